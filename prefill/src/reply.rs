//! The prefill worker's side of a reply: exactly one per accepted request.

use crossbeam_channel::Sender;
use kvmesh_common::RequestId;
use kvmesh_worker::{PrefillDone, PrefillError, PrefillReply};

/// Sends exactly one reply: if the worker drops a request without answering (it stopped or
/// panicked), the drop answers `Unavailable`, so the decode worker need not wait for its
/// deadline.
#[derive(Debug)]
pub(crate) struct ReplyTo {
    request_id: RequestId,
    tx: Option<Sender<PrefillReply>>,
}

impl ReplyTo {
    pub(crate) fn new(request_id: RequestId, tx: Sender<PrefillReply>) -> Self {
        ReplyTo {
            request_id,
            tx: Some(tx),
        }
    }

    pub(crate) fn send(mut self, result: Result<PrefillDone, PrefillError>) {
        self.send_once(result);
    }

    /// Drops without replying: the caller reported the failure synchronously.
    pub(crate) fn disarm(mut self) {
        self.tx = None;
    }

    fn send_once(&mut self, result: Result<PrefillDone, PrefillError>) {
        if let Some(tx) = self.tx.take() {
            // A decode worker that went away needs no answer.
            let _ = tx.send(PrefillReply {
                request_id: self.request_id,
                result,
            });
        }
    }
}

impl Drop for ReplyTo {
    fn drop(&mut self) {
        self.send_once(Err(PrefillError::Unavailable));
    }
}
