//! The reader's core, without I/O: every node's published log, replayed into the index.
//!
//! Per node it follows "newest complete snapshot, then each log batch in seq order". A batch
//! that does not follow the last applied one (a gap) asks the driver to re-list that node;
//! if the listing cannot be followed either (a batch lost for good, e.g. corrupt), the node
//! keeps its last state and waits for its next snapshot rather than re-listing again. The
//! node's entries go when its current snapshot's keys are deleted: the lease expired or was
//! revoked, or a new publisher reset them.

use super::codec::{Entry, KvKey, Record};
use super::index::SeqMap;
use super::watcher::WatchCounters;
use super::{InMemoryPrefixIndex, TierSet};
use kvmesh_common::NodeId;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// What the driver must do after an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    Applied,
    /// Nothing changed (a duplicate, an incomplete snapshot, a compacted key...).
    Ignored,
    /// The node's log cannot be followed from here: re-list its keys.
    Relist(NodeId),
}

pub(crate) struct Replica {
    index: Arc<InMemoryPrefixIndex>,
    counters: Arc<WatchCounters>,
    feeds: HashMap<NodeId, Feed>,
}

#[derive(Debug, Default)]
struct Feed {
    /// The snapshot the node's entries rest on; `None` until one was complete.
    base: Option<u64>,
    /// The last applied seq: the base's, or a later batch's.
    applied: u64,
    /// A snapshot whose parts are still arriving.
    pending: Option<Pending>,
    /// A listing could not be followed: wait for the next snapshot, do not re-list.
    stuck: bool,
    /// Events up to this revision are already part of a listing.
    listed_at: i64,
}

#[derive(Debug)]
struct Pending {
    seq: u64,
    parts: u32,
    received: BTreeMap<u32, Vec<Entry>>,
}

impl Pending {
    fn new(seq: u64, parts: u32) -> Self {
        Pending {
            seq,
            parts,
            received: BTreeMap::new(),
        }
    }

    /// Adds a part; false if it disagrees with the others on the part count.
    fn add(&mut self, part: u32, parts: u32, entries: Vec<Entry>) -> bool {
        if parts != self.parts {
            return false;
        }
        self.received.insert(part, entries);
        true
    }

    fn is_complete(&self) -> bool {
        self.received.len() == self.parts as usize
    }

    fn into_entries(self) -> impl Iterator<Item = Entry> {
        self.received.into_values().flatten()
    }
}

impl Replica {
    pub(crate) fn new(index: Arc<InMemoryPrefixIndex>, counters: Arc<WatchCounters>) -> Self {
        Replica {
            index,
            counters,
            feeds: HashMap::new(),
        }
    }

    /// A watched put, decoded; `revision` is the put's.
    pub(crate) fn on_put(&mut self, key: KvKey, record: Record, revision: i64) -> Outcome {
        let node = key.node();
        if self
            .feeds
            .get(&node)
            .is_some_and(|f| revision <= f.listed_at)
        {
            return Outcome::Ignored;
        }
        match (key, record) {
            (KvKey::Log { seq, .. }, Record::Log(entries)) => self.on_log(node, seq, &entries),
            (KvKey::Snapshot { seq, part, .. }, Record::Part { parts, entries }) => {
                let feed = self.feeds.entry(node).or_default();
                let pending = match &mut feed.pending {
                    Some(p) if p.seq > seq => return Outcome::Ignored,
                    Some(p) if p.seq == seq => p,
                    slot => slot.insert(Pending::new(seq, parts)),
                };
                if !pending.add(part, parts, entries) || !pending.is_complete() {
                    return Outcome::Ignored;
                }
                let pending = feed.pending.take().expect("just completed");
                self.index.replace_node(node, pending.into_entries());
                feed.base = Some(seq);
                feed.applied = seq;
                feed.stuck = false;
                self.counters
                    .snapshots_applied
                    .fetch_add(1, Ordering::Relaxed);
                Outcome::Applied
            }
            _ => Outcome::Ignored, // decode returns the record its key names
        }
    }

    fn on_log(&mut self, node: NodeId, seq: u64, entries: &[Entry]) -> Outcome {
        let Some(feed) = self.feeds.get_mut(&node) else {
            return Outcome::Relist(node); // its snapshot was missed
        };
        if feed.base.is_some() && seq <= feed.applied {
            return Outcome::Ignored;
        }
        if feed.base.is_none() || seq != feed.applied + 1 {
            return if feed.stuck {
                Outcome::Ignored
            } else {
                Outcome::Relist(node)
            };
        }
        self.index.set_tiers(node, entries);
        feed.applied = seq;
        self.counters
            .batches_applied
            .fetch_add(1, Ordering::Relaxed);
        Outcome::Applied
    }

    /// A watched delete; `revision` is the delete's.
    pub(crate) fn on_delete(&mut self, key: KvKey, revision: i64) {
        let node = key.node();
        let Some(feed) = self.feeds.get_mut(&node) else {
            return;
        };
        if revision <= feed.listed_at {
            return;
        }
        // A deleted log batch was compacted into a snapshot: nothing to do.
        if let KvKey::Snapshot { seq, .. } = key {
            if feed.base == Some(seq) {
                self.index.remove_node(node);
                self.feeds.remove(&node);
            } else if feed.pending.as_ref().is_some_and(|p| p.seq == seq) {
                feed.pending = None;
            }
        }
    }

    /// Replaces what is known of `node` with a listing of its keys at `revision`.
    pub(crate) fn load_node(&mut self, node: NodeId, listing: Vec<(KvKey, Record)>, revision: i64) {
        if listing.is_empty() {
            self.index.remove_node(node);
            self.feeds.remove(&node);
            return;
        }
        let mut snapshots: BTreeMap<u64, Pending> = BTreeMap::new();
        let mut logs: BTreeMap<u64, Vec<Entry>> = BTreeMap::new();
        for (key, record) in listing {
            match (key, record) {
                (KvKey::Log { seq, .. }, Record::Log(entries)) => {
                    logs.insert(seq, entries);
                }
                (KvKey::Snapshot { seq, part, .. }, Record::Part { parts, entries }) => {
                    let pending = snapshots
                        .entry(seq)
                        .or_insert_with(|| Pending::new(seq, parts));
                    pending.add(part, parts, entries);
                }
                _ => {}
            }
        }
        let mut feed = Feed {
            listed_at: revision,
            ..Feed::default()
        };
        let newest_complete = snapshots
            .iter()
            .rev()
            .find(|(_, p)| p.is_complete())
            .map(|(&seq, _)| seq);
        match newest_complete {
            None => {
                // Nothing to stand on until a snapshot completes.
                self.index.remove_node(node);
                feed.stuck = true;
            }
            Some(base) => {
                let snapshot = snapshots.remove(&base).expect("listed");
                let mut blocks: SeqMap<TierSet> = snapshot.into_entries().collect();
                let mut applied = base;
                for (&seq, entries) in logs.range(base + 1..) {
                    if seq != applied + 1 {
                        feed.stuck = true;
                        break;
                    }
                    for &(hash, tiers) in entries {
                        blocks.insert(hash, tiers);
                    }
                    applied = seq;
                }
                self.index.replace_node(node, blocks);
                feed.base = Some(base);
                feed.applied = applied;
            }
        }
        feed.pending = snapshots
            .into_values()
            .rev()
            .find(|p| Some(p.seq) > feed.base);
        self.feeds.insert(node, feed);
    }

    /// Replaces everything with a listing of the whole prefix at `revision`.
    pub(crate) fn load_all(
        &mut self,
        listing: HashMap<NodeId, Vec<(KvKey, Record)>>,
        revision: i64,
    ) {
        let known: HashSet<NodeId> = self
            .feeds
            .keys()
            .copied()
            .chain(self.index.nodes())
            .collect();
        for node in known {
            if !listing.contains_key(&node) {
                self.index.remove_node(node);
                self.feeds.remove(&node);
            }
        }
        for (node, records) in listing {
            self.load_node(node, records, revision);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::{PrefixIndex, Tier};
    use kvmesh_common::SequenceHash;

    const N: NodeId = NodeId(1);

    fn dev(i: u64) -> Entry {
        (SequenceHash(i), TierSet::only(Tier::Device))
    }

    fn gone(i: u64) -> Entry {
        (SequenceHash(i), TierSet::EMPTY)
    }

    fn log(seq: u64) -> KvKey {
        KvKey::Log { node: N, seq }
    }

    fn part(seq: u64, part: u32) -> KvKey {
        KvKey::Snapshot { node: N, seq, part }
    }

    fn replica() -> (Replica, Arc<InMemoryPrefixIndex>) {
        let index = Arc::new(InMemoryPrefixIndex::new());
        let r = Replica::new(index.clone(), Arc::default());
        (r, index)
    }

    fn held(index: &InMemoryPrefixIndex, upto: u64) -> usize {
        let hashes: Vec<SequenceHash> = (1..=upto).map(SequenceHash).collect();
        index.overlap(&hashes).get(&N).copied().unwrap_or(0)
    }

    #[test]
    fn follows_a_snapshot_in_parts_then_its_log() {
        let (mut r, index) = replica();
        let p0 = Record::Part {
            parts: 2,
            entries: vec![dev(1)],
        };
        let p1 = Record::Part {
            parts: 2,
            entries: vec![dev(2)],
        };
        assert_eq!(
            r.on_put(part(1, 1), p1, 10),
            Outcome::Ignored,
            "half a snapshot"
        );
        assert_eq!(r.on_put(part(1, 0), p0, 11), Outcome::Applied);
        assert_eq!(held(&index, 3), 2);
        assert_eq!(
            r.on_put(log(2), Record::Log(vec![dev(3)]), 12),
            Outcome::Applied
        );
        assert_eq!(held(&index, 3), 3);
        assert_eq!(
            r.on_put(log(2), Record::Log(vec![gone(1)]), 13),
            Outcome::Ignored
        );
        assert_eq!(
            r.on_put(log(3), Record::Log(vec![gone(3)]), 14),
            Outcome::Applied
        );
        assert_eq!(held(&index, 3), 2);
        // Compaction: a new snapshot, then its older keys deleted; the node stays.
        let s = Record::Part {
            parts: 1,
            entries: vec![dev(1), dev(2)],
        };
        assert_eq!(r.on_put(part(4, 0), s, 15), Outcome::Applied);
        r.on_delete(part(1, 0), 15);
        r.on_delete(part(1, 1), 15);
        r.on_delete(log(2), 15);
        assert_eq!(held(&index, 3), 2);
        // The lease ends: the current snapshot's keys go, and the node with them.
        r.on_delete(part(4, 0), 16);
        assert!(index.is_empty());
    }

    #[test]
    fn a_gap_asks_for_a_relist_once_and_a_broken_listing_waits_for_a_snapshot() {
        let (mut r, index) = replica();
        assert_eq!(
            r.on_put(log(5), Record::Log(vec![dev(1)]), 1),
            Outcome::Relist(N),
            "a batch of a node never seen"
        );
        let snap = |seq, e: Vec<Entry>| {
            (
                part(seq, 0),
                Record::Part {
                    parts: 1,
                    entries: e,
                },
            )
        };
        // The listing: snapshot 1, batch 2, batch 4 (3 is lost): applied up to 2, then stuck.
        r.load_node(
            N,
            vec![
                snap(1, vec![dev(1)]),
                (log(2), Record::Log(vec![dev(2)])),
                (log(4), Record::Log(vec![dev(4)])),
            ],
            20,
        );
        assert_eq!(held(&index, 4), 2);
        assert_eq!(
            r.on_put(log(4), Record::Log(vec![dev(4)]), 20),
            Outcome::Ignored
        );
        assert_eq!(
            r.on_put(log(5), Record::Log(vec![dev(3)]), 21),
            Outcome::Ignored
        );
        let (k, v) = snap(6, vec![dev(1), dev(2), dev(3)]);
        assert_eq!(r.on_put(k, v, 22), Outcome::Applied);
        assert_eq!(held(&index, 4), 3);
        assert_eq!(
            r.on_put(log(8), Record::Log(vec![dev(4)]), 23),
            Outcome::Relist(N)
        );
    }

    #[test]
    fn load_all_drops_nodes_that_are_gone_and_keeps_pending_snapshots() {
        let (mut r, index) = replica();
        index.apply(
            NodeId(9),
            &[kvmesh_common::KvEvent::Stored(SequenceHash(1))],
        );
        let listing = HashMap::from([(
            N,
            vec![
                (
                    part(1, 0),
                    Record::Part {
                        parts: 1,
                        entries: vec![dev(1)],
                    },
                ),
                (
                    part(3, 0),
                    Record::Part {
                        parts: 2,
                        entries: vec![dev(1)],
                    },
                ),
            ],
        )]);
        r.load_all(listing, 30);
        assert_eq!(index.nodes(), [N]);
        let rest = Record::Part {
            parts: 2,
            entries: vec![dev(2)],
        };
        assert_eq!(r.on_put(part(3, 1), rest, 31), Outcome::Applied);
        assert_eq!(held(&index, 2), 2);
        r.load_node(N, vec![], 32);
        assert!(index.is_empty());
    }
}
