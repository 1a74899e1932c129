//! Row-wise elementwise ops: RMSNorm, softmax, SiLU·mul, residual add. Plain Rust compiled
//! for the best ISA (see `simd.rs`); reductions use fixed lane trees, so results do not depend
//! on the ISA or on which other rows are present.

use super::exp::exp;
use super::simd::multiversion;
use rayon::prelude::*;

/// Rows per rayon task; below two tasks' worth everything runs on the caller's thread.
const PAR_ELEMS: usize = 1 << 15;

/// `out = x / sqrt(mean(x²) + eps) * weight` for each row of `x` (rows of `weight.len()`).
/// Like ggml, squares are summed in f64. Panics on mismatched lengths.
pub fn rmsnorm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    assert!(d > 0, "rmsnorm: empty weight");
    assert_eq!(x.len() % d, 0, "rmsnorm: x is not whole rows");
    assert_eq!(out.len(), x.len(), "rmsnorm: out length");
    let rows_per_task = (PAR_ELEMS / d).max(1);
    if x.len() > 2 * PAR_ELEMS {
        x.par_chunks(rows_per_task * d)
            .zip(out.par_chunks_mut(rows_per_task * d))
            .for_each(|(x, o)| rmsnorm_rows(x, weight, eps, o));
    } else {
        rmsnorm_rows(x, weight, eps, out);
    }
}

multiversion! {
    fn rmsnorm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        for (xr, or) in x.chunks_exact(w.len()).zip(out.chunks_exact_mut(w.len())) {
            rmsnorm_row(xr, w, eps, or);
        }
    }
}

#[inline(always)]
fn rmsnorm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let sum = sum_f64(x, |v| v * v);
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &wv) in out.iter_mut().zip(x).zip(w) {
        *o = (v * scale) * wv;
    }
}

/// Sums `f(x[i])` in f64 over 8 lanes (element i into lane i % 8), then a fixed tree.
#[inline(always)]
fn sum_f64(x: &[f32], f: impl Fn(f32) -> f32) -> f64 {
    let mut l = [0.0f64; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for j in 0..8 {
            l[j] += f(c[j]) as f64;
        }
    }
    for (j, &v) in tail.iter().enumerate() {
        l[j] += f(v) as f64;
    }
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// In-place softmax over the whole slice (sum in f64, as ggml). No-op on an empty slice.
pub fn softmax(x: &mut [f32]) {
    if !x.is_empty() {
        softmax_inner(x);
    }
}

multiversion! {
    fn softmax_inner(x: &mut [f32]) {
        let max = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
        for v in x.iter_mut() {
            *v = exp(*v - max);
        }
        let inv = (1.0 / sum_f64(x, |v| v)) as f32;
        for v in x.iter_mut() {
            *v *= inv;
        }
    }
}

/// `out[t, i] = silu(gate_up[t, i]) * gate_up[t, inter + i]` with `gate_up = [n, 2*inter]`,
/// `out = [n, inter]`. Panics on mismatched lengths.
pub fn silu_mul(gate_up: &[f32], inter: usize, out: &mut [f32]) {
    assert!(inter > 0, "silu_mul: inter is 0");
    assert_eq!(
        gate_up.len() % (2 * inter),
        0,
        "silu_mul: gate_up is not [n, 2*inter]"
    );
    assert_eq!(
        out.len() * 2,
        gate_up.len(),
        "silu_mul: out is not [n, inter]"
    );
    // An `exp` and a division per element: worth splitting at smaller sizes than the other
    // ops (batched decode's [32, 1536] would otherwise leave the other threads idle).
    const SILU_PAR_ELEMS: usize = 1 << 13;
    if out.len() >= 2 * SILU_PAR_ELEMS && rayon::current_num_threads() > 1 {
        let rows = (SILU_PAR_ELEMS / inter).max(1);
        gate_up
            .par_chunks(rows * 2 * inter)
            .zip(out.par_chunks_mut(rows * inter))
            .for_each(|(g, o)| silu_rows_best(g, inter, o));
    } else {
        silu_rows_best(gate_up, inter, out);
    }
}

/// [`silu_rows`] through explicit AVX-512 when available (the compiler's vectorization of
/// the scalar `exp` leaves its float-to-int conversion scalar); bit-identical to it.
fn silu_rows_best(gate_up: &[f32], inter: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::Isa::detect().has_avx512() {
        // SAFETY: the features were detected at run time.
        unsafe { silu_rows_avx512(gate_up, inter, out) };
        return;
    }
    silu_rows(gate_up, inter, out);
}

/// `silu_rows` with 16 lanes at a time: `exp_avx512` is bit-identical to `exp`, and the
/// division and product are the same IEEE operations, in the same order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn silu_rows_avx512(gate_up: &[f32], inter: usize, out: &mut [f32]) {
    use super::exp::exp_avx512;
    use std::arch::x86_64::*;
    let sign = _mm512_set1_ps(-0.0);
    let one = _mm512_set1_ps(1.0);
    for (g, o) in gate_up
        .chunks_exact(2 * inter)
        .zip(out.chunks_exact_mut(inter))
    {
        let (gate, up) = g.split_at(inter);
        let n16 = inter / 16 * 16;
        for i in (0..n16).step_by(16) {
            // SAFETY: i + 16 <= inter, the length of `gate`, `up` and `o`.
            unsafe {
                let a = _mm512_loadu_ps(gate.as_ptr().add(i));
                let b = _mm512_loadu_ps(up.as_ptr().add(i));
                let e = exp_avx512(_mm512_xor_ps(a, sign));
                let r = _mm512_mul_ps(_mm512_div_ps(a, _mm512_add_ps(one, e)), b);
                _mm512_storeu_ps(o.as_mut_ptr().add(i), r);
            }
        }
        for ((o, &a), &b) in o[n16..].iter_mut().zip(&gate[n16..]).zip(&up[n16..]) {
            *o = a / (1.0 + exp(-a)) * b;
        }
    }
}

multiversion! {
    /// `gate_up` rows of `2 * inter`, `out` rows of `inter`.
    fn silu_rows(gate_up: &[f32], inter: usize, out: &mut [f32]) {
        for (g, o) in gate_up.chunks_exact(2 * inter).zip(out.chunks_exact_mut(inter)) {
            let (gate, up) = g.split_at(inter);
            for ((o, &a), &b) in o.iter_mut().zip(gate).zip(up) {
                *o = a / (1.0 + exp(-a)) * b;
            }
        }
    }
}

/// `x += y`. Panics if the lengths differ.
pub fn add_in_place(x: &mut [f32], y: &[f32]) {
    assert_eq!(x.len(), y.len(), "add_in_place: length mismatch");
    add_inner(x, y);
}

multiversion! {
    fn add_inner(x: &mut [f32], y: &[f32]) {
        for (a, &b) in x.iter_mut().zip(y) {
            *a += b;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rmsnorm_matches_f64() {
        let d = 37;
        let x: Vec<f32> = (0..3 * d).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
        let w: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 * 0.01).collect();
        let mut out = vec![0.0; x.len()];
        rmsnorm(&x, &w, 1e-5, &mut out);
        for r in 0..3 {
            let row = &x[r * d..(r + 1) * d];
            let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / d as f64;
            let s = 1.0 / (ms + 1e-5).sqrt();
            for i in 0..d {
                let want = row[i] as f64 * s * w[i] as f64;
                assert!((out[r * d + i] as f64 - want).abs() < 1e-5, "{r} {i}");
            }
        }
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin() * 20.0).collect();
        let want: Vec<f64> = {
            let m = x.iter().fold(f64::MIN, |a, &v| a.max(v as f64));
            let e: Vec<f64> = x.iter().map(|&v| (v as f64 - m).exp()).collect();
            let s: f64 = e.iter().sum();
            e.iter().map(|v| v / s).collect()
        };
        softmax(&mut x);
        for (g, w) in x.iter().zip(&want) {
            assert!((*g as f64 - w).abs() < 1e-6 * w.max(1e-3));
        }
        softmax(&mut []);
    }

    #[test]
    fn silu_mul_values() {
        let gu = [1.0f32, -2.0, 0.0, 3.0, 0.5, 4.0];
        let mut out = [0.0; 3];
        silu_mul(&gu, 3, &mut out);
        let silu = |a: f64| a / (1.0 + (-a).exp());
        let want = [silu(1.0) * 3.0, silu(-2.0) * 0.5, 0.0];
        for (g, w) in out.iter().zip(want) {
            assert!((*g as f64 - w).abs() < 1e-6);
        }
    }

    #[test]
    fn silu_mul_matches_scalar_bitwise() {
        let inter = 37;
        let gu: Vec<f32> = (0..3 * 2 * inter)
            .map(|i| ((i * 7919) % 2001) as f32 * 0.05 - 50.0)
            .collect();
        let mut out = vec![0.0; 3 * inter];
        silu_mul(&gu, inter, &mut out);
        for (t, o) in out.chunks_exact(inter).enumerate() {
            let (gate, up) = gu[t * 2 * inter..(t + 1) * 2 * inter].split_at(inter);
            for i in 0..inter {
                let (a, b) = (gate[i], up[i]);
                let want = a / (1.0 + exp(-a)) * b;
                assert_eq!(o[i].to_bits(), want.to_bits(), "row {t} col {i}: a={a}");
            }
        }
    }

    #[test]
    fn add() {
        let mut x = [1.0, 2.0];
        add_in_place(&mut x, &[0.5, -2.0]);
        assert_eq!(x, [1.5, 0.0]);
    }
}
