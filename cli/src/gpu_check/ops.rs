//! Every CUDA op against the CPU backend's on the same random inputs: the largest absolute
//! error and that error relative to the reference's largest magnitude, against a bound per op.

use anyhow::Result;
use half::f16;
use kvmesh_kernels::cpu::{self, AttentionSeq, AttentionShape};
use kvmesh_kernels::cuda::{
    attention_threads, attention_tiles, CudaDevice, CudaSlice, CudaView, GemvKernel, KvGeometry,
    GEMV_MAX_M,
};
use kvmesh_kernels::{QMatrix, WeightFormat};
use serde_json::{json, Value};

use super::HBM_BYTES_PER_S;

struct Rng(u64);

impl Rng {
    fn f(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f()).collect()
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| (self.f() * 127.0) as i8 as u8).collect()
    }
}

/// (max abs error, max abs error / max |reference|).
fn errors(want: &[f32], got: &[f32]) -> (f32, f32) {
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12);
    let abs = want
        .iter()
        .zip(got)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    (abs, abs / scale)
}

struct Checks<'a> {
    out: serde_json::Map<String, Value>,
    failures: &'a mut Vec<String>,
}

impl Checks<'_> {
    fn compare(&mut self, name: &str, want: &[f32], got: &[f32], bound: f32) {
        let (abs, rel) = errors(want, got);
        let pass = want.len() == got.len() && rel <= bound;
        if !pass {
            self.failures
                .push(format!("op {name}: relative error {rel} > {bound}"));
        }
        self.out.insert(
            name.into(),
            json!({"max_abs_error": abs, "max_rel_error": rel, "bound": bound, "pass": pass}),
        );
    }

    fn exact(&mut self, name: &str, equal: bool) {
        if !equal {
            self.failures.push(format!("op {name}: not exact"));
        }
        self.out
            .insert(name.into(), json!({"exact": true, "pass": equal}));
    }
}

/// A Q8_0 or Q4_1 matrix with random quants and sane scales.
fn qmatrix(rng: &mut Rng, format: WeightFormat, rows: usize, cols: usize) -> QMatrix {
    let mut data = rng.bytes(rows * format.row_bytes(cols).unwrap_or(0));
    let d = f16::from_f32(0.01).to_le_bytes();
    for b in data.chunks_exact_mut(format.block_bytes()) {
        b[..2].copy_from_slice(&d);
        if format == WeightFormat::Q4_1 {
            b[2..4].copy_from_slice(&f16::from_f32(-0.07).to_le_bytes());
        }
    }
    QMatrix::new(format, rows, cols, data).unwrap_or_else(|e| panic!("{e}"))
}

pub fn check(ordinal: usize, failures: &mut Vec<String>) -> Result<Value> {
    // The int8 GEMV (the default): every matrix uploaded here carries its split copy, so both
    // GEMVs run on the same uploads.
    let mut dev = CudaDevice::open(ordinal)?;
    let mut rng = Rng(7);
    let mut c = Checks {
        out: serde_json::Map::new(),
        failures,
    };
    c.out.insert("device_name".into(), json!(dev.name()));
    c.out.insert("capability".into(), json!(dev.capability()));

    // RMSNorm and SiLU·mul over [64, 4096].
    let (rows, d) = (64, 4096);
    let (x, w) = (rng.vec(rows * d), rng.vec(d));
    let mut want = vec![0.0; rows * d];
    cpu::rmsnorm(&x, &w, 1e-5, &mut want);
    let (xd, wd) = (dev.upload(&x)?, dev.upload(&w)?);
    let mut out = dev.zeros::<f32>(rows * d)?;
    dev.rmsnorm(&xd.slice(..), &wd, 1e-5, rows, &mut out.slice_mut(..))?;
    let mut got = Vec::new();
    dev.download(&out.slice(..), &mut got)?;
    c.compare("rmsnorm", &want, &got, 1e-5);

    let inter = d / 2;
    let mut want = vec![0.0; rows * inter];
    cpu::silu_mul(&x, inter, &mut want);
    let mut out = dev.zeros::<f32>(rows * inter)?;
    dev.silu_mul(&xd.slice(..), inter, rows, &mut out.slice_mut(..))?;
    dev.download(&out.slice(..), &mut got)?;
    c.compare("silu_mul", &want, &got, 1e-5);

    // RoPE, both pairings, positions up to 100k.
    for interleaved in [true, false] {
        let (n, heads, hd) = (16, 8, 128);
        let positions: Vec<usize> = (0..n).map(|i| i * 6151).collect();
        let x = rng.vec(n * heads * hd);
        let mut want = x.clone();
        cpu::rope(&mut want, &positions, heads, hd, 500000.0, interleaved);
        let mut xd = dev.upload(&x)?;
        let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        let pd = dev.upload(&pos)?;
        dev.rope(
            &mut xd.slice_mut(..),
            &pd.slice(..),
            n,
            heads * hd,
            heads,
            hd,
            500000.0,
            interleaved,
        )?;
        dev.download(&xd.slice(..), &mut got)?;
        let name = if interleaved {
            "rope_interleaved"
        } else {
            "rope_neox"
        };
        c.compare(name, &want, &got, 1e-5);
    }

    // Matmuls against the CPU's, which quantizes the activations to int8 per block of 32. The
    // int8 GEMV (m <= 8) does the CPU's arithmetic per block, bit for bit, and differs only in
    // the order of its f32 sums (and Q8_0's half blocks scaled apart): a tight bound. The
    // reference GEMV (f32 activations) and cuBLAS (bf16 weights and activations, m = 64) miss
    // the CPU's rounding of the activations: a loose one. 1003 x 2080: rows not a multiple of
    // the int8 GEMV's 4 per thread block, 65 blocks per row (threads without one).
    for (n_out, k) in [(1024, 2048), (1003, 2080)] {
        for format in [WeightFormat::Q8_0, WeightFormat::Q4_1] {
            let w = qmatrix(&mut rng, format, n_out, k);
            let wd = dev.upload_matrix(&w)?;
            let mut scratch = dev.zeros::<u16>(64 * k)?;
            for m in [1usize, 2, 3, 5, 8, 64] {
                let x = rng.vec(m * k);
                let mut want = vec![0.0; m * n_out];
                cpu::matmul(&w, &x, m, &mut want);
                let xd = dev.upload(&x)?;
                let mut out = dev.zeros::<f32>(m * n_out)?;
                let runs: &[(GemvKernel, &str, f32)] = match m {
                    1 | 8 => &[
                        (GemvKernel::Dp4a, "dp4a", 1e-4),
                        (GemvKernel::Reference, "reference", 2e-2),
                    ],
                    _ if m <= GEMV_MAX_M => &[(GemvKernel::Dp4a, "dp4a", 1e-4)],
                    _ => &[(GemvKernel::Dp4a, "cublas", 2e-2)],
                };
                for &(kernel, name, bound) in runs {
                    dev.set_gemv(kernel);
                    dev.matmul(&wd, &xd.slice(..), m, &mut out.slice_mut(..), &mut scratch)?;
                    dev.download(&out.slice(..), &mut got)?;
                    let key = format!("matmul_{format:?}_{n_out}x{k}_m{m}_{name}");
                    c.compare(&key, &want, &got, bound);
                }
                dev.set_gemv(GemvKernel::Dp4a);
            }
        }
    }

    // Embedding gather of Q8_0 rows: exact (the same dequantization).
    let table = qmatrix(&mut rng, WeightFormat::Q8_0, 512, 256);
    let td = dev.upload_matrix(&table)?;
    let tokens: Vec<i32> = vec![0, 511, 17, 17, 300];
    let mut want = vec![0.0; tokens.len() * 256];
    for (row, &t) in want.chunks_exact_mut(256).zip(&tokens) {
        table.dequantize_row(t as usize, row);
    }
    let tk = dev.upload(&tokens)?;
    let mut out = dev.zeros::<f32>(tokens.len() * 256)?;
    dev.embed(&td, &tk.slice(..), tokens.len(), &mut out.slice_mut(..))?;
    dev.download(&out.slice(..), &mut got)?;
    c.exact("embed_q8_0", want == got);

    // Paged attention: 4 decoding sequences and one prefill chunk over a cached prefix, with
    // shuffled block tables; KV appended on the device and on the CPU from the same rows.
    let g = KvGeometry {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
        block_size: 16,
        num_blocks: 400,
    };
    let shape = AttentionShape {
        n_heads: g.n_heads,
        n_kv_heads: g.n_kv_heads,
        head_dim: g.head_dim,
        block_size: g.block_size,
    };
    let kv_row = g.n_kv_heads * g.head_dim;
    let q_row = g.n_heads * g.head_dim;
    let layer = g.block_elems() * g.num_blocks;
    let (mut kc, mut vc) = (vec![f16::ZERO; layer], vec![f16::ZERO; layer]);
    let (mut kd, mut vd) = (dev.zeros::<u16>(layer)?, dev.zeros::<u16>(layer)?);
    // (context length, query rows): four decodes and a 100-row prefill after 200 cached.
    let seqs_spec = [(1000usize, 1usize), (17, 1), (1, 1), (333, 1), (300, 100)];
    let mut tables: Vec<Vec<u32>> = Vec::new();
    let mut next_block = 0u32;
    for &(len, _) in &seqs_spec {
        let n = len.div_ceil(g.block_size) as u32;
        // Reversed block order: the table, not adjacency, must decide.
        tables.push((next_block..next_block + n).rev().collect());
        next_block += n;
    }
    let (mut q, mut row_pos, mut row_table, mut flat) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut seqs = Vec::new();
    for (i, &(len, nq)) in seqs_spec.iter().enumerate() {
        let k = rng.vec(len * kv_row);
        let v = rng.vec(len * kv_row);
        cpu::write_kv(&shape, &tables[i], 0, &k, &v, &mut kc, &mut vc);
        let slots: Vec<i32> = (0..len)
            .map(|p| {
                (tables[i][p / g.block_size] as usize * g.block_size + p % g.block_size) as i32
            })
            .collect();
        let (kdev, vdev, sdev) = (dev.upload(&k)?, dev.upload(&v)?, dev.upload(&slots)?);
        dev.kv_append(
            &g,
            &kdev.slice(..),
            &vdev.slice(..),
            kv_row,
            &sdev.slice(..),
            len,
            &mut kd,
            &mut vd,
        )?;
        let at = flat.len() as i32;
        flat.extend(tables[i].iter().map(|&b| b as i32));
        seqs.push((q.len() / q_row, nq, len - nq));
        for j in 0..nq {
            row_pos.push((len - nq + j) as i32);
            row_table.push(at);
        }
        q.extend(rng.vec(nq * q_row));
    }
    // The appended caches agree bit for bit (both round to nearest even).
    let (mut kh, mut vh) = (Vec::new(), Vec::new());
    dev.download(&kd.slice(..), &mut kh)?;
    dev.download(&vd.slice(..), &mut vh)?;
    let kbits: Vec<u16> = kc.iter().map(|h| h.to_bits()).collect();
    let vbits: Vec<u16> = vc.iter().map(|h| h.to_bits()).collect();
    c.exact("kv_append", kh == kbits && vh == vbits);
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
    let rows = q.len() / q_row;
    let mut want = vec![0.0; q.len()];
    cpu::paged_attention(&shape, &cpu_seqs, &q, &kc, &vc, &mut want);
    let inputs = AttentionInputs::upload(&dev, &g, &q, [&row_pos, &row_table, &flat], (&kd, &vd))?;
    // The first `rows` rows' attention, row by row or (`tiles`) a tile at a time.
    let attend = |tiles: Option<(&CudaView<'_, i32>, usize)>,
                  rows: usize,
                  got: &mut Vec<f32>|
     -> Result<()> {
        let mut out = dev.zeros::<f32>(rows * q_row)?;
        inputs.run(&dev, tiles, rows, &mut out)?;
        dev.download(&out.slice(..), got)?;
        Ok(())
    };
    attend(None, rows, &mut got)?;
    c.compare("paged_attention", &want, &got, 5e-3);
    // A tile at a time: the 100-row prefill in tiles of 32, 32, 32 and 4.
    let tiles = attention_tiles(seqs_spec.iter().map(|&(_, nq)| nq));
    let tiles_dev = dev.upload(&tiles)?;
    attend(
        Some((&tiles_dev.slice(..), tiles.len() - 1)),
        rows,
        &mut got,
    )?;
    c.compare("paged_attention_tiled", &want, &got, 5e-3);
    // The four decode rows alone: a launch of few thread blocks, which takes more warps per
    // row (`attention_threads`) than the launch above.
    let decode_rows = 4;
    attend(None, decode_rows, &mut got)?;
    let warps = attention_threads(decode_rows, g.n_heads) / 32;
    let key = format!("paged_attention_decode_rows_{warps}_warps");
    c.compare(&key, &want[..decode_rows * q_row], &got, 5e-3);

    // KV pack to the transfer layout equals the CPU's gather; unpack restores it elsewhere.
    let ids: Vec<u32> = vec![5, 0, 63, 7];
    let mut want = Vec::<u16>::new();
    for &b in &ids {
        let r = b as usize * g.block_elems()..(b as usize + 1) * g.block_elems();
        want.extend_from_slice(&kbits[r.clone()]);
        want.extend_from_slice(&vbits[r]);
    }
    let idd = dev.upload(&ids.iter().map(|&b| b as i32).collect::<Vec<_>>())?;
    let mut packed = dev.zeros::<u16>(want.len())?;
    dev.kv_pack(
        &g,
        &kd,
        &vd,
        &idd.slice(..),
        ids.len(),
        &mut packed.slice_mut(..),
    )?;
    let mut host = Vec::new();
    dev.download(&packed.slice(..), &mut host)?;
    c.exact("kv_pack", host == want);
    let (mut k2, mut v2) = (dev.zeros::<u16>(layer)?, dev.zeros::<u16>(layer)?);
    let dst = dev.upload(&[300i32, 301, 302, 303])?;
    dev.kv_unpack(&g, &packed.slice(..), &dst.slice(..), 4, &mut k2, &mut v2)?;
    let mut back = dev.zeros::<u16>(want.len())?;
    dev.kv_pack(&g, &k2, &v2, &dst.slice(..), 4, &mut back.slice_mut(..))?;
    dev.download(&back.slice(..), &mut host)?;
    c.exact("kv_unpack", host == want);

    // Greedy and truncated sampling over a 128k vocabulary.
    let (rows, vocab) = (4usize, 128256usize);
    let logits: Vec<f32> = (0..rows * vocab).map(|_| rng.f() * 10.0).collect();
    let ld = dev.upload(&logits)?;
    let mut ids = dev.zeros::<i32>(rows)?;
    dev.argmax(&ld.slice(..), vocab, rows, &mut ids.slice_mut(..))?;
    let mut got_ids = Vec::new();
    dev.download(&ids.slice(..), &mut got_ids)?;
    let want_ids: Vec<i32> = logits
        .chunks_exact(vocab)
        .map(|l| kvmesh_engine::sampler::argmax(l) as i32)
        .collect();
    c.exact("argmax", got_ids == want_ids);
    // Top-k 40 at temperature 0.8: every draw must be one of the 40 highest logits.
    let (temp, topk, topp): (Vec<f32>, Vec<i32>, Vec<f32>) =
        (vec![0.8; rows], vec![40; rows], vec![0.9; rows]);
    let (td, kd2, pd2) = (dev.upload(&temp)?, dev.upload(&topk)?, dev.upload(&topp)?);
    let mut inside = true;
    for draw in 0..64 {
        let u: Vec<f32> = (0..rows)
            .map(|r| ((draw * 7 + r * 13) % 64) as f32 / 64.0)
            .collect();
        let ud = dev.upload(&u)?;
        dev.sample(
            &ld.slice(..),
            vocab,
            rows,
            &td.slice(..),
            &kd2.slice(..),
            &pd2.slice(..),
            &ud.slice(..),
            &mut ids.slice_mut(..),
        )?;
        dev.download(&ids.slice(..), &mut got_ids)?;
        for (r, &t) in got_ids.iter().enumerate() {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let mut sorted = row.to_vec();
            sorted.sort_by(|a, b| b.total_cmp(a));
            inside &= t >= 0 && (t as usize) < vocab && row[t as usize] >= sorted[39];
        }
    }
    c.exact("sample_top_k_top_p_in_set", inside);
    // Speed is a figure, not a check: when it cannot be measured, the ops above still stand.
    let speed = matmul_speed(&mut dev, &mut rng).unwrap_or_else(|e| {
        c.failures.push(format!("matmul_speed: {e:#}"));
        json!({"error": format!("{e:#}")})
    });
    c.out.insert("matmul_speed".into(), speed);
    let speed = prefill_layer_speed(&dev, &mut rng).unwrap_or_else(|e| {
        c.failures.push(format!("prefill_layer_ms: {e:#}"));
        json!({"error": format!("{e:#}")})
    });
    c.out.insert("prefill_layer_ms".into(), speed);
    Ok(Value::Object(c.out))
}

/// Seconds a launch takes, over `repeats` launched back to back after one untimed (module
/// loading, cuBLAS's heuristics); for launches long enough to time from the host.
fn seconds_per_launch(
    dev: &CudaDevice,
    repeats: usize,
    launch: &mut dyn FnMut() -> Result<()>,
) -> Result<f64> {
    launch()?;
    dev.synchronize()?;
    let t = std::time::Instant::now();
    for _ in 0..repeats {
        launch()?;
    }
    dev.synchronize()?;
    Ok(t.elapsed().as_secs_f64() / repeats as f64)
}

/// One attention launch's inputs on the device (see [`CudaDevice::attention`]).
struct AttentionInputs<'a> {
    g: &'a KvGeometry,
    q: CudaSlice<f32>,
    row_pos: CudaSlice<i32>,
    row_table: CudaSlice<i32>,
    tables: CudaSlice<i32>,
    k: &'a CudaSlice<u16>,
    v: &'a CudaSlice<u16>,
}

impl<'a> AttentionInputs<'a> {
    /// Uploads the queries and `[row_pos, row_table, tables]`, over the caches `(k, v)`.
    fn upload(
        dev: &CudaDevice,
        g: &'a KvGeometry,
        q: &[f32],
        [row_pos, row_table, tables]: [&[i32]; 3],
        (k, v): (&'a CudaSlice<u16>, &'a CudaSlice<u16>),
    ) -> Result<Self> {
        Ok(AttentionInputs {
            g,
            q: dev.upload(q)?,
            row_pos: dev.upload(row_pos)?,
            row_table: dev.upload(row_table)?,
            tables: dev.upload(tables)?,
            k,
            v,
        })
    }

    /// The attention of the first `rows` query rows into `out`, row by row or (`tiles`) a
    /// tile at a time.
    fn run(
        &self,
        dev: &CudaDevice,
        tiles: Option<(&CudaView<'_, i32>, usize)>,
        rows: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let q_row = self.g.n_heads * self.g.head_dim;
        dev.attention(
            self.g,
            &self.q.slice(..),
            q_row,
            &self.row_pos.slice(..),
            &self.row_table.slice(..),
            &self.tables.slice(..),
            tiles,
            rows,
            self.k,
            self.v,
            &mut out.slice_mut(..rows * q_row),
            q_row,
        )?;
        Ok(())
    }
}

/// One prefill layer's ops alone, each timed on its own: a 2,048-token chunk of a
/// Llama-3-8B-shaped model (hidden 4,096, 32 heads over 8 KV heads of 128, FFN 14,336,
/// Q4_1 weights through cuBLAS as the engine runs them), in milliseconds a launch; their sum
/// times 32 layers against the step's measured prefill shows what the step spends beyond its
/// ops. Attention runs row by row and a tile at a time (with TFLOP/s: the causal product's
/// multiply-adds, QK and PV); the sum takes the kernel the engine picks (tiled).
fn prefill_layer_speed(dev: &CudaDevice, rng: &mut Rng) -> Result<Value> {
    const ROWS: usize = 2_048;
    const HIDDEN: usize = 4_096;
    const FFN: usize = 14_336;
    const LAYERS: f64 = 32.0;
    const REPEATS: usize = 10;
    let time = |launch: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        Ok(seconds_per_launch(dev, REPEATS, launch)? * 1e3)
    };
    let g = KvGeometry {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
        block_size: 16,
        num_blocks: ROWS / 16,
    };
    let q_row = g.n_heads * g.head_dim;
    let kv_row = g.n_kv_heads * g.head_dim;
    let mut ms = serde_json::Map::new();
    let mut layer = 0.0;

    // The matmuls, widest input first (one scratch and one output serve them all).
    let x = dev.upload(&rng.vec(ROWS * FFN))?;
    let mut scratch = dev.zeros::<u16>(ROWS * FFN)?;
    let mut out = dev.zeros::<f32>(ROWS * 2 * FFN)?;
    let mut act = dev.zeros::<f32>(ROWS * FFN)?;
    for (name, rows, cols) in [
        ("matmul_qkv", q_row + 2 * kv_row, HIDDEN),
        ("matmul_o", HIDDEN, q_row),
        ("matmul_gate_up", 2 * FFN, HIDDEN),
        ("matmul_down", HIDDEN, FFN),
    ] {
        let w = dev.upload_matrix(&qmatrix(rng, WeightFormat::Q4_1, rows, cols))?;
        let t = time(&mut || {
            dev.matmul(
                &w,
                &x.slice(..ROWS * cols),
                ROWS,
                &mut out.slice_mut(..ROWS * rows),
                &mut scratch,
            )?;
            Ok(())
        })?;
        ms.insert(name.into(), json!(t));
        layer += t;
    }
    let norm = dev.upload(&vec![1.0f32; HIDDEN])?;
    let t = time(&mut || {
        dev.rmsnorm(
            &x.slice(..ROWS * HIDDEN),
            &norm,
            1e-5,
            ROWS,
            &mut out.slice_mut(..ROWS * HIDDEN),
        )?;
        Ok(())
    })?;
    ms.insert("rmsnorm".into(), json!(t));
    layer += 2.0 * t;
    let t = time(&mut || {
        dev.add(
            &mut out.slice_mut(..ROWS * HIDDEN),
            &x.slice(..ROWS * HIDDEN),
            ROWS * HIDDEN,
        )?;
        Ok(())
    })?;
    ms.insert("add".into(), json!(t));
    layer += 2.0 * t;
    let t = time(&mut || {
        dev.silu_mul(&out.slice(..), FFN, ROWS, &mut act.slice_mut(..))?;
        Ok(())
    })?;
    ms.insert("silu_mul".into(), json!(t));
    layer += t;

    // Attention over the chunk's own 2,048 positions.
    let kv_elems = g.block_elems() * g.num_blocks;
    let (kd, vd) = (dev.zeros::<u16>(kv_elems)?, dev.zeros::<u16>(kv_elems)?);
    let row_pos: Vec<i32> = (0..ROWS as i32).collect();
    let table: Vec<i32> = (0..g.num_blocks as i32).collect();
    let inputs = AttentionInputs::upload(
        dev,
        &g,
        &rng.vec(ROWS * q_row),
        [&row_pos, &vec![0; ROWS], &table],
        (&kd, &vd),
    )?;
    let tiles = attention_tiles([ROWS]);
    let td = dev.upload(&tiles)?;
    let scores = (ROWS * (ROWS + 1) / 2 * g.n_heads) as f64;
    let flop = 4.0 * scores * g.head_dim as f64;
    for (key, tiled) in [
        ("attention_per_row", None),
        ("attention_tiled", Some((&td.slice(..), tiles.len() - 1))),
    ] {
        let t = time(&mut || inputs.run(dev, tiled, ROWS, &mut out))?;
        ms.insert(key.into(), json!(t));
        ms.insert(format!("{key}_tflop_per_s"), json!(flop / (t / 1e3) / 1e12));
        if tiled.is_some() {
            layer += t;
        }
    }
    ms.insert("layer_sum".into(), json!(layer));
    ms.insert("step_estimate_32_layers".into(), json!(layer * LAYERS));
    Ok(Value::Object(ms))
}

/// Decode's matrices alone: Llama-3-8B's FFN matrices in Q4_1 (gate/up 14,336 x 4,096 and
/// down 4,096 x 14,336: short and long rows) and one in Q8_0, through the int8 and the
/// reference GEMV at 1 and 8 activation rows, as weight bytes read per second (the figure
/// that bounds decode, against the HBM's bandwidth); and cuBLAS at 2,048 rows (a prefill
/// chunk) in TFLOP/s, the prefill target's baseline.
///
/// A GEMV of ~10 us takes about as long as the host's launch of it, so the GEMVs are timed as
/// `REPEATS` launches captured in one CUDA graph (replayed once untimed first): GPU time with
/// the gaps between kernels a decode graph has too. The int8 GEMV's figure includes its
/// quantization of the activations (a second kernel).
fn matmul_speed(dev: &mut CudaDevice, rng: &mut Rng) -> Result<Value> {
    const REPEATS: usize = 20;
    const REPLAYS: usize = 5;
    let mut gemv = serde_json::Map::new();
    let shapes = [
        ("q4_1_14336x4096", WeightFormat::Q4_1, 14_336, 4_096),
        ("q4_1_4096x14336", WeightFormat::Q4_1, 4_096, 14_336),
        ("q8_0_14336x4096", WeightFormat::Q8_0, 14_336, 4_096),
    ];
    for (name, format, rows, cols) in shapes {
        let w = qmatrix(rng, format, rows, cols);
        let bytes = w.data().len() as f64;
        dev.set_gemv(GemvKernel::Dp4a);
        let wd = dev.upload_matrix(&w)?;
        let m_max = GEMV_MAX_M;
        let xd = dev.upload(&rng.vec(m_max * cols))?;
        let mut scratch = dev.zeros::<u16>(m_max * cols)?;
        let mut out = dev.zeros::<f32>(m_max * rows)?;
        let mut entry = serde_json::Map::new();
        for m in [1usize, 8] {
            let mut per_m = serde_json::Map::new();
            for (kernel, key) in [
                (GemvKernel::Dp4a, "dp4a"),
                (GemvKernel::Reference, "reference"),
            ] {
                dev.set_gemv(kernel);
                let graph = dev.capture(|d| {
                    for _ in 0..REPEATS {
                        d.matmul(
                            &wd,
                            &xd.slice(..m * cols),
                            m,
                            &mut out.slice_mut(..m * rows),
                            &mut scratch,
                        )?;
                    }
                    Ok(())
                })?;
                dev.replay(&graph)?;
                dev.synchronize()?;
                let t = std::time::Instant::now();
                for _ in 0..REPLAYS {
                    dev.replay(&graph)?;
                }
                dev.synchronize()?;
                let secs = t.elapsed().as_secs_f64() / (REPLAYS * REPEATS) as f64;
                per_m.insert(
                    key.into(),
                    json!({
                        "seconds": secs,
                        "weight_gb_per_s": bytes / secs / 1e9,
                        "fraction_of_hbm": bytes / secs / HBM_BYTES_PER_S,
                    }),
                );
            }
            entry.insert(format!("m{m}"), Value::Object(per_m));
        }
        entry.insert("weight_bytes".into(), json!(bytes));
        gemv.insert(name.into(), Value::Object(entry));
    }
    dev.set_gemv(GemvKernel::Dp4a);
    // cuBLAS on the first shape; one launch is long enough to time from the host.
    let (rows, cols, chunk) = (14_336, 4_096, 2_048);
    let w = qmatrix(rng, WeightFormat::Q4_1, rows, cols);
    let wd = dev.upload_matrix(&w)?;
    let mut bf = dev.zeros::<u16>(chunk * cols)?;
    let xd = dev.upload(&rng.vec(chunk * cols))?;
    let mut out = dev.zeros::<f32>(chunk * rows)?;
    let gemm = seconds_per_launch(dev, REPEATS, &mut || {
        Ok(dev.matmul(&wd, &xd.slice(..), chunk, &mut out.slice_mut(..), &mut bf)?)
    })?;
    Ok(json!({
        "timing": format!("GEMVs: {REPEATS} launches in one CUDA graph, {REPLAYS} replays"),
        "gemv": gemv,
        "cublas_14336x4096_m2048_seconds": gemm,
        "cublas_14336x4096_m2048_tflop_per_s": 2.0 * (rows * cols * chunk) as f64 / gemm / 1e12,
    }))
}
