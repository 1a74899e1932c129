//! The engine drawing on the device (`engine.device_sampling`) against drawing on the host,
//! on the same device and model: greedy output must be the same; seeded temperature / top-k
//! / top-p draws must be reproducible and within the vocabulary (the device and the host
//! pick differently from the same number, so those are not compared token for token).

use anyhow::Result;
use kvmesh_common::{SamplingParams, TokenId};
use kvmesh_engine::device::Device;
use kvmesh_engine::engine_config::EngineConfig;
use kvmesh_engine::Loaded;
use serde_json::{json, Value};

const PROMPTS: usize = 8;
const MAX_TOKENS: u32 = 24;

/// Every request's tokens from one engine on `device`.
fn generate(
    loaded: &Loaded,
    device: Device,
    reference_gemv: bool,
    device_sampling: bool,
    params: &SamplingParams,
) -> Result<Vec<Vec<TokenId>>> {
    let config = EngineConfig {
        num_blocks: 256,
        max_model_len: Some(2048),
        device,
        device_sampling,
        cuda_reference_gemv: reference_gemv,
        ..EngineConfig::default()
    };
    let mut e = config.llama_engine(loaded)?;
    let vocab = loaded.model.config.vocab_size as u32;
    for i in 0..PROMPTS {
        let prompt: Vec<TokenId> = (0..32 + 8 * i as u32)
            .map(|t| (t * 7919 + i as u32 * 104_729) % vocab)
            .collect();
        e.add_request(i as u64, prompt, params.clone(), 0)?;
    }
    let mut out = vec![Vec::new(); PROMPTS];
    while e.has_work() {
        for o in e.step()? {
            out[o.seq_id as usize].extend(o.sampled.map(|s| s.token));
        }
    }
    Ok(out)
}

pub fn check(
    loaded: &Loaded,
    device: Device,
    reference_gemv: bool,
    failures: &mut Vec<String>,
) -> Result<Value> {
    let greedy = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(MAX_TOKENS)
    };
    let host = generate(loaded, device, reference_gemv, false, &greedy)?;
    let on_device = generate(loaded, device, reference_gemv, true, &greedy)?;
    let greedy_equal = host == on_device;
    let drawn = SamplingParams {
        temperature: 0.8,
        top_k: 50,
        top_p: 0.9,
        seed: Some(7),
        ..greedy
    };
    let first = generate(loaded, device, reference_gemv, true, &drawn)?;
    let second = generate(loaded, device, reference_gemv, true, &drawn)?;
    let vocab = loaded.model.config.vocab_size as TokenId;
    let reproducible = first == second;
    let in_vocab = first.iter().flatten().all(|&t| t < vocab);
    let full = first.iter().all(|t| t.len() == MAX_TOKENS as usize);
    let pass = greedy_equal && reproducible && in_vocab && full;
    if !pass {
        failures.push(format!(
            "sampling on {device}: greedy equal {greedy_equal}, seeded draws reproducible \
             {reproducible}, in vocabulary {in_vocab}, every request complete {full}"
        ));
    }
    Ok(json!({
        "requests": PROMPTS,
        "tokens_each": MAX_TOKENS,
        "greedy_device_equals_host": greedy_equal,
        "seeded_draws_reproducible": reproducible,
        "drawn_tokens_in_vocabulary": in_vocab,
        "drawn_example": first.first(),
        "pass": pass,
    }))
}
