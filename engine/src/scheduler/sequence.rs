//! One sequence's scheduling state: its tokens, how many of them have KV in its blocks, and
//! the chained hashes of its full blocks (its prefix-cache identity).

use kvmesh_common::{BlockHasher, BlockId, SequenceHash, TokenId};

/// Marks a sequence whose prompt KV comes from another node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct RemotePrefill;

#[derive(Debug)]
pub(super) struct Sequence {
    /// Distinguishes this sequence from an earlier one with the same id, so a step that was
    /// in flight when the earlier one finished cannot touch this one.
    pub(super) generation: u64,
    /// Prompt followed by every generated token.
    pub(super) tokens: Vec<TokenId>,
    pub(super) num_prompt_tokens: usize,
    /// Leading tokens whose KV is in `blocks`.
    pub(super) num_computed: usize,
    pub(super) blocks: Vec<BlockId>,
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
    pub(super) fn new(generation: u64, prompt: Vec<TokenId>) -> Self {
        Sequence {
            generation,
            num_prompt_tokens: prompt.len(),
            tokens: prompt,
            num_computed: 0,
            blocks: Vec::new(),
            hashes: Vec::new(),
            num_cached_blocks: 0,
            admitted_before: false,
            remote: None,
        }
    }

    pub(super) fn num_uncomputed(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    /// Hashes every full block of `tokens` not hashed yet.
    pub(super) fn extend_hashes(&mut self, hasher: &BlockHasher) {
        let bs = hasher.block_size;
        while (self.hashes.len() + 1) * bs <= self.tokens.len() {
            let i = self.hashes.len();
            let block = hasher.block_hash(&self.tokens[i * bs..(i + 1) * bs]);
            self.hashes
                .push(hasher.chain(self.hashes.last().copied(), block));
        }
    }
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
        seq.tokens.extend([6, 7, 8, 9, 10]);
        seq.extend_hashes(&hasher);
        assert_eq!(seq.hashes, hasher.sequence_hashes(&seq.tokens));
    }
}
