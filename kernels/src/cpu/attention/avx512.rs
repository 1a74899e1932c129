//! AVX-512 attention for one task (up to 16 query vectors of one GQA group), in three passes
//! over the positions, 16 at a time:
//! 1. scores: each chunk of 16 K rows is converted to f32 once; for each query, 16 lane-wise
//!    FMA chains (head_dim in the lanes) are folded by one transposing reduction into a vector
//!    of 16 scores — the canonical `dot16` per lane, with positions in the lanes;
//! 2. softmax per query with positions in the lanes (16-lane class sums for `l`), then the
//!    probabilities rounded to f16 as ggml does;
//! 3. P·V with head_dim in the lanes, queries of one row sharing each converted V row.

use super::{AttentionSeq, Ctx, Task, LANES, SCORES};
use crate::cpu::exp::exp_avx512;
use crate::cpu::lanes::avx512::{reduce16, reduce16x16, SLOT};
use crate::cpu::par::{return_scratch, take_scratch};
use half::f16;
use std::arch::x86_64::*;

/// Head sizes with a specialised kernel (multiples of 16 up to 128); others run portable.
pub(super) fn supports(shape: &super::AttentionShape) -> bool {
    matches!(shape.head_dim, 32 | 64 | 96 | 128)
}

/// # Safety
/// AVX-512 F/BW/DQ/VL, FMA and F16C must be available; the task must own its output.
/// `next`: the task this thread probably runs next, whose cache rows it prefetches.
pub(super) unsafe fn task(
    ctx: &Ctx,
    s: &AttentionSeq,
    t: &Task,
    next: Option<(&AttentionSeq, &Task)>,
) {
    // SAFETY: forwarded.
    unsafe {
        match ctx.shape.head_dim / 16 {
            2 => task_d::<2, 4>(ctx, s, t, next),
            4 => task_d::<4, 4>(ctx, s, t, next),
            6 => task_d::<6, 2>(ctx, s, t, next),
            _ => task_d::<8, 2>(ctx, s, t, next),
        }
    }
}

/// Positions a task attends over (its last query row's, plus one).
fn task_positions(s: &AttentionSeq, t: &Task) -> usize {
    s.start_pos + t.row0 + t.n_rows
}

/// During chunk `c` of `n` of one pass over this task, prefetches into L2 the matching share of
/// the next task's rows from `cache` (its K during the K pass, its V during the V pass), so
/// the next task starts on cached rows instead of waiting on memory for its first chunks.
#[inline(always)]
fn prefetch_next(
    ctx: &Ctx,
    next: Option<(&AttentionSeq, &Task)>,
    cache: &[f16],
    c: usize,
    n: usize,
) {
    let Some((ns, nt)) = next else { return };
    let npos = task_positions(ns, nt);
    let nn = npos.div_ceil(LANES);
    if 2 * npos * ctx.shape.head_dim * 2 > V_EARLY_BYTES {
        return; // too big to hold in L2 until it runs
    }
    for nc in c * nn / n..(c + 1) * nn / n {
        prefetch_chunk::<_MM_HINT_T1>(ctx, ns, nt, cache, nc * LANES, npos);
    }
}

/// `D` registers per head vector; P·V handles up to `G` queries of a row per pass.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")]
unsafe fn task_d<const D: usize, const G: usize>(
    ctx: &Ctx,
    s: &AttentionSeq,
    t: &Task,
    next: Option<(&AttentionSeq, &Task)>,
) {
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
    // Only `acc` must start at zero: every other slot is written before it is read, and
    // zeroing all of it costs as much as a short decode task's arithmetic.
    let len = nv * stride + 2 * nv * hd + LANES * hd;
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    let (sc, rest) = buf.split_at_mut(nv * stride);
    let (qs, rest) = rest.split_at_mut(nv * hd);
    let (acc, kv) = rest.split_at_mut(nv * hd);
    acc.fill(0.0);
    for v in 0..nv {
        let row = s.q_offset + t.row0 + v / t.n_heads;
        let h = t.h0 + v % t.n_heads;
        let q = &ctx.q[row * sh.q_row() + h * hd..][..hd];
        for j in 0..D {
            // SAFETY: `q` and this query's slot of `qs` hold hd = 16 * D floats.
            unsafe {
                let x = _mm512_loadu_ps(q.as_ptr().add(16 * j));
                let x = _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x));
                _mm512_storeu_ps(qs.as_mut_ptr().add(v * hd + 16 * j), x);
            }
        }
    }

    // SAFETY: cache rows come from the validated block table; all scratch indexing stays
    // inside the slices carved above; output writes are this task's (row, head) slots.
    unsafe {
        // The task's K and V are scattered blocks, so hardware prefetchers cannot follow
        // them: fetch two chunks ahead explicitly. When K and V together fit in L2, V is
        // fetched during the K pass too, so the P·V pass never waits on memory.
        let v_early = 2 * npos * hd * 2 <= V_EARLY_BYTES;
        for c in 0..AHEAD {
            prefetch_chunk::<_MM_HINT_T0>(ctx, s, t, ctx.k, c * LANES, npos);
            if v_early {
                prefetch_chunk::<_MM_HINT_T1>(ctx, s, t, ctx.v, c * LANES, npos);
            }
        }

        // 1. Scores.
        for c in 0..nchunks {
            prefetch_chunk::<_MM_HINT_T0>(ctx, s, t, ctx.k, (c + AHEAD) * LANES, npos);
            if v_early {
                prefetch_chunk::<_MM_HINT_T1>(ctx, s, t, ctx.v, (c + AHEAD) * LANES, npos);
            }
            prefetch_next(ctx, next, ctx.k, c, nchunks);
            load_chunk::<D>(ctx, s, t, ctx.k, kv, c * LANES, npos);
            for v in 0..nv {
                if pos_of(v) < c * LANES {
                    continue;
                }
                let out = sc.as_mut_ptr().add(v * stride + c * LANES);
                scores16::<D>(qs.as_ptr().add(v * hd), kv.as_ptr(), out);
            }
        }

        // 2. Softmax per query over positions 0..=p; probabilities rounded to f16.
        let scale = _mm512_set1_ps(scale);
        for v in 0..nv {
            let p = pos_of(v);
            let row = sc.as_mut_ptr().add(v * stride);
            let last = p / LANES;
            let tail: __mmask16 = ((1u32 << (p % LANES + 1)) - 1) as u16;
            let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
            for c in 0..=last {
                let m = if c == last { tail } else { 0xFFFF };
                let x = _mm512_mul_ps(_mm512_loadu_ps(row.add(c * LANES)), scale);
                mx = _mm512_mask_max_ps(mx, m, mx, x);
            }
            let mx = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
            let mut cls = _mm512_setzero_ps();
            for c in 0..=last {
                let m = if c == last { tail } else { 0xFFFF };
                let x = _mm512_mul_ps(_mm512_loadu_ps(row.add(c * LANES)), scale);
                let e = _mm512_maskz_mov_ps(m, exp_avx512(_mm512_sub_ps(x, mx)));
                _mm512_storeu_ps(row.add(c * LANES), e);
                cls = _mm512_add_ps(cls, e);
            }
            let inv_l = _mm512_set1_ps(1.0 / reduce16(cls));
            for c in 0..=last {
                let e = _mm512_mul_ps(_mm512_loadu_ps(row.add(c * LANES)), inv_l);
                let w = _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(e));
                _mm512_storeu_ps(row.add(c * LANES), w);
            }
        }

        // 3. P·V, row by row; the heads of a row share p and each converted V row.
        if !v_early {
            for c in 0..AHEAD {
                prefetch_chunk::<_MM_HINT_T0>(ctx, s, t, ctx.v, c * LANES, npos);
            }
        }
        for c in 0..nchunks {
            if !v_early {
                prefetch_chunk::<_MM_HINT_T0>(ctx, s, t, ctx.v, (c + AHEAD) * LANES, npos);
            }
            prefetch_next(ctx, next, ctx.v, c, nchunks);
            load_chunk::<D>(ctx, s, t, ctx.v, kv, c * LANES, npos);
            for r in 0..t.n_rows {
                let p = first_pos + r;
                if p < c * LANES {
                    continue;
                }
                let tmax = LANES.min(p + 1 - c * LANES);
                let mut h = 0;
                while h < t.n_heads {
                    let g = G.min(t.n_heads - h);
                    let v = r * t.n_heads + h;
                    let a = acc.as_mut_ptr().add(v * hd);
                    let e = sc.as_ptr().add(v * stride + c * LANES);
                    let vr = kv.as_ptr();
                    match g {
                        1 => pv::<D, 1>(a, hd, e, stride, vr, tmax),
                        2 => pv::<D, 2>(a, hd, e, stride, vr, tmax),
                        3 => pv::<D, 3>(a, hd, e, stride, vr, tmax),
                        _ => pv::<D, 4>(a, hd, e, stride, vr, tmax),
                    }
                    h += g;
                }
            }
        }

        for v in 0..nv {
            let row = s.q_offset + t.row0 + v / t.n_heads;
            let h = t.h0 + v % t.n_heads;
            let o = ctx.out.get().add(row * sh.q_row() + h * hd);
            for j in 0..D {
                let x = _mm512_loadu_ps(acc.as_ptr().add(v * hd + 16 * j));
                _mm512_storeu_ps(o.add(16 * j), x);
            }
        }
    }
    return_scratch(&SCORES, buf);
}

/// Chunks a pass prefetches ahead of the one it converts (6 measured no better).
const AHEAD: usize = 2;

/// K plus V bytes of a task up to which V is prefetched (into L2) during the K pass.
const V_EARLY_BYTES: usize = 256 << 10;

/// Start of the cache row of `pos` (below the sequence's validated length).
#[inline(always)]
fn row_ptr(ctx: &Ctx, s: &AttentionSeq, t: &Task, cache: &[f16], pos: usize) -> *const f16 {
    let sh = &ctx.shape;
    // Block sizes are powers of two in practice: a shift and a mask instead of a division.
    let (b, slot) = if sh.block_size.is_power_of_two() {
        let sh_bits = sh.block_size.trailing_zeros();
        (pos >> sh_bits, pos & (sh.block_size - 1))
    } else {
        (pos / sh.block_size, pos % sh.block_size)
    };
    let block = s.block_table[b] as usize;
    cache
        .as_ptr()
        .wrapping_add(sh.cache_offset(block, t.kv, slot))
}

/// Prefetches the cache rows of chunk `pos0..pos0 + 16` below `npos` with hint `H`.
#[inline(always)]
fn prefetch_chunk<const H: i32>(
    ctx: &Ctx,
    s: &AttentionSeq,
    t: &Task,
    cache: &[f16],
    pos0: usize,
    npos: usize,
) {
    let row_bytes = ctx.shape.head_dim * 2;
    for pos in pos0..npos.min(pos0 + LANES) {
        let src = row_ptr(ctx, s, t, cache, pos).cast::<i8>();
        for line in (0..row_bytes).step_by(64) {
            // SAFETY: a prefetch is a hint; it never faults.
            unsafe { _mm_prefetch::<H>(src.wrapping_add(line)) };
        }
    }
}

/// Converts the 16 cache rows from position `pos0` (zeros from `npos` on) into `kv` as f32.
#[inline]
#[target_feature(enable = "avx512f,f16c")]
unsafe fn load_chunk<const D: usize>(
    ctx: &Ctx,
    s: &AttentionSeq,
    t: &Task,
    cache: &[f16],
    kv: &mut [f32],
    pos0: usize,
    npos: usize,
) {
    let hd = D * 16;
    assert!(kv.len() >= LANES * hd);
    for i in 0..LANES {
        let pos = pos0 + i;
        // SAFETY: `kv` holds 16 rows of hd; cache rows come from the validated block table.
        unsafe {
            let dst = kv.as_mut_ptr().add(i * hd);
            if pos < npos {
                let src = row_ptr(ctx, s, t, cache, pos);
                for j in 0..D {
                    _mm512_storeu_ps(dst.add(16 * j), load_f16x16(src.add(16 * j)));
                }
            } else {
                for j in 0..D {
                    _mm512_storeu_ps(dst.add(16 * j), _mm512_setzero_ps());
                }
            }
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,f16c")]
unsafe fn load_f16x16(p: *const f16) -> __m512 {
    // SAFETY: the caller guarantees 16 readable halves.
    _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(p.cast()) })
}

/// Scores of one query (`q`, hd floats) against 16 f32 key rows (`k`, stride hd) into
/// `out[0..16]`: per row the canonical `dot16` (lane-wise FMA chain, then the fixed tree).
#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma")]
unsafe fn scores16<const D: usize>(q: *const f32, k: *const f32, out: *mut f32) {
    let hd = D * 16;
    // SAFETY: q has hd floats, k has 16 * hd, out has 16.
    unsafe {
        let mut qv = [_mm512_setzero_ps(); D];
        for (j, r) in qv.iter_mut().enumerate() {
            *r = _mm512_loadu_ps(q.add(16 * j));
        }
        let mut part = [_mm512_setzero_ps(); 16];
        for (t, &slot) in SLOT.iter().enumerate() {
            let kr = k.add(t * hd);
            let mut a = _mm512_setzero_ps();
            for (j, &qj) in qv.iter().enumerate() {
                a = _mm512_fmadd_ps(qj, _mm512_loadu_ps(kr.add(16 * j)), a);
            }
            part[slot] = a;
        }
        _mm512_storeu_ps(out, reduce16x16(&part));
    }
}

/// `acc[g] += Σ_{t < tmax} e[g][t] * v[t]` for `G` queries, in position order.
/// `acc` rows are `hd` apart, `e` rows `e_stride` apart, `v` rows `hd` apart.
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn pv<const D: usize, const G: usize>(
    acc: *mut f32,
    hd: usize,
    e: *const f32,
    e_stride: usize,
    v: *const f32,
    tmax: usize,
) {
    // SAFETY: the caller sizes every buffer for G queries, tmax rows and hd columns.
    unsafe {
        let mut a = [[_mm512_setzero_ps(); D]; G];
        for (g, ag) in a.iter_mut().enumerate() {
            for (j, r) in ag.iter_mut().enumerate() {
                *r = _mm512_loadu_ps(acc.add(g * hd + 16 * j));
            }
        }
        for t in 0..tmax {
            let mut vr = [_mm512_setzero_ps(); D];
            for (j, r) in vr.iter_mut().enumerate() {
                *r = _mm512_loadu_ps(v.add(t * hd + 16 * j));
            }
            for (g, ag) in a.iter_mut().enumerate() {
                let w = _mm512_set1_ps(*e.add(g * e_stride + t));
                for (r, &x) in ag.iter_mut().zip(&vr) {
                    *r = _mm512_fmadd_ps(w, x, *r);
                }
            }
        }
        for (g, ag) in a.iter().enumerate() {
            for (j, &r) in ag.iter().enumerate() {
                _mm512_storeu_ps(acc.add(g * hd + 16 * j), r);
            }
        }
    }
}
