//! AVX2 kernel for the integer path, on the panel layout of `quant/panel.rs`: for CPUs without
//! AVX-512 (most laptops, Zen 1–3 and Haswell–Comet Lake servers).
//!
//! A 64-byte panel vector holds four quant bytes of each of the 16 rows; here it is two 32-byte
//! halves of 8 rows each. With no `vpdpbusd`, each 4-term row dot product is
//! `vpmaddubsw` (unsigned weight byte × signed activation byte, pairs summed to i16) then
//! `vpmaddwd` by ones (pairs summed to i32), so a lane still ends with its own row's exact
//! block dot product. Q4 nibbles (≤ 15) allow summing all eight `vpmaddubsw` results in i16
//! (|sum| ≤ 8 · 2 · 15 · 128 < 2¹⁵) before widening. Q8_0 weights are signed: `vpsignb`
//! moves their sign onto the activation so that `vpmaddubsw` sees |w| ≤ 128 (each pair
//! ≤ 2 · 128 · 127 < 2¹⁵), widened per group. The f32 scaling then follows the canonical
//! per-output order of `quantized.rs` lane by lane, so results are bit-identical to it.

use super::act::ActBlock;
use super::quantized::{Panel, QKind};
use crate::quant::{panel_block_bytes, WeightFormat};
use std::arch::x86_64::*;

/// One 32-column block of a 16-row panel, unpacked once and reused for a tile of activation
/// rows: `w[k][h]` is operand `k` (a column group) for rows `8h..8h+8`.
struct WBlock {
    w: [[__m256i; 2]; 8],
    d: [__m256; 2],
    m: [__m256; 2],
}

const KIND_Q4_0: u8 = 0;
const KIND_Q4_1: u8 = 1;
const KIND_Q8_0: u8 = 2;

/// Activation rows per tile: the unpacked block is reused this many times.
const TILE: usize = 4;

fn format_of(kind: u8) -> WeightFormat {
    match kind {
        KIND_Q4_0 => WeightFormat::Q4_0,
        KIND_Q4_1 => WeightFormat::Q4_1,
        _ => WeightFormat::Q8_0,
    }
}

/// Computes `out[a * ldo + r]` for all `acts.len() / nb` activation rows and the panel's rows.
///
/// # Safety
/// The CPU must support the `Isa::Avx2` features; `out` must be valid for those writes.
pub(super) unsafe fn panel(p: &Panel, acts: &[ActBlock], out: *mut f32, ldo: usize) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match p.kind {
            QKind::Q4_0 => dispatch::<KIND_Q4_0>(p, acts, out, ldo),
            QKind::Q4_1 => dispatch::<KIND_Q4_1>(p, acts, out, ldo),
            QKind::Q8_0 => dispatch::<KIND_Q8_0>(p, acts, out, ldo),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dispatch<const KIND: u8>(p: &Panel, acts: &[ActBlock], out: *mut f32, ldo: usize) {
    assert!(p.blocks.len() >= p.nb * panel_block_bytes(format_of(KIND)));
    let m = acts.len() / p.nb;
    let mut a = 0;
    // SAFETY: each tile reads C activation rows from `a` and writes C output rows.
    unsafe {
        while a + TILE <= m {
            tile::<KIND, TILE>(p, &acts[a * p.nb..], out.add(a * ldo), ldo);
            a += TILE;
        }
        let (rest, o) = (&acts[a * p.nb..], out.add(a * ldo));
        match m - a {
            0 => {}
            1 => tile::<KIND, 1>(p, rest, o, ldo),
            2 => tile::<KIND, 2>(p, rest, o, ldo),
            _ => tile::<KIND, 3>(p, rest, o, ldo),
        }
    }
}

/// Loads and unpacks panel block `blk`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn load_block<const KIND: u8>(blk: *const u8) -> WBlock {
    // SAFETY: the caller passes a whole panel block.
    unsafe {
        let ld = |off: usize| _mm256_loadu_si256(blk.add(off).cast());
        let scales = |off: usize| {
            [
                _mm256_cvtph_ps(_mm_loadu_si128(blk.add(off).cast())),
                _mm256_cvtph_ps(_mm_loadu_si128(blk.add(off + 16).cast())),
            ]
        };
        let mut w = [[_mm256_setzero_si256(); 2]; 8];
        if KIND == KIND_Q8_0 {
            // Stored biased to unsigned; back to signed bytes.
            let bias = _mm256_set1_epi8(-128);
            for (g, wg) in w.iter_mut().enumerate() {
                for (h, v) in wg.iter_mut().enumerate() {
                    *v = _mm256_xor_si256(ld(64 * g + 32 * h), bias);
                }
            }
            let d = scales(512);
            WBlock {
                w,
                d,
                m: [_mm256_setzero_ps(); 2],
            }
        } else {
            let nib = _mm256_set1_epi8(0x0F);
            let (lo, hi) = w.split_at_mut(4);
            for (g, (lo, hi)) in lo.iter_mut().zip(hi).enumerate() {
                for (h, (lo, hi)) in lo.iter_mut().zip(hi).enumerate() {
                    let v = ld(64 * g + 32 * h);
                    *lo = _mm256_and_si256(v, nib);
                    *hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), nib);
                }
            }
            let d = scales(256);
            let m = if KIND == KIND_Q4_1 {
                scales(288)
            } else {
                let k = _mm256_set1_ps(-8.0);
                [_mm256_mul_ps(d[0], k), _mm256_mul_ps(d[1], k)]
            };
            WBlock { w, d, m }
        }
    }
}

/// The exact int32 block dot products of one activation block with rows `8h..8h+8`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn block_dot<const KIND: u8>(wb: &WBlock, h: usize, x: &[__m256i; 8]) -> __m256i {
    let ones = _mm256_set1_epi16(1);
    if KIND == KIND_Q8_0 {
        let mut i = _mm256_setzero_si256();
        for (w, &x) in wb.w.iter().zip(x) {
            let w = w[h];
            let pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
            i = _mm256_add_epi32(i, _mm256_madd_epi16(pairs, ones));
        }
        i
    } else {
        let mut s = _mm256_setzero_si256();
        for (w, &x) in wb.w.iter().zip(x) {
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[h], x));
        }
        _mm256_madd_epi16(s, ones)
    }
}

/// `C` activation rows (from `acts`, `nb` blocks each) against the whole panel.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const KIND: u8, const C: usize>(
    p: &Panel,
    acts: &[ActBlock],
    out: *mut f32,
    ldo: usize,
) {
    let nb = p.nb;
    let pbb = panel_block_bytes(format_of(KIND));
    assert!(acts.len() >= C * nb);
    let mut acc = [[_mm256_setzero_ps(); 2]; C];
    // SAFETY: block b lies inside `p.blocks` (checked by the caller); activation indices are
    // below C * nb <= acts.len(); the caller owns C output rows of `p.rows` floats.
    unsafe {
        for b in 0..nb {
            let wb = load_block::<KIND>(p.blocks.as_ptr().add(b * pbb));
            for (c, acc) in acc.iter_mut().enumerate() {
                let a = acts.get_unchecked(c * nb + b);
                let q = a.q.as_ptr().cast::<i32>();
                let x: [__m256i; 8] =
                    std::array::from_fn(|g| _mm256_set1_epi32(q.add(g).read_unaligned()));
                let ad = _mm256_set1_ps(a.d);
                let asum = _mm256_set1_ps(a.s);
                for (h, acc) in acc.iter_mut().enumerate() {
                    let i = block_dot::<KIND>(&wb, h, &x);
                    let scale = _mm256_mul_ps(wb.d[h], ad);
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), scale, *acc);
                    if KIND != KIND_Q8_0 {
                        *acc = _mm256_fmadd_ps(wb.m[h], asum, *acc);
                    }
                }
            }
        }
        for (c, [lo, hi]) in acc.iter().enumerate() {
            let mut row = [0.0f32; 16];
            _mm256_storeu_ps(row.as_mut_ptr(), *lo);
            _mm256_storeu_ps(row.as_mut_ptr().add(8), *hi);
            std::ptr::copy_nonoverlapping(row.as_ptr(), out.add(c * ldo), p.rows);
        }
    }
}
