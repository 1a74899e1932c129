//! Integer matmul for Q4_0, Q4_1 and Q8_0 weights.
//!
//! Canonical arithmetic for one output `(activation row a, weight row r)`, which every path
//! reproduces exactly:
//! ```text
//! acc = 0
//! for each block b:                        // in order
//!     I   = Σ_j wq[j] * aq[j]              // exact int32 (wq: 0..15 or -128..127)
//!     acc = fma(float(I), dw * da, acc)    // dw * da rounded to f32 first
//!     acc = fma(mw, sa, acc)               // Q4 only: mw = m (Q4_1) or -8*d (Q4_0)
//! ```
//! with the activation block's `da` and `sa = f16(da * Σaq)` from `act.rs`.

use super::act::{self, ActBlock, ActTile};
use super::{for_each_panel, PANEL};
use crate::cpu::par::{return_scratch, take_scratch, with_scratch, SendPtr};
use crate::cpu::simd::multiversion;
use crate::cpu::Isa;
use crate::quant::{PanelBlock, QMatrix, WeightFormat};
use std::cell::RefCell;

/// The quantized weight formats this path serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum QKind {
    Q4_0,
    Q4_1,
    Q8_0,
}

impl QKind {
    fn of(f: WeightFormat) -> QKind {
        match f {
            WeightFormat::Q4_0 => QKind::Q4_0,
            WeightFormat::Q4_1 => QKind::Q4_1,
            WeightFormat::Q8_0 => QKind::Q8_0,
            _ => unreachable!("not an integer-path format"),
        }
    }
}

/// Activation rows handled per pass over the weights. Bounds the quantized activations a
/// panel streams (256 rows x 1536 cols ≈ 600 KB) so they stay in L2.
const M_CHUNK: usize = 256;

thread_local! {
    static ACTS: RefCell<Vec<ActBlock>> = const { RefCell::new(Vec::new()) };
    static ACT_TILES: RefCell<Vec<ActTile>> = const { RefCell::new(Vec::new()) };
}

pub(super) fn matmul(isa: Isa, w: &QMatrix, x: &[f32], m: usize, out: &mut [f32]) {
    let kind = QKind::of(w.format);
    let (n, k) = (w.rows, w.cols);
    let nb = k / 32;
    if nb == 0 {
        out.fill(0.0);
        return;
    }
    let mut tiles_buf = take_scratch(&ACT_TILES);
    with_scratch(&ACTS, |acts| {
        act::quantize(isa, x, acts);
        // AMX handles whole tiles of 16 rows; M_CHUNK is a multiple of 16.
        let amx = isa == Isa::Amx && m >= 16;
        if amx {
            act::act_tiles(acts, nb, &mut tiles_buf);
        }
        let outp = SendPtr(out.as_mut_ptr());
        for a0 in (0..m).step_by(M_CHUNK) {
            let mc = M_CHUNK.min(m - a0);
            let acts = &acts[a0 * nb..(a0 + mc) * nb];
            let tiles = if amx && mc >= 16 {
                &tiles_buf[a0 / 16 * nb..(a0 + mc) / 16 * nb]
            } else {
                &[][..]
            };
            for_each_panel(n, mc * k * PANEL, |p| {
                let panel = Panel {
                    kind,
                    blocks: w.panel(p),
                    rows: PANEL.min(n - p * PANEL),
                    nb,
                };
                // SAFETY: panels write disjoint columns of rows a0..a0+mc of `out`.
                let o = unsafe { outp.get().add(a0 * n + p * PANEL) };
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: Avx512 is only selected when supported; `o` has mc rows of stride n.
                    Isa::Avx512 | Isa::Amx => unsafe {
                        super::quantized_avx512::panel(&panel, acts, tiles, o, n)
                    },
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: Avx2 is only selected when supported; `o` has mc rows of stride n.
                    Isa::Avx2 => unsafe { super::quantized_avx2::panel(&panel, acts, o, n) },
                    _ => panel_portable(&panel, acts, SendPtr(o), n),
                }
            });
        }
    });
    return_scratch(&ACT_TILES, tiles_buf);
}

/// One 16-row panel of a matrix in panel layout (`quant/panel.rs`); `rows` of them are real.
pub(super) struct Panel<'a> {
    pub kind: QKind,
    pub blocks: &'a [u8],
    pub rows: usize,
    pub nb: usize,
}

multiversion! {
    /// The reference kernel: writes `out[a * ldo + r]` for every activation row and panel row.
    fn panel_portable(p: &Panel, acts: &[ActBlock], out: SendPtr<f32>, ldo: usize) {
        for r in 0..p.rows {
            for (a, arow) in acts.chunks_exact(p.nb).enumerate() {
                let v = dot_row(p, r, arow);
                // SAFETY: the caller owns this (a, r) element of `out`.
                unsafe { *out.get().add(a * ldo + r) = v };
            }
        }
    }
}

/// Output for panel row `r` and one activation row, in the canonical order (module docs).
#[inline(always)]
fn dot_row(p: &Panel, r: usize, acts: &[ActBlock]) -> f32 {
    let format = match p.kind {
        QKind::Q4_0 => WeightFormat::Q4_0,
        QKind::Q4_1 => WeightFormat::Q4_1,
        QKind::Q8_0 => WeightFormat::Q8_0,
    };
    let mut acc = 0.0f32;
    for (b, a) in acts.iter().enumerate() {
        let blk = PanelBlock::new(format, p.blocks, r, b);
        let d = blk.d();
        if p.kind == QKind::Q8_0 {
            let i: i32 = (0..32).map(|j| blk.q(j) as i8 as i32 * a.q[j] as i32).sum();
            acc = (i as f32).mul_add(d * a.d, acc);
        } else {
            let mw = if p.kind == QKind::Q4_1 {
                blk.m()
            } else {
                d * -8.0
            };
            let i: i32 = (0..16)
                .map(|j| {
                    let q = blk.q(j);
                    (q & 0xF) as i32 * a.q[j] as i32 + (q >> 4) as i32 * a.q[j + 16] as i32
                })
                .sum();
            acc = (i as f32).mul_add(d * a.d, acc);
            acc = mw.mul_add(a.s, acc);
        }
    }
    acc
}
