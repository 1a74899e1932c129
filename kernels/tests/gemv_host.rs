//! gemv.cu's int8 GEMV run on the host, against the CPU backend's matmul on the same inputs.
//!
//! No GPU here: `cuda_host/harness.cpp` compiles gemv.cu itself as C++ against `shim.h` (one
//! host thread per CUDA thread, warp shuffles and `__syncthreads` as barriers) and runs the
//! kernels with the launch geometry, weight split and scratch layout `CudaDevice::matmul`
//! uses (`kvmesh_kernels::cuda`'s layout functions). The kernel's arithmetic is the CPU's per
//! block (the same int8 activations, exact int32 dot products), so only the order of f32 sums
//! may differ: a wrong index, a lost block or a quantization that differs from the CPU's by
//! one step moves the result far past the bound. What this cannot see is the device itself
//! (the real memory system, NVRTC's code): that is `kvmesh gpu-check`'s `ops` check.

use half::f16;
use kvmesh_kernels::cpu::matmul;
use kvmesh_kernels::cuda::{act_layout, dp4a_launch, quantize_blocks, split_blocks, split_layout};
use kvmesh_kernels::{QMatrix, WeightFormat};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The harness, compiled once per test run with the host's C++ compiler (`CXX`, else `c++`).
fn harness() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cuda_host/harness.cpp");
        let bin = Path::new(env!("CARGO_TARGET_TMPDIR")).join("gemv_host_harness");
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let out = Command::new(&cxx)
            .args(["-std=c++20", "-O2", "-pthread", "-ffp-contract=off"])
            .arg(&src)
            .arg("-o")
            .arg(&bin)
            .output()
            .unwrap_or_else(|e| panic!("running {cxx}: {e}"));
        assert!(
            out.status.success(),
            "compiling the host harness failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        bin
    })
}

/// Random quants with sane scales (as gpu-check's), and a weight row of all-zero quants.
fn weights(format: WeightFormat, rows: usize, cols: usize, rng: &mut StdRng) -> QMatrix {
    let mut data: Vec<u8> = (0..rows * format.row_bytes(cols).unwrap())
        .map(|_| rng.gen())
        .collect();
    let bb = format.block_bytes();
    for blk in data.chunks_exact_mut(bb) {
        let d = f16::from_f32(rng.gen_range(0.002..0.02));
        blk[..2].copy_from_slice(&d.to_le_bytes());
        if format == WeightFormat::Q4_1 {
            let m = f16::from_f32(rng.gen_range(-0.1..0.0));
            blk[2..4].copy_from_slice(&m.to_le_bytes());
        }
    }
    let zero_row = rows / 2 * format.row_bytes(cols).unwrap();
    for blk in data[zero_row..zero_row + format.row_bytes(cols).unwrap()].chunks_exact_mut(bb) {
        blk[if format == WeightFormat::Q4_1 { 4 } else { 2 }..].fill(0);
    }
    QMatrix::new(format, rows, cols, data).unwrap()
}

/// Activations in [-2, 2), with a block of zeros (scale 0) and one of large values.
fn activations(m: usize, cols: usize, rng: &mut StdRng) -> Vec<f32> {
    let mut x: Vec<f32> = (0..m * cols).map(|_| rng.gen_range(-2.0..2.0)).collect();
    x[32..64].fill(0.0);
    for v in &mut x[cols - 32..cols] {
        *v *= 1000.0;
    }
    x
}

/// The harness's output for `w` and `x`, launched as `CudaDevice::matmul` launches it.
fn host_gemv(w: &QMatrix, x: &[f32], m: usize, dir: &Path) -> Vec<f32> {
    let launch = dp4a_launch(w.format, w.rows, m).unwrap();
    let split = split_blocks(w.format, w.data()).unwrap();
    let scales_at = split_layout(w.format, w.rows * w.cols / 32)
        .unwrap()
        .quant_bytes;
    let act = act_layout(m, w.cols);
    std::fs::write(dir.join("w.bin"), &split).unwrap();
    std::fs::write(dir.join("x.bin"), bytemuck::cast_slice(x)).unwrap();
    let out = Command::new(harness())
        .arg(dir)
        .arg(launch.kernel)
        .args(
            [
                launch.blocks as usize,
                quantize_blocks(m, w.cols),
                w.rows,
                w.cols,
                m,
                scales_at,
                act.ds_offset,
                act.bytes,
            ]
            .map(|v| v.to_string()),
        )
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "harness: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let y = std::fs::read(dir.join("y.bin")).unwrap();
    y.chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

#[test]
fn int8_gemv_matches_the_cpu_matmul() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = StdRng::seed_from_u64(18);
    // Rows not a multiple of the 4 per thread block; 65 and 130 blocks per row: threads
    // without a block, and threads with two (Q8_0's 130 and 260 words: a second pass).
    for (rows, cols) in [(37usize, 2080usize), (9, 4160)] {
        for format in [WeightFormat::Q4_1, WeightFormat::Q8_0] {
            let w = weights(format, rows, cols, &mut rng);
            for m in [1usize, 2, 3, 4, 5, 8] {
                let x = activations(m, cols, &mut rng);
                let mut want = vec![0.0f32; m * rows];
                matmul(&w, &x, m, &mut want);
                let got = host_gemv(&w, &x, m, dir.path());
                // The harness starts from NaN: every output must have been written.
                assert!(got.len() == want.len() && got.iter().all(|v| v.is_finite()));
                let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
                let err = want
                    .iter()
                    .zip(&got)
                    .fold(0f32, |a, (w, g)| a.max((w - g).abs()));
                assert!(
                    err <= 1e-5 * scale,
                    "{format:?} {rows}x{cols} m={m}: error {err} of {scale}"
                );
            }
        }
    }
}
