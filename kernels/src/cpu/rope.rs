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
    let table = rope_table(positions, head_dim, base);
    rope_with(x, &table, n_heads, head_dim, interleaved);
}

/// The `(cos, sin)` pairs [`rope`] rotates by, `[positions.len(), head_dim / 2]`. A forward
/// pass computes them once per step and hands them to [`rope_with`] for every layer's q and
/// k, instead of redoing identical `sin_cos`s per call.
///
/// Panics if `head_dim` is odd.
pub fn rope_table(positions: &[usize], head_dim: usize, base: f32) -> Vec<(f32, f32)> {
    assert!(head_dim.is_multiple_of(2), "rope: odd head_dim");
    let half = head_dim / 2;
    let mut table = vec![(0.0f32, 0.0f32); positions.len() * half];
    if half == 0 {
        return table;
    }
    let inv_freq: Vec<f64> = (0..half)
        .map(|i| (base as f64).powf(-2.0 * i as f64 / head_dim as f64))
        .collect();
    let token = |cs: &mut [(f32, f32)], pos: usize| {
        for (c, &f) in cs.iter_mut().zip(&inv_freq) {
            let (s, co) = (pos as f64 * f).sin_cos();
            *c = (co as f32, s as f32);
        }
    };
    if positions.len() >= 64 {
        table
            .par_chunks_mut(half)
            .zip(positions.par_iter())
            .with_min_len(16)
            .for_each(|(cs, &p)| token(cs, p));
    } else {
        for (cs, &p) in table.chunks_mut(half).zip(positions) {
            token(cs, p);
        }
    }
    table
}

/// [`rope`] with the rotations precomputed by [`rope_table`]; bit-identical to it.
///
/// Panics if `head_dim` is odd, `table` is not whole tokens of `head_dim / 2` pairs or `x` is
/// not `[tokens, n_heads * head_dim]` for those tokens.
pub fn rope_with(
    x: &mut [f32],
    table: &[(f32, f32)],
    n_heads: usize,
    head_dim: usize,
    interleaved: bool,
) {
    assert!(head_dim.is_multiple_of(2), "rope: odd head_dim");
    let row = n_heads * head_dim;
    let half = head_dim / 2;
    if row == 0 {
        return;
    }
    assert!(
        table.len().is_multiple_of(half),
        "rope: table is not whole tokens"
    );
    assert_eq!(
        x.len(),
        table.len() / half * row,
        "rope: x is not [n_tokens, n_heads*head_dim]"
    );
    if x.len() / row >= 64 {
        x.par_chunks_mut(row)
            .zip(table.par_chunks(half))
            .with_min_len(16)
            .for_each(|(xt, cs)| rotate(xt, cs, interleaved));
    } else {
        for (xt, cs) in x.chunks_mut(row).zip(table.chunks(half)) {
            rotate(xt, cs, interleaved);
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
