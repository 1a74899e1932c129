//! Undoing admissions whose cached KV turned out unusable: a block promoted from a lower
//! tier whose copy could not be read back (a corrupt or vanished disk file) holds no valid
//! KV, so it must stop being a prefix hit and the sequences that took it must recompute.

use super::Scheduler;
use crate::runner::SeqId;
use kvmesh_common::BlockId;

impl Scheduler {
    /// Forgets `blocks` as prefix-cache entries and sends every admitted sequence holding one
    /// of them back to the head of the queue (as a preemption: blocks freed, to recompute).
    /// Call between `schedule` and `abort_step` of the plan that promoted them. Returns the
    /// sequences sent back.
    pub fn discard_blocks(&mut self, blocks: &[BlockId]) -> Vec<SeqId> {
        for &b in blocks {
            self.pool.uncache(b);
        }
        let holders: Vec<SeqId> = self
            .running
            .iter()
            .chain(&self.awaiting_kv)
            .copied()
            .filter(|id| self.seqs[id].blocks.iter().any(|b| blocks.contains(b)))
            .collect();
        for &id in &holders {
            self.running.retain(|&r| r != id);
            self.awaiting_kv.retain(|&r| r != id);
            self.preempt(id);
        }
        holders
    }
}
