//! Pulling a prompt's cached prefix from another node: the puller's side, shared by the
//! decode and the prefill worker.
//!
//! Someone names a holder (the router, for a decode worker; the destination of the KV, for
//! a prefill worker), with how many leading prompt blocks it has. If [`PullCost`] says moving
//! the blocks this node lacks beats recomputing them, the worker reserves blocks for them
//! (`LlmEngine::reserve_import`) and asks the holder to push their KV
//! ([`crate::KvExporter::export`]); the request waits, outside the engine, until every layer
//! of the blocks the holder had arrived intact, its reply came, or the pull timed out. Then
//! the blocks that arrived become ordinary prefix-cache entries and the request is queued as
//! usual, so whatever was not pulled is computed as it would have been. A failed pull costs
//! only the wait: the request recomputes.

use crate::export::{ExportReply, ExportRequest, ExportSource};
use crate::incoming::IncomingTransfer;
use crate::metrics::WorkerMetrics;
use crate::request::KvDestination;
use crossbeam_channel::{Receiver, Sender};
use kvmesh_common::{NodeId, RequestId, TokenId};
use kvmesh_engine::llm_engine::LlmEngine;
use kvmesh_engine::runner::ModelRunner;
use kvmesh_engine::scheduler::Import;
use kvmesh_transfer::KvChunk;
use std::collections::HashMap;
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
pub struct PullCost {
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

/// The pulls of one worker, each with what waits for it (`T`: a request, as that worker
/// holds one). Runs on the worker's thread; the worker feeds it the holders' replies
/// ([`Puller::replies`]), the chunks of its transfers ([`Puller::on_chunk`]) and the clock,
/// and queues each request handed back.
///
/// A request whose prompt starts with blocks a pull in flight is bringing waits for that
/// pull instead of asking for the same blocks again (a burst on a popular prefix moves it
/// once); when the pull ends it goes on from what arrived, pulling the rest if worth it.
pub struct Puller<T> {
    node_id: NodeId,
    timeout: Duration,
    /// The prompt of a waiting request.
    prompt: fn(&T) -> &[TokenId],
    pending: HashMap<RequestId, PendingPull<T>>,
    cost: PullCost,
    reply_tx: Sender<ExportReply>,
    reply_rx: Receiver<ExportReply>,
    metrics: WorkerMetrics,
}

struct PendingPull<T> {
    waiting: T,
    /// Requests that need the same blocks, with the pull each was offered.
    followers: Vec<(T, KvPull)>,
    import: Import,
    incoming: IncomingTransfer,
    /// Blocks the holder says it sent, once its reply is in.
    sent: Option<usize>,
    started: Instant,
    deadline: Instant,
}

impl<T> Puller<T> {
    /// Pulls into `node_id`'s pool; each waits at most `timeout` before its request
    /// recomputes. `prompt` reads a waiting request's prompt.
    pub fn new(
        node_id: NodeId,
        timeout: Duration,
        metrics: WorkerMetrics,
        prompt: fn(&T) -> &[TokenId],
    ) -> Self {
        let (reply_tx, reply_rx) = crossbeam_channel::unbounded();
        Puller {
            node_id,
            timeout,
            prompt,
            pending: HashMap::new(),
            cost: PullCost::default(),
            reply_tx,
            reply_rx,
            metrics,
        }
    }

    /// Where the holders' replies arrive: wait on it, then call [`Puller::on_replies`].
    pub fn replies(&self) -> &Receiver<ExportReply> {
        &self.reply_rx
    }

    /// Requests waiting for a pull.
    pub fn len(&self) -> usize {
        self.pending.values().map(|p| 1 + p.followers.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Whether a request waiting for a pull matches `f`.
    pub fn any(&self, f: impl Fn(&T) -> bool) -> bool {
        self.pending
            .values()
            .any(|p| f(&p.waiting) || p.followers.iter().any(|(w, _)| f(w)))
    }

    /// When the next pull times out.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.pending.values().map(|p| p.deadline).min()
    }

    /// A step computed `tokens` tokens in `elapsed` (what recomputing costs here).
    pub fn observe_step(&mut self, tokens: usize, elapsed: Duration) {
        self.cost.observe_step(tokens, elapsed);
    }

    /// Starts pulling the blocks of `waiting`'s prompt that this engine lacks from `pull`'s
    /// holder, when it has some and moving them beats recomputing them, or joins a pull in
    /// flight that brings its next blocks; then `waiting` waits. Otherwise hands `waiting`
    /// back, to be queued at once.
    pub fn start<R: ModelRunner>(
        &mut self,
        engine: &mut LlmEngine<R>,
        pull: KvPull,
        waiting: T,
    ) -> Result<(), T> {
        if pull.source.node_id() == self.node_id {
            return Err(waiting);
        }
        if let Some(p) = self.pull_bringing(engine, &waiting, pull.blocks) {
            p.followers.push((waiting, pull));
            return Ok(());
        }
        let shape = engine.runner().kv_shape();
        let cost = &self.cost;
        let worth = |blocks: usize| {
            let bytes = blocks * shape.block_bytes_per_layer() * shape.num_layers;
            cost.worth_pulling(bytes, blocks * shape.block_size)
        };
        let prompt = (self.prompt)(&waiting);
        let Some(import) = engine.reserve_import(prompt, pull.blocks, worth) else {
            return Err(waiting);
        };
        let transfer_id = RequestId(rand::random());
        let request = ExportRequest {
            transfer_id,
            hashes: import.hashes.clone(),
            destination: KvDestination {
                node: self.node_id,
                blocks: import.blocks.clone(),
            },
        };
        if let Err(e) = pull.source.export(request, self.reply_tx.clone()) {
            tracing::info!(
                "cannot pull from node {}: {e}; recomputing",
                pull.source.node_id()
            );
            engine.finish_import(import, 0);
            self.metrics.kv_pull_failures.increment(1);
            return Err(waiting);
        }
        let now = Instant::now();
        self.pending.insert(
            transfer_id,
            PendingPull {
                incoming: IncomingTransfer::new(transfer_id, &shape, &import.blocks),
                import,
                waiting,
                followers: Vec::new(),
                sent: None,
                started: now,
                deadline: now + self.timeout,
            },
        );
        Ok(())
    }

    /// The pull in flight that brings some of the first `blocks` blocks of `waiting`'s prompt.
    fn pull_bringing<R: ModelRunner>(
        &mut self,
        engine: &LlmEngine<R>,
        waiting: &T,
        blocks: usize,
    ) -> Option<&mut PendingPull<T>> {
        if self.pending.is_empty() {
            return None;
        }
        let config = engine.scheduler().config();
        let prompt = (self.prompt)(waiting);
        let wanted = &prompt[..(blocks * config.block_size).min(prompt.len())];
        let wanted = config.hasher.sequence_hashes(wanted);
        // Hashes are chained: one equal hash means the whole prefix up to it is equal.
        self.pending
            .values_mut()
            .find(|p| p.import.hashes.first().is_some_and(|h| wanted.contains(h)))
    }

    /// Takes the holders' replies that have arrived; returns the requests whose pulls they
    /// ended, to be queued.
    pub fn on_replies<R: ModelRunner>(&mut self, engine: &mut LlmEngine<R>) -> Vec<T> {
        let mut ended = Vec::new();
        while let Ok(reply) = self.reply_rx.try_recv() {
            ended.extend(self.on_reply(engine, reply));
        }
        ended
    }

    fn on_reply<R: ModelRunner>(
        &mut self,
        engine: &mut LlmEngine<R>,
        reply: ExportReply,
    ) -> Vec<T> {
        let id = reply.transfer_id;
        let Some(p) = self.pending.get_mut(&id) else {
            return Vec::new(); // timed out or abandoned
        };
        match reply.result {
            Ok(done) if done.blocks <= p.import.blocks.len() => {
                p.sent = Some(done.blocks);
                self.end_if_complete(engine, id)
            }
            Ok(done) => {
                tracing::warn!(
                    "the holder claims {} blocks of {} asked for; recomputing",
                    done.blocks,
                    p.import.blocks.len()
                );
                self.end(engine, id, 0)
            }
            Err(e) => {
                tracing::info!("pull {id} failed: {e}; recomputing");
                self.end(engine, id, 0)
            }
        }
    }

    /// Writes `chunk` if it belongs to a pull (`Err(chunk)` when it does not); returns the
    /// requests of the pull it ended, if any, to be queued.
    pub fn on_chunk<R: ModelRunner>(
        &mut self,
        engine: &mut LlmEngine<R>,
        chunk: KvChunk,
    ) -> Result<Vec<T>, KvChunk> {
        let id = chunk.header.request_id;
        let Some(p) = self.pending.get_mut(&id) else {
            return Err(chunk);
        };
        if let Err(e) = p.incoming.check(&chunk) {
            tracing::warn!("refusing pulled KV of pull {id}: {e}; recomputing");
            return Ok(self.end(engine, id, 0));
        }
        let h = &chunk.header;
        if let Err(e) = engine.write_kv_blocks(h.layers(), &h.blocks, &chunk.payload) {
            tracing::warn!("writing pulled KV of pull {id}: {e}; recomputing");
            return Ok(self.end(engine, id, 0));
        }
        p.incoming.record(&chunk);
        Ok(self.end_if_complete(engine, id))
    }

    /// Ends the pulls past their deadline: their requests recompute.
    pub fn expire<R: ModelRunner>(&mut self, engine: &mut LlmEngine<R>) -> Vec<T> {
        let now = Instant::now();
        let expired: Vec<RequestId> = self
            .pending
            .iter()
            .filter(|(_, p)| p.deadline <= now)
            .map(|(&id, _)| id)
            .collect();
        expired
            .into_iter()
            .flat_map(|id| {
                tracing::info!("pull {id} timed out; recomputing");
                self.end(engine, id, 0)
            })
            .collect()
    }

    /// Drops the requests that match `f` (their clients left, or the worker stops), releasing
    /// the blocks of pulls no request waits for any more; returns those requests.
    pub fn abandon<R: ModelRunner>(
        &mut self,
        engine: &mut LlmEngine<R>,
        f: impl Fn(&T) -> bool,
    ) -> Vec<T> {
        let mut gone = Vec::new();
        let mut unwanted = Vec::new();
        for (&id, p) in &mut self.pending {
            let (left, stay) = std::mem::take(&mut p.followers)
                .into_iter()
                .partition(|(w, _)| f(w));
            p.followers = stay;
            gone.extend(left.into_iter().map(|(w, _)| w));
            if f(&p.waiting) {
                if p.followers.is_empty() {
                    unwanted.push(id);
                } else {
                    // A follower takes the pull over.
                    let (next, _) = p.followers.remove(0);
                    gone.push(std::mem::replace(&mut p.waiting, next));
                }
            }
        }
        for id in unwanted {
            let p = self.pending.remove(&id).expect("listed");
            engine.finish_import(p.import, 0);
            gone.push(p.waiting);
        }
        gone
    }

    fn end_if_complete<R: ModelRunner>(
        &mut self,
        engine: &mut LlmEngine<R>,
        id: RequestId,
    ) -> Vec<T> {
        let Some(p) = self.pending.get(&id) else {
            return Vec::new();
        };
        match p.sent.filter(|&n| p.incoming.is_complete_upto(n)) {
            Some(sent) => self.end(engine, id, sent),
            None => Vec::new(),
        }
    }

    /// Ends a pull whose first `arrived` blocks came whole (0: it failed); returns the
    /// requests to queue. Its followers go on from what arrived (pulling the rest, if worth
    /// it); after a failure they recompute, rather than each wait for the same holder again.
    fn end<R: ModelRunner>(
        &mut self,
        engine: &mut LlmEngine<R>,
        id: RequestId,
        arrived: usize,
    ) -> Vec<T> {
        let Some(p) = self.pending.remove(&id) else {
            return Vec::new();
        };
        engine.finish_import(p.import, arrived);
        let elapsed = p.started.elapsed();
        if arrived > 0 {
            let bytes = p.incoming.bytes();
            self.metrics.kv_pulled_blocks.increment(arrived as u64);
            self.metrics.kv_pulled_bytes.increment(bytes);
            self.cost.observe_pull(bytes, elapsed);
        } else {
            self.metrics.kv_pull_failures.increment(1);
            self.cost.observe_failed_pull(elapsed);
        }
        let mut ready = vec![p.waiting];
        for (waiting, pull) in p.followers {
            if arrived == 0 {
                ready.push(waiting);
            } else if let Err(waiting) = self.start(engine, pull, waiting) {
                ready.push(waiting);
            }
        }
        ready
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
