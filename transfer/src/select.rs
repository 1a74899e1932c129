//! How a node picks its network transport: RDMA where it is compiled in and a device exists,
//! QUIC otherwise.
//!
//! ```no_run
//! use kvmesh_transfer::{select, QuicConfig, RdmaConfig, TransportKind};
//! let transport = select(TransportKind::Rdma, RdmaConfig::default(), QuicConfig::default())?;
//! // Advertise `transport.kind()` (and the QUIC address or RDMA peer info) in the node's
//! // registry entry; two nodes use RDMA only when both advertise it.
//! # Ok::<(), kvmesh_transfer::QuicError>(())
//! ```

use crate::chunk::KvChunk;
use crate::quic::{QuicConfig, QuicError, QuicTransport};
use crate::rdma::{RdmaConfig, RdmaTransport};
use crate::transport::{KvReceiver, Transport, TransportError};
use kvmesh_common::{NodeId, RequestId};
use serde::{Deserialize, Serialize};
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TransportKind {
    Rdma,
    Quic,
}

/// The transport a node ended up with.
pub enum NetworkTransport {
    Rdma(Box<RdmaTransport>),
    Quic(Box<QuicTransport>),
}

impl NetworkTransport {
    pub fn kind(&self) -> TransportKind {
        match self {
            NetworkTransport::Rdma(_) => TransportKind::Rdma,
            NetworkTransport::Quic(_) => TransportKind::Quic,
        }
    }

    fn inner(&self) -> &dyn Transport {
        match self {
            NetworkTransport::Rdma(t) => t.as_ref(),
            NetworkTransport::Quic(t) => t.as_ref(),
        }
    }
}

/// RDMA when `prefer`red and it opens (the reason it did not is logged), else QUIC.
pub fn select(
    prefer: TransportKind,
    rdma: RdmaConfig,
    quic: QuicConfig,
) -> Result<NetworkTransport, QuicError> {
    if prefer == TransportKind::Rdma {
        match RdmaTransport::open(rdma) {
            Ok(t) => return Ok(NetworkTransport::Rdma(Box::new(t))),
            Err(e) => tracing::warn!(error = %e, "KV transfer over QUIC"),
        }
    }
    QuicTransport::start(quic).map(|t| NetworkTransport::Quic(Box::new(t)))
}

impl Transport for NetworkTransport {
    fn bind(&self, node: NodeId) -> Result<KvReceiver, TransportError> {
        self.inner().bind(node)
    }

    fn unbind(&self, node: NodeId) {
        self.inner().unbind(node)
    }

    fn send(&self, dest: NodeId, chunk: KvChunk, deadline: Instant) -> Result<(), TransportError> {
        self.inner().send(dest, chunk, deadline)
    }

    fn end_transfer(&self, dest: NodeId, request: RequestId) {
        self.inner().end_transfer(dest, request)
    }
}
