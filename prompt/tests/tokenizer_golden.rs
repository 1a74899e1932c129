//! The tokenizer, chat template and incremental detokenizer on the real SmolLM2 GGUF,
//! against ids produced by llama.cpp (data/golden/smollm2_golden.json).

use std::path::PathBuf;
use std::sync::OnceLock;

use kvmesh_prompt::chat_template::{ChatMessage, ChatTemplate};
use kvmesh_prompt::detokenizer::IncrementalDetokenizer;
use kvmesh_prompt::gguf::GgufFile;
use kvmesh_prompt::tokenizer::Tokenizer;
use proptest::prelude::*;
use serde_json::Value;

fn model_path() -> PathBuf {
    kvmesh_prompt::model_fetch::fetched_model().unwrap_or_else(|e| panic!("{e}"))
}

fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let gguf = GgufFile::open(&model_path()).expect("open model");
        Tokenizer::from_gguf(&gguf).expect("tokenizer from GGUF metadata")
    })
}

fn golden() -> &'static Value {
    static GOLDEN: OnceLock<Value> = OnceLock::new();
    GOLDEN.get_or_init(|| {
        let path = PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../data/golden/smollm2_golden.json"
        ));
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        serde_json::from_str(&text).expect("golden json")
    })
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

#[test]
fn golden_strings_encode_to_llama_cpp_ids_and_round_trip() {
    let tok = tokenizer();
    let cases = golden()["tokenizer"].as_array().expect("tokenizer cases");
    assert!(!cases.is_empty());
    for case in cases {
        let text = case["text"].as_str().expect("text");
        let want = ids(&case["ids"]);
        let got = tok.encode(text, true).expect("encode");
        assert_eq!(got, want, "encoding {text:?}");
        assert_eq!(tok.decode(&got, false), text, "decoding {text:?}");
    }
}

#[test]
fn generation_prompts_encode_to_golden_prompt_ids() {
    let tok = tokenizer();
    for case in golden()["generation"].as_array().expect("generation cases") {
        let prompt = case["prompt"].as_str().expect("prompt");
        let want = ids(&case["prompt_ids"]);
        assert_eq!(tok.encode(prompt, true).unwrap(), want, "prompt {prompt:?}");
        assert_eq!(tok.decode(&want, false), prompt);
    }
}

#[test]
fn special_ids_and_vocab_match_the_model() {
    let tok = tokenizer();
    let g = golden();
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(
        tok.bos_token_id(),
        Some(g["bos_id"].as_u64().unwrap() as u32)
    );
    assert_eq!(
        tok.eos_token_id(),
        Some(g["eos_id"].as_u64().unwrap() as u32)
    );
    assert_eq!(tok.token_id("<|im_end|>"), Some(2));
    assert!(tok.is_special(1) && tok.is_special(2) && !tok.is_special(28));
    assert_eq!(tok.special_ids().len(), 17);
    assert_eq!(tok.token_bytes(216), Some(&b" "[..]));
    assert_eq!(tok.token_bytes(49152), None);
    // Skipping specials drops the control tokens' text only.
    let chat = tok.encode("<|im_start|>user\nHi<|im_end|>", true).unwrap();
    assert_eq!(tok.decode(&chat, true), "user\nHi");
}

#[test]
fn without_parse_special_marker_text_is_plain_text() {
    let tok = tokenizer();
    let text = "<|im_start|>user";
    let ids = tok.encode(text, false).unwrap();
    assert!(!ids.contains(&1), "{ids:?}");
    assert!(ids.iter().all(|&id| !tok.is_special(id)));
    assert_eq!(tok.decode(&ids, true), text);
}

#[test]
fn chat_template_renders_the_golden_prompt() {
    let tok = tokenizer();
    let template = ChatTemplate::from_tokenizer(tok).expect("model has a chat template");
    let want = golden()["generation"][2]["prompt"].as_str().unwrap();
    let messages = [
        ChatMessage::new(
            "system",
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
        ),
        ChatMessage::new("user", "What is the capital of France?"),
    ];
    assert_eq!(template.render(&messages, true).unwrap(), want);
    // SmolLM2's template adds that same system prompt when none is given.
    assert_eq!(template.render(&messages[1..], true).unwrap(), want);
    let ids = tok.encode(want, true).unwrap();
    assert_eq!(ids, self::ids(&golden()["generation"][2]["prompt_ids"]));
}

/// Ids that decode to one byte >= 0x80: pieces of multi-byte characters.
fn byte_piece_ids() -> &'static Vec<u32> {
    static IDS: OnceLock<Vec<u32>> = OnceLock::new();
    IDS.get_or_init(|| {
        let tok = tokenizer();
        (0..tok.vocab_size() as u32)
            .filter(|&id| matches!(tok.token_bytes(id), Some([b]) if *b >= 0x80))
            .collect()
    })
}

fn id_strategy() -> impl Strategy<Value = u32> {
    let emoji = tokenizer().encode("😀🎉 日本語 naïve", false).unwrap();
    prop_oneof![
        3 => 0u32..49152,
        3 => prop::sample::select(byte_piece_ids().clone()),
        2 => prop::sample::select(emoji),
        1 => 0u32..17,
    ]
}

fn stream(d: &mut IncrementalDetokenizer, ids: &[u32]) -> String {
    let tok = tokenizer();
    let mut out = String::new();
    for &id in ids {
        out += &d.push(tok, id);
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn streamed_pieces_concatenate_to_the_full_decode(
        ids in prop::collection::vec(id_strategy(), 0..40),
        keep_special in any::<bool>(),
    ) {
        let tok = tokenizer();
        let mut d = IncrementalDetokenizer::with_options(tok, &[], !keep_special);
        let mut text = stream(&mut d, &ids);
        text += &d.finish();
        prop_assert_eq!(text, tok.decode(&ids, !keep_special));
    }

    #[test]
    fn starting_after_a_prompt_continues_its_text(
        ids in prop::collection::vec(id_strategy(), 0..40),
        split in any::<prop::sample::Index>(),
    ) {
        let tok = tokenizer();
        let at = split.index(ids.len() + 1);
        let (prompt, generated) = ids.split_at(at);
        // The prompt's complete characters, as a detokenizer over the prompt emits them.
        let mut over_prompt = IncrementalDetokenizer::new(tok, &[]);
        let before = stream(&mut over_prompt, prompt);
        let mut d = IncrementalDetokenizer::new(tok, prompt);
        let mut after = stream(&mut d, generated);
        after += &d.finish();
        prop_assert_eq!(before + &after, tok.decode(&ids, true));
    }
}

#[test]
fn emoji_split_across_byte_tokens_is_held_back() {
    let tok = tokenizer();
    let ids = tok.encode("😀", false).unwrap();
    assert!(
        ids.len() > 1,
        "expected the emoji to need several tokens: {ids:?}"
    );
    let mut d = IncrementalDetokenizer::new(tok, &[]);
    let pieces: Vec<String> = ids.iter().map(|&id| d.push(tok, id)).collect();
    assert!(
        pieces[..pieces.len() - 1].iter().all(String::is_empty),
        "{pieces:?}"
    );
    assert_eq!(pieces.last().unwrap(), "😀");
    assert!(!d.has_pending());
    // A stream cut inside the character ends with one replacement character.
    let mut d = IncrementalDetokenizer::new(tok, &[]);
    assert_eq!(d.push(tok, ids[0]), "");
    assert_eq!(d.finish(), "\u{FFFD}");
}
