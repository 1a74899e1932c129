//! The prefix cache's map from a block's hash to the block that holds it: open addressing
//! with the key and the block side by side in one 16-byte slot, so that a probe of a pool gone
//! cold since its last step costs one cache miss where a map with a separate control array
//! costs two. It is probed for every block of every admission and written for every block
//! computed and evicted. Deletion shifts the following entries back (no tombstones), and the
//! table stays at most half full.

use kvmesh_common::SequenceHash;

/// No block: an empty slot (block ids never reach `u32::MAX`).
const EMPTY: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Slot {
    hash: u64,
    block: u32,
}

const VACANT: Slot = Slot {
    hash: 0,
    block: EMPTY,
};

#[derive(Clone, Debug)]
pub(super) struct HashSlots {
    slots: Box<[Slot]>,
    /// `64 - log2(slots.len())`: a hash's home slot is the top bits of its mixed value.
    shift: u32,
    len: usize,
}

impl HashSlots {
    /// Room for `n` entries without growing.
    pub(super) fn with_room_for(n: usize) -> Self {
        let slots = (2 * n).next_power_of_two().max(8);
        HashSlots {
            slots: vec![VACANT; slots].into_boxed_slice(),
            shift: 64 - slots.trailing_zeros(),
            len: 0,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Where `hash`'s probe starts. Hashes made by tests are small integers: mixed first.
    fn home(&self, hash: u64) -> usize {
        (hash.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    fn next(&self, i: usize) -> usize {
        (i + 1) & (self.slots.len() - 1)
    }

    /// The slot holding `hash`, or the empty slot where it would go.
    fn find(&self, hash: u64) -> usize {
        let mut i = self.home(hash);
        loop {
            let s = self.slots[i];
            if s.block == EMPTY || s.hash == hash {
                return i;
            }
            i = self.next(i);
        }
    }

    /// Starts loading `hash`'s home slot, where its probe (nearly always) ends.
    pub(super) fn prefetch(&self, hash: SequenceHash) {
        kvmesh_common::prefetch::prefetch(&self.slots[self.home(hash.0)]);
    }

    pub(super) fn get(&self, hash: SequenceHash) -> Option<u32> {
        let s = self.slots[self.find(hash.0)];
        (s.block != EMPTY).then_some(s.block)
    }

    /// Maps `hash` to `block` unless `hash` is mapped already; returns whether it was added.
    pub(super) fn insert_new(&mut self, hash: SequenceHash, block: u32) -> bool {
        debug_assert_ne!(block, EMPTY);
        if 2 * (self.len + 1) > self.slots.len() {
            self.grow();
        }
        let i = self.find(hash.0);
        if self.slots[i].block != EMPTY {
            return false;
        }
        self.slots[i] = Slot {
            hash: hash.0,
            block,
        };
        self.len += 1;
        true
    }

    /// Unmaps `hash`; returns the block it mapped to.
    pub(super) fn remove(&mut self, hash: SequenceHash) -> Option<u32> {
        let mut hole = self.find(hash.0);
        let removed = self.slots[hole].block;
        if removed == EMPTY {
            return None;
        }
        // Each later entry of the run moves into the hole unless its home lies cyclically
        // after the hole (then it is already as close to home as it can be).
        let mut j = hole;
        loop {
            j = self.next(j);
            let s = self.slots[j];
            if s.block == EMPTY {
                break;
            }
            let home = self.home(s.hash);
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.slots[hole] = s;
                hole = j;
            }
        }
        self.slots[hole] = VACANT;
        self.len -= 1;
        Some(removed)
    }

    pub(super) fn keys(&self) -> impl Iterator<Item = SequenceHash> + '_ {
        self.slots
            .iter()
            .filter(|s| s.block != EMPTY)
            .map(|s| SequenceHash(s.hash))
    }

    fn grow(&mut self) {
        let mut bigger = HashSlots::with_room_for(self.slots.len());
        for s in self.slots.iter().filter(|s| s.block != EMPTY) {
            bigger.insert_new(SequenceHash(s.hash), s.block);
        }
        *self = bigger;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u64, u32),
        Remove(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few distinct hashes, some sharing a home: long runs, wrapping around the end,
        // removals from their middles.
        let hash = prop_oneof![0u64..40, any::<u64>()];
        prop_oneof![
            (hash.clone(), 0u32..1000).prop_map(|(h, b)| Op::Insert(h, b)),
            hash.prop_map(Op::Remove),
        ]
    }

    proptest! {
        #[test]
        fn behaves_as_a_map(room in 0usize..20, ops in prop::collection::vec(op(), 0..400)) {
            let mut slots = HashSlots::with_room_for(room);
            let mut model: HashMap<u64, u32> = HashMap::new();
            for op in ops {
                match op {
                    Op::Insert(h, b) => {
                        let added = !model.contains_key(&h);
                        if added {
                            model.insert(h, b);
                        }
                        prop_assert_eq!(slots.insert_new(SequenceHash(h), b), added);
                    }
                    Op::Remove(h) => {
                        prop_assert_eq!(slots.remove(SequenceHash(h)), model.remove(&h));
                    }
                }
                prop_assert_eq!(slots.len(), model.len());
                for (&h, &b) in &model {
                    prop_assert_eq!(slots.get(SequenceHash(h)), Some(b));
                }
            }
            let mut keys: Vec<u64> = slots.keys().map(|h| h.0).collect();
            let mut expected: Vec<u64> = model.keys().copied().collect();
            keys.sort_unstable();
            expected.sort_unstable();
            prop_assert_eq!(keys, expected);
        }
    }

    #[test]
    fn a_full_run_wrapping_the_end_survives_removals() {
        let mut slots = HashSlots::with_room_for(4);
        let n = slots.slots.len() as u64;
        // Every hash homed at the last slot: the run wraps to the front.
        let last: Vec<u64> = (0..10_000u64)
            .filter(|&h| slots.home(h) as u64 == n - 1)
            .take(3)
            .collect();
        for (i, &h) in last.iter().enumerate() {
            assert!(slots.insert_new(SequenceHash(h), i as u32));
        }
        assert_eq!(slots.remove(SequenceHash(last[0])), Some(0));
        assert_eq!(slots.get(SequenceHash(last[1])), Some(1));
        assert_eq!(slots.get(SequenceHash(last[2])), Some(2));
        assert_eq!(slots.get(SequenceHash(last[0])), None);
    }
}
