//! A synthetic SmolLM2-135M forward pass built only from this crate's ops (random weights,
//! the real shapes and formats), to check the whole-model throughput targets without the
//! engine: prefill of 512 tokens, batch-1 decode and batch-32 decode.
//!
//! `cargo bench -p kvmesh-kernels --bench forward` (threads: `RAYON_NUM_THREADS`). With
//! `-- --in-pool` each step runs on a rayon worker (as an engine would with
//! `ThreadPool::install`), so kernel calls skip the cross-thread wake-up of calls made from
//! outside the pool.

use half::f16;
use kvmesh_kernels::cpu::{self, AttentionSeq, AttentionShape};
use kvmesh_kernels::{QMatrix, WeightFormat};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::Mutex;
use std::time::Instant;

/// Seconds spent per op kind, for the breakdown line.
static SPENT: Mutex<Vec<(&'static str, f64)>> = Mutex::new(Vec::new());

fn timed<R>(name: &'static str, f: impl FnOnce() -> R) -> R {
    let t = Instant::now();
    let r = f();
    let dt = t.elapsed().as_secs_f64();
    let mut s = SPENT.lock().unwrap();
    match s.iter_mut().find(|(n, _)| *n == name) {
        Some(e) => e.1 += dt,
        None => s.push((name, dt)),
    }
    r
}

fn breakdown() -> String {
    let mut s = SPENT.lock().unwrap();
    let total: f64 = s.iter().map(|e| e.1).sum();
    let line = s
        .iter()
        .map(|(n, t)| format!("{n} {:.0}%", 100.0 * t / total))
        .collect::<Vec<_>>()
        .join(", ");
    s.clear();
    line
}

const LAYERS: usize = 30;
const HIDDEN: usize = 576;
const HEADS: usize = 9;
const KV_HEADS: usize = 3;
const HEAD_DIM: usize = 64;
const INTER: usize = 1536;
const VOCAB: usize = 49152;
const BLOCK: usize = 16;
const QKV: usize = (HEADS + 2 * KV_HEADS) * HEAD_DIM;

fn random_q(f: WeightFormat, rows: usize, cols: usize, rng: &mut StdRng) -> QMatrix {
    let mut data: Vec<u8> = (0..rows * f.row_bytes(cols).unwrap())
        .map(|_| rng.gen())
        .collect();
    for blk in data.chunks_exact_mut(f.block_bytes()) {
        blk[..2].copy_from_slice(&f16::from_f32(0.004).to_le_bytes());
        if f == WeightFormat::Q4_1 {
            blk[2..4].copy_from_slice(&f16::from_f32(-0.03).to_le_bytes());
        }
    }
    QMatrix::new(f, rows, cols, data).unwrap()
}

struct Layer {
    qkv: QMatrix,
    o: QMatrix,
    gate_up: QMatrix,
    down: QMatrix,
    k_cache: Vec<f16>,
    v_cache: Vec<f16>,
}

struct Model {
    layers: Vec<Layer>,
    embed: QMatrix,
    norm: Vec<f32>,
}

const SHAPE: AttentionShape = AttentionShape {
    n_heads: HEADS,
    n_kv_heads: KV_HEADS,
    head_dim: HEAD_DIM,
    block_size: BLOCK,
};

impl Model {
    fn new(num_blocks: usize) -> Model {
        let mut rng = StdRng::seed_from_u64(3);
        let cache = num_blocks * KV_HEADS * BLOCK * HEAD_DIM;
        let layers = (0..LAYERS)
            .map(|_| Layer {
                qkv: random_q(WeightFormat::Q4_1, QKV, HIDDEN, &mut rng),
                o: random_q(WeightFormat::Q4_1, HIDDEN, HIDDEN, &mut rng),
                gate_up: random_q(WeightFormat::Q4_1, 2 * INTER, HIDDEN, &mut rng),
                down: random_q(WeightFormat::Q4_1, HIDDEN, INTER, &mut rng),
                k_cache: vec![f16::ZERO; cache],
                v_cache: vec![f16::ZERO; cache],
            })
            .collect();
        Model {
            layers,
            embed: random_q(WeightFormat::Q8_0, VOCAB, HIDDEN, &mut rng),
            norm: vec![1.0; HIDDEN],
        }
    }

    /// One forward step, on a pool worker when `IN_POOL` is set.
    fn step(&mut self, tokens: &[usize], starts: &[usize], tables: &[Vec<u32>]) -> Vec<f32> {
        if IN_POOL.load(std::sync::atomic::Ordering::Relaxed) {
            let mut out = Vec::new();
            rayon::scope(|_| out = self.step_here(tokens, starts, tables));
            out
        } else {
            self.step_here(tokens, starts, tables)
        }
    }

    /// One forward step for a batch of sequences: `tokens[i]` new tokens for sequence `i`,
    /// which already has `starts[i]` cached. Returns logits for each sequence's last token.
    fn step_here(&mut self, tokens: &[usize], starts: &[usize], tables: &[Vec<u32>]) -> Vec<f32> {
        let m: usize = tokens.iter().sum();
        let mut x = vec![0.0f32; m * HIDDEN];
        for (t, row) in x.chunks_exact_mut(HIDDEN).enumerate() {
            self.embed.dequantize_row((t * 7919) % VOCAB, row);
        }
        let positions: Vec<usize> = tokens
            .iter()
            .zip(starts)
            .flat_map(|(&n, &s)| s..s + n)
            .collect();
        let (mut h, mut qkv, mut att, mut tmp) = (
            vec![0.0; m * HIDDEN],
            vec![0.0; m * QKV],
            vec![0.0; m * HIDDEN],
            vec![0.0; m * HIDDEN],
        );
        let (mut q, mut k, mut v) = (
            vec![0.0; m * HIDDEN],
            vec![0.0; m * KV_HEADS * HEAD_DIM],
            vec![0.0; m * KV_HEADS * HEAD_DIM],
        );
        let (mut gu, mut act) = (vec![0.0; m * 2 * INTER], vec![0.0; m * INTER]);
        let kvw = KV_HEADS * HEAD_DIM;
        for layer in &mut self.layers {
            cpu::rmsnorm(&x, &self.norm, 1e-5, &mut h);
            timed("matmul", || cpu::matmul(&layer.qkv, &h, m, &mut qkv));
            for t in 0..m {
                let r = &qkv[t * QKV..(t + 1) * QKV];
                q[t * HIDDEN..(t + 1) * HIDDEN].copy_from_slice(&r[..HIDDEN]);
                k[t * kvw..(t + 1) * kvw].copy_from_slice(&r[HIDDEN..HIDDEN + kvw]);
                v[t * kvw..(t + 1) * kvw].copy_from_slice(&r[HIDDEN + kvw..]);
            }
            timed("rope", || {
                cpu::rope(&mut q, &positions, HEADS, HEAD_DIM, 100000.0, false);
                cpu::rope(&mut k, &positions, KV_HEADS, HEAD_DIM, 100000.0, false);
            });
            let mut seqs = Vec::new();
            let mut off = 0;
            for ((&n, &s), table) in tokens.iter().zip(starts).zip(tables) {
                let rows = off * kvw..(off + n) * kvw;
                cpu::write_kv(
                    &SHAPE,
                    table,
                    s,
                    &k[rows.clone()],
                    &v[rows],
                    &mut layer.k_cache,
                    &mut layer.v_cache,
                );
                seqs.push(AttentionSeq {
                    q_offset: off,
                    n_q: n,
                    start_pos: s,
                    block_table: table,
                });
                off += n;
            }
            timed("attention", || {
                cpu::paged_attention(&SHAPE, &seqs, &q, &layer.k_cache, &layer.v_cache, &mut att)
            });
            timed("matmul", || cpu::matmul(&layer.o, &att, m, &mut tmp));
            cpu::add_in_place(&mut x, &tmp);
            cpu::rmsnorm(&x, &self.norm, 1e-5, &mut h);
            timed("matmul", || cpu::matmul(&layer.gate_up, &h, m, &mut gu));
            timed("silu", || cpu::silu_mul(&gu, INTER, &mut act));
            timed("matmul", || cpu::matmul(&layer.down, &act, m, &mut tmp));
            cpu::add_in_place(&mut x, &tmp);
        }
        // Logits only for each sequence's last token.
        let mut last = Vec::new();
        let mut off = 0;
        for &n in tokens {
            off += n;
            last.extend_from_slice(&x[(off - 1) * HIDDEN..off * HIDDEN]);
        }
        let mut normed = vec![0.0; last.len()];
        cpu::rmsnorm(&last, &self.norm, 1e-5, &mut normed);
        let mut logits = vec![0.0; tokens.len() * VOCAB];
        timed("lm_head", || {
            cpu::matmul(&self.embed, &normed, tokens.len(), &mut logits)
        });
        logits
    }
}

fn tables(seqs: usize, ctx: usize) -> Vec<Vec<u32>> {
    let per = ctx.div_ceil(BLOCK) as u32;
    (0..seqs as u32)
        .map(|s| (s * per..(s + 1) * per).collect())
        .collect()
}

static IN_POOL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn main() {
    let in_pool = std::env::args().any(|a| a == "--in-pool");
    IN_POOL.store(in_pool, std::sync::atomic::Ordering::Relaxed);
    let threads = rayon::current_num_threads();
    println!(
        "synthetic SmolLM2-135M forward, {:?}, {threads} threads{}",
        cpu::Isa::detect(),
        if in_pool {
            ", steps on a pool worker"
        } else {
            ""
        }
    );
    const PROMPT: usize = 512;
    const DECODE_STEPS: usize = 16;
    {
        let tables = tables(1, PROMPT);
        let mut model = Model::new(PROMPT.div_ceil(BLOCK));
        // Prefill: one sequence of 512 tokens (the first run also warms up).
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            model.step(&[PROMPT], &[0], &tables);
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!(
            "prefill {PROMPT} tokens:           {:>7.1} tok/s   [{}]",
            PROMPT as f64 / best,
            breakdown()
        );
    }
    for &(batch, ctx) in &[(1usize, 128usize), (1, 512), (32, 128), (32, 512)] {
        let total = ctx + DECODE_STEPS + 1;
        let tables = tables(batch, total);
        let mut model = Model::new(batch * total.div_ceil(BLOCK));
        // Caches hold whatever is there; only the timing matters.
        let starts = vec![ctx; batch];
        model.step(&vec![1; batch], &starts, &tables);
        breakdown();
        let t = Instant::now();
        for i in 0..DECODE_STEPS {
            let starts: Vec<usize> = starts.iter().map(|s| s + i).collect();
            model.step(&vec![1; batch], &starts, &tables);
        }
        let secs = t.elapsed().as_secs_f64();
        println!(
            "decode batch {batch:>2} @ctx {ctx:>3}: {:>7.1} tok/s ({:>5.2} ms/step)   [{}]",
            (batch * DECODE_STEPS) as f64 / secs,
            secs / DECODE_STEPS as f64 * 1e3,
            breakdown()
        );
    }
}
