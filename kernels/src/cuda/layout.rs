//! Launch geometry and layouts of the decode kernels, pure arithmetic with no driver: for the
//! int8 GEMV (`gemv.cu`) the split layout weights are uploaded in, where the quantized
//! activations sit in the scratch buffer and which kernel runs with what grid; the warps of
//! a paged attention launch (`attention.cu`).
//!
//! ggml's blocks are 20 bytes (Q4_1) and 34 bytes (Q8_0), so a block's quants sit at any
//! 4-byte (Q4_1) or 2-byte (Q8_0) offset and a warp cannot read them as aligned 128-bit words.
//! At upload each matrix is split, bits unchanged: every block's quants, in block order (16
//! bytes for Q4_1, 32 for Q8_0: whole 128-bit words), then every block's scales (Q4_1's `d`
//! and `m`, 4 bytes; Q8_0's `d`, 2 bytes), in the same order.

use crate::WeightFormat;

/// Which kernel serves decode's matmuls (`m` up to [`GEMV_MAX_M`] activation rows over Q8_0 or
/// Q4_1 weights).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GemvKernel {
    /// `gemv.cu`: activations quantized to int8 per block of 32 (as the CPU backend's
    /// matmul does), int32 dot products with `dp4a` over the split layout's 128-bit words.
    #[default]
    Dp4a,
    /// `quant.cu`'s `gemv_q8_0` / `gemv_q4_1`: f32 activations, the blocks read byte by byte
    /// as stored in the GGUF. Kept to compare against.
    Reference,
}

/// Most activation rows a GEMV launch serves (`GEMV_MAX_M` in quant.cu); more go to cuBLAS.
pub const GEMV_MAX_M: usize = 8;

/// Threads per block of the int8 GEMV (`DP4A_THREADS` in gemv.cu).
pub const DP4A_THREADS: u32 = 128;

/// Threads per block of `quantize_q8_1` (one warp per block of 32 activations).
pub const QUANTIZE_THREADS: u32 = 256;

/// Weight rows each thread block of the int8 GEMV computes (`DP4A_ROWS` in gemv.cu).
pub const DP4A_ROWS: usize = 4;

/// The int8 GEMV's instantiations, by the most activation rows each serves (gemv.cu's
/// `gemv_*_dp4a_m*`): a launch takes the smallest that holds its `m`.
pub const DP4A_MAX_M: [usize; 4] = [1, 2, 4, 8];

const Q4_1_DP4A: [&str; 4] = [
    "gemv_q4_1_dp4a_m1",
    "gemv_q4_1_dp4a_m2",
    "gemv_q4_1_dp4a_m4",
    "gemv_q4_1_dp4a_m8",
];
const Q8_0_DP4A: [&str; 4] = [
    "gemv_q8_0_dp4a_m1",
    "gemv_q8_0_dp4a_m2",
    "gemv_q8_0_dp4a_m4",
    "gemv_q8_0_dp4a_m8",
];

/// Bytes of one block's scales and of its quants in the split layout; `None` for formats the
/// int8 GEMV does not read.
pub fn split_block(format: WeightFormat) -> Option<(usize, usize)> {
    match format {
        WeightFormat::Q4_1 => Some((4, 16)),
        WeightFormat::Q8_0 => Some((2, 32)),
        _ => None,
    }
}

/// Where a matrix's sections lie in its split copy: the quants from byte 0, the scales from
/// `quant_bytes` (a multiple of 16, so the scales are aligned as well).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitLayout {
    pub quant_bytes: usize,
    pub scale_bytes: usize,
}

/// The split layout of `blocks` ggml blocks of `format`.
pub fn split_layout(format: WeightFormat, blocks: usize) -> Option<SplitLayout> {
    let (scale, quant) = split_block(format)?;
    Some(SplitLayout {
        quant_bytes: blocks * quant,
        scale_bytes: blocks * scale,
    })
}

/// `data` (ggml blocks of `format`, as stored) in the split layout; `None` for other formats
/// or a length that is not whole blocks.
pub fn split_blocks(format: WeightFormat, data: &[u8]) -> Option<Vec<u8>> {
    let (scale, quant) = split_block(format)?;
    let bb = scale + quant;
    if !data.len().is_multiple_of(bb) {
        return None;
    }
    let layout = split_layout(format, data.len() / bb)?;
    let mut out = vec![0u8; layout.quant_bytes + layout.scale_bytes];
    let (quants, scales) = out.split_at_mut(layout.quant_bytes);
    for ((block, q), s) in data
        .chunks_exact(bb)
        .zip(quants.chunks_exact_mut(quant))
        .zip(scales.chunks_exact_mut(scale))
    {
        s.copy_from_slice(&block[..scale]);
        q.copy_from_slice(&block[scale..]);
    }
    Some(out)
}

/// Where `m` rows of `cols` quantized activations lie in the matmul's scratch buffer: the
/// int8 values row by row from byte 0 (each block's 32 at a 32-byte boundary), then one
/// `(d, s)` pair of f32 per block of 32 from byte [`ActLayout::ds_offset`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActLayout {
    pub ds_offset: usize,
    pub bytes: usize,
}

/// The scratch layout of `m` rows of `cols` (a multiple of 32) activations.
pub fn act_layout(m: usize, cols: usize) -> ActLayout {
    let q = m * cols;
    ActLayout {
        ds_offset: q,
        bytes: q + m * (cols / 32) * 8,
    }
}

/// One launch of the int8 GEMV: the kernel and its grid (`blocks` of [`DP4A_THREADS`], each
/// computing [`DP4A_ROWS`] weight rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemvLaunch {
    pub kernel: &'static str,
    pub blocks: u32,
}

/// The int8 GEMV launch for `rows` weight rows of `format` and `m` activation rows: the
/// smallest instantiation that holds `m`. `None` when it does not apply (another format,
/// `m` of 0 or above [`GEMV_MAX_M`], or a grid too large).
pub fn dp4a_launch(format: WeightFormat, rows: usize, m: usize) -> Option<GemvLaunch> {
    let names = match format {
        WeightFormat::Q4_1 => &Q4_1_DP4A,
        WeightFormat::Q8_0 => &Q8_0_DP4A,
        _ => return None,
    };
    let i = DP4A_MAX_M.iter().position(|&max_m| m >= 1 && m <= max_m)?;
    Some(GemvLaunch {
        kernel: names[i],
        blocks: u32::try_from(rows.div_ceil(DP4A_ROWS).max(1)).ok()?,
    })
}

/// Thread blocks of `quantize_q8_1` for `m` rows of `cols` activations.
pub fn quantize_blocks(m: usize, cols: usize) -> usize {
    let warps = (QUANTIZE_THREADS / 32) as usize;
    (m * cols / 32).div_ceil(warps).max(1)
}

/// Most warps of one attention thread block (`ATTN_MAX_WARPS` in attention.cu).
pub const ATTN_MAX_WARPS: usize = 16;
/// Fewest warps of one attention thread block (a prefill launch: many rows).
pub const ATTN_MIN_WARPS: usize = 4;
/// Warps that fill a large GPU (132 SMs of 64 resident warps, about 8,192).
const ATTN_FILL_WARPS: usize = 8192;

/// Threads per thread block of an attention launch over `rows` query rows and `heads` heads
/// (one block each). Each block's warps split its row's positions, walking them one after
/// another, so a launch of few blocks (decode at small batch: 32 blocks for one sequence of
/// Llama-3-8B) takes up to [`ATTN_MAX_WARPS`] to have more positions read at once, and one
/// of many blocks (prefill) keeps [`ATTN_MIN_WARPS`].
pub fn attention_threads(rows: usize, heads: usize) -> u32 {
    let blocks = (rows * heads).max(1);
    let warps = (ATTN_FILL_WARPS / blocks).clamp(ATTN_MIN_WARPS, ATTN_MAX_WARPS);
    32 * warps as u32
}

/// Every kernel name of the int8 GEMV, for the source list.
pub const DP4A_KERNELS: [&str; 9] = [
    "quantize_q8_1",
    Q4_1_DP4A[0],
    Q4_1_DP4A[1],
    Q4_1_DP4A[2],
    Q4_1_DP4A[3],
    Q8_0_DP4A[0],
    Q8_0_DP4A[1],
    Q8_0_DP4A[2],
    Q8_0_DP4A[3],
];

#[cfg(test)]
mod tests {
    use super::*;

    /// The inverse of [`split_blocks`]: ggml blocks back from the split layout.
    fn join_blocks(format: WeightFormat, split: &[u8]) -> Vec<u8> {
        let (scale, quant) = split_block(format).unwrap();
        let blocks = split.len() / (scale + quant);
        let (quants, scales) = split.split_at(blocks * quant);
        quants
            .chunks_exact(quant)
            .zip(scales.chunks_exact(scale))
            .flat_map(|(q, s)| s.iter().chain(q).copied())
            .collect()
    }

    fn bytes(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn split_keeps_every_bit_and_joins_back() {
        for format in [WeightFormat::Q4_1, WeightFormat::Q8_0] {
            let data = bytes(7 * format.block_bytes(), 3);
            let split = split_blocks(format, &data).unwrap();
            assert_eq!(split.len(), data.len());
            assert_eq!(join_blocks(format, &split), data, "{format:?}");
        }
    }

    #[test]
    fn split_blocks_land_where_the_kernels_read_them() {
        // Q4_1 block 5: its 16 quant bytes at 16 * 5, its (d, m) word at quant_bytes + 4 * 5.
        let data = bytes(9 * 20, 11);
        let split = split_blocks(WeightFormat::Q4_1, &data).unwrap();
        let l = split_layout(WeightFormat::Q4_1, 9).unwrap();
        assert_eq!(l.quant_bytes % 16, 0);
        let block = &data[5 * 20..6 * 20];
        assert_eq!(&split[5 * 16..6 * 16], &block[4..]);
        assert_eq!(
            &split[l.quant_bytes + 5 * 4..l.quant_bytes + 6 * 4],
            &block[..4]
        );
        // Q8_0 block 2: 32 quant bytes at 32 * 2 (two 128-bit words), d at quant_bytes + 2 * 2.
        let data = bytes(3 * 34, 5);
        let split = split_blocks(WeightFormat::Q8_0, &data).unwrap();
        let l = split_layout(WeightFormat::Q8_0, 3).unwrap();
        let block = &data[2 * 34..3 * 34];
        assert_eq!(&split[2 * 32..3 * 32], &block[2..]);
        assert_eq!(&split[l.quant_bytes + 4..l.quant_bytes + 6], &block[..2]);
    }

    #[test]
    fn split_refuses_other_formats_and_partial_blocks() {
        assert!(split_blocks(WeightFormat::Q4_0, &[0; 18]).is_none());
        assert!(split_blocks(WeightFormat::F16, &[0; 64]).is_none());
        assert!(split_blocks(WeightFormat::Q4_1, &[0; 21]).is_none());
    }

    #[test]
    fn quantized_activations_fit_the_bf16_scratch_aligned() {
        // The engine sizes the scratch for a bf16 copy of the widest input (2 bytes per
        // activation); the int8 copy and its (d, s) pairs take 1.25.
        for (m, cols) in [(1, 32), (1, 576), (3, 4096), (8, 14336)] {
            let l = act_layout(m, cols);
            assert!(l.bytes <= 2 * m * cols, "{m} x {cols}");
            assert_eq!(l.ds_offset % 8, 0, "(d, s) pairs are 8-byte loads");
            assert_eq!(l.bytes, m * cols + 8 * m * cols / 32);
        }
    }

    #[test]
    fn launch_picks_the_smallest_variant_that_holds_m() {
        let q41 = |m| dp4a_launch(WeightFormat::Q4_1, 14336, m).map(|l| l.kernel);
        assert_eq!(q41(1), Some("gemv_q4_1_dp4a_m1"));
        assert_eq!(q41(2), Some("gemv_q4_1_dp4a_m2"));
        assert_eq!(q41(3), Some("gemv_q4_1_dp4a_m4"));
        assert_eq!(q41(5), Some("gemv_q4_1_dp4a_m8"));
        assert_eq!(q41(8), Some("gemv_q4_1_dp4a_m8"));
        assert_eq!(q41(0), None);
        assert_eq!(q41(9), None);
        assert_eq!(
            dp4a_launch(WeightFormat::Q8_0, 10, 4).map(|l| l.kernel),
            Some("gemv_q8_0_dp4a_m4")
        );
        assert!(dp4a_launch(WeightFormat::Q4_0, 10, 1).is_none());
    }

    #[test]
    fn launch_grid_covers_every_row() {
        for rows in [1, 2, 3, 1003, 14336, 128256] {
            for m in 1..=GEMV_MAX_M {
                let l = dp4a_launch(WeightFormat::Q4_1, rows, m).unwrap();
                let covered = l.blocks as usize * DP4A_ROWS;
                assert!(covered >= rows && covered < rows + DP4A_ROWS);
            }
        }
    }

    #[test]
    fn attention_takes_more_warps_for_fewer_rows() {
        assert_eq!(attention_threads(1, 32), 32 * ATTN_MAX_WARPS as u32);
        assert_eq!(attention_threads(1, 9), 32 * ATTN_MAX_WARPS as u32);
        assert_eq!(attention_threads(32, 32), 32 * 8);
        assert_eq!(attention_threads(2048, 32), 32 * ATTN_MIN_WARPS as u32);
        for rows in [0, 1, 7, 100, 5000] {
            let t = attention_threads(rows, 32);
            assert!(t.is_multiple_of(32) && (4..=16).contains(&(t / 32)));
        }
    }

    #[test]
    fn quantize_grid_gives_every_block_a_warp() {
        for (m, cols) in [(1, 32), (1, 4096), (5, 2080), (8, 14336)] {
            let warps = quantize_blocks(m, cols) * (QUANTIZE_THREADS as usize / 32);
            assert!(warps >= m * cols / 32);
            assert!(warps < m * cols / 32 + QUANTIZE_THREADS as usize / 32);
        }
    }
}
