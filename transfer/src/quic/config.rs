//! What a QUIC transport is started with, and why starting it can fail.

use crate::codec::CodecLimits;
use kvmesh_common::tls::{ClusterTls, TlsError, CLUSTER_SERVER_NAME};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// How the QUIC endpoint proves (or does not prove) who it is.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum TlsConfig {
    /// A fresh self-signed certificate per process, and clients that accept any server
    /// certificate. Traffic is **encrypted but not authenticated**: anyone who can reach the
    /// port can send KV, and an active man in the middle can read it. For a trusted network
    /// or a single host only.
    #[default]
    SelfSigned,
    /// Mutual TLS: this node presents `cert` (PEM chain) with `key` (PEM, PKCS#8/PKCS#1/SEC1),
    /// and accepts only peers whose certificates `ca` (PEM) signed, in both directions. A
    /// server certificate must name [`QuicConfig::server_name`] as a DNS subject alt name.
    Files {
        ca: PathBuf,
        cert: PathBuf,
        key: PathBuf,
    },
    /// Mutual TLS as in `Files`, from material the node already loaded (and checked) once
    /// for its whole control plane.
    Cluster(ClusterTls),
}

/// Settings of a [`QuicTransport`](super::QuicTransport). The defaults are tuned for
/// megabyte chunks inside a data centre: flow-control windows that cover several GB/s at
/// sub-millisecond RTTs yet fit the UDP socket buffer (so a slow receiver stalls its sender
/// instead of dropping datagrams), and the largest datagrams a loopback path carries. Raise
/// the windows together with `socket_buffer_bytes` (and the kernel's rmem_max) for long
/// fat paths.
#[derive(Clone, Debug)]
pub struct QuicConfig {
    /// UDP address to listen on (port 0: any free port); also the source of outbound traffic.
    pub listen: SocketAddr,
    pub tls: TlsConfig,
    /// TLS server name: sent by clients, and checked against server certificates in the
    /// mutual modes (default: the cluster name every `kvmesh certs` certificate carries).
    pub server_name: String,
    /// Chunks held per bound node before stream readers stop reading (backpressure).
    pub queue_chunks: usize,
    pub limits: CodecLimits,
    /// Worker threads of the transport's own tokio runtime.
    pub runtime_threads: usize,
    /// Bytes a sender may have in flight on one stream before the receiver reads them.
    pub stream_receive_window: u64,
    /// Bytes in flight on one connection, over all its streams.
    pub receive_window: u64,
    /// Unacknowledged bytes a sender keeps per connection.
    pub send_window: u64,
    /// Datagram size to peers on loopback addresses (loopback's MTU is 65536).
    pub loopback_mtu: u16,
    /// Peers elsewhere start at QUIC's safe 1200 bytes and MTU discovery probes up to this
    /// (1452: Ethernet; raise for jumbo frames).
    pub remote_max_mtu: u16,
    /// Largest datagram this endpoint accepts.
    pub max_udp_payload: u16,
    /// SO_SNDBUF / SO_RCVBUF requested for the UDP socket (the kernel may cap it).
    pub socket_buffer_bytes: usize,
    /// A transfer stream idle this long is finished as if `end_transfer` had been called.
    pub stream_idle_timeout: Duration,
    /// A connection silent this long is closed (keep-alives flow at a third of it).
    pub connection_idle_timeout: Duration,
    /// Transfer streams one peer may have open to this node at once.
    pub max_incoming_streams: u32,
}

impl Default for QuicConfig {
    fn default() -> Self {
        QuicConfig {
            listen: SocketAddr::from(([0, 0, 0, 0], 0)),
            tls: TlsConfig::SelfSigned,
            server_name: CLUSTER_SERVER_NAME.to_string(),
            queue_chunks: 256,
            limits: CodecLimits::default(),
            runtime_threads: 2,
            stream_receive_window: 4 << 20,
            receive_window: 8 << 20,
            send_window: 16 << 20,
            loopback_mtu: 65_000,
            remote_max_mtu: 1452,
            max_udp_payload: 65_000,
            socket_buffer_bytes: 8 << 20,
            stream_idle_timeout: Duration::from_secs(30),
            connection_idle_timeout: Duration::from_secs(30),
            max_incoming_streams: 1024,
        }
    }
}

/// Why a QUIC transport could not start.
#[derive(Debug, thiserror::Error)]
pub enum QuicError {
    #[error("cannot bind UDP {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot start the transport's runtime: {0}")]
    Runtime(std::io::Error),
    #[error("cluster TLS: {0}")]
    ClusterTls(#[from] TlsError),
    #[error("TLS setup: {0}")]
    Tls(#[from] rustls::Error),
    #[error("TLS client verifier: {0}")]
    Verifier(String),
    #[error("self-signed certificate: {0}")]
    Certificate(#[from] rcgen::Error),
    #[error("invalid setting: {0}")]
    Config(String),
}
