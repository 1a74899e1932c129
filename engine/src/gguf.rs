//! Model loading: [`LoadError`], [`Weights`] (tensors under GGUF names) and [`load_model`],
//! which opens a `.gguf` file or a safetensors checkpoint (see `safetensors_loader`). The
//! GGUF container reader and the text metadata (tokenizer, fingerprint) are
//! `kvmesh_prompt`'s; this module turns the file into weights and a `ModelConfig`.

mod config;
mod error;
mod weights;

use std::path::{Path, PathBuf};

use kvmesh_common::ModelFingerprint;
use kvmesh_prompt::gguf::GgufFile;
use kvmesh_prompt::tokenizer::Tokenizer;
use kvmesh_prompt::{ModelFiles, ModelText};

use crate::model_config::ModelConfig;

pub use error::LoadError;
pub use weights::{weight_format, WeightTensor, Weights};

/// Everything needed to serve a model.
#[derive(Debug)]
pub struct LoadedModel {
    pub path: PathBuf,
    pub config: ModelConfig,
    pub weights: Weights,
    pub tokenizer: Tokenizer,
    /// Identity of the weights and tokenizer: the root of every prefix-hash chain.
    pub fingerprint: ModelFingerprint,
}

/// Loads a `.gguf` file, a `.safetensors` file, or a directory holding a safetensors
/// checkpoint (config.json, tokenizer.json, model*.safetensors).
pub fn load_model(path: &Path) -> Result<LoadedModel, LoadError> {
    match ModelFiles::locate(path)? {
        ModelFiles::Gguf(file) => load_gguf(&file),
        ModelFiles::Hf { dir, shards } => {
            crate::safetensors_loader::load_safetensors(path, &dir, &shards)
        }
    }
}

/// Loads a GGUF model: weights stay memory-mapped, config and tokenizer come from the
/// metadata, and every tensor the forward pass needs is shape-checked.
pub fn load_gguf(path: &Path) -> Result<LoadedModel, LoadError> {
    let gguf = GgufFile::open(path)?;
    let weights = Weights::from_gguf(&gguf);
    let config = config::model_config(&gguf, &weights)?;
    weights.check_llama_shapes(&config)?;
    let text = ModelText::from_gguf(&gguf)?;
    Ok(LoadedModel {
        path: path.to_path_buf(),
        config,
        weights,
        tokenizer: text.tokenizer,
        fingerprint: text.fingerprint,
    })
}
