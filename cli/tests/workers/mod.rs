//! Shared by the tests of the workers (decode, and prefill with decode): the real model
//! (loaded once), engines and prompts.

#![allow(dead_code)]

use kvmesh_common::{GenerateEvent, GenerateRequest, RequestId, SamplingParams, TokenId, Usage};
use kvmesh_decode::EventReceiver;
use kvmesh_engine::engine_config::EngineConfig;
use kvmesh_engine::llama_runner::LlamaRunner;
use kvmesh_engine::llm_engine::LlmEngine;
use kvmesh_engine::Loaded;
use std::sync::OnceLock;

/// The default model, loaded once per test binary.
pub fn loaded() -> &'static Loaded {
    static MODEL: OnceLock<Loaded> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = kvmesh_prompt::model_fetch::fetched_model().unwrap_or_else(|e| panic!("{e}"));
        kvmesh_engine::load(&path).expect("model loads")
    })
}

/// Small pools and a modest step budget, so long prompts prefill in several chunks.
pub fn engine_config() -> EngineConfig {
    EngineConfig {
        num_blocks: 256,
        max_model_len: Some(2048),
        ..EngineConfig::default()
    }
}

/// Every test worker gets one of these engines; the metrics recorder goes in first, so the
/// workers' metric handles record (the tests read them).
pub fn engine() -> LlmEngine<LlamaRunner> {
    kvmesh_router::metrics_exporter();
    engine_config().llama_engine(loaded()).unwrap()
}

const TEXT: &str = "The history of computing is a story of abstraction. Early machines were \
    programmed by rewiring panels; then came stored programs, assemblers, compilers and \
    operating systems, each hiding the layer below. Networks joined the machines, and \
    distributed systems learned to survive the failure of any one of them. Today a single \
    request to a language model may touch a router, a prefill node that reads the prompt, \
    and a decode node that writes the answer one token at a time, while a key-value cache \
    moves between them over the network. Good engineering keeps each of those parts small, \
    testable and honest about its failures.";

/// A prompt of `len` real tokens, different for each `seed`.
pub fn prompt(seed: usize, len: usize) -> Vec<TokenId> {
    let base = loaded().tokenizer.encode(TEXT, false).unwrap();
    (0..len)
        .map(|i| base[(seed * 17 + i) % base.len()])
        .collect()
}

pub fn request(id: u64, prompt: Vec<TokenId>, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        request_id: RequestId(id),
        prompt,
        params: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(max_tokens)
        },
        resume: Vec::new(),
    }
}

/// What a lone engine generates for `request`: the reference every path must match.
pub fn reference(request: &GenerateRequest) -> Vec<TokenId> {
    let mut e = engine();
    e.add_request(0, request.prompt.clone(), request.params.clone(), 0)
        .unwrap();
    let mut tokens = Vec::new();
    while e.has_work() {
        for out in e.step().unwrap() {
            tokens.extend(out.sampled.map(|s| s.token));
        }
    }
    tokens
}

/// Reads a stream to its end: the tokens and the `Finished` usage (panics on `Error`).
pub fn collect(mut rx: EventReceiver) -> (Vec<TokenId>, String, Usage) {
    let mut tokens = Vec::new();
    let mut text = String::new();
    loop {
        match rx.blocking_recv().expect("the stream ends with Finished") {
            GenerateEvent::Token(t) => {
                tokens.push(t.token);
                text.push_str(&t.text);
            }
            GenerateEvent::Finished { text: t, usage, .. } => {
                text.push_str(&t);
                return (tokens, text, usage);
            }
            GenerateEvent::Error(e) => panic!("stream failed: {e}"),
        }
    }
}

/// Waits (bounded) until the worker reports no request and no KV block in use.
pub fn wait_until_idle(load: impl Fn() -> kvmesh_common::LoadReport, within: std::time::Duration) {
    let deadline = std::time::Instant::now() + within;
    loop {
        let l = load();
        if l.running == 0 && l.waiting == 0 && l.kv_blocks_used == 0 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "worker still busy: {l:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// A worker's counter `name` (process-wide metrics, told apart by node).
pub fn counter(name: &str, node: kvmesh_common::NodeId) -> u64 {
    let scrape = kvmesh_router::metrics_exporter().render();
    kvmesh_common::metrics::scraped_sum(&scrape, name, &[("node", &node.to_string())]) as u64
}

/// Remote prefills whose KV the decode worker `node` received whole (from its metrics).
pub fn transfers_completed(node: kvmesh_common::NodeId) -> u64 {
    let node = node.to_string();
    let labels = [("node", &node[..]), ("role", "decode")];
    let scrape = kvmesh_router::metrics_exporter().render();
    let count = format!("{}_count", kvmesh_common::metrics::TRANSFER_SECONDS);
    kvmesh_common::metrics::scraped_sum(&scrape, &count, &labels) as u64
}
