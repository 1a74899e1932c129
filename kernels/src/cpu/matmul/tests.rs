//! Every path against the scalar reference (bit-exact), the reference against f64 math, and
//! batch invariance.

use super::act::{quantize_portable, ActBlock};
use super::matmul_with;
use crate::cpu::Isa;
use crate::quant::{QMatrix, WeightFormat};
use half::{bf16, f16};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Random but well-formed ggml bytes: random quants, finite scales of moderate size.
pub(crate) fn random_matrix(f: WeightFormat, rows: usize, cols: usize, seed: u64) -> QMatrix {
    let mut rng = StdRng::seed_from_u64(seed);
    let nblocks = rows * cols / f.block_elems();
    let mut data = Vec::with_capacity(nblocks * f.block_bytes());
    let h = |x: f32| f16::from_f32(x).to_le_bytes();
    for _ in 0..nblocks {
        let mut b: Vec<u8> = (0..f.block_bytes()).map(|_| rng.gen()).collect();
        match f {
            WeightFormat::F32 => b.copy_from_slice(&rng.gen_range(-2.0f32..2.0).to_le_bytes()),
            WeightFormat::F16 => b.copy_from_slice(&h(rng.gen_range(-2.0..2.0))),
            WeightFormat::BF16 => {
                b.copy_from_slice(&bf16::from_f32(rng.gen_range(-2.0..2.0)).to_le_bytes())
            }
            WeightFormat::Q8_0 | WeightFormat::Q4_0 => {
                b[..2].copy_from_slice(&h(rng.gen_range(-0.05..0.05)))
            }
            WeightFormat::Q4_1 => {
                b[..2].copy_from_slice(&h(rng.gen_range(0.0..0.05)));
                b[2..4].copy_from_slice(&h(rng.gen_range(-0.4..0.0)));
            }
            WeightFormat::Q4_K => {
                b[..2].copy_from_slice(&h(rng.gen_range(0.0..0.01)));
                b[2..4].copy_from_slice(&h(rng.gen_range(0.0..0.01)));
            }
            WeightFormat::Q6_K => b[208..].copy_from_slice(&h(rng.gen_range(-0.01..0.01))),
        }
        data.extend(b);
    }
    QMatrix::new(f, rows, cols, data).unwrap()
}

pub(crate) fn random_x(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    (0..len)
        .map(|i| {
            // Mix scales so that blocks have different ranges, plus some exact zeros.
            if i % 29 == 0 {
                0.0
            } else {
                rng.gen_range(-1.0f32..1.0) * if i % 7 == 0 { 8.0 } else { 1.0 }
            }
        })
        .collect()
}

fn run(isa: Isa, w: &QMatrix, x: &[f32], m: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; m * w.rows];
    matmul_with(isa, w, x, m, &mut out);
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn is_integer_path(f: WeightFormat) -> bool {
    matches!(
        f,
        WeightFormat::Q4_0 | WeightFormat::Q4_1 | WeightFormat::Q8_0
    )
}

/// f64 reference. Float path: dequantized weights times `x`. Integer path: the kernel's
/// semantics in exact arithmetic — per block, `Σ (dw·qw)(da·qa)` plus the offset term `mw·s`
/// with the activation block's (f16-rounded) `s`, as ggml's `vec_dot_q4_1_q8_1` does.
fn check_against_f64(w: &QMatrix, x: &[f32], m: usize, got: &[f32]) {
    let k = w.cols;
    let f = w.format;
    let mut want = vec![(0.0f64, 0.0f64); m * w.rows];
    if is_integer_path(f) {
        let nb = k / 32;
        let mut acts = vec![ActBlock::default(); x.len() / 32];
        quantize_portable(x, &mut acts);
        let (g, rb, bb) = (w.data(), w.row_bytes(), f.block_bytes());
        for r in 0..w.rows {
            for a in 0..m {
                let (mut s, mut mag) = (0.0f64, 0.0f64);
                for b in 0..nb {
                    let blk = &g[r * rb + b * bb..][..bb];
                    let ab = &acts[a * nb + b];
                    let d = f16::from_le_bytes([blk[0], blk[1]]).to_f64();
                    let (qw, mw): (Vec<f64>, f64) = match f {
                        WeightFormat::Q8_0 => {
                            (blk[2..].iter().map(|&q| q as i8 as f64).collect(), 0.0)
                        }
                        _ => {
                            let qs = if f == WeightFormat::Q4_1 {
                                &blk[4..]
                            } else {
                                &blk[2..]
                            };
                            let mw = if f == WeightFormat::Q4_1 {
                                f16::from_le_bytes([blk[2], blk[3]]).to_f64()
                            } else {
                                -8.0 * d
                            };
                            let lo = qs.iter().map(|&q| (q & 15) as f64);
                            (lo.chain(qs.iter().map(|&q| (q >> 4) as f64)).collect(), mw)
                        }
                    };
                    for (j, q) in qw.iter().enumerate() {
                        let t = d * q * ab.q[j] as f64 * ab.d as f64;
                        s += t;
                        mag += t.abs();
                    }
                    s += mw * ab.s as f64;
                    mag += (mw * ab.s as f64).abs();
                }
                want[a * w.rows + r] = (s, mag);
            }
        }
    } else {
        let mut row = vec![0.0f32; k];
        for r in 0..w.rows {
            w.dequantize_row(r, &mut row);
            for a in 0..m {
                let (mut s, mut mag) = (0.0f64, 0.0f64);
                for (wv, xv) in row.iter().zip(&x[a * k..(a + 1) * k]) {
                    s += *wv as f64 * *xv as f64;
                    mag += (*wv as f64 * *xv as f64).abs();
                }
                want[a * w.rows + r] = (s, mag);
            }
        }
    }
    for (i, (&g, &(s, mag))) in got.iter().zip(&want).enumerate() {
        assert!(
            (g as f64 - s).abs() <= 2e-6 * mag + 1e-30,
            "{f:?} out[{i}]: got {g}, want {s} (mag {mag})"
        );
    }
}

fn check(f: WeightFormat, rows: usize, cols: usize, m: usize, seed: u64) {
    let w = random_matrix(f, rows, cols, seed);
    let x = random_x(m * cols, seed);
    let reference = run(Isa::Portable, &w, &x, m);
    check_against_f64(&w, &x, m, &reference);
    for isa in [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Amx] {
        if !isa.is_supported() {
            continue;
        }
        let got = run(isa, &w, &x, m);
        assert_eq!(bits(&got), bits(&reference), "{isa:?} vs portable, {f:?}");
        // Batch invariance: each row alone gives the same bits as inside the batch.
        for a in [0, m / 2, m - 1] {
            let one = run(isa, &w, &x[a * cols..(a + 1) * cols], 1);
            assert_eq!(
                bits(&one),
                bits(&got[a * rows..(a + 1) * rows]),
                "{isa:?} row {a}"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn q4_1(rows in 1usize..50, nb in 1usize..7, m in 1usize..40, seed: u64) {
        check(WeightFormat::Q4_1, rows, nb * 32, m, seed);
    }

    #[test]
    fn q8_0(rows in 1usize..50, nb in 1usize..7, m in 1usize..40, seed: u64) {
        check(WeightFormat::Q8_0, rows, nb * 32, m, seed);
    }

    #[test]
    fn q4_0(rows in 1usize..50, nb in 1usize..7, m in 1usize..40, seed: u64) {
        check(WeightFormat::Q4_0, rows, nb * 32, m, seed);
    }

    #[test]
    fn float_formats(fi in 0usize..3, rows in 1usize..40, cols in 1usize..100, m in 1usize..40,
                     seed: u64) {
        let f = [WeightFormat::F32, WeightFormat::F16, WeightFormat::BF16][fi];
        check(f, rows, cols, m, seed);
    }

    #[test]
    fn k_quants(k6 in any::<bool>(), rows in 1usize..20, nb in 1usize..3, m in 1usize..12,
                seed: u64) {
        let f = if k6 { WeightFormat::Q6_K } else { WeightFormat::Q4_K };
        check(f, rows, nb * 256, m, seed);
    }
}

/// Big enough to go parallel and to cross the activation chunk boundaries.
#[test]
fn large_shapes_parallel_and_chunked() {
    for (f, rows, cols, m) in [
        (WeightFormat::Q4_1, 200, 576, 300),
        (WeightFormat::Q8_0, 333, 256, 9),
        (WeightFormat::F16, 70, 200, 140),
    ] {
        check(f, rows, cols, m, 7);
    }
}

#[test]
fn extreme_quants() {
    // All-max nibbles / -128 bytes and saturated activations must not overflow.
    for f in [WeightFormat::Q4_1, WeightFormat::Q4_0, WeightFormat::Q8_0] {
        let rows = 17;
        let bb = f.block_bytes();
        let mut data = vec![0u8; rows * 2 * bb];
        for blk in data.chunks_exact_mut(bb) {
            blk.iter_mut()
                .for_each(|b| *b = if f == WeightFormat::Q8_0 { 0x80 } else { 0xFF });
            blk[..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
            if f == WeightFormat::Q4_1 {
                blk[2..4].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
            }
        }
        let w = QMatrix::new(f, rows, 64, data).unwrap();
        let x: Vec<f32> = (0..20 * 64)
            .map(|i| if i % 2 == 0 { -1.0 } else { -3.0 })
            .collect();
        let want = run(Isa::Portable, &w, &x, 20);
        check_against_f64(&w, &x, 20, &want);
        for isa in [Isa::Avx2, Isa::Avx512, Isa::Amx] {
            if isa.is_supported() {
                assert_eq!(bits(&run(isa, &w, &x, 20)), bits(&want));
            }
        }
    }
}
