//! The writers' side: one node's registration, kept alive by a background task.
//!
//! The task refreshes the lease every TTL/3, writes load reports (at most one per
//! `load_report_interval`, only when changed), and re-registers by itself when it finds the
//! lease gone (etcd unreachable for longer than the TTL): a node never has to notice that
//! etcd went away.

use super::{bounded, encode, put_if_absent, EtcdConfig};
use crate::StoreError;
use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper, PutOptions};
use kvmesh_common::{LoadReport, NodeId, NodeInfo};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::{debug, info, warn};

/// The least time between two attempts at a load write that failed.
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// A live registration. [`revoke`](NodeLease::revoke) it to drain (the key disappears at
/// once); dropping it stops the keep-alive, so the key expires with the TTL like a crashed
/// process's.
pub struct NodeLease {
    info: NodeInfo,
    client: Client,
    config: EtcdConfig,
    load: watch::Sender<LoadReport>,
    /// The lease currently holding the key; replaced when the task re-registers.
    lease_id: Arc<AtomicI64>,
    stop: CancellationToken,
    _stop_on_drop: DropGuard,
    task: JoinHandle<()>,
}

impl NodeLease {
    pub(super) async fn start(
        client: Client,
        config: EtcdConfig,
        info: NodeInfo,
    ) -> Result<Self, StoreError> {
        let lease_id = grant(&client, &config).await?;
        let created = put_if_absent(&client, &config, lease_id, &info, LoadReport::default());
        match created.await {
            Ok(true) => {}
            Ok(false) => {
                revoke_quietly(&client, &config, lease_id).await;
                return Err(StoreError::AlreadyRegistered(info.node_id));
            }
            Err(e) => {
                revoke_quietly(&client, &config, lease_id).await;
                return Err(e);
            }
        }
        let lease_id = Arc::new(AtomicI64::new(lease_id));
        let (load, load_rx) = watch::channel(LoadReport::default());
        let stop = CancellationToken::new();
        let keeper = Keeper {
            client: client.clone(),
            config: config.clone(),
            info: info.clone(),
            load: load_rx,
            lease_id: lease_id.clone(),
            registered: true,
            written: LoadReport::default(),
            stream: None,
        };
        let task = tokio::spawn({
            let stop = stop.clone();
            async move {
                stop.run_until_cancelled(keeper.run()).await;
            }
        });
        Ok(NodeLease {
            info,
            client,
            config,
            load,
            lease_id,
            _stop_on_drop: stop.clone().drop_guard(),
            stop,
            task,
        })
    }

    pub fn node_id(&self) -> NodeId {
        self.info.node_id
    }

    pub fn info(&self) -> &NodeInfo {
        &self.info
    }

    /// The etcd lease that currently holds the node's key (it changes if the node had to
    /// re-register); keys published under it vanish with the node.
    pub fn lease_id(&self) -> i64 {
        self.lease_id.load(Ordering::Acquire)
    }

    pub(crate) fn client(&self) -> &Client {
        &self.client
    }

    pub(crate) fn config(&self) -> &EtcdConfig {
        &self.config
    }

    /// The live lease id, shared with the lease task that replaces it.
    pub(crate) fn lease_cell(&self) -> Arc<AtomicI64> {
        self.lease_id.clone()
    }

    /// Cancelled when the lease is revoked or dropped: work under the lease stops with it.
    pub(crate) fn stopped(&self) -> CancellationToken {
        self.stop.clone()
    }

    /// Hands the latest load to the lease task; never blocks. Reports that arrive faster
    /// than `load_report_interval` are coalesced: only the latest is written.
    pub fn report_load(&self, load: LoadReport) {
        self.load.send_replace(load);
    }

    /// Drains: stops the keep-alive and revokes the lease, so the key disappears at once.
    /// If etcd is unreachable the key still goes, when the lease expires.
    pub async fn revoke(mut self) -> Result<(), StoreError> {
        self.stop.cancel();
        // The task only stops at an await point; it never panics, so the result is ().
        let _ = (&mut self.task).await;
        let mut lease = self.client.lease_client();
        let id = self.lease_id();
        match bounded(&self.config, self.config.request_timeout, lease.revoke(id)).await {
            Ok(_) | Err(StoreError::LeaseExpired) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

impl std::fmt::Debug for NodeLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeLease")
            .field("node", &self.info.node_id)
            .field("lease", &self.lease_id())
            .finish_non_exhaustive()
    }
}

async fn grant(client: &Client, config: &EtcdConfig) -> Result<i64, StoreError> {
    let mut lease = client.lease_client();
    let ttl = config.lease_ttl_secs();
    let resp = bounded(config, config.request_timeout, lease.grant(ttl, None)).await?;
    Ok(resp.id())
}

/// Best effort: a lease we fail to revoke holds no key and expires with its TTL.
async fn revoke_quietly(client: &Client, config: &EtcdConfig, id: i64) {
    let mut lease = client.lease_client();
    if let Err(e) = bounded(config, config.request_timeout, lease.revoke(id)).await {
        debug!(error = %e, lease = id, "could not revoke an unused lease");
    }
}

/// The lease task's state.
struct Keeper {
    client: Client,
    config: EtcdConfig,
    info: NodeInfo,
    load: watch::Receiver<LoadReport>,
    lease_id: Arc<AtomicI64>,
    /// Whether the key exists under `lease_id` (false after the lease was found gone and
    /// until a re-registration succeeds).
    registered: bool,
    /// The load last written to etcd.
    written: LoadReport,
    /// The open keep-alive stream; reopened after any failure.
    stream: Option<(LeaseKeeper, LeaseKeepAliveStream)>,
}

impl Keeper {
    async fn run(mut self) {
        let ttl = Duration::from_secs(self.config.lease_ttl_secs() as u64);
        let mut refresh = tokio::time::interval_at(Instant::now() + ttl / 3, ttl / 3);
        refresh.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut next_write = Instant::now();
        let mut dirty = false;
        loop {
            tokio::select! {
                _ = refresh.tick() => self.refresh().await,
                changed = self.load.changed(), if !dirty => {
                    if changed.is_err() {
                        return; // the NodeLease is gone
                    }
                    dirty = true;
                }
                _ = tokio::time::sleep_until(next_write), if dirty => {
                    let written = self.write_load().await;
                    dirty = !written;
                    // A failed write is retried, but never in a tight loop.
                    let pause = if written { Duration::ZERO } else { RETRY_PAUSE };
                    let interval = self.config.load_report_interval.max(pause);
                    next_write = Instant::now() + interval;
                }
            }
        }
    }

    /// One keep-alive round trip; re-registers when the lease is gone.
    async fn refresh(&mut self) {
        if self.registered {
            match self.keep_alive().await {
                Ok(()) => return,
                Err(StoreError::LeaseExpired) => {
                    warn!(node = %self.info.node_id, "lease gone; re-registering");
                    self.registered = false;
                }
                Err(e) => {
                    // etcd away: keep trying; if it stays away past the TTL the lease is gone
                    // and the next successful round trip says so.
                    debug!(node = %self.info.node_id, error = %e, "lease keep-alive failed");
                    self.stream = None;
                    return;
                }
            }
        }
        self.reregister().await;
    }

    async fn keep_alive(&mut self) -> Result<(), StoreError> {
        let config = &self.config;
        let Some((keeper, stream)) = &mut self.stream else {
            // Opening the stream is itself a keep-alive round trip.
            let mut lease = self.client.lease_client();
            let id = self.lease_id.load(Ordering::Acquire);
            let opened = bounded(config, config.request_timeout, lease.keep_alive(id)).await?;
            self.stream = Some(opened);
            return Ok(());
        };
        bounded(config, config.request_timeout, keeper.keep_alive()).await?;
        match bounded(config, config.request_timeout, stream.message()).await? {
            Some(resp) if resp.ttl() > 0 => Ok(()),
            Some(_) => Err(StoreError::LeaseExpired),
            None => Err(StoreError::Etcd("keep-alive stream closed".into())),
        }
    }

    /// Grants a fresh lease and recreates the key under it, with the latest load.
    async fn reregister(&mut self) {
        self.stream = None;
        let id = match grant(&self.client, &self.config).await {
            Ok(id) => id,
            Err(e) => {
                debug!(node = %self.info.node_id, error = %e, "re-registration failed");
                return;
            }
        };
        self.lease_id.store(id, Ordering::Release);
        let load = *self.load.borrow();
        match put_if_absent(&self.client, &self.config, id, &self.info, load).await {
            Ok(true) => {
                info!(node = %self.info.node_id, "re-registered");
                self.registered = true;
                self.written = load;
            }
            Ok(false) => {
                warn!(node = %self.info.node_id, "node id taken by another registration; retrying");
                revoke_quietly(&self.client, &self.config, id).await;
            }
            Err(e) => debug!(node = %self.info.node_id, error = %e, "re-registration failed"),
        }
    }

    /// Writes the latest load if it changed; returns false if it must be retried.
    async fn write_load(&mut self) -> bool {
        let load = *self.load.borrow_and_update();
        if load == self.written {
            return true;
        }
        if !self.registered {
            return false; // the re-registration writes the latest load
        }
        let key = self.config.node_key(self.info.role, self.info.node_id);
        let lease = self.lease_id.load(Ordering::Acquire);
        let options = PutOptions::new().with_lease(lease);
        let mut kv = self.client.kv_client();
        let put = kv.put(key, encode(&self.info, load), Some(options));
        match bounded(&self.config, self.config.request_timeout, put).await {
            Ok(_) => {
                self.written = load;
                true
            }
            Err(StoreError::LeaseExpired) => {
                self.registered = false;
                self.reregister().await;
                self.registered
            }
            Err(e) => {
                debug!(node = %self.info.node_id, error = %e, "load report not written");
                false
            }
        }
    }
}
