//! The readers' side: every node's published KV state, watched into an in-memory index.
//!
//! List-then-watch, as in discovery: list `/{cluster}/kv/` at revision R (in pages), then
//! watch from R+1, so no event falls between the two. A broken watch (etcd gone, compaction)
//! keeps the index as it is and starts over with a fresh list, which replaces it wholesale;
//! a gap in one node's log re-lists that node only (see [`super::replica`]).

use super::codec::{self, node_dir, parse_key, prefix_end, KvKey, Record};
use super::replica::{Outcome, Replica};
use super::{InMemoryPrefixIndex, PrefixIndex, TieredOverlap};
use crate::etcd::{bounded, connect_client, next_watch_batch, Backoff};
use crate::{EtcdConfig, StoreError};
use etcd_client::{Client, EventType, GetOptions, KeyValue, WatchOptions};
use kvmesh_common::fast_hash::U64Map;
use kvmesh_common::{NodeId, SequenceHash};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::{debug, info, warn};

/// Keys per page of a listing: with values of at most `MAX_VALUE_BYTES` (about 72 KiB) a
/// page stays near 4.5 MiB.
const PAGE_KEYS: i64 = 64;
/// A watch response gathers up to 1,000 revisions for a reader that lags; above tonic's
/// 4 MiB default that must still decode. (If one does not, the watch breaks and the reader
/// re-lists, which is correct, only slower.)
const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// A [`PrefixIndex`] kept current from etcd. Cheap to clone; the watch stops when the last
/// clone is dropped. Reads never touch etcd, and keep serving the last known state while
/// etcd is away.
#[derive(Clone)]
pub struct EtcdPrefixIndex {
    inner: Arc<Inner>,
}

struct Inner {
    index: Arc<InMemoryPrefixIndex>,
    counters: Arc<WatchCounters>,
    _stop: DropGuard,
}

#[derive(Debug, Default)]
pub(crate) struct WatchCounters {
    pub(crate) resyncs: AtomicU64,
    pub(crate) node_resyncs: AtomicU64,
    pub(crate) batches_applied: AtomicU64,
    pub(crate) snapshots_applied: AtomicU64,
    pub(crate) corrupt_values: AtomicU64,
}

/// The watcher's counters, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WatcherStats {
    /// (block, node) entries in the index.
    pub entries: usize,
    /// Nodes with at least one block.
    pub nodes: usize,
    /// Full re-lists after the watch broke (the first list not counted).
    pub resyncs: u64,
    /// One node re-listed after a gap in its log.
    pub node_resyncs: u64,
    pub batches_applied: u64,
    pub snapshots_applied: u64,
    /// Keys or values under the prefix that did not decode, skipped.
    pub corrupt_values: u64,
}

impl EtcdPrefixIndex {
    /// Connects, loads every node's published state and starts the watch that keeps it
    /// current. Retries until `connect_timeout`, then fails with `Unreachable`.
    pub async fn connect(config: EtcdConfig) -> Result<Self, StoreError> {
        let client = connect_client(&config).await?;
        Self::start(client, config).await
    }

    pub(crate) async fn start(client: Client, config: EtcdConfig) -> Result<Self, StoreError> {
        let index = Arc::new(InMemoryPrefixIndex::new());
        let counters = Arc::new(WatchCounters::default());
        let mut follower = Follower {
            replica: Replica::new(index.clone(), counters.clone()),
            prefix: config.kv_prefix(),
            client,
            config,
            counters: counters.clone(),
        };
        let deadline = tokio::time::Instant::now() + follower.config.connect_timeout;
        let mut backoff = Backoff::default();
        let revision = loop {
            match follower.resync(false).await {
                Ok(revision) => break revision,
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
        tokio::spawn({
            let stop = stop.clone();
            async move {
                stop.run_until_cancelled(follower.watch_forever(revision))
                    .await;
            }
        });
        Ok(EtcdPrefixIndex {
            inner: Arc::new(Inner {
                index,
                counters,
                _stop: stop.drop_guard(),
            }),
        })
    }

    pub fn stats(&self) -> WatcherStats {
        let c = &self.inner.counters;
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        WatcherStats {
            entries: self.inner.index.len(),
            nodes: self.inner.index.nodes().len(),
            resyncs: load(&c.resyncs),
            node_resyncs: load(&c.node_resyncs),
            batches_applied: load(&c.batches_applied),
            snapshots_applied: load(&c.snapshots_applied),
            corrupt_values: load(&c.corrupt_values),
        }
    }

    /// How many blocks `node` holds, as last seen.
    pub fn node_blocks(&self, node: NodeId) -> usize {
        self.inner.index.node_blocks(node)
    }
}

impl PrefixIndex for EtcdPrefixIndex {
    fn overlap_tiered(&self, hashes: &[SequenceHash]) -> U64Map<NodeId, TieredOverlap> {
        self.inner.index.overlap_tiered(hashes)
    }

    fn len(&self) -> usize {
        self.inner.index.len()
    }

    fn subscribe(&self) -> watch::Receiver<u64> {
        self.inner.index.subscribe()
    }
}

impl std::fmt::Debug for EtcdPrefixIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdPrefixIndex")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// The background task.
struct Follower {
    client: Client,
    config: EtcdConfig,
    prefix: String,
    replica: Replica,
    counters: Arc<WatchCounters>,
}

impl Follower {
    async fn watch_forever(mut self, mut listed_at: i64) {
        let mut backoff = Backoff::default();
        loop {
            let broke = self.watch_from(listed_at + 1, &mut backoff).await;
            warn!(reason = %broke, "prefix index watch broke; serving the last known index");
            listed_at = loop {
                tokio::time::sleep(backoff.next()).await;
                match self.resync(true).await {
                    Ok(revision) => {
                        info!(revision, "prefix index re-listed; watching again");
                        break revision;
                    }
                    Err(e) => debug!(error = %e, "prefix index re-list failed; retrying"),
                }
            };
        }
    }

    /// Lists the whole prefix into the index (counted as a resync `after_break`); returns
    /// the revision it was read at.
    async fn resync(&mut self, after_break: bool) -> Result<i64, StoreError> {
        let (kvs, revision) = list(&self.client, &self.config, &self.prefix).await?;
        let mut listing: HashMap<NodeId, Vec<(KvKey, Record)>> = HashMap::new();
        for kv in &kvs {
            if let Some((key, record)) = self.decode(kv) {
                listing.entry(key.node()).or_default().push((key, record));
            }
        }
        // Counted before the new state shows, so that whoever sees it sees the count too.
        if after_break {
            self.counters.resyncs.fetch_add(1, Ordering::Relaxed);
        }
        self.replica.load_all(listing, revision);
        Ok(revision)
    }

    async fn resync_node(&mut self, node: NodeId) -> Result<(), StoreError> {
        let dir = node_dir(&self.prefix, node);
        let (kvs, revision) = list(&self.client, &self.config, &dir).await?;
        let listing = kvs.iter().filter_map(|kv| self.decode(kv)).collect();
        self.counters.node_resyncs.fetch_add(1, Ordering::Relaxed);
        self.replica.load_node(node, listing, revision);
        debug!(%node, revision, "prefix index re-listed a node after a gap");
        Ok(())
    }

    /// Applies events until the watch breaks; returns why it broke.
    async fn watch_from(&mut self, start: i64, backoff: &mut Backoff) -> StoreError {
        let options = WatchOptions::new().with_prefix().with_start_revision(start);
        let mut client = self
            .client
            .watch_client()
            .max_decoding_message_size(MAX_MESSAGE_BYTES);
        let watch = client.watch(self.prefix.clone(), Some(options));
        let mut stream = match bounded(&self.config, self.config.request_timeout, watch).await {
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
                let revision = kv.mod_revision();
                let outcome = match event.event_type() {
                    EventType::Put => match self.decode(kv) {
                        Some((key, record)) => self.replica.on_put(key, record, revision),
                        None => Outcome::Ignored,
                    },
                    EventType::Delete => {
                        // A deleted key that never parsed was skipped when it was put.
                        if let Ok(key) = parse_key(&self.prefix, kv.key()) {
                            self.replica.on_delete(key, revision);
                        }
                        Outcome::Ignored
                    }
                };
                if let Outcome::Relist(node) = outcome {
                    if let Err(e) = self.resync_node(node).await {
                        return e;
                    }
                }
            }
        }
    }

    /// A key and value under the prefix, or `None` (warned and counted) if either is corrupt.
    fn decode(&self, kv: &KeyValue) -> Option<(KvKey, Record)> {
        let decoded = parse_key(&self.prefix, kv.key())
            .and_then(|key| codec::decode(&key, kv.value()).map(|record| (key, record)));
        match decoded {
            Ok(decoded) => Some(decoded),
            Err(reason) => {
                self.counters.corrupt_values.fetch_add(1, Ordering::Relaxed);
                let e = StoreError::Corrupt {
                    key: String::from_utf8_lossy(kv.key()).into_owned(),
                    reason,
                };
                warn!(error = %e, "skipping a prefix index entry");
                None
            }
        }
    }
}

/// Every key under `prefix` at one revision, read in pages; returns them with the revision.
async fn list(
    client: &Client,
    config: &EtcdConfig,
    prefix: &str,
) -> Result<(Vec<KeyValue>, i64), StoreError> {
    let mut kv = client
        .kv_client()
        .max_decoding_message_size(MAX_MESSAGE_BYTES);
    let end = prefix_end(prefix);
    let mut from = prefix.as_bytes().to_vec();
    let mut revision = 0;
    let mut all = Vec::new();
    loop {
        let options = GetOptions::new()
            .with_range(end.clone())
            .with_limit(PAGE_KEYS)
            .with_revision(revision);
        let get = kv.get(from.clone(), Some(options));
        let mut resp = bounded(config, config.request_timeout, get).await?;
        if revision == 0 {
            // Later pages read at the first page's revision: one consistent listing.
            revision = resp.header().map_or(0, |h| h.revision());
        }
        let more = resp.more();
        let page = resp.take_kvs();
        match page.last() {
            Some(last) if more => {
                from = last.key().to_vec();
                from.push(0); // the next key after it
            }
            _ => {
                all.extend(page);
                return Ok((all, revision));
            }
        }
        all.extend(page);
    }
}
