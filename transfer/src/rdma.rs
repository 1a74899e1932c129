//! KV transfer by one-sided RDMA writes (ibverbs, cargo feature `rdma`).
//!
//! Each pair of nodes shares one reliable-connected queue pair, and each side registers a
//! receive ring for the other. The control plane carries the [`RdmaPeerInfo`] of both sides
//! (`prepare_peer` on each, then `connect_peer` with the other's). A sender encodes every
//! chunk as a self-contained codec stream (preamble + one frame), writes it straight into
//! the receiver's ring with RDMA WRITE_WITH_IMM (the immediate carries its length), and the
//! receiver, woken by that completion, decodes and verifies it exactly as the QUIC transport
//! does, queues the chunk, and hands the ring space back with a zero-length SEND_WITH_IMM
//! (the immediate carries the bytes freed; what is owed while the send queue is full goes
//! with the next one, so a queue pair never has more sends posted than its depth). Both
//! sides place messages by the same rule, so offsets never travel: a message goes at the
//! ring's head, or at its start when it would run past the end.
//!
//! Every decision lives in a core without verbs, tested without a device: `ring` (placement
//! and each side's accounting), `send_queue` (the write and the credits within the queue's
//! depth) and `peer_table` (which link serves which peer, generation-tagged so that no two
//! links share a work request id; replacing and freeing links; what happens to the KV of a
//! failed one). The verbs driver only carries out what the table says. A link that fails
//! (an error completion, a protocol violation, a write stuck past its deadline, an idle
//! link's keepalive finding the peer gone) is drained and freed, and the chunk its write
//! carried comes back undelivered, for the network transport to send over QUIC; the peer
//! has no link until it exchanges again.
//!
//! Without the feature, or on a machine without an RDMA device, [`RdmaTransport::open`]
//! says so and the node uses QUIC (see [`NetworkTransport`](crate::NetworkTransport)).

mod loopback;
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
mod peer_table;
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
mod ring;
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
mod send_queue;
#[cfg(feature = "rdma")]
mod verbs;
#[cfg(feature = "rdma")]
pub use verbs::RdmaTransport;

#[cfg(not(feature = "rdma"))]
mod stub;
#[cfg(not(feature = "rdma"))]
pub use stub::RdmaTransport;

pub use loopback::{LoopbackFabric, LoopbackRdma};

use crate::chunk::KvChunk;
use crate::codec::CodecLimits;
use crate::transport::TransportError;
use kvmesh_common::NodeId;
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// A registered memory region a peer may write into.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaRegion {
    pub addr: u64,
    pub rkey: u32,
    pub len: u64,
}

/// The address of a queue pair (InfiniBand LID, or RoCE GID).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaEndpoint {
    pub qp_num: u32,
    pub lid: u16,
    pub gid: [u8; 16],
    /// First packet sequence number this side sends with.
    pub psn: u32,
}

/// What one node tells another (through the control plane) to receive its KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaPeerInfo {
    pub endpoint: RdmaEndpoint,
    /// The ring the other node writes into.
    pub region: RdmaRegion,
}

#[derive(Clone, Debug)]
pub struct RdmaConfig {
    /// Device name (`mlx5_0`); the first device when `None`.
    pub device: Option<String>,
    /// Physical port (from 1).
    pub port: u8,
    /// GID table index for RoCE (global routing); `None` for InfiniBand LID routing.
    pub gid_index: Option<u8>,
    /// Bytes of the receive ring registered per peer; bounds one message (chunk + headers).
    pub ring_bytes: usize,
    /// Chunks held per bound node before the completion poller waits (backpressure).
    pub queue_chunks: usize,
    /// Peers with RDMA links at once; more use QUIC. Each pins two rings of `ring_bytes`
    /// (the receive ring and the staging buffer), and up to twice that while it exchanges
    /// again.
    pub max_peers: usize,
    pub limits: CodecLimits,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            device: None,
            port: 1,
            gid_index: None,
            ring_bytes: 128 << 20,
            queue_chunks: 256,
            max_peers: 16,
            limits: CodecLimits::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RdmaError {
    #[error("RDMA support is not compiled in (build with feature `rdma`); falling back to QUIC")]
    NotCompiled,
    #[error("no RDMA device found ({0}); falling back to QUIC")]
    NoDevice(String),
    #[error("RDMA {op} failed: {source}")]
    Verbs {
        op: &'static str,
        source: std::io::Error,
    },
    #[error("no queue pair prepared for node {0}: call prepare_peer first")]
    NotPrepared(NodeId),
    /// Another exchange with the node is under way (until it completes or its lease ends).
    #[error("an RDMA exchange with node {0} is already under way")]
    ExchangeInProgress(NodeId),
    #[error("RDMA links to {max} peers already (max_peers); this one uses QUIC")]
    TooManyPeers { max: usize },
    #[error("invalid setting: {0}")]
    Config(String),
}

/// A chunk RDMA did not deliver (its link failed, or it could not take it), to send another
/// way before its deadline. The receiver may have it already (a write can land and still
/// fail), which is harmless: a receiver records which layers of which blocks arrived.
#[derive(Debug)]
pub struct Undelivered<C = KvChunk> {
    pub chunk: C,
    pub deadline: Instant,
}

/// Why a chunk did not go over RDMA.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RdmaSendError {
    /// No usable link to the node (none exchanged, or it failed); the chunk waits with the
    /// node's undelivered ones.
    #[error("{0}")]
    Unusable(String),
    /// The message is larger than the node's ring; the chunk waits with the node's
    /// undelivered ones.
    #[error("a {len}-byte message does not fit the {max}-byte RDMA ring")]
    TooLarge { len: u64, max: u64 },
    /// Dropped, as by any transport: the node's ring stayed full until the deadline
    /// (`Timeout`), the chunk cannot be encoded (`Invalid`), nobody receives for the node.
    #[error(transparent)]
    Dropped(TransportError),
}
