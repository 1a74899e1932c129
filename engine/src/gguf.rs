//! Model loading. This module holds the GGUF reader and the pieces every format shares:
//! [`LoadError`], [`Weights`] (tensors under GGUF names) and [`load_model`], which opens a
//! `.gguf` file or a safetensors checkpoint (see `safetensors_loader`).

mod config;
mod error;
mod reader;
mod types;
mod weights;

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use kvmesh_common::ModelFingerprint;
use xxhash_rust::xxh3::Xxh3;

use crate::model_config::ModelConfig;
use crate::tokenizer::Tokenizer;

pub use error::LoadError;
pub use reader::{GgufFile, GgufTensorInfo};
pub use types::{GgmlType, GgufValue};
pub use weights::{WeightTensor, Weights};

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
    if path.is_dir() {
        return crate::safetensors_loader::load_safetensors(path);
    }
    let io = |source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut magic = Vec::with_capacity(4);
    File::open(path)
        .map_err(io)?
        .take(4)
        .read_to_end(&mut magic)
        .map_err(io)?;
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    if magic == b"GGUF" || ext.eq_ignore_ascii_case("gguf") {
        load_gguf(path)
    } else if ext.eq_ignore_ascii_case("safetensors") {
        crate::safetensors_loader::load_safetensors(path)
    } else {
        Err(LoadError::UnknownFormat {
            path: path.to_path_buf(),
        })
    }
}

/// Loads a GGUF model: weights stay memory-mapped, config and tokenizer come from the
/// metadata, and every tensor the forward pass needs is shape-checked.
pub fn load_gguf(path: &Path) -> Result<LoadedModel, LoadError> {
    let gguf = GgufFile::open(path)?;
    let weights = Weights::from_gguf(&gguf);
    let config = config::model_config(&gguf, &weights)?;
    weights.check_llama_shapes(&config)?;
    let tokenizer = Tokenizer::from_gguf(&gguf)?;
    // The whole file: two fine-tunes can share a header and tensor table.
    let fingerprint = fingerprint(&[gguf.bytes()]);
    Ok(LoadedModel {
        path: path.to_path_buf(),
        config,
        weights,
        tokenizer,
        fingerprint,
    })
}

/// A stable fingerprint of the bytes that define a model (weights and tokenizer).
pub(crate) fn fingerprint(parts: &[&[u8]]) -> ModelFingerprint {
    let mut h = Xxh3::new();
    for part in parts {
        // Length-prefixed so that moving bytes between parts changes the hash.
        h.update(&(part.len() as u64).to_le_bytes());
        h.update(part);
    }
    ModelFingerprint::from_bytes(&h.digest128().to_le_bytes())
}
