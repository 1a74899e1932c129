//! The bytes of the host-memory tier: the KV of prefix-cache blocks the pool evicted, by
//! hash, in the transfer layout (every layer of one block). The pool decides what moves
//! ([`TierMove`]); this carries the moves out against the runner's KV cache.

use crate::block_pool::TierMove;
use crate::runner::{ModelRunner, RunnerError};
use kvmesh_common::SequenceHash;
use std::collections::HashMap;

#[derive(Debug, Default)]
pub struct HostKv {
    blocks: HashMap<SequenceHash, Vec<u8>>,
}

impl HostKv {
    /// Blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Carries out `moves` in order. Call before the runner reuses an offloaded block.
    pub fn apply(
        &mut self,
        moves: Vec<TierMove>,
        runner: &mut impl ModelRunner,
    ) -> Result<(), RunnerError> {
        let layers = runner.kv_shape().num_layers;
        for m in moves {
            match m {
                TierMove::Offload { hash, block } => {
                    let mut bytes = Vec::new();
                    for layer in 0..layers {
                        runner.read_kv_blocks(layer, &[block], &mut bytes)?;
                    }
                    self.blocks.insert(hash, bytes);
                }
                TierMove::Promote { hash, block } => {
                    // The pool promotes only what it offloaded; were the bytes missing, the
                    // write's size check fails the step rather than using stale KV.
                    let bytes = self.blocks.remove(&hash).unwrap_or_default();
                    runner.write_kv_blocks(0..layers, &[block], &bytes)?;
                }
                TierMove::Drop { hash } => {
                    self.blocks.remove(&hash);
                }
            }
        }
        Ok(())
    }
}
