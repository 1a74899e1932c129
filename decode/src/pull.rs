//! Pulling a prompt's cached prefix from another node: the decode worker's side.
//!
//! The router names a holder when another node has more of the prompt cached than this one
//! (`KvHolder`). If [`PullCost`] says moving those blocks beats recomputing them, the worker
//! reserves blocks for them (`LlmEngine::reserve_import`) and asks the holder to push their KV
//! (`KvExporter::export`); the request waits, outside the engine, until every layer of the
//! blocks the holder had arrived intact, its reply came, or the pull timed out. Then the
//! blocks that arrived become ordinary prefix-cache entries and the request is queued as
//! usual, so whatever was not pulled is prefilled as it would have been (here or on a
//! prefill node). A failed pull costs only the wait: the request recomputes.

use crate::incoming::IncomingTransfer;
use crate::worker::Submission;
use kvmesh_common::RequestId;
use kvmesh_engine::scheduler::Import;
use kvmesh_prefill::ExportSource;
use std::time::{Duration, Instant};

/// Where to pull a request's prefix from: `source` holds its first `blocks` prompt blocks.
#[derive(Clone, Debug)]
pub struct KvPull {
    pub source: ExportSource,
    pub blocks: usize,
}

/// Estimates whether pulling blocks is faster than recomputing them: a pull costs a latency
/// (the call's round trip, and the wait for the holder to finish its current engine step,
/// which on a busy node dominates) plus its bytes at the link's rate; a recompute costs its
/// tokens at this node's prefill rate. Latency and prefill rate are measured as the node
/// works; the link's rate is a conservative prior (the latency absorbs any shortfall).
#[derive(Clone, Debug)]
pub(crate) struct PullCost {
    latency_s: f64,
    prefill_tokens_per_s: f64,
}

/// Weight of the newest measurement in the moving averages.
const EWMA: f64 = 0.2;
/// Bytes per second assumed for the KV transport (QUIC measures several GB/s on loopback).
const LINK_BYTES_PER_S: f64 = 1e9;

impl Default for PullCost {
    fn default() -> Self {
        // About a small model's prefill on a few CPU cores, and an idle holder next door.
        PullCost {
            latency_s: 0.005,
            prefill_tokens_per_s: 4_000.0,
        }
    }
}

impl PullCost {
    /// Pulling `bytes` beats prefilling `tokens` here.
    pub fn worth_pulling(&self, bytes: usize, tokens: usize) -> bool {
        let pull = self.latency_s + bytes as f64 / LINK_BYTES_PER_S;
        let recompute = tokens as f64 / self.prefill_tokens_per_s;
        pull < recompute
    }

    /// A pull moved `bytes` in `elapsed` (from asking to having all of it).
    pub fn observe_pull(&mut self, bytes: u64, elapsed: Duration) {
        let latency = (elapsed.as_secs_f64() - bytes as f64 / LINK_BYTES_PER_S).max(0.0);
        self.latency_s = ewma(self.latency_s, latency);
    }

    /// A pull that failed or timed out after `elapsed`: as slow as that, at least.
    pub fn observe_failed_pull(&mut self, elapsed: Duration) {
        self.latency_s = ewma(self.latency_s, elapsed.as_secs_f64());
    }

    /// A step computed `tokens` tokens in `elapsed`; only prefill-sized steps say anything
    /// about the prefill rate (a decode step of a few tokens is bound by weights, not tokens).
    pub fn observe_step(&mut self, tokens: usize, elapsed: Duration) {
        const MIN_PREFILL_TOKENS: usize = 64;
        if tokens < MIN_PREFILL_TOKENS {
            return;
        }
        if let Some(rate) = rate(tokens as f64, elapsed) {
            self.prefill_tokens_per_s = ewma(self.prefill_tokens_per_s, rate);
        }
    }
}

fn rate(amount: f64, elapsed: Duration) -> Option<f64> {
    let s = elapsed.as_secs_f64();
    (s > 0.0 && amount > 0.0).then(|| amount / s)
}

fn ewma(old: f64, new: f64) -> f64 {
    old + EWMA * (new - old)
}

/// One pull in flight, and the request waiting for it.
pub(crate) struct PendingPull {
    pub request: Submission,
    pub import: Import,
    pub incoming: IncomingTransfer,
    /// Blocks the holder says it sent, once its reply is in.
    pub sent: Option<usize>,
    pub started: Instant,
    pub deadline: Instant,
}

impl PendingPull {
    pub fn request_id(&self) -> RequestId {
        self.request.request.request_id
    }

    /// The holder replied and every layer of the blocks it sent is here.
    pub fn is_complete(&self) -> bool {
        self.sent.is_some_and(|n| self.incoming.is_complete_upto(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pulls_win_when_moving_bytes_is_faster_than_computing_tokens() {
        let mut c = PullCost::default();
        // 62 blocks of SmolLM2 KV (368,640 bytes each) against their 992 tokens.
        let (bytes, tokens) = (62 * 368_640, 992);
        assert!(c.worth_pulling(bytes, tokens));
        // A tiny pull is all latency.
        assert!(!c.worth_pulling(368_640, 16));
        // Holders that keep the puller waiting (long steps) make pulls lose, once measured.
        for _ in 0..30 {
            c.observe_pull(bytes as u64, Duration::from_millis(900));
        }
        assert!(!c.worth_pulling(bytes, tokens));
        // ... unless prefill is slower still.
        for _ in 0..30 {
            c.observe_step(100, Duration::from_secs(1));
        }
        assert!(c.worth_pulling(bytes, tokens));
        // Failures count as slow pulls.
        let mut c = PullCost::default();
        for _ in 0..30 {
            c.observe_failed_pull(Duration::from_secs(2));
        }
        assert!(!c.worth_pulling(bytes, tokens));
    }

    #[test]
    fn decode_sized_and_empty_steps_say_nothing_of_the_prefill_rate() {
        let mut c = PullCost::default();
        let before = c.clone();
        c.observe_step(8, Duration::from_secs(100));
        c.observe_step(100, Duration::ZERO);
        assert_eq!(c.prefill_tokens_per_s, before.prefill_tokens_per_s);
    }
}
