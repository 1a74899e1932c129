//! Prefix blocks pulled from another node: the pool side of a pull.
//!
//! `reserve_import` takes fresh blocks for the prompt blocks after this pool's own prefix
//! hits (pinning those hits, so the reservation cannot evict them); the driver has the holder
//! write their KV into them (`write_kv_blocks`), then `finish_import` registers the blocks
//! that arrived whole as prefix-cache entries and lets everything go. The request that asked
//! for the pull is added afterwards and finds them as ordinary hits. Until `finish_import`,
//! the reserved blocks carry no hash, so nothing reads partial KV.

use super::Scheduler;
use kvmesh_common::{BlockId, SequenceHash, TokenId};

/// Blocks reserved for pulled KV: the block of hash `hashes[i]` goes into `blocks[i]` (the
/// prompt's blocks after this pool's own hits, in order).
#[derive(Debug, PartialEq, Eq)]
#[must_use = "an import holds blocks until `finish_import`"]
pub struct Import {
    pub hashes: Vec<SequenceHash>,
    pub blocks: Vec<BlockId>,
    /// This pool's own hits in front of the import, held so the reservation cannot evict them.
    pinned: Vec<BlockId>,
}

impl Scheduler {
    /// Reserves blocks to pull `prompt`'s blocks from after this pool's cached prefix up to
    /// block `upto` (at most as many as admission would use, leaving one token to compute),
    /// if `worth(n)` says pulling those `n` blocks is worth it. `None` when it is not, when
    /// that leaves nothing to pull, prefix caching is off, or too few blocks are free (a pull
    /// must never cost a running sequence its room to grow).
    pub fn reserve_import(
        &mut self,
        prompt: &[TokenId],
        upto: usize,
        worth: impl FnOnce(usize) -> bool,
    ) -> Option<Import> {
        if !self.config.enable_prefix_caching || prompt.is_empty() {
            return None;
        }
        let hashes = self.config.hasher.sequence_hashes(prompt);
        let (hits, lower) = self.cached_prefix(&hashes, prompt.len());
        let first = hits.len() + lower;
        let end = upto.min((prompt.len() - 1) / self.config.block_size);
        if end <= first || !worth(end - first) {
            return None;
        }
        // Leave every admitted sequence a block to grow into, or the next step would
        // preempt one of them to make room for a cache fill.
        let headroom = self.running.len() + self.awaiting_kv.len();
        if self.pool.num_free() < end - first + headroom + self.revived(&hits) {
            return None;
        }
        self.pool.take(&hits).expect("hits are pool blocks");
        let blocks = self.pool.allocate(end - first).expect("checked num_free");
        Some(Import {
            hashes: hashes[first..end].to_vec(),
            blocks,
            pinned: hits,
        })
    }

    /// Ends `import`: its first `arrived` blocks hold their KV and become prefix-cache entries
    /// (announced like computed ones); every reserved and pinned block is released.
    pub fn finish_import(&mut self, import: Import, arrived: usize) {
        let Import {
            hashes,
            blocks,
            pinned,
        } = import;
        self.pool.prefetch(&hashes[..arrived.min(hashes.len())]);
        for (&block, &hash) in blocks.iter().zip(&hashes).take(arrived) {
            // `Ok(false)`: another block caches this hash by now; this copy just goes free.
            self.pool
                .cache_full_block(block, hash)
                .expect("reserved blocks are held and uncached");
        }
        // Tail first, so eviction takes it before the head (as `BlockPool::free` orders).
        self.pool
            .free(&blocks)
            .expect("allocated in reserve_import");
        self.pool.free(&pinned).expect("pinned in reserve_import");
    }
}
