//! The transport between workers of one process: a bounded channel per receiving node.

use crate::chunk::KvChunk;
use crate::transport::{KvReceiver, Transport, TransportError};
use crossbeam_channel::{SendTimeoutError, Sender};
use kvmesh_common::NodeId;
use std::collections::HashMap;
use std::sync::RwLock;
use std::time::Instant;

/// See the module docs. Chunks move without copying; the queue bound is the backpressure.
#[derive(Debug)]
pub struct InProcessTransport {
    queue_chunks: usize,
    nodes: RwLock<HashMap<NodeId, Sender<KvChunk>>>,
}

impl InProcessTransport {
    /// Each receiving node's queue holds up to `queue_chunks` chunks (at least 1).
    pub fn new(queue_chunks: usize) -> Self {
        InProcessTransport {
            queue_chunks: queue_chunks.max(1),
            nodes: RwLock::new(HashMap::new()),
        }
    }
}

impl Default for InProcessTransport {
    /// 256 chunks per node: with one chunk per layer and step, several prefill steps of
    /// several requests in flight.
    fn default() -> Self {
        Self::new(256)
    }
}

impl Transport for InProcessTransport {
    fn bind(&self, node: NodeId) -> Result<KvReceiver, TransportError> {
        let mut nodes = self.nodes.write().unwrap_or_else(|e| e.into_inner());
        if nodes.contains_key(&node) {
            return Err(TransportError::AlreadyBound(node));
        }
        let (tx, rx) = crossbeam_channel::bounded(self.queue_chunks);
        nodes.insert(node, tx);
        Ok(rx)
    }

    fn unbind(&self, node: NodeId) {
        let mut nodes = self.nodes.write().unwrap_or_else(|e| e.into_inner());
        nodes.remove(&node);
    }

    fn send(&self, dest: NodeId, chunk: KvChunk, deadline: Instant) -> Result<(), TransportError> {
        let tx = {
            let nodes = self.nodes.read().unwrap_or_else(|e| e.into_inner());
            nodes
                .get(&dest)
                .cloned()
                .ok_or(TransportError::Unreachable(dest))?
        };
        match tx.send_deadline(chunk, deadline) {
            Ok(()) => Ok(()),
            Err(SendTimeoutError::Timeout(_)) => Err(TransportError::Timeout(dest)),
            Err(SendTimeoutError::Disconnected(_)) => Err(TransportError::Unreachable(dest)),
        }
    }
}

/// The in-process transport with one slow peer: sends to `slow` wait until the gate opens
/// (its sender is dropped) or their deadline passes. For tests of what a slow destination
/// does to everything else a worker serves.
pub struct SlowTo {
    pub inner: InProcessTransport,
    pub slow: NodeId,
    pub gate: crossbeam_channel::Receiver<()>,
}

impl Transport for SlowTo {
    fn bind(&self, node: NodeId) -> Result<KvReceiver, TransportError> {
        self.inner.bind(node)
    }

    fn unbind(&self, node: NodeId) {
        self.inner.unbind(node)
    }

    fn send(
        &self,
        dest: NodeId,
        chunk: KvChunk,
        deadline: std::time::Instant,
    ) -> Result<(), TransportError> {
        if dest == self.slow {
            let _ = self.gate.recv_deadline(deadline);
        }
        self.inner.send(dest, chunk, deadline)
    }
}
