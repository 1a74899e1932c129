//! Causal attention over a paged f16 KV cache, and the cache writer.
//!
//! Canonical arithmetic for one query vector `q` (one head of one query row at position `p`),
//! which every path and every tiling reproduces exactly — so a row's output depends only on
//! its own query and the cache, never on the batch, the chunking or the ISA. It follows
//! ggml's non-flash attention (f16 K·Q, f32 softmax, f16 probabilities times f16 V), so our
//! logits track llama.cpp's instead of drifting from them:
//! ```text
//! qh[d]  = f16(q[d])
//! s[t]   = lanes::dot16(qh, k[t]) * (1/sqrt(head_dim))   for t = 0..=p
//! mx     = max_t s[t];   e[t] = exp(s[t] - mx)     (crate exp)
//! c[j]   = Σ_{t ≡ j mod 16} e[t], in order;        l = lanes::reduce16(c)
//! w[t]   = f16(e[t] * (1/l))
//! out[d] = Σ_t fma(w[t], v[t][d], out[d]), in order
//! ```
//! The lane structure of `s` and `l` is what 16-wide SIMD does naturally with positions in
//! the lanes, for one query or many, so decode and prefill run the same kernel.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

use super::exp::exp;
use super::lanes::{dot16, reduce16};
use super::par::{with_scratch, SendPtr};
use super::simd::multiversion;
use super::Isa;
use half::f16;
use rayon::prelude::*;
use std::cell::RefCell;

/// Head geometry and cache block size. The per-layer cache holds K (and, separately, V) as
/// `[num_blocks, n_kv_heads, block_size, head_dim]` f16.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

/// One sequence's rows in a batched attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttentionSeq<'a> {
    /// First row of this sequence in `q` / `out`.
    pub q_offset: usize,
    /// Number of query rows.
    pub n_q: usize,
    /// Query row `j` is at position `start_pos + j` and attends to positions `0..=start_pos+j`.
    pub start_pos: usize,
    /// Physical cache block of each logical block (position / block_size).
    pub block_table: &'a [u32],
}

impl AttentionShape {
    fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }
    fn q_row(&self) -> usize {
        self.n_heads * self.head_dim
    }
    fn kv_row(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    fn block_elems(&self) -> usize {
        self.n_kv_heads * self.block_size * self.head_dim
    }
    fn validate(&self) {
        assert!(
            self.n_heads > 0 && self.n_kv_heads > 0 && self.head_dim > 0 && self.block_size > 0,
            "attention: zero dimension in {self:?}"
        );
        assert_eq!(
            self.n_heads % self.n_kv_heads,
            0,
            "attention: n_heads % n_kv_heads != 0"
        );
    }
    /// Offset of (physical block, kv head, slot) in a layer cache.
    fn cache_offset(&self, block: usize, kv_head: usize, slot: usize) -> usize {
        ((block * self.n_kv_heads + kv_head) * self.block_size + slot) * self.head_dim
    }
}

/// Paged causal attention for a batch of sequences. `q` and `out` are
/// `[total_q_rows, n_heads * head_dim]`; the `1/sqrt(head_dim)` scale is applied inside; head
/// `h` reads KV head `h / (n_heads / n_kv_heads)` (GQA). The cache must already hold K/V for
/// every position up to each sequence's last query row (see [`write_kv`]). Sequences must not
/// share query rows; rows of `out` not covered by any sequence are left untouched.
///
/// Parallel over (sequence, KV head, tile of query rows). Panics if shapes, block tables or
/// block ids are inconsistent.
pub fn paged_attention(
    shape: &AttentionShape,
    seqs: &[AttentionSeq],
    q: &[f32],
    k_cache: &[f16],
    v_cache: &[f16],
    out: &mut [f32],
) {
    paged_attention_with(Isa::detect(), shape, seqs, q, k_cache, v_cache, out);
}

/// [`paged_attention`] on a chosen [`Isa`] (falls back to `Portable` where unsupported); the
/// results are bit-identical. For tests and benchmarks.
pub fn paged_attention_with(
    isa: Isa,
    shape: &AttentionShape,
    seqs: &[AttentionSeq],
    q: &[f32],
    k_cache: &[f16],
    v_cache: &[f16],
    out: &mut [f32],
) {
    shape.validate();
    assert_eq!(q.len(), out.len(), "attention: q and out differ in length");
    assert_eq!(
        q.len() % shape.q_row(),
        0,
        "attention: q is not [rows, n_heads*head_dim]"
    );
    assert_eq!(
        k_cache.len(),
        v_cache.len(),
        "attention: K and V caches differ"
    );
    assert_eq!(
        k_cache.len() % shape.block_elems(),
        0,
        "attention: cache is not whole blocks"
    );
    let rows = q.len() / shape.q_row();
    let num_blocks = k_cache.len() / shape.block_elems();
    for s in seqs {
        assert!(
            s.q_offset + s.n_q <= rows,
            "attention: sequence rows out of range"
        );
        let needed = (s.start_pos + s.n_q).div_ceil(shape.block_size);
        assert!(
            s.block_table.len() >= needed,
            "attention: block table too short"
        );
        assert!(
            s.block_table[..needed]
                .iter()
                .all(|&b| (b as usize) < num_blocks),
            "attention: block id out of range"
        );
    }
    // Tasks write their sequences' rows of `out` concurrently: the ranges must be disjoint.
    let mut ranges: Vec<(usize, usize)> = seqs
        .iter()
        .filter(|s| s.n_q > 0)
        .map(|s| (s.q_offset, s.q_offset + s.n_q))
        .collect();
    ranges.sort_unstable();
    assert!(
        ranges.windows(2).all(|w| w[0].1 <= w[1].0),
        "attention: sequences share query rows"
    );
    let tasks = tasks(shape, seqs);
    let ctx = Ctx {
        shape: *shape,
        q,
        k: k_cache,
        v: v_cache,
        out: SendPtr(out.as_mut_ptr()),
        isa: isa.effective(),
    };
    let work: usize = tasks.iter().map(|t| t.work).sum();
    if work < 1 << 15 || rayon::current_num_threads() == 1 {
        tasks
            .iter()
            .enumerate()
            .for_each(|(i, t)| ctx.run(seqs, t, tasks.get(i + 1)));
    } else {
        // A thread runs a contiguous range of tasks in order, so task i + 1 is usually the
        // next one on the same thread: each task prefetches the next one's cache rows.
        tasks
            .par_iter()
            .enumerate()
            .for_each(|(i, t)| ctx.run(seqs, t, tasks.get(i + 1)));
    }
}

/// Query vectors per task: one 16-lane register's worth.
const LANES: usize = 16;

/// A tile: rows `row0..row0+n_rows` of sequence `seq`, heads `h0..h0+n_heads` (all sharing
/// KV head `kv`).
#[derive(Clone, Copy, Debug)]
pub(super) struct Task {
    seq: usize,
    kv: usize,
    row0: usize,
    n_rows: usize,
    h0: usize,
    n_heads: usize,
    /// Positions touched, for deciding whether to go parallel.
    work: usize,
}

fn tasks(shape: &AttentionShape, seqs: &[AttentionSeq]) -> Vec<Task> {
    let group = shape.group();
    let (rows_per, heads_per) = if group >= LANES {
        (1, LANES)
    } else {
        (LANES / group, group)
    };
    let mut v = Vec::new();
    for (si, s) in seqs.iter().enumerate() {
        for kv in 0..shape.n_kv_heads {
            for row0 in (0..s.n_q).step_by(rows_per) {
                let n_rows = rows_per.min(s.n_q - row0);
                for hh in (0..group).step_by(heads_per) {
                    let n_heads = heads_per.min(group - hh);
                    v.push(Task {
                        seq: si,
                        kv,
                        row0,
                        n_rows,
                        h0: kv * group + hh,
                        n_heads,
                        work: (s.start_pos + row0 + n_rows) * n_rows * n_heads,
                    });
                }
            }
        }
    }
    // Longest first, so the causal tail does not straggle.
    v.sort_by_key(|t| std::cmp::Reverse(t.work));
    v
}

struct Ctx<'a> {
    shape: AttentionShape,
    q: &'a [f32],
    k: &'a [f16],
    v: &'a [f16],
    out: SendPtr<f32>,
    isa: Isa,
}

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

impl Ctx<'_> {
    /// Runs task `t`; `next` is the task this thread probably runs after it (a hint).
    fn run(&self, seqs: &[AttentionSeq], t: &Task, next: Option<&Task>) {
        let s = &seqs[t.seq];
        #[cfg(target_arch = "x86_64")]
        if self.isa.has_avx512() && avx512::supports(&self.shape) {
            let next = next.map(|n| (&seqs[n.seq], n));
            // SAFETY: AVX-512 verified by `Isa::effective`; the task owns its output rows/heads.
            unsafe { avx512::task(self, s, t, next) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if self.isa.has_avx2() && avx2::supports(&self.shape) {
            // SAFETY: AVX2, FMA and F16C verified by `Isa::effective`; as above.
            unsafe { avx2::task(self, s, t) };
            return;
        }
        let _ = next;
        task_portable(self, s, t);
    }

    /// The cache row of `kv` head at position `pos` of sequence `s`.
    #[inline(always)]
    fn kv_row<'c>(&self, cache: &'c [f16], s: &AttentionSeq, kv: usize, pos: usize) -> &'c [f16] {
        let sh = &self.shape;
        let block = s.block_table[pos / sh.block_size] as usize;
        &cache[sh.cache_offset(block, kv, pos % sh.block_size)..][..sh.head_dim]
    }
}

/// Writes K and V rows (`[n, n_kv_heads * head_dim]` f32) for positions
/// `start_pos..start_pos + n` into the paged cache, rounding to f16 (nearest even).
/// Panics if the rows are not whole, the block table is too short or a block id is out of
/// range.
pub fn write_kv(
    shape: &AttentionShape,
    block_table: &[u32],
    start_pos: usize,
    k: &[f32],
    v: &[f32],
    k_cache: &mut [f16],
    v_cache: &mut [f16],
) {
    use half::slice::HalfFloatSliceExt;
    shape.validate();
    let row = shape.kv_row();
    let hd = shape.head_dim;
    assert_eq!(k.len(), v.len(), "write_kv: k and v differ in length");
    assert_eq!(
        k.len() % row,
        0,
        "write_kv: k is not [n, n_kv_heads*head_dim]"
    );
    assert_eq!(
        k_cache.len(),
        v_cache.len(),
        "write_kv: K and V caches differ"
    );
    for (i, (kr, vr)) in k.chunks_exact(row).zip(v.chunks_exact(row)).enumerate() {
        let pos = start_pos + i;
        let block = block_table[pos / shape.block_size] as usize;
        for g in 0..shape.n_kv_heads {
            let o = shape.cache_offset(block, g, pos % shape.block_size);
            k_cache[o..o + hd].convert_from_f32_slice(&kr[g * hd..(g + 1) * hd]);
            v_cache[o..o + hd].convert_from_f32_slice(&vr[g * hd..(g + 1) * hd]);
        }
    }
}
multiversion! {
    /// The reference: one query vector at a time, in the canonical order.
    fn task_portable(ctx: &Ctx<'_>, s: &AttentionSeq, t: &Task) {
            let sh = &ctx.shape;
            let hd = sh.head_dim;
            let scale = 1.0 / (hd as f32).sqrt();
            with_scratch(&SCORES, |sc| {
                let mut qs = vec![0.0f32; hd];
                let mut acc = vec![0.0f32; hd];
                let mut kr = vec![0.0f32; hd];
                for j in t.row0..t.row0 + t.n_rows {
                    let row = s.q_offset + j;
                    let p = s.start_pos + j;
                    sc.clear();
                    sc.resize(p + 1, 0.0);
                    for h in t.h0..t.h0 + t.n_heads {
                        let qv = &ctx.q[row * sh.q_row() + h * hd..][..hd];
                        for (a, &b) in qs.iter_mut().zip(qv) {
                            *a = f16::from_f32(b).to_f32();
                        }
                        for (pos, st) in sc.iter_mut().enumerate() {
                            for (kf, k) in kr.iter_mut().zip(ctx.kv_row(ctx.k, s, t.kv, pos)) {
                                *kf = k.to_f32();
                            }
                            *st = dot16(&qs, &kr) * scale;
                        }
                        let mx = sc.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                        let mut cls = [0.0f32; 16];
                        for (t, e) in sc.iter_mut().enumerate() {
                            *e = exp(*e - mx);
                            cls[t % 16] += *e;
                        }
                        let inv_l = 1.0 / reduce16(cls);
                        for e in sc.iter_mut() {
                            *e = f16::from_f32(*e * inv_l).to_f32();
                        }
                        acc.fill(0.0);
                        for (pos, &e) in sc.iter().enumerate() {
                            let v = ctx.kv_row(ctx.v, s, t.kv, pos);
                            for (a, vd) in acc.iter_mut().zip(v) {
                                *a = e.mul_add(vd.to_f32(), *a);
                            }
                        }
                        let o = row * sh.q_row() + h * hd;
                        for (d, &a) in acc.iter().enumerate() {
                            // SAFETY: this task owns (row, head h) of `out`.
                            unsafe { *ctx.out.0.add(o + d) = a };
                        }
                    }
                }
            });
        }
}
