//! The seam between the workers and the network: one small trait.

use crate::chunk::KvChunk;
use crate::codec::CodecError;
use kvmesh_common::{NodeId, RequestId};
use std::time::Instant;

/// The chunks addressed to one node, in the order each sender sent them.
pub type KvReceiver = crossbeam_channel::Receiver<KvChunk>;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    #[error("node {0} already receives on this transport")]
    AlreadyBound(NodeId),
    /// Nobody receives for the node (never bound, unbound, or its receiver was dropped).
    #[error("node {0} is unreachable")]
    Unreachable(NodeId),
    /// The node's inbound queue stayed full until the deadline.
    #[error("timed out sending to node {0}: its queue stayed full")]
    Timeout(NodeId),
    /// The chunk cannot be put on the wire (over the codec's limits, or another request's).
    #[error("cannot send the chunk: {0}")]
    Invalid(CodecError),
    /// No connection to the node's address could be made or kept (unreachable host, TLS
    /// handshake refused, connection lost).
    #[error("connection to node {node} failed: {reason}")]
    Connection { node: NodeId, reason: String },
    /// The receiving end abandoned the transfer (it found a malformed frame); `code` says why.
    #[error("node {node} refused the transfer (code {code})")]
    Refused { node: NodeId, code: u64 },
}

/// Moves KV chunks between nodes.
///
/// A node that receives (a decode node) calls `bind` once and drains the queue it gets; a
/// node that sends (a prefill node) calls `send` for each chunk. Every implementation
/// delivers the chunks from one sender to one node in order, and applies backpressure: `send`
/// waits while the destination's queue is full, so a slow receiver slows its senders
/// instead of growing memory without bound. What crosses a network is verified by the
/// receiver (`KvChunk::verify`), not trusted.
pub trait Transport: Send + Sync {
    /// Starts receiving the chunks addressed to `node` (once; `unbind` before binding again).
    fn bind(&self, node: NodeId) -> Result<KvReceiver, TransportError>;

    /// Stops receiving for `node`; sends to it fail with `Unreachable` from now on.
    fn unbind(&self, node: NodeId);

    /// Delivers `chunk` to `dest`, waiting while `dest`'s queue is full, until `deadline`.
    fn send(&self, dest: NodeId, chunk: KvChunk, deadline: Instant) -> Result<(), TransportError>;

    /// Says that `request` sends nothing more to `dest` (its last chunk went, or it failed).
    /// Transports that keep per-transfer state (a QUIC stream) release it here; they also
    /// release it after an idle timeout, so a forgotten call leaks nothing for long.
    fn end_transfer(&self, dest: NodeId, request: RequestId) {
        let _ = (dest, request);
    }
}
