//! `out[m, n] = x[m, k] · wᵀ` for every [`WeightFormat`].
//!
//! Q4_0/Q4_1/Q8_0 weights take the integer path (`quantized`): activations are quantized once
//! per call to 8-bit blocks of 32, then each (weight block, activation block) pair gives an
//! exact int32 dot product, scaled and accumulated in f32 block by block. Float and K-quant
//! weights take the f32 path (`float`). Both parallelise over panels of 16 output rows with
//! rayon; a panel is computed for all activation rows, so the per-element arithmetic never
//! depends on `m` (batch invariance).

mod act;
#[cfg(target_arch = "x86_64")]
mod amx;
mod float;
#[cfg(target_arch = "x86_64")]
mod float_avx512;
mod quantized;
#[cfg(target_arch = "x86_64")]
mod quantized_avx2;
#[cfg(target_arch = "x86_64")]
mod quantized_avx512;

use super::Isa;
use crate::quant::{QMatrix, WeightFormat};
use rayon::prelude::*;

/// Output rows per panel: one AVX-512 register of f32 lanes.
const PANEL: usize = crate::quant::PANEL_ROWS;

/// `out[m, w.rows] = x[m, w.cols] · wᵀ`, row-major. Threaded with rayon over panels of 16
/// output rows. Row `i` of `out` is bit-identical whatever `m` is and whatever the other rows
/// of `x` contain.
///
/// Panics if `x.len() != m * w.cols` or `out.len() != m * w.rows`.
pub fn matmul(w: &QMatrix, x: &[f32], m: usize, out: &mut [f32]) {
    matmul_with(Isa::detect(), w, x, m, out);
}

/// [`matmul`] on a chosen [`Isa`] (an unsupported one falls back to `Portable`). For tests
/// and benchmarks; results are bit-identical to [`matmul`].
pub fn matmul_with(isa: Isa, w: &QMatrix, x: &[f32], m: usize, out: &mut [f32]) {
    assert_eq!(x.len(), m * w.cols, "matmul: x is not [m, cols]");
    assert_eq!(out.len(), m * w.rows, "matmul: out is not [m, rows]");
    if m == 0 || w.rows == 0 {
        return;
    }
    if w.cols == 0 {
        out.fill(0.0);
        return;
    }
    let isa = isa.effective();
    match w.format {
        WeightFormat::Q4_0 | WeightFormat::Q4_1 | WeightFormat::Q8_0 => {
            quantized::matmul(isa, w, x, m, out)
        }
        _ => float::matmul(isa, w, x, m, out),
    }
}

/// Whether the AMX-INT8 kernel can run here (see `amx.rs`).
pub(crate) fn amx_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    return amx::supported();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Calls `f(panel)` for every panel of 16 output rows, in parallel when the whole product is
/// big enough to pay for waking the pool. `macs_per_panel` sizes the tasks.
fn for_each_panel(n_rows: usize, macs_per_panel: usize, f: impl Fn(usize) + Sync + Send) {
    let panels = n_rows.div_ceil(PANEL);
    const SERIAL_MACS: usize = 1 << 16;
    const TASK_MACS: usize = 1 << 17;
    if panels * macs_per_panel <= SERIAL_MACS || rayon::current_num_threads() == 1 {
        (0..panels).for_each(f);
    } else {
        let min_len = (TASK_MACS / macs_per_panel.max(1)).max(1);
        (0..panels)
            .into_par_iter()
            .with_min_len(min_len)
            .for_each(f);
    }
}

#[cfg(test)]
mod tests;
