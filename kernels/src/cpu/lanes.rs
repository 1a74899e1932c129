//! The canonical 16-lane f32 dot product shared by the float matmul and attention: lane `j`
//! accumulates `fma(a[16c+j], b[16c+j], lane)` over chunks `c` in order (from +0, elements
//! past the end count as +0), then [`reduce16`] folds the lanes with a fixed halving tree.
//! SIMD kernels reproduce it exactly.

/// `((l[i] + l[i+8]) -> h8; (h8[i] + h8[i+4]) -> h4; (h4[i] + h4[i+2]) -> h2; h2[0] + h2[1])`.
#[inline(always)]
pub(crate) fn reduce16(l: [f32; 16]) -> f32 {
    let h8: [f32; 8] = std::array::from_fn(|i| l[i] + l[i + 8]);
    let h4: [f32; 4] = std::array::from_fn(|i| h8[i] + h8[i + 4]);
    (h4[0] + h4[2]) + (h4[1] + h4[3])
}

/// The canonical dot product of two equally long slices.
#[inline(always)]
pub(crate) fn dot16(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut lane = [0.0f32; 16];
    for (ca, cb) in a.chunks(16).zip(b.chunks(16)) {
        for (j, l) in lane.iter_mut().enumerate() {
            let (x, y) = (
                ca.get(j).copied().unwrap_or(0.0),
                cb.get(j).copied().unwrap_or(0.0),
            );
            *l = x.mul_add(y, *l);
        }
    }
    reduce16(lane)
}

/// The same reductions with each 16-lane vector held as two 8-lane halves `[lo, hi]`.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    /// [`super::reduce16`] of the vector `[lo, hi]`.
    #[inline]
    #[target_feature(enable = "avx")]
    pub(crate) fn reduce16(lo: __m256, hi: __m256) -> f32 {
        let h8 = _mm256_add_ps(lo, hi);
        let h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps::<1>(h8));
        let h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
        _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps::<1>(h2, h2)))
    }

    /// Input slot of lane `t`'s vector in [`reduce16x8`]: the final stage leaves lanes 1 and
    /// 2 of each quad swapped, so callers put vector `t` in slot `SLOT[t]`.
    pub(crate) const SLOT: [usize; 8] = [0, 2, 1, 3, 4, 6, 5, 7];

    /// Eight [`reduce16`]s at once: lane `t` of the result is the canonical reduction of the
    /// vector in slot `SLOT[t]`. Every add combines lanes of one input vector, in the same
    /// pairs as the scalar tree, so results are bit-identical to it.
    #[inline]
    #[target_feature(enable = "avx")]
    pub(crate) fn reduce16x8(v: &[[__m256; 2]; 8]) -> __m256 {
        // h8: the halves.
        let h8 = v.map(|[lo, hi]| _mm256_add_ps(lo, hi));
        // h4: 128-bit quarters, vector j in the low quarter and j + 4 in the high one.
        let x: [__m256; 4] = std::array::from_fn(|j| {
            let (a, b) = (h8[j], h8[j + 4]);
            _mm256_add_ps(
                _mm256_blend_ps::<0xF0>(a, b),
                _mm256_permute2f128_ps::<0x21>(a, b),
            )
        });
        // h2: 64-bit pairs.
        let y: [__m256; 2] = std::array::from_fn(|j| {
            let (a, b) = (_mm256_castps_pd(x[j]), _mm256_castps_pd(x[j + 2]));
            _mm256_add_ps(
                _mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
                _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)),
            )
        });
        // Final pair.
        let (a, b) = (y[0], y[1]);
        _mm256_add_ps(
            _mm256_shuffle_ps::<0b10_00_10_00>(a, b),
            _mm256_shuffle_ps::<0b11_01_11_01>(a, b),
        )
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn reduce16x8_matches_scalar_tree() {
            if !crate::cpu::Isa::Avx2.is_supported() {
                return;
            }
            // Magnitudes spread over many binades, so a different pairing would round
            // differently.
            let vals: Vec<[f32; 16]> = (0..8)
                .map(|t| {
                    std::array::from_fn(|i| {
                        let k = (t * 16 + i) as f32;
                        (k * 0.377).sin() * (k * 0.61).cos().abs().powi(8) * 1e4
                    })
                })
                .collect();
            let naive = |v: &[f32; 16]| v.iter().sum::<f32>();
            assert!(vals.iter().any(|v| super::super::reduce16(*v) != naive(v)));
            // SAFETY: AVX2 checked above.
            let mut regs = [[unsafe { _mm256_setzero_ps() }; 2]; 8];
            for (t, v) in vals.iter().enumerate() {
                // SAFETY: AVX2 checked above; 16 floats.
                regs[SLOT[t]] = unsafe {
                    [
                        _mm256_loadu_ps(v.as_ptr()),
                        _mm256_loadu_ps(v.as_ptr().add(8)),
                    ]
                };
            }
            let mut out = [0.0f32; 8];
            // SAFETY: AVX2 checked above.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), reduce16x8(&regs)) };
            for (t, v) in vals.iter().enumerate() {
                let want = super::super::reduce16(*v);
                assert_eq!(out[t].to_bits(), want.to_bits(), "lane {t}");
                let [lo, hi] = regs[SLOT[t]];
                // SAFETY: as above.
                let one = unsafe { reduce16(lo, hi) };
                assert_eq!(one.to_bits(), want.to_bits());
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    /// [`super::reduce16`] on a register.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(crate) fn reduce16(v: __m512) -> f32 {
        let h8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps::<1>(v));
        let h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps::<1>(h8));
        let h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
        _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps::<1>(h2, h2)))
    }

    /// Input slot of lane `t`'s vector in [`reduce16x16`]: the final stage leaves lanes 1 and
    /// 2 of each quad swapped, so callers put vector `t` in slot `SLOT[t]`.
    pub(crate) const SLOT: [usize; 16] = [0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15];

    /// Sixteen [`reduce16`]s at once: lane `t` of the result is the canonical reduction of the
    /// vector in slot `SLOT[t]`. Every add combines lanes of one input vector, in the same
    /// pairs as the scalar tree, so results are bit-identical to it.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn reduce16x16(v: &[__m512; 16]) -> __m512 {
        // h8: 256-bit halves.
        let mut x = [_mm512_setzero_ps(); 8];
        for (j, xj) in x.iter_mut().enumerate() {
            let (a, b) = (v[j], v[j + 8]);
            *xj = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
            );
        }
        // h4: 128-bit quarters.
        let lo = _mm512_set_epi32(27, 26, 25, 24, 11, 10, 9, 8, 19, 18, 17, 16, 3, 2, 1, 0);
        let hi = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 23, 22, 21, 20, 7, 6, 5, 4);
        let mut y = [_mm512_setzero_ps(); 4];
        for (j, yj) in y.iter_mut().enumerate() {
            let (a, b) = (x[j], x[j + 4]);
            *yj = _mm512_add_ps(
                _mm512_permutex2var_ps(a, lo, b),
                _mm512_permutex2var_ps(a, hi, b),
            );
        }
        // h2: 64-bit pairs.
        let mut z = [_mm512_setzero_ps(); 2];
        for (j, zj) in z.iter_mut().enumerate() {
            let (a, b) = (_mm512_castps_pd(y[j]), _mm512_castps_pd(y[j + 2]));
            *zj = _mm512_add_ps(
                _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
            );
        }
        // Final pair.
        let (a, b) = (z[0], z[1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(a, b),
            _mm512_shuffle_ps::<0b11_01_11_01>(a, b),
        )
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn reduce16x16_matches_scalar_tree() {
            if !crate::cpu::Isa::Avx512.is_supported() {
                return;
            }
            let vals: Vec<[f32; 16]> = (0..16)
                .map(|t| std::array::from_fn(|i| ((t * 16 + i) as f32 * 0.377).sin() * 1e3))
                .collect();
            let mut regs = [unsafe { _mm512_setzero_ps() }; 16];
            for (t, v) in vals.iter().enumerate() {
                // SAFETY: AVX-512 checked above.
                regs[SLOT[t]] = unsafe { _mm512_loadu_ps(v.as_ptr()) };
            }
            let mut out = [0.0f32; 16];
            // SAFETY: AVX-512 checked above.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr(), reduce16x16(&regs)) };
            for (t, v) in vals.iter().enumerate() {
                assert_eq!(
                    out[t].to_bits(),
                    super::super::reduce16(*v).to_bits(),
                    "lane {t}"
                );
                // SAFETY: as above.
                let one = unsafe { reduce16(_mm512_loadu_ps(v.as_ptr())) };
                assert_eq!(one.to_bits(), out[t].to_bits());
            }
        }
    }
}
