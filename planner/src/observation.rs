//! What the mesh publishes and the planner reads: one snapshot of load, latency and counts.
//!
//! An observation carries no timestamp: the caller passes `now` to
//! [`Planner::observe`](crate::Planner::observe), so tests drive the planner in virtual time.

use std::time::Duration;

/// A latency distribution's two quantiles the planner reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LatencyQuantiles {
    pub p50: Duration,
    pub p99: Duration,
}

/// Engine steps a node measured: their shape and how long they took, one step or several
/// summed (a running mesh's nodes report their steps' totals, differenced between two
/// readings). The step-time model is linear, so a sum is as good a sample as a step. The SLO
/// policy refits its [`PerfModel`](crate::PerfModel) from these.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepSample {
    /// How many steps the sample sums.
    pub steps: u64,
    /// Tokens the step's prefill chunks computed.
    pub prefill_tokens: u64,
    /// Tokens of KV the prefill chunks read but did not compute (cached prefix).
    pub prefill_cached_tokens: u64,
    /// Sequences the step decoded one token for.
    pub decode_seqs: u64,
    /// Their total context, in tokens.
    pub decode_context_tokens: u64,
    pub duration: Duration,
}

impl Default for StepSample {
    /// One step that did nothing, in no time.
    fn default() -> Self {
        StepSample {
            steps: 1,
            prefill_tokens: 0,
            prefill_cached_tokens: 0,
            decode_seqs: 0,
            decode_context_tokens: 0,
            duration: Duration::ZERO,
        }
    }
}

/// A snapshot of the mesh, as published by its nodes and router.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Observation {
    /// Requests arriving per second (router).
    pub arrival_rate: f64,
    /// Mean prompt length of recent requests, in tokens.
    pub mean_prompt_tokens: f64,
    /// Mean output length of recent requests, in tokens.
    pub mean_output_tokens: f64,
    /// Share of prompt tokens served from a prefix cache, `0..=1`.
    pub prefix_hit_rate: f64,
    /// Prompt tokens waiting to be computed, one entry per prefill node.
    pub prefill_queued_tokens: Vec<u64>,
    /// Prompt tokens waiting to be computed, one entry per decode node: its local prefills
    /// (short prompts, prompts that found every prefill node busy, and every prompt while
    /// there is no prefill node).
    pub decode_queued_prompt_tokens: Vec<u64>,
    /// Sequences decoding, one entry per decode node.
    pub decode_running: Vec<u32>,
    /// Share of KV blocks in use, `0..=1`, one entry per decode node.
    pub decode_kv_usage: Vec<f64>,
    /// Time to first token, if any request finished its prefill recently.
    pub ttft: Option<LatencyQuantiles>,
    /// Inter-token latency, if any token was generated recently.
    pub itl: Option<LatencyQuantiles>,
    /// Prefill nodes alive now (from discovery), whoever started them.
    pub prefill_nodes: u32,
    /// Decode nodes alive now (from discovery), whoever started them.
    pub decode_nodes: u32,
    /// Engine steps measured since the last observation.
    pub steps: Vec<StepSample>,
}

impl Observation {
    /// Prompt tokens queued on every node, prefill and decode.
    pub fn queued_prompt_tokens(&self) -> u64 {
        self.prefill_queued_tokens.iter().sum::<u64>()
            + self.decode_queued_prompt_tokens.iter().sum::<u64>()
    }

    /// The actual node count of a role.
    pub fn nodes(&self, role: crate::Role) -> u32 {
        match role {
            crate::Role::Prefill => self.prefill_nodes,
            crate::Role::Decode => self.decode_nodes,
        }
    }
}
