//! Discovery backed by etcd.
//!
//! Each node's registration is `/{cluster}/nodes/{role}/{node_id}` -> JSON [`NodeEntry`],
//! written under the node's lease: a crashed node vanishes when the lease expires, a draining
//! node revokes it. Readers keep an in-memory snapshot current from a watch, so `nodes` never
//! touches etcd, and keep serving the last known membership while etcd is away.

mod config;
mod leader;
mod lease;
mod watch;

pub use config::EtcdConfig;
pub use leader::{duty_key, Leadership};
pub use lease::NodeLease;

use crate::{Discovery, EtcdPrefixIndex, NodeEntry, StoreError};
use etcd_client::{Client, Compare, CompareOp, ConnectOptions, PutOptions, Txn, TxnOp};
use kvmesh_common::{LoadReport, NodeInfo, NodeRole};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::{CancellationToken, DropGuard};
use watch::{Snapshot, Watcher};

/// HTTP/2 pings detect a silently dead connection under a long-lived watch. etcd answers
/// pings more often than every 5 s (its `--grpc-keepalive-min-time`) with GOAWAY, so stay
/// above that.
const H2_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(6);
const H2_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(3);

/// An etcd-backed node registry: a watched snapshot for readers and [`register`] for
/// nodes. Cheap to clone; the watch stops when the last clone is dropped.
///
/// [`register`]: EtcdDiscovery::register
#[derive(Clone)]
pub struct EtcdDiscovery {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client,
    config: EtcdConfig,
    snapshot: Arc<Snapshot>,
    _stop_watch: DropGuard,
}

impl std::fmt::Debug for EtcdDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdDiscovery")
            .field("endpoints", &self.inner.config.endpoints)
            .field("cluster", &self.inner.config.cluster)
            .finish_non_exhaustive()
    }
}

impl EtcdDiscovery {
    /// Connects, loads the current membership and starts the watch that keeps it current.
    /// Retries until `connect_timeout`, then fails with `Unreachable`.
    pub async fn connect(config: EtcdConfig) -> Result<Self, StoreError> {
        let deadline = tokio::time::Instant::now() + config.connect_timeout;
        let client = connect_client(&config).await?;
        let snapshot = Arc::new(Snapshot::default());
        let mut backoff = Backoff::default();
        let revision = loop {
            match watch::list(&client, &config).await {
                Ok((entries, revision)) => {
                    snapshot.replace(entries);
                    break revision;
                }
                Err(e) => {
                    let retry_at = tokio::time::Instant::now() + backoff.next();
                    if retry_at >= deadline {
                        return Err(e);
                    }
                    tokio::time::sleep_until(retry_at).await;
                }
            }
        };

        let stop = CancellationToken::new();
        let watcher = Watcher::new(client.clone(), config.clone(), snapshot.clone());
        tokio::spawn(watcher.run(revision, stop.clone()));
        Ok(EtcdDiscovery {
            inner: Arc::new(Inner {
                client,
                config,
                snapshot,
                _stop_watch: stop.drop_guard(),
            }),
        })
    }

    pub fn config(&self) -> &EtcdConfig {
        &self.inner.config
    }

    /// Registers `info` under a fresh lease and keeps the lease alive until the returned
    /// [`NodeLease`] is revoked or dropped. Fails with `AlreadyRegistered` while a live key
    /// holds the node id.
    pub async fn register(&self, info: NodeInfo) -> Result<NodeLease, StoreError> {
        NodeLease::start(self.inner.client.clone(), self.inner.config.clone(), info).await
    }

    /// A prefix index over this connection: loads every node's published KV state, then
    /// keeps it current from a watch (see [`EtcdPrefixIndex::connect`]).
    pub async fn prefix_index(&self) -> Result<EtcdPrefixIndex, StoreError> {
        EtcdPrefixIndex::start(self.inner.client.clone(), self.inner.config.clone()).await
    }
}

/// Validates `config` and opens a client. Connecting is lazy (the channel dials on first
/// use), so an unreachable etcd shows in the first request, not here.
pub(crate) async fn connect_client(config: &EtcdConfig) -> Result<Client, StoreError> {
    config.validate()?;
    let options = ConnectOptions::new()
        .with_connect_timeout(config.connect_timeout)
        .with_keep_alive(H2_KEEPALIVE_INTERVAL, H2_KEEPALIVE_TIMEOUT)
        .with_require_leader(true);
    let connecting = Client::connect(&config.endpoints, Some(options));
    bounded(config, config.connect_timeout, connecting).await
}

impl Discovery for EtcdDiscovery {
    fn nodes(&self, role: NodeRole) -> Vec<NodeEntry> {
        self.inner.snapshot.nodes(role)
    }

    fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.inner.snapshot.subscribe()
    }
}

/// Creates the node's key under `lease` unless some key, in any role, already holds the node
/// id (ids name nodes to peers whatever their role). Returns whether it was created.
async fn put_if_absent(
    client: &Client,
    config: &EtcdConfig,
    lease: i64,
    info: &NodeInfo,
    load: LoadReport,
) -> Result<bool, StoreError> {
    let key = config.node_key(info.role, info.node_id);
    let value = encode(info, load);
    let free = [NodeRole::Router, NodeRole::Prefill, NodeRole::Decode].map(|role| {
        Compare::create_revision(config.node_key(role, info.node_id), CompareOp::Equal, 0)
    });
    let txn = Txn::new().when(free).and_then([TxnOp::put(
        key,
        value,
        Some(PutOptions::new().with_lease(lease)),
    )]);
    let mut kv = client.kv_client();
    let resp = bounded(config, config.request_timeout, kv.txn(txn)).await?;
    Ok(resp.succeeded())
}

fn encode(info: &NodeInfo, load: LoadReport) -> Vec<u8> {
    let entry = NodeEntry {
        info: info.clone(),
        load,
    };
    serde_json::to_vec(&entry).expect("NodeEntry serializes")
}

/// A value under the prefix must decode and belong to the key it sits at.
fn decode(config: &EtcdConfig, key: &[u8], value: &[u8]) -> Result<NodeEntry, StoreError> {
    let corrupt = |reason: String| StoreError::Corrupt {
        key: String::from_utf8_lossy(key).into_owned(),
        reason,
    };
    let entry: NodeEntry = serde_json::from_slice(value).map_err(|e| corrupt(e.to_string()))?;
    let expected = config.node_key(entry.info.role, entry.info.node_id);
    if expected.as_bytes() != key {
        return Err(corrupt(format!("holds the entry of {expected}")));
    }
    Ok(entry)
}

/// Runs one etcd call with a deadline, mapping failures to `StoreError`.
pub(crate) async fn bounded<T>(
    config: &EtcdConfig,
    limit: Duration,
    call: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(limit, call).await {
        Ok(result) => result.map_err(|e| classify(config, e)),
        Err(_) => Err(unreachable(config, format!("no answer within {limit:?}"))),
    }
}

fn unreachable(config: &EtcdConfig, reason: String) -> StoreError {
    StoreError::Unreachable {
        endpoints: config.endpoints.join(","),
        reason,
    }
}

/// Transport trouble is `Unreachable` (retry later); anything etcd itself rejected is `Etcd`.
/// The next batch of a watch, or why the watch ended (closed, failed, or cancelled, e.g.
/// because its start revision was compacted): the caller then re-lists.
pub(crate) async fn next_watch_batch(
    stream: &mut etcd_client::WatchStream,
    config: &EtcdConfig,
) -> Result<etcd_client::WatchResponse, StoreError> {
    let resp = match stream.message().await {
        Ok(Some(resp)) => resp,
        Ok(None) => return Err(StoreError::Etcd("watch stream closed".into())),
        Err(e) => return Err(classify(config, e)),
    };
    if resp.canceled() {
        return Err(StoreError::Etcd(format!(
            "watch canceled (compacted at {}): {}",
            resp.compact_revision(),
            resp.cancel_reason()
        )));
    }
    Ok(resp)
}

pub(crate) fn classify(config: &EtcdConfig, e: etcd_client::Error) -> StoreError {
    use etcd_client::Error as E;
    use tonic::Code;
    match &e {
        E::InvalidUri(_) | E::InvalidArgs(_) => StoreError::InvalidConfig(e.to_string()),
        E::TransportError(_) | E::IoError(_) => unreachable(config, e.to_string()),
        // The server says "requested lease not found"; the keep-alive opener "lease not found".
        E::GRpcStatus(s)
            if s.code() == Code::NotFound && s.message().contains("lease not found") =>
        {
            StoreError::LeaseExpired
        }
        E::LeaseKeepAliveError(m) if m.contains("lease not found") => StoreError::LeaseExpired,
        E::GRpcStatus(s)
            if matches!(
                s.code(),
                Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown
            ) =>
        {
            unreachable(config, e.to_string())
        }
        _ => StoreError::Etcd(e.to_string()),
    }
}

/// Exponential backoff between reconnect attempts: 50 ms doubling to 500 ms, so a returning
/// etcd is noticed within half a second.
#[derive(Debug)]
pub(crate) struct Backoff {
    next: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff { next: Self::FIRST }
    }
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(50);
    const MAX: Duration = Duration::from_millis(500);

    pub(crate) fn next(&mut self) -> Duration {
        let d = self.next;
        self.next = (d * 2).min(Self::MAX);
        d
    }

    pub(crate) fn reset(&mut self) {
        self.next = Self::FIRST;
    }
}
