//! `kvmesh gpu-check`: the one prepared run for a machine with a CUDA GPU (see
//! `scripts/gpu_check.sh` and docs/gpu.md). It needs no weights, toolchain or network: models
//! are generated with random weights in the shapes of SmolLM2-135M and Llama-3-8B. It checks
//! every op against the CPU backend on the same inputs, whole-model agreement of the CUDA
//! forward pass with the CPU one, and measures decode and prefill throughput and KV pack /
//! unpack bandwidth, writing one JSON. It exits non-zero when a check fails.

#[cfg(feature = "cuda")]
mod ops;

use anyhow::{bail, Context, Result};
use clap::Args;
use kvmesh_common::BlockId;
use kvmesh_engine::device::Device;
use kvmesh_engine::llama_runner::LlamaRunner;
use kvmesh_engine::model_config::ModelConfig;
use kvmesh_engine::random_model::{llama3_8b, random_model, smollm2_135m};
use kvmesh_engine::runner::{KvSource, ModelRunner, SeqChunk, StepInput};
use kvmesh_kernels::WeightFormat;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct GpuCheckArgs {
    /// The CUDA device to check.
    #[arg(long, default_value = "cuda:0")]
    pub device: Device,
    /// Where to write the results.
    #[arg(long, default_value = "gpu_check.json")]
    pub out: PathBuf,
    /// Shapes to run: smollm2, llama3-8b (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "smollm2,llama3-8b")]
    pub shapes: Vec<String>,
    /// Skip the throughput figures (agreement only).
    #[arg(long)]
    pub no_perf: bool,
    /// Only compile every kernel for this virtual architecture (e.g. `compute_90`) into the
    /// kernel cache (`KVMESH_KERNEL_CACHE`) with NVRTC, and exit: no GPU needed. A machine
    /// given the filled cache needs no NVRTC.
    #[arg(long, value_name = "ARCH")]
    pub fill_cache: Option<String>,
}

/// KV block size, as the mesh's default.
const BLOCK: usize = 16;
/// HBM bandwidth of an H200, for the decode roofline.
const HBM_BYTES_PER_S: f64 = 4.8e12;

pub fn run(args: &GpuCheckArgs) -> Result<()> {
    if let Some(arch) = &args.fill_cache {
        return fill_cache(arch);
    }
    let Device::Cuda(ordinal) = args.device else {
        bail!("gpu-check needs a CUDA device (--device cuda:N)");
    };
    let mut report = serde_json::Map::new();
    let mut failures = Vec::<String>::new();
    report.insert("device".into(), json!(args.device.to_string()));
    report.insert("ops".into(), ops_report(ordinal, &mut failures)?);
    let mut shapes = serde_json::Map::new();
    for name in &args.shapes {
        let config = match name.as_str() {
            "smollm2" => smollm2_135m(),
            "llama3-8b" => llama3_8b(),
            other => bail!("unknown shape {other:?} (smollm2, llama3-8b)"),
        };
        eprintln!("gpu-check: {name}: building the random-weight model");
        let model = Arc::new(random_model(config, WeightFormat::Q4_1, 42));
        let mut entry = serde_json::Map::new();
        entry.insert(
            "agreement".into(),
            agreement(&model, args.device, name, &mut failures)?,
        );
        if !args.no_perf {
            entry.insert("throughput".into(), throughput(&model, args.device)?);
        }
        shapes.insert(name.clone(), Value::Object(entry));
        write(&args.out, &report, &shapes, &failures)?;
    }
    write(&args.out, &report, &shapes, &failures)?;
    if !failures.is_empty() {
        bail!(
            "{} check(s) failed: {}",
            failures.len(),
            failures.join("; ")
        );
    }
    Ok(())
}

fn write(
    out: &PathBuf,
    report: &serde_json::Map<String, Value>,
    shapes: &serde_json::Map<String, Value>,
    failures: &[String],
) -> Result<()> {
    let mut r = report.clone();
    r.insert("models".into(), Value::Object(shapes.clone()));
    r.insert("failures".into(), json!(failures));
    std::fs::write(out, serde_json::to_string_pretty(&r)? + "\n")
        .with_context(|| format!("writing {}", out.display()))
}

#[cfg(feature = "cuda")]
fn fill_cache(arch: &str) -> Result<()> {
    for path in kvmesh_kernels::cuda::fill_cache(arch)? {
        println!("{}", path.display());
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn fill_cache(_arch: &str) -> Result<()> {
    bail!("this kvmesh was built without CUDA support (rebuild with `--features cuda`)")
}

#[cfg(feature = "cuda")]
fn ops_report(ordinal: usize, failures: &mut Vec<String>) -> Result<Value> {
    ops::check(ordinal, failures)
}

#[cfg(not(feature = "cuda"))]
fn ops_report(_ordinal: usize, _failures: &mut Vec<String>) -> Result<Value> {
    bail!("this kvmesh was built without CUDA support (rebuild with `--features cuda`)")
}

/// A chunk of `tokens` at `start_pos` for sequence `seq`, over blocks `first..`.
fn chunk(seq: u64, tokens: Vec<u32>, start_pos: usize, first: u32, blocks: usize) -> SeqChunk {
    SeqChunk {
        seq_id: seq,
        tokens: tokens.into(),
        start_pos,
        block_table: (first..first + blocks as u32).map(BlockId).collect(),
        want_logits: true,
    }
}

fn argmax(l: &[f32]) -> usize {
    kvmesh_engine::sampler::argmax(l) as usize
}

/// Prefill of a random prompt, then greedy decode steps fed the CPU's tokens, on both
/// backends; per position: top-1 equal, and the logits' largest error.
fn agreement(
    model: &Arc<kvmesh_engine::model::LlamaModel>,
    device: Device,
    name: &str,
    failures: &mut Vec<String>,
) -> Result<Value> {
    const PROMPT: usize = 64;
    const STEPS: usize = 63;
    let blocks = (PROMPT + STEPS).div_ceil(BLOCK);
    let mut cpu = LlamaRunner::on_device(Device::Cpu, model.clone(), blocks, BLOCK)?;
    let mut gpu = LlamaRunner::on_device(device, model.clone(), blocks, BLOCK)?;
    let vocab = model.config.vocab_size as u64;
    let mut seed = 0x5eed_u64;
    let prompt: Vec<u32> = (0..PROMPT)
        .map(|_| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) % vocab) as u32
        })
        .collect();
    let (mut agree, mut worst_abs, mut worst_rel) = (0usize, 0f32, 0f32);
    let mut step = chunk(1, prompt, 0, 0, blocks);
    for i in 0..=STEPS {
        let input = StepInput {
            chunks: vec![step.clone()],
        };
        let c = cpu.execute(&input)?.logits.remove(0).1;
        let g = gpu.execute(&input)?.logits.remove(0).1;
        let scale = c.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
        let err = c
            .iter()
            .zip(&g)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        worst_abs = worst_abs.max(err);
        worst_rel = worst_rel.max(err / scale);
        let next = argmax(&c);
        agree += usize::from(next == argmax(&g));
        step = chunk(
            1,
            vec![next as u32],
            step.start_pos + step.tokens.len(),
            0,
            blocks,
        );
        if i == STEPS {
            break;
        }
    }
    let positions = STEPS + 1;
    let top1 = agree as f64 / positions as f64;
    // Bounds: top-1 on 95% of positions (the issue's), logits within 5% of their largest
    // magnitude (bf16 GEMMs and f32 GEMVs against the CPU's int8-activation matmuls).
    let pass = top1 >= 0.95 && worst_rel <= 0.05;
    if !pass {
        failures.push(format!(
            "{name}: top-1 {top1:.3}, logit error {worst_abs} ({worst_rel:.4} of max)"
        ));
    }
    Ok(json!({
        "positions": positions,
        "top1_agreement": top1,
        "max_abs_logit_error": worst_abs,
        "max_rel_logit_error": worst_rel,
        "bounds": {"top1_agreement_min": 0.95, "max_rel_logit_error": 0.05},
        "pass": pass,
    }))
}

/// Bytes of every weight matrix as stored (what a batch-1 decode step streams).
fn weight_bytes(c: &ModelConfig) -> f64 {
    let row = |cols: usize| WeightFormat::Q4_1.row_bytes(cols).unwrap_or(0) as f64;
    let (hs, hd) = (c.hidden_size, c.head_dim);
    let qkv = ((c.num_heads + 2 * c.num_kv_heads) * hd) as f64;
    let per_layer = qkv * row(hs)
        + hs as f64 * row(c.num_heads * hd)
        + 2.0 * c.intermediate_size as f64 * row(hs)
        + hs as f64 * row(c.intermediate_size);
    let head = if c.tied_embeddings {
        c.vocab_size as f64 * WeightFormat::Q8_0.row_bytes(hs).unwrap_or(0) as f64
    } else {
        c.vocab_size as f64 * row(hs)
    };
    per_layer * c.num_layers as f64 + head
}

fn time_step(r: &mut LlamaRunner, input: &StepInput) -> Result<f64> {
    let t = Instant::now();
    r.execute(input)?; // returns after the logits are back on the host: the step is done
    Ok(t.elapsed().as_secs_f64())
}

/// Decode tok/s at batch 1, 32 and 128 (context 512), prefill tok/s at 512, 2048 and 8192
/// tokens, KV pack/unpack GB/s.
fn throughput(model: &Arc<kvmesh_engine::model::LlamaModel>, device: Device) -> Result<Value> {
    const CTX: usize = 512;
    const STEPS: usize = 16;
    let per_seq = (CTX + STEPS).div_ceil(BLOCK);
    let blocks = (128 * per_seq).max(8192 / BLOCK);
    let mut r = LlamaRunner::on_device(device, model.clone(), blocks, BLOCK)?;
    let c = &model.config;
    let mut decode = serde_json::Map::new();
    for batch in [1usize, 32, 128] {
        // Fill each sequence's context (KV values do not matter for timing).
        for s in 0..batch {
            let input = StepInput {
                chunks: vec![chunk(
                    s as u64,
                    vec![1; CTX],
                    0,
                    (s * per_seq) as u32,
                    per_seq,
                )],
            };
            r.execute(&input)?;
        }
        let mut secs = 0.0;
        for step in 0..STEPS {
            let input = StepInput {
                chunks: (0..batch)
                    .map(|s| chunk(s as u64, vec![2], CTX + step, (s * per_seq) as u32, per_seq))
                    .collect(),
            };
            let t = time_step(&mut r, &input)?;
            if step > 0 {
                secs += t; // the first step warms up
            }
        }
        let tok_s = (batch * (STEPS - 1)) as f64 / secs;
        decode.insert(format!("batch_{batch}_tok_s"), json!(tok_s));
    }
    let wb = weight_bytes(c);
    let roofline = HBM_BYTES_PER_S / wb;
    let b1 = decode
        .get("batch_1_tok_s")
        .and_then(Value::as_f64)
        .unwrap_or(0.0);
    decode.insert("weight_bytes".into(), json!(wb));
    decode.insert("batch_1_roofline_tok_s".into(), json!(roofline));
    decode.insert("batch_1_fraction_of_roofline".into(), json!(b1 / roofline));
    let mut prefill = serde_json::Map::new();
    for len in [512usize, 2048, 8192] {
        let n = len.div_ceil(BLOCK);
        let input = StepInput {
            chunks: vec![chunk(0, vec![3; len], 0, 0, n)],
        };
        time_step(&mut r, &input)?; // warm-up (cuBLAS heuristics, buffer growth)
        let secs = time_step(&mut r, &input)?;
        prefill.insert(format!("tokens_{len}_tok_s"), json!(len as f64 / secs));
    }
    // KV: 256 blocks of every layer packed to the transfer layout and back.
    let ids: Vec<BlockId> = (0..256).map(BlockId).collect();
    let mut payload = Vec::new();
    let t = Instant::now();
    for layer in 0..c.num_layers {
        r.read_kv_blocks(layer, &ids, &mut payload)?;
    }
    let pack = payload.len() as f64 / t.elapsed().as_secs_f64() / 1e9;
    let t = Instant::now();
    r.write_kv_blocks(0..c.num_layers, &ids, &payload)?;
    let unpack = payload.len() as f64 / t.elapsed().as_secs_f64() / 1e9;
    Ok(json!({
        "decode": decode,
        "prefill": prefill,
        "kv": {"bytes": payload.len(), "pack_gb_s": pack, "unpack_gb_s": unpack},
    }))
}
