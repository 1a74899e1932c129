//! The pinned host buffer KV leaves the device through. A read of `n` blocks of one layer is
//! packed on the device into the transfer layout and copied in one piece into the start of
//! this buffer, so block `i`'s K and V land where the transport expects them (see
//! `runner::KvSource`); the buffer grows to the largest read and is reused, since pinning
//! memory costs far more than copying through it.

use std::ops::Range;

/// The smallest staging buffer: a few blocks of a small model.
pub const MIN_STAGING_BYTES: usize = 1 << 20;

/// The staging layout of one layer's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagingLayout {
    /// Bytes of K (and of V) of one block in one layer: f16 `[n_kv_heads, block_size,
    /// head_dim]`.
    pub half_block_bytes: usize,
}

impl StagingLayout {
    /// Bytes a read of `n_blocks` blocks fills.
    pub fn bytes(&self, n_blocks: usize) -> usize {
        2 * self.half_block_bytes * n_blocks
    }

    /// Where the `i`-th block of a read puts its K and its V.
    pub fn block(&self, i: usize) -> (Range<usize>, Range<usize>) {
        let k = 2 * i * self.half_block_bytes;
        let v = k + self.half_block_bytes;
        (k..v, v..v + self.half_block_bytes)
    }
}

/// The capacity to give a staging buffer of `current` bytes that must hold `needed`: kept
/// when it is enough, otherwise the next power of two (at least [`MIN_STAGING_BYTES`]), so
/// a node re-pins only a handful of times over its life.
pub fn staging_capacity(current: usize, needed: usize) -> usize {
    if needed <= current {
        current
    } else {
        needed.next_power_of_two().max(MIN_STAGING_BYTES)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::KvCache;
    use crate::runner::{KvShape, KvSource};
    use half::f16;
    use kvmesh_common::BlockId;

    #[test]
    fn the_layout_is_the_transfer_layout() {
        let shape = KvShape {
            num_layers: 2,
            num_kv_heads: 3,
            head_dim: 4,
            block_size: 2,
            num_blocks: 5,
        };
        let mut cache = KvCache::new(shape);
        let elems = cache.block_elems();
        for layer in 0..2 {
            for (i, (k, v)) in cache.k[layer]
                .iter_mut()
                .zip(&mut cache.v[layer])
                .enumerate()
            {
                *k = f16::from_f32((layer * 1000 + i) as f32);
                *v = f16::from_f32(-((layer * 1000 + i) as f32));
            }
        }
        let blocks = [BlockId(4), BlockId(1), BlockId(3)];
        let mut out = Vec::new();
        cache.read_kv_blocks(1, &blocks, &mut out).unwrap();
        let layout = StagingLayout {
            half_block_bytes: elems * 2,
        };
        assert_eq!(out.len(), layout.bytes(blocks.len()));
        assert_eq!(out.len(), shape.block_bytes_per_layer() * blocks.len());
        let halves = |r: Range<usize>| -> Vec<f16> {
            out[r]
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]))
                .collect()
        };
        for (i, b) in blocks.iter().enumerate() {
            let (k, v) = layout.block(i);
            let at = b.0 as usize * elems;
            assert_eq!(halves(k), cache.k[1][at..at + elems]);
            assert_eq!(halves(v), cache.v[1][at..at + elems]);
        }
    }

    #[test]
    fn staging_grows_in_powers_of_two_and_never_shrinks() {
        assert_eq!(staging_capacity(0, 10), MIN_STAGING_BYTES);
        assert_eq!(staging_capacity(MIN_STAGING_BYTES, 10), MIN_STAGING_BYTES);
        assert_eq!(staging_capacity(MIN_STAGING_BYTES, 3 << 20), 4 << 20);
        assert_eq!(staging_capacity(4 << 20, 1 << 20), 4 << 20);
        assert_eq!(staging_capacity(4 << 20, 4 << 20), 4 << 20);
    }
}
