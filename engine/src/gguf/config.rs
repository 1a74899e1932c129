//! `ModelConfig` from GGUF metadata (`{arch}.block_count`, `{arch}.embedding_length`, ...).

use kvmesh_prompt::gguf::GgufFile;
use kvmesh_prompt::model_text::gguf_context_length;
use kvmesh_prompt::ModelFileError;

use super::error::LoadError;
use super::weights::Weights;
use crate::model_config::{ModelConfig, RopeStyle};

pub(crate) fn model_config(g: &GgufFile, weights: &Weights) -> Result<ModelConfig, LoadError> {
    let arch = g.str_req("general.architecture")?;
    // llama.cpp's converter permutes Llama Q/K rows for adjacent-pair RoPE; Qwen2 keeps
    // the HF layout and rotates half-split pairs.
    let (rope_style, qkv_bias) = match arch {
        "llama" => (RopeStyle::Interleaved, weights.has("blk.0.attn_q.bias")),
        "qwen2" => (RopeStyle::Neox, true),
        _ => {
            return Err(LoadError::UnsupportedArchitecture {
                path: g.path.clone(),
                arch: arch.into(),
            })
        }
    };
    let key = |k: &str| format!("{arch}.{k}");
    let req = |k: &str| g.positive_req(&key(k));
    let num_layers = req("block_count")?;
    let hidden_size = req("embedding_length")?;
    let intermediate_size = req("feed_forward_length")?;
    let num_heads = req("attention.head_count")?;
    let num_kv_heads = g
        .positive_opt(&key("attention.head_count_kv"))?
        .unwrap_or(num_heads);
    if !num_heads.is_multiple_of(num_kv_heads) {
        return Err(g
            .bad_value(
                &key("attention.head_count_kv"),
                format!("{num_kv_heads} does not divide the {num_heads} query heads"),
            )
            .into());
    }
    let head_dim = match g.positive_opt(&key("attention.key_length"))? {
        Some(v) => v,
        None if hidden_size.is_multiple_of(num_heads) => hidden_size / num_heads,
        None => {
            return Err(g
                .bad_value(
                    &key("attention.head_count"),
                    format!("{num_heads} heads do not divide the embedding length {hidden_size}"),
                )
                .into())
        }
    };
    let vocab_size = match g.array_opt("tokenizer.ggml.tokens")? {
        Some(tokens) => tokens.len(),
        None => req("vocab_size")?,
    };
    let rms_key = key("attention.layer_norm_rms_epsilon");
    let rms_norm_eps = g
        .f64_opt(&rms_key)?
        .ok_or_else(|| ModelFileError::MissingMetadata {
            path: g.path.clone(),
            key: rms_key,
        })? as f32;
    let token_id = |k: &str| -> Result<Option<u32>, LoadError> {
        g.u64_opt(k)?
            .map(|v| {
                u32::try_from(v)
                    .map_err(|_| g.bad_value(k, format!("{v} is not a token id")).into())
            })
            .transpose()
    };
    Ok(ModelConfig {
        architecture: arch.into(),
        num_layers,
        hidden_size,
        intermediate_size,
        num_heads,
        num_kv_heads,
        head_dim,
        vocab_size,
        max_context: gguf_context_length(g)?,
        rope_theta: g.f64_opt(&key("rope.freq_base"))?.unwrap_or(10_000.0) as f32,
        rope_style,
        rms_norm_eps,
        tied_embeddings: !weights.has("output.weight"),
        qkv_bias,
        bos_token_id: token_id("tokenizer.ggml.bos_token_id")?,
        eos_token_id: token_id("tokenizer.ggml.eos_token_id")?,
    })
}
