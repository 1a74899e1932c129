//! Paged attention: SIMD vs portable (bit-exact), against an f64 reference, and invariance
//! to batching, chunking and block placement.

use half::f16;
use kvmesh_kernels::cpu::{paged_attention_with, write_kv, AttentionSeq, AttentionShape, Isa};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

struct Cache {
    k: Vec<f16>,
    v: Vec<f16>,
}

/// A cache with `num_blocks` blocks and, per sequence, a shuffled block table filled with
/// random K/V for `len` positions.
fn setup(shape: &AttentionShape, lens: &[usize], rng: &mut StdRng) -> (Cache, Vec<Vec<u32>>) {
    let per_seq: Vec<usize> = lens.iter().map(|l| l.div_ceil(shape.block_size)).collect();
    let num_blocks = per_seq.iter().sum::<usize>() + 3;
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    ids.shuffle(rng);
    let block_elems = shape.n_kv_heads * shape.block_size * shape.head_dim;
    // Fill with NaN so reads of unwritten slots would poison the results.
    let mut cache = Cache {
        k: vec![f16::NAN; num_blocks * block_elems],
        v: vec![f16::NAN; num_blocks * block_elems],
    };
    let mut tables = Vec::new();
    let mut next = 0;
    for (&len, &nb) in lens.iter().zip(&per_seq) {
        let table = ids[next..next + nb].to_vec();
        next += nb;
        let row = shape.n_kv_heads * shape.head_dim;
        let k: Vec<f32> = (0..len * row).map(|_| rng.gen_range(-2.0..2.0)).collect();
        let v: Vec<f32> = (0..len * row).map(|_| rng.gen_range(-1.0..1.0)).collect();
        write_kv(shape, &table, 0, &k, &v, &mut cache.k, &mut cache.v);
        tables.push(table);
    }
    (cache, tables)
}

fn attend(
    isa: Isa,
    shape: &AttentionShape,
    seqs: &[AttentionSeq],
    q: &[f32],
    c: &Cache,
) -> Vec<f32> {
    let mut out = vec![0.0; q.len()];
    paged_attention_with(isa, shape, seqs, q, &c.k, &c.v, &mut out);
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Straightforward f64 attention for one sequence.
fn reference(shape: &AttentionShape, s: &AttentionSeq, q: &[f32], c: &Cache) -> Vec<f64> {
    let hd = shape.head_dim;
    let qrow = shape.n_heads * hd;
    let group = shape.n_heads / shape.n_kv_heads;
    let at = |cache: &[f16], pos: usize, kv: usize, d: usize| {
        let b = s.block_table[pos / shape.block_size] as usize;
        let o = ((b * shape.n_kv_heads + kv) * shape.block_size + pos % shape.block_size) * hd;
        cache[o + d].to_f64()
    };
    let mut out = vec![0.0; s.n_q * qrow];
    for j in 0..s.n_q {
        let p = s.start_pos + j;
        for h in 0..shape.n_heads {
            let kv = h / group;
            let qv = &q[(s.q_offset + j) * qrow + h * hd..][..hd];
            let sc: Vec<f64> = (0..=p)
                .map(|t| {
                    (0..hd)
                        .map(|d| qv[d] as f64 * at(&c.k, t, kv, d))
                        .sum::<f64>()
                        / (hd as f64).sqrt()
                })
                .collect();
            let mx = sc.iter().cloned().fold(f64::MIN, f64::max);
            let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
            let l: f64 = e.iter().sum();
            for d in 0..hd {
                let acc: f64 = (0..=p).map(|t| e[t] * at(&c.v, t, kv, d)).sum();
                out[j * qrow + h * hd + d] = acc / l;
            }
        }
    }
    out
}

fn shapes() -> Vec<AttentionShape> {
    let s = |n_heads, n_kv_heads, head_dim, block_size| AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim,
        block_size,
    };
    vec![
        s(9, 3, 64, 16),  // SmolLM2-135M
        s(4, 4, 32, 8),   // MHA
        s(32, 1, 64, 16), // group wider than the 16 lanes
        s(8, 2, 128, 5),  // odd block size
        s(6, 2, 48, 7),   // head_dim without a SIMD kernel: portable fallback
    ]
}

fn check(shape: &AttentionShape, specs: &[(usize, usize)], seed: u64) {
    // specs: (start_pos, n_q) per sequence.
    let mut rng = StdRng::seed_from_u64(seed);
    let lens: Vec<usize> = specs.iter().map(|(s, n)| s + n).collect();
    let (cache, tables) = setup(shape, &lens, &mut rng);
    let qrow = shape.n_heads * shape.head_dim;
    let mut seqs = Vec::new();
    let mut off = 0;
    for (&(start_pos, n_q), t) in specs.iter().zip(&tables) {
        seqs.push(AttentionSeq {
            q_offset: off,
            n_q,
            start_pos,
            block_table: t,
        });
        off += n_q;
    }
    let q: Vec<f32> = (0..off * qrow).map(|_| rng.gen_range(-1.5..1.5)).collect();
    let base = attend(Isa::Portable, shape, &seqs, &q, &cache);
    for s in &seqs {
        let want = reference(shape, s, &q, &cache);
        let got = &base[s.q_offset * qrow..(s.q_offset + s.n_q) * qrow];
        for (g, w) in got.iter().zip(&want) {
            assert!((*g as f64 - w).abs() < 2e-3, "{shape:?}: got {g} want {w}");
        }
    }
    for isa in [Isa::Portable, Isa::Avx2, Isa::Avx512] {
        if !isa.is_supported() {
            continue;
        }
        let all = attend(isa, shape, &seqs, &q, &cache);
        assert_eq!(bits(&all), bits(&base), "{isa:?} vs portable {shape:?}");
        for s in &seqs {
            let rows = s.q_offset * qrow..(s.q_offset + s.n_q) * qrow;
            // Alone in the batch.
            let alone = AttentionSeq { q_offset: 0, ..*s };
            let one = attend(isa, shape, &[alone], &q[rows.clone()], &cache);
            assert_eq!(bits(&one), bits(&all[rows.clone()]), "batch invariance");
            // One row at a time, as decode would.
            for j in 0..s.n_q {
                let r = (s.q_offset + j) * qrow..(s.q_offset + j + 1) * qrow;
                let step = AttentionSeq {
                    q_offset: 0,
                    n_q: 1,
                    start_pos: s.start_pos + j,
                    ..*s
                };
                let one = attend(isa, shape, &[step], &q[r.clone()], &cache);
                assert_eq!(bits(&one), bits(&all[r]), "chunking invariance");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn attention_matches(shape_i in 0usize..5,
                         specs in proptest::collection::vec((0usize..40, 1usize..12), 1..4),
                         seed: u64) {
        check(&shapes()[shape_i], &specs, seed);
    }
}

#[test]
fn long_prefill_parallel() {
    check(&shapes()[0], &[(0, 200), (37, 70)], 11);
}

#[test]
fn write_kv_places_rows() {
    let shape = AttentionShape {
        n_heads: 2,
        n_kv_heads: 2,
        head_dim: 4,
        block_size: 2,
    };
    let table = [3u32, 0];
    let mut k = vec![f16::ZERO; 4 * 2 * 2 * 4];
    let mut v = k.clone();
    let rows: Vec<f32> = (0..3 * 8).map(|i| i as f32).collect();
    write_kv(&shape, &table, 1, &rows, &rows, &mut k, &mut v);
    // Position 1 -> block 3 slot 1; position 2 -> block 0 slot 0.
    let at = |b: usize, h: usize, s: usize| ((b * 2 + h) * 2 + s) * 4;
    assert_eq!(k[at(3, 0, 1)].to_f32(), 0.0);
    assert_eq!(k[at(3, 1, 1) + 3].to_f32(), 7.0);
    assert_eq!(v[at(0, 0, 0)].to_f32(), 8.0);
    assert_eq!(k[at(0, 1, 1) + 2].to_f32(), 22.0);
}
