//! KV transfer over QUIC (quinn): the default between hosts.
//!
//! One UDP endpoint per transport serves both directions. Senders keep one connection per
//! peer address and open one unidirectional stream per (destination node, request); the
//! stream starts with the codec's preamble and carries the request's chunks as frames.
//! Receivers route each stream by its preamble to the queue of a node bound here.
//!
//! Backpressure is end to end: while a node's queue is full its stream readers stop
//! reading, QUIC flow control stops the senders, and `send` waits (until its deadline).
//! Memory therefore stays within the queue, one chunk per stream being read, and the flow
//! control windows.
//!
//! The transport owns a small tokio runtime, so its blocking `send` serves plain threads (the
//! prefill worker); do not call it from inside an async task.

mod config;
mod receiver;
mod sender;
mod tls;

pub use config::{QuicConfig, QuicError, TlsConfig};
pub use tls::ALPN;

use crate::chunk::KvChunk;
use crate::transport::{KvReceiver, Transport, TransportError};
use kvmesh_common::{NodeId, RequestId};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{
    ClientConfig, Endpoint, EndpointConfig, IdleTimeout, MtuDiscoveryConfig, ServerConfig,
    TransportConfig, VarInt,
};
use receiver::Inbound;
use sender::Outbound;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::runtime::Runtime;

/// Application error codes on stopped or reset streams.
pub mod error_code {
    use quinn::VarInt;
    /// The receiver has no bound node of the preamble's destination.
    pub const UNKNOWN_NODE: VarInt = VarInt::from_u32(1);
    /// The receiver could not decode the stream (see `CodecError`).
    pub const MALFORMED: VarInt = VarInt::from_u32(2);
    /// The sender gave up on the transfer (deadline passed, connection failed).
    pub const SENDER_ABORTED: VarInt = VarInt::from_u32(3);
}

/// See the module docs.
pub struct QuicTransport {
    runtime: Option<Runtime>,
    endpoint: Endpoint,
    local_addr: SocketAddr,
    queue_chunks: usize,
    outbound: Arc<Outbound>,
    inbound: Arc<Inbound>,
}

impl QuicTransport {
    /// Binds `config.listen` and starts serving.
    pub fn start(config: QuicConfig) -> Result<QuicTransport, QuicError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.runtime_threads.max(1))
            .thread_name("kvmesh-quic")
            .enable_all()
            .build()
            .map_err(QuicError::Runtime)?;
        let tls = tls::build(&config.tls, &config.server_name)?;
        let server_crypto =
            QuicServerConfig::try_from(tls.server).map_err(|e| QuicError::Config(e.to_string()))?;
        let mut server = ServerConfig::with_crypto(Arc::new(server_crypto));
        // Receivers mostly send acknowledgements: small datagrams.
        server.transport_config(Arc::new(transport_config(&config, 1200, 1452)?));
        let client_crypto = Arc::new(
            QuicClientConfig::try_from(tls.client).map_err(|e| QuicError::Config(e.to_string()))?,
        );
        let client = |initial_mtu, max_mtu| -> Result<ClientConfig, QuicError> {
            let mut c = ClientConfig::new(client_crypto.clone());
            c.transport_config(Arc::new(transport_config(&config, initial_mtu, max_mtu)?));
            Ok(c)
        };
        let loopback_client = client(config.loopback_mtu, config.loopback_mtu)?;
        let remote_client = client(1200, config.remote_max_mtu)?;

        let socket = bind_udp(&config)?;
        let mut endpoint_config = EndpointConfig::default();
        endpoint_config
            .max_udp_payload_size(config.max_udp_payload)
            .map_err(|e| QuicError::Config(format!("max_udp_payload: {e}")))?;
        let endpoint = {
            let _in_runtime = runtime.enter();
            Endpoint::new(
                endpoint_config,
                Some(server),
                socket,
                Arc::new(quinn::TokioRuntime),
            )
            .map_err(|source| QuicError::Bind {
                addr: config.listen,
                source,
            })?
        };
        let local_addr = endpoint.local_addr().map_err(|source| QuicError::Bind {
            addr: config.listen,
            source,
        })?;

        let inbound = Arc::new(Inbound {
            limits: config.limits,
            nodes: Default::default(),
        });
        let outbound = Arc::new(Outbound::new(
            endpoint.clone(),
            config.server_name.clone(),
            loopback_client,
            remote_client,
            config.limits,
        ));
        runtime.spawn(receiver::accept_loop(endpoint.clone(), inbound.clone()));
        runtime.spawn(reap_idle_streams(
            Arc::downgrade(&outbound),
            config.stream_idle_timeout,
        ));
        Ok(QuicTransport {
            runtime: Some(runtime),
            endpoint,
            local_addr,
            queue_chunks: config.queue_chunks.max(1),
            outbound,
            inbound,
        })
    }

    /// The UDP address peers reach this transport at (with the real port when bound to 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Tells the transport where `node` receives (from the control plane's node registry).
    pub fn add_peer(&self, node: NodeId, addr: SocketAddr) {
        self.outbound.add_peer(node, addr);
    }

    /// Forgets where `node` receives; sends to it fail with `Unreachable`.
    pub fn remove_peer(&self, node: NodeId) {
        self.outbound.remove_peer(node);
    }

    /// Transfer streams open for sending (not yet ended, nor idle long enough to be ended).
    pub fn open_transfers(&self) -> usize {
        self.outbound.open_streams()
    }

    fn runtime(&self) -> &Runtime {
        self.runtime.as_ref().expect("present until drop")
    }
}

impl Transport for QuicTransport {
    fn bind(&self, node: NodeId) -> Result<KvReceiver, TransportError> {
        let mut nodes = self
            .inbound
            .nodes
            .write()
            .unwrap_or_else(|e| e.into_inner());
        if nodes.contains_key(&node) {
            return Err(TransportError::AlreadyBound(node));
        }
        let (tx, rx) = crossbeam_channel::bounded(self.queue_chunks);
        nodes.insert(node, tx);
        Ok(rx)
    }

    fn unbind(&self, node: NodeId) {
        let mut nodes = self
            .inbound
            .nodes
            .write()
            .unwrap_or_else(|e| e.into_inner());
        nodes.remove(&node);
    }

    fn send(&self, dest: NodeId, chunk: KvChunk, deadline: Instant) -> Result<(), TransportError> {
        // The task, not this thread, drives the write; it gives up at the deadline itself.
        let (tx, rx) = crossbeam_channel::bounded(1);
        let outbound = self.outbound.clone();
        self.runtime().spawn(async move {
            let _ = tx.send(outbound.send(dest, chunk, deadline).await);
        });
        rx.recv().unwrap_or_else(|_| {
            Err(TransportError::Connection {
                node: dest,
                reason: "the transport is shutting down".to_string(),
            })
        })
    }

    fn end_transfer(&self, dest: NodeId, request: RequestId) {
        self.runtime().spawn(self.outbound.end((dest, request)));
    }
}

impl Drop for QuicTransport {
    /// Closes every connection at once: bytes not yet acknowledged are lost, and their
    /// receivers see the transfers fail.
    fn drop(&mut self) {
        self.endpoint.close(VarInt::from_u32(0), b"shutdown");
        if let Some(rt) = self.runtime.take() {
            // Stream readers may be parked in a blocking queue send; do not wait for them.
            rt.shutdown_background();
        }
    }
}

async fn reap_idle_streams(outbound: std::sync::Weak<Outbound>, idle: Duration) {
    let mut tick = tokio::time::interval((idle / 4).max(Duration::from_millis(10)));
    loop {
        tick.tick().await;
        let Some(outbound) = outbound.upgrade() else {
            return;
        };
        outbound.end_idle(idle).await;
    }
}

/// quinn sends at most this many datagrams in one GSO batch (quinn's MAX_TRANSMIT_SEGMENTS).
const GSO_BATCH: usize = 10;

/// Transport parameters for connections whose datagrams start at `initial_mtu` and may grow
/// to `max_mtu` by MTU discovery.
fn transport_config(
    config: &QuicConfig,
    initial_mtu: u16,
    max_mtu: u16,
) -> Result<TransportConfig, QuicError> {
    let varint = |what: &str, v: u64| {
        VarInt::from_u64(v).map_err(|_| QuicError::Config(format!("{what} {v} is too large")))
    };
    let max_mtu = max_mtu.clamp(1200, config.max_udp_payload);
    let initial_mtu = initial_mtu.clamp(1200, max_mtu);
    let mut t = TransportConfig::default();
    t.stream_receive_window(varint(
        "stream_receive_window",
        config.stream_receive_window,
    )?)
    .receive_window(varint("receive_window", config.receive_window)?)
    .send_window(config.send_window)
    .max_concurrent_uni_streams(config.max_incoming_streams.into())
    .max_concurrent_bidi_streams(VarInt::from_u32(0))
    .max_idle_timeout(Some(
        IdleTimeout::try_from(config.connection_idle_timeout)
            .map_err(|_| QuicError::Config("connection_idle_timeout is too large".into()))?,
    ))
    .keep_alive_interval(Some(config.connection_idle_timeout / 3))
    .initial_mtu(initial_mtu)
    // A GSO batch is one UDP send of at most 64 KiB; quinn-udp silently drops a larger one
    // (EMSGSIZE), which looks like loss and sends black-hole detection down to 1200 bytes.
    // Large datagrams need no batching anyway.
    .enable_segmentation_offload(usize::from(max_mtu) * GSO_BATCH <= 65_000);
    // quinn's default first congestion window (14720 bytes) is smaller than one large
    // loopback datagram and would stall the handshake; RFC 9002's formula scales it.
    let mtu = u64::from(initial_mtu);
    let mut cubic = quinn::congestion::CubicConfig::default();
    cubic.initial_window((10 * mtu).min((2 * mtu).max(14_720)));
    t.congestion_controller_factory(Arc::new(cubic));
    let mut mtud = MtuDiscoveryConfig::default();
    mtud.upper_bound(max_mtu);
    t.mtu_discovery_config(Some(mtud));
    Ok(t)
}

/// The endpoint's socket, with the buffers bulk transfer needs (best effort: unprivileged
/// processes get at most the kernel's rmem_max / wmem_max).
fn bind_udp(config: &QuicConfig) -> Result<std::net::UdpSocket, QuicError> {
    let socket = std::net::UdpSocket::bind(config.listen).map_err(|source| QuicError::Bind {
        addr: config.listen,
        source,
    })?;
    let state =
        quinn::udp::UdpSocketState::new((&socket).into()).map_err(|source| QuicError::Bind {
            addr: config.listen,
            source,
        })?;
    let bytes = config.socket_buffer_bytes;
    if let Err(e) = state.set_recv_buffer_size((&socket).into(), bytes) {
        tracing::debug!(error = %e, bytes, "cannot set the UDP receive buffer size");
    }
    if let Err(e) = state.set_send_buffer_size((&socket).into(), bytes) {
        tracing::debug!(error = %e, bytes, "cannot set the UDP send buffer size");
    }
    Ok(socket)
}
