//! The inference engine: model loading (GGUF, safetensors weights; the tokenizer and
//! fingerprint come from `kvmesh_prompt`), the Llama-family forward pass on a kernels
//! backend, the paged KV BlockPool, the sans-IO Scheduler, the Sampler, and the ModelRunner
//! trait with the real runner and the MockRunner.

pub mod backend;
pub mod block_pool;
#[cfg(feature = "cuda")]
mod cuda_backend;
pub mod cuda_plan;
pub mod device;
pub mod engine_config;
pub mod gguf;
pub mod kv_blocks;
pub mod llama_runner;
pub mod llm_engine;
pub mod mock_runner;
pub mod model;
pub mod model_config;
pub mod random_model;
pub mod runner;
pub mod safetensors_loader;
pub mod sampler;
pub mod scheduler;
pub mod tier_store;

use std::path::Path;
use std::sync::Arc;

/// A model ready to serve: weights, tokenizer and the identity that roots its prefix hashes.
pub struct Loaded {
    pub model: Arc<model::LlamaModel>,
    pub tokenizer: Arc<kvmesh_prompt::tokenizer::Tokenizer>,
    pub fingerprint: kvmesh_common::ModelFingerprint,
}

/// Loads a `.gguf` file or a safetensors checkpoint and builds the forward pass's weights.
pub fn load(path: &Path) -> Result<Loaded, gguf::LoadError> {
    let loaded = gguf::load_model(path)?;
    Ok(Loaded {
        model: Arc::new(model::LlamaModel::load(loaded.config, &loaded.weights)?),
        tokenizer: Arc::new(loaded.tokenizer),
        fingerprint: loaded.fingerprint,
    })
}
