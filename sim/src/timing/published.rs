//! Built-in profiles fitted to published measurements of real GPUs, carried in the
//! repository with their source (`data/profiles/`, see `data/README.md`).

use super::{StepShape, TimingProfile};
use serde::Deserialize;
use std::time::Duration;

/// NVIDIA Dynamo's planner profile of vLLM serving Llama-3.1-8B-Instruct-FP8 on one H200.
const DYNAMO_H200_LLAMA8B_FP8: &str =
    include_str!("../../../data/profiles/dynamo_h200_llama31_8b_fp8.json");

/// The measurements as the file holds them.
#[derive(Deserialize)]
struct Published {
    source: String,
    max_kv_tokens: u64,
    prefill: Prefill,
    decode: Decode,
}

/// Time to first token of one prompt at a time, by its length.
#[derive(Deserialize)]
struct Prefill {
    isl_tokens: Vec<u64>,
    ttft_ms: Vec<f64>,
}

/// Steady decoding at a context length: the time between tokens, and the tokens per second
/// of the whole GPU (so the batch is their product).
#[derive(Deserialize)]
struct Decode {
    context_tokens: Vec<u64>,
    itl_ms: Vec<f64>,
    throughput_tokens_per_s: Vec<f64>,
}

impl Published {
    fn parse(json: &str) -> Published {
        serde_json::from_str(json).expect("the bundled profile data parses")
    }

    /// Each measurement as the step it times: a prompt's one prefill step (its TTFT, which
    /// also holds the request's handling outside the step), a decode step of the batch the
    /// throughput and latency imply at that context.
    fn samples(&self) -> Vec<(StepShape, Duration)> {
        let ms = |t: f64| Duration::from_secs_f64(t / 1e3);
        let prefill = self
            .prefill
            .isl_tokens
            .iter()
            .zip(&self.prefill.ttft_ms)
            .map(|(&n, &t)| {
                let shape = StepShape {
                    prefill_tokens: n,
                    prefill_attention_pairs: n * (n + 1) / 2,
                    ..StepShape::default()
                };
                (shape, ms(t))
            });
        let d = &self.decode;
        let decode = d
            .context_tokens
            .iter()
            .zip(&d.itl_ms)
            .zip(&d.throughput_tokens_per_s)
            .map(|((&context, &itl), &throughput)| {
                let batch = (throughput * itl / 1e3).round().max(1.0) as u64;
                let shape = StepShape {
                    decode_seqs: batch,
                    decode_context_tokens: batch * context,
                    ..StepShape::default()
                };
                (shape, ms(itl))
            });
        prefill.chain(decode).collect()
    }
}

/// `h200-llama8b-fp8`: fitted to Dynamo's measurements (see the module docs).
pub(super) fn h200_llama8b_fp8(name: &str) -> TimingProfile {
    // Relative error: median 3.5%; every decode step and prefill of 2,000 tokens or more
    // within 16% (see the test).
    let data = Published::parse(DYNAMO_H200_LLAMA8B_FP8);
    let samples = data.samples();
    let source = format!(
        "fitted by kvmesh to published measurements: {} ({} steps; prefill TTFT includes the request's handling outside the step)",
        data.source,
        samples.len()
    );
    TimingProfile::fit(name, &source, &samples)
        .expect("the bundled measurements fit")
        .profile
}

/// The KV tokens the measured H200 held (Dynamo's `max_kv_tokens`).
pub fn h200_llama8b_fp8_kv_tokens() -> u64 {
    Published::parse(DYNAMO_H200_LLAMA8B_FP8).max_kv_tokens
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fit_reproduces_the_measurements() {
        let data = Published::parse(DYNAMO_H200_LLAMA8B_FP8);
        let samples = data.samples();
        assert_eq!(samples.len(), 17 + 41);
        let fit = TimingProfile::fit("t", "", &samples).unwrap();
        assert!(fit.median_rel_error < 0.05, "{fit:?}");
        // Every decode step and every prefill of 2,000 tokens or more within 16%; shorter
        // prompts' TTFTs hold more of the request's handling outside the step (about 13 ms:
        // the measured TTFT at 100 tokens is 19.5 ms) than the step model prices.
        for (shape, measured) in &samples {
            let predicted = fit.profile.step_time(shape).as_secs_f64();
            let error = predicted / measured.as_secs_f64() - 1.0;
            if shape.prefill_tokens == 0 || shape.prefill_tokens >= 2000 {
                assert!(error.abs() < 0.16, "{shape:?}: {measured:?}, {error:+.3}");
            } else {
                assert!(error < 0.0, "{shape:?}: {measured:?}, {error:+.3}");
            }
        }
        // A decode step at batch 1 costs what Dynamo measured: 4.4 to 4.8 ms.
        let one = StepShape {
            decode_seqs: 1,
            decode_context_tokens: 3000,
            ..StepShape::default()
        };
        let t = fit.profile.step_time(&one).as_secs_f64() * 1e3;
        assert!((4.0..5.2).contains(&t), "{t} ms");
        assert_eq!(h200_llama8b_fp8_kv_tokens(), 945_029);
    }
}
