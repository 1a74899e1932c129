//! `kvmesh profile`: times this machine's engine on a grid of step shapes and fits the
//! [`TimingProfile`] that `kvmesh sim` prices steps with.
//!
//! Every step is a real forward pass of the real runner on the real model: prefill chunks of
//! N new tokens after C cached ones, decode batches of B sequences at context L, and mixed
//! steps (a prefill chunk beside decodes, as the scheduler batches them). The cached KV is
//! real too: one prompt of the longest context is prefilled once, and its blocks are written
//! into every sequence's blocks, as a KV transfer writes them. Each shape runs once to warm
//! up, then `--repeats` times; the median is kept. [`TimingProfile::fit`] fits the
//! coefficients (non-negative least squares on relative error).

use crate::bench_engine::{blocks, random_tokens};
use crate::model_args::ModelArgs;
use anyhow::{bail, Context, Result};
use clap::Args;
use kvmesh_engine::llama_runner::LlamaRunner;
use kvmesh_engine::model::LlamaModel;
use kvmesh_engine::runner::{KvSource, ModelRunner, SeqChunk, StepInput};
use kvmesh_sim::timing::{Fit, StepShape, TimingProfile};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BLOCK_SIZE: usize = 16;

#[derive(Args, Debug)]
pub struct ProfileArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Timed runs of each step shape, after one warm-up; the median is kept.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub repeats: u32,
    /// A small grid that runs in seconds (tests, a first look) instead of about a minute.
    #[arg(long)]
    pub quick: bool,
    /// The profile's name [default: cpu-<model>-<threads>t].
    #[arg(long)]
    pub name: Option<String>,
    /// Where to write the profile JSON [default: target/profile/<name>.json].
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// The step shapes to time.
struct Grid {
    /// Prefill chunks: new tokens, each after every one of `cached`.
    prefill_tokens: &'static [usize],
    cached: &'static [usize],
    /// Decode steps: batch sizes, each at every one of `contexts` (tokens per sequence,
    /// including the one decoded).
    batches: &'static [usize],
    contexts: &'static [usize],
    /// (prefill tokens, cached, decode batch, decode context) in one step.
    mixed: &'static [(usize, usize, usize, usize)],
}

const FULL: Grid = Grid {
    prefill_tokens: &[16, 64, 256, 512, 1024],
    cached: &[0, 512, 1024],
    batches: &[1, 2, 4, 8, 16, 32],
    contexts: &[128, 512, 1024],
    // What a 512-token step budget schedules: a chunk beside 8 or 32 decodes.
    mixed: &[(256, 0, 8, 512), (480, 512, 32, 1024)],
};

const QUICK: Grid = Grid {
    prefill_tokens: &[16, 64, 128],
    cached: &[0, 128],
    batches: &[1, 4],
    contexts: &[64, 256],
    mixed: &[(64, 128, 4, 256)],
};

/// One step to time: a chunk of `new` tokens after `cached` per sequence.
struct Case {
    label: String,
    chunks: Vec<(usize, usize)>,
}

impl Grid {
    fn cases(&self) -> Vec<Case> {
        let decodes = |b: usize, l: usize| std::iter::repeat_n((l - 1, 1), b);
        let mut cases = Vec::new();
        for &c in self.cached {
            for &n in self.prefill_tokens {
                cases.push(Case {
                    label: format!("prefill {n} after {c}"),
                    chunks: vec![(c, n)],
                });
            }
        }
        for &l in self.contexts {
            for &b in self.batches {
                cases.push(Case {
                    label: format!("decode {b} at {l}"),
                    chunks: decodes(b, l).collect(),
                });
            }
        }
        for &(n, c, b, l) in self.mixed {
            cases.push(Case {
                label: format!("prefill {n} after {c} + decode {b} at {l}"),
                chunks: std::iter::once((c, n)).chain(decodes(b, l)).collect(),
            });
        }
        cases
    }
}

pub fn run(args: &ProfileArgs) -> Result<()> {
    if args.model.threads == Some(0) {
        bail!("--threads must be at least 1");
    }
    if let Some(name) = &args.name {
        check_name(name)?;
    }
    let path = args.model.prepare()?;
    let threads = rayon::current_num_threads();
    let loaded = crate::model_args::load(&path)?;
    let model_file = path
        .file_name()
        .unwrap_or(path.as_os_str())
        .to_string_lossy()
        .into_owned();
    let name = args
        .name
        .clone()
        .unwrap_or_else(|| default_name(&path, threads));
    let out = args.out.clone().unwrap_or_else(|| {
        Path::new("target/profile")
            .join(&name)
            .with_extension("json")
    });

    let grid = if args.quick { &QUICK } else { &FULL };
    let cases = grid.cases();
    let longest = cases
        .iter()
        .flat_map(|c| c.chunks.iter().map(|&(cached, _)| cached))
        .max()
        .unwrap_or(0);
    eprintln!(
        "timing {} step shapes on {threads} threads, median of {} runs each",
        cases.len(),
        args.repeats
    );
    let bench = Bench::new(loaded.model.clone(), longest)?;
    let mut samples = Vec::with_capacity(cases.len());
    let mut spreads = Vec::with_capacity(cases.len());
    for case in &cases {
        let (shape, times) = bench.time(case, args.repeats)?;
        let time = times[times.len() / 2];
        tracing::debug!(case = %case.label, ?times, "timed");
        samples.push((shape, time));
        spreads.push((times[times.len() - 1] - times[0]).as_secs_f64() / time.as_secs_f64());
    }

    let fit = TimingProfile::fit(&name, "", &samples)?;
    let affine: Vec<_> = samples
        .iter()
        .map(|&(shape, t)| {
            let shape = StepShape {
                prefill_attention_pairs: 0,
                ..shape
            };
            (shape, t)
        })
        .collect();
    let affine = TimingProfile::fit(&name, "", &affine)?;

    let date = time::OffsetDateTime::now_utc().date();
    let source = format!(
        "kvmesh {} `profile{}` of {model_file} on {threads} threads{}, {:04}-{:02}-{:02}: {} step shapes, median of {} runs; {}",
        env!("CARGO_PKG_VERSION"),
        if args.quick { " --quick" } else { "" },
        cpu_model().map(|m| format!(" ({m})")).unwrap_or_default(),
        date.year(),
        u8::from(date.month()),
        date.day(),
        cases.len(),
        args.repeats,
        quality(&fit),
    );
    let profile = TimingProfile {
        source,
        ..fit.profile.clone()
    };

    print_table(&cases, &samples, &spreads, &profile);
    println!();
    println!("fit: {}", quality(&fit));
    println!("without the attention term: {}", quality(&affine));
    if !fit.unidentified.is_empty() {
        println!("no step varies (set to 0): {}", fit.unidentified.join(", "));
    }
    if !fit.at_zero.is_empty() {
        println!("held at 0 (would fit negative): {}", fit.at_zero.join(", "));
    }
    println!();
    println!("{}", profile.to_json());

    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(&out, profile.to_json() + "\n")
        .with_context(|| format!("writing {}", out.display()))?;
    println!("wrote {}", out.display());
    Ok(())
}

fn quality(fit: &Fit) -> String {
    format!(
        "R² {:.4}, relative error median {:.1}%, max {:.1}%",
        fit.r_squared,
        fit.median_rel_error * 100.0,
        fit.max_rel_error * 100.0
    )
}

/// One row per step: measured (median) and fitted time, the fit's error, and the runs'
/// spread (slowest minus fastest over the median), which shows a machine too busy to measure.
fn print_table(
    cases: &[Case],
    samples: &[(StepShape, Duration)],
    spreads: &[f64],
    profile: &TimingProfile,
) {
    let width = cases.iter().map(|c| c.label.len()).max().unwrap_or(0);
    println!(
        "{:<width$}  {:>11}  {:>9}  {:>7}  {:>6}",
        "step", "measured ms", "fitted ms", "error", "spread"
    );
    for ((case, (shape, time)), spread) in cases.iter().zip(samples).zip(spreads) {
        let measured = time.as_secs_f64() * 1e3;
        let fitted = profile.micros(shape) / 1e3;
        println!(
            "{:<width$}  {measured:>11.2}  {fitted:>9.2}  {:>+6.1}%  {:>5.1}%",
            case.label,
            (fitted - measured) / measured * 100.0,
            spread * 100.0
        );
    }
}

/// `cpu-<model file stem>-<threads>t`, lower case, anything but letters, digits, `_` and `-`
/// made `-` (`SmolLM2-135M-Instruct.Q4_1.gguf`: `cpu-smollm2-135m-instruct-q4_1-2t`).
fn default_name(model: &Path, threads: usize) -> String {
    let stem = model.file_stem().unwrap_or_default().to_string_lossy();
    let stem: String = stem
        .to_lowercase()
        .chars()
        .map(|c| match c {
            'a'..='z' | '0'..='9' | '_' | '-' => c,
            _ => '-',
        })
        .collect();
    format!("cpu-{stem}-{threads}t")
}

/// A name is also the default file name: nothing that would leave `target/profile/`.
fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name.contains(['/', '\\']) || name == "." || name == ".." {
        bail!("--name must be a non-empty file name without `/` or `\\`, got {name:?}");
    }
    Ok(())
}

/// The CPU's marketing name, where `/proc/cpuinfo` gives one.
fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("model name"))?;
    Some(line.split_once(':')?.1.trim().to_string())
}

/// Times steps on the model, with the KV of one real prompt to stand in as any cached
/// context up to its length.
struct Bench {
    model: Arc<LlamaModel>,
    /// The prompt's KV, per layer, in the transfer layout (block after block).
    prefix: Vec<Vec<u8>>,
}

impl Bench {
    /// Prefills a prompt of `longest` tokens and keeps its KV.
    fn new(model: Arc<LlamaModel>, longest: usize) -> Result<Bench> {
        let num_blocks = longest.div_ceil(BLOCK_SIZE).max(1);
        let mut runner = LlamaRunner::new(model.clone(), num_blocks, BLOCK_SIZE);
        let table = blocks(0..num_blocks as u32);
        if longest > 0 {
            runner.execute(&StepInput {
                chunks: vec![SeqChunk {
                    seq_id: 0,
                    tokens: random_tokens(longest, 0).into(),
                    start_pos: 0,
                    block_table: table.clone(),
                    want_logits: false,
                }],
            })?;
        }
        let prefix = (0..runner.kv_shape().num_layers)
            .map(|layer| {
                let mut kv = Vec::new();
                runner.read_kv_blocks(layer, &table, &mut kv)?;
                Ok(kv)
            })
            .collect::<Result<_>>()?;
        Ok(Bench { model, prefix })
    }

    /// `case`'s shape and the times of `repeats` runs of it (after a warm-up), sorted.
    fn time(&self, case: &Case, repeats: u32) -> Result<(StepShape, Vec<Duration>)> {
        let per_seq: Vec<usize> = case
            .chunks
            .iter()
            .map(|&(cached, new)| (cached + new).div_ceil(BLOCK_SIZE))
            .collect();
        let total = per_seq.iter().sum();
        let mut runner = LlamaRunner::new(self.model.clone(), total, BLOCK_SIZE);
        let block_bytes = runner.kv_shape().block_bytes_per_layer();
        let mut step = StepInput::default();
        let mut next = 0;
        for (i, (&(cached, new), &n)) in case.chunks.iter().zip(&per_seq).enumerate() {
            let table = blocks(next..next + n as u32);
            next += n as u32;
            let full = cached.div_ceil(BLOCK_SIZE);
            for (layer, kv) in self.prefix.iter().enumerate() {
                runner.write_kv_blocks(
                    layer..layer + 1,
                    &table[..full],
                    &kv[..full * block_bytes],
                )?;
            }
            step.chunks.push(SeqChunk {
                seq_id: i as u64,
                tokens: random_tokens(new, 1 + i as u64).into(),
                start_pos: cached,
                block_table: table,
                want_logits: true,
            });
        }
        // Each run writes the same positions' KV again: every run is the same step.
        runner.execute(&step)?;
        let mut times = (0..repeats)
            .map(|_| {
                let start = Instant::now();
                runner.execute(&step)?;
                Ok(start.elapsed())
            })
            .collect::<Result<Vec<_>>>()?;
        times.sort();
        Ok((StepShape::of(&step), times))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_name_is_a_file_name() {
        let model = Path::new("/cache/SmolLM2-135M-Instruct.Q4_1.gguf");
        assert_eq!(default_name(model, 2), "cpu-smollm2-135m-instruct-q4_1-2t");
        check_name(&default_name(model, 2)).unwrap();
        assert!(check_name("../x").is_err());
        assert!(check_name("").is_err());
    }

    #[test]
    fn grids_time_every_kind_of_step() {
        for grid in [&FULL, &QUICK] {
            let cases = grid.cases();
            let count = |f: fn(&Case) -> bool| cases.iter().filter(|c| f(c)).count();
            assert!(count(|c| c.chunks.len() == 1 && c.chunks[0].1 > 1) > 0);
            assert!(count(|c| c.chunks.iter().all(|&(_, n)| n == 1)) > 0);
            assert!(count(|c| c.chunks.iter().any(|&(_, n)| n > 1) && c.chunks.len() > 1) > 0);
        }
        assert_eq!(FULL.cases().len(), 15 + 18 + 2);
    }
}
