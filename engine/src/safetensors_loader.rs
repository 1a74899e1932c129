//! HF safetensors checkpoints (Llama, Qwen2): config.json gives the `ModelConfig`, tensors
//! are renamed to their GGUF names and stay memory-mapped; the tokenizer, chat template and
//! fingerprint are the text path's (`kvmesh_prompt::ModelText::from_hf`).

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvmesh_kernels::WeightFormat;
use kvmesh_prompt::model_text::HfTextConfig;
use kvmesh_prompt::{ModelFileError, ModelText};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

use crate::gguf::{LoadError, LoadedModel, Weights};
use crate::model_config::{ModelConfig, RopeStyle};

/// The fields of an HF config.json that a Llama-family forward pass needs.
#[derive(Debug, Deserialize)]
struct HfConfig {
    model_type: String,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    rope_theta: Option<f64>,
    rms_norm_eps: f64,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: bool,
    rope_scaling: Option<serde_json::Value>,
    /// Context length and special ids.
    #[serde(flatten)]
    text: HfTextConfig,
}

/// Loads the checkpoint at `path` whose files [`kvmesh_prompt::ModelFiles::locate`] found:
/// the JSON files in `dir`, the weights in `shards`.
pub fn load_safetensors(
    path: &Path,
    dir: &Path,
    shards: &[PathBuf],
) -> Result<LoadedModel, LoadError> {
    let config_path = dir.join("config.json");
    let config_bytes = fs::read(&config_path).map_err(|source| ModelFileError::Io {
        path: config_path.clone(),
        source,
    })?;
    let hf: HfConfig =
        serde_json::from_slice(&config_bytes).map_err(|source| ModelFileError::Json {
            path: config_path.clone(),
            source,
        })?;
    let config = model_config(&config_path, &hf)?;

    let mut weights = Weights::new(path);
    for file in shards {
        let map = map_file(file)?;
        add_tensors(&mut weights, file, &map)?;
    }
    weights.check_llama_shapes(&config)?;

    let text = ModelText::from_hf(dir, shards)?;
    Ok(LoadedModel {
        path: path.to_path_buf(),
        config,
        weights,
        tokenizer: text.tokenizer,
        fingerprint: text.fingerprint,
    })
}

fn map_file(path: &Path) -> Result<Arc<Mmap>, LoadError> {
    let io = |source| ModelFileError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    // SAFETY: read-only map; the checkpoint must not be modified while loaded.
    let map = unsafe { Mmap::map(&file) }.map_err(io)?;
    Ok(Arc::new(map))
}

/// Registers the tensors of one shard under their GGUF names. safetensors validates that
/// every tensor's byte range matches its dtype and shape and lies inside the file.
fn add_tensors(weights: &mut Weights, path: &Path, map: &Arc<Mmap>) -> Result<(), LoadError> {
    let (header_len, metadata) =
        SafeTensors::read_metadata(&map[..]).map_err(|source| LoadError::Safetensors {
            path: path.to_path_buf(),
            source,
        })?;
    let data_start = 8 + header_len;
    let source = weights.add_source(map.clone());
    for (hf_name, info) in metadata.tensors() {
        let Some(name) = gguf_name(&hf_name) else {
            tracing::debug!(tensor = %hf_name, file = %path.display(), "ignoring unused tensor");
            continue;
        };
        let (format, type_name) = match info.dtype {
            Dtype::F32 => (Some(WeightFormat::F32), "F32"),
            Dtype::F16 => (Some(WeightFormat::F16), "F16"),
            Dtype::BF16 => (Some(WeightFormat::BF16), "BF16"),
            other => (None, dtype_name(other)),
        };
        // HF shapes are [rows, cols] row-major; ggml lists the contiguous dim first.
        let dims = info.shape.iter().rev().copied().collect();
        let (start, end) = info.data_offsets;
        weights.insert(
            name,
            format,
            type_name,
            dims,
            source,
            data_start + start..data_start + end,
        );
    }
    Ok(())
}

fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::BOOL => "BOOL",
        Dtype::U8 => "U8",
        Dtype::I8 => "I8",
        Dtype::I16 => "I16",
        Dtype::U16 => "U16",
        Dtype::I32 => "I32",
        Dtype::U32 => "U32",
        Dtype::I64 => "I64",
        Dtype::U64 => "U64",
        Dtype::F64 => "F64",
        _ => "an 8-bit or smaller float",
    }
}

/// HF Llama/Qwen2 tensor name -> GGUF tensor name; `None` for tensors the forward pass
/// does not use (e.g. `rotary_emb.inv_freq`).
pub fn gguf_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(name) = fixed {
        return Some(name.into());
    }
    let (layer, rest) = hf.strip_prefix("model.layers.")?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, kind) = rest.rsplit_once('.')?;
    if kind != "weight" && kind != "bias" {
        return None;
    }
    let name = match module {
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        _ => return None,
    };
    Some(format!("blk.{layer}.{name}.{kind}"))
}

fn model_config(path: &Path, c: &HfConfig) -> Result<ModelConfig, LoadError> {
    let bad = |key: &str, reason: String| -> LoadError {
        ModelFileError::BadConfigValue {
            path: path.to_path_buf(),
            key: key.into(),
            reason,
        }
        .into()
    };
    let qkv_bias = match c.model_type.as_str() {
        "qwen2" => true,
        "llama" if c.attention_bias => {
            return Err(bad(
                "attention_bias",
                "Llama checkpoints with attention biases are not supported".into(),
            ))
        }
        "llama" => false,
        other => {
            return Err(LoadError::UnsupportedArchitecture {
                path: path.to_path_buf(),
                arch: other.into(),
            })
        }
    };
    if let Some(scaling) = c.rope_scaling.as_ref().filter(|v| !v.is_null()) {
        return Err(bad(
            "rope_scaling",
            format!("RoPE scaling is not supported ({scaling})"),
        ));
    }
    let num_kv_heads = c.num_key_value_heads.unwrap_or(c.num_attention_heads);
    for (key, v) in [
        ("hidden_size", c.hidden_size),
        ("intermediate_size", c.intermediate_size),
        ("num_hidden_layers", c.num_hidden_layers),
        ("num_attention_heads", c.num_attention_heads),
        ("num_key_value_heads", num_kv_heads),
        ("vocab_size", c.vocab_size),
        ("max_position_embeddings", c.text.max_position_embeddings),
    ] {
        if v == 0 {
            return Err(bad(key, "must be positive".into()));
        }
    }
    if !c.num_attention_heads.is_multiple_of(num_kv_heads) {
        return Err(bad(
            "num_key_value_heads",
            format!(
                "{num_kv_heads} does not divide the {} attention heads",
                c.num_attention_heads
            ),
        ));
    }
    let head_dim = match c.head_dim {
        Some(d) if d > 0 => d,
        Some(_) => return Err(bad("head_dim", "must be positive".into())),
        None if c.hidden_size.is_multiple_of(c.num_attention_heads) => {
            c.hidden_size / c.num_attention_heads
        }
        None => {
            return Err(bad(
                "num_attention_heads",
                "does not divide hidden_size".into(),
            ))
        }
    };
    Ok(ModelConfig {
        architecture: c.model_type.clone(),
        num_layers: c.num_hidden_layers,
        hidden_size: c.hidden_size,
        intermediate_size: c.intermediate_size,
        num_heads: c.num_attention_heads,
        num_kv_heads,
        head_dim,
        vocab_size: c.vocab_size,
        max_context: c.text.max_position_embeddings,
        rope_theta: c.rope_theta.unwrap_or(10_000.0) as f32,
        // HF keeps Q/K unpermuted: RoPE pairs dimension i with i + head_dim / 2.
        rope_style: RopeStyle::Neox,
        rms_norm_eps: c.rms_norm_eps as f32,
        tied_embeddings: c.tie_word_embeddings,
        qkv_bias,
        bos_token_id: c.text.bos_token_id(),
        eos_token_id: c.text.eos_token_id(),
    })
}

#[cfg(test)]
mod tests {
    use super::gguf_name;

    #[test]
    fn hf_names_map_to_gguf_names() {
        let cases = [
            ("model.embed_tokens.weight", Some("token_embd.weight")),
            ("lm_head.weight", Some("output.weight")),
            ("model.norm.weight", Some("output_norm.weight")),
            (
                "model.layers.3.self_attn.q_proj.bias",
                Some("blk.3.attn_q.bias"),
            ),
            (
                "model.layers.12.mlp.down_proj.weight",
                Some("blk.12.ffn_down.weight"),
            ),
            (
                "model.layers.0.post_attention_layernorm.weight",
                Some("blk.0.ffn_norm.weight"),
            ),
            ("model.layers.0.self_attn.rotary_emb.inv_freq", None),
            ("model.layers.x.mlp.up_proj.weight", None),
        ];
        for (hf, want) in cases {
            assert_eq!(gguf_name(hf).as_deref(), want, "{hf}");
        }
    }
}
