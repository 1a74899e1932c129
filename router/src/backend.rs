//! The narrow seam between the router and whatever serves tokens.

use async_trait::async_trait;
use kvmesh_common::{GenerateEvent, GenerateRequest, WorkerError};
use tokio::sync::mpsc;

/// Serves tokens: the [`MeshBackend`](crate::MeshBackend) over the decode nodes (in-process
/// or over gRPC), or a test's stand-in.
///
/// Implement it with [`macro@crate::async_trait`] (re-exported by this crate):
///
/// ```
/// use kvmesh_common::{FinishReason, GenerateEvent, GenerateRequest, Usage, WorkerError};
/// use tokio::sync::mpsc;
///
/// /// Answers every request with nothing.
/// struct Silent;
///
/// #[kvmesh_router::async_trait]
/// impl kvmesh_router::Backend for Silent {
///     async fn generate(
///         &self,
///         req: GenerateRequest,
///     ) -> Result<mpsc::UnboundedReceiver<GenerateEvent>, WorkerError> {
///         let (tx, rx) = mpsc::unbounded_channel();
///         let usage = Usage { prompt_tokens: req.prompt.len() as u32, ..Usage::default() };
///         tx.send(GenerateEvent::Finished { reason: FinishReason::Stop, text: String::new(), usage })
///             .map_err(|e| WorkerError::Internal(e.to_string()))?;
///         Ok(rx)
///     }
///
///     fn is_ready(&self) -> bool {
///         true
///     }
/// }
/// let _backend: std::sync::Arc<dyn kvmesh_router::Backend> = std::sync::Arc::new(Silent);
/// ```
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// Starts generating. Events arrive on the returned receiver: `Token`s, then exactly one
    /// `Finished` or `Error`, after which the router drops the receiver.
    ///
    /// Dropping the receiver early cancels the request: the backend notices the closed
    /// channel (`Sender::closed()` or a failed `send`) and frees what the request held.
    /// `Err` means nothing was started: `Overloaded` becomes 429, `Unavailable` 503,
    /// `InvalidRequest` 400 and `Internal` 500.
    async fn generate(
        &self,
        req: GenerateRequest,
    ) -> Result<mpsc::UnboundedReceiver<GenerateEvent>, WorkerError>;

    /// Ready to take traffic (false while starting or draining); `/health` reports it.
    fn is_ready(&self) -> bool;
}
