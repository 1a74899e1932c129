//! How KV arriving in the transfer layout goes onto the device (`CudaBackend::
//! write_kv_blocks`, the kernels' `write_kv_piece`): cut into pieces of whole blocks of one
//! layer, at most [`PIECE_BYTES`] each, that pass one at a time through two pinned buffers
//! (the host fills one while the other is copied to the device and scattered). Pieces bound
//! the pinned memory whatever a write's size; two let the host's copy overlap the DMA.

use std::ops::Range;

/// The most bytes of one piece: large enough that a copy's fixed cost is small beside its
/// bytes, small enough that the two pinned buffers stay modest.
pub const PIECE_BYTES: usize = 8 << 20;

/// One piece of a write: `blocks` (indices into the write's block list) of its `layer`-th
/// layer, at `bytes` of the payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub layer: usize,
    pub blocks: Range<usize>,
    pub bytes: Range<usize>,
}

/// Blocks per piece for blocks of `block_bytes` (K and V of one layer): as many as fit in
/// `cap`, at least one.
pub fn blocks_per_piece(block_bytes: usize, cap: usize) -> usize {
    (cap / block_bytes.max(1)).max(1)
}

/// The pieces of a payload of `layers` layers of `blocks` blocks of `block_bytes` each, in
/// payload order.
pub fn pieces(layers: usize, blocks: usize, block_bytes: usize, cap: usize) -> Vec<Piece> {
    let per = blocks_per_piece(block_bytes, cap);
    let mut out = Vec::new();
    for layer in 0..layers {
        let base = layer * blocks * block_bytes;
        for start in (0..blocks).step_by(per) {
            let end = (start + per).min(blocks);
            out.push(Piece {
                layer,
                blocks: start..end,
                bytes: base + start * block_bytes..base + end * block_bytes,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_payload_once_in_order() {
        for (layers, blocks, bb, cap) in [(3, 10, 64, 256), (2, 7, 64, 64), (1, 5, 100, 10)] {
            let ps = pieces(layers, blocks, bb, cap);
            let mut at = 0;
            for p in &ps {
                assert_eq!(p.bytes.start, at, "contiguous");
                assert_eq!(p.bytes.len(), p.blocks.len() * bb, "whole blocks");
                assert!(
                    p.bytes.len() <= cap.max(bb),
                    "within the cap (or one block)"
                );
                assert_eq!(
                    p.bytes.start,
                    (p.layer * blocks + p.blocks.start) * bb,
                    "where the transfer layout puts them"
                );
                at = p.bytes.end;
            }
            assert_eq!(at, layers * blocks * bb);
            let per_layer: usize = ps
                .iter()
                .filter(|p| p.layer == 0)
                .map(|p| p.blocks.len())
                .sum();
            assert_eq!(per_layer, blocks);
        }
    }

    #[test]
    fn a_block_larger_than_the_cap_is_a_piece_of_its_own() {
        assert_eq!(blocks_per_piece(100, 10), 1);
        assert_eq!(blocks_per_piece(64, 256), 4);
        assert_eq!(pieces(1, 3, 100, 10).len(), 3);
        assert!(pieces(2, 0, 64, 256).is_empty());
    }
}
