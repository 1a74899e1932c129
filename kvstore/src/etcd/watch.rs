//! The readers' side: a snapshot of the registry kept current by one watch.
//!
//! Consistency rests on list-then-watch: list the prefix at revision R, then watch from R+1,
//! so no event falls between the two. Whenever the watch breaks (etcd gone, compaction,
//! cancellation) the snapshot is kept as is (the last known membership) and the cycle starts
//! over with a fresh list, which replaces the snapshot wholesale: deletes missed while
//! disconnected cannot survive it.

use super::{bounded, decode, next_watch_batch, Backoff, EtcdConfig};
use crate::{NodeEntry, StoreError};
use etcd_client::{Client, EventType, GetOptions, WatchOptions};
use kvmesh_common::NodeRole;
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

type Entries = HashMap<Vec<u8>, NodeEntry>;

/// The registry as last seen, keyed by etcd key (deletes carry only the key).
#[derive(Debug)]
pub(super) struct Snapshot {
    entries: RwLock<Entries>,
    generation: watch::Sender<u64>,
}

impl Default for Snapshot {
    fn default() -> Self {
        Snapshot {
            entries: RwLock::default(),
            generation: watch::Sender::new(0),
        }
    }
}

impl Snapshot {
    pub(super) fn nodes(&self, role: NodeRole) -> Vec<NodeEntry> {
        let entries = self.entries.read().expect("snapshot lock");
        let mut nodes: Vec<NodeEntry> = entries
            .values()
            .filter(|e| e.info.role == role)
            .cloned()
            .collect();
        nodes.sort_by_key(|e| e.info.node_id);
        nodes
    }

    pub(super) fn subscribe(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    pub(super) fn replace(&self, new: Entries) {
        let mut entries = self.entries.write().expect("snapshot lock");
        if *entries != new {
            *entries = new;
            self.bump();
        }
    }

    /// `None` removes the key (a delete, or a put of an undecodable value).
    fn set(&self, key: &[u8], entry: Option<NodeEntry>) {
        let mut entries = self.entries.write().expect("snapshot lock");
        let changed = match entry {
            Some(entry) => entries.insert(key.to_vec(), entry.clone()) != Some(entry),
            None => entries.remove(key).is_some(),
        };
        if changed {
            self.bump();
        }
    }

    fn bump(&self) {
        self.generation.send_modify(|g| *g += 1);
    }
}

/// Reads the whole registry; returns it with the revision it was read at.
pub(super) async fn list(
    client: &Client,
    config: &EtcdConfig,
) -> Result<(Entries, i64), StoreError> {
    let mut kv = client.kv_client();
    let prefix = config.nodes_prefix();
    let resp = bounded(
        config,
        config.request_timeout,
        kv.get(prefix, Some(GetOptions::new().with_prefix())),
    )
    .await?;
    let revision = resp.header().map_or(0, |h| h.revision());
    let entries = resp
        .kvs()
        .iter()
        .filter_map(|kv| match decode(config, kv.key(), kv.value()) {
            Ok(entry) => Some((kv.key().to_vec(), entry)),
            Err(e) => {
                warn!(error = %e, "skipping a discovery entry");
                None
            }
        })
        .collect();
    Ok((entries, revision))
}

/// The background task: applies watch events to the snapshot and recovers from breaks.
pub(super) struct Watcher {
    client: Client,
    config: EtcdConfig,
    snapshot: Arc<Snapshot>,
}

impl Watcher {
    pub(super) fn new(client: Client, config: EtcdConfig, snapshot: Arc<Snapshot>) -> Self {
        Watcher {
            client,
            config,
            snapshot,
        }
    }

    /// Watches from `listed_at + 1` (the revision `connect` listed at), until `stop`.
    pub(super) async fn run(self, listed_at: i64, stop: CancellationToken) {
        stop.run_until_cancelled(self.watch_forever(listed_at))
            .await;
    }

    async fn watch_forever(&self, mut listed_at: i64) {
        let mut backoff = Backoff::default();
        loop {
            let broke = self.watch_from(listed_at + 1, &mut backoff).await;
            warn!(reason = %broke, "discovery watch broke; serving the last known membership");
            listed_at = loop {
                tokio::time::sleep(backoff.next()).await;
                match list(&self.client, &self.config).await {
                    Ok((entries, revision)) => {
                        info!(revision, "discovery re-listed; watching again");
                        self.snapshot.replace(entries);
                        break revision;
                    }
                    Err(e) => debug!(error = %e, "discovery re-list failed; retrying"),
                }
            };
        }
    }

    /// Applies events until the watch breaks; returns why it broke.
    async fn watch_from(&self, start: i64, backoff: &mut Backoff) -> StoreError {
        let options = WatchOptions::new().with_prefix().with_start_revision(start);
        let mut client = self.client.watch_client();
        let prefix = self.config.nodes_prefix();
        let mut stream = match bounded(
            &self.config,
            self.config.request_timeout,
            client.watch(prefix, Some(options)),
        )
        .await
        {
            Ok(stream) => stream,
            Err(e) => return e,
        };
        loop {
            let resp = match next_watch_batch(&mut stream, &self.config).await {
                Ok(resp) => resp,
                Err(e) => return e,
            };
            backoff.reset();
            for event in resp.events() {
                let Some(kv) = event.kv() else { continue };
                let entry = match event.event_type() {
                    EventType::Delete => None,
                    EventType::Put => match decode(&self.config, kv.key(), kv.value()) {
                        Ok(entry) => Some(entry),
                        Err(e) => {
                            warn!(error = %e, "skipping a discovery entry");
                            None
                        }
                    },
                };
                self.snapshot.set(kv.key(), entry);
            }
        }
    }
}
