//! AVX-512 f32 kernel: 4 weight rows x up to 6 activation rows of 16-lane accumulators per
//! tile, each lane following the canonical order of `float.rs`.

use super::float::FloatTile;
use crate::cpu::lanes::avx512::reduce16;
use crate::quant::WeightFormat;
use std::arch::x86_64::*;

/// F16/BF16 row to f32 (exact conversions, same values as the scalar path).
///
/// # Safety
/// The CPU must support AVX-512 F/BW and F16C.
#[target_feature(enable = "avx512f,avx512bw,f16c")]
pub(super) unsafe fn convert_row(format: WeightFormat, src: &[u8], dst: &mut [f32]) {
    let n = dst.len();
    assert!(src.len() >= 2 * n);
    let mut i = 0;
    // SAFETY: i + 16 <= n, and src holds 2n bytes.
    unsafe {
        while i + 16 <= n {
            let h = _mm256_loadu_si256(src.as_ptr().add(2 * i).cast());
            let v = if format == WeightFormat::F16 {
                _mm512_cvtph_ps(h)
            } else {
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            };
            _mm512_storeu_ps(dst.as_mut_ptr().add(i), v);
            i += 16;
        }
    }
    crate::quant::dequantize_blocks(format, &src[2 * i..2 * n], &mut dst[i..]);
}

/// # Safety
/// AVX-512 F/DQ + FMA; `out` valid for `x.len() / k` rows of stride `ldo` and `t.rows` columns.
#[target_feature(enable = "avx512f,avx512dq,fma")]
pub(super) unsafe fn panel(t: &FloatTile, out: *mut f32, ldo: usize) {
    let m = t.x.len() / t.k;
    for rg in (0..t.rows).step_by(4) {
        let mut a = 0;
        // SAFETY: forwarded; tiles stay inside the panel and the output block.
        unsafe {
            while a + 6 <= m {
                tile::<6>(t, rg, a, out, ldo);
                a += 6;
            }
            match m - a {
                0 => {}
                1 => tile::<1>(t, rg, a, out, ldo),
                2 => tile::<2>(t, rg, a, out, ldo),
                3 => tile::<3>(t, rg, a, out, ldo),
                4 => tile::<4>(t, rg, a, out, ldo),
                _ => tile::<5>(t, rg, a, out, ldo),
            }
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma")]
unsafe fn tile<const C: usize>(t: &FloatTile, rg: usize, a: usize, out: *mut f32, ldo: usize) {
    let (k, kp) = (t.k, t.kp);
    assert!(t.w.len() >= (rg + 4) * kp && t.x.len() >= (a + C) * k);
    let wp = t.w.as_ptr().wrapping_add(rg * kp);
    let xp = t.x.as_ptr().wrapping_add(a * k);
    let mut acc = [[_mm512_setzero_ps(); C]; 4];
    let full = k / 16;
    // SAFETY: weight loads stay within 4 rows of kp; activation loads within C rows of k
    // (the tail chunk is masked).
    unsafe {
        for ch in 0..kp / 16 {
            let mut w = [_mm512_setzero_ps(); 4];
            for (r, wr) in w.iter_mut().enumerate() {
                *wr = _mm512_loadu_ps(wp.add(r * kp + ch * 16));
            }
            for c in 0..C {
                let px = xp.add(c * k + ch * 16);
                let xv = if ch < full {
                    _mm512_loadu_ps(px)
                } else {
                    _mm512_maskz_loadu_ps(((1u32 << (k % 16)) - 1) as u16, px)
                };
                for (acc_r, &wr) in acc.iter_mut().zip(&w) {
                    acc_r[c] = _mm512_fmadd_ps(wr, xv, acc_r[c]);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            if rg + r >= t.rows {
                break;
            }
            for (c, &v) in row.iter().enumerate() {
                *out.add((a + c) * ldo + rg + r) = reduce16(v);
            }
        }
    }
}
