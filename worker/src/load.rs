//! A worker's live load, published by its engine thread and read by routers without locks.

use kvmesh_common::{LoadReport, StepTotals};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Where the engine thread publishes its load (the [`LoadReport`] the node reports to
/// discovery); each field is read atomically, the snapshot as a whole may mix two
/// publications. The step totals are read whole (a planner fits step times to their
/// differences, which a torn reading would skew).
#[derive(Debug, Default)]
pub struct LoadCell {
    running: AtomicUsize,
    waiting: AtomicUsize,
    kv_blocks_used: AtomicUsize,
    queued_prompt_tokens: AtomicU64,
    steps: Mutex<StepTotals>,
}

impl LoadCell {
    pub fn publish(&self, load: LoadReport) {
        self.running.store(load.running, Ordering::Relaxed);
        self.waiting.store(load.waiting, Ordering::Relaxed);
        self.kv_blocks_used
            .store(load.kv_blocks_used, Ordering::Relaxed);
        self.queued_prompt_tokens
            .store(load.queued_prompt_tokens, Ordering::Relaxed);
        *self.steps.lock().unwrap_or_else(|e| e.into_inner()) = load.steps;
    }

    pub fn get(&self) -> LoadReport {
        LoadReport {
            running: self.running.load(Ordering::Relaxed),
            waiting: self.waiting.load(Ordering::Relaxed),
            kv_blocks_used: self.kv_blocks_used.load(Ordering::Relaxed),
            queued_prompt_tokens: self.queued_prompt_tokens.load(Ordering::Relaxed),
            steps: *self.steps.lock().unwrap_or_else(|e| e.into_inner()),
        }
    }
}

/// A bounded count of requests admitted to a worker's queue, shared by its handles (which
/// take slots) and its thread (which gives them back).
#[derive(Debug)]
pub struct QueueSlots {
    used: AtomicUsize,
    capacity: usize,
}

impl QueueSlots {
    pub fn new(capacity: usize) -> Self {
        QueueSlots {
            used: AtomicUsize::new(0),
            capacity,
        }
    }

    /// Takes a slot; false when all are taken.
    pub fn try_take(&self) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.capacity).then_some(n + 1)
            })
            .is_ok()
    }

    pub fn give_back(&self) {
        let prev = self.used.fetch_sub(1, Ordering::AcqRel);
        debug_assert!(prev > 0, "a queue slot was given back twice");
    }

    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_bounded() {
        let q = QueueSlots::new(2);
        assert!(q.try_take() && q.try_take());
        assert!(!q.try_take());
        q.give_back();
        assert!(q.try_take());
        assert_eq!(q.used(), 2);
    }
}
