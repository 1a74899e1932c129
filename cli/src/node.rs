//! `kvmesh prefill | decode | router`: one mesh role per process, found through etcd.
//!
//! Every node registers `/{cluster}/nodes/{role}/{node_id}` under an etcd lease, refreshes
//! its load report under that lease, and on SIGINT/SIGTERM (or a `Drain` RPC) drains: it
//! revokes the lease first (routers stop sending within a watch round trip), finishes what it
//! accepted, then exits.

pub mod decode;
pub mod prefill;
pub mod router;

use anyhow::{Context, Result};
use clap::Args;
use humantime_serde::re::humantime;
use kvmesh_common::{LoadReport, NodeId, NodeInfo};
use kvmesh_engine::worker_load::WorkerLoad;
use kvmesh_kvstore::{EtcdConfig, EtcdDiscovery, NodeLease};
use kvmesh_transfer::{QuicConfig, TlsConfig};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Flags every mesh node takes.
#[derive(Args, Clone, Debug)]
pub struct MeshArgs {
    /// etcd client URLs, comma-separated (e.g. http://127.0.0.1:2379).
    #[arg(long, env = "KVMESH_ETCD", value_delimiter = ',', required = true)]
    pub etcd: Vec<String>,
    /// Where this node listens: gRPC (TCP) for prefill/decode, HTTP for the router; a decode
    /// node also receives KV over QUIC on the same port (UDP).
    #[arg(long, env = "KVMESH_LISTEN")]
    pub listen: SocketAddr,
    /// The address other nodes use to reach this one (default: --listen).
    #[arg(long, env = "KVMESH_ADVERTISE")]
    pub advertise: Option<SocketAddr>,
    /// Name of the mesh: the root of its etcd keys, so meshes can share one etcd.
    #[arg(long, env = "KVMESH_CLUSTER", default_value = "kvmesh")]
    pub cluster: String,
    /// This node's id (hex; default: random). Must be unique in the cluster.
    #[arg(long, env = "KVMESH_NODE_ID", value_parser = parse_node_id)]
    pub node_id: Option<NodeId>,
    /// How long the node outlives its last etcd keep-alive (a crashed node leaves routing
    /// after this).
    #[arg(long, env = "KVMESH_LEASE_TTL", default_value = "3s", value_parser = humantime::parse_duration)]
    pub lease_ttl: Duration,
    /// CA certificate (PEM) for mutual TLS on the KV transport; with --tls-cert and
    /// --tls-key. Without them the transport uses a self-signed certificate (encrypted, not
    /// authenticated).
    #[arg(long, env = "KVMESH_TLS_CA", requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<PathBuf>,
    #[arg(long, env = "KVMESH_TLS_CERT", requires_all = ["tls_ca", "tls_key"])]
    pub tls_cert: Option<PathBuf>,
    #[arg(long, env = "KVMESH_TLS_KEY", requires_all = ["tls_ca", "tls_cert"])]
    pub tls_key: Option<PathBuf>,
}

fn parse_node_id(s: &str) -> Result<NodeId, String> {
    u64::from_str_radix(s.trim_start_matches("0x"), 16)
        .map(NodeId)
        .map_err(|e| format!("node id must be hex: {e}"))
}

impl MeshArgs {
    pub fn advertise(&self) -> SocketAddr {
        self.advertise.unwrap_or(self.listen)
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

    /// The KV transport on `listen` (UDP).
    pub fn quic_config(&self, listen: SocketAddr) -> QuicConfig {
        let tls = match (&self.tls_ca, &self.tls_cert, &self.tls_key) {
            (Some(ca), Some(cert), Some(key)) => TlsConfig::Files {
                ca: ca.clone(),
                cert: cert.clone(),
                key: key.clone(),
            },
            _ => TlsConfig::SelfSigned,
        };
        QuicConfig {
            listen,
            tls,
            ..QuicConfig::default()
        }
    }

    pub async fn connect(&self) -> Result<EtcdDiscovery> {
        EtcdDiscovery::connect(self.etcd_config())
            .await
            .with_context(|| format!("connecting to etcd at {}", self.etcd.join(",")))
    }
}

pub fn load_report(load: WorkerLoad) -> LoadReport {
    LoadReport {
        running: load.running,
        waiting: load.waiting,
        kv_blocks_used: load.kv_blocks_used,
    }
}

/// Registers the node, then reports its load every `interval` until a signal arrives or
/// `draining()` turns true; then revokes the lease (leaving routing at once).
pub async fn serve_lease(
    discovery: &EtcdDiscovery,
    info: NodeInfo,
    mut load: impl FnMut() -> WorkerLoad,
    draining: impl Fn() -> bool,
) -> Result<()> {
    let node = info.node_id;
    let role = info.role;
    let lease: NodeLease = discovery
        .register(info)
        .await
        .with_context(|| format!("registering {} node {node}", role.as_str()))?;
    tracing::info!(%node, role = role.as_str(), "registered");
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let signal = crate::serve::shutdown_signal();
    tokio::pin!(signal);
    loop {
        tokio::select! {
            () = &mut signal => break,
            _ = tick.tick() => {
                lease.report_load(load_report(load()));
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

/// The async runtime of a node process (its compute runs on its own threads).
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}
