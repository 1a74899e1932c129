//! The host-memory tier behind the prefix cache: a prompt whose blocks the pool evicted (to
//! make room for another) is served from host memory when it comes back, with exactly the
//! output it had when computed from scratch; without the tier it is recomputed.

mod common;

use common::model;
use kvmesh_common::{SamplingParams, TokenId};
use kvmesh_engine::engine_config::EngineConfig;
use kvmesh_engine::llama_runner::LlamaRunner;
use kvmesh_engine::llm_engine::LlmEngine;
use kvmesh_engine::Loaded;

/// 20 blocks of 16 tokens: two prompts of about 190 tokens cannot both stay cached.
fn engine(host_tier_blocks: usize) -> LlmEngine<LlamaRunner> {
    let (m, tokenizer) = model();
    let loaded = Loaded {
        model: m.clone(),
        tokenizer: tokenizer.clone(),
        fingerprint: kvmesh_common::ModelFingerprint(1),
    };
    EngineConfig {
        num_blocks: 20,
        host_tier_blocks,
        ..EngineConfig::default()
    }
    .llama_engine(&loaded)
    .expect("engine")
}

fn prompt(topic: &str) -> Vec<TokenId> {
    let (_, tokenizer) = model();
    let text = format!("Here is a note about {topic}, written at some length. ").repeat(14)
        + "Now summarize it.";
    let ids = tokenizer.encode(&text, false).expect("encodes");
    assert!(ids.len() > 150 && ids.len() < 250, "{} tokens", ids.len());
    ids
}

/// Greedy tokens and the request's cached prompt tokens.
fn run(e: &mut LlmEngine<LlamaRunner>, id: u64, prompt: &[TokenId]) -> (Vec<TokenId>, usize) {
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: 8,
        ..SamplingParams::default()
    };
    e.add_request(id, prompt.to_vec(), params, 0)
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

#[test]
fn an_evicted_prefix_comes_back_from_host_memory_with_the_same_output() {
    let (rivers, owls) = (prompt("rivers"), prompt("owls"));
    let mut e = engine(64);
    let (first, cached) = run(&mut e, 1, &rivers);
    assert_eq!(cached, 0);
    // The second prompt needs blocks that only evicting the first one's can give.
    run(&mut e, 2, &owls);
    assert!(e.host_tier_blocks() > 0, "nothing was offloaded");
    let (again, cached) = run(&mut e, 3, &rivers);
    let whole_blocks = (rivers.len() - 1) / 16 * 16;
    assert!(
        cached >= whole_blocks / 2,
        "only {cached} of {whole_blocks} tokens came from the cache"
    );
    assert_eq!(again, first, "the promoted KV changed the output");

    // Without the tier the same sequence of requests recomputes.
    let mut e = engine(0);
    run(&mut e, 1, &rivers);
    run(&mut e, 2, &owls);
    let (recomputed, cached_without) = run(&mut e, 3, &rivers);
    assert_eq!(recomputed, first);
    assert!(
        cached_without < cached,
        "the tier made no difference ({cached_without} vs {cached} cached tokens)"
    );
}
