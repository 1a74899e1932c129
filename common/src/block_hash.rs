//! Prefix identity of KV blocks.
//!
//! `block_hash = xxh3(token ids of one full block)` and
//! `seq_hash[i] = xxh3(seq_hash[i-1] || block_hash[i])`, where `seq_hash[-1]` is the model
//! fingerprint, so two models (or tokenizers) never share hashes. Only full blocks are hashed.
//! This is the one implementation: router, engine and kvstore all call it.

use crate::ids::{BlockHash, SequenceHash, TokenId};
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
#[derive(Clone, Copy, Debug)]
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
        BlockHash(xxh3_64_with_seed(
            bytemuck_tokens(tokens).as_slice(),
            HASH_SEED,
        ))
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
        let mut out = known.to_vec();
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

fn bytemuck_tokens(tokens: &[TokenId]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hasher() -> BlockHasher {
        BlockHasher::new(ModelFingerprint(7), 4)
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
