//! `kvmesh bench engine`: prefill and decode throughput of the real model on the CPU.
//!
//! Prefill: one prompt of `--prefill-tokens` tokens in one step. Decode: `B` sequences with
//! `--decode-prompt`-token prompts, then `--decode-tokens` greedy steps of the whole batch
//! (aggregate tokens/s), the same shape as llama.cpp's `llama-batched-bench`.

use crate::model_args::ModelArgs;
use anyhow::Result;
use clap::Args;
use kvmesh_common::BlockId;
use kvmesh_engine::llama_runner::LlamaRunner;
use kvmesh_engine::model::LlamaModel;
use kvmesh_engine::runner::{ModelRunner, SeqChunk, StepInput};
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
    /// Timed repetitions of each measurement (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &BenchEngineArgs) -> Result<()> {
    let mut model_args = args.model.clone();
    model_args.threads = Some(model_args.threads.unwrap_or(2));
    let threads = model_args.threads.unwrap_or(2);
    let path = model_args.prepare()?;
    let model = crate::model_args::load(&path)?.model;

    let prefill = median_time(args.repeats, || time_prefill(&model, args.prefill_tokens))?;
    let prefill_tok_s = args.prefill_tokens as f64 / prefill.as_secs_f64();
    let mut decode = Vec::new();
    for &batch in &args.batches {
        let t = median_time(args.repeats, || {
            time_decode(&model, batch, args.decode_prompt, args.decode_tokens)
        })?;
        decode.push((batch, (batch * args.decode_tokens) as f64 / t.as_secs_f64()));
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
    }
    Ok(())
}

fn median_time(repeats: usize, mut f: impl FnMut() -> Result<Duration>) -> Result<Duration> {
    f()?; // warm-up: page in weights, size scratch buffers
    let mut times = (0..repeats.max(1))
        .map(|_| f())
        .collect::<Result<Vec<_>>>()?;
    times.sort();
    Ok(times[times.len() / 2])
}

/// Ordinary-text token ids, away from the special tokens at the start of the vocabulary.
fn random_tokens(n: usize, seed: u64) -> Vec<u32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.gen_range(1000..40_000)).collect()
}

fn blocks(range: std::ops::Range<u32>) -> Vec<BlockId> {
    range.map(BlockId).collect()
}

fn time_prefill(model: &Arc<LlamaModel>, tokens: usize) -> Result<Duration> {
    let num_blocks = tokens.div_ceil(BLOCK_SIZE);
    let mut runner = LlamaRunner::new(model.clone(), num_blocks, BLOCK_SIZE);
    let step = StepInput {
        chunks: vec![SeqChunk {
            seq_id: 0,
            tokens: random_tokens(tokens, 1),
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
            tokens: random_tokens(prompt, 100 + i as u64),
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
            chunk.tokens = vec![argmax(logits)];
        }
        out = runner.execute(&StepInput {
            chunks: chunks.clone(),
        })?;
    }
    Ok(start.elapsed())
}
