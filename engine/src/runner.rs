//! The seam between scheduling and compute: a `ModelRunner` executes one step (a batch of
//! sequence chunks) against KV storage it owns, and returns the logits that were asked for.
//! The real runner runs the Llama forward pass; the `MockRunner` only models time.

use kvmesh_common::{BlockId, StepTotals, TokenId};
use std::ops::{Deref, Range};
use std::sync::Arc;

/// Identifies a sequence inside one engine (one per request choice).
pub type SeqId = u64;

/// A sequence's blocks in order, shared by the scheduler and the steps that read them: a step
/// takes a reference, not a copy of the list.
pub type BlockTable = Arc<[BlockId]>;

/// The part of one sequence to compute in this step.
#[derive(Clone, Debug, PartialEq)]
pub struct SeqChunk {
    pub seq_id: SeqId,
    /// Tokens to run through the model, at positions `start_pos..start_pos + tokens.len()`.
    pub tokens: ChunkTokens,
    /// Number of this sequence's tokens whose KV is already in its blocks.
    pub start_pos: usize,
    /// The sequence's blocks, covering at least `start_pos + tokens.len()` positions.
    pub block_table: BlockTable,
    /// Whether to return logits for the last token of this chunk (it ends the known tokens).
    pub want_logits: bool,
}

/// A chunk's tokens, read as a slice. A prefill chunk is a range of its sequence's prompt,
/// shared rather than copied (prompts run to tens of thousands of tokens, and each step of a
/// chunked prefill would copy its share); a decode's one token is kept in place, with no
/// allocation; anything else (a chunk past the prompt) is a vector of its own.
#[derive(Clone)]
pub struct ChunkTokens(Repr);

#[derive(Clone)]
enum Repr {
    Shared(Arc<[TokenId]>, Range<usize>),
    One(TokenId),
    Owned(Vec<TokenId>),
}

impl ChunkTokens {
    /// `range` of `tokens`, sharing them.
    ///
    /// # Panics
    /// If `range` is not within `tokens`.
    pub fn shared(tokens: &Arc<[TokenId]>, range: Range<usize>) -> ChunkTokens {
        assert!(
            range.start <= range.end && range.end <= tokens.len(),
            "range {range:?} outside {} tokens",
            tokens.len()
        );
        ChunkTokens(Repr::Shared(tokens.clone(), range))
    }

    /// A single token.
    pub fn one(token: TokenId) -> ChunkTokens {
        ChunkTokens(Repr::One(token))
    }
}

impl Deref for ChunkTokens {
    type Target = [TokenId];

    fn deref(&self) -> &[TokenId] {
        match &self.0 {
            Repr::Shared(tokens, range) => &tokens[range.clone()],
            Repr::One(token) => std::slice::from_ref(token),
            Repr::Owned(tokens) => tokens,
        }
    }
}

impl From<Vec<TokenId>> for ChunkTokens {
    fn from(tokens: Vec<TokenId>) -> ChunkTokens {
        ChunkTokens(Repr::Owned(tokens))
    }
}

impl<'a> IntoIterator for &'a ChunkTokens {
    type Item = &'a TokenId;
    type IntoIter = std::slice::Iter<'a, TokenId>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl std::fmt::Debug for ChunkTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// The same tokens, however they are held.
impl PartialEq for ChunkTokens {
    fn eq(&self, other: &ChunkTokens) -> bool {
        **self == **other
    }
}

impl PartialEq<[TokenId]> for ChunkTokens {
    fn eq(&self, other: &[TokenId]) -> bool {
        **self == *other
    }
}

impl PartialEq<Vec<TokenId>> for ChunkTokens {
    fn eq(&self, other: &Vec<TokenId>) -> bool {
        **self == other[..]
    }
}

impl<const N: usize> PartialEq<[TokenId; N]> for ChunkTokens {
    fn eq(&self, other: &[TokenId; N]) -> bool {
        **self == other[..]
    }
}

/// One step's work.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepInput {
    pub chunks: Vec<SeqChunk>,
}

impl StepInput {
    pub fn num_tokens(&self) -> usize {
        self.chunks.iter().map(|c| c.tokens.len()).sum()
    }

    /// This step's work as one step's [`StepTotals`] (no time yet). A one-token chunk counts
    /// as a decode even when it ends a prompt, as the runners treat it.
    pub fn totals(&self) -> StepTotals {
        let mut t = StepTotals {
            steps: 1,
            ..StepTotals::default()
        };
        for c in &self.chunks {
            let (n, start) = (c.tokens.len() as u64, c.start_pos as u64);
            if n == 1 {
                t.decode_seqs += 1;
                t.decode_context_tokens += start + 1;
            } else {
                t.prefill_tokens += n;
                t.prefill_cached_tokens += start;
            }
        }
        t
    }
}

/// What the chunks that asked for logits got, in chunk order: their last token's logits, or
/// the token the runner drew for them ([`DeviceDraw`]).
#[derive(Clone, Debug, Default)]
pub struct StepOutput {
    pub logits: Vec<(SeqId, Vec<f32>)>,
    pub drawn: Vec<(SeqId, TokenId)>,
}

/// A token for the runner to draw itself for one sequence (on its device, next to the
/// logits), instead of returning the logits for the host's sampler.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceDraw {
    pub seq_id: SeqId,
    pub params: crate::sampler::device_draw::DrawParams,
    /// The draw's number in [0, 1), from the sequence's own random stream.
    pub uniform: f32,
}

/// Shapes a scheduler and a KV transport need to know about a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub num_blocks: usize,
}

impl KvShape {
    /// Bytes of K plus V for one block in one layer (f16 storage).
    pub fn block_bytes_per_layer(&self) -> usize {
        2 * self.num_kv_heads * self.block_size * self.head_dim * 2
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RunnerError {
    #[error("chunk for sequence {seq_id} needs {needed} KV positions but its block table covers {covered}")]
    BlockTableTooShort {
        seq_id: SeqId,
        needed: usize,
        covered: usize,
    },
    #[error("token id {token} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange { token: TokenId, vocab: usize },
    #[error("position {pos} exceeds the model's context length {max}")]
    ContextOverflow { pos: usize, max: usize },
    #[error("block id {block} is outside the pool of {num_blocks} blocks")]
    BlockOutOfRange { block: u32, num_blocks: usize },
    #[error("layer {layer} is outside the model's {num_layers} layers")]
    LayerOutOfRange { layer: usize, num_layers: usize },
    #[error("a KV payload of {got} bytes does not match the {expected} bytes its layers and blocks need")]
    KvPayloadSize { expected: usize, got: usize },
    #[error("device: {0}")]
    Device(String),
}

/// Read access to a runner's KV blocks, for pushing them to another node.
///
/// Blocks travel in the *transfer layout*: for each layer, for each block in the order given,
/// the block's K then its V, each `[num_kv_heads, block_size, head_dim]` little-endian f16
/// (`KvShape::block_bytes_per_layer` bytes per block and layer). `kvmesh-transfer` carries
/// these bytes without looking inside; see `kv_blocks` for the copy routines.
pub trait KvSource {
    /// Appends the K and V of `blocks` in `layer` to `out`, in the transfer layout.
    fn read_kv_blocks(
        &self,
        layer: usize,
        blocks: &[BlockId],
        out: &mut Vec<u8>,
    ) -> Result<(), RunnerError>;
}

/// Executes steps. Implementations own their KV storage, addressed by `BlockId`.
pub trait ModelRunner: KvSource + Send {
    fn kv_shape(&self) -> KvShape;
    fn vocab_size(&self) -> usize;
    fn max_context(&self) -> usize;

    /// `execute`, calling `on_layer(l, kv)` as soon as layer `l`'s KV of this step is written,
    /// so a transfer of that layer can overlap the layers still to compute. `kv` reads any
    /// block of the cache, not only those of this step.
    fn execute_observed(
        &mut self,
        input: &StepInput,
        on_layer: &mut (dyn FnMut(usize, &dyn KvSource) + Send),
    ) -> Result<StepOutput, RunnerError>;

    fn execute(&mut self, input: &StepInput) -> Result<StepOutput, RunnerError> {
        self.execute_observed(input, &mut |_, _| {})
    }

    /// Whether [`execute_drawing`](Self::execute_drawing) draws tokens itself.
    fn draws_on_device(&self) -> bool {
        false
    }

    /// `execute_observed`, drawing the tokens of `draws` (sequences of this step that ask for
    /// logits) on the runner's device and returning them in `drawn` rather than their
    /// logits. A runner that does not draw returns logits for them: the host draws.
    fn execute_drawing(
        &mut self,
        input: &StepInput,
        draws: &[DeviceDraw],
        on_layer: &mut (dyn FnMut(usize, &dyn KvSource) + Send),
    ) -> Result<StepOutput, RunnerError> {
        let _ = draws;
        self.execute_observed(input, on_layer)
    }

    /// Writes KV computed elsewhere into `blocks`: `payload` holds `layers` × `blocks` in the
    /// transfer layout (see [`KvSource`]). Nothing is written when an error is returned.
    fn write_kv_blocks(
        &mut self,
        layers: Range<usize>,
        blocks: &[BlockId],
        payload: &[u8],
    ) -> Result<(), RunnerError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_tokens_read_the_same_however_held() {
        let prompt: Arc<[TokenId]> = (0..10).collect();
        let shared = ChunkTokens::shared(&prompt, 3..6);
        assert_eq!(shared, [3, 4, 5]);
        assert_eq!(shared, ChunkTokens::from(vec![3, 4, 5]));
        assert_eq!(ChunkTokens::one(7), vec![7]);
        assert_eq!(ChunkTokens::shared(&prompt, 4..4).len(), 0);
        assert_eq!(format!("{shared:?}"), "[3, 4, 5]");
        assert_eq!((&shared).into_iter().sum::<TokenId>(), 12);
        assert_eq!(Arc::strong_count(&prompt), 2, "shared, not copied");
    }

    #[test]
    #[should_panic(expected = "outside 10 tokens")]
    fn a_shared_range_stays_within_its_tokens() {
        let prompt: Arc<[TokenId]> = (0..10).collect();
        let _ = ChunkTokens::shared(&prompt, 8..11);
    }
}
