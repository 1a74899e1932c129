//! Copies whole KV blocks between a [`KvCache`] and the transfer layout (see
//! [`KvSource`]): the gather a prefill node runs before pushing KV, and the scatter a decode
//! node runs when it arrives. On a GPU backend these become kernels; the layout stays.

use crate::model::KvCache;
use crate::runner::{KvShape, KvSource, RunnerError};
use kvmesh_common::BlockId;
use std::ops::Range;

// The transfer layout is little-endian f16, which is the in-memory layout on every target we
// build for; a big-endian port would need a byte swap here.
const _: () = assert!(
    cfg!(target_endian = "little"),
    "kv_blocks copies f16 as little-endian bytes"
);

/// Bytes of `num_layers` × `num_blocks` blocks in the transfer layout.
pub fn payload_len(shape: &KvShape, num_layers: usize, num_blocks: usize) -> usize {
    num_layers * num_blocks * shape.block_bytes_per_layer()
}

/// Checks that `layers` and `blocks` address this shape's cache.
pub fn check_range(
    shape: &KvShape,
    layers: Range<usize>,
    blocks: &[BlockId],
) -> Result<(), RunnerError> {
    if layers.end > shape.num_layers || layers.start > layers.end {
        return Err(RunnerError::LayerOutOfRange {
            layer: layers.end.max(layers.start),
            num_layers: shape.num_layers,
        });
    }
    if let Some(b) = blocks.iter().find(|b| b.0 as usize >= shape.num_blocks) {
        return Err(RunnerError::BlockOutOfRange {
            block: b.0,
            num_blocks: shape.num_blocks,
        });
    }
    Ok(())
}

impl KvSource for KvCache {
    fn read_kv_blocks(
        &self,
        layer: usize,
        blocks: &[BlockId],
        out: &mut Vec<u8>,
    ) -> Result<(), RunnerError> {
        check_range(&self.shape, layer..layer + 1, blocks)?;
        let elems = self.block_elems();
        out.reserve(payload_len(&self.shape, 1, blocks.len()));
        for b in blocks {
            let r = b.0 as usize * elems..(b.0 as usize + 1) * elems;
            out.extend_from_slice(bytemuck::cast_slice(&self.k[layer][r.clone()]));
            out.extend_from_slice(bytemuck::cast_slice(&self.v[layer][r]));
        }
        Ok(())
    }
}

/// Writes `payload` (`layers` × `blocks` in the transfer layout) into `kv`. Checks everything
/// before writing anything.
pub fn write_kv_blocks(
    kv: &mut KvCache,
    layers: Range<usize>,
    blocks: &[BlockId],
    payload: &[u8],
) -> Result<(), RunnerError> {
    check_range(&kv.shape, layers.clone(), blocks)?;
    let expected = payload_len(&kv.shape, layers.len(), blocks.len());
    if payload.len() != expected {
        return Err(RunnerError::KvPayloadSize {
            expected,
            got: payload.len(),
        });
    }
    let elems = kv.block_elems();
    let half = elems * 2; // bytes of K (or V) of one block
    let mut parts = payload.chunks_exact(half);
    for layer in layers {
        for b in blocks {
            let r = b.0 as usize * elems..(b.0 as usize + 1) * elems;
            let (k, v) = (parts.next(), parts.next());
            let (Some(k), Some(v)) = (k, v) else {
                unreachable!("the payload length was checked");
            };
            bytemuck::cast_slice_mut(&mut kv.k[layer][r.clone()]).copy_from_slice(k);
            bytemuck::cast_slice_mut(&mut kv.v[layer][r]).copy_from_slice(v);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    fn shape() -> KvShape {
        KvShape {
            num_layers: 3,
            num_kv_heads: 2,
            head_dim: 4,
            block_size: 2,
            num_blocks: 5,
        }
    }

    fn filled() -> KvCache {
        let mut kv = KvCache::new(shape());
        for l in 0..3 {
            for (i, x) in kv.k[l].iter_mut().enumerate() {
                *x = f16::from_f32((l * 1000 + i) as f32);
            }
            for (i, x) in kv.v[l].iter_mut().enumerate() {
                *x = f16::from_f32(-((l * 1000 + i) as f32));
            }
        }
        kv
    }

    #[test]
    fn gather_then_scatter_moves_exactly_the_blocks() {
        let src = filled();
        let (from, to) = ([BlockId(3), BlockId(1)], [BlockId(0), BlockId(4)]);
        let mut payload = Vec::new();
        for l in 1..3 {
            src.read_kv_blocks(l, &from, &mut payload).unwrap();
        }
        assert_eq!(payload.len(), payload_len(&shape(), 2, 2));
        let mut dst = KvCache::new(shape());
        write_kv_blocks(&mut dst, 1..3, &to, &payload).unwrap();
        let e = dst.block_elems();
        for l in 1..3 {
            for (s, d) in from.iter().zip(&to) {
                let (s, d) = (s.0 as usize * e, d.0 as usize * e);
                assert_eq!(dst.k[l][d..d + e], src.k[l][s..s + e]);
                assert_eq!(dst.v[l][d..d + e], src.v[l][s..s + e]);
            }
        }
        // Layer 0 and the other blocks are untouched.
        assert!(dst.k[0].iter().all(|x| *x == f16::ZERO));
        assert!(dst.k[1][e..4 * e].iter().all(|x| *x == f16::ZERO));
    }

    #[test]
    fn bad_ranges_and_sizes_write_nothing() {
        let mut kv = KvCache::new(shape());
        let one = payload_len(&shape(), 1, 1);
        assert!(matches!(
            write_kv_blocks(&mut kv, 0..1, &[BlockId(5)], &vec![1; one]),
            Err(RunnerError::BlockOutOfRange { block: 5, .. })
        ));
        assert!(matches!(
            write_kv_blocks(&mut kv, 2..4, &[BlockId(0)], &vec![1; 2 * one]),
            Err(RunnerError::LayerOutOfRange { .. })
        ));
        assert!(matches!(
            write_kv_blocks(&mut kv, 0..1, &[BlockId(0)], &vec![1; one - 2]),
            Err(RunnerError::KvPayloadSize { .. })
        ));
        assert!(kv.k.iter().flatten().all(|x| *x == f16::ZERO));
    }
}
