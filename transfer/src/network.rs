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
//! When a peer's RDMA link fails (an error completion, a write that never completes), chunks
//! to it go over QUIC from then on, starting with the ones the link did not deliver: the
//! write in flight when it failed comes back from the RDMA transport and is sent again over
//! QUIC before the next chunk (or at `end_transfer`, for a request's last chunk), so no
//! request loses KV to a failed link. The receiver may get such a chunk twice, which is
//! harmless (it records which layers of which blocks arrived). When to exchange again is
//! [`NetworkTransport::rdma_exchange_due`]'s answer: soon after a first failure, then after
//! delays that double, and after six failures in a row not any more (QUIC for good, unless
//! the peer starts an exchange).
//!
//! ```no_run
//! use kvmesh_transfer::{NetworkTransport, QuicConfig, RdmaConfig, QuicTransport};
//! let quic = QuicTransport::start(QuicConfig::default())?;
//! // RDMA where it is compiled in and a device exists (the reason it is not is logged).
//! let transport = NetworkTransport::open(quic, RdmaConfig::default());
//! # Ok::<(), kvmesh_transfer::QuicError>(())
//! ```

mod routes;

use crate::chunk::KvChunk;
use crate::quic::QuicTransport;
use crate::rdma::{RdmaConfig, RdmaError, RdmaPeerInfo, RdmaSendError, RdmaTransport, Undelivered};
use crate::transport::{KvReceiver, Transport, TransportError};
use kvmesh_common::{NodeId, RequestId};
use routes::{RetryPolicy, Routes};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A chunk sent again over QUIC after RDMA failed gets at least this long (its own deadline
/// may have passed while its write waited to fail).
const RESEND_GRACE: Duration = Duration::from_secs(2);

/// An RDMA transport as the control plane and [`NetworkTransport`] drive it.
pub trait RdmaPeering: Transport {
    /// The device in use, for logs.
    fn device_name(&self) -> &str;
    /// Sets up this side's queue pair and receive ring for `peer` (replacing, once
    /// connected, any earlier ones, which are freed); returns what `peer` must be told.
    /// Refused with `ExchangeInProgress` while another exchange with `peer` is under way.
    fn prepare_peer(&self, peer: NodeId) -> Result<RdmaPeerInfo, RdmaError>;
    /// Connects the queue pair prepared for `peer` to `peer`'s.
    fn connect_peer(&self, peer: NodeId, remote: RdmaPeerInfo) -> Result<(), RdmaError>;
    /// Whether `peer` has a connected link that has not failed.
    fn link_up(&self, peer: NodeId) -> bool;
    /// Sends `chunk` to `dest` over RDMA. One that cannot go (no usable link, too large)
    /// waits with `dest`'s undelivered chunks; one refused for a full ring is dropped.
    fn try_send(
        &self,
        dest: NodeId,
        chunk: KvChunk,
        deadline: Instant,
    ) -> Result<(), RdmaSendError>;
    /// Waits until the write in flight to `dest`, if any, has completed; at that write's
    /// deadline gives its link up (the chunk then is undelivered).
    fn settle(&self, dest: NodeId);
    /// The chunks to `dest` that RDMA did not deliver, oldest first.
    fn take_undelivered(&self, dest: NodeId) -> Vec<Undelivered>;
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

    fn link_up(&self, peer: NodeId) -> bool {
        RdmaTransport::link_up(self, peer)
    }

    fn try_send(
        &self,
        dest: NodeId,
        chunk: KvChunk,
        deadline: Instant,
    ) -> Result<(), RdmaSendError> {
        RdmaTransport::try_send(self, dest, chunk, deadline)
    }

    fn settle(&self, dest: NodeId) {
        RdmaTransport::settle(self, dest)
    }

    fn take_undelivered(&self, dest: NodeId) -> Vec<Undelivered> {
        RdmaTransport::take_undelivered(self, dest)
    }
}

/// See the module docs.
pub struct NetworkTransport {
    quic: QuicTransport,
    rdma: Option<Arc<dyn RdmaPeering>>,
    /// Which way chunks go to each peer.
    routes: Mutex<Routes>,
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
            routes: Mutex::new(Routes::new(RetryPolicy::default())),
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

    /// Whether chunks to `peer` go over RDMA (its exchange completed and its link has not
    /// failed since).
    pub fn uses_rdma(&self, peer: NodeId) -> bool {
        match &self.rdma {
            Some(rdma) => self.on_rdma(rdma.as_ref(), peer, Instant::now()),
            None => false,
        }
    }

    /// Whether this node should start the RDMA exchange with `peer` now: never tried, or
    /// its last exchange or link failed and the backoff since has passed (not after six
    /// failures in a row). Not while chunks go over RDMA or an exchange is under way.
    pub fn rdma_exchange_due(&self, peer: NodeId) -> bool {
        let Some(rdma) = &self.rdma else {
            return false;
        };
        let now = Instant::now();
        self.on_rdma(rdma.as_ref(), peer, now);
        lock(&self.routes).exchange_due(peer, now)
    }

    /// Step 1 of the exchange with `peer`: what to send it.
    pub fn rdma_prepare(&self, peer: NodeId) -> Result<RdmaPeerInfo, RdmaError> {
        let rdma = self.rdma.as_ref().ok_or(RdmaError::NotCompiled)?;
        lock(&self.routes).exchange_started(peer, Instant::now());
        rdma.prepare_peer(peer).inspect_err(|e| {
            if !matches!(e, RdmaError::ExchangeInProgress(_)) {
                lock(&self.routes).exchange_failed(peer, Instant::now());
            }
        })
    }

    /// Step 2: connect to what `peer` sent; from now on chunks to it go over RDMA.
    pub fn rdma_connect(&self, peer: NodeId, remote: RdmaPeerInfo) -> Result<(), RdmaError> {
        let rdma = self.rdma.as_ref().ok_or(RdmaError::NotCompiled)?;
        let result = rdma.connect_peer(peer, remote);
        let mut routes = lock(&self.routes);
        match &result {
            Ok(()) => routes.exchange_succeeded(peer, Instant::now()),
            Err(_) => routes.exchange_failed(peer, Instant::now()),
        }
        result
    }

    /// Whether `peer` is on RDMA, noting first a link that failed since.
    fn on_rdma(&self, rdma: &dyn RdmaPeering, peer: NodeId, now: Instant) -> bool {
        let mut routes = lock(&self.routes);
        if routes.uses_rdma(peer) && !rdma.link_up(peer) {
            tracing::warn!(node = %peer, "RDMA link failed; KV to this node goes over QUIC");
            routes.link_failed(peer, now);
        }
        routes.uses_rdma(peer)
    }

    /// Sends chunks RDMA did not deliver over QUIC, in order, each by its deadline or
    /// `floor`, whichever is later. The first error, if any.
    fn resend(
        &self,
        dest: NodeId,
        undelivered: Vec<Undelivered>,
        floor: Instant,
    ) -> Result<(), TransportError> {
        if undelivered.is_empty() {
            return Ok(());
        }
        tracing::info!(
            node = %dest,
            chunks = undelivered.len(),
            "sending KV that RDMA did not deliver over QUIC"
        );
        let mut result = Ok(());
        for u in undelivered {
            let sent = self.quic.send(dest, u.chunk, u.deadline.max(floor));
            if result.is_ok() {
                result = sent;
            }
        }
        result
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
        let Some(rdma) = &self.rdma else {
            return self.quic.send(dest, chunk, deadline);
        };
        // What RDMA did not deliver goes first, so that this chunk does not overtake it.
        let earlier = self.resend(dest, rdma.take_undelivered(dest), deadline);
        let now = Instant::now();
        if !self.on_rdma(rdma.as_ref(), dest, now) {
            let sent = self.quic.send(dest, chunk, deadline);
            return earlier.and(sent);
        }
        let sent = match rdma.try_send(dest, chunk, deadline) {
            Ok(()) => Ok(()),
            Err(RdmaSendError::Dropped(e)) => Err(e),
            Err(e) => {
                if let RdmaSendError::Unusable(why) = &e {
                    tracing::warn!(node = %dest, %why, "RDMA link failed; KV to this node goes over QUIC");
                    lock(&self.routes).link_failed(dest, now);
                } else {
                    tracing::debug!(node = %dest, "{e}; this chunk goes over QUIC");
                }
                self.resend(dest, rdma.take_undelivered(dest), deadline)
            }
        };
        earlier.and(sent)
    }

    /// Waits for the request's write in flight over RDMA, if any, and sends over QUIC what
    /// RDMA did not deliver (a request's last chunk included), then ends the transfer on
    /// both.
    fn end_transfer(&self, dest: NodeId, request: RequestId) {
        if let Some(rdma) = &self.rdma {
            rdma.settle(dest);
            let undelivered = rdma.take_undelivered(dest);
            if !undelivered.is_empty() {
                let now = Instant::now();
                self.on_rdma(rdma.as_ref(), dest, now);
                if let Err(e) = self.resend(dest, undelivered, now + RESEND_GRACE) {
                    tracing::warn!(node = %dest, %request, "resending KV over QUIC: {e}");
                }
            }
            rdma.end_transfer(dest, request);
        }
        self.quic.end_transfer(dest, request);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
