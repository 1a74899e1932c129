//! Hyper-parameters of a Llama-family model, read from GGUF metadata or an HF config.json.

use serde::{Deserialize, Serialize};

/// How RoPE pairs dimensions: GGUF Llama checkpoints have Q/K permuted for adjacent pairs
/// (`Interleaved`); HF checkpoints pair `i` with `i + head_dim/2` (`Neox`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RopeStyle {
    Interleaved,
    Neox,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// e.g. "llama" or "qwen2".
    pub architecture: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_context: usize,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    pub rms_norm_eps: f32,
    /// The output projection reuses the token embedding.
    pub tied_embeddings: bool,
    /// Q/K/V projections carry biases (Qwen2).
    pub qkv_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
}
