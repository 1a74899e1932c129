//! An intrusive doubly-linked list of free blocks: O(1) push to the back, pop from the front
//! and removal from the middle (a prefix hit revives a block wherever it sits in LRU order).
//! The links live in the blocks' own metadata, so the list allocates nothing.

use super::BlockMeta;

/// "No block": the end of a list.
pub(super) const NIL: u32 = u32::MAX;

/// A block's neighbours in the free list it is on (meaningless while it is in use).
#[derive(Clone, Copy, Debug)]
pub(super) struct Links {
    prev: u32,
    next: u32,
}

impl Default for Links {
    fn default() -> Self {
        Links {
            prev: NIL,
            next: NIL,
        }
    }
}

#[derive(Debug)]
pub(super) struct FreeList {
    head: u32,
    tail: u32,
    len: usize,
}

impl Default for FreeList {
    fn default() -> Self {
        FreeList {
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }
}

impl FreeList {
    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn push_back(&mut self, blocks: &mut [BlockMeta], id: u32) {
        blocks[id as usize].links = Links {
            prev: self.tail,
            next: NIL,
        };
        match self.tail {
            NIL => self.head = id,
            tail => blocks[tail as usize].links.next = id,
        }
        self.tail = id;
        self.len += 1;
    }

    pub(super) fn pop_front(&mut self, blocks: &mut [BlockMeta]) -> Option<u32> {
        let id = self.head;
        if id == NIL {
            return None;
        }
        self.remove(blocks, id);
        Some(id)
    }

    /// Unlinks `id`, which must be on this list.
    pub(super) fn remove(&mut self, blocks: &mut [BlockMeta], id: u32) {
        let Links { prev, next } = blocks[id as usize].links;
        match prev {
            NIL => self.head = next,
            p => blocks[p as usize].links.next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => blocks[n as usize].links.prev = prev,
        }
        blocks[id as usize].links = Links::default();
        self.len -= 1;
    }
}
