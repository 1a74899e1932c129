//! f32 matmul for float and K-quant weights: each panel of 16 weight rows is converted to f32
//! (zero-padded to a multiple of 16 columns) and dotted with the activation rows.
//!
//! Canonical arithmetic for one output, reproduced exactly by every path:
//! ```text
//! lane[j] = Σ_c fma over chunks c of 16 columns: lane[j] = fma(w[16c+j], x[16c+j], lane[j])
//!           (columns past the end count as w = x = +0)
//! out     = lanes::reduce16(lane)
//! ```

use super::{for_each_panel, PANEL};
use crate::cpu::lanes::reduce16;
use crate::cpu::par::{with_scratch, SendPtr};
use crate::cpu::simd::multiversion;
use crate::cpu::Isa;
use crate::quant::{dequantize_blocks, QMatrix, WeightFormat};
use std::cell::RefCell;

/// Activation rows per pass over the weights (keeps them in L2 for large batches).
const M_CHUNK: usize = 128;

thread_local! {
    static PANEL_F32: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

pub(super) fn matmul(isa: Isa, w: &QMatrix, x: &[f32], m: usize, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    let kp = k.div_ceil(16) * 16;
    let outp = SendPtr(out.as_mut_ptr());
    for a0 in (0..m).step_by(M_CHUNK) {
        let mc = M_CHUNK.min(m - a0);
        let xs = &x[a0 * k..(a0 + mc) * k];
        for_each_panel(n, mc * k * PANEL, |p| {
            let r0 = p * PANEL;
            let nr = PANEL.min(n - r0);
            with_scratch(&PANEL_F32, |buf| {
                buf.clear();
                buf.resize(PANEL * kp, 0.0);
                for r in 0..nr {
                    convert_row(
                        isa,
                        w.format,
                        w.ggml_row(r0 + r),
                        &mut buf[r * kp..r * kp + k],
                    );
                }
                let tile = FloatTile {
                    w: buf,
                    kp,
                    rows: nr,
                    x: xs,
                    k,
                };
                // SAFETY: panels write disjoint columns r0..r0+nr of rows a0..a0+mc of `out`.
                let o = unsafe { outp.get().add(a0 * n + r0) };
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: Avx512 is only selected when supported; `o` has mc rows of stride n.
                    Isa::Avx512 | Isa::Amx => unsafe { super::float_avx512::panel(&tile, o, n) },
                    _ => panel_portable(&tile, SendPtr(o), n),
                }
            });
        });
    }
}

/// A panel of f32 weight rows (`rows` valid, 16 allocated, stride `kp`) and activation rows.
pub(super) struct FloatTile<'a> {
    pub w: &'a [f32],
    pub kp: usize,
    pub rows: usize,
    pub x: &'a [f32],
    pub k: usize,
}

fn convert_row(isa: Isa, format: WeightFormat, src: &[u8], dst: &mut [f32]) {
    match (isa, format) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Avx512 is only selected when supported.
        (Isa::Avx512 | Isa::Amx, WeightFormat::F16 | WeightFormat::BF16) => unsafe {
            super::float_avx512::convert_row(format, src, dst)
        },
        _ => dequantize_blocks(format, src, dst),
    }
}

multiversion! {
    fn panel_portable(t: &FloatTile, out: SendPtr<f32>, ldo: usize) {
        for r in 0..t.rows {
            let w = &t.w[r * t.kp..(r + 1) * t.kp];
            for (a, x) in t.x.chunks_exact(t.k).enumerate() {
                // SAFETY: the caller owns this (a, r) element of `out`.
                unsafe { *out.0.add(a * ldo + r) = dot(w, x) };
            }
        }
    }
}

/// One output in the canonical order; `w` is zero-padded to a multiple of 16.
#[inline(always)]
fn dot(w: &[f32], x: &[f32]) -> f32 {
    let mut lane = [0.0f32; 16];
    for (c, wc) in w.chunks_exact(16).enumerate() {
        for j in 0..16 {
            let xv = x.get(16 * c + j).copied().unwrap_or(0.0);
            lane[j] = wc[j].mul_add(xv, lane[j]);
        }
    }
    reduce16(lane)
}
