//! The publisher's core, without I/O: what one node holds, what changed since the last
//! write, and what to write next.
//!
//! A log batch carries each changed block's tiers as they are now, not the events that led
//! there, so a batch is as large as the set of blocks touched in one interval however many
//! events touched them, and re-applying one is harmless. The log is compacted into a
//! snapshot once it would hold more entries than the node holds blocks (or more than
//! [`MAX_LOG_KEYS`] keys), so etcd holds O(blocks held), not O(history).

use super::codec::{Entry, PART_ENTRIES};
use super::index::SeqMap;
use super::{TierSet, TieredKvEvent};

/// Log keys between two snapshots: also bounds what a joining reader replays.
pub(crate) const MAX_LOG_KEYS: usize = 64;
/// A small node still gets this many log entries before a snapshot replaces them.
pub(crate) const MIN_COMPACT_ENTRIES: usize = 1024;

/// One write to etcd.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Write {
    /// `log/{seq}`: these blocks' tiers now (empty: no longer held).
    Log { seq: u64, entries: Vec<Entry> },
    /// Everything held as of `seq`. `reset`: first delete every key the node has (a previous
    /// publisher's, whose seqs may run higher than ours).
    Snapshot {
        seq: u64,
        entries: Vec<Entry>,
        reset: bool,
    },
}

#[derive(Debug)]
pub(crate) struct Journal {
    held: SeqMap<TierSet>,
    /// Blocks changed since the last write, with their tiers as last written. Not kept while
    /// a snapshot is due: it will cover them.
    dirty: SeqMap<TierSet>,
    snapshot_due: bool,
    reset_due: bool,
    next_seq: u64,
    /// Log keys and entries written since the last snapshot.
    log_keys: usize,
    log_entries: usize,
}

impl Default for Journal {
    fn default() -> Self {
        Journal {
            held: SeqMap::default(),
            dirty: SeqMap::default(),
            snapshot_due: true,
            reset_due: true,
            next_seq: 1,
            log_keys: 0,
            log_entries: 0,
        }
    }
}

impl Journal {
    pub(crate) fn held(&self) -> usize {
        self.held.len()
    }

    /// What the node holds, sorted by hash.
    #[cfg(test)]
    pub(crate) fn held_entries(&self) -> Vec<Entry> {
        let mut entries: Vec<Entry> = self.held.iter().map(|(&h, &t)| (h, t)).collect();
        entries.sort_unstable_by_key(|&(h, _)| h);
        entries
    }

    pub(crate) fn record(&mut self, events: impl IntoIterator<Item = TieredKvEvent>) {
        for event in events {
            let hash = event.hash();
            let old = self.held.get(&hash).copied().unwrap_or_default();
            let new = old.after(event);
            if new == old {
                continue;
            }
            if new.is_empty() {
                self.held.remove(&hash);
            } else {
                self.held.insert(hash, new);
            }
            if !self.snapshot_due {
                self.dirty.entry(hash).or_insert(old);
            }
        }
        // More changes than one batch value holds: a snapshot is smaller than the log would be.
        if self.dirty.len() > PART_ENTRIES {
            self.force_snapshot();
        }
    }

    /// The next write must be a snapshot (the lease changed, so etcd lost everything).
    pub(crate) fn force_snapshot(&mut self) {
        self.snapshot_due = true;
        self.dirty = SeqMap::default();
    }

    /// What to write now, if anything; it takes a seq number whether or not it lands.
    pub(crate) fn next_write(&mut self) -> Option<Write> {
        if !self.snapshot_due {
            let held = &self.held;
            let entries: Vec<Entry> = self
                .dirty
                .drain()
                .filter_map(|(hash, before)| {
                    let now = held.get(&hash).copied().unwrap_or_default();
                    (now != before).then_some((hash, now))
                })
                .collect();
            if entries.is_empty() {
                return None;
            }
            let bound = self.held.len().max(MIN_COMPACT_ENTRIES);
            if self.log_keys < MAX_LOG_KEYS && self.log_entries + entries.len() <= bound {
                let seq = self.take_seq();
                return Some(Write::Log { seq, entries });
            }
        }
        self.snapshot_due = false;
        self.dirty.clear();
        let entries = self.held.iter().map(|(&h, &t)| (h, t)).collect();
        Some(Write::Snapshot {
            seq: self.take_seq(),
            entries,
            reset: self.reset_due,
        })
    }

    pub(crate) fn written(&mut self, write: &Write) {
        match write {
            Write::Log { entries, .. } => {
                self.log_keys += 1;
                self.log_entries += entries.len();
            }
            Write::Snapshot { .. } => {
                self.log_keys = 0;
                self.log_entries = 0;
                self.reset_due = false;
            }
        }
    }

    /// A failed write may or may not have landed; only a snapshot repairs the log for sure.
    pub(crate) fn failed(&mut self) {
        self.force_snapshot();
    }

    fn take_seq(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        seq
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::Tier;
    use kvmesh_common::SequenceHash;

    fn stored(i: u64) -> TieredKvEvent {
        TieredKvEvent::stored(Tier::Device, SequenceHash(i))
    }

    fn removed(i: u64) -> TieredKvEvent {
        TieredKvEvent::removed(Tier::Device, SequenceHash(i))
    }

    fn write_ok(j: &mut Journal) -> Option<Write> {
        let w = j.next_write()?;
        j.written(&w);
        Some(w)
    }

    #[test]
    fn starts_with_a_resetting_snapshot_then_logs_net_changes() {
        let mut j = Journal::default();
        j.record([stored(1)]);
        let dev = TierSet::only(Tier::Device);
        assert_eq!(
            write_ok(&mut j),
            Some(Write::Snapshot {
                seq: 1,
                entries: vec![(SequenceHash(1), dev)],
                reset: true
            })
        );
        assert_eq!(write_ok(&mut j), None, "nothing changed");
        // Stored then removed within one interval: no entry. Removed: an empty entry.
        j.record([stored(2), removed(2), removed(1), stored(3), stored(3)]);
        let Some(Write::Log { seq, mut entries }) = write_ok(&mut j) else {
            panic!("a log batch")
        };
        entries.sort_by_key(|e| e.0);
        assert_eq!(seq, 2);
        assert_eq!(
            entries,
            [(SequenceHash(1), TierSet::EMPTY), (SequenceHash(3), dev)]
        );
        assert_eq!(j.held(), 1);
    }

    #[test]
    fn the_log_is_compacted_once_it_outgrows_the_held_set() {
        let mut j = Journal::default();
        write_ok(&mut j); // the first snapshot
        let mut snapshots = 0;
        let mut logged = 0;
        // Churn on a few blocks: the log grows, the held set does not.
        for round in 0..2000u64 {
            j.record([stored(round % 8), removed((round + 4) % 8)]);
            match write_ok(&mut j) {
                Some(Write::Snapshot { reset, .. }) => {
                    assert!(!reset);
                    snapshots += 1;
                }
                Some(Write::Log { entries, .. }) => logged += entries.len(),
                None => {}
            }
            assert!(j.log_keys <= MAX_LOG_KEYS);
            assert!(j.log_entries <= MIN_COMPACT_ENTRIES.max(j.held()));
        }
        // A snapshot every MAX_LOG_KEYS + 1 writes.
        assert!(snapshots >= 25, "{snapshots}");
        assert!(logged > 0);
    }

    #[test]
    fn a_failed_write_or_a_burst_turns_into_a_snapshot() {
        let mut j = Journal::default();
        write_ok(&mut j);
        j.record([stored(1)]);
        assert!(matches!(j.next_write(), Some(Write::Log { seq: 2, .. })));
        j.failed();
        let Some(Write::Snapshot { seq, entries, .. }) = write_ok(&mut j) else {
            panic!("a snapshot")
        };
        assert_eq!(
            (seq, entries.len()),
            (3, 1),
            "a new seq, never a reused one"
        );

        j.record((0..PART_ENTRIES as u64 + 10).map(stored));
        assert!(
            j.dirty.is_empty(),
            "a burst past one batch drops the dirty set"
        );
        assert!(matches!(write_ok(&mut j), Some(Write::Snapshot { .. })));
    }
}
