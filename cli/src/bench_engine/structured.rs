//! `kvmesh bench engine --structured`: what structured outputs cost and save, through the
//! engine (no HTTP), on engines that take one step each in turn, so that a shared machine's
//! noise falls on every variant alike.
//!
//! Cost: the same batch decodes free text, and under a JSON schema whose one string field
//! outlasts the run (every token drawn under a mask, none forced), with the masks computed
//! while the model runs and after it: the mean step time of each. Saving: the same batch
//! answers under a schema with long fixed keys with fast-forward on and off, greedily, to
//! the schema's end: steps and time.

use anyhow::Result;
use kvmesh_common::{Constraint, SamplingParams, TokenId};
use kvmesh_engine::engine_config::EngineConfig;
use kvmesh_engine::llama_runner::LlamaRunner;
use kvmesh_engine::llm_engine::LlmEngine;
use kvmesh_engine::Loaded;
use serde_json::json;
use std::time::{Duration, Instant};

/// Mean decode step time of one batch: free text, and under a JSON schema with the masks
/// computed during and after the forward pass.
pub struct MaskCost {
    pub batch: usize,
    pub free: Duration,
    pub during: Duration,
    pub after: Duration,
}

/// Steps and time for one batch to answer under a schema with long fixed keys.
pub struct FastForward {
    pub batch: usize,
    pub tokens: (usize, usize),
    pub steps: (usize, usize),
    pub time: (Duration, Duration),
}

fn long_string() -> Constraint {
    Constraint::JsonSchema {
        schema: json!({
            "type": "object",
            "properties": {"text": {"type": "string", "minLength": 100_000}},
            "required": ["text"]
        }),
    }
}

fn long_keys() -> Constraint {
    Constraint::JsonSchema {
        schema: json!({
            "type": "object",
            "properties": {
                "customer_full_legal_name": {"type": "string", "maxLength": 24},
                "customer_primary_email_address": {"type": "string", "maxLength": 24},
                "preferred_contact_method_for_notifications": {"enum": ["email", "phone", "post"]},
                "account_balance_in_euro_cents": {"type": "integer", "minimum": 0, "maximum": 100_000}
            },
            "required": [
                "customer_full_legal_name",
                "customer_primary_email_address",
                "preferred_contact_method_for_notifications",
                "account_balance_in_euro_cents"
            ],
            "additionalProperties": false
        }),
    }
}

/// An engine with `batch` sequences of `prompt` random tokens (the same ones in every
/// engine), each asked for `max_tokens` under `constraint`.
fn engine(
    loaded: &Loaded,
    batch: usize,
    prompt: usize,
    max_tokens: usize,
    constraint: Option<Constraint>,
    configure: impl FnOnce(&mut LlmEngine<LlamaRunner>),
) -> Result<LlmEngine<LlamaRunner>> {
    let config = EngineConfig {
        num_blocks: batch * (prompt + max_tokens).div_ceil(super::BLOCK_SIZE) + 1,
        max_num_batched_tokens: batch * prompt,
        max_num_seqs: batch,
        enable_prefix_caching: false,
        ..EngineConfig::default()
    };
    let mut engine = config.llama_engine(loaded)?;
    configure(&mut engine);
    for i in 0..batch {
        let params = SamplingParams {
            ignore_eos: true,
            constraint: constraint.clone(),
            ..SamplingParams::greedy(max_tokens as u32)
        };
        let tokens: Vec<TokenId> = super::random_tokens(prompt, 300 + i as u64);
        engine.add_request(i as u64, tokens, params, 0)?;
    }
    Ok(engine)
}

/// One engine's run under [`interleave`].
#[derive(Clone, Copy, Default)]
struct Run {
    time: Duration,
    /// The first step's (the prompts' prefill).
    prefill: Duration,
    steps: usize,
    tokens: usize,
}

impl Run {
    fn mean_decode_step(&self) -> Duration {
        (self.time - self.prefill) / (self.steps.max(2) - 1) as u32
    }
}

/// Steps each engine in turn until every one is done; the engine that goes first rotates.
fn interleave(engines: &mut [LlmEngine<LlamaRunner>]) -> Result<Vec<Run>> {
    let n = engines.len();
    let mut runs = vec![Run::default(); n];
    for round in 0.. {
        if !engines.iter().any(|e| e.has_work()) {
            break;
        }
        for k in 0..n {
            let (engine, run) = (&mut engines[(round + k) % n], &mut runs[(round + k) % n]);
            if !engine.has_work() {
                continue;
            }
            let start = Instant::now();
            let outputs = engine.step()?;
            let took = start.elapsed();
            if run.steps == 0 {
                run.prefill = took;
            }
            run.time += took;
            run.steps += 1;
            run.tokens += outputs.len();
        }
    }
    Ok(runs)
}

pub fn mask_cost(
    loaded: &Loaded,
    batch: usize,
    prompt: usize,
    tokens: usize,
    repeats: usize,
) -> Result<MaskCost> {
    let mut runs = Vec::new();
    for _ in 0..repeats.max(1) {
        let mut engines = [
            engine(loaded, batch, prompt, tokens, None, |_| {})?,
            engine(loaded, batch, prompt, tokens, Some(long_string()), |_| {})?,
            engine(loaded, batch, prompt, tokens, Some(long_string()), |e| {
                e.set_mask_overlap(false)
            })?,
        ];
        for e in &mut engines {
            e.set_fast_forward(false);
        }
        let r = interleave(&mut engines)?;
        runs.push([0, 1, 2].map(|i| r[i].mean_decode_step()));
    }
    let pick = |i: usize| super::median(runs.iter().map(|r| r[i]));
    Ok(MaskCost {
        batch,
        free: pick(0),
        during: pick(1),
        after: pick(2),
    })
}

pub fn fast_forward(
    loaded: &Loaded,
    batch: usize,
    prompt: usize,
    repeats: usize,
) -> Result<FastForward> {
    let mut runs = Vec::new();
    for _ in 0..repeats.max(1) {
        let mut engines = [
            engine(loaded, batch, prompt, 200, Some(long_keys()), |_| {})?,
            engine(loaded, batch, prompt, 200, Some(long_keys()), |e| {
                e.set_fast_forward(false)
            })?,
        ];
        runs.push(interleave(&mut engines)?);
    }
    let time = |i: usize| super::median(runs.iter().map(|r| r[i].time));
    let last = &runs[runs.len() - 1];
    Ok(FastForward {
        batch,
        tokens: (last[0].tokens, last[1].tokens),
        steps: (last[0].steps, last[1].steps),
        time: (time(0), time(1)),
    })
}
