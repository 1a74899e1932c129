//! A map from a sequence hash to a small value, for tables far larger than the caches that
//! are probed at random: the engine's prefix cache (hash -> block) and the prefix index
//! (hash -> holders). Open addressing with the key and the value side by side in one slot, so
//! a probe of a table gone cold costs one cache miss where a map with a separate control
//! array costs two, and a caller can start loading a slot ([`HashSlots::prefetch`]) well
//! before it probes it. Deletion shifts the following entries back (no tombstones), and the
//! table stays at most half full.

use crate::SequenceHash;

/// A value a slot can hold, one of whose values marks an empty slot. A stored value is never
/// [`SlotValue::VACANT`].
pub trait SlotValue {
    const VACANT: Self;
    fn is_vacant(&self) -> bool;
}

/// Block ids, which never reach `u32::MAX`.
impl SlotValue for u32 {
    const VACANT: u32 = u32::MAX;

    fn is_vacant(&self) -> bool {
        *self == u32::MAX
    }
}

#[derive(Clone, Debug)]
struct Slot<V> {
    hash: u64,
    value: V,
}

impl<V: SlotValue> Slot<V> {
    const VACANT: Slot<V> = Slot {
        hash: 0,
        value: V::VACANT,
    };
}

#[derive(Clone, Debug)]
pub struct HashSlots<V> {
    slots: Box<[Slot<V>]>,
    /// `64 - log2(slots.len())`: a hash's home slot is the top bits of its mixed value.
    shift: u32,
    len: usize,
}

impl<V: SlotValue> Default for HashSlots<V> {
    fn default() -> Self {
        HashSlots::with_room_for(0)
    }
}

impl<V: SlotValue> HashSlots<V> {
    /// Room for `n` entries without growing.
    pub fn with_room_for(n: usize) -> Self {
        let slots = (2 * n).next_power_of_two().max(8);
        HashSlots {
            slots: (0..slots).map(|_| Slot::VACANT).collect(),
            shift: 64 - slots.trailing_zeros(),
            len: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Grows, if need be, to hold `n` entries without growing again.
    pub fn reserve(&mut self, n: usize) {
        if 2 * n > self.slots.len() {
            self.grow_to(n);
        }
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
            let s = &self.slots[i];
            if s.value.is_vacant() || s.hash == hash {
                return i;
            }
            i = self.next(i);
        }
    }

    /// Starts loading `hash`'s home slot, where its probe (nearly always) ends.
    pub fn prefetch(&self, hash: SequenceHash) {
        crate::prefetch::prefetch(&self.slots[self.home(hash.0)]);
    }

    pub fn get(&self, hash: SequenceHash) -> Option<&V> {
        let s = &self.slots[self.find(hash.0)];
        (!s.value.is_vacant()).then_some(&s.value)
    }

    /// `hash`'s entry, to read, change, fill or remove in place (one probe for all of it).
    pub fn entry(&mut self, hash: SequenceHash) -> Entry<'_, V> {
        // Grown first, so that filling a vacant entry needs no second probe.
        if 2 * (self.len + 1) > self.slots.len() {
            self.grow_to(self.slots.len());
        }
        let at = self.find(hash.0);
        match self.slots[at].value.is_vacant() {
            true => Entry::Vacant(VacantEntry {
                table: self,
                at,
                hash: hash.0,
            }),
            false => Entry::Occupied(OccupiedEntry { table: self, at }),
        }
    }

    /// Maps `hash` to `value` unless `hash` is mapped already; returns whether it was added.
    pub fn insert_new(&mut self, hash: SequenceHash, value: V) -> bool {
        match self.entry(hash) {
            Entry::Vacant(e) => {
                e.insert(value);
                true
            }
            Entry::Occupied(_) => false,
        }
    }

    /// Unmaps `hash`; returns its value.
    pub fn remove(&mut self, hash: SequenceHash) -> Option<V> {
        let at = self.find(hash.0);
        (!self.slots[at].value.is_vacant()).then(|| self.remove_at(at))
    }

    /// Empties occupied slot `hole`: each later entry of its run moves into the hole unless
    /// its home lies cyclically after the hole (then it is already as close to home as it can
    /// be). Reads no value but the run's, so the removed one may look vacant already.
    fn remove_at(&mut self, mut hole: usize) -> V {
        let removed = std::mem::replace(&mut self.slots[hole].value, V::VACANT);
        let mut j = hole;
        loop {
            j = self.next(j);
            if self.slots[j].value.is_vacant() {
                break;
            }
            let home = self.home(self.slots[j].hash);
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.slots.swap(hole, j);
                hole = j;
            }
        }
        self.slots[hole].hash = 0;
        self.len -= 1;
        removed
    }

    /// Every entry, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (SequenceHash, &V)> + '_ {
        self.slots
            .iter()
            .filter(|s| !s.value.is_vacant())
            .map(|s| (SequenceHash(s.hash), &s.value))
    }

    pub fn keys(&self) -> impl Iterator<Item = SequenceHash> + '_ {
        self.iter().map(|(hash, _)| hash)
    }

    /// Keeps the entries for which `keep` (which may change them) returns true. Rebuilds
    /// the table: it costs the whole table, as a scan would anyway.
    pub fn retain(&mut self, mut keep: impl FnMut(SequenceHash, &mut V) -> bool) {
        let old = std::mem::replace(self, HashSlots::with_room_for(self.slots.len() / 2));
        for mut s in old.slots.into_vec() {
            if !s.value.is_vacant() && keep(SequenceHash(s.hash), &mut s.value) {
                self.insert_new(SequenceHash(s.hash), s.value);
            }
        }
    }

    /// Rehashes into a table with room for `n` entries.
    fn grow_to(&mut self, n: usize) {
        let old = std::mem::replace(self, HashSlots::with_room_for(n));
        for s in old.slots.into_vec() {
            if !s.value.is_vacant() {
                self.insert_new(SequenceHash(s.hash), s.value);
            }
        }
    }
}

/// An entry of [`HashSlots::entry`].
pub enum Entry<'a, V> {
    Occupied(OccupiedEntry<'a, V>),
    Vacant(VacantEntry<'a, V>),
}

pub struct OccupiedEntry<'a, V> {
    table: &'a mut HashSlots<V>,
    at: usize,
}

impl<V: SlotValue> OccupiedEntry<'_, V> {
    pub fn get(&self) -> &V {
        &self.table.slots[self.at].value
    }

    /// The value, to change in place; left [`SlotValue::VACANT`], the entry must be removed.
    pub fn get_mut(&mut self) -> &mut V {
        &mut self.table.slots[self.at].value
    }

    pub fn remove(self) -> V {
        self.table.remove_at(self.at)
    }
}

pub struct VacantEntry<'a, V> {
    table: &'a mut HashSlots<V>,
    at: usize,
    hash: u64,
}

impl<V: SlotValue> VacantEntry<'_, V> {
    pub fn insert(self, value: V) {
        debug_assert!(!value.is_vacant(), "a stored value is never the vacant one");
        self.table.slots[self.at] = Slot {
            hash: self.hash,
            value,
        };
        self.table.len += 1;
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
        /// Removes every entry whose value is odd, and adds one to the rest.
        Retain,
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few distinct hashes, some sharing a home: long runs, wrapping around the end,
        // removals from their middles.
        let hash = prop_oneof![0u64..40, any::<u64>()];
        prop_oneof![
            20 => (hash.clone(), 0u32..1000).prop_map(|(h, b)| Op::Insert(h, b)),
            20 => hash.prop_map(Op::Remove),
            1 => Just(Op::Retain),
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
                    Op::Retain => {
                        let keep = |b: &mut u32| {
                            *b += 1;
                            *b % 2 == 1
                        };
                        model.retain(|_, b| keep(b));
                        slots.retain(|_, b| keep(b));
                    }
                }
                prop_assert_eq!(slots.len(), model.len());
                for (&h, &b) in &model {
                    prop_assert_eq!(slots.get(SequenceHash(h)), Some(&b));
                }
            }
            let mut entries: Vec<(u64, u32)> = slots.iter().map(|(h, &b)| (h.0, b)).collect();
            let mut expected: Vec<(u64, u32)> = model.into_iter().collect();
            entries.sort_unstable();
            expected.sort_unstable();
            prop_assert_eq!(entries, expected);
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
        assert_eq!(slots.get(SequenceHash(last[1])), Some(&1));
        assert_eq!(slots.get(SequenceHash(last[2])), Some(&2));
        assert_eq!(slots.get(SequenceHash(last[0])), None);
    }

    #[test]
    fn an_entry_emptied_in_place_is_removed_by_its_handle() {
        let mut slots = HashSlots::with_room_for(4);
        let n = slots.slots.len() as u64;
        let homed: Vec<u64> = (0..10_000u64)
            .filter(|&h| slots.home(h) as u64 == 0)
            .take(2)
            .collect();
        slots.insert_new(SequenceHash(homed[0]), 5);
        slots.insert_new(SequenceHash(homed[1]), 6);
        let Entry::Occupied(mut e) = slots.entry(SequenceHash(homed[0])) else {
            panic!("inserted");
        };
        *e.get_mut() = u32::VACANT;
        assert_eq!(e.remove(), u32::VACANT);
        // The second entry of the run moved home, and is still found.
        assert_eq!(slots.get(SequenceHash(homed[1])), Some(&6));
        assert_eq!((slots.len(), n), (1, slots.slots.len() as u64));
        assert!(matches!(
            slots.entry(SequenceHash(homed[0])),
            Entry::Vacant(_)
        ));
    }

    #[test]
    fn reserve_keeps_every_entry() {
        let mut slots = HashSlots::with_room_for(0);
        for h in 0..5u64 {
            slots.insert_new(SequenceHash(h), h as u32);
        }
        slots.reserve(1000);
        assert!(slots.slots.len() >= 2000);
        assert_eq!(slots.len(), 5);
        assert!((0..5u64).all(|h| slots.get(SequenceHash(h)) == Some(&(h as u32))));
    }
}
