//! Public-API matmul properties: batch invariance, fused (concatenated) weights, ggml byte
//! round trips, and agreement with f64 math on dequantized weights.

use half::f16;
use kvmesh_kernels::cpu::{matmul, matmul_with, Isa};
use kvmesh_kernels::{QMatrix, WeightFormat};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn random(f: WeightFormat, rows: usize, cols: usize, seed: u64) -> QMatrix {
    let mut rng = StdRng::seed_from_u64(seed);
    let rb = f.row_bytes(cols).unwrap();
    let mut data: Vec<u8> = (0..rows * rb).map(|_| rng.gen()).collect();
    match f {
        WeightFormat::F16 => {
            for h in data.chunks_exact_mut(2) {
                h.copy_from_slice(&f16::from_f32(rng.gen_range(-1.0..1.0)).to_le_bytes());
            }
        }
        _ => {
            for blk in data.chunks_exact_mut(f.block_bytes()) {
                blk[..2].copy_from_slice(&f16::from_f32(rng.gen_range(0.001..0.02)).to_le_bytes());
                if f == WeightFormat::Q4_1 {
                    blk[2..4].copy_from_slice(&f16::from_f32(-0.1).to_le_bytes());
                }
            }
        }
    }
    QMatrix::new(f, rows, cols, data).unwrap()
}

fn xs(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.gen_range(-2.0..2.0)).collect()
}

fn mm(w: &QMatrix, x: &[f32], m: usize) -> Vec<u32> {
    let mut out = vec![0.0; m * w.rows];
    matmul(w, x, m, &mut out);
    out.iter().map(|v| v.to_bits()).collect()
}

const FORMATS: [WeightFormat; 4] = [
    WeightFormat::Q4_1,
    WeightFormat::Q8_0,
    WeightFormat::Q4_0,
    WeightFormat::F16,
];

#[test]
fn row_is_bit_identical_alone_and_in_a_batch_of_37() {
    for f in FORMATS {
        let (n, k, m) = (100, 576, 37);
        let w = random(f, n, k, 1);
        let x = xs(m * k, 2);
        let batch = mm(&w, &x, m);
        for i in [0, 5, 36] {
            let one = mm(&w, &x[i * k..(i + 1) * k], 1);
            assert_eq!(one, batch[i * n..(i + 1) * n], "{f:?} row {i}");
        }
        // Other rows' contents do not matter either.
        let mut y = xs(m * k, 3);
        y[5 * k..6 * k].copy_from_slice(&x[5 * k..6 * k]);
        assert_eq!(mm(&w, &y, m)[5 * n..6 * n], batch[5 * n..6 * n], "{f:?}");
    }
}

#[test]
fn fused_weights_match_separate_matmuls() {
    for f in FORMATS {
        let (q, k, v) = (
            random(f, 40, 64, 4),
            random(f, 13, 64, 5),
            random(f, 13, 64, 6),
        );
        let qkv = QMatrix::concat_rows(&[q.clone(), k.clone(), v.clone()]).unwrap();
        let x = xs(3 * 64, 7);
        let fused = mm(&qkv, &x, 3);
        let parts = [mm(&q, &x, 3), mm(&k, &x, 3), mm(&v, &x, 3)];
        for a in 0..3 {
            let mut want = Vec::new();
            for (p, w) in parts.iter().zip([&q, &k, &v]) {
                want.extend_from_slice(&p[a * w.rows..(a + 1) * w.rows]);
            }
            assert_eq!(fused[a * 66..(a + 1) * 66], want[..], "{f:?}");
        }
    }
}

#[test]
fn data_round_trips_ggml_bytes() {
    for f in FORMATS {
        let w = random(f, 21, 64, 8);
        let again = QMatrix::new(f, 21, 64, w.data().to_vec()).unwrap();
        assert_eq!(again, w);
        assert_eq!(again.data(), w.data());
        assert_eq!(w.data().len(), 21 * f.row_bytes(64).unwrap());
    }
}

#[test]
fn close_to_f64_on_dequantized_weights() {
    // The integer path quantizes activations to 8 bits: about 0.5% relative error per dot.
    for f in FORMATS {
        let (n, k, m) = (33, 256, 3);
        let w = random(f, n, k, 9);
        let x = xs(m * k, 10);
        let mut out = vec![0.0; m * n];
        matmul_with(Isa::Portable, &w, &x, m, &mut out);
        let mut row = vec![0.0; k];
        for r in 0..n {
            w.dequantize_row(r, &mut row);
            for a in 0..m {
                let xa = &x[a * k..(a + 1) * k];
                let want: f64 = row.iter().zip(xa).map(|(&p, &q)| p as f64 * q as f64).sum();
                let norm: f64 = row
                    .iter()
                    .zip(xa)
                    .map(|(&p, &q)| (p as f64 * q as f64).abs())
                    .sum();
                let got = out[a * n + r] as f64;
                assert!(
                    (got - want).abs() <= 0.01 * norm,
                    "{f:?}: {got} vs {want} ({norm})"
                );
            }
        }
    }
}

#[test]
fn f32_matrix_is_exact_for_small_integers() {
    let w = QMatrix::from_f32(2, 3, &[1.0, 2.0, 3.0, -1.0, 0.5, 0.0]);
    let mut out = [0.0; 4];
    matmul(&w, &[1.0, 1.0, 1.0, 2.0, 0.0, -2.0], 2, &mut out);
    assert_eq!(out, [6.0, -0.5, -4.0, -2.0]);
}
