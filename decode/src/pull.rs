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

/// Estimates whether pulling blocks is faster than recomputing them, from the transfer and
/// prefill rates this node measured (priors until it has measured any).
#[derive(Clone, Debug)]
pub(crate) struct PullCost {
    transfer_bytes_per_s: f64,
    prefill_tokens_per_s: f64,
}

/// Weight of the newest measurement in the moving averages.
const EWMA: f64 = 0.2;
/// A pull's fixed cost: the export call's round trip and the holder finishing its step.
const PULL_SETUP: Duration = Duration::from_millis(5);

impl Default for PullCost {
    fn default() -> Self {
        // Conservative for a network (QUIC measures several GB/s on loopback) and about a
        // small model's prefill on a few CPU cores; measurements replace both quickly.
        PullCost {
            transfer_bytes_per_s: 500e6,
            prefill_tokens_per_s: 4_000.0,
        }
    }
}

impl PullCost {
    /// Pulling `bytes` beats prefilling `tokens` here.
    pub fn worth_pulling(&self, bytes: usize, tokens: usize) -> bool {
        let pull = PULL_SETUP.as_secs_f64() + bytes as f64 / self.transfer_bytes_per_s;
        let recompute = tokens as f64 / self.prefill_tokens_per_s;
        pull < recompute
    }

    /// A pull moved `bytes` in `elapsed` (from asking to having all of it).
    pub fn observe_pull(&mut self, bytes: u64, elapsed: Duration) {
        if let Some(rate) = rate(bytes as f64, elapsed) {
            self.transfer_bytes_per_s = ewma(self.transfer_bytes_per_s, rate);
        }
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

/// One pull in flight, and the request waiting for it (`R`: the worker's submission).
pub(crate) struct PendingPull<R> {
    pub request: R,
    pub request_id: RequestId,
    pub import: Import,
    pub incoming: IncomingTransfer,
    /// Blocks the holder says it sent, once its reply is in.
    pub sent: Option<usize>,
    pub started: Instant,
    pub deadline: Instant,
}

impl<R> PendingPull<R> {
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
        assert!(c.worth_pulling(62 * 368_640, 992));
        // A tiny pull is all setup cost.
        assert!(!c.worth_pulling(368_640, 16));
        // A very slow link loses, once measured.
        for _ in 0..50 {
            c.observe_pull(1_000_000, Duration::from_secs(1));
        }
        assert!(!c.worth_pulling(62 * 368_640, 992));
        // ... unless prefill is slower still.
        for _ in 0..50 {
            c.observe_step(100, Duration::from_secs(10));
        }
        assert!(c.worth_pulling(62 * 368_640, 992));
    }

    #[test]
    fn decode_sized_steps_and_empty_measurements_change_nothing() {
        let mut c = PullCost::default();
        let before = c.clone();
        c.observe_step(8, Duration::from_secs(100));
        c.observe_pull(0, Duration::from_secs(1));
        c.observe_pull(100, Duration::ZERO);
        assert_eq!(c.prefill_tokens_per_s, before.prefill_tokens_per_s);
        assert_eq!(c.transfer_bytes_per_s, before.transfer_bytes_per_s);
    }
}
