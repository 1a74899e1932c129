//! The seam between scheduling and compute: a `ModelRunner` executes one step (a batch of
//! sequence chunks) against KV storage it owns, and returns the logits that were asked for.
//! The real runner runs the Llama forward pass; the `MockRunner` only models time.

use kvmesh_common::{BlockId, TokenId};
use std::ops::Range;

/// Identifies a sequence inside one engine (one per request choice).
pub type SeqId = u64;

/// The part of one sequence to compute in this step.
#[derive(Clone, Debug, PartialEq)]
pub struct SeqChunk {
    pub seq_id: SeqId,
    /// Tokens to run through the model, at positions `start_pos..start_pos + tokens.len()`.
    pub tokens: Vec<TokenId>,
    /// Number of this sequence's tokens whose KV is already in its blocks.
    pub start_pos: usize,
    /// The sequence's blocks, covering at least `start_pos + tokens.len()` positions.
    pub block_table: Vec<BlockId>,
    /// Whether to return logits for the last token of this chunk (it ends the known tokens).
    pub want_logits: bool,
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
}

/// Logits of the last token of every chunk that asked for them, in chunk order.
#[derive(Clone, Debug, Default)]
pub struct StepOutput {
    pub logits: Vec<(SeqId, Vec<f32>)>,
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

    /// Writes KV computed elsewhere into `blocks`: `payload` holds `layers` × `blocks` in the
    /// transfer layout (see [`KvSource`]). Nothing is written when an error is returned.
    fn write_kv_blocks(
        &mut self,
        layers: Range<usize>,
        blocks: &[BlockId],
        payload: &[u8],
    ) -> Result<(), RunnerError>;
}
