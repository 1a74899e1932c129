//! The decode worker's handle: what `generate` checks and queues, read from any thread.

use crossbeam_channel::{Sender, TrySendError};
use kvmesh_common::{GenerateEvent, GenerateRequest, NodeId, WorkerError};
use kvmesh_worker::{
    Control, ExportError, ExportJob, ExportReply, ExportRequest, KvExporter, KvPull, NodeState,
    PrefillTarget,
};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};

/// The events of one request: tokens, then `Finished` or `Error`. Unbounded so the worker
/// never waits for a slow client; it holds at most `max_tokens + 1` events. Read with
/// `recv().await` or, outside async code, `blocking_recv()`. Dropping it cancels the request.
pub type EventReceiver = tokio::sync::mpsc::UnboundedReceiver<GenerateEvent>;

pub(crate) struct Submission {
    pub(crate) request: GenerateRequest,
    pub(crate) prefill: Option<PrefillTarget>,
    pub(crate) pull: Option<KvPull>,
    pub(crate) events: UnboundedSender<GenerateEvent>,
    pub(crate) enqueued_at: Instant,
}

pub(crate) enum Inbox {
    Generate(Box<Submission>),
    /// Another node pulls cached KV: served before the next step (see `kvmesh_worker::export`).
    Export(Box<ExportJob>),
    /// Wakes the thread to notice a drain.
    Wake,
    Stop,
}

impl Control for Inbox {
    fn wake() -> Self {
        Inbox::Wake
    }

    fn stop() -> Self {
        Inbox::Stop
    }
}

/// What `generate` checks before queueing, copied from the engine at spawn.
pub(crate) struct Limits {
    pub(crate) max_model_len: usize,
    pub(crate) num_blocks: usize,
    pub(crate) block_size: usize,
    /// Token ids at or above this are refused here: the runner would fail the whole batch
    /// they joined, every co-batched request with them.
    pub(crate) vocab_size: usize,
}

/// What the handles and the thread share; the role adds the limits `generate` checks.
pub(crate) type Shared = NodeState<Limits>;

/// Submits requests to one decode worker and reads its load. Cheap to clone; usable from
/// any thread, async or not.
#[derive(Clone)]
pub struct DecodeHandle {
    /// Shared by the clones: the worker holds it weakly (to name itself as a holder), so
    /// that it still sees the inbox close when the last handle is dropped.
    pub(crate) inbox: Arc<Sender<Inbox>>,
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for DecodeHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeHandle")
            .field("node_id", &self.shared.node_id)
            .finish()
    }
}

impl DecodeHandle {
    pub fn node_id(&self) -> NodeId {
        self.shared.node_id
    }

    /// Queues `request` and returns its event stream. With `prefill`, a prompt whose uncached
    /// part is at least `local_prefill_max_tokens` long is prefilled there (falling back to a
    /// local prefill if that fails); without, or for shorter prompts, it is prefilled here.
    ///
    /// The stream: one `Token` per generated token (also a final EOS or stop token, with empty
    /// text, so the count matches `usage.completion_tokens`), each carrying the text that is
    /// final with it (the last one also carries any text held back until the end); then
    /// `Finished` (its `text` is empty) or `Error`.
    ///
    /// Never blocks. Errors: `InvalidRequest` (bad parameters, empty prompt, prompt longer
    /// than the context or the KV pool), `Overloaded` (the queue is full: retry later),
    /// `Unavailable` (draining or stopped).
    pub fn generate(
        &self,
        request: GenerateRequest,
        prefill: Option<PrefillTarget>,
    ) -> Result<EventReceiver, WorkerError> {
        self.generate_pulling(request, prefill, None)
    }

    /// `generate`, first pulling the prompt's cached prefix from `pull`'s node when that is
    /// cheaper than recomputing it (see `kvmesh_worker::Puller`); whatever is not pulled is
    /// prefilled as `generate` would.
    pub fn generate_pulling(
        &self,
        request: GenerateRequest,
        prefill: Option<PrefillTarget>,
        pull: Option<KvPull>,
    ) -> Result<EventReceiver, WorkerError> {
        if self.shared.is_draining() {
            return Err(WorkerError::Unavailable(
                "the decode worker is draining".into(),
            ));
        }
        self.validate(&request)?;
        if !self.shared.queue.try_take() {
            return Err(WorkerError::Overloaded(format!(
                "{} requests are queued at decode worker {}",
                self.shared.queue.capacity(),
                self.shared.node_id
            )));
        }
        let (events, rx) = unbounded_channel();
        let msg = Inbox::Generate(Box::new(Submission {
            request,
            prefill,
            pull,
            events,
            enqueued_at: Instant::now(),
        }));
        match self.inbox.try_send(msg) {
            Ok(()) => Ok(rx),
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.shared.queue.give_back();
                Err(WorkerError::Unavailable(
                    "the decode worker has stopped".into(),
                ))
            }
        }
    }

    fn validate(&self, request: &GenerateRequest) -> Result<(), WorkerError> {
        let invalid = |m: String| Err(WorkerError::InvalidRequest(m));
        if let Err(e) = request.params.validate() {
            return invalid(e.to_string());
        }
        let len = request.prompt.len();
        let l = &self.shared.role;
        if len == 0 {
            return invalid("the prompt is empty".into());
        }
        if len > l.max_model_len {
            return invalid(format!(
                "the prompt has {len} tokens; the maximum context is {}",
                l.max_model_len
            ));
        }
        if len.div_ceil(l.block_size) > l.num_blocks {
            return invalid(format!(
                "the prompt needs {} KV blocks; this worker has {}",
                len.div_ceil(l.block_size),
                l.num_blocks
            ));
        }
        let tokens = request.prompt.iter().chain(&request.resume);
        if let Some(&token) = tokens.into_iter().find(|&&t| t as usize >= l.vocab_size) {
            return invalid(format!(
                "token id {token} is outside the model's vocabulary of {}",
                l.vocab_size
            ));
        }
        Ok(())
    }

    kvmesh_worker::node_handle_methods!();
}

impl KvExporter for DecodeHandle {
    fn node_id(&self) -> NodeId {
        DecodeHandle::node_id(self)
    }

    fn export(
        &self,
        request: ExportRequest,
        reply: Sender<ExportReply>,
    ) -> Result<(), ExportError> {
        ExportJob::queue(&self.inbox, Inbox::Export, request, reply)
    }
}
