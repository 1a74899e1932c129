//! Structured-output constraints on the real SmolLM2 vocabulary: masks admit exactly the
//! tokens that keep the text in the language, driving a sequence by the mask alone (with or
//! without the tokens the grammar forces) ends in a complete sentence of it, forced tokens
//! are tokens the mask allows, and bad constraints are refused with a reason.

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

/// Generates under `constraint` by always taking the allowed token that `prefer(token, step)`
/// ranks first (a stand-in for a model's logits), until EOS or the grammar's end (or 400
/// tokens): the text. With `forced`, the tokens the grammar forces follow each drawn one
/// (each checked against the mask at its position).
fn drive(constraint: &Constraint, forced: bool, prefer: impl Fn(TokenId, u32) -> f32) -> String {
    let tok = tokenizer();
    let eos = tok.eos_token_id().unwrap();
    let mut seq = grammars().start(constraint).expect("compiles");
    let mut out = Vec::new();
    for step in 0..400 {
        let mut logits: Vec<f32> = (0..tok.vocab_size() as TokenId)
            .map(|t| prefer(t, step))
            .collect();
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
        if forced {
            for token in seq.forced_tokens() {
                let mut logits = vec![0.0; tok.vocab_size()];
                seq.mask(&mut logits).unwrap();
                assert!(
                    logits[token as usize].is_finite(),
                    "forced {token} is masked"
                );
                seq.accept(token).unwrap();
                out.push(token);
            }
        }
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
    let text = drive(&constraint, false, |t, _| {
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
fn a_schema_forces_its_keys_and_punctuation() {
    let tok = tokenizer();
    let schema = json!({
        "type": "object",
        "properties": {"customer_full_legal_name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["customer_full_legal_name", "age"],
        "additionalProperties": false
    });
    let mut seq = grammars()
        .start(&Constraint::JsonSchema { schema })
        .unwrap();
    seq.accept(tok.token_id("{").unwrap()).unwrap();
    let forced = seq.forced_tokens();
    let text = tok.decode(&forced, false);
    // The key and its separator; the string's opening quote may be left to a longer token.
    assert!(
        text.starts_with("\"customer_full_legal_name\":"),
        "{text:?}"
    );
    assert!(forced.len() >= 4, "{forced:?}");
    // Peeking does not follow them: they are still what comes next.
    assert_eq!(seq.forced_tokens(), forced);
    for &t in &forced {
        seq.accept(t).unwrap();
    }
    // Inside the string value: the model chooses.
    for t in tok.encode(" \"Ann", false).unwrap() {
        seq.accept(t).unwrap();
    }
    assert_eq!(seq.forced_tokens(), Vec::<TokenId>::new());
}

#[test]
fn the_mask_word_by_word_matches_the_allowed_set() {
    let tok = tokenizer();
    let mut seq = grammars()
        .start(&Constraint::Regex {
            pattern: "[a-f0-9]{4}".into(),
        })
        .unwrap();
    let allowed = seq.allowed_tokens().unwrap();
    // Padding rows past the vocabulary, as a model's output layer may have.
    let mut logits = vec![1.0; tok.vocab_size() + 45];
    allowed.apply(&mut logits);
    let finite = logits.iter().filter(|l| l.is_finite()).count();
    assert_eq!(finite, allowed.count());
    assert!(finite > 10 && finite < 2000, "{finite}");
    for (t, l) in logits.iter().enumerate() {
        assert_eq!(l.is_finite(), allowed.is_allowed(t as TokenId), "token {t}");
    }
}

#[test]
fn choices_regexes_and_grammars_constrain_the_text() {
    let options = vec!["red".to_string(), "green".into(), "blue".into()];
    let text = drive(
        &Constraint::Choice {
            options: options.clone(),
        },
        false,
        |t, _| -(t as f32),
    );
    assert!(options.contains(&text), "{text:?}");
    let text = drive(
        &Constraint::Regex {
            pattern: "[0-9]{3}-[a-z]{2}".into(),
        },
        false,
        |t, _| (t % 13) as f32,
    );
    assert!(regex_like(&text), "{text:?}");
    let lark = r#"start: "yes" | "no""#.to_string();
    let text = drive(&Constraint::Grammar { lark }, false, |t, _| t as f32);
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

/// A random JSON schema of the kinds products send: nested objects with required fields,
/// arrays with bounds, enums, bounded integers and numbers, bounded strings, booleans.
fn schema_strategy() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
    use proptest::prelude::*;
    let leaf = prop_oneof![
        (0i64..50, 0i64..50).prop_map(
            |(a, b)| json!({"type": "integer", "minimum": a.min(b), "maximum": a.max(b)})
        ),
        (-5.0f64..5.0).prop_map(|m| json!({"type": "number", "minimum": m.floor()})),
        (1u32..12).prop_map(|n| json!({"type": "string", "maxLength": n})),
        Just(json!({"type": "boolean"})),
        proptest::collection::btree_set("[a-z]{1,6}", 1..4)
            .prop_map(|s| json!({"enum": s.into_iter().collect::<Vec<_>>()})),
    ];
    leaf.prop_recursive(3, 12, 4, |inner| {
        prop_oneof![
            (inner.clone(), 0u32..2, 1u32..3).prop_map(|(items, min, extra)| {
                json!({"type": "array", "items": items, "minItems": min, "maxItems": min + extra})
            }),
            proptest::collection::btree_map("[a-z]{1,5}", inner, 1..4).prop_flat_map(|props| {
                let names: Vec<String> = props.keys().cloned().collect();
                proptest::sample::subsequence(names.clone(), 0..=names.len()).prop_map(
                    move |required| {
                        json!({"type": "object", "properties": props.clone(),
                               "required": required, "additionalProperties": false})
                    },
                )
            }),
        ]
    })
    .prop_map(|s| {
        if s["type"] == "object" {
            s
        } else {
            json!({"type": "object", "properties": {"value": s}, "required": ["value"],
                   "additionalProperties": false})
        }
    })
}

/// Whether `v` is valid against `schema` (the subset `schema_strategy` draws).
fn valid(schema: &serde_json::Value, v: &serde_json::Value) -> Result<(), String> {
    let fail = |why: &str| Err(format!("{v} against {schema}: {why}"));
    if let Some(options) = schema["enum"].as_array() {
        return if options.contains(v) {
            Ok(())
        } else {
            fail("not in the enum")
        };
    }
    match schema["type"].as_str().unwrap() {
        "integer" => {
            let Some(n) = v.as_i64() else {
                return fail("not an integer");
            };
            let (lo, hi) = (
                schema["minimum"].as_i64().unwrap(),
                schema["maximum"].as_i64().unwrap(),
            );
            if n < lo || n > hi {
                return fail("out of bounds");
            }
        }
        "number" => {
            let Some(n) = v.as_f64() else {
                return fail("not a number");
            };
            if n < schema["minimum"].as_f64().unwrap() {
                return fail("below the minimum");
            }
        }
        "string" => {
            let Some(s) = v.as_str() else {
                return fail("not a string");
            };
            if s.chars().count() as u64 > schema["maxLength"].as_u64().unwrap() {
                return fail("too long");
            }
        }
        "boolean" => {
            if !v.is_boolean() {
                return fail("not a boolean");
            }
        }
        "array" => {
            let Some(a) = v.as_array() else {
                return fail("not an array");
            };
            let n = a.len() as u64;
            if n < schema["minItems"].as_u64().unwrap() || n > schema["maxItems"].as_u64().unwrap()
            {
                return fail("wrong length");
            }
            for item in a {
                valid(&schema["items"], item)?;
            }
        }
        "object" => {
            let Some(o) = v.as_object() else {
                return fail("not an object");
            };
            let props = schema["properties"].as_object().unwrap();
            for r in schema["required"].as_array().unwrap() {
                if !o.contains_key(r.as_str().unwrap()) {
                    return fail("a required field is missing");
                }
            }
            for (k, x) in o {
                let Some(p) = props.get(k) else {
                    return fail("an extra field");
                };
                valid(p, x)?;
            }
        }
        other => return fail(&format!("unexpected type {other}")),
    }
    Ok(())
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 50, ..Default::default() })]

    /// Whatever the token preferences (random, so every branch of the schema gets taken),
    /// the mask leads to text that parses and validates against the schema, with or without
    /// the forced tokens.
    #[test]
    fn fifty_random_schemas_give_valid_json(
        schema in schema_strategy(),
        salt in 0u32..1_000_000,
        forced in proptest::bool::ANY,
    ) {
        let tok = tokenizer();
        let constraint = Constraint::JsonSchema { schema: schema.clone() };
        // A hash of (token, salt, step): a different arbitrary "model" per case and step.
        // Short tokens are favoured so that strings and numbers end and brackets close.
        let text = drive(&constraint, forced, |t, step| {
            let h = (t ^ salt ^ step.wrapping_mul(40_503)).wrapping_mul(2_654_435_761) >> 8;
            (h % 1000) as f32 / 1000.0 - tok.token_bytes(t).map_or(0.0, |b| b.len() as f32 * 0.3)
        });
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| proptest::test_runner::TestCaseError::fail(format!("{text:?}: {e}")))?;
        valid(&schema, &v).map_err(proptest::test_runner::TestCaseError::fail)?;
    }
}
