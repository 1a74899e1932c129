//! CUDA kernels run on the host, against the CPU backend on the same inputs: gemv.cu's
//! int8 GEMV against the CPU matmul, attention.cu's paged attention against the CPU's.
//!
//! No GPU here: `cuda_host/harness.cpp` compiles the .cu sources themselves as C++ against
//! `shim.h` (one host thread per CUDA thread, warp shuffles and `__syncthreads` as barriers)
//! and runs the kernels with the launch geometry (and for the GEMV the weight split and
//! scratch layout) `CudaDevice` uses (`kvmesh_kernels::cuda`'s layout functions). The GEMV's
//! arithmetic is the CPU's per block (the same int8 activations, exact int32 dot products),
//! so only the order of f32 sums may differ: a wrong index, a lost block or a quantization
//! that differs from the CPU's by one step moves the result far past the bound. What this
//! cannot see is the device itself (the real memory system, NVRTC's code): that is
//! `kvmesh gpu-check`'s `ops` check.

use half::f16;
use kvmesh_kernels::cpu::{matmul, paged_attention, write_kv, AttentionSeq, AttentionShape};
use kvmesh_kernels::cuda::{
    act_layout, attention_threads, attention_tiles, dp4a_launch, quantize_blocks, split_blocks,
    split_layout,
};
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
        let bin = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda_host_harness");
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
    let sizes = [
        launch.blocks as usize,
        quantize_blocks(m, w.cols),
        w.rows,
        w.cols,
        m,
        scales_at,
        act.ds_offset,
        act.bytes,
    ];
    let args = ["gemv".to_string(), launch.kernel.to_string()];
    run_harness(dir, args.into_iter().chain(sizes.map(|v| v.to_string())));
    floats(&dir.join("y.bin"))
}

fn floats(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// The largest error of `got` against `want`, over `want`'s largest magnitude; every value
/// of `got` must have been written (the harness starts from NaN).
fn rel_error(want: &[f32], got: &[f32]) -> f32 {
    assert!(got.len() == want.len() && got.iter().all(|v| v.is_finite()));
    let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
    let err = want
        .iter()
        .zip(got)
        .fold(0f32, |a, (w, g)| a.max((w - g).abs()));
    err / scale
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
                let err = rel_error(&want, &got);
                assert!(err <= 1e-5, "{format:?} {rows}x{cols} m={m}: error {err}");
            }
        }
    }
}

/// Runs the harness on the inputs in `dir`, failing the test with its error output.
fn run_harness(dir: &Path, args: impl IntoIterator<Item = String>) {
    let out = Command::new(harness())
        .arg(dir)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "harness: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn write_i32(path: PathBuf, v: &[i32]) {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(path, bytes).unwrap();
}

/// Attention inputs in `dir` for sequences of (context, query rows) `spec` (shuffled block
/// tables, GQA: 4 heads over 2 KV heads), and the CPU's output for them.
struct AttentionCase {
    shape: AttentionShape,
    rows: usize,
    want: Vec<f32>,
}

impl AttentionCase {
    fn write(dir: &Path, spec: &[(usize, usize)], seed: u64) -> AttentionCase {
        let mut rng = StdRng::seed_from_u64(seed);
        let shape = AttentionShape {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 64,
            block_size: 16,
        };
        let kv_row = shape.n_kv_heads * shape.head_dim;
        let q_row = shape.n_heads * shape.head_dim;
        let mut tables: Vec<Vec<u32>> = Vec::new();
        let mut next = 0u32;
        for &(len, _) in spec {
            let n = len.div_ceil(shape.block_size) as u32;
            tables.push((next..next + n).rev().collect()); // the table, not adjacency, decides
            next += n;
        }
        let layer = next as usize * shape.block_size * kv_row;
        let (mut kc, mut vc) = (vec![f16::ZERO; layer], vec![f16::ZERO; layer]);
        let (mut q, mut pos, mut rtab, mut flat, mut seqs) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, &(len, nq)) in spec.iter().enumerate() {
            let k: Vec<f32> = (0..len * kv_row)
                .map(|_| rng.gen_range(-1.0..1.0))
                .collect();
            let v: Vec<f32> = (0..len * kv_row)
                .map(|_| rng.gen_range(-1.0..1.0))
                .collect();
            write_kv(&shape, &tables[i], 0, &k, &v, &mut kc, &mut vc);
            let at = flat.len() as i32;
            flat.extend(tables[i].iter().map(|&b| b as i32));
            seqs.push((q.len() / q_row, nq, len - nq));
            for j in 0..nq {
                pos.push((len - nq + j) as i32);
                rtab.push(at);
            }
            q.extend((0..nq * q_row).map(|_| rng.gen_range(-2.0f32..2.0)));
        }
        let cpu_seqs: Vec<AttentionSeq> = seqs
            .iter()
            .zip(&tables)
            .map(|(&(q_offset, n_q, start_pos), t)| AttentionSeq {
                q_offset,
                n_q,
                start_pos,
                block_table: t,
            })
            .collect();
        let mut want = vec![0.0; q.len()];
        paged_attention(&shape, &cpu_seqs, &q, &kc, &vc, &mut want);

        let bits = |c: &[f16]| -> Vec<u8> { c.iter().flat_map(|h| h.to_le_bytes()).collect() };
        std::fs::write(dir.join("q.bin"), bytemuck::cast_slice(&q)).unwrap();
        std::fs::write(dir.join("k.bin"), bits(&kc)).unwrap();
        std::fs::write(dir.join("v.bin"), bits(&vc)).unwrap();
        write_i32(dir.join("pos.bin"), &pos);
        write_i32(dir.join("rtab.bin"), &rtab);
        write_i32(dir.join("tables.bin"), &flat);
        AttentionCase {
            shape,
            rows: pos.len(),
            want,
        }
    }

    /// The harness's `mode` (`attention` or `attention_tiled`) with `first` (threads or
    /// tiles): its output's error relative to the CPU's.
    fn error(&self, dir: &Path, mode: &str, first: usize) -> f32 {
        let s = &self.shape;
        let scale = 1.0f32 / (s.head_dim as f32).sqrt();
        let sizes = [
            first,
            self.rows,
            s.n_heads,
            s.n_kv_heads,
            s.head_dim,
            s.block_size,
        ];
        let args = std::iter::once(mode.to_string())
            .chain(sizes.map(|v| v.to_string()))
            .chain([scale.to_string()]);
        run_harness(dir, args);
        rel_error(&self.want, &floats(&dir.join("out.bin")))
    }
}

/// Paged attention with the warps a decode launch takes and with a prefill launch's: three
/// decoding sequences (contexts of 100, 17 and 1) and a 5-row chunk after 55 cached
/// positions.
#[test]
fn paged_attention_matches_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let case = AttentionCase::write(dir.path(), &[(100, 1), (17, 1), (1, 1), (60, 5)], 7);
    let decode = attention_threads(case.rows, case.shape.n_heads);
    assert_eq!(decode, 512, "a launch this small takes the most warps");
    for threads in [decode, 128] {
        let err = case.error(dir.path(), "attention", threads as usize);
        // About 1e-4 at any warp count (as on the device: the CPU's exponential and sums
        // differ); a position lost or counted twice is 1e-1.
        assert!(err <= 1e-3, "{threads} threads: error {err}");
    }
}

/// The tiled prefill attention: two decoding sequences (one-row tiles), a 70-row chunk after
/// 20 cached positions (tiles of 32, 32 and 6 rows over three 32-position chunks of K and V)
/// and a 5-row chunk after 55.
#[test]
fn tiled_paged_attention_matches_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let spec = [(100, 1), (17, 1), (90, 70), (60, 5)];
    let case = AttentionCase::write(dir.path(), &spec, 11);
    let tiles = attention_tiles(spec.iter().map(|&(_, nq)| nq));
    assert_eq!(tiles, [0, 1, 2, 34, 66, 72, 77]);
    write_i32(dir.path().join("tiles.bin"), &tiles);
    let err = case.error(dir.path(), "attention_tiled", tiles.len() - 1);
    assert!(err <= 1e-3, "error {err}");
}
