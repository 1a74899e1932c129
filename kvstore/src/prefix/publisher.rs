//! One node's writer: its KV events, batched into etcd under its lease.
//!
//! `publish` only records the events (a mutex, no I/O). A background task wakes once per
//! `kv_flush_interval` and makes at most one write: a log batch of the blocks that changed,
//! or a snapshot when the log has outgrown the held set (see [`super::journal`]). Everything
//! is written under the node's lease, so a dead node's entries vanish with it. When the lease
//! task had to re-register (a new lease id: etcd dropped everything under the old one), the
//! next write is a fresh snapshot under the new lease.

use super::codec::{self, encode_log, encode_part, prefix_end, Entry, KvKey, PART_ENTRIES};
use super::journal::{Journal, Write};
use super::TieredKvEvent;
use crate::etcd::bounded;
use crate::{EtcdConfig, NodeLease, StoreError};
use etcd_client::{Client, DeleteOptions, PutOptions, Txn, TxnOp};
use kvmesh_common::NodeId;
use std::future::Future;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::DropGuard;
use tracing::{debug, warn};

/// Snapshot parts per transaction stay below this, under etcd's 1.5 MiB request limit.
const TXN_BYTES: usize = 1 << 20;

/// Publishes one node's KV events to etcd. Dropping it stops the writes; the entries stay
/// until the lease ends (revoke the lease to drain). One publisher per node at a time: a new
/// one first deletes whatever an earlier one left.
pub struct KvEventPublisher {
    shared: Arc<Shared>,
    _stop: DropGuard,
}

#[derive(Default)]
struct Shared {
    journal: Mutex<Journal>,
    events_published: AtomicU64,
    batches_written: AtomicU64,
    entries_written: AtomicU64,
    snapshots_written: AtomicU64,
    etcd_writes: AtomicU64,
    write_failures: AtomicU64,
}

/// The publisher's counters, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PublisherStats {
    /// Blocks the node holds now, in any tier, as its events say.
    pub held_blocks: usize,
    /// Events passed to `publish`.
    pub events_published: u64,
    /// Log batches written (one key each).
    pub batches_written: u64,
    /// Block entries in those batches (a block changed many times in one interval is one).
    pub entries_written: u64,
    pub snapshots_written: u64,
    /// etcd write requests (puts, deletes and transactions), failed ones included: what
    /// `kv_flush_interval` bounds.
    pub etcd_writes: u64,
    pub write_failures: u64,
}

impl KvEventPublisher {
    /// Starts publishing under `lease` (within a tokio runtime). The first write, right away,
    /// is a snapshot of what is published before it, so a node that starts with a warm cache
    /// publishes its `cached_hashes()` as stored events first. Stops with the lease.
    pub fn start(lease: &NodeLease) -> KvEventPublisher {
        let shared = Arc::new(Shared::default());
        let stop = lease.stopped().child_token();
        let flusher = Flusher {
            client: lease.client().clone(),
            config: lease.config().clone(),
            node: lease.node_id(),
            lease_id: lease.lease_cell(),
            shared: shared.clone(),
            written_lease: None,
            dead_lease: None,
        };
        tokio::spawn({
            let stop = stop.clone();
            async move {
                stop.run_until_cancelled(flusher.run()).await;
            }
        });
        KvEventPublisher {
            shared,
            _stop: stop.drop_guard(),
        }
    }

    /// Records events for the next flush; never blocks on I/O.
    pub fn publish(&self, events: Vec<TieredKvEvent>) {
        let n = events.len() as u64;
        self.shared
            .journal
            .lock()
            .expect("journal lock")
            .record(events);
        self.shared.events_published.fetch_add(n, Ordering::Relaxed);
    }

    pub fn stats(&self) -> PublisherStats {
        let s = &self.shared;
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        PublisherStats {
            held_blocks: s.journal.lock().expect("journal lock").held(),
            events_published: load(&s.events_published),
            batches_written: load(&s.batches_written),
            entries_written: load(&s.entries_written),
            snapshots_written: load(&s.snapshots_written),
            etcd_writes: load(&s.etcd_writes),
            write_failures: load(&s.write_failures),
        }
    }
}

impl std::fmt::Debug for KvEventPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvEventPublisher")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// The background task.
struct Flusher {
    client: Client,
    config: EtcdConfig,
    node: NodeId,
    lease_id: Arc<AtomicI64>,
    shared: Arc<Shared>,
    /// The lease the last successful write went under.
    written_lease: Option<i64>,
    /// A lease etcd no longer knows: no write until the lease task replaces it.
    dead_lease: Option<i64>,
}

impl Flusher {
    async fn run(mut self) {
        let period = self.config.kv_flush_interval.max(Duration::from_millis(1));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.flush().await;
        }
    }

    /// At most one write.
    async fn flush(&mut self) {
        let lease = self.lease_id.load(Ordering::Acquire);
        if self.dead_lease == Some(lease) {
            return;
        }
        let write = {
            let mut journal = self.shared.journal.lock().expect("journal lock");
            if self.written_lease != Some(lease) {
                journal.force_snapshot();
            }
            journal.next_write()
        };
        let Some(write) = write else { return };
        let result = self.send(&write, lease).await;
        let mut journal = self.shared.journal.lock().expect("journal lock");
        match result {
            Ok(()) => {
                journal.written(&write);
                self.written_lease = Some(lease);
                let s = &self.shared;
                match &write {
                    Write::Log { entries, .. } => {
                        s.batches_written.fetch_add(1, Ordering::Relaxed);
                        s.entries_written
                            .fetch_add(entries.len() as u64, Ordering::Relaxed);
                    }
                    Write::Snapshot { .. } => {
                        s.snapshots_written.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Err(e) => {
                journal.failed();
                self.shared.write_failures.fetch_add(1, Ordering::Relaxed);
                if e == StoreError::LeaseExpired {
                    warn!(node = %self.node, lease, "lease gone; publishing again once re-registered");
                    self.dead_lease = Some(lease);
                } else {
                    debug!(node = %self.node, error = %e, "prefix index write failed; a snapshot follows");
                }
            }
        }
    }

    async fn send(&self, write: &Write, lease: i64) -> Result<(), StoreError> {
        let mut kv = self.client.kv_client();
        for ops in requests(&self.config.kv_prefix(), self.node, write) {
            let ops: Vec<TxnOp> = ops
                .into_iter()
                .map(|op| match op {
                    StoreOp::Put { key, value } => {
                        TxnOp::put(key, value, Some(PutOptions::new().with_lease(lease)))
                    }
                    StoreOp::Delete { from, to } => {
                        TxnOp::delete(from, Some(DeleteOptions::new().with_range(to)))
                    }
                })
                .collect();
            self.request(kv.txn(Txn::new().and_then(ops))).await?;
        }
        Ok(())
    }

    async fn request<T>(
        &self,
        call: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, StoreError> {
        self.shared.etcd_writes.fetch_add(1, Ordering::Relaxed);
        bounded(&self.config, self.config.request_timeout, call).await
    }
}

/// One etcd operation of a write (puts go under the node's lease).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum StoreOp {
    Put {
        key: String,
        value: Vec<u8>,
    },
    /// Deletes the keys in `[from, to)`.
    Delete {
        from: String,
        to: Vec<u8>,
    },
}

/// The transactions, applied in order, that carry out `write`. A snapshot's parts go a few
/// per transaction; the last one completes it and deletes the snapshots and log batches it
/// replaces, so a reader never sees the log gone before the snapshot is whole. A reset is a
/// transaction of its own: etcd refuses one that deletes a key it also puts.
pub(crate) fn requests(prefix: &str, node: NodeId, write: &Write) -> Vec<Vec<StoreOp>> {
    let (seq, entries, reset) = match write {
        Write::Log { seq, entries } => {
            let key = KvKey::Log { node, seq: *seq }.to_key(prefix);
            let value = encode_log(*seq, entries);
            return vec![vec![StoreOp::Put { key, value }]];
        }
        Write::Snapshot {
            seq,
            entries,
            reset,
        } => (*seq, entries, *reset),
    };
    let mut txns = Vec::new();
    if reset {
        let dir = codec::node_dir(prefix, node);
        let to = prefix_end(&dir);
        txns.push(vec![StoreOp::Delete { from: dir, to }]);
    }
    let chunks: Vec<&[Entry]> = if entries.is_empty() {
        vec![&[]]
    } else {
        entries.chunks(PART_ENTRIES).collect()
    };
    let parts = chunks.len() as u32;
    let mut ops = Vec::new();
    let mut bytes = 0;
    for (part, chunk) in (0..parts).zip(chunks) {
        let value = encode_part(seq, part, parts, chunk);
        if bytes + value.len() > TXN_BYTES && !ops.is_empty() {
            txns.push(std::mem::take(&mut ops));
            bytes = 0;
        }
        bytes += value.len();
        let key = KvKey::Snapshot { node, seq, part }.to_key(prefix);
        ops.push(StoreOp::Put { key, value });
    }
    // Earlier snapshots: the keys below this one's first part. Logs: up to `seq`.
    ops.push(StoreOp::Delete {
        from: codec::snapshot_dir(prefix, node),
        to: KvKey::Snapshot { node, seq, part: 0 }
            .to_key(prefix)
            .into_bytes(),
    });
    ops.push(StoreOp::Delete {
        from: codec::log_dir(prefix, node),
        to: KvKey::Log { node, seq: seq + 1 }
            .to_key(prefix)
            .into_bytes(),
    });
    txns.push(ops);
    txns
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::{Tier, TierSet};
    use kvmesh_common::SequenceHash;

    #[test]
    fn snapshots_split_into_parts_and_transactions_under_the_request_limit() {
        let t = TierSet::only(Tier::Device);
        let entries: Vec<Entry> = (0..200_000).map(|i| (SequenceHash(i), t)).collect();
        let write = Write::Snapshot {
            seq: 9,
            entries,
            reset: true,
        };
        let txns = requests("/c/kv/", NodeId(1), &write);
        let ops: usize = txns.iter().map(Vec::len).sum();
        let parts = 200_000usize.div_ceil(PART_ENTRIES);
        assert_eq!(
            ops,
            1 + parts + 2,
            "a reset, every part, then two range deletes"
        );
        assert_eq!(txns[0].len(), 1, "the reset goes alone");
        assert!(txns.len() >= 3);
        assert!(
            txns.iter().all(|ops| ops.len() <= 128),
            "etcd's max-txn-ops"
        );
        // An empty node still writes one (empty) part: its snapshot says "nothing".
        let empty = Write::Snapshot {
            seq: 1,
            entries: vec![],
            reset: false,
        };
        assert_eq!(requests("/c/kv/", NodeId(1), &empty)[0].len(), 3);
    }
}
