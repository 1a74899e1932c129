//! The engine loop: one step = schedule, execute, sample, absorb. Synchronous and single
//! threaded; servers drive it from a dedicated thread and talk to it through channels.
//!
//! Structured outputs ride on the same loop. The grammar state of a constrained sequence
//! is final once its last token is known, so the tokens it allows next are computed on the
//! rayon pool while the model computes the logits (`set_mask_overlap`), and applied to them
//! after. Where the grammar forces the next tokens (a JSON schema's keys and punctuation),
//! they follow the drawn token in the same step's outputs, without a draw each, and the
//! next step computes them together (`set_fast_forward`).
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
use crate::runner::{DeviceDraw, KvSource, ModelRunner, RunnerError, SeqId, StepInput};
use crate::sampler::device_draw::device_draw;
use crate::sampler::{Sampled, Sampler};
use crate::scheduler::{
    Admission, Import, RemoteAdmission, Scheduler, SchedulerConfig, SchedulerError, StepShape,
};
use crate::tier_store::{TierError, TierStore};
use kvmesh_common::{
    BlockId, FinishReason, SamplingParams, SamplingParamsError, SequenceHash, StepTotals, TokenId,
};
use kvmesh_prompt::detokenizer::IncrementalDetokenizer;
use kvmesh_prompt::grammar::{AllowedTokens, ConstrainedSequence, GrammarError, Grammars};
use kvmesh_prompt::stop::StopChecker;
use kvmesh_prompt::tokenizer::Tokenizer;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// One token a step produced for one sequence. A structured output whose format forces
/// the tokens after the drawn one gets several outputs in one step, in order: each is a
/// generated token like any other (stop conditions, usage, streaming).
#[derive(Clone, Debug, PartialEq)]
pub struct SeqOutput {
    pub seq_id: SeqId,
    /// The token (`None` when the sequence ended without one, e.g. context full). A forced
    /// token has log-probability 0 (probability 1 under the constraint) and, when
    /// log-probabilities are asked for, itself as its only top alternative.
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
    /// Tokens generated so far (delivered before a migration included): what `max_tokens`
    /// counts.
    num_generated: usize,
    /// Forced tokens a migration cut off: already among the sequence's tokens (computed with
    /// them), delivered before its next drawn token.
    undelivered: Vec<TokenId>,
}

impl SeqState {
    /// Brings a migrated sequence's per-token state to where it was after `generated`:
    /// the text they completed is dropped (the client has it already). Tokens the format
    /// forced (with `fast_forward`, as this engine would have forced them) took no draw.
    /// Returns the rest of a forced run that `generated` cuts off: see `deliver_later`.
    fn replay(
        &mut self,
        tokenizer: &Tokenizer,
        vocab: usize,
        prompt: &[TokenId],
        generated: &[TokenId],
        fast_forward: bool,
    ) -> Vec<TokenId> {
        let mut forced = std::collections::VecDeque::new();
        for (i, &token) in generated.iter().enumerate() {
            let was_forced = forced.front() == Some(&token);
            if was_forced {
                forced.pop_front();
            } else {
                forced.clear();
                if !self.params.is_greedy() {
                    // One draw per drawn token, as `complete_remote_prefill` does: later
                    // draws continue the same random stream.
                    let mut logits = vec![0.0; vocab];
                    self.sampler
                        .sample(&self.params, &mut logits, prompt, &generated[..i]);
                }
            }
            let piece = self.detokenizer.push(tokenizer, token);
            self.stop.push_text(&piece);
            if let Some(grammar) = &mut self.grammar {
                // Tokens another node drew under the same constraint: they fit it.
                let _ = grammar.accept(token);
                if fast_forward && !was_forced {
                    forced = grammar.forced_tokens().into();
                }
            }
        }
        self.num_generated = generated.len();
        forced.into()
    }

    /// Follows forced tokens that join the sequence's tokens now and are delivered before its
    /// next drawn token.
    fn deliver_later(&mut self, tokens: Vec<TokenId>) {
        if let Some(grammar) = &mut self.grammar {
            for &token in &tokens {
                let _ = grammar.accept(token);
            }
        }
        self.undelivered = tokens;
    }

    /// Follows the run's drawn token (its last) in the format, and appends the tokens the
    /// format forces after it (with `fast_forward`; not for a prefill-only sequence, which
    /// ends with its drawn token). A token that completes the format (or breaks it) ends the
    /// sequence.
    fn follow_format(&mut self, run: &mut Run, fast_forward: bool) {
        run.forced_from = run.tokens.len();
        let Some(grammar) = &mut self.grammar else {
            return;
        };
        let drawn = run.tokens.last_mut().expect("a drawn token");
        if grammar.accept(drawn.token()).is_err() || grammar.is_finished() {
            drawn.format_end = true;
            return;
        }
        if !fast_forward || self.prefill_only {
            return;
        }
        for token in grammar.forced_tokens() {
            let format_end = grammar.accept(token).is_err() || grammar.is_finished();
            run.tokens.push(NewToken {
                output: forced_output(run.seq_id, token, &self.params),
                format_end,
            });
            if format_end {
                break;
            }
        }
    }
}

/// One sequence's new tokens of one step, in order: forced tokens a migration cut off, the
/// drawn token, then the tokens its format forces after it.
struct Run {
    seq_id: SeqId,
    tokens: Vec<NewToken>,
    /// Where the forced tokens after the drawn one start: the scheduler appends them.
    forced_from: usize,
}

impl Run {
    fn new(seq_id: SeqId) -> Self {
        Run {
            seq_id,
            tokens: Vec::new(),
            forced_from: 0,
        }
    }

    fn forced(&self) -> Vec<TokenId> {
        self.tokens[self.forced_from..]
            .iter()
            .map(NewToken::token)
            .collect()
    }
}

struct NewToken {
    output: SeqOutput,
    /// The format is complete with this token (or broken): the sequence ends here.
    format_end: bool,
}

impl NewToken {
    fn token(&self) -> TokenId {
        self.output.sampled.as_ref().expect("a token").token
    }
}

/// The output of a token the format forced: probability 1 under the constraint.
fn forced_output(seq_id: SeqId, token: TokenId, params: &SamplingParams) -> SeqOutput {
    let top_logprobs = match params.logprobs {
        Some(n) if n > 0 => vec![(token, 0.0)],
        _ => Vec::new(),
    };
    SeqOutput {
        seq_id,
        sampled: Some(Sampled {
            token,
            logprob: params.logprobs.map(|_| 0.0),
            top_logprobs,
        }),
        top_logits: Vec::new(),
        text: String::new(),
        finish: None,
        cached_tokens: None,
    }
}

/// What each constrained sequence that draws this step may draw, or why its grammar failed.
type Masks = Vec<(SeqId, Result<AllowedTokens, GrammarError>)>;

/// Computes the masks of `ids`' grammars, in parallel (each has its own parser; a mask costs
/// tens of microseconds).
fn compute_masks(seqs: &mut HashMap<SeqId, SeqState>, ids: &[SeqId]) -> Masks {
    use rayon::prelude::*;
    let mut grammars: Vec<(SeqId, &mut ConstrainedSequence)> = seqs
        .iter_mut()
        .filter(|(id, _)| ids.contains(id))
        .filter_map(|(&id, s)| Some((id, s.grammar.as_mut()?)))
        .collect();
    let compute =
        |(id, grammar): &mut (SeqId, &mut ConstrainedSequence)| (*id, grammar.allowed_tokens());
    if grammars.len() > 1 {
        grammars.par_iter_mut().map(compute).collect()
    } else {
        grammars.iter_mut().map(compute).collect()
    }
}

/// Masks what each constrained sequence's format forbids; a grammar in error allows only the
/// end of the sequence (the text so far stands).
fn apply_masks(logits: &mut [(SeqId, Vec<f32>)], masks: Masks, eos: Option<TokenId>) {
    use rayon::prelude::*;
    if masks.is_empty() {
        return;
    }
    let masks: HashMap<SeqId, Result<AllowedTokens, GrammarError>> = masks.into_iter().collect();
    let apply = |(id, logits): &mut (SeqId, Vec<f32>)| match masks.get(id) {
        None => {}
        Some(Ok(allowed)) => allowed.apply(logits),
        Some(Err(e)) => {
            tracing::warn!("structured output: {e}; ending the sequence");
            for (t, l) in logits.iter_mut().enumerate() {
                if Some(t as TokenId) != eos {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    };
    if masks.len() > 1 {
        logits.par_iter_mut().for_each(apply);
    } else {
        logits.iter_mut().for_each(apply);
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
    /// Running totals: steps that ran the model (what they held, how long they took), and
    /// tokens they delivered (drawn or forced).
    step_totals: StepTotals,
    tokens_generated: u64,
    tiers: TierStore,
    /// Constraint compiler over the tokenizer's vocabulary, built on first use.
    grammars: Option<Arc<Grammars>>,
    /// Forced tokens follow the drawn one without a draw each.
    fast_forward: bool,
    /// Masks are computed while the model runs, not after it.
    mask_overlap: bool,
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
            step_totals: StepTotals::default(),
            tokens_generated: 0,
            tiers: TierStore::default(),
            grammars: None,
            fast_forward: true,
            mask_overlap: true,
        }
    }

    /// Whether the tokens a structured output's format forces follow the drawn token in the
    /// same step, without a draw each (on by default). Off, every token takes a step and a
    /// draw from the masked logits; the text is in the format either way, but the tokens (the
    /// model may spell a forced text differently) and a seeded run's later draws differ. A
    /// migrated request must resume on an engine with the same setting to continue exactly.
    pub fn set_fast_forward(&mut self, on: bool) {
        self.fast_forward = on;
    }

    /// See [`crate::engine_config::EngineConfig::max_step_time`].
    pub fn set_max_step_time(&mut self, target: Option<Duration>) {
        self.scheduler.set_max_step_time(target);
    }

    /// Whether the masks of a step's constrained sequences are computed while the model
    /// computes their logits (on by default) or after it. The tokens are the same either way.
    pub fn set_mask_overlap(&mut self, on: bool) {
        self.mask_overlap = on;
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
            num_generated: 0,
            undelivered: Vec::new(),
        };
        let mut cut_off = state.replay(
            &self.tokenizer,
            vocab,
            &prompt,
            &generated,
            self.fast_forward,
        );
        // The forced tokens a migration cut off are computed with the delivered ones; room is
        // left for a drawn token after them.
        let config = self.scheduler.config();
        let max_len = config
            .max_model_len
            .min(config.num_blocks * config.block_size);
        cut_off.truncate(max_len.saturating_sub(prompt.len() + generated.len() + 1));
        let mut generated = generated;
        generated.extend_from_slice(&cut_off);
        state.deliver_later(cut_off);
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

    /// Steps that ran the model since the engine was made.
    pub fn steps_run(&self) -> u64 {
        self.step_totals.steps
    }

    /// The steps that ran the model since the engine was made, summed.
    pub fn step_totals(&self) -> StepTotals {
        self.step_totals
    }

    /// Tokens the steps delivered since the engine was made: drawn, and forced by a format.
    pub fn tokens_generated(&self) -> u64 {
        self.tokens_generated
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
    /// worker sampled, and returns its output (text, finish) as `step` would have, followed
    /// by those of the tokens its format forces after it.
    /// `remote_cached_tokens` is how much of the prompt the prefill worker served from its
    /// own cache; usage reports the larger of that and the local hits.
    pub fn complete_remote_prefill(
        &mut self,
        seq_id: SeqId,
        first: Sampled,
        remote_cached_tokens: usize,
    ) -> Result<Vec<SeqOutput>, EngineError> {
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
        let mut run = Run::new(seq_id);
        run.tokens.push(NewToken {
            output: SeqOutput {
                seq_id,
                sampled: Some(first),
                top_logits: Vec::new(),
                text: String::new(),
                finish: None,
                cached_tokens: None,
            },
            format_end: false,
        });
        state.follow_format(&mut run, self.fast_forward);
        let first = run.tokens[0].token();
        let outcome = self.scheduler.complete_remote_prefill(seq_id, first)?;
        let mut runs = vec![run];
        let context_full = self.append_forced(&mut runs, outcome.context_full);
        Ok(self.finish_outputs(runs, &context_full))
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
        // The whole step, planning and sampling too, is the gap its decoding streams see.
        let started = Instant::now();
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
        let shape = StepShape::of(step);
        let work = step.totals();
        // The constrained sequences that draw this step: their grammar state is final, so what
        // they may draw is computed while the model runs.
        let drawing: Vec<SeqId> = step
            .chunks
            .iter()
            .filter(|c| c.want_logits)
            .filter(|c| {
                self.seqs
                    .get(&c.seq_id)
                    .is_some_and(|s| s.grammar.is_some())
            })
            .map(|c| c.seq_id)
            .collect();
        // The draws the runner's device makes itself, when it can: the rest come back as
        // logits for the host's sampler.
        let draws = if self.runner.draws_on_device() {
            device_draws(&mut self.seqs, &self.scheduler, step)
        } else {
            Vec::new()
        };
        let mut masks = Masks::new();
        let result = if self.mask_overlap && !drawing.is_empty() {
            let (runner, seqs) = (&mut self.runner, &mut self.seqs);
            // The model on this thread, the masks on the rayon pool.
            rayon::in_place_scope(|scope| {
                scope.spawn(|_| masks = compute_masks(seqs, &drawing));
                runner.execute_drawing(step, &draws, &mut |layer, kv| on_layer(layer, step, kv))
            })
        } else {
            let result = self
                .runner
                .execute_drawing(step, &draws, &mut |layer, kv| on_layer(layer, step, kv));
            if result.is_ok() {
                masks = compute_masks(&mut self.seqs, &drawing);
            }
            result
        };
        let result = match result {
            Ok(r) => r,
            Err(e) => {
                self.scheduler.abort_step(plan);
                return Err(e.into());
            }
        };

        let mut logits_by_seq = result.logits;
        apply_masks(&mut logits_by_seq, masks, self.tokenizer.eos_token_id());
        let rows = logits_by_seq.len() + result.drawn.len();
        let picks = logits_by_seq
            .into_iter()
            .map(|(seq_id, logits)| (seq_id, Pick::Logits(logits)))
            .chain(
                result
                    .drawn
                    .into_iter()
                    .map(|(seq_id, token)| (seq_id, Pick::Drawn(token))),
            );
        let mut sampled = Vec::with_capacity(rows);
        let mut runs = Vec::with_capacity(rows);
        for (seq_id, pick) in picks {
            let (Some(state), Some(tokens)) = (
                self.seqs.get_mut(&seq_id),
                self.scheduler.sequence_tokens(seq_id),
            ) else {
                continue;
            };
            let (top_logits, s) = match pick {
                Pick::Logits(mut logits) => {
                    // For a constrained sequence, the best the format allows (masked above).
                    let top_logits = top_n(&logits, state.top_logits);
                    let s = state.sampler.sample(
                        &state.params,
                        &mut logits,
                        tokens.prompt,
                        tokens.output,
                    );
                    (top_logits, s)
                }
                // Drawn on the device: only sequences that want no top logits or logprobs.
                Pick::Drawn(token) => (
                    Vec::new(),
                    Sampled {
                        token,
                        logprob: None,
                        top_logprobs: Vec::new(),
                    },
                ),
            };
            sampled.push((seq_id, s.token));
            let mut run = Run::new(seq_id);
            let undelivered = std::mem::take(&mut state.undelivered);
            let last = undelivered.len().checked_sub(1);
            for (i, token) in undelivered.into_iter().enumerate() {
                // Replayed already: the format may be complete with the last of them.
                let format_end =
                    Some(i) == last && state.grammar.as_ref().is_some_and(|g| g.is_finished());
                run.tokens.push(NewToken {
                    output: forced_output(seq_id, token, &state.params),
                    format_end,
                });
            }
            run.tokens.push(NewToken {
                output: SeqOutput {
                    seq_id,
                    sampled: Some(s),
                    top_logits,
                    text: String::new(),
                    finish: None,
                    cached_tokens: None,
                },
                format_end: false,
            });
            state.follow_format(&mut run, self.fast_forward);
            runs.push(run);
        }
        let outcome = self.scheduler.update_from_output(plan, &sampled)?;
        let context_full = self.append_forced(&mut runs, outcome.context_full);
        let outputs = self.finish_outputs(runs, &context_full);
        let took = started.elapsed();
        self.scheduler.observe_step_time(shape, took);
        self.step_totals = self.step_totals.plus(StepTotals {
            micros: took.as_micros() as u64,
            ..work
        });
        self.tokens_generated += outputs.len() as u64;
        Ok(outputs)
    }

    /// Appends each run's forced tokens to its sequence, up to the one that fills the
    /// context (none when the drawn token filled it). Returns the sequences whose context is
    /// full: each run ends with the token that filled it.
    fn append_forced(&mut self, runs: &mut [Run], mut context_full: Vec<SeqId>) -> Vec<SeqId> {
        for run in runs.iter_mut() {
            if context_full.contains(&run.seq_id) {
                run.tokens.truncate(run.forced_from);
                continue;
            }
            let forced = run.forced();
            if forced.is_empty() {
                continue;
            }
            let appended = self.scheduler.append_tokens(run.seq_id, &forced);
            run.tokens.truncate(run.forced_from + appended.count);
            if appended.context_full {
                context_full.push(run.seq_id);
            }
        }
        context_full
    }

    /// Stop checks, detokenization and cleanup, token by token, of the sequences that just
    /// got tokens: a sequence's run ends at its first token that finishes it.
    fn finish_outputs(&mut self, runs: Vec<Run>, context_full: &[SeqId]) -> Vec<SeqOutput> {
        let mut outputs = Vec::with_capacity(runs.iter().map(|r| r.tokens.len()).sum());
        for run in runs {
            let seq_id = run.seq_id;
            let Some(state) = self.seqs.get_mut(&seq_id) else {
                continue;
            };
            let n = run.tokens.len();
            let mut matched_stop_string = false;
            let mut finished = false;
            for (i, new) in run.tokens.into_iter().enumerate() {
                let token = new.token();
                let mut out = new.output;
                state.num_generated += 1;
                out.finish = state.stop.check_token(token, state.num_generated);
                if out.finish != Some(FinishReason::Stop) {
                    let piece = state.detokenizer.push(&self.tokenizer, token);
                    let (text, hit) = state.stop.push_text(&piece);
                    out.text = text;
                    if hit {
                        out.finish = Some(FinishReason::Stop);
                        matched_stop_string = true;
                    }
                }
                if new.format_end {
                    // The constraint's language ends here: nothing more may follow.
                    out.finish.get_or_insert(FinishReason::Stop);
                }
                if i + 1 == n && (context_full.contains(&seq_id) || state.prefill_only) {
                    out.finish.get_or_insert(FinishReason::Length);
                }
                if !state.reported_cached {
                    state.reported_cached = true;
                    out.cached_tokens = state.cached_tokens;
                }
                finished = out.finish.is_some();
                outputs.push(out);
                if finished {
                    break;
                }
            }
            if finished {
                let mut state = self.seqs.remove(&seq_id).expect("looked up above");
                // Flush held-back text unless a stop string cut it off.
                if !matched_stop_string {
                    let out = outputs.last_mut().expect("pushed above");
                    let tail = state.detokenizer.finish();
                    out.text.push_str(&state.stop.push_text(&tail).0);
                    out.text.push_str(&state.stop.flush());
                }
                self.scheduler.finish(seq_id);
            }
        }
        outputs
    }
}

/// A sequence's share of a step's output: logits for the host's sampler, or a token the
/// runner drew.
enum Pick {
    Logits(Vec<f32>),
    Drawn(TokenId),
}

/// The draws of `step` a device may make (see `sampler::device_draw`), each taking its
/// number from its sequence's random stream.
fn device_draws(
    seqs: &mut HashMap<SeqId, SeqState>,
    scheduler: &Scheduler,
    step: &StepInput,
) -> Vec<DeviceDraw> {
    let mut draws = Vec::new();
    for c in step.chunks.iter().filter(|c| c.want_logits) {
        let (Some(state), Some(tokens)) =
            (seqs.get_mut(&c.seq_id), scheduler.sequence_tokens(c.seq_id))
        else {
            continue;
        };
        if state.grammar.is_some() {
            continue;
        }
        if let Some(params) = device_draw(&state.params, tokens.output.len(), state.top_logits) {
            draws.push(DeviceDraw {
                seq_id: c.seq_id,
                params,
                uniform: state.sampler.uniform(),
            });
        }
    }
    draws
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
