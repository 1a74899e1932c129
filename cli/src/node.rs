//! `kvmesh prefill | decode | router`: the mesh's node processes, found through etcd, and
//! `kvmesh node`, which operates a running one.
//!
//! Every node registers `/{cluster}/nodes/{role}/{node_id}` under an etcd lease, refreshes
//! its load report under that lease, and on SIGINT/SIGTERM (or a `Drain` RPC) drains: it
//! revokes the lease first (routers stop sending within a watch round trip), finishes what it
//! accepted, then exits. A prefill or decode node switches to the other role in place on
//! `Node.SwitchRole` (`kvmesh node switch-role`): the same drain, then the same engine, its
//! weights and KV pool, serves the other role under a new registration
//! ([`lifecycle`]).

pub mod config;
pub mod control;
pub mod decode;
pub mod engine_args;
pub mod lifecycle;
pub mod metrics;
pub mod prefill;
pub mod process;
pub mod roles;
pub mod router;
pub mod switchboard;

use crate::config::{env_vars, node_id_hex};
use anyhow::{bail, Context, Result};
use clap::Args;
use config::MeshNodeConfig;
use humantime_serde::re::humantime;
use kvmesh_common::kv_tier::{KvEventSink, TieredKvEvent};
use kvmesh_common::tls::ClusterTls;
use kvmesh_common::{NodeId, NodeRole};
use kvmesh_kvstore::{Discovery, EtcdConfig, EtcdDiscovery, KvEventPublisher, PublisherStats};
use kvmesh_transfer::{NetworkTransport, QuicConfig, QuicTransport, RdmaConfig, TlsConfig};
use serde::Serialize;
use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Flags every mesh node takes; each sets the key of the same name under `[mesh]`.
#[derive(Args, Clone, Debug, Serialize)]
pub struct MeshArgs {
    /// etcd client URLs, comma-separated (e.g. http://127.0.0.1:2379); required.
    #[arg(long, env = env_vars::ETCD, value_delimiter = ',')]
    pub etcd: Option<Vec<String>>,
    /// Where this node listens: gRPC (TCP) for prefill/decode, HTTP for the router; a decode
    /// node also receives KV over QUIC on the same port (UDP); required.
    #[arg(long, env = env_vars::LISTEN)]
    pub listen: Option<SocketAddr>,
    /// The address other nodes use to reach this one (default: --listen, or with a wildcard
    /// --listen, the address this host reaches etcd from).
    #[arg(long, env = env_vars::ADVERTISE)]
    pub advertise: Option<SocketAddr>,
    /// Name of the mesh: the root of its etcd keys, so meshes can share one etcd.
    #[arg(long, env = env_vars::CLUSTER)]
    pub cluster: Option<String>,
    /// This node's id (hex; default: the one its --tls-cert names, else random). Must be
    /// unique in the cluster.
    #[arg(long, env = env_vars::NODE_ID, value_parser = node_id_hex::parse)]
    #[serde(with = "node_id_hex", skip_serializing_if = "Option::is_none")]
    pub node_id: Option<NodeId>,
    /// How long the node outlives its last etcd keep-alive (a crashed node leaves routing
    /// after this).
    #[arg(long, env = env_vars::LEASE_TTL, value_parser = humantime::parse_duration)]
    #[serde(with = "humantime_serde")]
    pub lease_ttl: Option<Duration>,
    /// After SIGTERM or a `Drain` RPC, how long the node lets accepted requests finish; past
    /// it, it stops, and the router moves the requests still open to other nodes.
    #[arg(long, env = env_vars::DRAIN_TIMEOUT, value_parser = humantime::parse_duration)]
    #[serde(with = "humantime_serde")]
    pub drain_timeout: Option<Duration>,
    /// The cluster CA certificate (PEM) for mutual TLS between nodes, on gRPC and the KV
    /// transport; with --tls-cert and --tls-key (`kvmesh certs` makes all three). Without
    /// them gRPC is plaintext and KV uses a self-signed certificate (encrypted, not
    /// authenticated): anyone who reaches the ports can act as a node.
    #[arg(long, env = env_vars::TLS_CA)]
    pub tls_ca: Option<PathBuf>,
    /// This node's certificate (PEM), signed by the cluster CA, naming `kvmesh.cluster`.
    #[arg(long, env = env_vars::TLS_CERT)]
    pub tls_cert: Option<PathBuf>,
    /// This node's private key (PEM).
    #[arg(long, env = env_vars::TLS_KEY)]
    pub tls_key: Option<PathBuf>,
    /// Serve Prometheus metrics (`GET /metrics`) here, with `GET /health` (200 while
    /// serving a role, 503 while switching or draining) and `GET /live` (prefill and decode
    /// nodes; a router serves `/metrics` and `/health` on its API port).
    #[arg(long, env = env_vars::METRICS_LISTEN)]
    pub metrics_listen: Option<SocketAddr>,
}

/// Where the `MeshArgs` flags go in the TOML.
pub const MESH_KEYS: &[(&str, &str)] = &[
    ("etcd", "mesh.etcd"),
    ("listen", "mesh.listen"),
    ("advertise", "mesh.advertise"),
    ("cluster", "mesh.cluster"),
    ("node_id", "mesh.node_id"),
    ("lease_ttl", "mesh.lease_ttl"),
    ("drain_timeout", "mesh.drain_timeout"),
    ("tls_ca", "mesh.tls_ca"),
    ("tls_cert", "mesh.tls_cert"),
    ("tls_key", "mesh.tls_key"),
    ("metrics_listen", "mesh.metrics_listen"),
];

/// Pulling cached prefixes from other nodes (prefill and decode nodes).
#[derive(Args, Clone, Debug, Serialize)]
pub struct PullArgs {
    /// How long to wait for a holder's blocks before recomputing them instead (a silent or
    /// slow holder costs a request at most this).
    #[arg(long, env = env_vars::PULL_TIMEOUT, value_parser = humantime::parse_duration)]
    #[serde(with = "humantime_serde")]
    pub pull_timeout: Option<Duration>,
}

/// The local address the kernel would send from to reach `url`'s host (a connected UDP
/// socket sends nothing).
fn route_source(url: &str) -> Option<std::net::IpAddr> {
    use std::net::ToSocketAddrs;
    let host_port = url.split("://").last()?.split('/').next()?;
    let target = host_port.to_socket_addrs().ok()?.next()?;
    let socket = std::net::UdpSocket::bind(("0.0.0.0", 0)).ok()?;
    socket.connect(target).ok()?;
    Some(socket.local_addr().ok()?.ip())
}

impl MeshNodeConfig {
    /// `--advertise`, else `--listen`; a wildcard listen address (0.0.0.0, as in a
    /// container) is replaced by the address this host uses to reach etcd, which is the one
    /// other nodes can dial.
    pub fn advertise(&self) -> Result<SocketAddr> {
        let listen = self.listen()?;
        if let Some(a) = self.advertise {
            return Ok(a);
        }
        if !listen.ip().is_unspecified() {
            return Ok(listen);
        }
        let ip = self
            .etcd
            .iter()
            .find_map(|url| route_source(url))
            .unwrap_or(listen.ip());
        Ok(SocketAddr::new(ip, listen.port()))
    }

    /// `--listen` (checked to be set before a node starts).
    pub fn listen(&self) -> Result<SocketAddr> {
        self.listen.context("mesh.listen (--listen) is not set")
    }

    /// The id the node's certificate proves (`tls`), else `--node-id`, else a random one. A
    /// `--node-id` other than the certificate's is an error: peers would refuse the node
    /// naming its own id.
    pub fn node_id(&self, tls: Option<&ClusterTls>) -> Result<NodeId> {
        let proven = match tls {
            Some(tls) => tls.node_id().context("reading the node id in --tls-cert")?,
            None => None,
        };
        match (proven, self.node_id) {
            (Some(proven), Some(given)) if proven != given => bail!(
                "--node-id {given} is not the id {proven} that --tls-cert names; drop --node-id \
                 (a node takes its id from its certificate)"
            ),
            (Some(id), _) | (None, Some(id)) => Ok(id),
            (None, None) => Ok(NodeId(rand::random())),
        }
    }

    pub fn etcd_config(&self) -> EtcdConfig {
        EtcdConfig {
            endpoints: self.etcd.clone(),
            cluster: self.cluster.clone(),
            lease_ttl: self.lease_ttl,
            ..EtcdConfig::default()
        }
    }

    /// The node's cluster identity from `--tls-*`, read and checked once for gRPC and QUIC;
    /// `None`, with a warning, without them.
    pub fn cluster_tls(&self) -> Result<Option<ClusterTls>> {
        let (Some(ca), Some(cert), Some(key)) = (&self.tls_ca, &self.tls_cert, &self.tls_key)
        else {
            tracing::warn!(
                "no --tls-ca/--tls-cert/--tls-key: the cluster is UNAUTHENTICATED (plaintext \
                 gRPC, KV encrypted to anyone); make certificates with `kvmesh certs`"
            );
            return Ok(None);
        };
        let tls = ClusterTls::load(ca, cert, key).context("loading the cluster TLS files")?;
        tracing::info!(ca = %ca.display(), cert = %cert.display(), "mutual TLS between nodes");
        Ok(Some(tls))
    }

    /// QUIC settings on `listen` (UDP): mutual TLS with `tls`, self-signed without.
    pub fn quic_config(&self, listen: SocketAddr, tls: Option<&ClusterTls>) -> QuicConfig {
        QuicConfig {
            listen,
            tls: tls.map_or(TlsConfig::SelfSigned, |t| TlsConfig::Cluster(t.clone())),
            ..QuicConfig::default()
        }
    }

    /// The KV transport: QUIC on `listen` (UDP), plus RDMA when compiled in and a device
    /// exists (it says at start-up which, and why not RDMA).
    pub fn kv_transport(
        &self,
        listen: SocketAddr,
        tls: Option<&ClusterTls>,
    ) -> Result<NetworkTransport> {
        let quic = QuicTransport::start(self.quic_config(listen, tls))
            .context("starting the QUIC transport")?;
        Ok(NetworkTransport::open(quic, RdmaConfig::default()))
    }

    pub async fn connect(&self) -> Result<EtcdDiscovery> {
        EtcdDiscovery::connect(self.etcd_config())
            .await
            .with_context(|| format!("connecting to etcd at {}", self.etcd.join(",")))
    }
}

/// Tells `retain` the live nodes (of any role) each time discovery changes, so that
/// connections to nodes that left are dropped.
pub fn forget_departed_nodes(
    discovery: &EtcdDiscovery,
    retain: impl Fn(&HashSet<NodeId>) + Send + 'static,
) {
    let discovery = discovery.clone();
    let mut changes = discovery.subscribe();
    tokio::spawn(async move {
        while changes.changed().await.is_ok() {
            let alive: HashSet<_> = [NodeRole::Prefill, NodeRole::Decode]
                .into_iter()
                .flat_map(|role| discovery.nodes(role))
                .map(|n| n.info.node_id)
                .collect();
            retain(&alive);
        }
    });
}

/// Where a node's workers announce prefix-cache changes: the etcd publisher of the node's
/// current registration. Events that come while the node is not registered (before its
/// first registration, or between two roles) are kept and handed to the next publisher, so
/// the prefix index never misses what the pool holds.
#[derive(Clone, Default)]
pub struct KvPublisherSlot(Arc<Mutex<PublisherState>>);

#[derive(Default)]
struct PublisherState {
    publisher: Option<KvEventPublisher>,
    pending: Vec<TieredKvEvent>,
}

impl KvPublisherSlot {
    fn lock(&self) -> std::sync::MutexGuard<'_, PublisherState> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publishes through `publisher` from now on, starting with the events kept meanwhile.
    pub fn install(&self, publisher: KvEventPublisher) {
        let mut state = self.lock();
        let pending = std::mem::take(&mut state.pending);
        if !pending.is_empty() {
            publisher.publish(pending);
        }
        state.publisher = Some(publisher);
    }

    /// Stops publishing (the registration ends); events are kept for the next publisher.
    pub fn retire(&self) {
        self.lock().publisher = None;
    }

    pub fn stats(&self) -> Option<PublisherStats> {
        self.lock().publisher.as_ref().map(|p| p.stats())
    }

    fn publish(&self, events: Vec<TieredKvEvent>) {
        let mut state = self.lock();
        match &state.publisher {
            Some(p) => p.publish(events),
            None => state.pending.extend(events),
        }
    }
}

/// A worker's event sink that forwards to the node's publisher.
pub fn kv_event_sink(slot: &KvPublisherSlot) -> Arc<dyn KvEventSink> {
    Arc::new(PublisherSink(slot.clone()))
}

struct PublisherSink(KvPublisherSlot);

impl std::fmt::Debug for PublisherSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let registered = self.0.lock().publisher.is_some();
        f.debug_struct("PublisherSink")
            .field("registered", &registered)
            .finish()
    }
}

impl KvEventSink for PublisherSink {
    /// The publisher writes under this node's lease: its only worker is `_node`.
    fn publish(&self, _node: NodeId, events: Vec<TieredKvEvent>) {
        self.0.publish(events);
    }
}

/// The async runtime of a node process (its compute runs on its own threads).
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}
