//! `kvmesh bench engine`: prefill and decode throughput of the real model on the CPU.
//!
//! Prefill: one prompt of `--prefill-tokens` tokens in one step. Decode: `B` sequences with
//! `--decode-prompt`-token prompts, then `--decode-tokens` greedy steps of the whole batch
//! (aggregate tokens/s), the same shape as llama.cpp's `llama-batched-bench`. Step budget:
//! through the engine's scheduler, a long prompt arrives while `--interference-decodes`
//! sequences decode; per step budget, the decodes' longest gap between tokens and the long
//! prompt's TTFT, against the first budget given (measured in the same run). Structured
//! outputs (`--structured`, instead of the others): see `structured`.

mod structured;

use crate::model_args::ModelArgs;
use anyhow::Result;
use clap::Args;
use kvmesh_common::{BlockId, SamplingParams};
use kvmesh_engine::engine_config::EngineConfig;
use kvmesh_engine::llama_runner::LlamaRunner;
use kvmesh_engine::model::LlamaModel;
use kvmesh_engine::runner::{BlockTable, ChunkTokens, ModelRunner, SeqChunk, StepInput};
use kvmesh_engine::sampler::argmax;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BLOCK_SIZE: usize = 16;

#[derive(Args, Debug)]
pub struct BenchEngineArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    pub prefill_tokens: usize,
    /// Prompt length of each sequence in the decode measurement.
    #[arg(long, default_value_t = 128)]
    pub decode_prompt: usize,
    /// Tokens generated per sequence in the decode measurement.
    #[arg(long, default_value_t = 64)]
    pub decode_tokens: usize,
    /// Batch sizes for the decode measurement.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 8, 32])]
    pub batches: Vec<usize>,
    /// Step budgets (`max_num_batched_tokens`) for the step-budget measurement; the first is
    /// the baseline of the ratios.
    #[arg(long, value_delimiter = ',', default_values_t = vec![2048, 512, 256, 128])]
    pub budgets: Vec<usize>,
    /// The long prompt that arrives in the step-budget measurement (tokens).
    #[arg(long, default_value_t = 2000)]
    pub interference_prompt: usize,
    /// Sequences decoding when it arrives.
    #[arg(long, default_value_t = 4)]
    pub interference_decodes: usize,
    /// Timed repetitions of each measurement (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Measure structured outputs instead, at each batch size: the decode step with a JSON
    /// schema against free text (masks computed during and after the forward pass), and the
    /// steps and time of answers under a schema with long fixed keys with fast-forward on and
    /// off. The variants take one step each in turn.
    #[arg(long)]
    pub structured: bool,
}

pub fn run(args: &BenchEngineArgs) -> Result<()> {
    let mut model_args = args.model.clone();
    model_args.threads = Some(model_args.threads.unwrap_or(2));
    let threads = model_args.threads.unwrap_or(2);
    let path = model_args.prepare()?;
    let loaded = crate::model_args::load(&path)?;
    if args.structured {
        return run_structured(&loaded, threads, args);
    }
    let model = loaded.model.clone();

    let prefill = median_time(args.repeats, || time_prefill(&model, args.prefill_tokens))?;
    let prefill_tok_s = args.prefill_tokens as f64 / prefill.as_secs_f64();
    let mut decode = Vec::new();
    for &batch in &args.batches {
        let t = median_time(args.repeats, || {
            time_decode(&model, batch, args.decode_prompt, args.decode_tokens)
        })?;
        decode.push((batch, (batch * args.decode_tokens) as f64 / t.as_secs_f64()));
    }
    let mut budgets = Vec::new();
    for &budget in &args.budgets {
        let runs = (0..args.repeats.max(1))
            .map(|_| interference(&loaded, budget, args))
            .collect::<Result<Vec<_>>>()?;
        budgets.push((
            budget,
            median(runs.iter().map(|r| r.0)),
            median(runs.iter().map(|r| r.1)),
        ));
    }

    if args.json {
        let decode: Vec<_> = decode
            .iter()
            .map(|(b, s)| serde_json::json!({"batch": b, "tok_s": s}))
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "threads": threads,
                "prefill_tokens": args.prefill_tokens,
                "prefill_tok_s": prefill_tok_s,
                "decode_prompt": args.decode_prompt,
                "decode_tokens": args.decode_tokens,
                "decode": decode,
                "interference_prompt": args.interference_prompt,
                "interference_decodes": args.interference_decodes,
                "budgets": budgets.iter().map(|(b, gap, ttft)| serde_json::json!({
                    "budget": b,
                    "longest_decode_gap_s": gap.as_secs_f64(),
                    "long_prompt_ttft_s": ttft.as_secs_f64(),
                })).collect::<Vec<_>>(),
            })
        );
    } else {
        println!("threads {threads}");
        println!(
            "prefill {} tokens: {prefill_tok_s:.1} tok/s",
            args.prefill_tokens
        );
        for (b, s) in decode {
            println!("decode batch {b:>3}: {s:.1} tok/s (aggregate)");
        }
        println!(
            "a {}-token prompt arriving while {} sequences decode:",
            args.interference_prompt, args.interference_decodes
        );
        if let Some(&(_, gap0, ttft0)) = budgets.first() {
            for (b, gap, ttft) in &budgets {
                println!(
                    "step budget {b:>5}: decodes' longest gap {:.1} ms ({:.2}x), the prompt's TTFT {:.1} ms ({:.2}x)",
                    gap.as_secs_f64() * 1e3,
                    gap.as_secs_f64() / gap0.as_secs_f64(),
                    ttft.as_secs_f64() * 1e3,
                    ttft.as_secs_f64() / ttft0.as_secs_f64(),
                );
            }
        }
    }
    Ok(())
}

fn run_structured(
    loaded: &kvmesh_engine::Loaded,
    threads: usize,
    args: &BenchEngineArgs,
) -> Result<()> {
    let mut rows = Vec::new();
    for &batch in &args.batches {
        let cost = structured::mask_cost(
            loaded,
            batch,
            args.decode_prompt,
            args.decode_tokens,
            args.repeats,
        )?;
        let ff = structured::fast_forward(loaded, batch, args.decode_prompt, args.repeats)?;
        rows.push((cost, ff));
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    if args.json {
        let rows: Vec<_> = rows
            .iter()
            .map(|(c, f)| {
                serde_json::json!({
                    "batch": c.batch,
                    "step_free_s": c.free.as_secs_f64(),
                    "step_json_s": c.during.as_secs_f64(),
                    "step_json_masks_after_s": c.after.as_secs_f64(),
                    "fast_forward": {
                        "tokens": [f.tokens.0, f.tokens.1],
                        "steps": [f.steps.0, f.steps.1],
                        "time_s": [f.time.0.as_secs_f64(), f.time.1.as_secs_f64()],
                    },
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "threads": threads,
                "decode_prompt": args.decode_prompt,
                "decode_tokens": args.decode_tokens,
                "structured": rows,
            })
        );
        return Ok(());
    }
    println!("threads {threads}");
    for (c, f) in &rows {
        println!(
            "batch {:>3}: decode step {:.2} ms free, {:.2} ms with a JSON schema ({:.3}x; masks after the forward: {:.2} ms, {:.3}x)",
            c.batch,
            ms(c.free),
            ms(c.during),
            c.during.as_secs_f64() / c.free.as_secs_f64(),
            ms(c.after),
            c.after.as_secs_f64() / c.free.as_secs_f64(),
        );
        println!(
            "batch {:>3}: a schema with long fixed keys: {} tokens in {} steps, {:.0} ms with fast-forward; {} tokens in {} steps, {:.0} ms without ({:.2}x the time)",
            f.batch,
            f.tokens.0,
            f.steps.0,
            ms(f.time.0),
            f.tokens.1,
            f.steps.1,
            ms(f.time.1),
            f.time.0.as_secs_f64() / f.time.1.as_secs_f64(),
        );
    }
    Ok(())
}

fn median(times: impl Iterator<Item = Duration>) -> Duration {
    let mut times: Vec<Duration> = times.collect();
    times.sort();
    times[times.len() / 2]
}

/// Through the engine with a step budget of `budget`: `interference_decodes` sequences are
/// decoding when a prompt of `interference_prompt` tokens arrives. Returns the longest step
/// until its first token (every decode waits that long for its next token) and that TTFT.
fn interference(
    loaded: &kvmesh_engine::Loaded,
    budget: usize,
    args: &BenchEngineArgs,
) -> Result<(Duration, Duration)> {
    // Short prompts, and room to decode through any long prompt's chunks.
    let (decode_prompt, decode_max): (usize, u32) = (64, 1024);
    let per_seq = (decode_prompt + decode_max as usize).div_ceil(BLOCK_SIZE);
    let config = EngineConfig {
        max_num_batched_tokens: budget,
        num_blocks: args.interference_decodes * per_seq
            + args.interference_prompt.div_ceil(BLOCK_SIZE)
            + 1,
        enable_prefix_caching: false,
        ..EngineConfig::default()
    };
    let mut engine = config.llama_engine(loaded)?;
    let params = |max_tokens| SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    };
    let decodes = args.interference_decodes as u64;
    for i in 0..decodes {
        engine.add_request(
            i,
            random_tokens(decode_prompt, 200 + i),
            params(decode_max),
            0,
        )?;
    }
    // Until every sequence has its first token: all decoding.
    let mut started = std::collections::HashSet::new();
    while started.len() < args.interference_decodes {
        started.extend(engine.step()?.iter().map(|o| o.seq_id));
    }
    let long = decodes;
    engine.add_request(
        long,
        random_tokens(args.interference_prompt, 7),
        params(1),
        0,
    )?;
    let arrived = Instant::now();
    let mut longest_step = Duration::ZERO;
    loop {
        let step = Instant::now();
        let out = engine.step()?;
        longest_step = longest_step.max(step.elapsed());
        if out.iter().any(|o| o.seq_id == long) {
            return Ok((longest_step, arrived.elapsed()));
        }
    }
}

fn median_time(repeats: usize, mut f: impl FnMut() -> Result<Duration>) -> Result<Duration> {
    f()?; // warm-up: page in weights, size scratch buffers
    let times = (0..repeats.max(1))
        .map(|_| f())
        .collect::<Result<Vec<_>>>()?;
    Ok(median(times.into_iter()))
}

/// Ordinary-text token ids, away from the special tokens at the start of the vocabulary.
pub(crate) fn random_tokens(n: usize, seed: u64) -> Vec<u32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.gen_range(1000..40_000)).collect()
}

/// Blocks `range`, in order.
pub(crate) fn blocks(range: std::ops::Range<u32>) -> BlockTable {
    range.map(BlockId).collect()
}

fn time_prefill(model: &Arc<LlamaModel>, tokens: usize) -> Result<Duration> {
    let num_blocks = tokens.div_ceil(BLOCK_SIZE);
    let mut runner = LlamaRunner::new(model.clone(), num_blocks, BLOCK_SIZE);
    let step = StepInput {
        chunks: vec![SeqChunk {
            seq_id: 0,
            tokens: random_tokens(tokens, 1).into(),
            start_pos: 0,
            block_table: blocks(0..num_blocks as u32),
            want_logits: true,
        }],
    };
    let start = Instant::now();
    runner.execute(&step)?;
    Ok(start.elapsed())
}

fn time_decode(
    model: &Arc<LlamaModel>,
    batch: usize,
    prompt: usize,
    new_tokens: usize,
) -> Result<Duration> {
    let per_seq = (prompt + new_tokens).div_ceil(BLOCK_SIZE) as u32;
    let mut runner = LlamaRunner::new(model.clone(), batch * per_seq as usize, BLOCK_SIZE);
    let mut chunks: Vec<SeqChunk> = (0..batch)
        .map(|i| SeqChunk {
            seq_id: i as u64,
            tokens: random_tokens(prompt, 100 + i as u64).into(),
            start_pos: 0,
            block_table: blocks(i as u32 * per_seq..(i as u32 + 1) * per_seq),
            want_logits: true,
        })
        .collect();
    let mut out = runner.execute(&StepInput {
        chunks: chunks.clone(),
    })?;
    let start = Instant::now();
    for _ in 0..new_tokens {
        for (chunk, (_, logits)) in chunks.iter_mut().zip(&out.logits) {
            chunk.start_pos += chunk.tokens.len();
            chunk.tokens = ChunkTokens::one(argmax(logits));
        }
        out = runner.execute(&StepInput {
            chunks: chunks.clone(),
        })?;
    }
    Ok(start.elapsed())
}
