//! Shared by the engine's integration tests: the real model (loaded once) and the golden data.

#![allow(dead_code)]

use kvmesh_engine::model::LlamaModel;
use kvmesh_prompt::tokenizer::Tokenizer;
use std::sync::{Arc, OnceLock};

/// The golden outputs recorded from llama.cpp (`data/golden/`, bundled in the repository).
pub fn golden() -> &'static serde_json::Value {
    static GOLDEN: OnceLock<serde_json::Value> = OnceLock::new();
    GOLDEN.get_or_init(|| {
        let text = include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../data/golden/smollm2_golden.json"
        ));
        serde_json::from_str(text).expect("golden file is JSON")
    })
}

/// The default model, loaded once per test binary.
pub fn model() -> &'static (Arc<LlamaModel>, Arc<Tokenizer>) {
    static MODEL: OnceLock<(Arc<LlamaModel>, Arc<Tokenizer>)> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = kvmesh_prompt::model_fetch::fetched_model().unwrap_or_else(|e| panic!("{e}"));
        let loaded = kvmesh_engine::load(&path).expect("model loads");
        (loaded.model, loaded.tokenizer)
    })
}

/// An engine over the default model with `config`'s KV pool.
pub fn engine(
    config: kvmesh_engine::engine_config::EngineConfig,
) -> kvmesh_engine::llm_engine::LlmEngine<kvmesh_engine::llama_runner::LlamaRunner> {
    let (m, tokenizer) = model();
    let loaded = kvmesh_engine::Loaded {
        model: m.clone(),
        tokenizer: tokenizer.clone(),
        fingerprint: kvmesh_common::ModelFingerprint(1),
    };
    config.llama_engine(&loaded).expect("engine")
}

/// A prompt of about 200 tokens: a note about `topic` repeated, then a request.
pub fn note_prompt(topic: &str) -> Vec<kvmesh_common::TokenId> {
    let (_, tokenizer) = model();
    let text = format!("Here is a note about {topic}, written at some length. ").repeat(14)
        + "Now summarize it.";
    tokenizer.encode(&text, false).expect("encodes")
}

/// Runs `prompt` greedily for 8 tokens: the tokens and the request's cached prompt tokens.
pub fn run<R: kvmesh_engine::runner::ModelRunner>(
    e: &mut kvmesh_engine::llm_engine::LlmEngine<R>,
    id: u64,
    prompt: &[kvmesh_common::TokenId],
) -> (Vec<kvmesh_common::TokenId>, usize) {
    e.add_request(
        id,
        prompt.to_vec(),
        kvmesh_common::SamplingParams::greedy(8),
        0,
    )
    .expect("accepted");
    let (mut tokens, mut cached) = (Vec::new(), 0);
    loop {
        for out in e.step().expect("step") {
            cached = out.cached_tokens.unwrap_or(cached);
            tokens.push(out.sampled.expect("a token").token);
            if out.finish.is_some() {
                return (tokens, cached);
            }
        }
    }
}

/// Runs one request alone on a 64-block engine, from its start or resumed after `generated`
/// (a migration): every token, the text each one released, and how it ended.
pub fn run_alone(
    prompt: &[kvmesh_common::TokenId],
    generated: &[kvmesh_common::TokenId],
    params: &kvmesh_common::SamplingParams,
) -> (
    Vec<kvmesh_common::TokenId>,
    Vec<String>,
    kvmesh_common::FinishReason,
) {
    let mut e = engine(kvmesh_engine::engine_config::EngineConfig {
        num_blocks: 64,
        ..Default::default()
    });
    if generated.is_empty() {
        e.add_request(0, prompt.to_vec(), params.clone(), 0)
    } else {
        e.resume_request(0, prompt.to_vec(), generated.to_vec(), params.clone(), 0)
    }
    .expect("accepted");
    let (mut tokens, mut texts) = (Vec::new(), Vec::new());
    loop {
        for out in e.step().expect("step") {
            tokens.push(out.sampled.expect("a token").token);
            texts.push(out.text);
            if let Some(reason) = out.finish {
                return (tokens, texts, reason);
            }
        }
    }
}
