//! The in-memory index: block -> holders, each with its tiers.
//!
//! A flat hash map keyed by sequence hash. Chained hashes already name a whole prefix, so a
//! lookup is a walk from the first block that stops when no node holds the next one. A trie
//! (children keyed by hash) needs each block's parent, which `KvEvent` does not carry, and
//! even given parents it was no faster where it matters (`benches/prefix_index.rs`: 1,000
//! nodes, 100k blocks; lookups of cached prompts 10-30% slower, misses 14 ns faster).
//!
//! Holders are a vector sorted by node, so a walk intersects them with the still-matching
//! nodes by a merge instead of hashing every node at every step, and counts tiers with a table
//! (both halved lookup time). Each holder is packed into 4 bytes: a dense slot number the
//! index gives each node, and the tier bits. A second map, node -> its blocks, makes a node's
//! removal and snapshot replacement cost that node's blocks, not the whole index. Most blocks
//! have one or two holders, kept in the map's own entry rather than a vector of their own
//! ([`Holders`]), so publishing a block allocates nothing.
//!
//! A writer whose nodes rarely leave (the simulator: a million blocks, a KV event every few
//! hundred nanoseconds) keeps no per-node map ([`InMemoryPrefixIndex::without_node_maps`]):
//! an event is then one lookup of the block's holders, which carry the node's tiers already,
//! and a node's removal or replacement scans the whole index instead.

use super::{PrefixIndex, TierSet, TieredKvEvent, TieredOverlap};
use kvmesh_common::fast_hash::U64Map;
use kvmesh_common::hash_slots::{self, HashSlots, SlotValue};
use kvmesh_common::{NodeId, SequenceHash};
use std::collections::hash_map::Entry;
use std::sync::RwLock;
use tokio::sync::watch;

/// A map keyed by sequence hash (SipHash would cost more than the rest of a lookup step).
pub(crate) type SeqMap<V> = U64Map<SequenceHash, V>;

/// Which nodes hold which blocks, in which tiers; one process's own copy.
///
/// Written directly in a single-process mesh (`kvmesh serve`), or kept current from etcd by
/// [`crate::EtcdPrefixIndex`].
#[derive(Debug)]
pub struct InMemoryPrefixIndex {
    state: RwLock<State>,
    generation: watch::Sender<u64>,
}

/// One holder of one block: the node's slot in the high bits, its tiers in the low three.
/// Ordered by slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Holder(u32);

impl Holder {
    const TIER_BITS: u32 = 3;

    fn new(slot: u32, tiers: TierSet) -> Self {
        Holder(slot << Self::TIER_BITS | u32::from(tiers.bits()))
    }

    fn slot(self) -> u32 {
        self.0 >> Self::TIER_BITS
    }

    fn tier_bits(self) -> u32 {
        self.0 & ((1 << Self::TIER_BITS) - 1)
    }

    /// The index in [`Counts`] of the fastest tier it holds the block in: a table lookup,
    /// as this runs once per matching node per block of a lookup.
    fn fastest(self) -> usize {
        // By tier bits (device 1, host 2, disk 4); no bits (never stored) counts nowhere.
        const FASTEST: [usize; 8] = [3, 0, 1, 0, 2, 0, 1, 0];
        FASTEST[self.tier_bits() as usize]
    }
}

/// Leading blocks by fastest tier (device, host, disk), during a lookup.
type Counts = [u32; 4];

/// One block's holders, sorted by slot: up to [`Holders::FEW`] in place, more in a vector.
/// Most blocks have one or two (a prompt's blocks on its prefill and its decode node), and a
/// vector of their own would cost an allocation and a cache miss more per publish.
#[derive(Debug)]
enum Holders {
    /// The first of them are the holders, the rest [`Holder::NONE`] (which sorts last).
    Few([Holder; Holders::FEW]),
    Many(Vec<Holder>),
}

impl Holder {
    /// No holder: a slot beyond any a node is given ([`State::claim`]).
    const NONE: Holder = Holder(u32::MAX);
}

/// A block nobody holds: an empty slot of the table.
impl SlotValue for Holders {
    const VACANT: Holders = Holders::Few([Holder::NONE; Holders::FEW]);

    fn is_vacant(&self) -> bool {
        matches!(self, Holders::Few(few) if few[0] == Holder::NONE)
    }
}

impl Holders {
    const FEW: usize = 4;

    fn one(holder: Holder) -> Self {
        let mut few = [Holder::NONE; Self::FEW];
        few[0] = holder;
        Holders::Few(few)
    }

    /// The tiers `slot` holds the block in (empty: it does not).
    fn tiers_of(&self, slot: u32) -> TierSet {
        let held = self.as_slice();
        match held.binary_search_by_key(&slot, |h| h.slot()) {
            Ok(i) => TierSet::from_bits(held[i].tier_bits() as u8).expect("three tier bits"),
            Err(_) => TierSet::default(),
        }
    }

    fn as_slice(&self) -> &[Holder] {
        match self {
            Holders::Few(few) => {
                let n = few.iter().take_while(|h| **h != Holder::NONE).count();
                &few[..n]
            }
            Holders::Many(v) => v,
        }
    }

    /// Inserts `holder`, or replaces the one of its slot; true if it was not there.
    fn put(&mut self, holder: Holder) -> bool {
        let at = self
            .as_slice()
            .binary_search_by_key(&holder.slot(), |h| h.slot());
        match (self, at) {
            (Holders::Few(few), Ok(i)) => few[i] = holder,
            (Holders::Many(v), Ok(i)) => v[i] = holder,
            (Holders::Few(few), Err(i)) if few[Self::FEW - 1] == Holder::NONE => {
                few.copy_within(i..Self::FEW - 1, i + 1);
                few[i] = holder;
            }
            (Holders::Many(v), Err(i)) => v.insert(i, holder),
            // Full: they move to a vector.
            (this, Err(i)) => {
                let mut v = this.as_slice().to_vec();
                v.insert(i, holder);
                *this = Holders::Many(v);
            }
        }
        at.is_err()
    }

    /// Removes the holder of `slot`: whether it was there, and whether none is left.
    fn take(&mut self, slot: u32) -> (bool, bool) {
        let Ok(i) = self.as_slice().binary_search_by_key(&slot, |h| h.slot()) else {
            return (false, false);
        };
        match self {
            Holders::Few(few) => {
                few.copy_within(i + 1.., i);
                few[Self::FEW - 1] = Holder::NONE;
                (true, few[0] == Holder::NONE)
            }
            Holders::Many(v) => {
                v.remove(i);
                (true, v.is_empty())
            }
        }
    }
}

#[derive(Debug, Default)]
struct State {
    /// Block -> holders sorted by slot. Probed at random over millions of blocks: a table
    /// whose probe costs one cache miss, and that an event batch prefetches.
    holders: HashSlots<Holders>,
    /// Whether each node's blocks are kept in a map of its own (see the module docs).
    node_maps: bool,
    /// Node -> its slot, while it holds at least one block.
    slots: U64Map<NodeId, u32>,
    /// Slot -> its node and the blocks it holds.
    nodes: Vec<NodeBlocks>,
    /// Slots of nodes that left, for reuse.
    free: Vec<u32>,
    /// (block, node) pairs.
    entries: usize,
}

#[derive(Debug)]
struct NodeBlocks {
    node: NodeId,
    /// Its blocks and their tiers, with node maps; empty without.
    blocks: SeqMap<TierSet>,
    /// How many blocks it holds.
    held: usize,
}

impl Default for InMemoryPrefixIndex {
    fn default() -> Self {
        InMemoryPrefixIndex::with_state(State {
            node_maps: true,
            ..State::default()
        })
    }
}

impl InMemoryPrefixIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// An index that keeps no map per node (see the module docs): each event costs one
    /// lookup where it costs two, and removing or replacing a node costs the whole index
    /// where it costs that node's blocks. For a writer whose events far outnumber its nodes'
    /// departures.
    pub fn without_node_maps() -> Self {
        InMemoryPrefixIndex::with_state(State::default())
    }

    fn with_state(state: State) -> Self {
        InMemoryPrefixIndex {
            state: RwLock::new(state),
            generation: watch::Sender::new(0),
        }
    }

    /// Applies a node's stored/removed events, in order. Plain `KvEvent`s (the engine's main
    /// pool) are accepted as [`Tier::Device`](super::Tier::Device) events.
    pub fn apply<E: Copy + Into<TieredKvEvent>>(&self, node: NodeId, events: &[E]) {
        let mut state = self.state.write().expect("prefix index lock");
        state.touch(events.iter().map(|&e| e.into().hash()));
        let slot = state.claim(node);
        let mut changed = false;
        for &event in events {
            changed |= state.apply(slot, event.into());
        }
        state.release_if_empty(slot);
        drop(state);
        if changed {
            self.bump();
        }
    }

    /// Sets the tiers `node` holds each listed block in (empty: not held).
    pub(crate) fn set_tiers(&self, node: NodeId, blocks: &[(SequenceHash, TierSet)]) {
        let mut state = self.state.write().expect("prefix index lock");
        let slot = state.claim(node);
        let mut changed = false;
        for &(hash, tiers) in blocks {
            changed |= state.set(slot, hash, tiers);
        }
        state.release_if_empty(slot);
        drop(state);
        if changed {
            self.bump();
        }
    }

    /// Replaces everything `node` holds with `blocks` (a snapshot of the node). Costs the
    /// node's old and new blocks, not the index.
    pub fn replace_node(
        &self,
        node: NodeId,
        blocks: impl IntoIterator<Item = (SequenceHash, TierSet)>,
    ) {
        let new: SeqMap<TierSet> = blocks.into_iter().filter(|(_, t)| !t.is_empty()).collect();
        let mut state = self.state.write().expect("prefix index lock");
        let slot = state.claim(node);
        let changed = match state.node_maps {
            true => state.replace_mapped(slot, new),
            false => state.replace_scanning(slot, &new),
        };
        state.release_if_empty(slot);
        drop(state);
        if changed {
            self.bump();
        }
    }

    /// Forgets everything a node published (it left, or its lease expired).
    pub fn remove_node(&self, node: NodeId) {
        self.replace_node(node, []);
    }

    /// Makes room for `blocks` distinct blocks. A writer that knows how many blocks its nodes
    /// hold (the simulator) reserves them up front: filling the index doubles it otherwise,
    /// rehashing every block and faulting in each size on the way.
    pub fn reserve(&self, blocks: usize) {
        let mut state = self.state.write().expect("prefix index lock");
        state.holders.reserve(blocks);
    }

    /// Nodes holding at least one block, in id order.
    pub fn nodes(&self) -> Vec<NodeId> {
        let state = self.state.read().expect("prefix index lock");
        let mut nodes: Vec<NodeId> = state.slots.keys().copied().collect();
        nodes.sort_unstable();
        nodes
    }

    /// How many blocks `node` holds (in any tier).
    pub fn node_blocks(&self, node: NodeId) -> usize {
        let state = self.state.read().expect("prefix index lock");
        state
            .slots
            .get(&node)
            .map_or(0, |&slot| state.nodes[slot as usize].held)
    }

    /// What `node` holds, sorted by hash.
    #[cfg(test)]
    pub(crate) fn node_entries(&self, node: NodeId) -> Vec<(SequenceHash, TierSet)> {
        let state = self.state.read().expect("prefix index lock");
        let Some(&slot) = state.slots.get(&node) else {
            return Vec::new();
        };
        let mut entries: Vec<_> = state
            .holders
            .iter()
            .map(|(h, holders)| (h, holders.tiers_of(slot)))
            .filter(|(_, t)| !t.is_empty())
            .collect();
        entries.sort_unstable_by_key(|&(h, _)| h);
        entries
    }

    fn bump(&self) {
        // With no one subscribed (the simulator's index) there is no one to wake, and waking
        // no one still took the notifier's locks, once an event batch.
        let notify = self.generation.receiver_count() > 0;
        self.generation.send_if_modified(|g| {
            *g += 1;
            notify
        });
    }
}

impl State {
    /// The node's slot, given one if it has none.
    fn claim(&mut self, node: NodeId) -> u32 {
        if let Some(&slot) = self.slots.get(&node) {
            return slot;
        }
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                self.nodes.push(NodeBlocks {
                    node,
                    blocks: SeqMap::default(),
                    held: 0,
                });
                let slot = u32::try_from(self.nodes.len() - 1).expect("fewer nodes than u32");
                assert!(
                    slot < u32::MAX >> Holder::TIER_BITS,
                    "too many nodes for a slot"
                );
                slot
            }
        };
        self.nodes[slot as usize].node = node;
        self.slots.insert(node, slot);
        slot
    }

    /// A node that holds nothing gives its slot back (no holder names it any more).
    fn release_if_empty(&mut self, slot: u32) {
        let entry = &mut self.nodes[slot as usize];
        if entry.held == 0 {
            entry.blocks = SeqMap::default(); // free its table
            self.slots.remove(&entry.node);
            self.free.push(slot);
        }
    }

    /// Sets one entry of a claimed slot (release it after, if it may be left empty); returns
    /// whether it changed.
    fn set(&mut self, slot: u32, hash: SequenceHash, tiers: TierSet) -> bool {
        if !self.node_maps {
            return self.set_held(slot, hash, |_| tiers);
        }
        let blocks = &mut self.nodes[slot as usize].blocks;
        let old = if tiers.is_empty() {
            blocks.remove(&hash)
        } else {
            blocks.insert(hash, tiers)
        };
        self.update_holders(slot, hash, old.unwrap_or_default(), tiers)
    }

    /// Starts loading every block's entry before a batch's updates: in an index larger than
    /// the caches their misses overlap, and the updates that follow find their entries cached.
    fn touch(&self, hashes: impl Iterator<Item = SequenceHash>) {
        for hash in hashes {
            self.holders.prefetch(hash);
        }
    }

    /// Applies one event of a claimed slot ([`Self::set`] with the tiers after it, one lookup
    /// of the node's own entry); returns whether it changed anything.
    fn apply(&mut self, slot: u32, event: TieredKvEvent) -> bool {
        if !self.node_maps {
            return self.set_held(slot, event.hash(), |old| old.after(event));
        }
        let hash = event.hash();
        let (old, tiers) = match self.nodes[slot as usize].blocks.entry(hash) {
            Entry::Occupied(mut e) => {
                let old = *e.get();
                let tiers = old.after(event);
                if tiers.is_empty() {
                    e.remove();
                } else {
                    e.insert(tiers);
                }
                (old, tiers)
            }
            Entry::Vacant(e) => {
                let tiers = TierSet::default().after(event);
                if !tiers.is_empty() {
                    e.insert(tiers);
                }
                (TierSet::default(), tiers)
            }
        };
        self.update_holders(slot, hash, old, tiers)
    }

    /// Without node maps: the block's tiers on `slot` go from what its holders say to
    /// `tiers(old)`, in one lookup; returns whether they changed.
    fn set_held(
        &mut self,
        slot: u32,
        hash: SequenceHash,
        tiers: impl FnOnce(TierSet) -> TierSet,
    ) -> bool {
        match self.holders.entry(hash) {
            hash_slots::Entry::Occupied(mut e) => {
                let old = e.get().tiers_of(slot);
                let new = tiers(old);
                if new == old {
                    return false;
                }
                if !new.is_empty() {
                    if e.get_mut().put(Holder::new(slot, new)) {
                        self.counted(slot, 1);
                    }
                    return true;
                }
                let (_, none_left) = e.get_mut().take(slot);
                if none_left {
                    e.remove();
                }
                self.counted(slot, -1);
                true
            }
            hash_slots::Entry::Vacant(e) => {
                let new = tiers(TierSet::default());
                if new.is_empty() {
                    return false;
                }
                e.insert(Holders::one(Holder::new(slot, new)));
                self.counted(slot, 1);
                true
            }
        }
    }

    /// `slot` holds `by` blocks more (or fewer).
    fn counted(&mut self, slot: u32, by: isize) {
        let held = &mut self.nodes[slot as usize].held;
        *held = held
            .checked_add_signed(by)
            .expect("a node holds what it gives up");
        self.entries = self.entries.checked_add_signed(by).expect("entries");
    }

    /// With node maps: the claimed `slot` holds exactly `new`, at the cost of its old and new
    /// blocks; whether anything changed.
    fn replace_mapped(&mut self, slot: u32, new: SeqMap<TierSet>) -> bool {
        let old = std::mem::take(&mut self.nodes[slot as usize].blocks);
        let mut changed = false;
        for hash in old.keys() {
            if !new.contains_key(hash) {
                self.unhold(slot, *hash);
                changed = true;
            }
        }
        for (&hash, &tiers) in &new {
            if old.get(&hash) != Some(&tiers) {
                self.hold(slot, hash, tiers);
                changed = true;
            }
        }
        self.nodes[slot as usize].blocks = new;
        changed
    }

    /// Without node maps: the claimed `slot` holds exactly `new`, scanning every block for
    /// what it holds now; whether anything changed.
    fn replace_scanning(&mut self, slot: u32, new: &SeqMap<TierSet>) -> bool {
        let mut dropped = 0;
        self.holders.retain(|hash, holders| {
            if !new.contains_key(&hash) && holders.take(slot).0 {
                dropped += 1;
            }
            !holders.as_slice().is_empty()
        });
        self.counted(slot, -dropped);
        let mut changed = dropped > 0;
        for (&hash, &tiers) in new {
            changed |= self.set_held(slot, hash, |_| tiers);
        }
        changed
    }

    /// The holders side of a node's block going from `old` to `tiers`; whether it changed.
    fn update_holders(
        &mut self,
        slot: u32,
        hash: SequenceHash,
        old: TierSet,
        tiers: TierSet,
    ) -> bool {
        if old == tiers {
            return false;
        }
        if tiers.is_empty() {
            self.unhold(slot, hash);
        } else {
            self.hold(slot, hash, tiers);
        }
        true
    }

    /// Inserts or updates a holder of the block (the holders side only).
    fn hold(&mut self, slot: u32, hash: SequenceHash, tiers: TierSet) {
        let holder = Holder::new(slot, tiers);
        match self.holders.entry(hash) {
            hash_slots::Entry::Vacant(e) => {
                e.insert(Holders::one(holder));
                self.counted(slot, 1);
            }
            hash_slots::Entry::Occupied(mut e) => {
                if e.get_mut().put(holder) {
                    self.counted(slot, 1);
                }
            }
        }
    }

    /// Removes a holder of the block (the holders side only).
    fn unhold(&mut self, slot: u32, hash: SequenceHash) {
        let hash_slots::Entry::Occupied(mut e) = self.holders.entry(hash) else {
            return;
        };
        let (removed, none_left) = e.get_mut().take(slot);
        if none_left {
            e.remove();
        }
        if removed {
            self.counted(slot, -1);
        }
    }
}

impl InMemoryPrefixIndex {
    /// The lookup behind both overlaps: `finish` turns a node's counts into its answer.
    fn walk<T>(&self, hashes: &[SequenceHash], finish: impl Fn(&Counts) -> T) -> U64Map<NodeId, T> {
        let state = self.state.read().expect("prefix index lock");
        let Some((first, rest)) = hashes.split_first() else {
            return U64Map::default();
        };
        // The walk probes one block after another: loaded a few blocks ahead, their misses
        // overlap (a walk that stops early has loaded a few slots for nothing).
        const AHEAD: usize = 8;
        for &hash in rest.iter().take(AHEAD) {
            state.holders.prefetch(hash);
        }
        let Some(holders) = state.holders.get(*first).map(Holders::as_slice) else {
            return U64Map::default();
        };
        // Every holder of the first block has an answer: room for them all, once.
        let mut result = U64Map::with_capacity_and_hasher(holders.len(), Default::default());
        // Slots of the nodes that hold every block so far, in slot order like every holders
        // vector, with their leading blocks counted by fastest tier.
        let mut matching: Vec<(u32, Counts)> = holders
            .iter()
            .map(|h| {
                let mut counts = Counts::default();
                counts[h.fastest()] += 1;
                (h.slot(), counts)
            })
            .collect();
        let node = |slot: u32| state.nodes[slot as usize].node;
        for (i, &hash) in rest.iter().enumerate() {
            if let Some(&ahead) = rest.get(i + AHEAD) {
                state.holders.prefetch(ahead);
            }
            let Some(holders) = state.holders.get(hash).map(Holders::as_slice) else {
                break;
            };
            let mut at = 0;
            matching.retain_mut(|(slot, counts)| {
                at = seek(holders, at, *slot);
                match holders.get(at) {
                    Some(h) if h.slot() == *slot => {
                        counts[h.fastest()] += 1;
                        true
                    }
                    // Its prefix ends here: the count is final.
                    _ => {
                        result.insert(node(*slot), finish(counts));
                        false
                    }
                }
            });
            if matching.is_empty() {
                break;
            }
        }
        result.extend(
            matching
                .into_iter()
                .map(|(slot, counts)| (node(slot), finish(&counts))),
        );
        result
    }
}

impl PrefixIndex for InMemoryPrefixIndex {
    fn overlap_tiered(&self, hashes: &[SequenceHash]) -> U64Map<NodeId, TieredOverlap> {
        self.walk(hashes, |c| TieredOverlap {
            device: c[0] as usize,
            host: c[1] as usize,
            disk: c[2] as usize,
        })
    }

    fn overlap(&self, hashes: &[SequenceHash]) -> U64Map<NodeId, usize> {
        self.walk(hashes, |c| (c[0] + c[1] + c[2]) as usize)
    }

    fn len(&self) -> usize {
        self.state.read().expect("prefix index lock").entries
    }

    fn subscribe(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }
}

/// The first position at or after `from` whose slot is not below `slot`: a few linear steps
/// (holders and matching nodes usually move together), then a binary search.
fn seek(holders: &[Holder], mut from: usize, slot: u32) -> usize {
    for _ in 0..4 {
        match holders.get(from) {
            Some(h) if h.slot() < slot => from += 1,
            _ => return from,
        }
    }
    from + holders[from..].partition_point(|h| h.slot() < slot)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::Tier;
    use kvmesh_common::KvEvent;

    fn h(i: u64) -> SequenceHash {
        SequenceHash(i)
    }

    #[test]
    fn overlap_counts_leading_blocks_per_node() {
        let idx = InMemoryPrefixIndex::new();
        idx.apply(
            NodeId(1),
            &[
                KvEvent::Stored(h(1)),
                KvEvent::Stored(h(2)),
                KvEvent::Stored(h(3)),
            ],
        );
        idx.apply(NodeId(2), &[KvEvent::Stored(h(1)), KvEvent::Stored(h(3))]);
        let o = idx.overlap(&[h(1), h(2), h(3), h(4)]);
        assert_eq!(o[&NodeId(1)], 3);
        // Node 2 lacks block 2, so block 3 cannot be a prefix hit there.
        assert_eq!(o[&NodeId(2)], 1);
        assert_eq!(idx.len(), 5);
        assert!(idx.overlap(&[h(2)]).contains_key(&NodeId(1)));
        assert!(idx.overlap(&[h(9), h(1)]).is_empty());
        assert!(idx.overlap(&[]).is_empty());
    }

    #[test]
    fn removal_and_node_loss_forget_entries() {
        let idx = InMemoryPrefixIndex::new();
        idx.apply(NodeId(1), &[KvEvent::Stored(h(1)), KvEvent::Stored(h(2))]);
        idx.apply(NodeId(1), &[KvEvent::Removed(h(2))]);
        assert_eq!(idx.overlap(&[h(1), h(2)])[&NodeId(1)], 1);
        idx.remove_node(NodeId(1));
        assert!(idx.overlap(&[h(1)]).is_empty());
        assert!(idx.is_empty());
        assert!(idx.nodes().is_empty());
    }

    #[test]
    fn tiers_are_tracked_per_node_and_block() {
        let idx = InMemoryPrefixIndex::new();
        let n = NodeId(7);
        idx.apply(
            n,
            &[
                TieredKvEvent::stored(Tier::Device, h(1)),
                TieredKvEvent::stored(Tier::Host, h(1)),
                TieredKvEvent::stored(Tier::Host, h(2)),
                TieredKvEvent::stored(Tier::Disk, h(3)),
            ],
        );
        let o = idx.overlap_tiered(&[h(1), h(2), h(3)])[&n];
        assert_eq!((o.device, o.host, o.disk), (1, 1, 1));
        // Evicted from the device but still in host memory: still a hit, a slower one.
        idx.apply(n, &[TieredKvEvent::removed(Tier::Device, h(1))]);
        let o = idx.overlap_tiered(&[h(1), h(2), h(3)])[&n];
        assert_eq!((o.device, o.host, o.disk), (0, 2, 1));
        assert_eq!(
            idx.len(),
            3,
            "one entry per (block, node), whatever its tiers"
        );
        idx.apply(n, &[TieredKvEvent::removed(Tier::Host, h(1))]);
        assert!(idx.overlap_tiered(&[h(1)]).is_empty());
        assert_eq!(idx.node_blocks(n), 2);
    }

    #[test]
    fn replace_node_swaps_one_nodes_blocks_and_signals_only_changes() {
        let idx = InMemoryPrefixIndex::new();
        let dev = TierSet::only(Tier::Device);
        idx.apply(NodeId(1), &[KvEvent::Stored(h(1)), KvEvent::Stored(h(2))]);
        idx.apply(NodeId(2), &[KvEvent::Stored(h(1))]);
        let mut changes = idx.subscribe();
        changes.mark_unchanged();
        idx.replace_node(NodeId(1), [(h(1), dev), (h(2), dev)]);
        assert!(
            !changes.has_changed().unwrap(),
            "the same blocks are no change"
        );
        idx.replace_node(NodeId(1), [(h(2), dev), (h(3), TierSet::only(Tier::Disk))]);
        assert!(changes.has_changed().unwrap());
        assert_eq!(
            idx.overlap(&[h(1)]).keys().collect::<Vec<_>>(),
            [&NodeId(2)]
        );
        assert_eq!(idx.overlap(&[h(2), h(3)])[&NodeId(1)], 2);
        assert_eq!(idx.len(), 3);
        assert_eq!(idx.nodes(), [NodeId(1), NodeId(2)]);
    }

    #[test]
    fn seek_finds_the_first_position_not_below() {
        let t = TierSet::only(Tier::Host);
        let v: Vec<Holder> = (0..100).map(|i| Holder::new(i * 2, t)).collect();
        assert_eq!(
            (v[3].slot(), v[3].tier_bits(), v[3].fastest()),
            (6, 0b10, 1)
        );
        for bits in 1..8 {
            let tiers = TierSet::from_bits(bits).unwrap();
            let fastest = Tier::ALL.iter().position(|&t| Some(t) == tiers.fastest());
            assert_eq!(Some(Holder::new(1, tiers).fastest()), fastest);
        }
        for from in [0, 3, 50] {
            for slot in 0..210 {
                let at = seek(&v, from, slot);
                let want = from + v[from..].partition_point(|h| h.slot() < slot);
                assert_eq!(at, want, "from {from} slot {slot}");
            }
        }
    }

    mod model {
        use super::*;
        use proptest::prelude::*;
        use std::collections::HashMap;

        /// The obvious index: per node, its blocks; overlap walks every node.
        #[derive(Default)]
        struct Model(HashMap<NodeId, HashMap<SequenceHash, TierSet>>);

        impl Model {
            fn apply(&mut self, node: NodeId, events: &[TieredKvEvent]) {
                let blocks = self.0.entry(node).or_default();
                for &e in events {
                    let t = blocks.get(&e.hash()).copied().unwrap_or_default().after(e);
                    if t.is_empty() {
                        blocks.remove(&e.hash());
                    } else {
                        blocks.insert(e.hash(), t);
                    }
                }
            }

            fn overlap(&self, hashes: &[SequenceHash]) -> U64Map<NodeId, TieredOverlap> {
                let mut out = U64Map::default();
                for (&node, blocks) in &self.0 {
                    let mut o = TieredOverlap::default();
                    for h in hashes {
                        match blocks.get(h) {
                            Some(&t) => o.push(t),
                            None => break,
                        }
                    }
                    if o.total() > 0 {
                        out.insert(node, o);
                    }
                }
                out
            }

            fn len(&self) -> usize {
                self.0.values().map(HashMap::len).sum()
            }
        }

        #[derive(Clone, Debug)]
        enum Op {
            Apply(u64, Vec<TieredKvEvent>),
            Remove(u64),
            Replace(u64, Vec<(u64, u8)>),
        }

        fn event() -> impl Strategy<Value = TieredKvEvent> {
            (0..10u64, 0..3usize, any::<bool>()).prop_map(|(h, t, stored)| {
                let tier = Tier::ALL[t];
                if stored {
                    TieredKvEvent::stored(tier, SequenceHash(h))
                } else {
                    TieredKvEvent::removed(tier, SequenceHash(h))
                }
            })
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                8 => (0..5u64, proptest::collection::vec(event(), 0..12))
                    .prop_map(|(n, e)| Op::Apply(n, e)),
                1 => (0..5u64).prop_map(Op::Remove),
                1 => (0..5u64, proptest::collection::vec((0..10u64, 0..8u8), 0..8))
                    .prop_map(|(n, e)| Op::Replace(n, e)),
            ]
        }

        fn tier_sets(entries: &[(u64, u8)]) -> impl Iterator<Item = (SequenceHash, TierSet)> + '_ {
            entries
                .iter()
                .map(|&(h, t)| (SequenceHash(h), TierSet::from_bits(t).unwrap()))
        }

        proptest! {
            #[test]
            fn overlap_matches_a_naive_model(
                ops in proptest::collection::vec(op(), 1..40),
                prompts in proptest::collection::vec(proptest::collection::vec(0..10u64, 0..8), 1..10),
            ) {
                // Both layouts, each checked against the model after every operation.
                let indexes = [InMemoryPrefixIndex::new(), InMemoryPrefixIndex::without_node_maps()];
                let mut model = Model::default();
                for op in ops {
                    for index in &indexes {
                        match &op {
                            Op::Apply(n, events) => index.apply(NodeId(*n), events),
                            Op::Remove(n) => index.remove_node(NodeId(*n)),
                            Op::Replace(n, entries) => {
                                index.replace_node(NodeId(*n), tier_sets(entries))
                            }
                        }
                    }
                    match op {
                        Op::Apply(n, events) => model.apply(NodeId(n), &events),
                        Op::Remove(n) => drop(model.0.remove(&NodeId(n))),
                        Op::Replace(n, entries) => {
                            let blocks: HashMap<_, _> = tier_sets(&entries)
                                .filter(|(_, t)| !t.is_empty())
                                .collect();
                            model.0.insert(NodeId(n), blocks);
                        }
                    }
                    for index in &indexes {
                        prop_assert_eq!(index.len(), model.len());
                        for n in 0..5 {
                            let blocks = model.0.get(&NodeId(n)).map_or(0, HashMap::len);
                            prop_assert_eq!(index.node_blocks(NodeId(n)), blocks);
                            let mut held: Vec<_> = model.0.get(&NodeId(n))
                                .map(|b| b.iter().map(|(&h, &t)| (h, t)).collect())
                                .unwrap_or_default();
                            held.sort_unstable_by_key(|&(h, _)| h);
                            prop_assert_eq!(index.node_entries(NodeId(n)), held);
                        }
                        for prompt in &prompts {
                            let hashes: Vec<SequenceHash> = prompt.iter().copied().map(SequenceHash).collect();
                            prop_assert_eq!(index.overlap_tiered(&hashes), model.overlap(&hashes));
                        }
                    }
                }
            }
        }
    }
}
