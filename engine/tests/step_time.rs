//! The step-time target on the real model: the engine times its own steps, and once it has
//! seen what a chunk costs, a prompt that arrives beside a decoding stream is prefilled in
//! chunks that keep each step within the target.

mod common;

use kvmesh_common::SamplingParams;
use kvmesh_engine::engine_config::EngineConfig;
use std::time::Duration;

/// The tokens of each step after a long prompt arrives beside a stream that is decoding.
fn steps_beside_a_decode(max_step_time: Option<Duration>) -> Vec<usize> {
    let mut e = common::engine(EngineConfig {
        max_step_time,
        ..EngineConfig::default()
    });
    let short = common::note_prompt("rivers")[..40].to_vec();
    e.add_request(1, short, SamplingParams::greedy(64), 0)
        .unwrap();
    // Its prefill chunk and a few decodes: what the engine learns steps cost from.
    for _ in 0..6 {
        e.step().unwrap();
    }
    e.add_request(
        2,
        common::note_prompt("mountains"),
        SamplingParams::greedy(4),
        0,
    )
    .unwrap();
    (0..4)
        .map(|_| {
            e.step().unwrap();
            e.last_step_tokens()
        })
        .collect()
}

#[test]
fn a_target_no_step_can_meet_leaves_each_step_one_block_of_prompt() {
    // No step of a real model takes a microsecond: every step gets the floor, one block
    // (16 tokens) of the prompt beside the one decode.
    let tight = steps_beside_a_decode(Some(Duration::from_micros(1)));
    assert_eq!(tight, vec![17; 4]);
    // Without a target the token budget (128) sizes the chunks.
    let untimed = steps_beside_a_decode(None);
    assert_eq!(untimed[0], 128, "{untimed:?}");
}

#[test]
fn the_engine_sums_what_its_steps_held_and_took() {
    let mut e = common::engine(EngineConfig::default());
    let prompt = common::note_prompt("rivers")[..40].to_vec();
    e.add_request(1, prompt, SamplingParams::greedy(64), 0)
        .unwrap();
    e.step().unwrap();
    let first = e.step_totals();
    // The whole prompt in one prefill chunk.
    assert_eq!(
        (
            first.steps,
            first.prefill_tokens,
            first.prefill_cached_tokens,
            first.decode_seqs
        ),
        (1, 40, 0, 0)
    );
    assert!(first.micros > 0, "a step of the real model takes time");
    for _ in 0..5 {
        e.step().unwrap();
    }
    let after = e.step_totals();
    // Five decodes at positions 40..45, each attending its position and all before it.
    assert_eq!((after.steps, after.prefill_tokens), (6, 40));
    assert_eq!(
        (after.decode_seqs, after.decode_context_tokens),
        (5, 41 + 42 + 43 + 44 + 45)
    );
    assert!(after.micros > first.micros);
    assert_eq!(e.steps_run(), after.steps);
}
