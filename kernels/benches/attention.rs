//! Paged attention throughput for SmolLM2-135M's heads (9 query, 3 KV, head_dim 64, blocks of
//! 16): prefill of 512 tokens, and decode of one token per sequence at a context of 512 for
//! batches of 1 and 32. Prints GFLOP/s (QK and PV, 2 FLOPs per multiply-add) per case, then
//! runs criterion (`-- --summary-only` to skip it).

use criterion::{Criterion, Throughput};
use half::f16;
use kvmesh_kernels::cpu::{paged_attention_with, AttentionSeq, AttentionShape, Isa};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::hint::black_box;
use std::time::{Duration, Instant};

const SHAPE: AttentionShape = AttentionShape {
    n_heads: 9,
    n_kv_heads: 3,
    head_dim: 64,
    block_size: 16,
};

struct Case {
    name: &'static str,
    /// (start_pos, n_q) per sequence.
    seqs: Vec<(usize, usize)>,
}

struct Input {
    q: Vec<f32>,
    k: Vec<f16>,
    v: Vec<f16>,
    tables: Vec<Vec<u32>>,
    out: Vec<f32>,
    flops: f64,
}

fn input(c: &Case) -> Input {
    let mut rng = StdRng::seed_from_u64(5);
    let bs = SHAPE.block_size;
    let per: Vec<usize> = c.seqs.iter().map(|(s, n)| (s + n).div_ceil(bs)).collect();
    let blocks: usize = per.iter().sum();
    let mut next = 0u32;
    let tables = per
        .iter()
        .map(|&n| {
            next += n as u32;
            (next - n as u32..next).collect()
        })
        .collect();
    let cache = blocks * SHAPE.n_kv_heads * bs * SHAPE.head_dim;
    let rows: usize = c.seqs.iter().map(|s| s.1).sum();
    let qlen = rows * SHAPE.n_heads * SHAPE.head_dim;
    let attended: usize = c
        .seqs
        .iter()
        .map(|&(s, n)| (0..n).map(|j| s + j + 1).sum::<usize>())
        .sum();
    Input {
        q: (0..qlen).map(|_| rng.gen_range(-1.0..1.0)).collect(),
        k: (0..cache)
            .map(|_| f16::from_f32(rng.gen_range(-1.0..1.0)))
            .collect(),
        v: (0..cache)
            .map(|_| f16::from_f32(rng.gen_range(-1.0..1.0)))
            .collect(),
        tables,
        out: vec![0.0; qlen],
        flops: (4 * SHAPE.n_heads * SHAPE.head_dim * attended) as f64,
    }
}

fn run(isa: Isa, c: &Case, i: &mut Input) {
    let mut off = 0;
    let seqs: Vec<AttentionSeq> = c
        .seqs
        .iter()
        .zip(&i.tables)
        .map(|(&(start_pos, n_q), t)| {
            off += n_q;
            AttentionSeq {
                q_offset: off - n_q,
                n_q,
                start_pos,
                block_table: t,
            }
        })
        .collect();
    paged_attention_with(isa, &SHAPE, &seqs, black_box(&i.q), &i.k, &i.v, &mut i.out);
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "prefill_512",
            seqs: vec![(0, 512)],
        },
        Case {
            name: "decode_b1_ctx512",
            seqs: vec![(512, 1)],
        },
        Case {
            name: "decode_b32_ctx512",
            seqs: vec![(512, 1); 32],
        },
    ]
}

fn main() {
    let isa = Isa::detect();
    println!(
        "attention ({isa:?}, {} threads)",
        rayon::current_num_threads()
    );
    for c in cases() {
        let mut i = input(&c);
        run(isa, &c, &mut i);
        let mut best = f64::MAX;
        for _ in 0..3 {
            let (t, mut n) = (Instant::now(), 0);
            while t.elapsed() < Duration::from_millis(300) || n < 3 {
                run(isa, &c, &mut i);
                n += 1;
            }
            best = best.min(t.elapsed().as_secs_f64() / n as f64);
        }
        println!(
            "{:<20} {:>9.1} us  {:>6.1} GFLOP/s",
            c.name,
            best * 1e6,
            i.flops / best / 1e9
        );
    }
    if std::env::args().any(|a| a == "--summary-only") {
        return;
    }
    let mut cr = Criterion::default().configure_from_args();
    let mut g = cr.benchmark_group("attention");
    g.sample_size(10).measurement_time(Duration::from_secs(2));
    for c in cases() {
        let mut i = input(&c);
        g.throughput(Throughput::Elements(i.flops as u64 / 2));
        g.bench_function(c.name, |b| b.iter(|| run(isa, &c, &mut i)));
    }
    g.finish();
    cr.final_summary();
}
