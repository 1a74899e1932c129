//! The decode node's remote prefills in flight: for each request a prefill worker is computing,
//! which KV has arrived, whether its reply is in, and when it must be given up.
//!
//! Pure: no threads, channels or clocks. Time comes in as `now`, events come in as calls, and
//! each call says what the driver (the decode thread) must do: write a chunk, complete the
//! prefill with the first token, or fall back to a local prefill. A transfer completes once
//! its reply *and* every layer of every reserved block are in, in whatever order they come.
//! Its timeout bounds its silence, not its length: every chunk written starts it over, so a
//! long prompt that streams steadily is never thrown away and recomputed. Once a transfer has
//! ended (completed, fallen back or removed) anything more for it is late and ignored.

use kvmesh_engine::runner::SeqId;
use kvmesh_transfer::KvChunk;
use kvmesh_worker::{CancelToken, IncomingError, IncomingTransfer, PrefillDone, PrefillError};
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The transfers in flight of one decode node, by sequence.
#[derive(Debug)]
pub(crate) struct RemotePrefills {
    /// How long a transfer may stay silent before it is given up.
    timeout: Duration,
    transfers: HashMap<SeqId, Transfer>,
}

#[derive(Debug)]
struct Transfer {
    incoming: IncomingTransfer,
    /// Stops the prefill worker when the transfer ends early.
    cancel: CancelToken,
    /// The prefill worker's answer, kept until every chunk is in.
    done: Option<PrefillDone>,
    started: Instant,
    deadline: Instant,
}

/// What to do with an arrived chunk.
#[derive(Debug)]
pub(crate) enum ChunkVerdict {
    /// No transfer of this sequence is in flight (it completed, fell back or was removed).
    Late,
    /// Intact and expected: write it into the blocks, then report it with `written`.
    Write,
    /// Refused: the transfer has ended; prefill locally.
    FallBack(FallBack),
}

/// A transfer to give up: cancel the prefill worker's work and prefill locally.
#[derive(Debug)]
pub(crate) struct FallBack {
    pub(crate) seq_id: SeqId,
    pub(crate) cancel: CancelToken,
    pub(crate) reason: FallBackReason,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum FallBackReason {
    #[error("refusing KV chunk: {0}")]
    Refused(IncomingError),
    #[error("remote prefill failed: {0}")]
    Failed(PrefillError),
    #[error("remote prefill timed out")]
    TimedOut,
    #[error("writing KV chunk: {0}")]
    NotWritten(String),
}

/// A transfer whose reply and KV are all in: hand `done.first` to the engine.
#[derive(Debug)]
pub(crate) struct Completion {
    pub(crate) seq_id: SeqId,
    pub(crate) done: PrefillDone,
    /// From the prefill worker accepting the request to now.
    pub(crate) elapsed: Duration,
}

/// What a prefill worker's reply leads to.
#[derive(Debug)]
pub(crate) enum Action {
    Complete(Completion),
    FallBack(FallBack),
}

impl RemotePrefills {
    pub(crate) fn new(timeout: Duration) -> Self {
        RemotePrefills {
            timeout,
            transfers: HashMap::new(),
        }
    }

    /// The prefill worker accepted `seq_id`'s request at `now`; `incoming` expects the blocks
    /// reserved for it. Its clock starts.
    pub(crate) fn start(
        &mut self,
        now: Instant,
        seq_id: SeqId,
        incoming: IncomingTransfer,
        cancel: CancelToken,
    ) {
        let transfer = Transfer {
            incoming,
            cancel,
            done: None,
            started: now,
            deadline: now + self.timeout,
        };
        self.transfers.insert(seq_id, transfer);
    }

    /// A chunk for `seq_id` arrived: checks it before anything is written.
    pub(crate) fn on_chunk(&mut self, seq_id: SeqId, chunk: &KvChunk) -> ChunkVerdict {
        let Entry::Occupied(t) = self.transfers.entry(seq_id) else {
            return ChunkVerdict::Late;
        };
        match t.get().incoming.check(chunk) {
            Ok(()) => ChunkVerdict::Write,
            Err(e) => {
                ChunkVerdict::FallBack(t.remove().fall_back(seq_id, FallBackReason::Refused(e)))
            }
        }
    }

    /// The chunk `on_chunk` passed was written at `now`: the transfer made progress, so its
    /// timeout starts over. Completes it if that was the last piece and the reply is in.
    pub(crate) fn written(
        &mut self,
        now: Instant,
        seq_id: SeqId,
        chunk: &KvChunk,
    ) -> Option<Completion> {
        let t = self.transfers.get_mut(&seq_id)?;
        t.incoming.record(chunk);
        t.deadline = now + self.timeout;
        self.try_complete(now, seq_id)
    }

    /// The chunk `on_chunk` passed could not be written into the blocks (`error`).
    pub(crate) fn not_written(&mut self, seq_id: SeqId, error: String) -> Option<FallBack> {
        let t = self.transfers.remove(&seq_id)?;
        Some(t.fall_back(seq_id, FallBackReason::NotWritten(error)))
    }

    /// The prefill worker answered for `seq_id`. Its chunks were sent before the reply, but
    /// they may still be on their way: a success completes only once they are all in.
    pub(crate) fn on_reply(
        &mut self,
        now: Instant,
        seq_id: SeqId,
        result: Result<PrefillDone, PrefillError>,
    ) -> Option<Action> {
        let Entry::Occupied(mut t) = self.transfers.entry(seq_id) else {
            return None;
        };
        match result {
            Ok(done) => {
                t.get_mut().done = Some(done);
                self.try_complete(now, seq_id).map(Action::Complete)
            }
            Err(e) => {
                let reason = FallBackReason::Failed(e);
                Some(Action::FallBack(t.remove().fall_back(seq_id, reason)))
            }
        }
    }

    /// The clock: gives up every transfer silent for its whole timeout by `now`.
    pub(crate) fn on_tick(&mut self, now: Instant) -> Vec<FallBack> {
        let mut expired: Vec<SeqId> = self
            .transfers
            .iter()
            .filter(|(_, t)| t.deadline <= now)
            .map(|(&id, _)| id)
            .collect();
        expired.sort_unstable();
        expired
            .into_iter()
            .filter_map(|id| {
                let t = self.transfers.remove(&id)?;
                Some(t.fall_back(id, FallBackReason::TimedOut))
            })
            .collect()
    }

    /// When `on_tick` must next run, if a transfer is in flight.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.transfers.values().map(|t| t.deadline).min()
    }

    /// Ends `seq_id`'s transfer without a verdict (the request is gone): returns the token
    /// that stops the prefill worker.
    pub(crate) fn remove(&mut self, seq_id: SeqId) -> Option<CancelToken> {
        self.transfers.remove(&seq_id).map(|t| t.cancel)
    }

    fn try_complete(&mut self, now: Instant, seq_id: SeqId) -> Option<Completion> {
        let t = self.transfers.get(&seq_id)?;
        if !t.incoming.is_complete() || t.done.is_none() {
            return None;
        }
        let t = self.transfers.remove(&seq_id)?;
        Some(Completion {
            seq_id,
            elapsed: now.saturating_duration_since(t.started),
            done: t.done?,
        })
    }
}

impl Transfer {
    fn fall_back(self, seq_id: SeqId, reason: FallBackReason) -> FallBack {
        FallBack {
            seq_id,
            cancel: self.cancel,
            reason,
        }
    }
}

#[cfg(test)]
mod tests;
