//! Timing models: how long one engine step takes, in place of the forward pass.
//!
//! A step is a batch of chunks (the scheduler's `StepInput`); the model reduces it to a
//! [`StepShape`] and prices it with a model linear in its coefficients, which are data:
//!
//! ```text
//! step = step_overhead                                   (any non-empty step)
//!      + prefill_per_token      * new prefill tokens     (compute-bound matmuls)
//!      + prefill_per_cached_token * cached context of prefill chunks (reading their KV)
//!      + decode_per_seq         * decode sequences       (their share of the matmuls)
//!      + decode_per_context_token * context of decode sequences (attention reads KV)
//!      + prefill_per_attention_pair * (query, key) pairs of prefill chunks
//! ```
//!
//! The last term is prefill attention's compute: a chunk of `n` new tokens after `c` cached
//! ones scores `n * c + n * (n + 1) / 2` pairs, quadratic in the chunk. It dominates nothing
//! on a GPU with fused attention (the built-in profiles leave it at 0), but on the CPU engine
//! a 1,024-token chunk spends a large share of its time there (see `docs/profile.md`).
//!
//! So prefill time is a function of (new tokens, cached tokens) and decode time of (batch
//! size, total context), as the simulator's callers need. A [`TimingProfile`] is plain JSON;
//! `kvmesh profile` measures one on a real node ([`TimingProfile::fit`]), and
//! [`TimingProfile::named`] gives built-in profiles for common GPU/model pairs.

mod fit;
mod published;

pub use fit::Fit;
pub use published::h200_llama8b_fp8_kv_tokens;

use kvmesh_engine::runner::StepInput;
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::Duration;

/// What a step's time depends on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepShape {
    /// Tokens computed by prefill chunks (chunks of more than one token).
    pub prefill_tokens: u64,
    /// Tokens whose KV prefill chunks read but do not compute (their `start_pos`).
    pub prefill_cached_tokens: u64,
    /// One-token chunks.
    pub decode_seqs: u64,
    /// Context (positions, including the new token) of the decode chunks.
    pub decode_context_tokens: u64,
    /// (query, key) pairs prefill chunks' attention scores: `n * start_pos + n * (n + 1) / 2`
    /// for a chunk of `n` tokens (each new token attends to every earlier one and itself).
    pub prefill_attention_pairs: u64,
}

impl StepShape {
    /// The shape of a scheduler step. A one-token chunk counts as a decode even when it ends
    /// a prefill (a prompt whose last token was left over), as the real runner treats it.
    pub fn of(step: &StepInput) -> StepShape {
        let mut s = StepShape::default();
        for c in &step.chunks {
            let n = c.tokens.len() as u64;
            if n == 1 {
                s.decode_seqs += 1;
                s.decode_context_tokens += c.start_pos as u64 + 1;
            } else {
                s.prefill_tokens += n;
                s.prefill_cached_tokens += c.start_pos as u64;
                s.prefill_attention_pairs += n * c.start_pos as u64 + n * (n + 1) / 2;
            }
        }
        s
    }

    pub fn is_empty(&self) -> bool {
        self.prefill_tokens == 0 && self.decode_seqs == 0
    }

    /// What each of [`TimingProfile::TERMS`] multiplies, in that order (1 for the overhead).
    pub fn terms(&self) -> [f64; NUM_TERMS] {
        [
            1.0,
            self.prefill_tokens as f64,
            self.prefill_cached_tokens as f64,
            self.decode_seqs as f64,
            self.decode_context_tokens as f64,
            self.prefill_attention_pairs as f64,
        ]
    }
}

/// How many coefficients a [`TimingProfile`] has.
pub const NUM_TERMS: usize = 6;

/// An affine step-time model; every coefficient in microseconds (fractions allowed).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimingProfile {
    /// What it models (`h200-llama8b`, or what `kvmesh profile` measured).
    pub name: String,
    /// Where the numbers come from.
    #[serde(default)]
    pub source: String,
    pub step_overhead_us: f64,
    pub prefill_per_token_us: f64,
    pub prefill_per_cached_token_us: f64,
    pub decode_per_seq_us: f64,
    pub decode_per_context_token_us: f64,
    /// Per (query, key) pair of prefill attention; absent (0) in profiles that predate it.
    #[serde(default)]
    pub prefill_per_attention_pair_us: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum TimingError {
    #[error("reading timing profile {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("parsing timing profile: {0}")]
    Parse(#[from] serde_json::Error),
    #[error("timing profile `{name}`: {field} must be finite and non-negative, got {value}")]
    Invalid {
        name: String,
        field: &'static str,
        value: f64,
    },
    #[error("unknown timing profile `{0}` (built in: {names})", names = TimingProfile::NAMES.join(", "))]
    Unknown(String),
    #[error("fitting a timing profile needs at least one measured step")]
    NoSamples,
    #[error("measured step {index} is empty (no tokens): there is nothing to price")]
    EmptyStep { index: usize },
    #[error("measured step {index} took no time: its relative error is undefined")]
    ZeroTime { index: usize },
    #[error("the fit gave a non-finite {field} ({value}): the samples are too far apart in scale")]
    NotFinite { field: &'static str, value: f64 },
}

// Peak figures from NVIDIA's H100 and H200 datasheets: H100 SXM 3.35 TB/s HBM3, H200 SXM
// 4.8 TB/s HBM3e, both 989 TFLOP/s dense BF16 tensor throughput. The BF16 profiles below are
// rooflines from those peaks with two stated assumptions, not measurements: 70% of peak
// memory bandwidth is achieved when streaming weights and KV, and 50% of peak FLOP/s (MFU) in
// prefill. The one measured GPU profile found (`h200-llama8b-fp8`, see `published`) checks
// them: its batch-1 decode step (4.4 ms) is near the H200 roofline's weight-streaming floor
// for twice the bytes (4.8 ms for BF16 weights), and its per-context-token cost (0.030 us) near
// the roofline's (0.039 us). Prefer a measured profile where one exists.
const H100_HBM_BYTES_PER_S: f64 = 3.35e12;
const H200_HBM_BYTES_PER_S: f64 = 4.8e12;
const BF16_DENSE_FLOPS: f64 = 989e12;
const ASSUMED_BANDWIDTH_EFFICIENCY: f64 = 0.7;
const ASSUMED_MFU: f64 = 0.5;

/// A dense decoder served in BF16, split tensor-parallel over `gpus` GPUs.
struct Roofline {
    params: f64,
    /// K and V bytes per token over all layers (`2 * layers * kv_heads * head_dim * 2`).
    kv_bytes_per_token: f64,
    gpus: f64,
    hbm_bytes_per_s: f64,
}

impl Roofline {
    fn profile(&self, name: &str, source: &str) -> TimingProfile {
        let bw = self.hbm_bytes_per_s * ASSUMED_BANDWIDTH_EFFICIENCY;
        let flops = BF16_DENSE_FLOPS * ASSUMED_MFU * self.gpus;
        // A token through the matmuls costs 2 FLOPs per parameter.
        let per_token_us = 2.0 * self.params / flops * 1e6;
        // Each GPU streams its share of the weights once per step, and of the KV per token.
        let weights_us = 2.0 * self.params / self.gpus / bw * 1e6;
        let kv_us = self.kv_bytes_per_token / self.gpus / bw * 1e6;
        TimingProfile {
            name: name.into(),
            source: source.into(),
            step_overhead_us: weights_us,
            prefill_per_token_us: per_token_us,
            prefill_per_cached_token_us: kv_us,
            decode_per_seq_us: per_token_us,
            decode_per_context_token_us: kv_us,
            prefill_per_attention_pair_us: 0.0,
        }
    }
}

impl TimingProfile {
    /// The built-in profiles' names.
    pub const NAMES: &'static [&'static str] = &[
        "h200-llama8b-fp8",
        "h200-llama8b",
        "h100-llama8b",
        "h100x4-llama70b",
    ];

    /// A built-in profile: `h200-llama8b-fp8` fitted to published measurements (see
    /// `published`), the others rooflines (see the note above).
    pub fn named(name: &str) -> Result<TimingProfile, TimingError> {
        // Llama 3.1 8B: 8.03e9 parameters; 32 layers, 8 KV heads of 128: 128 KiB of KV a token.
        let llama8b = |hbm| Roofline {
            params: 8.03e9,
            kv_bytes_per_token: (2 * 32 * 8 * 128 * 2) as f64,
            gpus: 1.0,
            hbm_bytes_per_s: hbm,
        };
        // Llama 3.1 70B: 70.6e9 parameters; 80 layers, 8 KV heads of 128: 320 KiB a token.
        // 141 GB of BF16 weights need at least two 80 GB H100s; four leave room for KV.
        // Tensor-parallel all-reduce time is not modelled.
        let llama70b_tp4 = Roofline {
            params: 70.6e9,
            kv_bytes_per_token: (2 * 80 * 8 * 128 * 2) as f64,
            gpus: 4.0,
            hbm_bytes_per_s: H100_HBM_BYTES_PER_S,
        };
        let source = "roofline from NVIDIA datasheet peaks (70% HBM bandwidth, 50% MFU assumed)";
        match name {
            "h200-llama8b-fp8" => Ok(published::h200_llama8b_fp8(name)),
            "h200-llama8b" => Ok(llama8b(H200_HBM_BYTES_PER_S).profile(name, source)),
            "h100-llama8b" => Ok(llama8b(H100_HBM_BYTES_PER_S).profile(name, source)),
            "h100x4-llama70b" => Ok(llama70b_tp4.profile(name, source)),
            _ => Err(TimingError::Unknown(name.into())),
        }
    }

    /// Every step costs `service`, whatever it holds: a deterministic server, for queueing
    /// checks (M/D/1) and tests.
    pub fn fixed(service: Duration) -> TimingProfile {
        TimingProfile {
            name: "fixed".into(),
            source: "constant service time".into(),
            step_overhead_us: service.as_nanos() as f64 / 1e3,
            prefill_per_token_us: 0.0,
            prefill_per_cached_token_us: 0.0,
            decode_per_seq_us: 0.0,
            decode_per_context_token_us: 0.0,
            prefill_per_attention_pair_us: 0.0,
        }
    }

    /// The coefficients' JSON names, in the order of [`StepShape::terms`].
    pub const TERMS: [&'static str; NUM_TERMS] = [
        "step_overhead_us",
        "prefill_per_token_us",
        "prefill_per_cached_token_us",
        "decode_per_seq_us",
        "decode_per_context_token_us",
        "prefill_per_attention_pair_us",
    ];

    /// The coefficients, in the order of [`TimingProfile::TERMS`].
    pub fn coefficients(&self) -> [f64; NUM_TERMS] {
        [
            self.step_overhead_us,
            self.prefill_per_token_us,
            self.prefill_per_cached_token_us,
            self.decode_per_seq_us,
            self.decode_per_context_token_us,
            self.prefill_per_attention_pair_us,
        ]
    }

    /// A profile with coefficients `c`, in the order of [`TimingProfile::TERMS`].
    pub fn with_coefficients(name: &str, source: &str, c: [f64; NUM_TERMS]) -> TimingProfile {
        TimingProfile {
            name: name.into(),
            source: source.into(),
            step_overhead_us: c[0],
            prefill_per_token_us: c[1],
            prefill_per_cached_token_us: c[2],
            decode_per_seq_us: c[3],
            decode_per_context_token_us: c[4],
            prefill_per_attention_pair_us: c[5],
        }
    }

    /// Parses and validates a profile in JSON.
    pub fn from_json(json: &str) -> Result<TimingProfile, TimingError> {
        let p: TimingProfile = serde_json::from_str(json)?;
        p.validate()?;
        Ok(p)
    }

    pub fn load(path: &Path) -> Result<TimingProfile, TimingError> {
        let text = std::fs::read_to_string(path).map_err(|source| TimingError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_json(&text)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a profile always serializes")
    }

    pub fn validate(&self) -> Result<(), TimingError> {
        let fields = Self::TERMS.into_iter().zip(self.coefficients());
        match fields.into_iter().find(|(_, v)| !v.is_finite() || *v < 0.0) {
            Some((field, value)) => Err(TimingError::Invalid {
                name: self.name.clone(),
                field,
                value,
            }),
            None => Ok(()),
        }
    }

    /// How long a step of `shape` takes; zero for an empty step.
    pub fn step_time(&self, shape: &StepShape) -> Duration {
        if shape.is_empty() {
            return Duration::ZERO;
        }
        let us = self.micros(shape);
        // Rounded to whole nanoseconds so the same shape always costs the same time.
        Duration::from_nanos(round_to_u64(us * 1e3))
    }

    /// The times of steps that decode `batch` sequences and nothing else, the first at
    /// `context` tokens of context and each later one `batch` tokens more (a run of quiet
    /// decode steps), in whole nanoseconds (which a run sums cheaper than durations): each
    /// exactly [`Self::step_time`] of its shape, summed in the same order, with the terms
    /// the steps share summed once.
    pub fn decode_step_nanos(&self, batch: u64, context: u64) -> impl Iterator<Item = u64> + '_ {
        const CONTEXT: usize = 4;
        let first = StepShape {
            decode_seqs: batch,
            decode_context_tokens: context,
            ..StepShape::default()
        };
        let (c, x) = (self.coefficients(), first.terms());
        // `micros` sums left to right: the terms before the context's, it, those after (an
        // array, so that the sum below unrolls).
        let before: f64 = (0..CONTEXT).map(|k| c[k] * x[k]).sum();
        let after: [f64; NUM_TERMS - CONTEXT - 1] =
            std::array::from_fn(|k| c[CONTEXT + 1 + k] * x[CONTEXT + 1 + k]);
        (0u64..).map(move |step| {
            if batch == 0 {
                return 0;
            }
            let context = (context + step * batch) as f64;
            let us = after
                .iter()
                .fold(before + c[CONTEXT] * context, |sum, t| sum + t);
            round_to_u64(us * 1e3)
        })
    }

    /// A step's time in microseconds, unrounded (the model itself, also for an empty step).
    pub fn micros(&self, shape: &StepShape) -> f64 {
        let terms = shape.terms();
        self.coefficients()
            .iter()
            .zip(terms)
            .map(|(c, x)| c * x)
            .sum()
    }
}

/// `x.round() as u64` (halves away from zero, negatives and NaN to 0, saturating) without
/// the library call `round` is on this target: a step is timed per simulated step, hundreds
/// of millions of times an hour.
fn round_to_u64(x: f64) -> u64 {
    // Below 2^52 (a step's nanoseconds always are) through i64, whose conversions are one
    // instruction each where u64's take several; the fraction is exact there.
    const SIGNED_EXACT: f64 = 4_503_599_627_370_496.0;
    if (0.0..SIGNED_EXACT).contains(&x) {
        let whole = x as i64;
        let fraction = x - whole as f64;
        return whole as u64 + u64::from(fraction >= 0.5);
    }
    // Truncated and saturated; the fraction is exact: below 2^53 it is `x`'s fractional
    // bits, above it `x` is whole (0, or past u64's range a positive number that saturates).
    let whole = x as u64;
    let fraction = x - whole as f64;
    if fraction >= 0.5 {
        whole.saturating_add(1)
    } else {
        whole
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_engine::runner::SeqChunk;

    #[test]
    fn decode_step_nanos_are_each_steps_own_time() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let mut profiles: Vec<TimingProfile> = ["h200-llama8b", "h200-llama8b-fp8"]
            .iter()
            .map(|n| TimingProfile::named(n).unwrap())
            .collect();
        for _ in 0..20 {
            let c = std::array::from_fn(|_| rng.gen_range(-50.0..500.0) / rng.gen_range(1.0..1e4));
            profiles.push(TimingProfile::with_coefficients("random", "test", c));
        }
        for profile in &profiles {
            for _ in 0..50 {
                let batch = rng.gen_range(0..300u64);
                let context = rng.gen_range(0..3_000_000u64);
                let times: Vec<Duration> = profile
                    .decode_step_nanos(batch, context)
                    .take(40)
                    .map(Duration::from_nanos)
                    .collect();
                for (step, time) in times.into_iter().enumerate() {
                    let shape = StepShape {
                        decode_seqs: batch,
                        decode_context_tokens: context + step as u64 * batch,
                        ..StepShape::default()
                    };
                    assert_eq!(time, profile.step_time(&shape), "{profile:?} {shape:?}");
                }
            }
        }
    }

    #[test]
    fn rounds_as_the_library_does() {
        let mut values = vec![
            0.0,
            -0.0,
            0.5,
            1.5,
            2.5,
            0.49999999999999994,
            -0.5,
            -1.7,
            1e300,
            -1e300,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            4503599627370495.5,
            4503599627370496.0,
            4503599627370496.5,
            4503599627370497.0,
            9007199254740993.0,
            18446744073709551615.0,
            18446744073709549568.0,
        ];
        let mut x = 0.123_f64;
        for _ in 0..100_000 {
            x = (x * 1.000_37 + 0.618) % 1e7;
            values.extend([x, x.floor() + 0.5, x.floor() - 0.5]);
        }
        for v in values {
            assert_eq!(round_to_u64(v), v.round() as u64, "{v}");
        }
    }

    /// A chunk of `n` tokens after `start_pos` cached ones.
    pub(super) fn chunk(start_pos: usize, n: usize) -> SeqChunk {
        SeqChunk {
            seq_id: 0,
            tokens: vec![1; n].into(),
            start_pos,
            block_table: Default::default(),
            want_logits: true,
        }
    }

    #[test]
    fn shape_splits_prefill_from_decode() {
        let step = StepInput {
            chunks: vec![chunk(32, 100), chunk(9, 1), chunk(19, 1)],
        };
        let s = StepShape::of(&step);
        assert_eq!(
            s,
            StepShape {
                prefill_tokens: 100,
                prefill_cached_tokens: 32,
                decode_seqs: 2,
                decode_context_tokens: 30,
                // 100 tokens after 32: 100 * 32 + 100 * 101 / 2.
                prefill_attention_pairs: 3200 + 5050,
            }
        );
    }

    #[test]
    fn affine_in_every_term() {
        let p = TimingProfile {
            name: "t".into(),
            source: String::new(),
            step_overhead_us: 1000.0,
            prefill_per_token_us: 10.0,
            prefill_per_cached_token_us: 1.0,
            decode_per_seq_us: 20.0,
            decode_per_context_token_us: 0.5,
            prefill_per_attention_pair_us: 0.25,
        };
        let s = StepShape {
            prefill_tokens: 100,
            prefill_cached_tokens: 32,
            decode_seqs: 2,
            decode_context_tokens: 30,
            prefill_attention_pairs: 400,
        };
        assert_eq!(
            p.step_time(&s),
            Duration::from_micros(1000 + 1000 + 32 + 40 + 15 + 100)
        );
        assert_eq!(p.step_time(&StepShape::default()), Duration::ZERO);
    }

    #[test]
    fn built_in_profiles_are_plausible_and_ordered() {
        let h200 = TimingProfile::named("h200-llama8b").unwrap();
        let h100 = TimingProfile::named("h100-llama8b").unwrap();
        // 16 GB of weights at 70% of 4.8 TB/s: about 4.8 ms a decode step.
        assert!(
            (4000.0..6000.0).contains(&h200.step_overhead_us),
            "{h200:?}"
        );
        assert!(h100.step_overhead_us > h200.step_overhead_us);
        assert_eq!(h100.prefill_per_token_us, h200.prefill_per_token_us);
        let l70 = TimingProfile::named("h100x4-llama70b").unwrap();
        assert!(l70.step_overhead_us > h100.step_overhead_us);
        for name in TimingProfile::NAMES {
            TimingProfile::named(name).unwrap().validate().unwrap();
        }
        assert!(matches!(
            TimingProfile::named("tpu-llama8b"),
            Err(TimingError::Unknown(_))
        ));
    }

    #[test]
    fn json_round_trips_and_rejects_bad_numbers() {
        let p = TimingProfile::named("h200-llama8b").unwrap();
        assert_eq!(TimingProfile::from_json(&p.to_json()).unwrap(), p);
        let bad = p.to_json().replace(
            &format!("\"decode_per_seq_us\": {}", p.decode_per_seq_us),
            "\"decode_per_seq_us\": -1.0",
        );
        assert!(matches!(
            TimingProfile::from_json(&bad),
            Err(TimingError::Invalid {
                field: "decode_per_seq_us",
                ..
            })
        ));
        assert!(matches!(
            TimingProfile::from_json("{\"name\": 3}"),
            Err(TimingError::Parse(_))
        ));
    }

    #[test]
    fn profiles_without_the_attention_term_still_load() {
        let old = r#"{
            "name": "old",
            "step_overhead_us": 5000.0,
            "prefill_per_token_us": 16.0,
            "prefill_per_cached_token_us": 0.04,
            "decode_per_seq_us": 16.0,
            "decode_per_context_token_us": 0.04
        }"#;
        let p = TimingProfile::from_json(old).unwrap();
        assert_eq!(p.prefill_per_attention_pair_us, 0.0);
        assert_eq!(p.step_overhead_us, 5000.0);
    }

    #[test]
    fn fixed_costs_the_same_for_any_step() {
        let p = TimingProfile::fixed(Duration::from_millis(7));
        let big = StepShape {
            prefill_tokens: 4096,
            decode_seqs: 64,
            ..StepShape::default()
        };
        let one = StepShape {
            decode_seqs: 1,
            ..StepShape::default()
        };
        assert_eq!(p.step_time(&big), Duration::from_millis(7));
        assert_eq!(p.step_time(&one), Duration::from_millis(7));
    }
}
