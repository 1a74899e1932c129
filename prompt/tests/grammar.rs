//! Structured-output constraints on the real SmolLM2 vocabulary: masks admit exactly the
//! tokens that keep the text in the language, driving a sequence by the mask alone ends in
//! a complete sentence of it, and bad constraints are refused with a reason.

use kvmesh_common::{Constraint, TokenId};
use kvmesh_prompt::gguf::GgufFile;
use kvmesh_prompt::grammar::Grammars;
use kvmesh_prompt::tokenizer::Tokenizer;
use serde_json::json;
use std::sync::{Arc, OnceLock};

fn tokenizer() -> Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        let path = kvmesh_prompt::model_fetch::fetched_model().unwrap_or_else(|e| panic!("{e}"));
        let gguf = GgufFile::open(&path).expect("open model");
        Arc::new(Tokenizer::from_gguf(&gguf).expect("tokenizer"))
    })
    .clone()
}

fn grammars() -> &'static Grammars {
    static G: OnceLock<Grammars> = OnceLock::new();
    G.get_or_init(|| Grammars::new(tokenizer()).expect("grammars"))
}

/// Generates under `constraint` by always taking the allowed token that `prefer` ranks first
/// (a stand-in for a model's logits), until EOS or the grammar's end: the text.
fn drive(constraint: &Constraint, prefer: impl Fn(TokenId) -> f32) -> String {
    let tok = tokenizer();
    let eos = tok.eos_token_id().unwrap();
    let mut seq = grammars().start(constraint).expect("compiles");
    let mut out = Vec::new();
    for _ in 0..200 {
        let mut logits: Vec<f32> = (0..tok.vocab_size() as TokenId).map(&prefer).collect();
        seq.mask(&mut logits).unwrap();
        let (best, _) = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap();
        assert!(logits[best].is_finite(), "the mask allows nothing");
        let token = best as TokenId;
        seq.accept(token).unwrap();
        if token == eos {
            break;
        }
        out.push(token);
        if seq.is_finished() {
            break;
        }
    }
    tok.decode(&out, true)
}

#[test]
fn a_json_schema_admits_only_valid_json() {
    let schema = json!({
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": false
    });
    let constraint = Constraint::JsonSchema { schema };
    // Prefer long tokens with letters: the grammar must still close the object.
    let tok = tokenizer();
    let text = drive(&constraint, |t| {
        tok.token_bytes(t).map_or(0.0, |b| b.len() as f32 * 0.01) + (t % 97) as f32 * 0.001
    });
    let v: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(
        v["name"].is_string() && v["name"].as_str().unwrap().chars().count() <= 8,
        "{v}"
    );
    let age = v["age"].as_i64().unwrap();
    assert!((0..=120).contains(&age), "{v}");
    assert_eq!(v.as_object().unwrap().len(), 2, "{v}");
}

#[test]
fn the_first_mask_of_a_json_object_allows_a_brace_and_no_words() {
    let tok = tokenizer();
    let mut seq = grammars().start(&Constraint::JsonObject).unwrap();
    let mut logits = vec![0.0; tok.vocab_size()];
    seq.mask(&mut logits).unwrap();
    let allowed = |s: &str| logits[tok.token_id(s).unwrap() as usize].is_finite();
    assert!(allowed("{"));
    assert!(!allowed("hello"));
    let eos = tok.eos_token_id().unwrap() as usize;
    assert!(!logits[eos].is_finite(), "EOS before any JSON");
    // Special tokens are never text.
    let im_end = tok.token_id("<|im_end|>").unwrap() as usize;
    assert!(!logits[im_end].is_finite() || im_end == eos);
}

#[test]
fn choices_regexes_and_grammars_constrain_the_text() {
    let options = vec!["red".to_string(), "green".into(), "blue".into()];
    let text = drive(
        &Constraint::Choice {
            options: options.clone(),
        },
        |t| -(t as f32),
    );
    assert!(options.contains(&text), "{text:?}");
    let text = drive(
        &Constraint::Regex {
            pattern: "[0-9]{3}-[a-z]{2}".into(),
        },
        |t| (t % 13) as f32,
    );
    assert!(regex_like(&text), "{text:?}");
    let lark = r#"start: "yes" | "no""#.to_string();
    let text = drive(&Constraint::Grammar { lark }, |t| t as f32);
    assert!(text == "yes" || text == "no", "{text:?}");
}

fn regex_like(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 6
        && b[..3].iter().all(u8::is_ascii_digit)
        && b[3] == b'-'
        && b[4..].iter().all(u8::is_ascii_lowercase)
}

#[test]
fn bad_constraints_are_refused_with_a_reason() {
    let bad = [
        Constraint::JsonSchema {
            schema: json!({"type": "no-such-type"}),
        },
        Constraint::Regex {
            pattern: "(unclosed".into(),
        },
        Constraint::Grammar {
            lark: "start: undefined_rule".into(),
        },
        Constraint::Choice { options: vec![] },
    ];
    for c in bad {
        let e = grammars().start(&c).unwrap_err();
        assert!(!e.0.is_empty(), "{c:?}");
    }
}
