//! `MockRunner`: a weight-free `ModelRunner` for simulating a serving fleet at scale.
//!
//! This is a product feature, not a test helper: the discrete-event simulator (`kvmesh sim`,
//! `bench`) runs real schedulers, routers and planners on thousands of mock nodes, and policy
//! tests use it where a GPU would be too slow or absent. It computes nothing; it
//!
//! - returns deterministic fake logits: the favoured next token depends only on the last token
//!   and its position, so outputs are reproducible, independent of batching and identical
//!   after a preemption recomputes a sequence;
//! - validates every chunk the way the real runner does (block table coverage, block ids,
//!   token ids, context length), so scheduler bugs surface in simulation;
//! - prices each step with a [`CostModel`] and reports that duration. It never sleeps: a
//!   simulator advances its virtual clock by [`MockRunner::last_step_time`]; a real-time
//!   wrapper may sleep for it;
//! - stores no KV: reading blocks for a transfer yields zeros of the real size (so transfer
//!   volumes are modelled), and writing received blocks only checks their addresses.

use crate::kv_blocks;
use crate::runner::{KvShape, KvSource, ModelRunner, RunnerError, SeqChunk, StepInput, StepOutput};
use kvmesh_common::{BlockId, TokenId};
use std::ops::Range;
use std::time::Duration;

/// Time one step takes on the modelled hardware. Defaults approximate an 8B Llama (GQA, f16)
/// on one H100-class GPU; calibrate against a real node with `kvmesh bench`.
///
/// `step_time = decode_step_base + prefill_per_token * prefill tokens
///            + decode_per_seq * decode sequences + per_context_token * KV tokens read`,
/// and zero for an empty step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    /// Paid once per non-empty step: streaming the weights through the GPU plus launch and
    /// sampling overhead. Dominates small decode batches, which is why batching pays.
    pub decode_step_base: Duration,
    /// Per token of a prefill chunk (more than one token): compute-bound matmuls. Prefill
    /// attention's quadratic term is small next to the matmuls at common lengths and is
    /// folded in here.
    pub prefill_per_token: Duration,
    /// Per decoding sequence (a one-token chunk): its share of the batched matmuls.
    pub decode_per_seq: Duration,
    /// Per token of KV context a chunk reads (`start_pos + tokens`): attention is
    /// memory-bound, so long contexts slow decoding even at a fixed batch size.
    pub per_context_token: Duration,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            decode_step_base: Duration::from_micros(5_000),
            prefill_per_token: Duration::from_micros(60),
            decode_per_seq: Duration::from_micros(50),
            per_context_token: Duration::from_nanos(40),
        }
    }
}

impl CostModel {
    /// A model where every step is free: for tests that only care about token flow.
    pub fn zero() -> Self {
        CostModel {
            decode_step_base: Duration::ZERO,
            prefill_per_token: Duration::ZERO,
            decode_per_seq: Duration::ZERO,
            per_context_token: Duration::ZERO,
        }
    }

    /// How long `input` takes to execute.
    pub fn step_time(&self, input: &StepInput) -> Duration {
        if input.chunks.is_empty() {
            return Duration::ZERO;
        }
        let mut prefill_tokens = 0u32;
        let mut decode_seqs = 0u32;
        let mut context_tokens = 0u64;
        for chunk in &input.chunks {
            match chunk.tokens.len() {
                1 => decode_seqs += 1,
                n => prefill_tokens += n as u32,
            }
            context_tokens += (chunk.start_pos + chunk.tokens.len()) as u64;
        }
        self.decode_step_base
            + self.prefill_per_token * prefill_tokens
            + self.decode_per_seq * decode_seqs
            + scale(self.per_context_token, context_tokens)
    }
}

/// `d * n` for a count that may not fit the `u32` that `Duration`'s `Mul` takes.
fn scale(d: Duration, n: u64) -> Duration {
    Duration::from_nanos((d.as_nanos() as u64).saturating_mul(n))
}

/// The logit of the favoured token; every other token gets 0. At temperature 1 over a 32k
/// vocabulary the favoured token wins about 40% of draws, so sampling still varies.
pub const FAVOURED_LOGIT: f32 = 10.0;

/// See the module docs.
#[derive(Debug)]
pub struct MockRunner {
    kv_shape: KvShape,
    vocab_size: usize,
    max_context: usize,
    cost: CostModel,
    last_step_time: Duration,
    total_time: Duration,
}

impl MockRunner {
    /// # Panics
    /// If `vocab_size` is zero.
    pub fn new(kv_shape: KvShape, vocab_size: usize, max_context: usize, cost: CostModel) -> Self {
        assert!(vocab_size > 0, "vocab_size must be positive");
        MockRunner {
            kv_shape,
            vocab_size,
            max_context,
            cost,
            last_step_time: Duration::ZERO,
            total_time: Duration::ZERO,
        }
    }

    /// The token the fake model favours after `last` at position `pos`. Public so simulations
    /// and tests can predict greedy outputs. `vocab_size` must be positive.
    pub fn favoured_token(last: TokenId, pos: usize, vocab_size: usize) -> TokenId {
        // Each token follows from the last, so a simulated node's tokens are one chain of
        // these: one 128-bit multiply mixes (wyhash's), and the high word of another maps the
        // mix onto the vocabulary, where a division took tens of cycles.
        let product = u128::from(u64::from(last) ^ 0x2d35_8dcc_aa6c_78a5)
            * u128::from(pos as u64 ^ 0x8bb8_4b93_962e_acc9);
        let mixed = (product as u64) ^ (product >> 64) as u64;
        ((u128::from(mixed) * vocab_size as u128) >> 64) as TokenId
    }

    pub fn cost_model(&self) -> &CostModel {
        &self.cost
    }

    /// Modelled duration of the last successful `execute`.
    pub fn last_step_time(&self) -> Duration {
        self.last_step_time
    }

    /// Sum of the modelled durations of every successful `execute`.
    pub fn total_time(&self) -> Duration {
        self.total_time
    }

    fn validate(&self, chunk: &SeqChunk) -> Result<(), RunnerError> {
        let end = chunk.start_pos + chunk.tokens.len();
        if end > self.max_context {
            return Err(RunnerError::ContextOverflow {
                pos: end - 1,
                max: self.max_context,
            });
        }
        let covered = chunk.block_table.len() * self.kv_shape.block_size;
        if covered < end {
            return Err(RunnerError::BlockTableTooShort {
                seq_id: chunk.seq_id,
                needed: end,
                covered,
            });
        }
        if let Some(b) = chunk
            .block_table
            .iter()
            .find(|b| b.0 as usize >= self.kv_shape.num_blocks)
        {
            return Err(RunnerError::BlockOutOfRange {
                block: b.0,
                num_blocks: self.kv_shape.num_blocks,
            });
        }
        if let Some(&token) = chunk
            .tokens
            .iter()
            .find(|&&t| t as usize >= self.vocab_size)
        {
            return Err(RunnerError::TokenOutOfRange {
                token,
                vocab: self.vocab_size,
            });
        }
        Ok(())
    }
}

impl ModelRunner for MockRunner {
    fn kv_shape(&self) -> KvShape {
        self.kv_shape
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn max_context(&self) -> usize {
        self.max_context
    }

    fn execute_observed(
        &mut self,
        input: &StepInput,
        on_layer: &mut (dyn FnMut(usize, &dyn KvSource) + Send),
    ) -> Result<StepOutput, RunnerError> {
        let output = self.execute_step(input)?;
        for layer in 0..self.kv_shape.num_layers {
            on_layer(layer, self);
        }
        Ok(output)
    }

    fn write_kv_blocks(
        &mut self,
        layers: Range<usize>,
        blocks: &[BlockId],
        payload: &[u8],
    ) -> Result<(), RunnerError> {
        kv_blocks::check_range(&self.kv_shape, layers.clone(), blocks)?;
        let expected = kv_blocks::payload_len(&self.kv_shape, layers.len(), blocks.len());
        if payload.len() != expected {
            return Err(RunnerError::KvPayloadSize {
                expected,
                got: payload.len(),
            });
        }
        Ok(())
    }
}

impl KvSource for MockRunner {
    fn read_kv_blocks(
        &self,
        layer: usize,
        blocks: &[BlockId],
        out: &mut Vec<u8>,
    ) -> Result<(), RunnerError> {
        kv_blocks::check_range(&self.kv_shape, layer..layer + 1, blocks)?;
        let len = kv_blocks::payload_len(&self.kv_shape, 1, blocks.len());
        out.resize(out.len() + len, 0);
        Ok(())
    }
}

impl MockRunner {
    fn execute_step(&mut self, input: &StepInput) -> Result<StepOutput, RunnerError> {
        for chunk in &input.chunks {
            self.validate(chunk)?;
        }
        let mut output = StepOutput::default();
        for chunk in input.chunks.iter().filter(|c| c.want_logits) {
            let Some(&last) = chunk.tokens.last() else {
                continue;
            };
            let pos = chunk.start_pos + chunk.tokens.len() - 1;
            let mut logits = vec![0.0; self.vocab_size];
            logits[Self::favoured_token(last, pos, self.vocab_size) as usize] = FAVOURED_LOGIT;
            output.logits.push((chunk.seq_id, logits));
        }
        self.last_step_time = self.cost.step_time(input);
        self.total_time += self.last_step_time;
        Ok(output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_common::BlockId;

    fn shape() -> KvShape {
        KvShape {
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 8,
            block_size: 4,
            num_blocks: 8,
        }
    }

    fn chunk(seq_id: u64, tokens: Vec<TokenId>, start_pos: usize, blocks: u32) -> SeqChunk {
        SeqChunk {
            seq_id,
            tokens: tokens.into(),
            start_pos,
            block_table: (0..blocks).map(BlockId).collect(),
            want_logits: true,
        }
    }

    fn cost() -> CostModel {
        CostModel {
            decode_step_base: Duration::from_millis(5),
            prefill_per_token: Duration::from_micros(100),
            decode_per_seq: Duration::from_micros(10),
            per_context_token: Duration::from_nanos(1_000),
        }
    }

    #[test]
    fn empty_step_is_free() {
        assert_eq!(cost().step_time(&StepInput::default()), Duration::ZERO);
    }

    #[test]
    fn prefill_costs_per_token_and_context() {
        let step = StepInput {
            chunks: vec![chunk(1, vec![1; 10], 0, 3)],
        };
        // 5ms + 10 * 100us + 10 context tokens * 1us
        assert_eq!(cost().step_time(&step), Duration::from_micros(6_010));
    }

    #[test]
    fn decode_batch_shares_the_base_cost() {
        let one = StepInput {
            chunks: vec![chunk(1, vec![1], 99, 25)],
        };
        let four = StepInput {
            chunks: (0..4).map(|s| chunk(s, vec![1], 99, 25)).collect(),
        };
        // 5ms + 10us + 100us of context
        assert_eq!(cost().step_time(&one), Duration::from_micros(5_110));
        assert_eq!(cost().step_time(&four), Duration::from_micros(5_440));
        assert!(cost().step_time(&four) < cost().step_time(&one) * 4 / 3);
    }

    #[test]
    fn longer_context_decodes_slower() {
        let short = StepInput {
            chunks: vec![chunk(1, vec![1], 10, 3)],
        };
        let long = StepInput {
            chunks: vec![chunk(1, vec![1], 1_000, 251)],
        };
        assert!(cost().step_time(&long) > cost().step_time(&short));
    }

    #[test]
    fn default_model_is_sane() {
        let c = CostModel::default();
        let decode_32 = StepInput {
            chunks: (0..32).map(|s| chunk(s, vec![1], 1_000, 251)).collect(),
        };
        let t = c.step_time(&decode_32);
        assert!(
            t > Duration::from_millis(5) && t < Duration::from_millis(20),
            "{t:?}"
        );
    }

    #[test]
    fn execute_reports_time_and_deterministic_logits() {
        let mut r = MockRunner::new(shape(), 100, 32, cost());
        let step = StepInput {
            chunks: vec![chunk(1, vec![3, 4, 5], 0, 1), chunk(2, vec![5], 2, 1)],
        };
        let out = r.execute(&step).unwrap();
        assert_eq!(r.last_step_time(), cost().step_time(&step));
        // Same last token at the same position: same favoured token, whatever the batch.
        let argmax = |l: &[f32]| l.iter().position(|&x| x == FAVOURED_LOGIT).unwrap() as u32;
        assert_eq!(argmax(&out.logits[0].1), argmax(&out.logits[1].1));
        assert_eq!(
            argmax(&out.logits[0].1),
            MockRunner::favoured_token(5, 2, 100)
        );
    }

    #[test]
    fn favoured_tokens_spread_over_the_vocabulary() {
        let distinct: std::collections::HashSet<_> = (0..200)
            .map(|p| MockRunner::favoured_token(7, p, 1_000))
            .collect();
        assert!(distinct.len() > 150);
    }

    #[test]
    fn validates_chunks_like_the_real_runner() {
        let mut r = MockRunner::new(shape(), 100, 32, cost());
        let run = |r: &mut MockRunner, c: SeqChunk| r.execute(&StepInput { chunks: vec![c] });
        assert!(matches!(
            run(&mut r, chunk(1, vec![1; 5], 0, 1)),
            Err(RunnerError::BlockTableTooShort {
                needed: 5,
                covered: 4,
                ..
            })
        ));
        assert!(matches!(
            run(&mut r, chunk(1, vec![1], 0, 9)),
            Err(RunnerError::BlockOutOfRange { block: 8, .. })
        ));
        assert!(matches!(
            run(&mut r, chunk(1, vec![100], 0, 1)),
            Err(RunnerError::TokenOutOfRange { token: 100, .. })
        ));
        assert!(matches!(
            run(&mut r, chunk(1, vec![1], 32, 8)),
            Err(RunnerError::ContextOverflow { pos: 32, max: 32 })
        ));
    }
}
