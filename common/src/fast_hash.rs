//! Hash maps keyed by one `u64` that the process does not take from clients as is: sequence
//! hashes (already xxh3 outputs), node ids, sequence ids. The standard library's SipHash
//! resists collision attacks these keys do not need resisting, and costs more than the rest
//! of a prefix-cache probe; one multiply spreads small numbers over hashbrown's top bits.
//! The prefix index, the engine's block pool and its scheduler all use this one definition.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// For keys that are one u64 (or a newtype of one). Iteration order is deterministic (no
/// random seed), but nothing should depend on it.
#[derive(Clone, Copy, Debug, Default)]
pub struct U64Hasher(u64);

impl Hasher for U64Hasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// The [`BuildHasher`](std::hash::BuildHasher) of [`U64Map`] and [`U64Set`].
pub type BuildU64Hasher = BuildHasherDefault<U64Hasher>;

/// A map keyed by a `u64` or a newtype of one (see the module docs).
pub type U64Map<K, V> = HashMap<K, V, BuildU64Hasher>;

/// A set of `u64`s or newtypes of one (see the module docs).
pub type U64Set<K> = HashSet<K, BuildU64Hasher>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SequenceHash;

    #[test]
    fn newtype_keys_hash_as_their_u64() {
        let mut m: U64Map<SequenceHash, u32> = U64Map::default();
        for i in 0..1000u64 {
            m.insert(
                SequenceHash(i.wrapping_mul(0x1234_5678_9abc_def1)),
                i as u32,
            );
        }
        assert_eq!(m.len(), 1000);
        assert_eq!(m[&SequenceHash(0x1234_5678_9abc_def1)], 1);
        let s: U64Set<u64> = (0..10).collect();
        assert!(s.contains(&9) && !s.contains(&10));
    }
}
