//! A list of free blocks in the order they were freed: push to the back, pop from the front,
//! and removal from the middle (a prefix hit revives a block wherever it sits in LRU order).
//!
//! It is a queue of `(block, stamp)` entries rather than a chain through the blocks: a block's
//! stamp changes whenever it joins or leaves a list, so removal only changes the stamp and
//! leaves an entry that no longer matches, which popping skips. Popping many blocks then
//! reads the queue in order and each block independently, where a chain waits for each
//! block's link before it can load the next block (on a pool gone cold, one cache miss after
//! another), and a removal touches no neighbours.

use super::BlockMeta;
use std::collections::VecDeque;

/// Entries beyond those of listed blocks that a list keeps before it drops them.
const STALE_SLACK: usize = 64;

#[derive(Debug, Default)]
pub(super) struct FreeList {
    /// Blocks and their stamps when they joined, oldest first; an entry whose stamp is not
    /// its block's any more is stale.
    queue: VecDeque<(u32, u32)>,
    len: usize,
}

impl FreeList {
    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn push_back(&mut self, blocks: &mut [BlockMeta], id: u32) {
        let stamp = &mut blocks[id as usize].stamp;
        *stamp = stamp.wrapping_add(1);
        self.queue.push_back((id, *stamp));
        self.len += 1;
    }

    pub(super) fn pop_front(&mut self, blocks: &mut [BlockMeta]) -> Option<u32> {
        while let Some((id, stamp)) = self.queue.pop_front() {
            let meta = &mut blocks[id as usize];
            if meta.stamp == stamp {
                meta.stamp = stamp.wrapping_add(1);
                self.len -= 1;
                self.drop_stale_if_many(blocks);
                return Some(id);
            }
        }
        None
    }

    /// Starts loading the blocks of the first `n` entries (a hint: changes nothing), so that
    /// popping them does not wait for each block in turn. Stale entries among them make it
    /// load fewer live ones.
    pub(super) fn prefetch_front(&self, blocks: &[BlockMeta], n: usize) {
        for &(id, _) in self.queue.iter().take(n) {
            kvmesh_common::prefetch::prefetch(&blocks[id as usize]);
        }
    }

    /// Unlinks `id`, which must be on this list.
    pub(super) fn remove(&mut self, blocks: &mut [BlockMeta], id: u32) {
        let stamp = &mut blocks[id as usize].stamp;
        *stamp = stamp.wrapping_add(1);
        self.len -= 1;
        self.drop_stale_if_many(blocks);
    }

    /// Drops the stale entries once they outnumber the live ones (and the slack): the
    /// queue then stays within twice the list, and as each drop costs about twice the
    /// stale entries it drops, each made stale by one removal, it costs O(1) a removal.
    fn drop_stale_if_many(&mut self, blocks: &[BlockMeta]) {
        if self.queue.len() > 2 * self.len + STALE_SLACK {
            self.queue
                .retain(|&(id, stamp)| blocks[id as usize].stamp == stamp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Pushes, pops and removals of random blocks keep the order of a plain list (and
        /// prefetches change nothing).
        #[test]
        fn keeps_the_order_of_a_list(ops in prop::collection::vec((0u8..4, 0u32..48), 0..1500)) {
            let mut blocks = vec![BlockMeta::default(); 48];
            let mut list = FreeList::default();
            let mut model: Vec<u32> = Vec::new();
            for (op, id) in ops {
                match op {
                    0 if !model.contains(&id) => {
                        list.push_back(&mut blocks, id);
                        model.push(id);
                    }
                    1 => {
                        let expected = (!model.is_empty()).then(|| model.remove(0));
                        prop_assert_eq!(list.pop_front(&mut blocks), expected);
                    }
                    2 if model.contains(&id) => {
                        list.remove(&mut blocks, id);
                        model.retain(|&b| b != id);
                    }
                    3 => list.prefetch_front(&blocks, id as usize),
                    _ => {}
                }
                prop_assert_eq!(list.len(), model.len());
                prop_assert!(list.queue.len() <= 2 * model.len() + STALE_SLACK);
            }
            let mut rest = Vec::new();
            while let Some(id) = list.pop_front(&mut blocks) {
                rest.push(id);
            }
            prop_assert_eq!(rest, model);
        }
    }

    #[test]
    fn stale_entries_stay_bounded_as_the_list_empties() {
        let n = 4 * STALE_SLACK as u32;
        let mut blocks = vec![BlockMeta::default(); n as usize];
        let mut list = FreeList::default();
        for id in 0..n {
            list.push_back(&mut blocks, id);
        }
        // Stale entries at the back, then the live ones in front of them popped.
        for id in n / 2..n {
            list.remove(&mut blocks, id);
        }
        for id in 0..n / 2 {
            assert_eq!(list.pop_front(&mut blocks), Some(id));
            assert!(list.queue.len() <= 2 * list.len() + STALE_SLACK);
        }
        assert_eq!(list.pop_front(&mut blocks), None);
    }
}
