//! KV sends off the engine thread. A transport's `send` waits while the destination's queue
//! is full (backpressure) for up to the send timeout; called from an engine step, one slow
//! destination would stall every request batched in that step. The engine thread reads the
//! KV into buffers (a copy, during the step, while the blocks are certainly the request's)
//! and hands them to a [`KvOutbox`]; a sender thread per destination node moves them, so
//! chunks to one node keep their order and a slow node holds up only the sends queued for
//! it.

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use kvmesh_common::NodeId;
use kvmesh_transfer::Transport;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Work for one destination's sender thread: it runs with the transport, in the order
/// handed over.
pub type Parcel = Box<dyn FnOnce(&dyn Transport) + Send>;

/// A sender thread with nothing to do for this long exits (a later parcel starts another).
const IDLE_EXIT: Duration = Duration::from_secs(30);

/// Moves KV to other nodes from sender threads, one per destination.
pub struct KvOutbox {
    transport: Arc<dyn Transport>,
    lanes: Arc<Mutex<HashMap<NodeId, Sender<Parcel>>>>,
}

impl std::fmt::Debug for KvOutbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvOutbox")
            .field("lanes", &lock(&self.lanes).len())
            .finish()
    }
}

impl KvOutbox {
    pub fn new(transport: Arc<dyn Transport>) -> Self {
        KvOutbox {
            transport,
            lanes: Arc::default(),
        }
    }

    /// Runs `parcel` on `dest`'s sender thread after what was handed over for `dest`
    /// before it. Never blocks on the network.
    pub fn hand_over(&self, dest: NodeId, parcel: Parcel) {
        let mut lanes = lock(&self.lanes);
        let parcel = match lanes.get(&dest) {
            Some(lane) => match lane.send(parcel) {
                Ok(()) => return,
                // Its thread exited: start another.
                Err(e) => e.into_inner(),
            },
            None => parcel,
        };
        let (tx, rx) = crossbeam_channel::unbounded();
        let transport = self.transport.clone();
        let lanes_of_thread = self.lanes.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("kv-send-{dest}"))
            .spawn(move || run_lane(dest, rx, transport, lanes_of_thread));
        match spawned {
            Ok(_) => {
                let _ = tx.send(parcel);
                lanes.insert(dest, tx);
            }
            Err(e) => {
                // No thread: send from here rather than lose the parcel (and its reply).
                drop(lanes);
                tracing::error!("cannot start a KV sender thread: {e}");
                parcel(&*self.transport);
            }
        }
    }
}

impl Drop for KvOutbox {
    /// Lets the sender threads go: each finishes what it was handed, then exits.
    fn drop(&mut self) {
        lock(&self.lanes).clear();
    }
}

fn run_lane(
    dest: NodeId,
    rx: Receiver<Parcel>,
    transport: Arc<dyn Transport>,
    lanes: Arc<Mutex<HashMap<NodeId, Sender<Parcel>>>>,
) {
    loop {
        match rx.recv_timeout(IDLE_EXIT) {
            Ok(parcel) => parcel(&*transport),
            Err(RecvTimeoutError::Disconnected) => return,
            Err(RecvTimeoutError::Timeout) => {
                // Under the lock no parcel can arrive between the check and the removal.
                let mut lanes = lock(&lanes);
                if rx.is_empty() {
                    lanes.remove(&dest);
                    return;
                }
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
