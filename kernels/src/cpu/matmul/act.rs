//! Activation quantization for the integer matmul path: each row is cut into blocks of 32 and
//! each block becomes `d = max|x| / 127`, `q = round_half_even(x / d)` (via `x * (1/d)`, as
//! ggml does), plus the block sums the weight formats need. Like ggml's `block_q8_1`, `d` and
//! `s = d * Σq` are kept at f16 precision, so our dot products track llama.cpp's.

use crate::cpu::Isa;

/// One quantized block of 32 activations.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(16))]
pub(crate) struct ActBlock {
    pub q: [i8; 32],
    /// Scale: `x ≈ d * q` (an f16 value).
    pub d: f32,
    /// `f16(d * Σq)`, for the Q4_1/Q4_0 offset term `m * Σx`.
    pub s: f32,
    /// `-128 * Σq`: the Q8_0 kernel runs weights as `q + 128` (unsigned) and subtracts this.
    pub corr: i32,
    _pad: i32,
}

/// One block of a tile of 16 activation rows, laid out for the AMX kernel: the 16 rows'
/// quants contiguous (one dense tile load) and their scales (broadcast at constant offsets).
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
pub(crate) struct ActTile {
    pub q: [[i8; 32]; 16],
    pub d: [f32; 16],
    pub s: [f32; 16],
}

impl Default for ActTile {
    fn default() -> Self {
        ActTile {
            q: [[0; 32]; 16],
            d: [0.0; 16],
            s: [0.0; 16],
        }
    }
}

/// Regroups the first `m / 16 * 16` rows of `acts` (`nb` blocks per row) into [`ActTile`]s,
/// indexed `[tile * nb + block]`.
pub(crate) fn act_tiles(acts: &[ActBlock], nb: usize, out: &mut Vec<ActTile>) {
    let tiles = acts.len() / nb / 16;
    out.clear();
    out.resize(tiles * nb, ActTile::default());
    for (i, at) in out.iter_mut().enumerate() {
        let (t, b) = (i / nb, i % nb);
        for r in 0..16 {
            let a = &acts[(16 * t + r) * nb + b];
            at.q[r] = a.q;
            at.d[r] = a.d;
            at.s[r] = a.s;
        }
    }
}

/// Quantizes `x = [m, k]` (k a multiple of 32) into `out = [m, k/32]` blocks.
pub(crate) fn quantize(isa: Isa, x: &[f32], out: &mut Vec<ActBlock>) {
    debug_assert!(x.len().is_multiple_of(32));
    out.clear();
    out.resize(x.len() / 32, ActBlock::default());
    let run = |xs: &[f32], os: &mut [ActBlock]| match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512` is only passed on when the CPU supports it.
        Isa::Avx512 | Isa::Amx => unsafe { quantize_avx512(xs, os) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, for `Isa::Avx2`.
        Isa::Avx2 => unsafe { quantize_avx2(xs, os) },
        _ => quantize_portable(xs, os),
    };
    // Large batches (prefill) are worth splitting; decode rows are not.
    const CHUNK_BLOCKS: usize = 4096;
    if out.len() > 2 * CHUNK_BLOCKS && rayon::current_num_threads() > 1 {
        use rayon::prelude::*;
        x.par_chunks(CHUNK_BLOCKS * 32)
            .zip(out.par_chunks_mut(CHUNK_BLOCKS))
            .for_each(|(xs, os)| run(xs, os));
    } else {
        run(x, out);
    }
}

/// Stores the scale and sum rounded through f16, as ggml's Q8_1/Q8_0 blocks hold them: the
/// rounding is part of llama.cpp's arithmetic, and matching it keeps our logits (and greedy
/// tokens) on llama.cpp's, not merely near them.
fn finish(block: &mut ActBlock, d: f32, isum: i32) {
    block.d = half::f16::from_f32(d).to_f32();
    block.s = half::f16::from_f32(d * isum as f32).to_f32();
    block.corr = -128 * isum;
}

/// The reference: the SIMD versions must match it bit for bit.
pub(crate) fn quantize_portable(x: &[f32], out: &mut [ActBlock]) {
    for (xs, o) in x.chunks_exact(32).zip(out.iter_mut()) {
        let amax = xs.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut isum = 0i32;
        for (q, &v) in o.q.iter_mut().zip(xs) {
            let r = (v * id).round_ties_even() as i32;
            *q = r.clamp(-128, 127) as i8;
            isum += *q as i32;
        }
        finish(o, d, isum);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn quantize_avx512(x: &[f32], out: &mut [ActBlock]) {
    use std::arch::x86_64::*;
    for (xs, o) in x.chunks_exact(32).zip(out.iter_mut()) {
        // SAFETY: `xs` has 32 elements and `o.q` 32 bytes.
        unsafe {
            let v0 = _mm512_loadu_ps(xs.as_ptr());
            let v1 = _mm512_loadu_ps(xs.as_ptr().add(16));
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            let d = amax / 127.0;
            let id = _mm512_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
            const RNE: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            let q0 = _mm512_cvt_roundps_epi32::<RNE>(_mm512_mul_ps(v0, id));
            let q1 = _mm512_cvt_roundps_epi32::<RNE>(_mm512_mul_ps(v1, id));
            let b0 = _mm512_cvtsepi32_epi8(q0);
            let b1 = _mm512_cvtsepi32_epi8(q1);
            _mm_storeu_si128(o.q.as_mut_ptr().cast(), b0);
            _mm_storeu_si128(o.q.as_mut_ptr().add(16).cast(), b1);
            // Sum the saturated bytes, as the portable path does.
            let s = _mm512_add_epi32(_mm512_cvtepi8_epi32(b0), _mm512_cvtepi8_epi32(b1));
            let isum = _mm512_reduce_add_epi32(s);
            // `finish` with F16C inline: `half`'s conversions are out-of-line calls, and
            // decode quantizes its activations on one thread. Both round to nearest even.
            let f16_round = |x: f32| {
                let h = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(x));
                _mm_cvtss_f32(_mm_cvtph_ps(h))
            };
            o.d = f16_round(d);
            o.s = f16_round(d * isum as f32);
            o.corr = -128 * isum;
        }
    }
}

/// `quantize_portable` on 8 lanes. `_mm256_cvtps_epi32` rounds by MXCSR, which Rust leaves
/// at its default, round to nearest even; |x * id| <= 127 + rounding error, so no lane
/// overflows and clamping afterwards matches the portable path.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_avx2(x: &[f32], out: &mut [ActBlock]) {
    use std::arch::x86_64::*;
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MAX));
    for (xs, o) in x.chunks_exact(32).zip(out.iter_mut()) {
        // SAFETY: `xs` has 32 elements and `o.q` 32 bytes.
        unsafe {
            let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(xs.as_ptr().add(8 * i)));
            let m = v.map(|v| _mm256_and_ps(v, abs));
            let m = _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3]));
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)));
            let d = amax / 127.0;
            let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
            let (lo, hi) = (_mm256_set1_epi32(-128), _mm256_set1_epi32(127));
            let q = v.map(|v| {
                let q = _mm256_cvtps_epi32(_mm256_mul_ps(v, id));
                _mm256_min_epi32(_mm256_max_epi32(q, lo), hi)
            });
            // The packs interleave 128-bit lanes; the permute restores element order.
            let b = _mm256_packs_epi16(
                _mm256_packs_epi32(q[0], q[1]),
                _mm256_packs_epi32(q[2], q[3]),
            );
            let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(o.q.as_mut_ptr().cast(), b);
            let s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
            finish(o, d, _mm_cvtsi128_si32(s));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn zero_block_has_zero_scale() {
        let mut out = Vec::new();
        quantize(Isa::Portable, &[0.0; 32], &mut out);
        assert_eq!(out[0].d, 0.0);
        assert_eq!(out[0].q, [0; 32]);
    }

    #[test]
    fn extremes_map_to_127() {
        let mut x = [0.0f32; 32];
        x[3] = -2.0;
        x[7] = 1.0;
        let mut out = Vec::new();
        quantize(Isa::Portable, &x, &mut out);
        assert_eq!(out[0].q[3], -127);
        assert_eq!(out[0].q[7], 64); // 63.5 rounds half to even
        assert_eq!(out[0].corr, -128 * (64 - 127));
    }

    proptest! {
        #[test]
        fn simd_matches_portable(v in proptest::collection::vec(-100.0f32..100.0, 32..=320),
                                 ties in proptest::collection::vec(-4i32..=4, 32)) {
            let n = v.len() / 32 * 32;
            let mut v = v[..n].to_vec();
            // A block whose max is 127 makes id = 1, so these land exactly on .5: ties.
            v.extend(ties.iter().map(|&t| t as f32 + 0.5));
            v[n] = 127.0;
            let mut a = Vec::new();
            quantize(Isa::Portable, &v, &mut a);
            for isa in [Isa::Avx2, Isa::Avx512] {
                if !isa.is_supported() {
                    continue; // nothing to compare on this CPU
                }
                let mut b = Vec::new();
                quantize(isa, &v, &mut b);
                for (x, y) in a.iter().zip(&b) {
                    prop_assert_eq!(x.q, y.q);
                    prop_assert_eq!(x.d.to_bits(), y.d.to_bits());
                    prop_assert_eq!(x.s.to_bits(), y.s.to_bits());
                    prop_assert_eq!(x.corr, y.corr);
                }
            }
        }
    }
}
