//! One exp approximation shared by softmax, attention and SiLU, in a scalar, an AVX2 and an
//! AVX-512 form that give bit-identical results (same operations, no FMA contraction).
//!
//! Cody-Waite range reduction `x = n ln2 + r`, |r| <= ln2/2, then Cephes' degree-5 minimax
//! polynomial (about 1 ulp). Inputs are clamped to [-87, 88] so `2^n` stays a normal float.

const LO: f32 = -87.0;
const HI: f32 = 88.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln2 split so that `n * LN2_HI` is exact for |n| < 2^14.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Adding and subtracting 1.5 * 2^23 rounds to the nearest integer, ties to even.
const ROUND: f32 = 12_582_912.0;
const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `e^x` to about 1 ulp for x in [-87, 88]; clamped outside; NaN stays NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let x = x.clamp(LO, HI);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = P[0];
    for c in &P[1..] {
        p = p * r + c;
    }
    let y = (p * (r * r) + r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

/// `exp` on 16 lanes; bit-identical to the scalar version for non-NaN inputs.
///
/// # Safety
/// The CPU must support AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn exp_avx512(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(LO)), _mm512_set1_ps(HI));
    let round = _mm512_set1_ps(ROUND);
    let n = _mm512_sub_ps(
        _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), round),
        round,
    );
    let r = _mm512_sub_ps(
        _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(LN2_HI))),
        _mm512_mul_ps(n, _mm512_set1_ps(LN2_LO)),
    );
    let mut p = _mm512_set1_ps(P[0]);
    for &c in &P[1..] {
        p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c));
    }
    let y = _mm512_add_ps(
        _mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r),
        _mm512_set1_ps(1.0),
    );
    let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
        _mm512_cvttps_epi32(n),
        _mm512_set1_epi32(127),
    ));
    _mm512_mul_ps(y, _mm512_castsi512_ps(e))
}

/// `exp` on 8 lanes; bit-identical to the scalar version for non-NaN inputs. Plain mul + add,
/// never FMA: the scalar version rounds after each.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn exp_avx2(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(LO)), _mm256_set1_ps(HI));
    let round = _mm256_set1_ps(ROUND);
    let n = _mm256_sub_ps(
        _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), round),
        round,
    );
    let r = _mm256_sub_ps(
        _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(LN2_HI))),
        _mm256_mul_ps(n, _mm256_set1_ps(LN2_LO)),
    );
    let mut p = _mm256_set1_ps(P[0]);
    for &c in &P[1..] {
        p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
    }
    let y = _mm256_add_ps(
        _mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r),
        _mm256_set1_ps(1.0),
    );
    let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvttps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    _mm256_mul_ps(y, _mm256_castsi256_ps(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn close_to_std() {
        let mut x = -87.0f32;
        while x <= 88.0 {
            let (got, want) = (exp(x), (x as f64).exp());
            assert!(
                ((got as f64 - want) / want).abs() < 3e-7,
                "x={x} got={got} want={want}"
            );
            x += 0.0137;
        }
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-1000.0) < 1e-37);
        assert!(exp(1000.0).is_finite());
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_matches_scalar() {
        use std::arch::x86_64::*;
        if !crate::cpu::Isa::Avx512.is_supported() {
            return;
        }
        let xs: Vec<f32> = (0..4096).map(|i| (i as f32 - 2048.0) * 0.0473).collect();
        for c in xs.chunks_exact(16) {
            let mut got = [0.0f32; 16];
            // SAFETY: AVX-512 checked above; 16-element buffers.
            unsafe { _mm512_storeu_ps(got.as_mut_ptr(), exp_avx512(_mm512_loadu_ps(c.as_ptr()))) };
            for (g, &x) in got.iter().zip(c) {
                assert_eq!(g.to_bits(), exp(x).to_bits(), "x={x}");
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_matches_scalar() {
        use std::arch::x86_64::*;
        if !crate::cpu::Isa::Avx2.is_supported() {
            return;
        }
        // Past both clamps, and through the rounding of n at half-integer multiples of ln2.
        let mut xs: Vec<f32> = (0..4096).map(|i| (i as f32 - 2048.0) * 0.0473).collect();
        xs.extend((-128..128).map(|i| (i as f32 + 0.5) * std::f32::consts::LN_2));
        for c in xs.chunks_exact(8) {
            let mut got = [0.0f32; 8];
            // SAFETY: AVX2 checked above; 8-element buffers.
            unsafe { _mm256_storeu_ps(got.as_mut_ptr(), exp_avx2(_mm256_loadu_ps(c.as_ptr()))) };
            for (g, &x) in got.iter().zip(c) {
                assert_eq!(g.to_bits(), exp(x).to_bits(), "x={x}");
            }
        }
    }
}
