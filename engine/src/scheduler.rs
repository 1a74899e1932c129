//! The sans-IO scheduler: continuous batching with chunked prefill, prefix caching and
//! preemption by recompute, after vLLM v1's scheduler.
//!
//! Every sequence is a list of tokens (prompt, then generated) and a count of how many have
//! KV in the cache. Each step spends a token budget on running sequences first (a decode is
//! one token, a prefill a chunk of its prompt), then admits waiting sequences in arrival order
//! while budget, blocks and `max_num_seqs` allow. The scheduler only plans and absorbs
//! results; it never runs the model, samples, reads a clock or blocks.
//!
//! # Driving it
//!
//! ```text
//! loop {
//!     let out = scheduler.schedule();                 // plan one step
//!     let logits = match runner.execute(&out.step) {
//!         Ok(o) => o,
//!         Err(e) => { scheduler.abort_step(out); /* fail or retry */ continue; }
//!     };
//!     let mut sampled = Vec::new();
//!     for (seq_id, mut l) in logits.logits {         // only chunks that end a sequence
//!         let tokens = scheduler.sequence_tokens(seq_id).unwrap();
//!         sampled.push((seq_id, samplers[seq_id].sample(params, &mut l, tokens.prompt, tokens.output).token));
//!     }
//!     let outcome = scheduler.update_from_output(out, &sampled)?;  // marks chunks computed
//!     for (seq_id, token) in sampled { if stop_checker says stop { scheduler.finish(seq_id); } }
//!     for seq_id in outcome.context_full { /* already finished: report FinishReason::Length */ }
//! }
//! ```
//!
//! Cancellation is `finish(seq_id)` at any time, even while a step is in flight: the step's
//! results for that sequence are then ignored. Exactly one step is in flight at a time; the
//! `SchedulerOutput` is the ticket that ends it and cannot be used twice.
//!
//! A driver that only prices steps (the simulator) may run the quiet decode steps ahead at
//! once, with the result of stepping through them: `quiet_decode_steps`, `advance_decode`.
//!
//! # Remote prefill
//!
//! A sequence added with `add_remote_sequence` gets its prompt's KV from another node (a
//! prefill worker). It waits in the same first-come-first-served queue; when admitted, it takes
//! its local prefix-cache hits and blocks for the rest of the prompt, and is reported in
//! `SchedulerOutput::remote_admitted` with the blocks the transfer must fill. It then holds those
//! blocks (and a `max_num_seqs` slot) but stays out of every batch until the driver either
//!
//! - `complete_remote_prefill(seq_id, first_token)`: every block arrived intact; the prompt
//!   counts as computed (its full blocks become prefix hits) and the first token, sampled by the
//!   prefill worker, is appended, so the sequence decodes from the next step; or
//! - `fail_remote_prefill(seq_id)`: the transfer failed or was corrupt; the blocks are released
//!   and the sequence goes back to the head of the queue to prefill locally.
//!
//! The scheduler keeps no clock for transfers: the driver, which sees the KV arrive, gives up
//! one that stalls with `fail_remote_prefill` (the decode worker's `remote_prefill` module), so
//! blocks reserved for a transfer that never completes are not stranded. Blocks that await KV
//! are never registered in the prefix cache, so nothing ever reads partial or corrupt KV.

mod discard;
mod import;
mod quiet;
mod sequence;
mod step_time;

use crate::block_pool::{BlockPool, TierMove};
use crate::runner::{BlockTable, SeqChunk, SeqId, StepInput};
use kvmesh_common::fast_hash::U64Map;
use kvmesh_common::kv_tier::TieredKvEvent;
use kvmesh_common::{BlockHasher, BlockId, PromptHashes, SequenceHash, TokenId};
use sequence::{blocks_for, joined, RemotePrefill, Sequence};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

pub use import::Import;
use step_time::TimeBudget;
pub use step_time::{StepCost, StepShape, StepTimeModel};

#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Tokens per KV block; must equal `hasher.block_size`.
    pub block_size: usize,
    pub num_blocks: usize,
    /// Token budget of one step, prefill chunks and decodes together.
    pub max_num_batched_tokens: usize,
    /// Most sequences running (holding KV) at once.
    pub max_num_seqs: usize,
    /// Most tokens (prompt plus generated) in one sequence.
    pub max_model_len: usize,
    pub enable_prefix_caching: bool,
    /// Capacity of the host-memory tier behind the prefix cache, in blocks (0: none).
    pub host_tier_blocks: usize,
    /// Capacity of the disk tier behind the host tier, in blocks (0: none).
    pub disk_tier_blocks: usize,
    pub hasher: BlockHasher,
}

impl SchedulerConfig {
    pub fn validate(&self) -> Result<(), SchedulerError> {
        let bad = |what| Err(SchedulerError::InvalidConfig(what));
        if self.block_size == 0 || self.hasher.block_size != self.block_size {
            return bad("block_size must be positive and equal hasher.block_size");
        }
        if self.num_blocks == 0 || self.num_blocks >= u32::MAX as usize {
            return bad("num_blocks must be in 1..u32::MAX");
        }
        if self.max_num_batched_tokens == 0 || self.max_num_seqs == 0 || self.max_model_len == 0 {
            return bad("max_num_batched_tokens, max_num_seqs and max_model_len must be positive");
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SchedulerError {
    #[error("invalid scheduler config: {0}")]
    InvalidConfig(&'static str),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {len} tokens; the maximum is {max_model_len}")]
    PromptTooLong { len: usize, max_model_len: usize },
    #[error("the prompt needs {needed} KV blocks; the whole pool has {num_blocks}")]
    PromptExceedsPool { needed: usize, num_blocks: usize },
    #[error("sequence {0} already exists")]
    DuplicateSeqId(SeqId),
    #[error("this output is not from the step in flight")]
    StaleOutput,
    #[error("no sampled token for sequence {0}, whose chunk returned logits")]
    MissingToken(SeqId),
    #[error("a sampled token for sequence {0}, whose chunk returned no logits")]
    UnexpectedToken(SeqId),
    #[error("two sampled tokens for sequence {0}")]
    DuplicateToken(SeqId),
    #[error("sequence {0} is not awaiting remote KV")]
    NotAwaitingKv(SeqId),
    #[error("disk tier: {0}")]
    DiskTier(String),
}

/// A sequence that got KV blocks this step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admission {
    pub seq_id: SeqId,
    /// Leading tokens served from the prefix cache (usage's `cached_tokens` on first admission).
    pub num_cached_tokens: usize,
    /// Readmitted after a preemption rather than admitted for the first time.
    pub resumed: bool,
}

/// A remote-prefill sequence that got KV blocks this step: start its transfer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteAdmission {
    pub seq_id: SeqId,
    /// Leading prompt tokens served from the local prefix cache (whole blocks); the sender
    /// skips them.
    pub num_cached_tokens: usize,
    /// The blocks the transfer fills, in order: block `i` holds the prompt's positions from
    /// `num_cached_tokens + i * block_size` on.
    pub blocks: Vec<BlockId>,
}

/// One planned step. Pass it to `update_from_output` (or `abort_step`) before the next
/// `schedule`.
#[derive(Debug)]
#[must_use = "pass the output to update_from_output or abort_step"]
pub struct SchedulerOutput {
    /// What the runner executes.
    pub step: StepInput,
    /// Sequences that lost their KV this step; they will recompute it when readmitted.
    pub preempted: Vec<SeqId>,
    pub admitted: Vec<Admission>,
    /// Remote-prefill sequences that got their blocks; they are in no chunk of this step.
    pub remote_admitted: Vec<RemoteAdmission>,
    step_id: u64,
    /// Our own record of the chunks, independent of any edits to `step`.
    scheduled: Vec<Scheduled>,
}

impl SchedulerOutput {
    /// True when the step has nothing to execute.
    pub fn is_empty(&self) -> bool {
        self.step.chunks.is_empty()
    }
}

#[derive(Clone, Copy, Debug)]
struct Scheduled {
    seq_id: SeqId,
    generation: u64,
    num_tokens: usize,
    want_logits: bool,
}

/// What `update_from_output` decided on its own.
#[derive(Debug, Default, PartialEq, Eq)]
#[must_use]
pub struct StepOutcome {
    /// Sequences that filled the context (`max_model_len`, or the whole KV pool) with the token
    /// just appended. They are already finished and freed (`sequence_tokens` no longer knows
    /// them); report `FinishReason::Length`.
    pub context_full: Vec<SeqId>,
}

/// What `append_tokens` did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[must_use]
pub struct Appended {
    /// Tokens appended, from the first on.
    pub count: usize,
    /// The last appended token filled the context: the sequence is finished and freed.
    pub context_full: bool,
}

/// A sequence's tokens, split as the sampler's penalties need them.
#[derive(Clone, Copy, Debug)]
pub struct SequenceTokens<'a> {
    pub prompt: &'a [TokenId],
    pub output: &'a [TokenId],
}

/// See the module docs.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    pool: BlockPool,
    /// Looked up several times per sequence per step: a fast hasher, not SipHash.
    seqs: U64Map<SeqId, Sequence>,
    /// In admission order: the last one is preempted first.
    running: Vec<SeqId>,
    waiting: VecDeque<SeqId>,
    /// Admitted remote-prefill sequences whose KV has not arrived, in admission order.
    awaiting_kv: Vec<SeqId>,
    in_flight: Option<u64>,
    next_step_id: u64,
    next_generation: u64,
    num_preemptions: u64,
    /// What steps cost on this engine, learned from the steps run; with a target, it sizes
    /// prefill chunks (see `step_time`).
    step_time: StepTimeModel,
    max_step_time: Option<f64>,
    /// `update_from_output`'s tokens, one entry a chunk, kept between steps so that a step
    /// allocates nothing for them.
    sampled_by_chunk: Vec<Option<TokenId>>,
}

impl Scheduler {
    /// # Panics
    /// If `config.validate()` fails; validate configs where they are loaded.
    pub fn new(config: SchedulerConfig) -> Self {
        if let Err(e) = config.validate() {
            panic!("{e}");
        }
        Scheduler {
            pool: BlockPool::new(config.num_blocks, config.block_size).with_tiers(
                config.host_tier_blocks,
                config.disk_tier_blocks,
                [],
            ),
            config,
            seqs: U64Map::default(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            awaiting_kv: Vec::new(),
            in_flight: None,
            next_step_id: 0,
            next_generation: 0,
            num_preemptions: 0,
            step_time: StepTimeModel::default(),
            max_step_time: None,
            sampled_by_chunk: Vec::new(),
        }
    }

    /// Sizes each step's prefill chunks so that the step is predicted to take at most
    /// `target` (`None`: the token budget alone). The prediction learns from
    /// [`Scheduler::observe_step_time`]; until it can say, the token budget alone decides.
    pub fn set_max_step_time(&mut self, target: Option<Duration>) {
        self.max_step_time = target.map(|t| t.as_secs_f64());
    }

    /// How long a step of this shape took, from its planning to its tokens: what the
    /// step-time target's predictions learn from.
    /// Nothing to learn without a target: no step pays for it.
    pub fn observe_step_time(&mut self, shape: StepShape, took: Duration) {
        if self.max_step_time.is_some() {
            self.step_time.observe(shape, took.as_secs_f64());
        }
    }

    /// The time budget of the step being planned, when there is a target.
    fn time_budget(&self) -> Option<TimeBudget> {
        let target = self.max_step_time?;
        let decodes = self
            .running
            .iter()
            .map(|id| &self.seqs[id])
            .filter(|s| s.num_uncomputed() == 1)
            .map(|s| StepShape::chunk(s.num_computed, 1))
            .fold(StepShape::default(), StepShape::plus);
        Some(TimeBudget::new(
            self.step_time.cost(),
            target,
            decodes,
            self.config.block_size,
        ))
    }

    /// Queues a sequence; it is admitted by a later `schedule`. The prompt is kept as given
    /// when it is an `Arc<[TokenId]>` (a caller that holds it elsewhere shares it; a `Vec`
    /// is copied once).
    pub fn add_sequence(
        &mut self,
        seq_id: SeqId,
        prompt: impl Into<Arc<[TokenId]>>,
    ) -> Result<(), SchedulerError> {
        self.add(seq_id, prompt.into(), Vec::new(), None, None)
    }

    /// [`Scheduler::add_sequence`] for a caller that hashed the prompt already (the router
    /// did): `hashed` is taken when this scheduler's hasher made it, else the prompt is hashed.
    pub fn add_sequence_hashed(
        &mut self,
        seq_id: SeqId,
        prompt: impl Into<Arc<[TokenId]>>,
        hashed: &PromptHashes,
    ) -> Result<(), SchedulerError> {
        self.add(seq_id, prompt.into(), Vec::new(), None, Some(hashed))
    }

    /// Queues a sequence that already generated `output` elsewhere (a migrated request): its
    /// KV is computed as a preempted sequence's is, and it continues after `output`.
    pub fn add_resumed_sequence(
        &mut self,
        seq_id: SeqId,
        prompt: impl Into<Arc<[TokenId]>>,
        output: Vec<TokenId>,
    ) -> Result<(), SchedulerError> {
        self.add(seq_id, prompt.into(), output, None, None)
    }

    /// Queues a sequence whose prompt KV will arrive from another node (see the module docs).
    pub fn add_remote_sequence(
        &mut self,
        seq_id: SeqId,
        prompt: impl Into<Arc<[TokenId]>>,
    ) -> Result<(), SchedulerError> {
        self.add(seq_id, prompt.into(), Vec::new(), Some(RemotePrefill), None)
    }

    /// [`Scheduler::add_remote_sequence`] with the prompt hashed already, as
    /// [`Scheduler::add_sequence_hashed`].
    pub fn add_remote_sequence_hashed(
        &mut self,
        seq_id: SeqId,
        prompt: impl Into<Arc<[TokenId]>>,
        hashed: &PromptHashes,
    ) -> Result<(), SchedulerError> {
        self.add(
            seq_id,
            prompt.into(),
            Vec::new(),
            Some(RemotePrefill),
            Some(hashed),
        )
    }

    fn add(
        &mut self,
        seq_id: SeqId,
        prompt: Arc<[TokenId]>,
        output: Vec<TokenId>,
        remote: Option<RemotePrefill>,
        hashed: Option<&PromptHashes>,
    ) -> Result<(), SchedulerError> {
        if prompt.is_empty() {
            return Err(SchedulerError::EmptyPrompt);
        }
        let len = prompt.len() + output.len();
        if len > self.config.max_model_len {
            return Err(SchedulerError::PromptTooLong {
                len,
                max_model_len: self.config.max_model_len,
            });
        }
        let needed = blocks_for(len, self.config.block_size);
        if needed > self.config.num_blocks {
            return Err(SchedulerError::PromptExceedsPool {
                needed,
                num_blocks: self.config.num_blocks,
            });
        }
        if self.seqs.contains_key(&seq_id) {
            return Err(SchedulerError::DuplicateSeqId(seq_id));
        }
        let mut seq = Sequence::new(self.next_generation, prompt);
        seq.output = output;
        seq.remote = remote;
        self.next_generation += 1;
        if self.config.enable_prefix_caching {
            if let Some(hashes) = hashed.and_then(|h| h.made_by(&self.config.hasher)) {
                debug_assert_eq!(
                    hashes,
                    &self.config.hasher.sequence_hashes(&seq.prompt)[..],
                    "another prompt's hashes"
                );
                seq.hashes = hashes.to_vec();
            }
            seq.extend_hashes(&self.config.hasher);
        }
        self.seqs.insert(seq_id, seq);
        self.waiting.push_back(seq_id);
        Ok(())
    }

    /// Plans the next step.
    ///
    /// # Panics
    /// If the previous step's output was not given back to `update_from_output` or
    /// `abort_step`: two steps in flight would compute the same tokens twice.
    pub fn schedule(&mut self) -> SchedulerOutput {
        assert!(
            self.in_flight.is_none(),
            "schedule() called while a step is in flight; pass its output to \
             update_from_output or abort_step first"
        );
        self.next_step_id += 1;
        let mut out = SchedulerOutput {
            step: StepInput::default(),
            preempted: Vec::new(),
            admitted: Vec::new(),
            remote_admitted: Vec::new(),
            step_id: self.next_step_id,
            scheduled: Vec::new(),
        };
        let mut budget = self.config.max_num_batched_tokens;
        let mut time = self.time_budget();

        // Running sequences first, in admission order; only they can preempt.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let seq = &self.seqs[&id];
            let (start, mut n) = (seq.num_computed, seq.num_uncomputed().min(budget));
            // A decode is in the time budget already; a prefill chunk gets what is left.
            if let Some(time) = time.as_mut().filter(|_| seq.num_uncomputed() > 1) {
                n = time.limit(start, n);
                time.add(start, n);
            }
            if n == 0 {
                i += 1;
                continue;
            }
            if !self.reserve_or_preempt(id, n, &mut out.preempted) {
                break;
            }
            self.push_chunk(id, n, &mut out);
            budget -= n;
            i += 1;
        }

        // Then waiting ones, first come first served; not while memory is short. A remote
        // prefill takes blocks and a slot but no token budget.
        if out.preempted.is_empty() {
            while self.running.len() + self.awaiting_kv.len() < self.config.max_num_seqs {
                let Some(&id) = self.waiting.front() else {
                    break;
                };
                if self.seqs[&id].remote.is_some() {
                    let Some(admission) = self.try_admit_remote(id) else {
                        break;
                    };
                    out.remote_admitted.push(admission);
                    continue;
                }
                if budget == 0 {
                    break;
                }
                let Some((n, admission)) = self.try_admit(id, budget, time.as_mut()) else {
                    break;
                };
                self.push_chunk(id, n, &mut out);
                out.admitted.push(admission);
                budget -= n;
            }
        }

        self.in_flight = Some(out.step_id);
        out
    }

    /// Ends the step in flight: marks every chunk computed, caches newly full blocks and
    /// appends each sampled token (one per chunk that returned logits, none for others).
    /// Sequences finished meanwhile are skipped, and tokens for them ignored.
    ///
    /// On error nothing is applied and the step counts as aborted: its chunks are planned
    /// again by the next `schedule`.
    pub fn update_from_output(
        &mut self,
        output: SchedulerOutput,
        sampled: &[(SeqId, TokenId)],
    ) -> Result<StepOutcome, SchedulerError> {
        if self.in_flight != Some(output.step_id) {
            return Err(SchedulerError::StaleOutput);
        }
        self.in_flight = None;
        check_sampled(
            &self.seqs,
            &output.scheduled,
            sampled,
            &mut self.sampled_by_chunk,
        )?;

        let mut outcome = StepOutcome::default();
        let max_len = self.max_seq_len();
        for (r, &token) in output.scheduled.iter().zip(&self.sampled_by_chunk) {
            let Some(seq) = self.seqs.get_mut(&r.seq_id) else {
                continue;
            };
            if seq.generation != r.generation {
                continue;
            }
            seq.num_computed += r.num_tokens;
            if self.config.enable_prefix_caching {
                cache_computed_blocks(&mut self.pool, seq, self.config.block_size);
            }
            if let Some(token) = token {
                seq.output.push(token);
                if self.config.enable_prefix_caching {
                    seq.extend_hashes(&self.config.hasher);
                }
                if seq.len() >= max_len {
                    outcome.context_full.push(r.seq_id);
                }
            }
        }
        for &id in &outcome.context_full {
            self.finish(id);
        }
        Ok(outcome)
    }

    /// Ends the step in flight without results (the runner failed). Nothing is marked
    /// computed; the same work is planned again by the next `schedule`.
    pub fn abort_step(&mut self, output: SchedulerOutput) {
        if self.in_flight == Some(output.step_id) {
            self.in_flight = None;
        }
    }

    /// Removes a finished or cancelled sequence and frees its blocks; computed full blocks stay
    /// in the prefix cache. Returns false if no such sequence exists.
    pub fn finish(&mut self, seq_id: SeqId) -> bool {
        let Some(seq) = self.seqs.remove(&seq_id) else {
            return false;
        };
        self.running.retain(|&id| id != seq_id);
        self.waiting.retain(|&id| id != seq_id);
        self.awaiting_kv.retain(|&id| id != seq_id);
        self.pool
            .free(&seq.blocks)
            .expect("a sequence holds one reference on each of its blocks");
        true
    }

    /// Ends the remote prefill of `seq_id`: its prompt's KV is in its blocks. Marks the prompt
    /// computed (its full blocks become prefix hits) and appends `first_token`, sampled by the
    /// prefill worker, so the sequence decodes from the next step. Allowed while a step is in
    /// flight (the sequence is in none). If the token fills the context, the sequence is
    /// finished and listed in `context_full`.
    pub fn complete_remote_prefill(
        &mut self,
        seq_id: SeqId,
        first_token: TokenId,
    ) -> Result<StepOutcome, SchedulerError> {
        let Some(pos) = self.awaiting_kv.iter().position(|&id| id == seq_id) else {
            return Err(SchedulerError::NotAwaitingKv(seq_id));
        };
        self.awaiting_kv.remove(pos);
        let seq = self
            .seqs
            .get_mut(&seq_id)
            .expect("awaiting sequences exist");
        seq.remote = None;
        seq.num_computed = seq.len();
        if self.config.enable_prefix_caching {
            cache_computed_blocks(&mut self.pool, seq, self.config.block_size);
        }
        seq.output.push(first_token);
        if self.config.enable_prefix_caching {
            seq.extend_hashes(&self.config.hasher);
        }
        let full = seq.len() >= self.max_seq_len();
        self.running.push(seq_id);
        let mut outcome = StepOutcome::default();
        if full {
            self.finish(seq_id);
            outcome.context_full.push(seq_id);
        }
        Ok(outcome)
    }

    /// Appends `tokens` after the token just sampled for the running sequence `seq_id`:
    /// tokens that need no draw of their own (a structured output's forced tokens). Its next
    /// chunk computes them together, and that chunk's last position gives the next logits.
    /// Stops at the token that fills the context; the sequence is then finished and freed,
    /// as by `update_from_output`. Call between steps.
    pub fn append_tokens(&mut self, seq_id: SeqId, tokens: &[TokenId]) -> Appended {
        debug_assert!(self.in_flight.is_none(), "append_tokens during a step");
        let max_len = self.max_seq_len();
        let mut appended = Appended::default();
        let Some(seq) = self.seqs.get_mut(&seq_id) else {
            return appended;
        };
        for &token in tokens {
            if seq.len() >= max_len {
                break;
            }
            seq.output.push(token);
            appended.count += 1;
            if seq.len() >= max_len {
                appended.context_full = true;
                break;
            }
        }
        if self.config.enable_prefix_caching {
            seq.extend_hashes(&self.config.hasher);
        }
        if appended.context_full {
            self.finish(seq_id);
        }
        appended
    }

    /// Gives up on the remote prefill of `seq_id`: releases the blocks reserved for the
    /// transfer and puts the sequence at the head of the queue to prefill locally. Works
    /// whether it was admitted already or still queued. False if `seq_id` is not a remote
    /// prefill.
    pub fn fail_remote_prefill(&mut self, seq_id: SeqId) -> bool {
        let Some(seq) = self.seqs.get_mut(&seq_id) else {
            return false;
        };
        if seq.remote.take().is_none() {
            return false;
        }
        if let Some(pos) = self.awaiting_kv.iter().position(|&id| id == seq_id) {
            self.awaiting_kv.remove(pos);
            self.pool
                .free(&seq.blocks)
                .expect("a sequence holds one reference on each of its blocks");
            seq.blocks = BlockTable::default();
            seq.num_computed = 0;
            seq.num_cached_blocks = 0;
            self.waiting.push_front(seq_id);
        }
        true
    }

    /// Admitted remote-prefill sequences whose KV has not arrived yet.
    pub fn num_awaiting_kv(&self) -> usize {
        self.awaiting_kv.len()
    }

    /// Whether `seq_id` holds blocks and waits for its prompt's KV.
    pub fn is_awaiting_kv(&self, seq_id: SeqId) -> bool {
        self.awaiting_kv.contains(&seq_id)
    }

    /// How many leading tokens of `prompt` the prefix cache holds now, as admission would count
    /// them (whole blocks, leaving at least one token to compute). Admission may find fewer
    /// if blocks are evicted meanwhile.
    pub fn probe_prefix(&self, prompt: &[TokenId]) -> usize {
        if !self.config.enable_prefix_caching || prompt.is_empty() {
            return 0;
        }
        let hashes = self.config.hasher.sequence_hashes(prompt);
        let (hits, host) = self.cached_prefix(&hashes, prompt.len());
        (hits.len() + host) * self.config.block_size
    }

    /// The cached prefix of a sequence of `len` tokens with block hashes `hashes`: the main
    /// pool's blocks, then how many blocks after them the lower tiers hold; at most
    /// `(len - 1) / block_size` blocks in all, so at least one token is left to compute.
    fn cached_prefix(&self, hashes: &[SequenceHash], len: usize) -> (Vec<BlockId>, usize) {
        if !self.config.enable_prefix_caching || len == 0 {
            return (Vec::new(), 0);
        }
        let limit = (len - 1) / self.config.block_size;
        let mut hits = self.pool.lookup_prefix(hashes);
        hits.truncate(limit);
        let lower = self.pool.lookup_lower(&hashes[hits.len()..]).len();
        let lower = lower.min(limit - hits.len());
        (hits, lower)
    }

    /// Takes `hits` and `fresh` blocks for sequence `id`, the first `host` of them filled
    /// from the lower tiers (copies the engine carries out). The caller checked the room.
    fn take_blocks(
        &mut self,
        id: SeqId,
        hits: &[BlockId],
        host: usize,
        fresh: usize,
    ) -> Vec<BlockId> {
        // Take the hits (and the host copies) first, or the allocation could evict them.
        self.pool.take(hits).expect("hits are pool blocks");
        let promoted = self.seqs[&id].hashes[hits.len()..hits.len() + host].to_vec();
        let tiers = self.pool.take_lower(&promoted);
        let fresh = self.pool.allocate(fresh).expect("checked num_free");
        for ((&hash, &block), from) in promoted.iter().zip(&fresh).zip(tiers) {
            self.pool.promote(hash, block, from);
        }
        fresh
    }

    /// Tells the pool what a restarted node's disk tier holds (it is announced when
    /// recording starts).
    pub fn restore_disk_tier(&mut self, on_disk: Vec<SequenceHash>) {
        self.pool.restore_disk(on_disk);
    }

    /// Forgets `hash`'s copy in a lower tier (the engine could not keep it).
    pub fn forget_lower(&mut self, hash: SequenceHash) {
        let _ = self.pool.forget_lower(hash);
    }

    /// Copies between the main pool and the host tier that the engine must carry out before
    /// running the next step, in order.
    pub fn drain_tier_moves(&mut self) -> Vec<TierMove> {
        self.pool.drain_tier_moves()
    }

    pub fn sequence_tokens(&self, seq_id: SeqId) -> Option<SequenceTokens<'_>> {
        self.seqs.get(&seq_id).map(|s| SequenceTokens {
            prompt: &s.prompt,
            output: &s.output,
        })
    }

    /// The running sequences, in admission order.
    pub fn running(&self) -> &[SeqId] {
        &self.running
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Prompt tokens still to be computed here: all of every waiting sequence's uncomputed
    /// tokens (a preempted one recomputes its output too) and the rest of every running
    /// sequence still prefilling in chunks. Sequences whose KV comes from another node count
    /// nothing until they fall back to a local prefill.
    pub fn queued_prompt_tokens(&self) -> u64 {
        let waiting = self
            .waiting
            .iter()
            .map(|id| &self.seqs[id])
            .filter(|seq| seq.remote.is_none())
            .map(|seq| seq.num_uncomputed());
        let prefilling = self
            .running
            .iter()
            .map(|id| self.seqs[id].num_uncomputed())
            .filter(|&n| n > 1);
        waiting.chain(prefilling).map(|n| n as u64).sum()
    }

    /// Whether any sequence is waiting, running or awaiting remote KV.
    pub fn has_work(&self) -> bool {
        !self.seqs.is_empty()
    }

    /// Fraction of KV blocks in use.
    pub fn block_usage(&self) -> f64 {
        self.pool.usage()
    }

    /// Preemptions since start.
    pub fn num_preemptions(&self) -> u64 {
        self.num_preemptions
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Starts or stops recording prefix-cache changes (off by default; see `BlockPool`).
    pub fn set_record_kv_events(&mut self, on: bool) {
        self.pool.set_record_events(on);
    }

    /// Prefix-cache changes since the last call, for the cluster's prefix index.
    pub fn drain_kv_events(&mut self) -> Vec<TieredKvEvent> {
        self.pool.drain_events()
    }

    /// See [`BlockPool::drain_events_into`].
    pub fn drain_kv_events_into(&mut self, out: &mut Vec<TieredKvEvent>) {
        self.pool.drain_events_into(out);
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Longest a sequence may grow: its last token must have a position the model and the
    /// pool can hold, so nothing ever waits for more blocks than exist.
    fn max_seq_len(&self) -> usize {
        self.config
            .max_model_len
            .min(self.config.num_blocks * self.config.block_size)
    }

    /// Gives running sequence `id` blocks for `n` more tokens, preempting the most recently
    /// admitted sequences while the pool is short. False if `id` itself had to be preempted.
    fn reserve_or_preempt(&mut self, id: SeqId, n: usize, preempted: &mut Vec<SeqId>) -> bool {
        loop {
            let seq = &self.seqs[&id];
            // An aborted step may have left more blocks than this chunk needs.
            let missing = blocks_for(seq.num_computed + n, self.config.block_size)
                .saturating_sub(seq.blocks.len());
            if let Some(blocks) = self.pool.allocate(missing) {
                let seq = self.seqs.get_mut(&id).unwrap();
                seq.blocks = joined(&seq.blocks, &blocks);
                return true;
            }
            let victim = self.running.pop().expect("`id` is running");
            self.preempt(victim);
            preempted.push(victim);
            if victim == id {
                return false;
            }
        }
    }

    /// Frees a running sequence's KV and puts it at the head of the queue to recompute.
    fn preempt(&mut self, id: SeqId) {
        let seq = self.seqs.get_mut(&id).expect("running sequences exist");
        self.pool
            .free(&seq.blocks)
            .expect("a sequence holds one reference on each of its blocks");
        seq.blocks = BlockTable::default();
        seq.num_computed = 0;
        seq.num_cached_blocks = 0;
        self.waiting.push_front(id);
        self.num_preemptions += 1;
    }

    /// Admits the head of the queue if blocks allow: takes its cached prefix, allocates the
    /// rest of its first chunk and moves it to running. Returns the chunk length.
    fn try_admit(
        &mut self,
        id: SeqId,
        budget: usize,
        time: Option<&mut TimeBudget>,
    ) -> Option<(usize, Admission)> {
        let bs = self.config.block_size;
        let seq = &self.seqs[&id];
        let (hits, host) = self.cached_prefix(&seq.hashes, seq.len());
        let num_cached = (hits.len() + host) * bs;
        let mut n = (seq.len() - num_cached).min(budget);
        let time = time.filter(|_| n > 1);
        if let Some(time) = &time {
            n = time.limit(num_cached, n);
            if n == 0 {
                return None;
            }
        }
        let new_blocks = blocks_for(num_cached + n, bs) - hits.len();
        if new_blocks + self.revived(&hits) > self.pool.num_free() {
            return None;
        }
        let fresh = self.take_blocks(id, &hits, host, new_blocks);
        if let Some(time) = time {
            time.add(num_cached, n);
        }

        let seq = self.seqs.get_mut(&id).unwrap();
        seq.num_cached_blocks = hits.len() + host;
        seq.blocks = joined(&hits, &fresh);
        seq.num_computed = num_cached;
        let resumed = std::mem::replace(&mut seq.admitted_before, true);
        self.waiting.pop_front();
        self.running.push(id);
        Some((
            n,
            Admission {
                seq_id: id,
                num_cached_tokens: num_cached,
                resumed,
            },
        ))
    }

    /// Admits the head of the queue for a remote prefill if blocks allow: takes its cached
    /// prefix and allocates blocks for the rest of the prompt, which the transfer will fill.
    fn try_admit_remote(&mut self, id: SeqId) -> Option<RemoteAdmission> {
        let bs = self.config.block_size;
        let seq = &self.seqs[&id];
        let (hits, host) = self.cached_prefix(&seq.hashes, seq.len());
        let new_blocks = blocks_for(seq.len(), bs) - hits.len();
        if new_blocks + self.revived(&hits) > self.pool.num_free() {
            return None;
        }
        let mut fresh = self.take_blocks(id, &hits, host, new_blocks);

        let seq = self.seqs.get_mut(&id).unwrap();
        let num_cached = (hits.len() + host) * bs;
        seq.num_cached_blocks = hits.len() + host;
        seq.blocks = joined(&hits, &fresh);
        // The promoted blocks are filled here; the transfer fills the rest.
        fresh.drain(..host);
        seq.num_computed = num_cached;
        seq.admitted_before = true;
        self.waiting.pop_front();
        self.awaiting_kv.push(id);
        Some(RemoteAdmission {
            seq_id: id,
            num_cached_tokens: num_cached,
            blocks: fresh,
        })
    }

    /// Hits that sit on the free list cost a free block, like a fresh allocation.
    fn revived(&self, hits: &[BlockId]) -> usize {
        hits.iter()
            .filter(|&&b| self.pool.ref_count(b) == 0)
            .count()
    }

    fn push_chunk(&self, id: SeqId, n: usize, out: &mut SchedulerOutput) {
        let seq = &self.seqs[&id];
        let start = seq.num_computed;
        let want_logits = start + n == seq.len();
        out.step.chunks.push(SeqChunk {
            seq_id: id,
            tokens: seq.tokens(start..start + n),
            start_pos: start,
            block_table: seq.blocks.clone(),
            want_logits,
        });
        out.scheduled.push(Scheduled {
            seq_id: id,
            generation: seq.generation,
            num_tokens: n,
            want_logits,
        });
    }
}

/// Places each of `sampled`'s tokens against its chunk of `scheduled`, in `by_chunk` (one
/// entry a chunk, `None` where it wants none), checking one token per live chunk that returns
/// logits and none for other chunks. A runner lists the tokens in its chunks' order, so each
/// chunk is searched for from the one after the last found: a step costs a pass, not a map.
fn check_sampled(
    seqs: &U64Map<SeqId, Sequence>,
    scheduled: &[Scheduled],
    sampled: &[(SeqId, TokenId)],
    by_chunk: &mut Vec<Option<TokenId>>,
) -> Result<(), SchedulerError> {
    by_chunk.clear();
    by_chunk.resize(scheduled.len(), None);
    let n = scheduled.len();
    let mut from = 0;
    for &(id, token) in sampled {
        let found = (0..n)
            .map(|k| (from + k) % n)
            .find(|&i| scheduled[i].seq_id == id);
        let Some(i) = found.filter(|&i| scheduled[i].want_logits) else {
            return Err(SchedulerError::UnexpectedToken(id));
        };
        if by_chunk[i].replace(token).is_some() {
            return Err(SchedulerError::DuplicateToken(id));
        }
        from = i + 1;
    }
    for (r, token) in scheduled.iter().zip(by_chunk.iter()) {
        let live = seqs
            .get(&r.seq_id)
            .is_some_and(|s| s.generation == r.generation);
        if live && r.want_logits && token.is_none() {
            return Err(SchedulerError::MissingToken(r.seq_id));
        }
    }
    Ok(())
}

/// Registers the sequence's computed full blocks in the prefix cache.
fn cache_computed_blocks(pool: &mut BlockPool, seq: &mut Sequence, block_size: usize) {
    let full = seq.num_computed / block_size;
    if let Some(hashes) = seq.hashes.get(seq.num_cached_blocks..full) {
        pool.prefetch(hashes);
    }
    for i in seq.num_cached_blocks..full {
        pool.cache_full_block(seq.blocks[i], seq.hashes[i])
            .expect("a running sequence holds its blocks, each hashed once");
    }
    seq.num_cached_blocks = seq.num_cached_blocks.max(full);
}

#[cfg(test)]
mod tests;
