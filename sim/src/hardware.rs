//! What one simulated node is: a model ([`ModelShape`]) on some hardware, priced by a
//! [`TimingProfile`], with the engine limits a real node of that kind would run with
//! ([`EngineConfig`], the same struct real nodes read from their config).
//!
//! [`Hardware::named`] gives the built-in GPU nodes (`h200-llama8b-fp8`, measured;
//! `h200-llama8b`, ..., rooflines);
//! [`Hardware::profiled`] this repository's CPU engine on SmolLM2-135M, timed by a profile
//! that `kvmesh profile` measured.

use crate::node::NodeConfig;
use crate::timing::{h200_llama8b_fp8_kv_tokens, TimingError, TimingProfile};
use kvmesh_common::ModelFingerprint;
use kvmesh_engine::engine_config::EngineConfig;

/// What the simulator needs to know of a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelShape {
    pub name: &'static str,
    /// Sampled tokens are drawn from `0..vocab_size`.
    pub vocab_size: usize,
    /// Longest sequence the model takes.
    pub max_context: usize,
    /// K and V bytes of one token over all layers, as the mesh moves them.
    pub kv_bytes_per_token: u64,
}

/// K and V of one token over all layers, 16-bit values: `2 * layers * kv_heads * head_dim * 2`.
const fn kv_bytes(layers: u64, kv_heads: u64, head_dim: u64) -> u64 {
    2 * layers * kv_heads * head_dim * 2
}

/// SmolLM2-135M-Instruct, the model this repository serves: 30 layers, 3 KV heads of 64.
pub const SMOLLM2_135M: ModelShape = ModelShape {
    name: "SmolLM2-135M-Instruct",
    vocab_size: 49152,
    max_context: 8192,
    kv_bytes_per_token: kv_bytes(30, 3, 64),
};

/// Llama 3.1 8B: 32 layers, 8 KV heads of 128 (128 KiB a token), 128k context.
pub const LLAMA_8B: ModelShape = ModelShape {
    name: "Llama-3.1-8B",
    vocab_size: 128_256,
    max_context: 131_072,
    kv_bytes_per_token: kv_bytes(32, 8, 128),
};

/// Llama 3.1 70B: 80 layers, 8 KV heads of 128 (320 KiB a token), 128k context.
pub const LLAMA_70B: ModelShape = ModelShape {
    name: "Llama-3.1-70B",
    vocab_size: 128_256,
    max_context: 131_072,
    kv_bytes_per_token: kv_bytes(80, 8, 128),
};

/// A node kind: model, timing and engine limits.
#[derive(Clone, Debug, PartialEq)]
pub struct Hardware {
    pub model: ModelShape,
    pub timing: TimingProfile,
    pub engine: EngineConfig,
}

/// Share of GPU memory the engine takes for weights and KV (vLLM's default
/// `gpu_memory_utilization`).
const GPU_MEMORY_SHARE: f64 = 0.9;
const BLOCK_SIZE: usize = 16;

/// The KV blocks a GPU node of `gpu_bytes` (all its GPUs) holds for `model`: what is left of
/// [`GPU_MEMORY_SHARE`] after the BF16 weights of `params` parameters.
fn kv_blocks(model: &ModelShape, params: f64, gpu_bytes: f64) -> usize {
    let kv_bytes = gpu_bytes * GPU_MEMORY_SHARE - 2.0 * params;
    (kv_bytes / (model.kv_bytes_per_token * BLOCK_SIZE as u64) as f64) as usize
}

/// A GPU node's engine with `num_blocks` of KV: a step budget of 8192 tokens and 256
/// sequences (a GPU's prefill is compute-bound well below that budget, so chunking costs it
/// little, and decode batches that large are still memory-bound).
fn gpu_engine(num_blocks: usize) -> EngineConfig {
    EngineConfig {
        block_size: BLOCK_SIZE,
        num_blocks,
        max_num_batched_tokens: 8192,
        max_num_seqs: 256,
        ..EngineConfig::default()
    }
}

impl Hardware {
    /// The built-in node kinds: [`TimingProfile::NAMES`].
    pub fn named(name: &str) -> Result<Hardware, TimingError> {
        let timing = TimingProfile::named(name)?;
        if name == "h200-llama8b-fp8" {
            // The KV pool the measured node had.
            let tokens = h200_llama8b_fp8_kv_tokens() as usize;
            return Ok(Hardware {
                model: LLAMA_8B,
                timing,
                engine: gpu_engine(tokens / BLOCK_SIZE),
            });
        }
        // HBM per GPU: H100 SXM 80 GB, H200 141 GB (NVIDIA datasheets).
        let (model, params, gpu_bytes) = match name {
            "h200-llama8b" => (LLAMA_8B, 8.03e9, 141e9),
            "h100-llama8b" => (LLAMA_8B, 8.03e9, 80e9),
            "h100x4-llama70b" => (LLAMA_70B, 70.6e9, 4.0 * 80e9),
            _ => return Err(TimingError::Unknown(name.into())),
        };
        Ok(Hardware {
            engine: gpu_engine(kv_blocks(&model, params, gpu_bytes)),
            model,
            timing,
        })
    }

    /// This repository's CPU engine serving SmolLM2-135M with `kvmesh serve`'s default engine
    /// limits, timed by `timing` (a profile `kvmesh profile` measured).
    pub fn profiled(timing: TimingProfile) -> Hardware {
        Hardware {
            model: SMOLLM2_135M,
            timing,
            engine: EngineConfig::default(),
        }
    }

    /// A simulated node of this kind running with `engine`'s limits.
    pub fn node(&self, engine: &EngineConfig) -> NodeConfig {
        let fingerprint = ModelFingerprint::from_bytes(self.model.name.as_bytes());
        NodeConfig {
            scheduler: engine.scheduler_config(fingerprint, self.model.max_context),
            timing: self.timing.clone(),
            vocab_size: self.model.vocab_size,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_sizes_match_the_models() {
        // 360 KiB per 16-token block for SmolLM2-135M, as the engine's config says.
        assert_eq!(SMOLLM2_135M.kv_bytes_per_token * 16, 360 * 1024);
        assert_eq!(LLAMA_8B.kv_bytes_per_token, 128 * 1024);
        assert_eq!(LLAMA_70B.kv_bytes_per_token, 320 * 1024);
    }

    #[test]
    fn gpu_pools_hold_what_memory_leaves_after_weights() {
        let h200 = Hardware::named("h200-llama8b").unwrap();
        let h100 = Hardware::named("h100-llama8b").unwrap();
        // 141 GB * 0.9 - 16.06 GB of weights = 110.8 GB of KV: about 845k tokens.
        let tokens = h200.engine.num_blocks * 16;
        assert!((840_000..850_000).contains(&tokens), "{tokens}");
        assert!(h100.engine.num_blocks < h200.engine.num_blocks);
        let l70 = Hardware::named("h100x4-llama70b").unwrap();
        assert!(l70.engine.num_blocks > 0);
        // The measured H200 held 945,029 tokens of KV.
        let fp8 = Hardware::named("h200-llama8b-fp8").unwrap();
        assert_eq!(fp8.engine.num_blocks, 945_029 / 16);
        assert_eq!(fp8.engine.max_num_seqs, h200.engine.max_num_seqs);
        for name in TimingProfile::NAMES {
            let hw = Hardware::named(name).unwrap();
            hw.node(&hw.engine).scheduler.validate().unwrap();
        }
        assert!(matches!(
            Hardware::named("tpu-llama8b"),
            Err(TimingError::Unknown(_))
        ));
    }

    #[test]
    fn a_profiled_node_is_the_cpu_engine_with_serves_defaults() {
        let hw = Hardware::profiled(TimingProfile::fixed(std::time::Duration::from_millis(1)));
        let node = hw.node(&hw.engine);
        assert_eq!(
            node.scheduler.num_blocks,
            EngineConfig::default().num_blocks
        );
        assert_eq!(node.scheduler.max_model_len, 8192);
        assert_eq!(node.vocab_size, 49152);
    }
}
