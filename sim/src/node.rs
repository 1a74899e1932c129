//! One simulated node: the engine's real [`Scheduler`] (and its `BlockPool` and prefix cache)
//! stepped in virtual time, with a [`TimingProfile`] in place of the forward pass.
//!
//! The node is driven the way `LlmEngine` drives a runner: `schedule`, execute,
//! `update_from_output`, stop checks. Execution is replaced by pricing the step with the
//! timing model: [`SimNode::start_step`] plans a step and says when it ends,
//! [`SimNode::finish_step`] (called by the event loop at that time) samples a token for every
//! chunk that ends a sequence and absorbs the step. Tokens are the `MockRunner`'s greedy
//! choice ([`MockRunner::favoured_token`]), so outputs are deterministic and independent of
//! batching. No logits are materialised: at a thousand nodes a vocabulary-sized vector per
//! sequence per step would dominate the simulation's cost and decide nothing.
//!
//! A node keeps the statistics bench's report carries ([`NodeTotals`]): busy time and steps,
//! KV blocks in use over time (observed whenever the driver starts a step, which it does after
//! every change to the node), and the prefix-cache hits of every admission by tier. The
//! scheduler reports each admission's cached tokens, lower tiers included, and the pool counts
//! the blocks it promoted from each lower tier; their difference is the device pool's share.
//! Copies between tiers take no time here (the pool's `TierMove`s are dropped).
//!
//! A node can die ([`SimNode::die`]): its step in flight never ends and it takes nothing more.
//!
//! An idle node woken by a request gathers first, as a real worker's engine thread does
//! ([`SimNode::set_gather_window`], [`kvmesh_worker::GATHER_WINDOW`]): its first step starts a
//! window later and takes what arrived meanwhile. A busy node never waits.
//!
//! With [`SimNode::set_coalesce`], a node plans runs of quiet decode steps at once
//! ([`Scheduler::quiet_decode_steps`]: the same batch decoding one token a step, no admission,
//! no block allocated or filled, no sequence finishing). Nothing outside the node can tell
//! such steps from steps planned one by one until one of them ends, so the driver applies
//! them when it next touches the node ([`SimNode::catch_up`], which leaves the next one in
//! flight as an ordinary step) or when the last one ends ([`SimNode::finish_run`]). The steps
//! are timed one by one as before, so every token keeps its time.

use crate::stats::{KvUsage, NodeTotals, PrefixTally};
use crate::timing::{StepShape, TimingProfile};
use kvmesh_common::fast_hash::{U64Map, U64Set};
use kvmesh_common::kv_tier::{Tier, TieredKvEvent};
use kvmesh_common::{LoadReport, PromptHashes, TokenId};
use kvmesh_engine::block_pool::BlockPool;
use kvmesh_engine::mock_runner::MockRunner;
use kvmesh_engine::runner::SeqId;
use kvmesh_engine::scheduler::{
    RemoteAdmission, Scheduler, SchedulerConfig, SchedulerError, SchedulerOutput,
};
use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

mod quiet;

use quiet::DecodeRun;
pub use quiet::RunTokens;

#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub scheduler: SchedulerConfig,
    pub timing: TimingProfile,
    /// Tokens are drawn from `0..vocab_size`.
    pub vocab_size: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Scheduler(#[from] SchedulerError),
    #[error(transparent)]
    Timing(#[from] crate::timing::TimingError),
    #[error("vocab_size must be positive")]
    EmptyVocab,
    #[error("max_tokens must be at least 1")]
    NoTokensWanted,
    #[error("finish_step called with no step in flight")]
    NoStepInFlight,
    #[error("the node is dead")]
    Dead,
}

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// It generated the tokens it asked for.
    MaxTokens,
    /// It filled the context (`max_model_len` or the whole KV pool).
    Length,
}

/// A sequence that ended in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Finished {
    pub seq_id: SeqId,
    pub reason: Finish,
    pub output_tokens: usize,
    /// Prompt tokens served from the prefix cache at its first admission.
    pub cached_tokens: usize,
}

/// What one step produced, at the step's end time.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Sequences that got a token this step, with the token's index in their output (0: the
    /// first token).
    pub tokens: Vec<(SeqId, usize)>,
    pub finished: Vec<Finished>,
    pub preempted: usize,
}

#[derive(Debug)]
struct Tracking {
    max_tokens: usize,
    generated: usize,
    cached_tokens: Option<usize>,
    /// Tokens its prefill must cover (the prompt, and a migrated request's resent output).
    to_prefill: usize,
    /// How far its prefill chunks have reached (the step in flight's included).
    prefilled: usize,
}

/// What [`SimNode::start_step`] started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Started {
    /// A step (or a run of quiet steps) that ends then.
    Step(Duration),
    /// The node's gather window, which ends then: call [`SimNode::start_step`] again at that
    /// instant for its first step.
    Gather(Duration),
}

#[derive(Debug)]
struct InFlight {
    output: SchedulerOutput,
    started: Duration,
    ends_at: Duration,
}

/// See the module docs.
#[derive(Debug)]
pub struct SimNode {
    scheduler: Scheduler,
    timing: TimingProfile,
    vocab_size: usize,
    in_flight: Option<InFlight>,
    /// Quiet decode steps planned at once, in place of `in_flight`.
    run: Option<DecodeRun>,
    /// Whether `start_step` may plan quiet decode steps at once.
    coalesce: bool,
    /// Looked up by id alone (and summed, in any order), so a fast unordered map.
    requests: U64Map<SeqId, Tracking>,
    /// Remote prefills admitted (blocks reserved) whose transfer the driver must start.
    remote_admitted: Vec<RemoteAdmission>,
    busy: Duration,
    steps: u64,
    /// Sequences aborted while the step in flight held a chunk of theirs: that chunk's token
    /// is not theirs to count (a new sequence of the same id may be tracked meanwhile).
    aborted_in_flight: BTreeSet<SeqId>,
    kv: KvUsage,
    prefix: PrefixTally,
    died_at: Option<Duration>,
    /// The shapes and times of its latest steps, at most `keep_steps` (for a planner's
    /// performance model, as a real node's step metrics feed it).
    recent_steps: VecDeque<(StepShape, Duration)>,
    keep_steps: usize,
    /// How long an idle node woken by a request waits for more before its first step.
    gather_window: Duration,
    /// A request reached the node while it had no work: its next step waits for the window.
    woken: bool,
    /// In its gather window until then: no step starts before.
    gathering_until: Option<Duration>,
}

impl SimNode {
    pub fn new(config: NodeConfig) -> Result<SimNode, NodeError> {
        config.scheduler.validate()?;
        config.timing.validate()?;
        if config.vocab_size == 0 {
            return Err(NodeError::EmptyVocab);
        }
        Ok(SimNode {
            scheduler: Scheduler::new(config.scheduler),
            timing: config.timing,
            vocab_size: config.vocab_size,
            in_flight: None,
            run: None,
            coalesce: false,
            requests: U64Map::default(),
            remote_admitted: Vec::new(),
            busy: Duration::ZERO,
            steps: 0,
            aborted_in_flight: BTreeSet::new(),
            kv: KvUsage::default(),
            prefix: PrefixTally::default(),
            died_at: None,
            recent_steps: VecDeque::new(),
            keep_steps: 0,
            gather_window: Duration::ZERO,
            woken: false,
            gathering_until: None,
        })
    }

    /// Queues a request for `max_tokens` output tokens; a later step admits it.
    pub fn submit(
        &mut self,
        seq_id: SeqId,
        prompt: Arc<[TokenId]>,
        max_tokens: usize,
    ) -> Result<(), NodeError> {
        let len = prompt.len();
        self.track(seq_id, max_tokens, 0, len, |scheduler| {
            scheduler.add_sequence(seq_id, prompt)
        })
    }

    /// [`SimNode::submit`] with the prompt hashed already (see
    /// [`Scheduler::add_sequence_hashed`]).
    pub fn submit_hashed(
        &mut self,
        seq_id: SeqId,
        prompt: Arc<[TokenId]>,
        hashed: &PromptHashes,
        max_tokens: usize,
    ) -> Result<(), NodeError> {
        let len = prompt.len();
        self.track(seq_id, max_tokens, 0, len, |scheduler| {
            scheduler.add_sequence_hashed(seq_id, prompt, hashed)
        })
    }

    /// Queues a migrated request: `output` are the tokens it already delivered from another
    /// node. Their KV is computed here as a prompt's is, and it continues after them, up to
    /// `max_tokens` in all.
    pub fn submit_resumed(
        &mut self,
        seq_id: SeqId,
        prompt: Arc<[TokenId]>,
        output: Vec<TokenId>,
        max_tokens: usize,
    ) -> Result<(), NodeError> {
        let generated = output.len();
        let len = prompt.len() + generated;
        self.track(seq_id, max_tokens, generated, len, |scheduler| {
            scheduler.add_resumed_sequence(seq_id, prompt, output)
        })
    }

    /// Queues a request whose prompt KV another node computes (disaggregated prefill): once
    /// admitted it is listed by [`SimNode::take_remote_admissions`], and
    /// [`SimNode::complete_remote`] ends its prefill when the KV is in.
    /// `hashed`: the prompt's hashes, when the caller has them.
    pub fn submit_remote(
        &mut self,
        seq_id: SeqId,
        prompt: Arc<[TokenId]>,
        hashed: Option<&PromptHashes>,
        max_tokens: usize,
    ) -> Result<(), NodeError> {
        // Its prefill is computed elsewhere: nothing of it is queued here.
        self.track(seq_id, max_tokens, 0, 0, |scheduler| match hashed {
            Some(hashed) => scheduler.add_remote_sequence_hashed(seq_id, prompt, hashed),
            None => scheduler.add_remote_sequence(seq_id, prompt),
        })
    }

    /// Adds a request to the scheduler with `add` and starts tracking its output, of which
    /// `generated` tokens exist already.
    fn track<E>(
        &mut self,
        seq_id: SeqId,
        max_tokens: usize,
        generated: usize,
        to_prefill: usize,
        add: impl FnOnce(&mut Scheduler) -> Result<(), E>,
    ) -> Result<(), NodeError>
    where
        NodeError: From<E>,
    {
        if self.died_at.is_some() {
            return Err(NodeError::Dead);
        }
        self.assert_caught_up();
        if max_tokens <= generated {
            return Err(NodeError::NoTokensWanted);
        }
        let idle = !self.has_work();
        add(&mut self.scheduler)?;
        self.woken |= idle;
        self.requests.insert(
            seq_id,
            Tracking {
                max_tokens,
                generated,
                cached_tokens: None,
                to_prefill,
                prefilled: 0,
            },
        );
        Ok(())
    }

    /// Cancels `seq_id` (its client or its decode node went away) and frees its blocks.
    /// False if the node does not have it.
    pub fn abort(&mut self, seq_id: SeqId) -> bool {
        self.assert_caught_up();
        if self.requests.remove(&seq_id).is_none() {
            return false;
        }
        self.scheduler.finish(seq_id);
        if self.in_flight.is_some() {
            self.aborted_in_flight.insert(seq_id);
        }
        true
    }

    /// Gives up on the remote prefill of `seq_id` (its prefill node died): the blocks
    /// reserved for the transfer are freed and it prefills here, as the decode worker falls
    /// back with `fail_remote_prefill`. False if it is not a remote prefill.
    pub fn fail_remote(&mut self, seq_id: SeqId) -> bool {
        self.assert_caught_up();
        self.scheduler.fail_remote_prefill(seq_id)
    }

    /// The node stops at `now`: the step in flight never ends (its time counts as busy only
    /// up to now), nothing more is submitted.
    pub fn die(&mut self, now: Duration) {
        if self.died_at.is_some() {
            return;
        }
        self.assert_caught_up();
        if let Some(InFlight {
            output, started, ..
        }) = self.in_flight.take()
        {
            self.busy += now.saturating_sub(started);
            self.scheduler.abort_step(output);
        }
        self.kv.observe(now, self.scheduler.pool().num_used());
        self.died_at = Some(now);
    }

    /// When it died, if it did.
    pub fn died_at(&self) -> Option<Duration> {
        self.died_at
    }

    /// The tokens `seq_id` has generated so far (those a migration resends).
    pub fn output_tokens(&self, seq_id: SeqId) -> Option<&[TokenId]> {
        self.assert_caught_up();
        self.scheduler.sequence_tokens(seq_id).map(|t| t.output)
    }

    /// Remote prefills admitted since the last call: their blocks are reserved, start their
    /// transfers.
    pub fn take_remote_admissions(&mut self) -> Vec<RemoteAdmission> {
        std::mem::take(&mut self.remote_admitted)
    }

    /// The KV of remote prefill `seq_id` has arrived with its `first_token` (sampled by the
    /// prefill node): the sequence decodes from the next step. Returns it when that token
    /// already ends it.
    pub fn complete_remote(
        &mut self,
        seq_id: SeqId,
        first_token: TokenId,
    ) -> Result<Option<Finished>, NodeError> {
        self.assert_caught_up();
        let outcome = self
            .scheduler
            .complete_remote_prefill(seq_id, first_token)?;
        let Some(t) = self.requests.get_mut(&seq_id) else {
            return Ok(None);
        };
        t.generated += 1;
        let reason = if outcome.context_full.contains(&seq_id) {
            Finish::Length
        } else if t.generated >= t.max_tokens {
            self.scheduler.finish(seq_id);
            Finish::MaxTokens
        } else {
            return Ok(None);
        };
        let t = self.requests.remove(&seq_id).expect("tracked above");
        Ok(Some(Finished {
            seq_id,
            reason,
            output_tokens: t.generated,
            cached_tokens: t.cached_tokens.unwrap_or(0),
        }))
    }

    /// An idle node woken by a request waits `window` for others before its first step, as
    /// a real worker's engine thread does (its `gather_window`, by default
    /// [`kvmesh_worker::GATHER_WINDOW`]); zero (the default here): it steps at once.
    pub fn set_gather_window(&mut self, window: Duration) {
        self.gather_window = window;
    }

    /// Plans a step at `now` when the node is idle and has work, and returns when it ends;
    /// or, when a request has just woken the idle node, starts its gather window
    /// ([`Self::set_gather_window`]) and returns when that ends. `None` when it is busy,
    /// gathering, or nothing can run (the node then waits for a submission).
    ///
    /// The driver calls it after every change to the node (a submission, a step's end, a
    /// transfer's arrival), so it also observes the KV blocks in use.
    pub fn start_step(&mut self, now: Duration) -> Option<Started> {
        if self.died_at.is_some() {
            return None;
        }
        self.kv.observe(now, self.scheduler.pool().num_used());
        if self.in_flight.is_some() || self.run.is_some() || !self.scheduler.has_work() {
            return None;
        }
        if std::mem::take(&mut self.woken) && !self.gather_window.is_zero() {
            let until = now + self.gather_window;
            self.gathering_until = Some(until);
            return Some(Started::Gather(until));
        }
        match self.gathering_until {
            Some(until) if now < until => return None,
            Some(_) => self.gathering_until = None,
            None => {}
        }
        if self.coalesce {
            if let Some(end) = self.start_run(now) {
                return Some(Started::Step(end));
            }
        }
        let promoted = |s: &Scheduler| {
            let pool = s.pool();
            (pool.num_promoted(Tier::Host), pool.num_promoted(Tier::Disk))
        };
        let (host_before, disk_before) = promoted(&self.scheduler);
        let mut output = self.scheduler.schedule();
        self.tally_admissions(&output, host_before, disk_before);
        // Copies between tiers take no time here.
        drop(self.scheduler.drain_tier_moves());
        self.kv.observe(now, self.scheduler.pool().num_used());
        let first_admissions = output.admitted.iter().filter(|a| !a.resumed);
        let remote = output.remote_admitted.iter();
        for (seq_id, cached) in first_admissions
            .map(|a| (a.seq_id, a.num_cached_tokens))
            .chain(remote.map(|a| (a.seq_id, a.num_cached_tokens)))
        {
            if let Some(t) = self.requests.get_mut(&seq_id) {
                t.cached_tokens.get_or_insert(cached);
            }
        }
        self.remote_admitted
            .append(&mut std::mem::take(&mut output.remote_admitted));
        if output.is_empty() {
            // Nothing to compute: end the (empty) step at once and wait for the next
            // submission or arrived KV. Remote admissions stand (abort undoes no admission).
            self.scheduler.abort_step(output);
            return None;
        }
        Some(Started::Step(self.begin(output, now)))
    }

    /// Puts the planned step `output` in flight from `now`; returns when it ends.
    fn begin(&mut self, output: SchedulerOutput, now: Duration) -> Duration {
        // What this step computes is no longer waiting.
        for c in &output.step.chunks {
            if let Some(t) = self.requests.get_mut(&c.seq_id) {
                t.prefilled = t.prefilled.max(c.start_pos + c.tokens.len());
            }
        }
        let shape = StepShape::of(&output.step);
        let time = self.timing.step_time(&shape);
        self.record_step(shape, time);
        self.steps += 1;
        let ends_at = now + time;
        self.in_flight = Some(InFlight {
            output,
            started: now,
            ends_at,
        });
        ends_at
    }

    fn record_step(&mut self, shape: StepShape, time: Duration) {
        if self.keep_steps > 0 {
            if self.recent_steps.len() == self.keep_steps {
                self.recent_steps.pop_front();
            }
            self.recent_steps.push_back((shape, time));
        }
    }

    fn assert_caught_up(&self) {
        assert!(
            self.run.is_none(),
            "the node's run of quiet steps must be caught up first"
        );
    }

    /// Counts the prefix-cache lookups and hits of the step's admissions, by tier: the pool's
    /// promotions since `host_before` and `disk_before` are the lower tiers' hits.
    fn tally_admissions(&mut self, output: &SchedulerOutput, host_before: u64, disk_before: u64) {
        let admissions = output
            .admitted
            .iter()
            .map(|a| (a.seq_id, a.num_cached_tokens));
        let remote = output.remote_admitted.iter();
        let mut cached = 0;
        for (seq_id, n) in admissions.chain(remote.map(|a| (a.seq_id, a.num_cached_tokens))) {
            let tokens = self
                .scheduler
                .sequence_tokens(seq_id)
                .map_or(0, |t| t.prompt.len() + t.output.len());
            self.prefix.lookup += tokens as u64;
            cached += n as u64;
        }
        let pool = self.scheduler.pool();
        let block = pool.block_size() as u64;
        let host = (pool.num_promoted(Tier::Host) - host_before) * block;
        let disk = (pool.num_promoted(Tier::Disk) - disk_before) * block;
        self.prefix.host += host;
        self.prefix.disk += disk;
        self.prefix.device += cached
            .checked_sub(host + disk)
            .expect("every promoted block is an admission's hit");
    }

    /// The step in flight ends at `ends_at` instead (it shares its host's cores, see
    /// [`crate::cpu`]); nothing when no step is in flight.
    pub fn set_step_end(&mut self, ends_at: Duration) {
        if let Some(f) = self.in_flight.as_mut() {
            f.ends_at = ends_at;
        }
    }

    /// When the step in flight ends, if one is.
    pub fn step_ends_at(&self) -> Option<Duration> {
        let run = self.run.as_ref().map(|r| r.end(r.end_nanos.len() - 1));
        self.in_flight.as_ref().map(|f| f.ends_at).or(run)
    }

    /// Ends the step in flight: one token for each sequence whose chunk ended its known
    /// tokens, and finishes those that are done.
    pub fn finish_step(&mut self) -> Result<StepReport, NodeError> {
        let InFlight {
            output,
            started,
            ends_at,
        } = self.in_flight.take().ok_or(NodeError::NoStepInFlight)?;
        self.busy += ends_at - started;
        let sampled: Vec<(SeqId, TokenId)> = output
            .step
            .chunks
            .iter()
            .filter(|c| c.want_logits)
            .map(|c| {
                let last = *c.tokens.last().expect("chunks are never empty");
                let pos = c.start_pos + c.tokens.len();
                (
                    c.seq_id,
                    MockRunner::favoured_token(last, pos, self.vocab_size),
                )
            })
            .collect();
        let preempted = output.preempted.len();
        let outcome = self.scheduler.update_from_output(output, &sampled)?;
        let context_full: U64Set<SeqId> = outcome.context_full.into_iter().collect();
        let aborted = std::mem::take(&mut self.aborted_in_flight);

        let mut report = StepReport {
            preempted,
            ..StepReport::default()
        };
        for &(seq_id, _) in &sampled {
            if aborted.contains(&seq_id) {
                continue;
            }
            let Some(t) = self.requests.get_mut(&seq_id) else {
                continue;
            };
            report.tokens.push((seq_id, t.generated));
            t.generated += 1;
            let reason = if context_full.contains(&seq_id) {
                Some(Finish::Length)
            } else if t.generated >= t.max_tokens {
                self.scheduler.finish(seq_id);
                Some(Finish::MaxTokens)
            } else {
                None
            };
            if let Some(reason) = reason {
                let t = self.requests.remove(&seq_id).expect("tracked above");
                report.finished.push(Finished {
                    seq_id,
                    reason,
                    output_tokens: t.generated,
                    cached_tokens: t.cached_tokens.unwrap_or(0),
                });
            }
        }
        Ok(report)
    }

    /// Whether anything is queued, running or in flight.
    pub fn has_work(&self) -> bool {
        self.in_flight.is_some() || self.run.is_some() || self.scheduler.has_work()
    }

    /// Requests submitted and not finished.
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// Prompt tokens its requests still wait to prefill here (not those the step in flight
    /// computes, nor a cached prefix once admission found it): what a prefill node has
    /// queued.
    pub fn queued_prefill_tokens(&self) -> u64 {
        self.requests
            .values()
            .map(|t| {
                let done = t.prefilled.max(t.cached_tokens.unwrap_or(0));
                t.to_prefill.saturating_sub(done) as u64
            })
            .sum()
    }

    /// Keep the shapes and modelled times of the latest `keep` steps ([`Self::take_steps`]).
    pub fn set_record_steps(&mut self, keep: usize) {
        self.keep_steps = keep;
        while self.recent_steps.len() > keep {
            self.recent_steps.pop_front();
        }
    }

    /// The recorded steps since the last call, oldest first.
    pub fn take_steps(&mut self) -> Vec<(StepShape, Duration)> {
        self.assert_caught_up();
        self.recent_steps.drain(..).collect()
    }

    /// The load report a real node would send, but for its queued prompt tokens (left at
    /// 0): routing does not read them, summing them costs a pass over the node's requests
    /// at every step, and the planner's observation reads [`Self::queued_prefill_tokens`]
    /// at its tick instead.
    pub fn load(&self) -> LoadReport {
        LoadReport {
            running: self.scheduler.num_running(),
            waiting: self.scheduler.num_waiting(),
            kv_blocks_used: self.scheduler.pool().num_used(),
            ..LoadReport::default()
        }
    }

    pub fn pool(&self) -> &BlockPool {
        self.scheduler.pool()
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// Record prefix-cache events (blocks stored and evicted) for the router's index.
    pub fn set_record_kv_events(&mut self, on: bool) {
        self.scheduler.set_record_kv_events(on);
    }

    /// The prefix-cache events since the last call, into `out` (see
    /// [`Scheduler::drain_kv_events_into`]).
    pub fn drain_kv_events_into(&mut self, out: &mut Vec<TieredKvEvent>) {
        self.scheduler.drain_kv_events_into(out);
    }

    /// Total modelled step time so far.
    pub fn busy_time(&self) -> Duration {
        self.busy
    }

    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Prefix-cache lookups and hits so far, by tier.
    pub fn prefix_hits(&self) -> PrefixTally {
        self.prefix
    }

    /// Its totals for bench's report, as node `id` of `role` that served `requests`.
    pub fn totals(&self, id: u64, role: &'static str, requests: u64) -> NodeTotals {
        NodeTotals {
            id,
            role,
            requests,
            steps: self.steps,
            busy: self.busy,
            kv: self.kv.clone(),
            kv_blocks: self.pool().num_blocks(),
            preemptions: self.scheduler.num_preemptions(),
            prefix: self.prefix,
            died_at: self.died_at,
            joined_at: Duration::ZERO,
            left_at: None,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use kvmesh_common::{BlockHasher, ModelFingerprint};

    const MS: Duration = Duration::from_millis(1);

    pub(crate) fn config(timing: TimingProfile) -> NodeConfig {
        NodeConfig {
            scheduler: SchedulerConfig {
                block_size: 4,
                num_blocks: 64,
                max_num_batched_tokens: 64,
                max_num_seqs: 8,
                max_model_len: 128,
                enable_prefix_caching: true,
                host_tier_blocks: 0,
                disk_tier_blocks: 0,
                hasher: BlockHasher::new(ModelFingerprint(1), 4),
            },
            timing,
            vocab_size: 1000,
        }
    }

    /// Runs the node alone until it has no work, returning each step's end and report.
    fn drain(node: &mut SimNode) -> Vec<(Duration, StepReport)> {
        let mut now = Duration::ZERO;
        let mut out = Vec::new();
        while let Some(Started::Step(end)) = node.start_step(now) {
            now = end;
            out.push((now, node.finish_step().unwrap()));
        }
        out
    }

    #[test]
    fn prefill_then_decodes_each_priced_by_the_model() {
        let mut node = SimNode::new(config(TimingProfile::fixed(10 * MS))).unwrap();
        node.submit(1, (1..=10).collect(), 3).unwrap();
        let steps = drain(&mut node);
        // One prefill step (first token) and two decode steps.
        let times: Vec<_> = steps.iter().map(|(t, _)| *t).collect();
        assert_eq!(times, [10 * MS, 20 * MS, 30 * MS]);
        assert_eq!(steps[0].1.tokens, [(1, 0)]);
        assert_eq!(steps[2].1.tokens, [(1, 2)]);
        assert_eq!(
            steps[2].1.finished,
            [Finished {
                seq_id: 1,
                reason: Finish::MaxTokens,
                output_tokens: 3,
                cached_tokens: 0
            }]
        );
        assert!(!node.has_work());
        assert_eq!(node.pool().num_free(), node.pool().num_blocks());
        assert_eq!(node.busy_time(), 30 * MS);
    }

    #[test]
    fn a_repeated_prompt_hits_the_prefix_cache() {
        let mut node = SimNode::new(config(TimingProfile::fixed(MS))).unwrap();
        node.submit(1, (1..=12).collect(), 1).unwrap();
        drain(&mut node);
        node.submit(2, (1..=12).collect(), 1).unwrap();
        let steps = drain(&mut node);
        // Two of the three full blocks are reused (the last prompt token is always computed).
        assert_eq!(steps[0].1.finished[0].cached_tokens, 8);
    }

    #[test]
    fn a_remote_prefill_waits_for_its_kv_then_decodes() {
        let mut node = SimNode::new(config(TimingProfile::fixed(MS))).unwrap();
        node.submit_remote(7, (1..=10).collect(), None, 3).unwrap();
        // Admission reserves blocks for the whole prompt but computes nothing.
        assert_eq!(node.start_step(Duration::ZERO), None);
        let admitted = node.take_remote_admissions();
        assert_eq!(admitted.len(), 1);
        assert_eq!(admitted[0].blocks.len(), 3);
        assert_eq!(node.pool().num_used(), 3);
        assert_eq!(
            node.start_step(Duration::ZERO),
            None,
            "still waiting for KV"
        );
        assert_eq!(node.complete_remote(7, 5).unwrap(), None);
        let steps = drain(&mut node);
        assert_eq!(steps.len(), 2, "the first token came with the KV");
        assert_eq!(steps[1].1.finished[0].output_tokens, 3);
        assert_eq!(node.pool().num_free(), node.pool().num_blocks());
        assert!(matches!(
            node.complete_remote(7, 5),
            Err(NodeError::Scheduler(SchedulerError::NotAwaitingKv(7)))
        ));
    }

    #[test]
    fn a_sequence_aborted_mid_step_gets_no_token_from_it_even_when_resubmitted() {
        let mut node = SimNode::new(config(TimingProfile::fixed(MS))).unwrap();
        node.submit(1, (1..=10).collect(), 1).unwrap();
        assert_eq!(node.start_step(Duration::ZERO), Some(Started::Step(MS)));
        assert!(node.abort(1));
        node.submit(1, (1..=10).collect(), 1).unwrap();
        let report = node.finish_step().unwrap();
        assert!(report.tokens.is_empty() && report.finished.is_empty());
        // The new one runs from scratch.
        let steps = drain(&mut node);
        assert_eq!(steps.len(), 1);
        assert_eq!(steps[0].1.finished[0].output_tokens, 1);
        assert_eq!(node.pool().num_free(), node.pool().num_blocks());
    }

    #[test]
    fn a_resumed_request_continues_after_its_tokens_and_a_dead_node_takes_nothing() {
        let mut node = SimNode::new(config(TimingProfile::fixed(MS))).unwrap();
        node.submit_resumed(3, (1..=10).collect(), vec![7, 8], 4)
            .unwrap();
        let steps = drain(&mut node);
        // One step recomputes prompt and output and samples the third token, one the fourth.
        assert_eq!(steps.len(), 2);
        assert_eq!(steps[0].1.tokens, [(3, 2)]);
        assert_eq!(steps[1].1.finished[0].output_tokens, 4);
        assert!(matches!(
            node.submit_resumed(4, Arc::new([1]), vec![5], 1),
            Err(NodeError::NoTokensWanted)
        ));
        node.submit(5, (1..=10).collect(), 3).unwrap();
        assert_eq!(node.start_step(10 * MS), Some(Started::Step(11 * MS)));
        node.die(10 * MS + MS / 2);
        assert_eq!(
            node.busy_time(),
            2 * MS + MS / 2,
            "the cut step counts to the death"
        );
        assert_eq!(node.start_step(20 * MS), None);
        assert!(matches!(
            node.submit(6, Arc::new([1]), 1),
            Err(NodeError::Dead)
        ));
    }

    #[test]
    fn an_idle_node_gathers_for_its_window_and_a_busy_one_does_not() {
        let window = kvmesh_worker::GATHER_WINDOW;
        let mut node = SimNode::new(config(TimingProfile::fixed(10 * MS))).unwrap();
        node.set_gather_window(window);
        node.submit(1, (1..=8).collect(), 2).unwrap();
        assert_eq!(
            node.start_step(Duration::ZERO),
            Some(Started::Gather(window))
        );
        // A request within the window waits with the first; nothing steps before it ends.
        node.submit(2, (11..=18).collect(), 1).unwrap();
        assert_eq!(node.start_step(window / 2), None);
        let first = node.start_step(window).unwrap();
        assert_eq!(first, Started::Step(window + 10 * MS));
        let report = node.finish_step().unwrap();
        assert_eq!(report.tokens, [(1, 0), (2, 0)], "both in the first step");
        // Busy (sequence 1 still decodes): a new request joins the next step at once.
        node.submit(3, (21..=28).collect(), 1).unwrap();
        let at = window + 10 * MS;
        assert_eq!(node.start_step(at), Some(Started::Step(at + 10 * MS)));
        node.finish_step().unwrap();
        assert!(!node.has_work());
        // Idle again: the next request gathers again.
        node.submit(4, (31..=38).collect(), 1).unwrap();
        assert_eq!(
            node.start_step(100 * MS),
            Some(Started::Gather(100 * MS + window))
        );
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        let mut node = SimNode::new(config(TimingProfile::fixed(MS))).unwrap();
        assert!(matches!(
            node.submit(1, Arc::new([1]), 0),
            Err(NodeError::NoTokensWanted)
        ));
        assert!(matches!(
            node.submit(1, Arc::new([]), 1),
            Err(NodeError::Scheduler(SchedulerError::EmptyPrompt))
        ));
        assert!(matches!(node.finish_step(), Err(NodeError::NoStepInFlight)));
        let mut c = config(TimingProfile::fixed(MS));
        c.vocab_size = 0;
        assert!(matches!(SimNode::new(c), Err(NodeError::EmptyVocab)));
    }
}
