//! The engine part of a worker's configuration, and building an engine from it.

use crate::backend::BackendError;
use crate::device::Device;
use crate::llama_runner::{LlamaRunner, RunnerOptions};
use crate::llm_engine::LlmEngine;
use crate::scheduler::{SchedulerConfig, SchedulerError};
use crate::Loaded;
use kvmesh_common::{BlockHasher, ModelFingerprint};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// KV pool and batching limits of one engine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// Tokens per KV block (the prefix-hash granularity; all nodes of a mesh must agree).
    pub block_size: usize,
    /// KV blocks in the pool. SmolLM2-135M needs 360 KiB per 16-token block, so the default
    /// 1024 blocks (16k tokens) take 360 MiB.
    pub num_blocks: usize,
    /// Token budget of one step (prefill chunks and decodes together). Every decode waits for
    /// the step to end, so the default is sized for a CPU, where a prompt's chunks set the
    /// gaps of every stream decoding beside it: 128 tokens halves the longest gap of 256
    /// (`kvmesh bench engine`: 0.52x with a 1,000-token prompt arriving among 2 decodes)
    /// and CPU prefill is as fast in such chunks as in long ones (that prompt's TTFT 0.96x).
    /// Where a per-token latency objective is tight for the machine, set `max_step_time`
    /// rather than lowering this; a GPU wants 2048 or more.
    pub max_num_batched_tokens: usize,
    /// A target for one step's time (e.g. `"80ms"`): each step's prefill chunks get only the
    /// tokens that keep it within the target, as this engine's own recent steps predict
    /// (`max_num_batched_tokens` still caps them). A chunk's cost grows with the context it
    /// attends and with the machine's load, which a token budget cannot see. Set it below
    /// the per-token latency objective: each chunk is a gap in every stream decoding beside
    /// the prompt. A step's first chunk gets at least `block_size` tokens, so prompts
    /// progress when decodes alone fill the target. Unset: the token budget alone.
    #[serde(with = "humantime_serde")]
    pub max_step_time: Option<Duration>,
    /// Most sequences holding KV at once.
    pub max_num_seqs: usize,
    /// Longest sequence (prompt plus output); `None` = the model's context length.
    pub max_model_len: Option<usize>,
    pub enable_prefix_caching: bool,
    /// Evicted prefix-cache blocks kept in a host-memory tier and copied back on a hit (0:
    /// none). On CPU the pool is host memory too, so a bigger `num_blocks` serves the same
    /// purpose without the copies; the tier pays where the pool is scarcer (a GPU).
    pub host_tier_blocks: usize,
    /// Blocks pushed out of the host tier kept on disk, in `disk_tier_dir`, and copied back
    /// on a hit (0: none). A restarted node finds and announces them again.
    pub disk_tier_blocks: usize,
    /// The disk tier's directory (one file per block); required when `disk_tier_blocks` > 0.
    pub disk_tier_dir: Option<std::path::PathBuf>,
    /// Structured outputs: the tokens a format forces (a JSON schema's keys and punctuation)
    /// follow the drawn token without a step and a draw each. Off only to compare; the nodes
    /// of a mesh must agree for a moved request to continue exactly.
    pub grammar_fast_forward: bool,
    /// Where the forward pass runs: `cpu`, or `cuda[:N]` (a build with the `cuda` feature
    /// and a CUDA device; otherwise the engine does not start, and says why).
    pub device: Device,
    /// On CUDA: replay decode steps as CUDA graphs, captured once per batch-size bucket
    /// (fewer launches per step). Off until a device run has measured it.
    pub cuda_graphs: bool,
    /// On CUDA: greedy and temperature / top-k / top-p draws without penalties, biases,
    /// min-p, log-probabilities or a format are made on the device (a token comes back, not
    /// a row of logits); the rest stay on the host. Off until a device run has checked it.
    pub device_sampling: bool,
    /// On CUDA: decode's matmuls read the GGUF blocks as stored with f32 activations (the
    /// first kernels: slow) instead of quantizing the activations to int8 as the CPU does
    /// and using `dp4a` over a split copy of the weights. To compare the two.
    pub cuda_reference_gemv: bool,
}

/// Why an engine could not be built.
#[derive(Debug, thiserror::Error)]
pub enum EngineBuildError {
    #[error("invalid engine config: {0}")]
    Scheduler(#[from] SchedulerError),
    #[error(transparent)]
    Backend(#[from] BackendError),
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            num_blocks: 1024,
            max_num_batched_tokens: 128,
            max_step_time: None,
            max_num_seqs: 64,
            max_model_len: None,
            enable_prefix_caching: true,
            host_tier_blocks: 0,
            disk_tier_blocks: 0,
            disk_tier_dir: None,
            grammar_fast_forward: true,
            device: Device::Cpu,
            cuda_graphs: false,
            device_sampling: false,
            cuda_reference_gemv: false,
        }
    }
}

impl EngineConfig {
    /// The scheduler's config for a model with this fingerprint and context length.
    pub fn scheduler_config(
        &self,
        fingerprint: ModelFingerprint,
        max_context: usize,
    ) -> SchedulerConfig {
        SchedulerConfig {
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            max_model_len: self.max_model_len.unwrap_or(max_context).min(max_context),
            enable_prefix_caching: self.enable_prefix_caching,
            host_tier_blocks: self.host_tier_blocks,
            disk_tier_blocks: self.disk_tier_blocks,
            hasher: BlockHasher::new(fingerprint, self.block_size.max(1)),
        }
    }

    /// An engine over the real model with its own KV pool.
    pub fn llama_engine(
        &self,
        loaded: &Loaded,
    ) -> Result<LlmEngine<LlamaRunner>, EngineBuildError> {
        let config = self.scheduler_config(loaded.fingerprint, loaded.model.config.max_context);
        config.validate()?;
        let options = RunnerOptions {
            cuda_graphs: self.cuda_graphs,
            device_sampling: self.device_sampling,
            reference_gemv: self.cuda_reference_gemv,
        };
        let runner = LlamaRunner::with_options(
            self.device,
            options,
            loaded.model.clone(),
            self.num_blocks,
            self.block_size,
        )?;
        let mut engine = LlmEngine::new(config, runner, loaded.tokenizer.clone());
        engine.set_fast_forward(self.grammar_fast_forward);
        engine.set_max_step_time(self.max_step_time);
        match (&self.disk_tier_dir, self.disk_tier_blocks) {
            (_, 0) => Ok(engine),
            (None, _) => {
                Err(SchedulerError::InvalidConfig("disk_tier_blocks needs disk_tier_dir").into())
            }
            (Some(dir), _) => engine.with_disk_tier(dir.clone()).map_err(|e| {
                SchedulerError::DiskTier(format!("cannot use {}: {e}", dir.display())).into()
            }),
        }
    }
}
