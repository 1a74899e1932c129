//! The one error type of model loading: reading the files (the text path's
//! [`ModelFileError`]) and what only the weights can get wrong.

use std::path::PathBuf;

use kvmesh_prompt::ModelFileError;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The container, metadata, config or tokenizer files.
    #[error(transparent)]
    File(#[from] ModelFileError),

    #[error("{}: unsupported architecture `{arch}` (supported: llama, qwen2)", .path.display())]
    UnsupportedArchitecture { path: PathBuf, arch: String },

    #[error("{}: missing tensor `{name}`", .path.display())]
    MissingTensor { path: PathBuf, name: String },

    #[error("{}: tensor `{name}` is stored as {format}, which the kernels cannot use here", .path.display())]
    UnsupportedTensorFormat {
        path: PathBuf,
        name: String,
        format: String,
    },

    #[error("{}: tensor `{name}` has shape {shape:?} (ggml order), expected {expected}", .path.display())]
    WrongTensorShape {
        path: PathBuf,
        name: String,
        shape: Vec<usize>,
        expected: String,
    },

    #[error("tensor `{name}`: {source}")]
    Quant {
        name: String,
        source: kvmesh_kernels::quant::QuantError,
    },

    #[error("{}: {source}", .path.display())]
    Safetensors {
        path: PathBuf,
        source: safetensors::SafeTensorError,
    },
}
