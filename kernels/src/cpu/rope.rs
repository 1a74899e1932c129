//! Rotary position embedding.

use super::simd::multiversion;
use rayon::prelude::*;

/// Rotary embedding in place on `x = [n_tokens, n_heads * head_dim]`; token `t` is at
/// `positions[t]`. `interleaved = true` rotates pairs `(2i, 2i+1)` (GGUF llama, llama.cpp's
/// "normal" mode); `false` rotates `(i, i + head_dim/2)` (NEOX / Hugging Face).
///
/// `theta_i = pos * base^(-2i/head_dim)` is computed in f64 and its cos/sin rounded to f32,
/// so angles stay exact at long positions (llama.cpp accumulates them in f32). Then
/// `x0' = x0 cos - x1 sin`, `x1' = x0 sin + x1 cos` in f32.
///
/// Panics if `head_dim` is odd or `x.len() != positions.len() * n_heads * head_dim`.
pub fn rope(
    x: &mut [f32],
    positions: &[usize],
    n_heads: usize,
    head_dim: usize,
    base: f32,
    interleaved: bool,
) {
    assert!(head_dim.is_multiple_of(2), "rope: odd head_dim");
    let row = n_heads * head_dim;
    assert_eq!(
        x.len(),
        positions.len() * row,
        "rope: x is not [n_tokens, n_heads*head_dim]"
    );
    if row == 0 {
        return;
    }
    let half = head_dim / 2;
    let inv_freq: Vec<f64> = (0..half)
        .map(|i| (base as f64).powf(-2.0 * i as f64 / head_dim as f64))
        .collect();
    let token = |xt: &mut [f32], pos: usize| {
        let mut cs = vec![(0.0f32, 0.0f32); half];
        for (c, &f) in cs.iter_mut().zip(&inv_freq) {
            let (s, co) = (pos as f64 * f).sin_cos();
            *c = (co as f32, s as f32);
        }
        rotate(xt, &cs, interleaved);
    };
    if positions.len() >= 64 {
        x.par_chunks_mut(row)
            .zip(positions.par_iter())
            .with_min_len(16)
            .for_each(|(xt, &p)| token(xt, p));
    } else {
        for (xt, &p) in x.chunks_mut(row).zip(positions) {
            token(xt, p);
        }
    }
}

multiversion! {
    /// Rotates every head of one token by the (cos, sin) pairs `cs`.
    fn rotate(xt: &mut [f32], cs: &[(f32, f32)], interleaved: bool) {
        let half = cs.len();
        for h in xt.chunks_exact_mut(2 * half) {
            if interleaved {
                for (p, &(c, s)) in h.chunks_exact_mut(2).zip(cs) {
                    let (x0, x1) = (p[0], p[1]);
                    p[0] = x0 * c - x1 * s;
                    p[1] = x0 * s + x1 * c;
                }
            } else {
                let (lo, hi) = h.split_at_mut(half);
                for ((a, b), &(c, s)) in lo.iter_mut().zip(hi.iter_mut()).zip(cs) {
                    let (x0, x1) = (*a, *b);
                    *a = x0 * c - x1 * s;
                    *b = x0 * s + x1 * c;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(x: &[f32], pos: usize, hd: usize, base: f64, interleaved: bool) -> Vec<f64> {
        let mut y: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        for i in 0..hd / 2 {
            let th = pos as f64 * base.powf(-2.0 * i as f64 / hd as f64);
            let (a, b) = if interleaved {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + hd / 2)
            };
            let (x0, x1) = (x[a] as f64, x[b] as f64);
            y[a] = x0 * th.cos() - x1 * th.sin();
            y[b] = x0 * th.sin() + x1 * th.cos();
        }
        y
    }

    #[test]
    fn matches_f64_both_modes() {
        let (hd, heads) = (64, 3);
        let positions: Vec<usize> = vec![0, 1, 17, 4095, 100_000];
        for interleaved in [true, false] {
            let x: Vec<f32> = (0..positions.len() * heads * hd)
                .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
                .collect();
            let mut y = x.clone();
            rope(&mut y, &positions, heads, hd, 10000.0, interleaved);
            for (t, &p) in positions.iter().enumerate() {
                for h in 0..heads {
                    let o = (t * heads + h) * hd;
                    let want = reference(&x[o..o + hd], p, hd, 10000.0, interleaved);
                    for (g, w) in y[o..o + hd].iter().zip(&want) {
                        assert!((*g as f64 - w).abs() < 1e-6, "pos {p}");
                    }
                }
            }
        }
    }

    #[test]
    fn position_zero_is_identity() {
        let x: Vec<f32> = (0..128).map(|i| i as f32).collect();
        let mut y = x.clone();
        rope(&mut y, &[0], 2, 64, 10000.0, true);
        assert_eq!(x, y);
    }
}
