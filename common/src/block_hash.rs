//! Prefix identity of KV blocks.
//!
//! `block_hash = xxh3(token ids of one full block)` and
//! `seq_hash[i] = xxh3(seq_hash[i-1] || block_hash[i])`, where `seq_hash[-1]` is the model
//! fingerprint, so two models (or tokenizers) never share hashes. Only full blocks are hashed.
//! This is the one implementation: router, engine and kvstore all call it.

use crate::ids::{BlockHash, SequenceHash, TokenId};
use std::borrow::Cow;
use std::sync::Arc;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Fixed seed so hashes are stable across processes and releases.
const HASH_SEED: u64 = 0x6b76_6d65_7368_0001; // "kvmesh" v1

/// Identifies a model + tokenizer pair; the root of every prefix hash chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct ModelFingerprint(pub u64);

impl ModelFingerprint {
    /// Fingerprint from any bytes that identify the model (e.g. its file's sha256).
    pub fn from_bytes(bytes: &[u8]) -> Self {
        ModelFingerprint(xxh3_64_with_seed(bytes, HASH_SEED))
    }
}

/// Computes chained block hashes for one model and block size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockHasher {
    pub fingerprint: ModelFingerprint,
    pub block_size: usize,
}

impl BlockHasher {
    pub fn new(fingerprint: ModelFingerprint, block_size: usize) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        BlockHasher {
            fingerprint,
            block_size,
        }
    }

    /// Hash of one block's token ids, independent of what came before.
    pub fn block_hash(&self, tokens: &[TokenId]) -> BlockHash {
        BlockHash(xxh3_64_with_seed(&le_bytes(tokens), HASH_SEED))
    }

    /// Chains `block` onto the prefix identified by `parent` (`None` = start of sequence).
    pub fn chain(&self, parent: Option<SequenceHash>, block: BlockHash) -> SequenceHash {
        let parent = parent.map_or(self.fingerprint.0, |p| p.0);
        let mut buf = [0u8; 16];
        buf[..8].copy_from_slice(&parent.to_le_bytes());
        buf[8..].copy_from_slice(&block.0.to_le_bytes());
        SequenceHash(xxh3_64(&buf))
    }

    /// Sequence hashes of every full block of `tokens`, in order.
    pub fn sequence_hashes(&self, tokens: &[TokenId]) -> Vec<SequenceHash> {
        self.extend_sequence_hashes(&[], tokens)
    }

    /// Extends `known` (hashes of the first `known.len()` full blocks of `tokens`) to cover
    /// every full block of `tokens`; incremental hashing as a sequence grows.
    pub fn extend_sequence_hashes(
        &self,
        known: &[SequenceHash],
        tokens: &[TokenId],
    ) -> Vec<SequenceHash> {
        let full = tokens.len() / self.block_size;
        let mut out = Vec::with_capacity(full.max(known.len()));
        out.extend_from_slice(known);
        let mut parent = known.last().copied();
        for i in known.len()..full {
            let block = &tokens[i * self.block_size..(i + 1) * self.block_size];
            let h = self.chain(parent, self.block_hash(block));
            out.push(h);
            parent = Some(h);
        }
        out
    }
}

/// A prompt's block hashes with the hasher that made them: a caller that hashes a prompt once
/// hands them to each component that would hash it again (the router, the engines), and each
/// takes them only if its own hasher would have made them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptHashes {
    hasher: BlockHasher,
    hashes: Arc<[SequenceHash]>,
}

impl PromptHashes {
    /// The hashes of every full block of `prompt`.
    pub fn new(hasher: BlockHasher, prompt: &[TokenId]) -> Self {
        PromptHashes {
            hasher,
            hashes: hasher.sequence_hashes(prompt).into(),
        }
    }

    /// The hashes of a prompt whose full blocks hash to `blocks` (each `hasher.block_hash`
    /// of its block, in order), chained here: a caller that knows some of a prompt's block
    /// hashes already (from another prompt with the same blocks) hashes only the others.
    pub fn from_blocks(hasher: BlockHasher, blocks: impl IntoIterator<Item = BlockHash>) -> Self {
        let mut parent = None;
        let hashes = blocks
            .into_iter()
            .map(|block| {
                let h = hasher.chain(parent, block);
                parent = Some(h);
                h
            })
            .collect();
        PromptHashes { hasher, hashes }
    }

    /// The hashes, when `hasher` is the one that made them; `None` otherwise.
    pub fn made_by(&self, hasher: &BlockHasher) -> Option<&[SequenceHash]> {
        (self.hasher == *hasher).then_some(&self.hashes[..])
    }
}

/// `tokens` as the little-endian bytes hashed: on a little-endian machine the tokens' own
/// memory, read in place (a block is hashed wherever a prompt is looked up or cached, and a
/// copy cost more than the hash).
#[cfg(target_endian = "little")]
fn le_bytes(tokens: &[TokenId]) -> Cow<'_, [u8]> {
    Cow::Borrowed(bytemuck::cast_slice(tokens))
}

#[cfg(not(target_endian = "little"))]
fn le_bytes(tokens: &[TokenId]) -> Cow<'_, [u8]> {
    Cow::Owned(tokens.iter().flat_map(|t| t.to_le_bytes()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hasher() -> BlockHasher {
        BlockHasher::new(ModelFingerprint(7), 4)
    }

    #[test]
    fn prompt_hashes_from_block_hashes_are_the_prompts() {
        let prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9];
        let blocks = prompt.chunks_exact(4).map(|b| hasher().block_hash(b));
        let made = PromptHashes::from_blocks(hasher(), blocks);
        assert_eq!(made, PromptHashes::new(hasher(), &prompt));
        assert_eq!(made.made_by(&hasher()).map(<[_]>::len), Some(2));
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        assert_eq!(hasher().sequence_hashes(&[1, 2, 3]).len(), 0);
        assert_eq!(hasher().sequence_hashes(&[1, 2, 3, 4, 5]).len(), 1);
    }

    #[test]
    fn fingerprint_separates_models() {
        let other = BlockHasher::new(ModelFingerprint(8), 4);
        assert_ne!(
            hasher().sequence_hashes(&[1, 2, 3, 4]),
            other.sequence_hashes(&[1, 2, 3, 4])
        );
    }

    #[test]
    fn same_block_after_different_prefix_differs() {
        let a = hasher().sequence_hashes(&[1, 1, 1, 1, 9, 9, 9, 9]);
        let b = hasher().sequence_hashes(&[2, 2, 2, 2, 9, 9, 9, 9]);
        assert_ne!(a[1], b[1]);
    }

    #[test]
    fn block_hashes_are_the_little_endian_bytes_hashed() {
        // The bytes hashed in place are the ones the first version copied out.
        for len in [0, 1, 16, 1024] {
            let tokens: Vec<TokenId> = (0..len)
                .map(|i: u32| i.wrapping_mul(2_654_435_761))
                .collect();
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            let expected = BlockHash(xxh3_64_with_seed(&bytes, HASH_SEED));
            assert_eq!(hasher().block_hash(&tokens), expected, "{len} tokens");
        }
    }

    #[test]
    fn prompt_hashes_serve_only_their_own_hasher() {
        let prompt: Vec<TokenId> = (0..10).collect();
        let hashed = PromptHashes::new(hasher(), &prompt);
        assert_eq!(
            hashed.made_by(&hasher()),
            Some(&hasher().sequence_hashes(&prompt)[..])
        );
        assert_eq!(
            hashed.made_by(&BlockHasher::new(ModelFingerprint(7), 8)),
            None
        );
        assert_eq!(
            hashed.made_by(&BlockHasher::new(ModelFingerprint(8), 4)),
            None
        );
    }

    proptest! {
        #[test]
        fn incremental_equals_whole(tokens in proptest::collection::vec(0u32..50_000, 0..64), cut in 0usize..64) {
            let h = hasher();
            let cut = cut.min(tokens.len());
            let prefix = h.sequence_hashes(&tokens[..cut]);
            prop_assert_eq!(h.extend_sequence_hashes(&prefix, &tokens), h.sequence_hashes(&tokens));
        }

        #[test]
        fn shared_prefix_shares_hashes(a in proptest::collection::vec(0u32..100, 8..32), b in proptest::collection::vec(0u32..100, 0..32)) {
            let h = hasher();
            let mut ab = a.clone();
            ab.extend(&b);
            let ha = h.sequence_hashes(&a);
            prop_assert_eq!(&h.sequence_hashes(&ab)[..ha.len()], &ha[..]);
        }
    }
}
