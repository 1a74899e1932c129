//! One sequence's scheduling state: its tokens, how many of them have KV in its blocks, and
//! the chained hashes of its full blocks (its prefix-cache identity).

use crate::runner::{BlockTable, ChunkTokens};
use kvmesh_common::{BlockHasher, BlockId, SequenceHash, TokenId};
use std::sync::Arc;

/// Marks a sequence whose prompt KV comes from another node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct RemotePrefill;

#[derive(Debug)]
pub(super) struct Sequence {
    /// Distinguishes this sequence from an earlier one with the same id, so a step that was
    /// in flight when the earlier one finished cannot touch this one.
    pub(super) generation: u64,
    /// The prompt, shared with the caller: prompts run to tens of thousands of tokens, and a
    /// simulated mesh holds the same prompt on a prefill and a decode node at once.
    pub(super) prompt: Arc<[TokenId]>,
    /// Every token generated after the prompt (or delivered before a migration).
    pub(super) output: Vec<TokenId>,
    /// Leading tokens whose KV is in `blocks`.
    pub(super) num_computed: usize,
    pub(super) blocks: BlockTable,
    /// Hashes of the full blocks of `tokens`, kept current when prefix caching is on.
    pub(super) hashes: Vec<SequenceHash>,
    /// Leading blocks already in the pool's prefix cache (hits or registered by us).
    pub(super) num_cached_blocks: usize,
    /// Set once admitted, so a re-admission after preemption is reported as a resume.
    pub(super) admitted_before: bool,
    /// `Some` while the prompt's KV is to come from another node (queued or awaiting it).
    pub(super) remote: Option<RemotePrefill>,
}

impl Sequence {
    pub(super) fn new(generation: u64, prompt: Arc<[TokenId]>) -> Self {
        Sequence {
            generation,
            prompt,
            output: Vec::new(),
            num_computed: 0,
            blocks: BlockTable::default(),
            hashes: Vec::new(),
            num_cached_blocks: 0,
            admitted_before: false,
            remote: None,
        }
    }

    /// Prompt and output tokens.
    pub(super) fn len(&self) -> usize {
        self.prompt.len() + self.output.len()
    }

    pub(super) fn num_uncomputed(&self) -> usize {
        self.len() - self.num_computed
    }

    /// Tokens `range` of prompt-then-output: the prompt's shared, a single token in place,
    /// others copied out.
    pub(super) fn tokens(&self, range: std::ops::Range<usize>) -> ChunkTokens {
        let p = self.prompt.len();
        if range.end <= p {
            return ChunkTokens::shared(&self.prompt, range);
        }
        if range.len() == 1 {
            return ChunkTokens::one(self.output[range.start - p]);
        }
        if range.start >= p {
            return self.output[range.start - p..range.end - p].to_vec().into();
        }
        let mut out = Vec::with_capacity(range.len());
        out.extend_from_slice(&self.prompt[range.start..]);
        out.extend_from_slice(&self.output[..range.end - p]);
        out.into()
    }

    /// Hashes every full block of `tokens` not hashed yet.
    pub(super) fn extend_hashes(&mut self, hasher: &BlockHasher) {
        let bs = hasher.block_size;
        while (self.hashes.len() + 1) * bs <= self.len() {
            let i = self.hashes.len();
            let range = i * bs..(i + 1) * bs;
            // Within the prompt or the output, hash in place; a block across both is copied.
            let p = self.prompt.len();
            let block = if range.end <= p {
                hasher.block_hash(&self.prompt[range])
            } else if range.start >= p {
                hasher.block_hash(&self.output[range.start - p..range.end - p])
            } else {
                hasher.block_hash(&self.tokens(range))
            };
            self.hashes
                .push(hasher.chain(self.hashes.last().copied(), block));
        }
    }
}

/// `head`'s blocks then `tail`'s, as one table (a table is shared, so it grows by a new one).
pub(super) fn joined(head: &[BlockId], tail: &[BlockId]) -> BlockTable {
    head.iter().chain(tail).copied().collect()
}

/// Blocks needed to hold `num_tokens` tokens.
pub(super) fn blocks_for(num_tokens: usize, block_size: usize) -> usize {
    num_tokens.div_ceil(block_size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_common::ModelFingerprint;

    #[test]
    fn incremental_hashes_match_the_shared_hasher() {
        let hasher = BlockHasher::new(ModelFingerprint(3), 4);
        let mut seq = Sequence::new(0, (0..6).collect());
        seq.extend_hashes(&hasher);
        assert_eq!(seq.hashes.len(), 1);
        // The second block spans prompt and output; the third is all output.
        seq.output.extend([6, 7, 8, 9, 10, 11, 12]);
        seq.extend_hashes(&hasher);
        assert_eq!(seq.hashes, hasher.sequence_hashes(&seq.tokens(0..13)));
        assert_eq!(seq.hashes.len(), 3);
        assert_eq!(seq.tokens(4..8), [4, 5, 6, 7]);
    }
}
