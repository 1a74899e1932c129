//! The paged KV block pool: reference counts, free lists and the prefix cache (vLLM v1's
//! `block_pool`).
//!
//! A block is *used* while at least one sequence holds a reference to it and *free* otherwise.
//! A full block whose content is known gets a [`SequenceHash`] (`cache_full_block`); it stays a
//! prefix hit after it is freed, until its memory is reallocated. To keep hits alive as long as
//! possible, allocation takes free blocks that hold no cached prefix first, and only then
//! evicts cached ones, least recently freed first.
//!
//! With lower tiers (`with_tiers`), an evicted cached block is not forgotten: its KV is
//! copied to host memory, and from there, when host memory is full, to disk; it stays a
//! prefix hit from either, and admission copies it back into a fresh block ("promotes" it).
//! The pool keeps only the hashes; it records each copy as a [`TierMove`] that the engine
//! carries out before the step's forward pass, in order.
//!
//! When recording is on (`set_record_events`), every hash that becomes a hit or stops being
//! one, in each tier, is announced as a [`TieredKvEvent`], so a cluster-wide prefix index can mirror
//! this pool without scanning it. It is off by default so that a node without an index does
//! not accumulate events nobody drains.

mod free_list;
mod tier_index;

use free_list::FreeList;
use kvmesh_common::hash_slots::HashSlots;
use kvmesh_common::kv_tier::{Tier, TieredKvEvent};
use kvmesh_common::{BlockId, SequenceHash};
use tier_index::TierIndex;

pub use kvmesh_common::KvEvent;

/// Misuse of the pool's reference counting. The pool's state is unchanged when one is returned.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BlockPoolError {
    #[error("block {} is outside the pool of {num_blocks} blocks", block.0)]
    OutOfRange { block: BlockId, num_blocks: usize },
    /// Freeing (or caching) a block nobody holds: a double free in the caller.
    #[error("block {} has no references", block.0)]
    NotReferenced { block: BlockId },
    /// A full block's content never changes, so it can only ever have one hash.
    #[error("block {} is already cached under a different hash", block.0)]
    AlreadyCached { block: BlockId },
}

/// A copy between the tiers, for the engine to carry out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TierMove {
    /// Copy `block`'s KV to host memory under `hash` (before the block is reused).
    Offload { hash: SequenceHash, block: BlockId },
    /// Move `hash`'s KV from host memory to disk.
    Demote { hash: SequenceHash },
    /// Copy `hash`'s KV from tier `from` (host or disk) into `block`, and forget that copy.
    Promote {
        hash: SequenceHash,
        block: BlockId,
        from: Tier,
    },
    /// Forget `hash`'s copy in `tier` (full, or recomputed into the pool meanwhile).
    Drop { hash: SequenceHash, tier: Tier },
}

/// Where a pool holds a cached block's KV (`BlockPool::locate`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    Device(BlockId),
    /// In a tier below the pool: host memory or disk.
    Lower(Tier),
}

#[derive(Clone, Debug, Default)]
struct BlockMeta {
    ref_count: u32,
    /// Set while the block is registered in the prefix cache.
    hash: Option<SequenceHash>,
    /// Changes whenever the block joins or leaves a free list (see [`FreeList`]).
    stamp: u32,
}

/// All KV blocks of one node. See the module docs.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    blocks: Vec<BlockMeta>,
    /// Free blocks without a cached hash: handed out first.
    free_uncached: FreeList,
    /// Free blocks that are still prefix hits, least recently freed at the front.
    free_cached: FreeList,
    /// Probed for every block of every admission and written for every block computed and
    /// evicted (a block has at most one hash, so it never outgrows the pool).
    cached: HashSlots<u32>,
    host: TierIndex,
    disk: TierIndex,
    /// Blocks promoted from each tier since start, by `Tier as usize`.
    promoted: [u64; 3],
    moves: Vec<TierMove>,
    record_events: bool,
    events: Vec<TieredKvEvent>,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks of `block_size` tokens each, all free.
    ///
    /// # Panics
    /// If `block_size` is zero or `num_blocks` does not fit a `u32` block id.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        assert!(
            num_blocks < u32::MAX as usize,
            "num_blocks must fit a u32 block id"
        );
        let mut blocks = vec![BlockMeta::default(); num_blocks];
        let mut free_uncached = FreeList::default();
        for id in 0..num_blocks as u32 {
            free_uncached.push_back(&mut blocks, id);
        }
        BlockPool {
            block_size,
            blocks,
            free_uncached,
            free_cached: FreeList::default(),
            cached: HashSlots::with_room_for(num_blocks),
            host: TierIndex::new(0),
            disk: TierIndex::new(0),
            promoted: [0; 3],
            moves: Vec::new(),
            record_events: false,
            events: Vec::new(),
        }
    }

    /// Keeps up to `host_blocks` evicted cached blocks in host memory and, behind it, up to
    /// `disk_blocks` on disk (0: no such tier). `on_disk` are the hashes a disk tier already
    /// holds (a restarted node's); they are announced when recording starts.
    pub fn with_tiers(
        mut self,
        host_blocks: usize,
        disk_blocks: usize,
        on_disk: impl IntoIterator<Item = SequenceHash>,
    ) -> Self {
        self.host = TierIndex::new(host_blocks);
        self.disk = TierIndex::new(disk_blocks);
        self.restore_disk(on_disk);
        self
    }

    /// Adds what a restarted node's disk tier holds; past its capacity, files are dropped.
    pub fn restore_disk(&mut self, on_disk: impl IntoIterator<Item = SequenceHash>) {
        for hash in on_disk {
            for dropped in self.disk.insert(hash) {
                self.moves.push(TierMove::Drop {
                    hash: dropped,
                    tier: Tier::Disk,
                });
            }
        }
    }

    /// Blocks the host tier holds.
    pub fn num_host_cached(&self) -> usize {
        self.host.len()
    }

    /// Blocks the disk tier holds.
    pub fn num_disk_cached(&self) -> usize {
        self.disk.len()
    }

    /// Prefix hits served from `tier` (below the pool) since start, in blocks.
    pub fn num_promoted(&self, tier: Tier) -> u64 {
        self.promoted[tier as usize]
    }

    /// The tiers below the pool that hold `hashes`, from the first, as long as one does.
    pub fn lookup_lower(&self, hashes: &[SequenceHash]) -> Vec<Tier> {
        hashes
            .iter()
            .map_while(|&h| self.lower_tier_of(h))
            .collect()
    }

    fn lower_tier_of(&self, hash: SequenceHash) -> Option<Tier> {
        if self.host.contains(hash) {
            Some(Tier::Host)
        } else if self.disk.contains(hash) {
            Some(Tier::Disk)
        } else {
            None
        }
    }

    /// Where this pool holds `hash`'s KV, if anywhere.
    pub fn locate(&self, hash: SequenceHash) -> Option<Held> {
        match self.cached.get(hash).copied() {
            Some(block) => Some(Held::Device(BlockId(block))),
            None => self.lower_tier_of(hash).map(Held::Lower),
        }
    }

    /// Takes `hashes` out of the lower tiers to promote them (so that no allocation
    /// meanwhile pushes them out); then `promote` each, with its tier, into a fresh block.
    pub fn take_lower(&mut self, hashes: &[SequenceHash]) -> Vec<Tier> {
        hashes
            .iter()
            .map(|&h| {
                if self.host.remove(h) {
                    Tier::Host
                } else {
                    let held = self.disk.remove(h);
                    debug_assert!(held, "take_lower of a hash no tier holds");
                    Tier::Disk
                }
            })
            .collect()
    }

    /// Forgets `hash` in the lower tiers, announcing it; returns the tier that held it.
    pub fn forget_lower(&mut self, hash: SequenceHash) -> Option<Tier> {
        let tier = self.lower_tier_of(hash)?;
        self.take_lower(&[hash]);
        self.record(TieredKvEvent::removed(tier, hash));
        Some(tier)
    }

    /// Registers fresh `block` (one reference, from `allocate`) as cached under `hash`, whose
    /// KV the engine copies in from tier `from` (`TierMove::Promote`).
    pub fn promote(&mut self, hash: SequenceHash, block: BlockId, from: Tier) {
        let meta = &mut self.blocks[block.0 as usize];
        debug_assert!(meta.ref_count > 0 && meta.hash.is_none());
        meta.hash = Some(hash);
        let added = self.cached.insert_new(hash, block.0);
        debug_assert!(added, "a promoted hash was not cached");
        self.moves.push(TierMove::Promote { hash, block, from });
        self.promoted[from as usize] += 1;
        self.record(TieredKvEvent::removed(from, hash));
        self.record(TieredKvEvent::stored(Tier::Device, hash));
    }

    /// The copies to carry out, in order, since the last call.
    pub fn drain_tier_moves(&mut self) -> Vec<TierMove> {
        std::mem::take(&mut self.moves)
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks nobody holds, cached or not: what `allocate` can hand out.
    pub fn num_free(&self) -> usize {
        self.free_uncached.len() + self.free_cached.len()
    }

    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free()
    }

    /// Fraction of blocks in use, in `[0, 1]` (cached-but-free blocks count as free).
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        self.num_used() as f64 / self.num_blocks() as f64
    }

    /// Number of blocks registered in the prefix cache, used or free.
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// References held on `block` (0 when free or out of range).
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.blocks.get(block.0 as usize).map_or(0, |b| b.ref_count)
    }

    /// The hash `block` is cached under, if any.
    pub fn cached_hash(&self, block: BlockId) -> Option<SequenceHash> {
        self.blocks.get(block.0 as usize).and_then(|b| b.hash)
    }

    /// `n` fresh blocks with one reference each, or `None` (and no change) if fewer are free.
    /// Uncached free blocks go first; then cached ones are evicted, least recently freed first.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free() {
            return None;
        }
        let mut out: Vec<BlockId> = Vec::with_capacity(n);
        let from_uncached = n.min(self.free_uncached.len());
        // The blocks about to be popped, loading together rather than one by one.
        self.free_uncached
            .prefetch_front(&self.blocks, from_uncached);
        self.free_cached
            .prefetch_front(&self.blocks, n - from_uncached);
        let uncached = std::iter::from_fn(|| self.free_uncached.pop_front(&mut self.blocks));
        out.extend(uncached.take(from_uncached).map(BlockId));
        // Then cached blocks, least recently freed first: all taken off their list before any
        // is evicted, so that their hashes' slots load together rather than one by one.
        let first_evicted = out.len();
        while out.len() < n {
            let id = self
                .free_cached
                .pop_front(&mut self.blocks)
                .expect("num_free counted this block");
            if let Some(hash) = self.blocks[id as usize].hash {
                self.cached.prefetch(hash);
            }
            out.push(BlockId(id));
        }
        for &BlockId(id) in &out[first_evicted..] {
            self.evict(id);
        }
        for &BlockId(id) in &out {
            self.blocks[id as usize].ref_count = 1;
        }
        Some(out)
    }

    /// The blocks caching the longest prefix of `hashes`. Takes no references: call `take` on
    /// the result before allocating anything, or an allocation may evict them.
    pub fn lookup_prefix(&self, hashes: &[SequenceHash]) -> Vec<BlockId> {
        hashes
            .iter()
            .map_while(|&h| self.cached.get(h).map(|&b| BlockId(b)))
            .collect()
    }

    /// Starts loading the prefix cache's entries for `hashes` (a hint: changes nothing), so
    /// that probing or registering them one after another does not wait for each in turn.
    pub fn prefetch(&self, hashes: &[SequenceHash]) {
        for &hash in hashes {
            self.cached.prefetch(hash);
        }
    }

    /// Adds one reference to each block (a prefix hit or a shared block), reviving free ones.
    pub fn take(&mut self, blocks: &[BlockId]) -> Result<(), BlockPoolError> {
        for &b in blocks {
            self.check_range(b)?;
        }
        for &b in blocks {
            let id = b.0;
            if self.blocks[id as usize].ref_count == 0 {
                let list = if self.blocks[id as usize].hash.is_some() {
                    &mut self.free_cached
                } else {
                    &mut self.free_uncached
                };
                list.remove(&mut self.blocks, id);
            }
            self.blocks[id as usize].ref_count += 1;
        }
        Ok(())
    }

    /// Registers a full, computed block under `hash` so later sequences can reuse it.
    ///
    /// Returns `Ok(true)` if the block is now cached, `Ok(false)` if it already was, or if
    /// another block already caches `hash` (two sequences computed the same prefix at once;
    /// the first one wins and this block stays uncached).
    pub fn cache_full_block(
        &mut self,
        block: BlockId,
        hash: SequenceHash,
    ) -> Result<bool, BlockPoolError> {
        self.check_range(block)?;
        let meta = &mut self.blocks[block.0 as usize];
        if meta.ref_count == 0 {
            return Err(BlockPoolError::NotReferenced { block });
        }
        match meta.hash {
            Some(h) if h == hash => return Ok(false),
            Some(_) => return Err(BlockPoolError::AlreadyCached { block }),
            None => {}
        }
        if !self.cached.insert_new(hash, block.0) {
            return Ok(false);
        }
        meta.hash = Some(hash);
        // Recomputed while a lower tier holds a copy (it was not promoted): keep one copy.
        if let Some(tier) = self.forget_lower(hash) {
            self.moves.push(TierMove::Drop { hash, tier });
        }
        self.record(TieredKvEvent::stored(Tier::Device, hash));
        Ok(true)
    }

    /// Stops `block` being a prefix hit (its KV is not what its hash says), announcing it.
    pub fn uncache(&mut self, block: BlockId) {
        let id = block.0;
        if self.check_range(block).is_err() || self.blocks[id as usize].hash.is_none() {
            return;
        }
        if self.blocks[id as usize].ref_count == 0 {
            self.free_cached.remove(&mut self.blocks, id);
            self.free_uncached.push_back(&mut self.blocks, id);
        }
        self.forget_hash(id);
    }

    /// Drops one reference from each block. Blocks reaching zero become free; cached ones stay
    /// prefix hits. Pass a sequence's blocks in order: they are released back to front, so a
    /// prefix's tail is evicted before its head (a head is shared by more prompts).
    ///
    /// A reference that does not exist is an error, never an underflow; then nothing changes.
    pub fn free(&mut self, blocks: &[BlockId]) -> Result<(), BlockPoolError> {
        self.check_can_free(blocks)?;
        for &b in blocks.iter().rev() {
            let id = b.0;
            let meta = &mut self.blocks[id as usize];
            meta.ref_count -= 1;
            if meta.ref_count == 0 {
                let list = if meta.hash.is_some() {
                    &mut self.free_cached
                } else {
                    &mut self.free_uncached
                };
                list.push_back(&mut self.blocks, id);
            }
        }
        Ok(())
    }

    /// Starts or stops recording `KvEvent`s. A consumer that starts late takes a snapshot
    /// with `cached_hashes` first; stopping discards undrained events.
    pub fn set_record_events(&mut self, on: bool) {
        self.record_events = on;
        self.events.clear();
        if on {
            // What a restarted node's disk tier holds, announced once.
            let on_disk: Vec<SequenceHash> = self.disk.hashes().collect();
            for hash in on_disk {
                self.record(TieredKvEvent::stored(Tier::Disk, hash));
            }
        }
    }

    /// Events since the last call, oldest first (none unless recording is on).
    pub fn drain_events(&mut self) -> Vec<TieredKvEvent> {
        std::mem::take(&mut self.events)
    }

    /// [`Self::drain_events`] into `out` (cleared first), whose buffer the pool keeps for
    /// the next events: a caller draining often allocates nothing once the buffers have grown.
    pub fn drain_events_into(&mut self, out: &mut Vec<TieredKvEvent>) {
        out.clear();
        std::mem::swap(out, &mut self.events);
    }

    /// Every hash currently cached (in any tier), in no particular order: a snapshot for a
    /// prefix index.
    pub fn cached_hashes(&self) -> impl Iterator<Item = SequenceHash> + '_ {
        self.cached
            .keys()
            .chain(self.host.hashes())
            .chain(self.disk.hashes())
    }

    fn record(&mut self, event: TieredKvEvent) {
        if self.record_events {
            self.events.push(event);
        }
    }

    /// Unregisters block `id`'s hash from the prefix cache, announcing it; returns it.
    fn forget_hash(&mut self, id: u32) -> Option<SequenceHash> {
        let hash = self.blocks[id as usize].hash.take()?;
        self.cached.remove(hash);
        self.record(TieredKvEvent::removed(Tier::Device, hash));
        Some(hash)
    }

    fn evict(&mut self, id: u32) {
        let hash = self
            .forget_hash(id)
            .expect("blocks on the cached free list have a hash");
        if self.host.capacity() == 0 && self.disk.capacity() == 0 {
            return;
        }
        // Still a hit on this node, from host memory (or, past it, from disk).
        self.moves.push(TierMove::Offload {
            hash,
            block: BlockId(id),
        });
        self.record(TieredKvEvent::stored(Tier::Host, hash));
        for spilled in self.host.insert(hash) {
            self.record(TieredKvEvent::removed(Tier::Host, spilled));
            if self.disk.capacity() == 0 {
                self.moves.push(TierMove::Drop {
                    hash: spilled,
                    tier: Tier::Host,
                });
                continue;
            }
            self.moves.push(TierMove::Demote { hash: spilled });
            self.record(TieredKvEvent::stored(Tier::Disk, spilled));
            for dropped in self.disk.insert(spilled) {
                self.moves.push(TierMove::Drop {
                    hash: dropped,
                    tier: Tier::Disk,
                });
                self.record(TieredKvEvent::removed(Tier::Disk, dropped));
            }
        }
    }

    fn check_range(&self, block: BlockId) -> Result<(), BlockPoolError> {
        if (block.0 as usize) < self.blocks.len() {
            Ok(())
        } else {
            Err(BlockPoolError::OutOfRange {
                block,
                num_blocks: self.blocks.len(),
            })
        }
    }

    /// Every block must hold as many references as it appears in `blocks`.
    fn check_can_free(&self, blocks: &[BlockId]) -> Result<(), BlockPoolError> {
        for &b in blocks {
            self.check_range(b)?;
        }
        let mut sorted = blocks.to_vec();
        sorted.sort_unstable();
        for run in sorted.chunk_by(|a, b| a == b) {
            if (self.blocks[run[0].0 as usize].ref_count as usize) < run.len() {
                return Err(BlockPoolError::NotReferenced { block: run[0] });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u64) -> SequenceHash {
        SequenceHash(n)
    }

    #[test]
    fn allocate_is_all_or_nothing() {
        let mut pool = BlockPool::new(4, 16);
        assert!(pool.allocate(5).is_none());
        assert_eq!(pool.num_free(), 4);
        let got = pool.allocate(3).unwrap();
        assert_eq!(got, vec![BlockId(0), BlockId(1), BlockId(2)]);
        assert_eq!((pool.num_free(), pool.num_used()), (1, 3));
        assert_eq!(pool.usage(), 0.75);
    }

    #[test]
    fn double_free_is_an_error_and_changes_nothing() {
        let mut pool = BlockPool::new(2, 16);
        let b = pool.allocate(1).unwrap();
        pool.free(&b).unwrap();
        assert_eq!(
            pool.free(&b),
            Err(BlockPoolError::NotReferenced { block: b[0] })
        );
        let c = pool.allocate(1).unwrap();
        assert_eq!(
            pool.free(&[c[0], c[0]]),
            Err(BlockPoolError::NotReferenced { block: c[0] })
        );
        assert_eq!(pool.ref_count(c[0]), 1);
        assert!(matches!(
            pool.free(&[BlockId(9)]),
            Err(BlockPoolError::OutOfRange { .. })
        ));
    }

    #[test]
    fn freed_cached_blocks_stay_hits_until_reallocated() {
        let mut pool = BlockPool::new(3, 16);
        pool.set_record_events(true);
        let b = pool.allocate(2).unwrap();
        assert_eq!(pool.cache_full_block(b[0], h(1)), Ok(true));
        assert_eq!(pool.cache_full_block(b[1], h(2)), Ok(true));
        pool.free(&b).unwrap();
        assert_eq!(pool.lookup_prefix(&[h(1), h(2), h(3)]), b);

        // The uncached block goes first, so the hits survive one allocation.
        let c = pool.allocate(1).unwrap();
        assert_eq!(c, vec![BlockId(2)]);
        assert_eq!(pool.lookup_prefix(&[h(1), h(2)]).len(), 2);

        // Freed back to front: the tail (hash 2) is evicted before the head.
        let d = pool.allocate(1).unwrap();
        assert_eq!(d, vec![b[1]]);
        assert_eq!(pool.lookup_prefix(&[h(1), h(2)]), vec![b[0]]);
        assert_eq!(
            pool.drain_events(),
            vec![
                TieredKvEvent::stored(Tier::Device, h(1)),
                TieredKvEvent::stored(Tier::Device, h(2)),
                TieredKvEvent::removed(Tier::Device, h(2))
            ]
        );
    }

    #[test]
    fn events_are_recorded_only_when_asked() {
        let mut pool = BlockPool::new(2, 16);
        let b = pool.allocate(2).unwrap();
        pool.cache_full_block(b[0], h(1)).unwrap();
        assert!(pool.drain_events().is_empty());
        pool.set_record_events(true);
        pool.cache_full_block(b[1], h(2)).unwrap();
        assert_eq!(
            pool.drain_events(),
            vec![TieredKvEvent::stored(Tier::Device, h(2))]
        );
        let mut snapshot: Vec<_> = pool.cached_hashes().collect();
        snapshot.sort();
        assert_eq!(snapshot, vec![h(1), h(2)]);
        // Drained into a buffer: its old contents go, and the next drain starts empty.
        pool.free(&b).unwrap();
        pool.allocate(1).unwrap();
        let mut out = vec![TieredKvEvent::stored(Tier::Host, h(9))];
        pool.drain_events_into(&mut out);
        assert_eq!(out, vec![TieredKvEvent::removed(Tier::Device, h(2))]);
        pool.drain_events_into(&mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn take_revives_a_free_cached_block() {
        let mut pool = BlockPool::new(2, 16);
        let b = pool.allocate(1).unwrap();
        pool.cache_full_block(b[0], h(7)).unwrap();
        pool.free(&b).unwrap();
        assert_eq!(pool.num_free(), 2);
        pool.take(&b).unwrap();
        assert_eq!((pool.num_free(), pool.ref_count(b[0])), (1, 1));
        // The revived block is no longer evictable.
        assert_eq!(pool.allocate(1).unwrap(), vec![BlockId(1)]);
        assert!(pool.allocate(1).is_none());
        assert_eq!(pool.lookup_prefix(&[h(7)]), b);
    }

    #[test]
    fn a_hash_is_cached_once_and_a_block_has_one_hash() {
        let mut pool = BlockPool::new(2, 16);
        let b = pool.allocate(2).unwrap();
        assert_eq!(pool.cache_full_block(b[0], h(1)), Ok(true));
        assert_eq!(pool.cache_full_block(b[0], h(1)), Ok(false));
        assert_eq!(pool.cache_full_block(b[1], h(1)), Ok(false));
        assert_eq!(pool.cached_hash(b[1]), None);
        assert_eq!(
            pool.cache_full_block(b[0], h(2)),
            Err(BlockPoolError::AlreadyCached { block: b[0] })
        );
        pool.free(&b).unwrap();
        assert_eq!(
            pool.cache_full_block(b[0], h(1)),
            Err(BlockPoolError::NotReferenced { block: b[0] })
        );
    }

    #[test]
    fn evicted_hits_move_down_the_tiers_and_come_back() {
        use TierMove::*;
        let mut pool = BlockPool::new(2, 16).with_tiers(1, 1, []);
        pool.set_record_events(true);
        let b = pool.allocate(2).unwrap();
        pool.cache_full_block(b[0], h(1)).unwrap();
        pool.cache_full_block(b[1], h(2)).unwrap();
        pool.free(&b).unwrap();
        pool.drain_events();
        // Evicting 2 then 1 (least recently freed first): 2 goes to host, then on to disk
        // when 1 takes the host's one slot.
        let c = pool.allocate(2).unwrap();
        assert_eq!(
            pool.drain_tier_moves(),
            vec![
                Offload {
                    hash: h(2),
                    block: b[1]
                },
                Offload {
                    hash: h(1),
                    block: b[0]
                },
                Demote { hash: h(2) },
            ]
        );
        let (dev, host, disk) = (Tier::Device, Tier::Host, Tier::Disk);
        assert_eq!(
            pool.drain_events(),
            vec![
                TieredKvEvent::removed(dev, h(2)),
                TieredKvEvent::stored(host, h(2)),
                TieredKvEvent::removed(dev, h(1)),
                TieredKvEvent::stored(host, h(1)),
                TieredKvEvent::removed(host, h(2)),
                TieredKvEvent::stored(disk, h(2)),
            ]
        );
        assert_eq!(pool.lookup_lower(&[h(1), h(2), h(3)]), vec![host, disk]);
        assert_eq!((pool.num_host_cached(), pool.num_disk_cached()), (1, 1));
        assert_eq!(pool.cached_hashes().count(), 2);
        // Promotion: out of its tier, cached in the pool again.
        assert_eq!(pool.take_lower(&[h(1), h(2)]), vec![host, disk]);
        pool.promote(h(1), c[0], host);
        pool.promote(h(2), c[1], disk);
        assert_eq!(
            pool.drain_tier_moves(),
            vec![
                Promote {
                    hash: h(1),
                    block: c[0],
                    from: host
                },
                Promote {
                    hash: h(2),
                    block: c[1],
                    from: disk
                },
            ]
        );
        assert_eq!(pool.lookup_prefix(&[h(1), h(2)]), c);
        assert_eq!((pool.num_host_cached(), pool.num_disk_cached()), (0, 0));
        assert_eq!((pool.num_promoted(host), pool.num_promoted(disk)), (1, 1));
        // Recomputing a hash a lower tier holds drops that copy.
        pool.free(&c).unwrap();
        pool.allocate(1).unwrap();
        assert_eq!(
            pool.drain_tier_moves(),
            vec![Offload {
                hash: h(2),
                block: c[1]
            }]
        );
        let d = pool.allocate(1).unwrap();
        pool.drain_tier_moves();
        pool.cache_full_block(d[0], h(2)).unwrap();
        assert_eq!(
            pool.drain_tier_moves(),
            vec![Drop {
                hash: h(2),
                tier: disk
            }]
        );
    }

    #[test]
    fn a_restarted_disk_tier_is_announced_and_bounded() {
        let mut pool = BlockPool::new(2, 16).with_tiers(0, 2, [h(7), h(8), h(9)]);
        assert_eq!(
            pool.drain_tier_moves(),
            vec![TierMove::Drop {
                hash: h(7),
                tier: Tier::Disk
            }]
        );
        pool.set_record_events(true);
        let mut announced = pool.drain_events();
        announced.sort_by_key(|e| e.hash().0);
        assert_eq!(
            announced,
            vec![
                TieredKvEvent::stored(Tier::Disk, h(8)),
                TieredKvEvent::stored(Tier::Disk, h(9)),
            ]
        );
        assert_eq!(pool.lookup_lower(&[h(8), h(9)]).len(), 2);
    }
}
