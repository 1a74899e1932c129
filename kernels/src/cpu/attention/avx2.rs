//! AVX2 attention for one task: the three passes of `avx512.rs`, with each 16-lane vector
//! held as two 8-lane halves `[lo, hi]` (lanes 0..8 and 8..16), so every output follows the
//! same canonical arithmetic:
//! 1. scores: each chunk of 16 K rows is converted to f32 once; per query and row the
//!    canonical `dot16` as two FMA chains, eight rows folded at a time by one transposing
//!    reduction into a vector of 8 scores;
//! 2. softmax per query with positions in the lanes (16-lane class sums for `l`, masks as a
//!    computed lane mask), then the probabilities rounded to f16 as ggml does;
//! 3. P·V with head_dim in the lanes, 32 columns at a time, two queries of a row sharing each
//!    V load (16 registers only: more would spill).

use super::{AttentionSeq, Ctx, Task, LANES, SCORES};
use crate::cpu::exp::exp_avx2;
use crate::cpu::lanes::avx2::{reduce16, reduce16x8, SLOT};
use crate::cpu::par::{return_scratch, take_scratch};
use half::f16;
use std::arch::x86_64::*;

/// Head sizes with a specialised kernel, as for AVX-512; others run portable.
pub(super) fn supports(shape: &super::AttentionShape) -> bool {
    matches!(shape.head_dim, 32 | 64 | 96 | 128)
}

/// # Safety
/// AVX2, FMA and F16C must be available; the task must own its output.
pub(super) unsafe fn task(ctx: &Ctx, s: &AttentionSeq, t: &Task) {
    // SAFETY: forwarded.
    unsafe {
        match ctx.shape.head_dim / 16 {
            2 => task_d::<2>(ctx, s, t),
            4 => task_d::<4>(ctx, s, t),
            6 => task_d::<6>(ctx, s, t),
            _ => task_d::<8>(ctx, s, t),
        }
    }
}

/// `D` 16-lane vectors per head vector.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn task_d<const D: usize>(ctx: &Ctx, s: &AttentionSeq, t: &Task) {
    let sh = &ctx.shape;
    let hd = D * 16;
    let scale = 1.0 / (hd as f32).sqrt();
    let nv = t.n_rows * t.n_heads;
    // Query vector v = (row r, head hh), v = r * n_heads + hh, at position p(v).
    let first_pos = s.start_pos + t.row0;
    let pos_of = |v: usize| first_pos + v / t.n_heads;
    let npos = first_pos + t.n_rows;
    let nchunks = npos.div_ceil(LANES);
    let stride = nchunks * LANES;

    let mut buf = take_scratch(&SCORES);
    buf.clear();
    buf.resize(nv * stride + 2 * nv * hd + LANES * hd, 0.0);
    let (sc, rest) = buf.split_at_mut(nv * stride);
    let (qs, rest) = rest.split_at_mut(nv * hd);
    let (acc, kv) = rest.split_at_mut(nv * hd);
    for v in 0..nv {
        let row = s.q_offset + t.row0 + v / t.n_heads;
        let h = t.h0 + v % t.n_heads;
        let q = &ctx.q[row * sh.q_row() + h * hd..][..hd];
        for (a, &b) in qs[v * hd..(v + 1) * hd].iter_mut().zip(q) {
            *a = f16::from_f32(b).to_f32();
        }
    }

    // SAFETY: cache rows come from the validated block table; all scratch indexing stays
    // inside the slices carved above; output writes are this task's (row, head) slots.
    unsafe {
        // 1. Scores. A half chunk wholly past a query's position is skipped (left 0, masked).
        for c in 0..nchunks {
            load_chunk::<D>(ctx, s, t, ctx.k, kv, c * LANES, npos);
            for v in 0..nv {
                let p = pos_of(v);
                if p < c * LANES {
                    continue;
                }
                let out = sc.as_mut_ptr().add(v * stride + c * LANES);
                let q = qs.as_ptr().add(v * hd);
                scores8::<D>(q, kv.as_ptr(), out);
                if p >= c * LANES + 8 {
                    scores8::<D>(q, kv.as_ptr().add(8 * hd), out.add(8));
                }
            }
        }

        // 2. Softmax per query over positions 0..=p; probabilities rounded to f16.
        let scale = _mm256_set1_ps(scale);
        let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
        let all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        let lane = [
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15),
        ];
        for v in 0..nv {
            let p = pos_of(v);
            let row = sc.as_mut_ptr().add(v * stride);
            let last = p / LANES;
            // Lanes 0..=p % 16 of the last chunk.
            let n = _mm256_set1_epi32((p % LANES) as i32 + 1);
            let tail = lane.map(|l| _mm256_castsi256_ps(_mm256_cmpgt_epi32(n, l)));
            let mask = |c: usize| if c == last { tail } else { [all; 2] };
            let mut mx = [ninf; 2];
            for c in 0..=last {
                let m = mask(c);
                for (h, mx) in mx.iter_mut().enumerate() {
                    let x = _mm256_mul_ps(_mm256_loadu_ps(row.add(c * LANES + 8 * h)), scale);
                    *mx = _mm256_max_ps(*mx, _mm256_blendv_ps(ninf, x, m[h]));
                }
            }
            let mx = _mm256_set1_ps(hmax(_mm256_max_ps(mx[0], mx[1])));
            let mut cls = [_mm256_setzero_ps(); 2];
            for c in 0..=last {
                let m = mask(c);
                for (h, cls) in cls.iter_mut().enumerate() {
                    let r = row.add(c * LANES + 8 * h);
                    let x = _mm256_mul_ps(_mm256_loadu_ps(r), scale);
                    let e = _mm256_and_ps(exp_avx2(_mm256_sub_ps(x, mx)), m[h]);
                    _mm256_storeu_ps(r, e);
                    *cls = _mm256_add_ps(*cls, e);
                }
            }
            let inv_l = _mm256_set1_ps(1.0 / reduce16(cls[0], cls[1]));
            for i in 0..2 * (last + 1) {
                let r = row.add(8 * i);
                let e = _mm256_mul_ps(_mm256_loadu_ps(r), inv_l);
                let w = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(e));
                _mm256_storeu_ps(r, w);
            }
        }

        // 3. P·V, row by row; the heads of a row share p and each converted V row.
        for c in 0..nchunks {
            load_chunk::<D>(ctx, s, t, ctx.v, kv, c * LANES, npos);
            for r in 0..t.n_rows {
                let p = first_pos + r;
                if p < c * LANES {
                    continue;
                }
                let tmax = LANES.min(p + 1 - c * LANES);
                let mut h = 0;
                while h < t.n_heads {
                    let g = 2.min(t.n_heads - h);
                    let v = r * t.n_heads + h;
                    let e = sc.as_ptr().add(v * stride + c * LANES);
                    for col in (0..hd).step_by(32) {
                        let a = acc.as_mut_ptr().add(v * hd + col);
                        let vr = kv.as_ptr().add(col);
                        match g {
                            1 => pv::<1>(a, hd, e, stride, vr, tmax),
                            _ => pv::<2>(a, hd, e, stride, vr, tmax),
                        }
                    }
                    h += g;
                }
            }
        }

        for v in 0..nv {
            let row = s.q_offset + t.row0 + v / t.n_heads;
            let h = t.h0 + v % t.n_heads;
            let o = ctx.out.get().add(row * sh.q_row() + h * hd);
            std::ptr::copy_nonoverlapping(acc.as_ptr().add(v * hd), o, hd);
        }
    }
    return_scratch(&SCORES, buf);
}

/// The largest of 8 lanes.
#[inline]
#[target_feature(enable = "avx")]
fn hmax(v: __m256) -> f32 {
    let m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps::<1>(m2, m2)))
}

/// Converts the 16 cache rows from position `pos0` (zeros from `npos` on) into `kv` as f32.
#[inline]
#[target_feature(enable = "avx,f16c")]
unsafe fn load_chunk<const D: usize>(
    ctx: &Ctx,
    s: &AttentionSeq,
    t: &Task,
    cache: &[f16],
    kv: &mut [f32],
    pos0: usize,
    npos: usize,
) {
    let sh = &ctx.shape;
    let hd = D * 16;
    assert!(kv.len() >= LANES * hd);
    // The blocks are scattered, so hardware prefetchers cannot guess the next chunk: fetch
    // the rows two chunks ahead while this one converts.
    let ahead = pos0 + 2 * LANES;
    for i in 0..LANES {
        let pos = ahead + i;
        if pos >= npos {
            break;
        }
        let block = s.block_table[pos / sh.block_size] as usize;
        let src = cache
            .as_ptr()
            .wrapping_add(sh.cache_offset(block, t.kv, pos % sh.block_size));
        for line in (0..hd * 2).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(src.cast::<i8>().wrapping_add(line));
        }
    }
    for i in 0..LANES {
        let pos = pos0 + i;
        // SAFETY: `kv` holds 16 rows of hd; cache rows come from the validated block table.
        unsafe {
            let dst = kv.as_mut_ptr().add(i * hd);
            if pos < npos {
                let block = s.block_table[pos / sh.block_size] as usize;
                let src = cache
                    .as_ptr()
                    .add(sh.cache_offset(block, t.kv, pos % sh.block_size));
                for j in 0..2 * D {
                    let h = _mm_loadu_si128(src.add(8 * j).cast());
                    _mm256_storeu_ps(dst.add(8 * j), _mm256_cvtph_ps(h));
                }
            } else {
                for j in 0..2 * D {
                    _mm256_storeu_ps(dst.add(8 * j), _mm256_setzero_ps());
                }
            }
        }
    }
}

/// Scores of one query (`q`, hd floats) against 8 f32 key rows (`k`, stride hd) into
/// `out[0..8]`: per row the canonical `dot16` (lane-wise FMA chains, then the fixed tree).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn scores8<const D: usize>(q: *const f32, k: *const f32, out: *mut f32) {
    let hd = D * 16;
    // SAFETY: q has hd floats, k has 8 * hd, out has 8.
    unsafe {
        let mut part = [[_mm256_setzero_ps(); 2]; 8];
        for (t, &slot) in SLOT.iter().enumerate() {
            let kr = k.add(t * hd);
            let mut a = [_mm256_setzero_ps(); 2];
            for j in 0..D {
                for (h, a) in a.iter_mut().enumerate() {
                    let o = 16 * j + 8 * h;
                    *a = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(o)), _mm256_loadu_ps(kr.add(o)), *a);
                }
            }
            part[slot] = a;
        }
        _mm256_storeu_ps(out, reduce16x8(&part));
    }
}

/// `acc[g][0..32] += Σ_{t < tmax} e[g][t] * v[t][0..32]` for `G` queries, in position order.
/// `acc` rows are `hd` apart, `e` rows `e_stride` apart, `v` rows `hd` apart.
#[inline]
#[target_feature(enable = "avx,fma")]
unsafe fn pv<const G: usize>(
    acc: *mut f32,
    hd: usize,
    e: *const f32,
    e_stride: usize,
    v: *const f32,
    tmax: usize,
) {
    // SAFETY: the caller sizes every buffer for G queries, tmax rows and 32 columns.
    unsafe {
        let mut a = [[_mm256_setzero_ps(); 4]; G];
        for (g, ag) in a.iter_mut().enumerate() {
            for (j, r) in ag.iter_mut().enumerate() {
                *r = _mm256_loadu_ps(acc.add(g * hd + 8 * j));
            }
        }
        for t in 0..tmax {
            let mut vr = [_mm256_setzero_ps(); 4];
            for (j, r) in vr.iter_mut().enumerate() {
                *r = _mm256_loadu_ps(v.add(t * hd + 8 * j));
            }
            for (g, ag) in a.iter_mut().enumerate() {
                let w = _mm256_set1_ps(*e.add(g * e_stride + t));
                for (r, &x) in ag.iter_mut().zip(&vr) {
                    *r = _mm256_fmadd_ps(w, x, *r);
                }
            }
        }
        for (g, ag) in a.iter().enumerate() {
            for (j, &r) in ag.iter().enumerate() {
                _mm256_storeu_ps(acc.add(g * hd + 8 * j), r);
            }
        }
    }
}
