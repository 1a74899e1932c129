//! A migrated request (`LlmEngine::resume_request`) continues exactly where the worker that
//! failed stopped: the same next tokens and the same text, with nothing repeated or skipped,
//! for greedy and for seeded sampling, with a stop string (held back across the cut) in play.

mod common;

use common::{model, run_alone};
use kvmesh_common::{FinishReason, SamplingParams};
use kvmesh_engine::engine_config::EngineConfig;
use kvmesh_engine::llama_runner::LlamaRunner;
use kvmesh_engine::llm_engine::LlmEngine;

fn check_resumes_at_every_cut(params: SamplingParams) -> FinishReason {
    let (_, tokenizer) = model();
    let prompt = tokenizer
        .encode("Write a short poem about the sea and the sky.", false)
        .expect("encodes");
    let (tokens, texts, reason) = run_alone(&prompt, &[], &params);
    assert!(
        tokens.len() >= 8,
        "too short a run to cut: {:?}",
        texts.concat()
    );
    for cut in [1, tokens.len() / 2, tokens.len() - 1] {
        let (rest, rest_texts, rest_reason) = run_alone(&prompt, &tokens[..cut], &params);
        assert_eq!(rest, tokens[cut..], "tokens after a cut at {cut}");
        assert_eq!(
            rest_texts.concat(),
            texts[cut..].concat(),
            "text after a cut at {cut}"
        );
        assert_eq!(rest_reason, reason);
    }
    reason
}

#[test]
fn a_resumed_greedy_request_continues_without_gap_or_repeat() {
    let reason = check_resumes_at_every_cut(SamplingParams {
        stop: vec![" sea of".into()],
        ignore_eos: true,
        ..SamplingParams::greedy(20)
    });
    assert_eq!(reason, FinishReason::Stop, "the stop string never came up");
}

#[test]
fn a_resumed_seeded_request_continues_the_same_random_stream() {
    check_resumes_at_every_cut(SamplingParams {
        temperature: 0.9,
        seed: Some(11),
        ignore_eos: true,
        ..SamplingParams::greedy(20)
    });
}

#[test]
fn resumed_tokens_must_exist_and_fit_the_context() {
    let mut e: LlmEngine<LlamaRunner> = common::engine(EngineConfig {
        num_blocks: 64,
        ..EngineConfig::default()
    });
    let bad = e.resume_request(0, vec![1, 2], vec![u32::MAX], SamplingParams::greedy(4), 0);
    assert!(
        bad.is_err(),
        "an out-of-vocabulary resumed token was accepted"
    );
    let long = vec![5; 64 * 16];
    let too_long = e.resume_request(1, vec![1], long, SamplingParams::greedy(4), 0);
    assert!(
        too_long.is_err(),
        "a resume longer than the pool was accepted"
    );
}
