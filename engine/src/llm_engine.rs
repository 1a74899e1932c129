//! The engine loop: one step = schedule, execute, sample, absorb. Synchronous and single
//! threaded; servers drive it from a dedicated thread and talk to it through channels.
//!
//! Disaggregated serving adds two roles on top of the plain loop:
//! - a *prefill worker* adds `add_prefill_request` sequences (they end after their first
//!   token) and runs `step_observed`, pushing each layer's KV as soon as it is written;
//! - a *decode worker* adds `add_remote_request` sequences, starts a transfer for each one in
//!   `last_remote_admitted`, writes arriving KV with `write_kv_blocks`, and ends the wait with
//!   `complete_remote_prefill` (the first token comes from the prefill worker) or
//!   `fail_remote_prefill` (prefill locally instead, also when a transfer stalls: the
//!   worker keeps the transfer's clock). See the scheduler's module docs.

use crate::block_pool::Held;
use crate::runner::{KvSource, ModelRunner, RunnerError, SeqId, StepInput};
use crate::sampler::{Sampled, Sampler};
use crate::scheduler::{
    Admission, Import, RemoteAdmission, Scheduler, SchedulerConfig, SchedulerError,
};
use crate::tier_store::{TierError, TierStore};
use kvmesh_common::{
    BlockId, FinishReason, SamplingParams, SamplingParamsError, SequenceHash, TokenId,
};
use kvmesh_prompt::detokenizer::IncrementalDetokenizer;
use kvmesh_prompt::grammar::{ConstrainedSequence, GrammarError, Grammars};
use kvmesh_prompt::stop::StopChecker;
use kvmesh_prompt::tokenizer::Tokenizer;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    InvalidParams(#[from] SamplingParamsError),
    #[error(transparent)]
    Rejected(#[from] SchedulerError),
    #[error("model execution failed: {0}")]
    Runner(#[from] RunnerError),
    #[error("KV tier: {0}")]
    Tier(#[from] TierError),
    #[error("invalid constraint: {0}")]
    Constraint(#[from] GrammarError),
}

/// What one step produced for one sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct SeqOutput {
    pub seq_id: SeqId,
    /// The sampled token (`None` when the sequence ended without one, e.g. context full).
    pub sampled: Option<Sampled>,
    /// Raw logits of the `top_logits` best tokens at this position, best first (diagnostics).
    pub top_logits: Vec<(TokenId, f32)>,
    /// Text that is final now (held back while it could still become a stop string).
    pub text: String,
    pub finish: Option<FinishReason>,
    /// Prompt tokens served from the prefix cache; set on the sequence's first output.
    pub cached_tokens: Option<usize>,
}

struct SeqState {
    params: SamplingParams,
    sampler: Sampler,
    stop: StopChecker,
    detokenizer: IncrementalDetokenizer,
    top_logits: usize,
    cached_tokens: Option<usize>,
    reported_cached: bool,
    /// Ends after its first token: the sequence of a prefill worker.
    prefill_only: bool,
    /// Its structured-output constraint's state: masks each draw, follows each token.
    grammar: Option<ConstrainedSequence>,
}

impl SeqState {
    /// Brings a migrated sequence's per-token state to where it was after `generated`:
    /// the text they completed is dropped (the client has it already).
    fn replay(
        &mut self,
        tokenizer: &Tokenizer,
        vocab: usize,
        prompt: &[TokenId],
        generated: &[TokenId],
    ) {
        for (i, &token) in generated.iter().enumerate() {
            if !self.params.is_greedy() {
                // One draw per token, as `complete_remote_prefill` does: later draws continue
                // the same random stream.
                let mut logits = vec![0.0; vocab];
                self.sampler
                    .sample(&self.params, &mut logits, prompt, &generated[..i]);
            }
            let piece = self.detokenizer.push(tokenizer, token);
            self.stop.push_text(&piece);
            if let Some(grammar) = &mut self.grammar {
                // Tokens another node drew under the same constraint: they fit it.
                let _ = grammar.accept(token);
            }
        }
    }

    /// Masks what the constraint forbids; a grammar in error allows only the end of the
    /// sequence (the text so far stands).
    fn constrain(&mut self, logits: &mut [f32], eos: Option<TokenId>) {
        let Some(grammar) = &mut self.grammar else {
            return;
        };
        if let Err(e) = grammar.mask(logits) {
            tracing::warn!("structured output: {e}; ending the sequence");
            for (id, l) in logits.iter_mut().enumerate() {
                if Some(id as TokenId) != eos {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }
}

/// Cached KV read out for another node ([`LlmEngine::export_prefix`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportedKv {
    /// Leading blocks of the asked-for run that this engine held.
    pub blocks: usize,
    /// Per layer: those blocks' K and V in the transfer layout.
    pub layers: Vec<Vec<u8>>,
}

/// How a sequence's prompt is computed.
#[derive(Clone, Copy, Debug)]
enum Mode {
    Local,
    Remote,
    PrefillOnly,
}

/// A scheduler, a runner and the per-sequence sampling state.
pub struct LlmEngine<R: ModelRunner> {
    scheduler: Scheduler,
    runner: R,
    tokenizer: Arc<Tokenizer>,
    seqs: HashMap<SeqId, SeqState>,
    /// Admissions of the last step, kept until the next one.
    admitted: Vec<Admission>,
    remote_admitted: Vec<RemoteAdmission>,
    last_step_tokens: usize,
    tiers: TierStore,
    /// Constraint compiler over the tokenizer's vocabulary, built on first use.
    grammars: Option<Arc<Grammars>>,
}

impl<R: ModelRunner> LlmEngine<R> {
    pub fn new(config: SchedulerConfig, runner: R, tokenizer: Arc<Tokenizer>) -> Self {
        LlmEngine {
            scheduler: Scheduler::new(config),
            runner,
            tokenizer,
            seqs: HashMap::new(),
            admitted: Vec::new(),
            remote_admitted: Vec::new(),
            last_step_tokens: 0,
            tiers: TierStore::default(),
            grammars: None,
        }
    }

    /// Keeps the disk tier (`SchedulerConfig::disk_tier_blocks`) in `dir`, taking over the
    /// blocks it already holds.
    pub fn with_disk_tier(mut self, dir: std::path::PathBuf) -> std::io::Result<Self> {
        let (store, found) = TierStore::with_disk(dir)?;
        self.tiers = store;
        self.scheduler.restore_disk_tier(found);
        Ok(self)
    }

    /// Blocks whose KV the host-memory tier holds.
    pub fn host_tier_blocks(&self) -> usize {
        self.scheduler.pool().num_host_cached()
    }

    /// Blocks the disk tier holds.
    pub fn disk_tier_blocks(&self) -> usize {
        self.scheduler.pool().num_disk_cached()
    }

    /// Queues a sequence. `top_logits` asks for the raw logits of that many best tokens at
    /// each step (0 for none).
    pub fn add_request(
        &mut self,
        seq_id: SeqId,
        prompt: Vec<TokenId>,
        params: SamplingParams,
        top_logits: usize,
    ) -> Result<(), EngineError> {
        self.add(seq_id, prompt, Vec::new(), params, top_logits, Mode::Local)
    }

    /// Queues a migrated sequence: `generated` are the tokens another worker already produced
    /// (and delivered) for it. Their KV is computed like a prompt's; their text, stop-string
    /// state and random draws are replayed without output, so the tokens and text that follow
    /// are exactly those the other worker would have produced next.
    pub fn resume_request(
        &mut self,
        seq_id: SeqId,
        prompt: Vec<TokenId>,
        generated: Vec<TokenId>,
        params: SamplingParams,
        top_logits: usize,
    ) -> Result<(), EngineError> {
        self.add(seq_id, prompt, generated, params, top_logits, Mode::Local)
    }

    /// Queues a sequence whose prompt KV will come from a prefill worker (see the module
    /// docs). Once it has blocks, it waits for `complete_remote_prefill` or
    /// `fail_remote_prefill`.
    pub fn add_remote_request(
        &mut self,
        seq_id: SeqId,
        prompt: Vec<TokenId>,
        params: SamplingParams,
        top_logits: usize,
    ) -> Result<(), EngineError> {
        self.add(seq_id, prompt, Vec::new(), params, top_logits, Mode::Remote)
    }

    /// Queues a prefill-only sequence: it computes the prompt, samples the first token with
    /// `params` (as a local run would) and ends there. The step that computes its last prompt
    /// chunk returns that token.
    pub fn add_prefill_request(
        &mut self,
        seq_id: SeqId,
        prompt: Vec<TokenId>,
        params: SamplingParams,
    ) -> Result<(), EngineError> {
        self.add(seq_id, prompt, Vec::new(), params, 0, Mode::PrefillOnly)
    }

    /// The constraint compiler, built on the first constrained request.
    fn grammars(&mut self) -> Result<Arc<Grammars>, GrammarError> {
        if self.grammars.is_none() {
            self.grammars = Some(Arc::new(Grammars::new(self.tokenizer.clone())?));
        }
        Ok(self.grammars.clone().expect("built above"))
    }

    fn add(
        &mut self,
        seq_id: SeqId,
        prompt: Vec<TokenId>,
        generated: Vec<TokenId>,
        params: SamplingParams,
        top_logits: usize,
        mode: Mode,
    ) -> Result<(), EngineError> {
        params.validate()?;
        let eos = self.tokenizer.eos_token_id();
        let vocab = self.runner.vocab_size();
        if let Some(&token) = generated.iter().find(|&&t| t as usize >= vocab) {
            return Err(RunnerError::TokenOutOfRange { token, vocab }.into());
        }
        let grammar = match &params.constraint {
            Some(constraint) => Some(self.grammars()?.start(constraint)?),
            None => None,
        };
        let mut state = SeqState {
            sampler: Sampler::new(&params, eos),
            stop: StopChecker::new(&params, eos),
            detokenizer: IncrementalDetokenizer::new(&self.tokenizer, &prompt),
            params,
            top_logits,
            cached_tokens: None,
            reported_cached: false,
            prefill_only: matches!(mode, Mode::PrefillOnly),
            grammar,
        };
        state.replay(&self.tokenizer, vocab, &prompt, &generated);
        match mode {
            Mode::Local if !generated.is_empty() => self
                .scheduler
                .add_resumed_sequence(seq_id, prompt, generated)?,
            Mode::Local | Mode::PrefillOnly => self.scheduler.add_sequence(seq_id, prompt)?,
            Mode::Remote => self.scheduler.add_remote_sequence(seq_id, prompt)?,
        }
        self.seqs.insert(seq_id, state);
        Ok(())
    }

    /// Cancels a sequence and frees its blocks. Returns false if it was unknown.
    pub fn abort(&mut self, seq_id: SeqId) -> bool {
        self.seqs.remove(&seq_id);
        self.scheduler.finish(seq_id)
    }

    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    pub fn runner(&self) -> &R {
        &self.runner
    }

    /// Starts or stops recording prefix-cache changes (off by default).
    pub fn set_record_kv_events(&mut self, on: bool) {
        self.scheduler.set_record_kv_events(on);
    }

    /// Prefix-cache changes since the last call.
    pub fn drain_kv_events(&mut self) -> Vec<kvmesh_common::kv_tier::TieredKvEvent> {
        self.scheduler.drain_kv_events()
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Sequences the last step admitted to compute locally (first admissions and resumes).
    pub fn last_admitted(&self) -> &[Admission] {
        &self.admitted
    }

    /// Remote-prefill sequences the last step gave blocks: start a transfer into each.
    pub fn last_remote_admitted(&self) -> &[RemoteAdmission] {
        &self.remote_admitted
    }

    /// Tokens the last step computed; 0 when nothing could run (nothing changes until a
    /// request arrives, a transfer ends or a timeout passes).
    pub fn last_step_tokens(&self) -> usize {
        self.last_step_tokens
    }

    /// Writes KV received for a remote prefill or a pull into `blocks` (transfer layout; see
    /// [`KvSource`]). Only blocks of a `RemoteAdmission` still awaiting KV, or of an
    /// [`Import`], may be written.
    pub fn write_kv_blocks(
        &mut self,
        layers: Range<usize>,
        blocks: &[BlockId],
        payload: &[u8],
    ) -> Result<(), EngineError> {
        Ok(self.runner.write_kv_blocks(layers, blocks, payload)?)
    }

    /// Reserves blocks to pull `prompt`'s cached blocks, up to block `upto`, from another
    /// node when `worth(n)` says pulling `n` blocks pays; see [`Scheduler::reserve_import`].
    pub fn reserve_import(
        &mut self,
        prompt: &[TokenId],
        upto: usize,
        worth: impl FnOnce(usize) -> bool,
    ) -> Option<Import> {
        self.scheduler.reserve_import(prompt, upto, worth)
    }

    /// Ends a pull whose first `arrived` blocks came whole; see [`Scheduler::finish_import`].
    pub fn finish_import(&mut self, import: Import, arrived: usize) {
        self.scheduler.finish_import(import, arrived)
    }

    /// The KV of the longest leading run of `hashes` this engine holds, in its pool or a
    /// tier below, for another node to pull: one payload per layer, each the run's blocks in
    /// order in the transfer layout. A lower-tier copy that cannot be read ends the run.
    pub fn export_prefix(&self, hashes: &[SequenceHash]) -> Result<ExportedKv, EngineError> {
        /// Where one block's KV is read from.
        enum Source {
            Pool(BlockId),
            /// A lower tier's copy: every layer, in the transfer layout.
            Copy(Vec<u8>),
        }
        let pool = self.scheduler.pool();
        let mut sources = Vec::new();
        for &hash in hashes {
            let source = match pool.locate(hash) {
                None => break,
                Some(Held::Device(block)) => Source::Pool(block),
                Some(Held::Lower(tier)) => match self.tiers.read(hash, tier) {
                    Ok(bytes) => Source::Copy(bytes),
                    Err(e) => {
                        tracing::warn!("exporting cached KV: {e}; sending the blocks before it");
                        break;
                    }
                },
            };
            sources.push(source);
        }
        let shape = self.runner.kv_shape();
        let per_layer = shape.block_bytes_per_layer();
        let mut layers = vec![Vec::with_capacity(sources.len() * per_layer); shape.num_layers];
        for (layer, out) in layers.iter_mut().enumerate() {
            for source in &sources {
                match source {
                    Source::Pool(block) => self.runner.read_kv_blocks(layer, &[*block], out)?,
                    Source::Copy(bytes) => {
                        let range = layer * per_layer..(layer + 1) * per_layer;
                        let Some(slice) = bytes.get(range) else {
                            return Err(RunnerError::KvPayloadSize {
                                expected: shape.num_layers * per_layer,
                                got: bytes.len(),
                            }
                            .into());
                        };
                        out.extend_from_slice(slice);
                    }
                }
            }
        }
        Ok(ExportedKv {
            blocks: sources.len(),
            layers,
        })
    }

    /// Ends a remote prefill whose KV arrived intact: appends `first`, the token the prefill
    /// worker sampled, and returns its output (text, finish) as `step` would have.
    /// `remote_cached_tokens` is how much of the prompt the prefill worker served from its
    /// own cache; usage reports the larger of that and the local hits.
    pub fn complete_remote_prefill(
        &mut self,
        seq_id: SeqId,
        first: Sampled,
        remote_cached_tokens: usize,
    ) -> Result<SeqOutput, EngineError> {
        let vocab = self.runner.vocab_size();
        if first.token as usize >= vocab {
            return Err(RunnerError::TokenOutOfRange {
                token: first.token,
                vocab,
            }
            .into());
        }
        let (Some(state), Some(tokens)) = (
            self.seqs.get_mut(&seq_id),
            self.scheduler.sequence_tokens(seq_id),
        ) else {
            return Err(SchedulerError::NotAwaitingKv(seq_id).into());
        };
        if !self.scheduler.is_awaiting_kv(seq_id) {
            return Err(SchedulerError::NotAwaitingKv(seq_id).into());
        }
        if !state.params.is_greedy() {
            // The prefill worker drew once from this request's random stream (same seed); draw
            // once here too, so every later token matches a local run.
            let mut logits = vec![0.0; vocab];
            state
                .sampler
                .sample(&state.params, &mut logits, tokens.prompt, &[]);
        }
        let cached = state.cached_tokens.unwrap_or(0).max(remote_cached_tokens);
        state.cached_tokens = Some(cached);
        let outcome = self
            .scheduler
            .complete_remote_prefill(seq_id, first.token)?;
        let mut outputs = vec![SeqOutput {
            seq_id,
            sampled: Some(first),
            top_logits: Vec::new(),
            text: String::new(),
            finish: None,
            cached_tokens: None,
        }];
        self.finish_outputs(&mut outputs, &outcome.context_full);
        Ok(outputs.pop().expect("one output"))
    }

    /// Gives up on a remote prefill (transfer failed, corrupt or the prefill worker is gone):
    /// the sequence prefills locally instead. False if it is not a remote prefill.
    pub fn fail_remote_prefill(&mut self, seq_id: SeqId) -> bool {
        self.scheduler.fail_remote_prefill(seq_id)
    }

    /// Runs one step and returns what every sequence that advanced produced.
    pub fn step(&mut self) -> Result<Vec<SeqOutput>, EngineError> {
        self.step_observed(&mut |_, _, _| {})
    }

    /// `step`, calling `on_layer(l, step, kv)` as soon as layer `l`'s KV of `step` is written,
    /// so a prefill worker can push that layer while the next ones compute.
    pub fn step_observed(
        &mut self,
        on_layer: &mut (dyn FnMut(usize, &StepInput, &dyn KvSource) + Send),
    ) -> Result<Vec<SeqOutput>, EngineError> {
        self.admitted.clear();
        self.remote_admitted.clear();
        let plan = loop {
            let plan = self.scheduler.schedule();
            self.admitted.extend_from_slice(&plan.admitted);
            self.remote_admitted
                .extend_from_slice(&plan.remote_admitted);
            // Before anything reuses a block the plan evicted, or reads one it promoted.
            let moves = self.scheduler.drain_tier_moves();
            let applied = self.tiers.apply(moves, &mut self.runner);
            for hash in applied.lost {
                self.scheduler.forget_lower(hash);
            }
            if applied.failed.is_empty() {
                break plan;
            }
            // A promoted block without its KV: the sequences that took it recompute instead,
            // and the plan is made again without it.
            let blocks: Vec<BlockId> = applied.failed.iter().map(|(b, _)| *b).collect();
            let sent_back = self.scheduler.discard_blocks(&blocks);
            self.admitted.retain(|a| !sent_back.contains(&a.seq_id));
            self.remote_admitted
                .retain(|a| !sent_back.contains(&a.seq_id));
            self.scheduler.abort_step(plan);
        };
        self.last_step_tokens = plan.step.num_tokens();
        for a in &self.admitted {
            if let Some(s) = self.seqs.get_mut(&a.seq_id) {
                s.cached_tokens.get_or_insert(a.num_cached_tokens);
            }
        }
        for a in &self.remote_admitted {
            if let Some(s) = self.seqs.get_mut(&a.seq_id) {
                s.cached_tokens.get_or_insert(a.num_cached_tokens);
            }
        }
        if plan.is_empty() {
            self.scheduler.abort_step(plan);
            return Ok(Vec::new());
        }
        let step = &plan.step;
        let result = self
            .runner
            .execute_observed(step, &mut |layer, kv| on_layer(layer, step, kv));
        let result = match result {
            Ok(r) => r,
            Err(e) => {
                self.scheduler.abort_step(plan);
                return Err(e.into());
            }
        };

        let mut sampled = Vec::with_capacity(result.logits.len());
        let mut outputs = Vec::with_capacity(result.logits.len());
        let mut logits_by_seq = result.logits;
        self.constrain_all(&mut logits_by_seq);
        for (seq_id, mut logits) in logits_by_seq {
            let (Some(state), Some(tokens)) = (
                self.seqs.get_mut(&seq_id),
                self.scheduler.sequence_tokens(seq_id),
            ) else {
                continue;
            };
            // For a constrained sequence, the best the format allows (masked above).
            let top_logits = top_n(&logits, state.top_logits);
            let s = state
                .sampler
                .sample(&state.params, &mut logits, tokens.prompt, tokens.output);
            sampled.push((seq_id, s.token));
            outputs.push(SeqOutput {
                seq_id,
                sampled: Some(s),
                top_logits,
                text: String::new(),
                finish: None,
                cached_tokens: None,
            });
        }
        let outcome = self.scheduler.update_from_output(plan, &sampled)?;
        self.finish_outputs(&mut outputs, &outcome.context_full);
        Ok(outputs)
    }

    /// Masks what each constrained sequence's format forbids, the sequences in parallel
    /// (each has its own parser; a mask costs tens of microseconds).
    fn constrain_all(&mut self, logits: &mut [(SeqId, Vec<f32>)]) {
        use rayon::prelude::*;
        let eos = self.tokenizer.eos_token_id();
        let mut constrained: HashMap<SeqId, &mut SeqState> = self
            .seqs
            .iter_mut()
            .filter(|(_, s)| s.grammar.is_some())
            .map(|(id, s)| (*id, s))
            .collect();
        if constrained.is_empty() {
            return;
        }
        let mut jobs: Vec<(&mut Vec<f32>, &mut SeqState)> = logits
            .iter_mut()
            .filter_map(|(id, l)| Some((l, constrained.remove(id)?)))
            .collect();
        jobs.par_iter_mut()
            .for_each(|(l, state)| state.constrain(l, eos));
    }

    /// Stop checks, detokenization and cleanup of sequences that just got a token.
    fn finish_outputs(&mut self, outputs: &mut [SeqOutput], context_full: &[SeqId]) {
        let mut matched_stop_string = Vec::new();
        for out in outputs.iter_mut() {
            let state = self.seqs.get_mut(&out.seq_id).expect("sampled above");
            let token = out.sampled.as_ref().expect("sampled above").token;
            let generated = self
                .scheduler
                .sequence_tokens(out.seq_id)
                .map_or(0, |t| t.output.len());
            out.finish = state.stop.check_token(token, generated);
            if out.finish != Some(FinishReason::Stop) {
                let piece = state.detokenizer.push(&self.tokenizer, token);
                let (text, hit) = state.stop.push_text(&piece);
                out.text = text;
                if hit {
                    out.finish = Some(FinishReason::Stop);
                    matched_stop_string.push(out.seq_id);
                }
            }
            if let Some(grammar) = &mut state.grammar {
                // The constraint's language ends here: nothing more may follow.
                if grammar.accept(token).is_err() || grammar.is_finished() {
                    out.finish.get_or_insert(FinishReason::Stop);
                }
            }
            if context_full.contains(&out.seq_id) || state.prefill_only {
                out.finish.get_or_insert(FinishReason::Length);
            }
        }
        for out in outputs.iter_mut() {
            let state = self.seqs.get_mut(&out.seq_id).expect("sampled above");
            if !state.reported_cached {
                state.reported_cached = true;
                out.cached_tokens = state.cached_tokens;
            }
            if out.finish.is_some() {
                let mut state = self.seqs.remove(&out.seq_id).expect("sampled above");
                // Flush held-back text unless a stop string cut it off.
                if !matched_stop_string.contains(&out.seq_id) {
                    let tail = state.detokenizer.finish();
                    out.text.push_str(&state.stop.push_text(&tail).0);
                    out.text.push_str(&state.stop.flush());
                }
                self.scheduler.finish(out.seq_id);
            }
        }
    }
}

/// The `n` largest logits, best first.
fn top_n(logits: &[f32], n: usize) -> Vec<(TokenId, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let n = n.min(ids.len());
    ids.select_nth_unstable_by(n - 1, |&a, &b| {
        logits[b as usize].total_cmp(&logits[a as usize])
    });
    ids.truncate(n);
    ids.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    ids.into_iter().map(|t| (t, logits[t as usize])).collect()
}
