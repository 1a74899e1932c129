//! Which blocks a tier below the main pool (host memory, disk) holds: hashes in
//! least-recently-used order, bounded by a capacity in blocks. The bytes live with the
//! engine, which copies them at the [`TierMove`](super::TierMove)s the pool records.

use kvmesh_common::fast_hash::U64Map;
use kvmesh_common::SequenceHash;
use std::collections::BTreeMap;

#[derive(Debug, Default)]
pub(super) struct TierIndex {
    capacity: usize,
    /// Use stamp → hash, oldest first.
    order: BTreeMap<u64, SequenceHash>,
    stamp_of: U64Map<SequenceHash, u64>,
    next_stamp: u64,
}

impl TierIndex {
    pub fn new(capacity: usize) -> Self {
        TierIndex {
            capacity,
            ..Default::default()
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.stamp_of.len()
    }

    pub fn contains(&self, hash: SequenceHash) -> bool {
        self.stamp_of.contains_key(&hash)
    }

    /// Adds `hash` as the most recently used; returns the hashes pushed out to stay within
    /// capacity (oldest first).
    pub fn insert(&mut self, hash: SequenceHash) -> Vec<SequenceHash> {
        self.remove(hash);
        self.order.insert(self.next_stamp, hash);
        self.stamp_of.insert(hash, self.next_stamp);
        self.next_stamp += 1;
        let mut dropped = Vec::new();
        while self.stamp_of.len() > self.capacity {
            let (_, oldest) = self.order.pop_first().expect("len > capacity >= 0");
            self.stamp_of.remove(&oldest);
            dropped.push(oldest);
        }
        dropped
    }

    pub fn remove(&mut self, hash: SequenceHash) -> bool {
        match self.stamp_of.remove(&hash) {
            Some(stamp) => {
                self.order.remove(&stamp);
                true
            }
            None => false,
        }
    }

    pub fn hashes(&self) -> impl Iterator<Item = SequenceHash> + '_ {
        self.stamp_of.keys().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_most_recent_within_capacity() {
        let h = SequenceHash;
        let mut t = TierIndex::new(2);
        assert!(t.insert(h(1)).is_empty());
        assert!(t.insert(h(2)).is_empty());
        // Re-inserting 1 makes 2 the oldest.
        assert!(t.insert(h(1)).is_empty());
        assert_eq!(t.insert(h(3)), vec![h(2)]);
        assert!(t.contains(h(1)) && t.contains(h(3)) && !t.contains(h(2)));
        assert!(t.remove(h(1)) && !t.remove(h(1)));
        assert_eq!(t.len(), 1);
        let mut off = TierIndex::new(0);
        assert_eq!(off.insert(h(5)), vec![h(5)]);
    }
}
