//! A node's transport between processes: QUIC to every peer, and RDMA to the peers it has
//! exchanged RDMA connection details with through the control plane.
//!
//! RDMA needs both ends prepared for each other before a byte moves: each side registers a
//! queue pair and a receive ring for the other ([`RdmaPeering::prepare_peer`]), the two
//! [`RdmaPeerInfo`]s cross over gRPC (`kvmesh.v1.Prefill/RdmaConnect`, which the decode node
//! calls when it first uses a prefill node that offers RDMA), and each side connects to the
//! other's ([`RdmaPeering::connect_peer`]). From then on chunks to that peer go over RDMA;
//! to everyone else (and whenever the exchange failed) over QUIC. A receiving node takes
//! chunks from both on one queue.
//!
//! ```no_run
//! use kvmesh_transfer::{NetworkTransport, QuicConfig, RdmaConfig, QuicTransport};
//! let quic = QuicTransport::start(QuicConfig::default())?;
//! // RDMA where it is compiled in and a device exists (the reason it is not is logged).
//! let transport = NetworkTransport::open(quic, RdmaConfig::default());
//! # Ok::<(), kvmesh_transfer::QuicError>(())
//! ```

use crate::chunk::KvChunk;
use crate::quic::QuicTransport;
use crate::rdma::{RdmaConfig, RdmaError, RdmaPeerInfo, RdmaTransport};
use crate::transport::{KvReceiver, Transport, TransportError};
use kvmesh_common::{NodeId, RequestId};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Instant;

/// An RDMA transport as the control plane drives it.
pub trait RdmaPeering: Transport {
    /// The device in use, for logs.
    fn device_name(&self) -> &str;
    /// Sets up this side's queue pair and receive ring for `peer`; returns what `peer` must
    /// be told.
    fn prepare_peer(&self, peer: NodeId) -> Result<RdmaPeerInfo, RdmaError>;
    /// Connects the queue pair prepared for `peer` to `peer`'s.
    fn connect_peer(&self, peer: NodeId, remote: RdmaPeerInfo) -> Result<(), RdmaError>;
}

impl RdmaPeering for RdmaTransport {
    fn device_name(&self) -> &str {
        RdmaTransport::device_name(self)
    }

    fn prepare_peer(&self, peer: NodeId) -> Result<RdmaPeerInfo, RdmaError> {
        RdmaTransport::prepare_peer(self, peer)
    }

    fn connect_peer(&self, peer: NodeId, remote: RdmaPeerInfo) -> Result<(), RdmaError> {
        RdmaTransport::connect_peer(self, peer, remote)
    }
}

/// See the module docs.
pub struct NetworkTransport {
    quic: QuicTransport,
    rdma: Option<Arc<dyn RdmaPeering>>,
    /// Peers whose RDMA exchange completed: chunks to them go over RDMA.
    rdma_peers: RwLock<HashSet<NodeId>>,
}

impl NetworkTransport {
    /// QUIC, plus RDMA when it opens; says at start-up which and why.
    pub fn open(quic: QuicTransport, rdma: RdmaConfig) -> NetworkTransport {
        let rdma: Option<Arc<dyn RdmaPeering>> = match RdmaTransport::open(rdma) {
            Ok(t) => {
                tracing::info!(
                    device = t.device_name(),
                    "KV transfer over RDMA to peers with RDMA, QUIC to the rest"
                );
                Some(Arc::new(t))
            }
            Err(RdmaError::NotCompiled) => {
                tracing::info!("KV transfer over QUIC (built without the `rdma` feature)");
                None
            }
            Err(e) => {
                tracing::warn!("{e}");
                None
            }
        };
        NetworkTransport::with_rdma(quic, rdma)
    }

    /// QUIC plus the given RDMA transport (none: QUIC only).
    pub fn with_rdma(quic: QuicTransport, rdma: Option<Arc<dyn RdmaPeering>>) -> Self {
        NetworkTransport {
            quic,
            rdma,
            rdma_peers: RwLock::default(),
        }
    }

    pub fn quic(&self) -> &QuicTransport {
        &self.quic
    }

    /// Where `node` receives QUIC traffic.
    pub fn add_peer(&self, node: NodeId, addr: SocketAddr) {
        self.quic.add_peer(node, addr);
    }

    /// Whether this node can exchange RDMA details with peers at all.
    pub fn offers_rdma(&self) -> bool {
        self.rdma.is_some()
    }

    /// Whether chunks to `peer` go over RDMA.
    pub fn uses_rdma(&self, peer: NodeId) -> bool {
        read(&self.rdma_peers).contains(&peer)
    }

    /// Step 1 of the exchange with `peer`: what to send it.
    pub fn rdma_prepare(&self, peer: NodeId) -> Result<RdmaPeerInfo, RdmaError> {
        self.rdma
            .as_ref()
            .ok_or(RdmaError::NotCompiled)?
            .prepare_peer(peer)
    }

    /// Step 2: connect to what `peer` sent; from now on chunks to it go over RDMA.
    pub fn rdma_connect(&self, peer: NodeId, remote: RdmaPeerInfo) -> Result<(), RdmaError> {
        self.rdma
            .as_ref()
            .ok_or(RdmaError::NotCompiled)?
            .connect_peer(peer, remote)?;
        write(&self.rdma_peers).insert(peer);
        Ok(())
    }

    fn route(&self, dest: NodeId) -> &dyn Transport {
        match &self.rdma {
            Some(rdma) if self.uses_rdma(dest) => rdma.as_ref(),
            _ => &self.quic,
        }
    }
}

impl Transport for NetworkTransport {
    fn bind(&self, node: NodeId) -> Result<KvReceiver, TransportError> {
        let quic = self.quic.bind(node)?;
        let Some(rdma) = &self.rdma else {
            return Ok(quic);
        };
        let rdma = match rdma.bind(node) {
            Ok(rx) => rx,
            Err(e) => {
                self.quic.unbind(node);
                return Err(e);
            }
        };
        // One queue for both: a thread per source moves chunks on, blocking while the
        // merged queue is full, so each source's own backpressure still holds.
        let (tx, rx) = crossbeam_channel::bounded(1);
        for (name, source) in [("kvmesh-kv-quic", quic), ("kvmesh-kv-rdma", rdma)] {
            let tx = tx.clone();
            std::thread::Builder::new()
                .name(name.into())
                .spawn(move || {
                    for chunk in source {
                        if tx.send(chunk).is_err() {
                            return;
                        }
                    }
                })
                .map_err(|e| TransportError::Connection {
                    node,
                    reason: format!("starting the receive thread: {e}"),
                })?;
        }
        Ok(rx)
    }

    fn unbind(&self, node: NodeId) {
        self.quic.unbind(node);
        if let Some(rdma) = &self.rdma {
            rdma.unbind(node);
        }
    }

    fn send(&self, dest: NodeId, chunk: KvChunk, deadline: Instant) -> Result<(), TransportError> {
        self.route(dest).send(dest, chunk, deadline)
    }

    fn end_transfer(&self, dest: NodeId, request: RequestId) {
        self.route(dest).end_transfer(dest, request)
    }
}

fn read<T>(m: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|e| e.into_inner())
}

fn write<T>(m: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|e| e.into_inner())
}
