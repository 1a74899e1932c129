//! `kvmesh prefill | decode | router`: one mesh role per process, found through etcd.
//!
//! Every node registers `/{cluster}/nodes/{role}/{node_id}` under an etcd lease, refreshes
//! its load report under that lease, and on SIGINT/SIGTERM (or a `Drain` RPC) drains: it
//! revokes the lease first (routers stop sending within a watch round trip), finishes what it
//! accepted, then exits.

pub mod config;
pub mod decode;
pub mod engine_args;
pub mod metrics;
pub mod prefill;
pub mod router;

use crate::config::{env_vars, node_id_hex};
use anyhow::{Context, Result};
use clap::Args;
use config::MeshNodeConfig;
use humantime_serde::re::humantime;
use kvmesh_common::kv_tier::{KvEventSink, TieredKvEvent};
use kvmesh_common::tls::ClusterTls;
use kvmesh_common::{LoadReport, NodeId, NodeInfo, NodeRole};
use kvmesh_kvstore::{Discovery, EtcdConfig, EtcdDiscovery, KvEventPublisher, NodeLease};
use kvmesh_transfer::{NetworkTransport, QuicConfig, QuicTransport, RdmaConfig, TlsConfig};
use serde::Serialize;
use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
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
    /// This node's id (hex; default: random). Must be unique in the cluster.
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
    /// Serve Prometheus metrics (`GET /metrics`) here (prefill and decode nodes; a router
    /// serves them on its API port).
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

    pub fn node_id(&self) -> NodeId {
        self.node_id.unwrap_or_else(|| NodeId(rand::random()))
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

/// Where a node's workers announce prefix-cache changes: the etcd publisher, once the node
/// is registered (it publishes under the node's lease).
pub type KvPublisherSlot = Arc<OnceLock<KvEventPublisher>>;

/// A worker's event sink that forwards to the node's publisher.
pub fn kv_event_sink(slot: &KvPublisherSlot) -> Arc<dyn KvEventSink> {
    Arc::new(PublisherSink(slot.clone()))
}

/// Forwards to the node's publisher; events before it is registered are dropped (the pool is
/// empty until the first request, which comes only after registration).
struct PublisherSink(KvPublisherSlot);

impl std::fmt::Debug for PublisherSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let registered = self.0.get().is_some();
        f.debug_struct("PublisherSink")
            .field("registered", &registered)
            .finish()
    }
}

impl KvEventSink for PublisherSink {
    /// The publisher writes under this node's lease: its only worker is `_node`.
    fn publish(&self, _node: NodeId, events: Vec<TieredKvEvent>) {
        if let Some(publisher) = self.0.get() {
            publisher.publish(events);
        }
    }
}

/// Registers the node, then reports its load every `interval` until a signal arrives or
/// `draining()` turns true; then revokes the lease (leaving routing at once).
pub async fn serve_lease(
    discovery: &EtcdDiscovery,
    info: NodeInfo,
    kv_events: &KvPublisherSlot,
    mut load: impl FnMut() -> LoadReport,
    draining: impl Fn() -> bool,
) -> Result<()> {
    let node = info.node_id;
    let role = info.role;
    let lease: NodeLease = discovery
        .register(info)
        .await
        .with_context(|| format!("registering {} node {node}", role.as_str()))?;
    tracing::info!(%node, role = role.as_str(), "registered");
    // The pool is empty until the first request, which comes only after registration.
    let _ = kv_events.set(KvEventPublisher::start(&lease));
    let mut publisher_metrics = metrics::PublisherMetrics::new(node);
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let signal = crate::serve::shutdown_signal();
    tokio::pin!(signal);
    loop {
        tokio::select! {
            () = &mut signal => break,
            _ = tick.tick() => {
                lease.report_load(load());
                if let Some(p) = kv_events.get() {
                    publisher_metrics.update(&p.stats());
                }
                if draining() {
                    tracing::info!("drain requested");
                    break;
                }
            }
        }
    }
    if let Err(e) = lease.revoke().await {
        tracing::warn!("revoking the lease: {e}; the node leaves when it expires");
    }
    tracing::info!(%node, "left the mesh; draining");
    Ok(())
}

/// A worker as the node process drives it.
pub trait NodeWorker: Send + 'static {
    fn load(&self) -> LoadReport;
    fn is_draining(&self) -> bool;
    /// Stops taking requests and waits until those accepted are done, or `timeout` passes
    /// (blocking). Returns whether they all finished.
    fn drain_and_join(self, timeout: Duration) -> bool;
}

/// Both worker kinds have the same handle surface; one impl each, written once.
macro_rules! node_worker {
    ($($worker:ty),*) => {$(
        impl NodeWorker for $worker {
            fn load(&self) -> LoadReport {
                self.handle().load()
            }

            fn is_draining(&self) -> bool {
                self.handle().is_draining()
            }

            fn drain_and_join(self, timeout: Duration) -> bool {
                self.handle().drain();
                self.join_within(timeout)
            }
        }
    )*};
}

node_worker!(kvmesh_decode::DecodeWorker, kvmesh_prefill::PrefillWorker);

/// The life of a node: serves `routes` (gRPC, mutual TLS with `tls`) on `--listen`,
/// registers `info`, reports load until a signal or a `Drain` RPC, leaves the mesh, drains
/// the worker, stops the server.
pub async fn run_node(
    args: &MeshNodeConfig,
    tls: Option<&ClusterTls>,
    discovery: &EtcdDiscovery,
    routes: tonic::service::Routes,
    info: NodeInfo,
    kv_events: &KvPublisherSlot,
    worker: impl NodeWorker,
) -> Result<()> {
    if let Some(addr) = args.metrics_listen {
        metrics::serve(addr);
    }
    let listen = args.listen()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        server = server
            .tls_config(tls.grpc_server())
            .context("gRPC server TLS")?;
    }
    let server = server
        .add_routes(routes)
        .serve_with_shutdown(listen, async {
            let _ = stopped.await;
        });
    let server = tokio::spawn(server);
    tracing::info!(node = %info.node_id, role = info.role.as_str(), listen = %listen, "serving");
    serve_lease(
        discovery,
        info,
        kv_events,
        || worker.load(),
        || worker.is_draining(),
    )
    .await?;
    let timeout = args.drain_timeout;
    if !tokio::task::spawn_blocking(move || worker.drain_and_join(timeout)).await? {
        tracing::warn!(
            "drain timeout ({timeout:?}) passed; stopped with requests open (the router \
             moves them to other nodes)"
        );
    }
    let _ = stop.send(());
    server.await?.context("gRPC server")
}

/// The async runtime of a node process (its compute runs on its own threads).
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}
