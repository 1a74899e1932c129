//! Matmul throughput on SmolLM2-135M's shapes at decode (m = 1), batched decode (m = 32) and
//! prefill (m = 512) sizes. Before the criterion runs it prints a GFLOP/s summary table
//! (2 FLOPs per multiply-accumulate). Threads: rayon's global pool (`RAYON_NUM_THREADS`).
//!
//! `cargo bench -p kvmesh-kernels --bench matmul` (add `-- --summary-only` to skip criterion,
//! `-- --isa=avx2` to compare kernels, `-- <filter>` to pick cases).

use criterion::{BenchmarkId, Criterion, Throughput};
use kvmesh_kernels::cpu::{matmul_with, Isa};
use kvmesh_kernels::{QMatrix, WeightFormat};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::hint::black_box;
use std::time::{Duration, Instant};

/// (name, format, out features n, in features k)
const SHAPES: &[(&str, WeightFormat, usize, usize)] = &[
    ("qkv_576x960", WeightFormat::Q4_1, 960, 576),
    ("o_576x576", WeightFormat::Q4_1, 576, 576),
    ("gate_up_576x3072", WeightFormat::Q4_1, 3072, 576),
    ("down_1536x576", WeightFormat::Q4_1, 576, 1536),
    ("lm_head_576x49152", WeightFormat::Q8_0, 49152, 576),
];
const BATCHES: &[usize] = &[1, 32, 512];

fn random_matrix(f: WeightFormat, rows: usize, cols: usize) -> QMatrix {
    let mut rng = StdRng::seed_from_u64(1);
    let mut data: Vec<u8> = (0..rows * f.row_bytes(cols).unwrap())
        .map(|_| rng.gen())
        .collect();
    // Sane f16 scales (d, and m for Q4_1) at the start of every block.
    let bb = f.block_bytes();
    for blk in data.chunks_exact_mut(bb) {
        blk[..2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        if f == WeightFormat::Q4_1 {
            blk[2..4].copy_from_slice(&half::f16::from_f32(-0.08).to_le_bytes());
        }
    }
    QMatrix::new(f, rows, cols, data).unwrap()
}

fn inputs(n: usize, k: usize, f: WeightFormat, m: usize) -> (QMatrix, Vec<f32>, Vec<f32>) {
    let mut rng = StdRng::seed_from_u64(2);
    let x = (0..m * k).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    (random_matrix(f, n, k), x, vec![0.0; m * n])
}

/// CPU time of all this process's threads, in seconds (Linux; 0 elsewhere). On a shared
/// machine, FLOPs per CPU-second measure the kernels rather than the neighbours (though it
/// also counts rayon workers spinning between small calls, which deflates m = 1).
fn cpu_seconds() -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .sum::<f64>()
        * 1e-9
}

/// (wall, CPU) seconds per call, best of a few ~0.3 s rounds.
fn time(isa: Isa, w: &QMatrix, x: &[f32], m: usize, out: &mut [f32]) -> (f64, f64) {
    matmul_with(isa, w, x, m, out);
    let (mut best, mut best_cpu) = (f64::MAX, f64::MAX);
    for _ in 0..3 {
        let (start, cpu0, mut iters) = (Instant::now(), cpu_seconds(), 0u32);
        while start.elapsed() < Duration::from_millis(300) || iters < 3 {
            matmul_with(isa, w, black_box(x), m, out);
            iters += 1;
        }
        best = best.min(start.elapsed().as_secs_f64() / iters as f64);
        best_cpu = best_cpu.min((cpu_seconds() - cpu0) / iters as f64);
    }
    (best, best_cpu)
}

fn summary(isa: Isa, filter: Option<&str>) {
    println!(
        "matmul GFLOP/s ({isa:?}, {} threads); in brackets: GFLOP per CPU-second (per core)",
        rayon::current_num_threads(),
    );
    println!(
        "{:<20} {:>16} {:>16} {:>16}",
        "shape", "m=1", "m=32", "m=512"
    );
    for &(name, f, n, k) in SHAPES {
        if filter.is_some_and(|fl| !name.contains(fl)) {
            continue;
        }
        let mut line = format!("{name:<20}");
        for &m in BATCHES {
            let (w, x, mut out) = inputs(n, k, f, m);
            let (secs, cpu) = time(isa, &w, &x, m, &mut out);
            let flop = 2.0 * (m * n * k) as f64 / 1e9;
            line += &format!(" {:>7.1} [{:>6.1}]", flop / secs, flop / cpu);
        }
        println!("{line}");
    }
}

fn bench(c: &mut Criterion) {
    let isa = Isa::detect();
    for &(name, f, n, k) in SHAPES {
        let mut g = c.benchmark_group(name);
        g.sample_size(10).measurement_time(Duration::from_secs(2));
        for &m in BATCHES {
            let (w, x, mut out) = inputs(n, k, f, m);
            g.throughput(Throughput::Elements((m * n * k) as u64));
            g.bench_with_input(BenchmarkId::new("m", m), &m, |b, &m| {
                b.iter(|| matmul_with(isa, &w, black_box(&x), m, &mut out))
            });
        }
        g.finish();
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let filter = args
        .iter()
        .find(|a| !a.starts_with('-'))
        .map(String::as_str);
    // `--isa=portable|avx2|avx512|amx` compares kernels on the same machine.
    let isa = args
        .iter()
        .find_map(|a| Isa::from_name(a.strip_prefix("--isa=")?))
        .unwrap_or_else(Isa::detect);
    summary(isa, filter);
    if args.iter().any(|a| a == "--summary-only") {
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}
