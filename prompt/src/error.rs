//! The error of reading a model's files without its weights: the GGUF container (header,
//! metadata, tensor directory), an HF checkpoint's JSON files, and the tokenizer built from
//! them. Every variant names the file and the field or tensor at fault.

use std::io;
use std::path::PathBuf;

use crate::tokenizer::TokenizerError;

#[derive(Debug, thiserror::Error)]
pub enum ModelFileError {
    #[error("{}: {source}", .path.display())]
    Io { path: PathBuf, source: io::Error },

    #[error("{}: not a GGUF file (magic bytes {magic:02x?}, expected \"GGUF\")", .path.display())]
    BadMagic { path: PathBuf, magic: Vec<u8> },

    #[error("{}: unsupported GGUF version {version} (supported: 2 and 3, little-endian)", .path.display())]
    UnsupportedVersion { path: PathBuf, version: u32 },

    #[error("{}: file ends inside {what} (needs {needed} bytes at offset {offset}; file is {file_size} bytes)", .path.display())]
    Truncated {
        path: PathBuf,
        what: String,
        offset: u64,
        needed: u64,
        file_size: u64,
    },

    #[error("{}: {what}: count {count} cannot fit in the {remaining} bytes left in the file", .path.display())]
    CountTooLarge {
        path: PathBuf,
        what: String,
        count: u64,
        remaining: u64,
    },

    #[error("{}: {what} is not valid UTF-8", .path.display())]
    InvalidUtf8 { path: PathBuf, what: String },

    #[error("{}: metadata `{key}` has unknown value type {type_id}", .path.display())]
    UnknownValueType {
        path: PathBuf,
        key: String,
        type_id: u32,
    },

    #[error("{}: metadata `{key}` nests arrays deeper than {max} levels", .path.display())]
    NestingTooDeep {
        path: PathBuf,
        key: String,
        max: usize,
    },

    #[error("{}: metadata key `{key}` appears twice", .path.display())]
    DuplicateKey { path: PathBuf, key: String },

    #[error("{}: tensor `{name}` appears twice", .path.display())]
    DuplicateTensor { path: PathBuf, name: String },

    #[error("{}: general.alignment = {alignment} is not a power of two", .path.display())]
    BadAlignment { path: PathBuf, alignment: u64 },

    #[error("{}: tensor `{tensor}` has unknown ggml type {type_id}", .path.display())]
    UnknownTensorType {
        path: PathBuf,
        tensor: String,
        type_id: u32,
    },

    #[error("{}: tensor `{tensor}`: {reason}", .path.display())]
    BadTensorInfo {
        path: PathBuf,
        tensor: String,
        reason: String,
    },

    #[error("{}: tensor `{tensor}` (bytes {start}..{end}) lies outside the file ({file_size} bytes)", .path.display())]
    TensorOutOfBounds {
        path: PathBuf,
        tensor: String,
        start: u64,
        end: u64,
        file_size: u64,
    },

    #[error("{}: missing metadata `{key}`", .path.display())]
    MissingMetadata { path: PathBuf, key: String },

    #[error("{}: metadata `{key}` should be {expected}", .path.display())]
    WrongMetadataType {
        path: PathBuf,
        key: String,
        expected: &'static str,
    },

    #[error("{}: `{key}`: {reason}", .path.display())]
    BadConfigValue {
        path: PathBuf,
        key: String,
        reason: String,
    },

    #[error("{}: tokenizer: {source}", .path.display())]
    Tokenizer {
        path: PathBuf,
        source: TokenizerError,
    },

    #[error("{}: {source}", .path.display())]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },

    #[error("{}: not a GGUF file, a .safetensors file, or a directory with config.json", .path.display())]
    UnknownFormat { path: PathBuf },
}
