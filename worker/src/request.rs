//! The messages between a decode worker and a prefill worker.

use crate::export::ExportSource;
use kvmesh_common::{BlockId, NodeId, RequestId, SamplingParams, TokenId};
use kvmesh_engine::sampler::Sampled;
use kvmesh_transfer::TransportError;
use tokio_util::sync::CancellationToken;

/// Where the prompt's KV goes: a node and, in prompt order, the blocks there that receive
/// the KV of the prompt's blocks from `cached_prefix_len / block_size` on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvDestination {
    pub node: NodeId,
    pub blocks: Vec<BlockId>,
}

/// Cancels a request across workers: the decode worker keeps one clone, the prefill worker
/// checks the other before every step, and a remote call awaits `cancelled()` to drop its RPC
/// (which cancels on the prefill node in turn).
#[derive(Clone, Debug, Default)]
pub struct CancelToken(CancellationToken);

impl CancelToken {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn cancel(&self) {
        self.0.cancel();
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.is_cancelled()
    }

    /// Completes once `cancel` was called on any clone.
    pub async fn cancelled(&self) {
        self.0.cancelled().await
    }
}

/// Decode worker -> prefill worker: compute `prompt`, push its KV to `destination`, sample the
/// first token.
#[derive(Clone, Debug)]
pub struct PrefillRequest {
    pub request_id: RequestId,
    pub prompt: Vec<TokenId>,
    /// The request's parameters; set `seed` so the decode worker's later draws continue the
    /// same random stream.
    pub params: SamplingParams,
    /// Leading prompt tokens the destination has already (whole blocks): not sent.
    pub cached_prefix_len: usize,
    pub destination: KvDestination,
    /// The destination, to pull the first `cached_prefix_len` tokens' KV from when this
    /// worker lacks them and pulling beats recomputing them (`None`: recompute).
    pub holder: Option<ExportSource>,
    pub cancel: CancelToken,
}

/// The prompt was computed and every chunk of its KV was handed to the transport.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefillDone {
    /// The first generated token, with its log-probabilities.
    pub first: Sampled,
    /// Prompt tokens the prefill worker served from its own prefix cache.
    pub cached_tokens: usize,
    pub chunks_sent: u32,
    pub bytes_sent: u64,
}

/// Why a prefill did not complete; the decode worker then prefills locally.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PrefillError {
    #[error("invalid prefill request: {0}")]
    InvalidRequest(String),
    #[error("the prefill worker's queue is full")]
    Overloaded,
    #[error("the prefill worker is draining or stopped")]
    Unavailable,
    #[error("cancelled")]
    Cancelled,
    #[error("KV transfer failed: {0}")]
    Transfer(#[from] TransportError),
    #[error("prefill failed: {0}")]
    Engine(String),
    /// The call to a remote prefill node failed (unreachable, reset, timed out).
    #[error("prefill call failed: {0}")]
    Rpc(String),
}

/// Prefill worker -> decode worker: how one request ended.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefillReply {
    pub request_id: RequestId,
    pub result: Result<PrefillDone, PrefillError>,
}
