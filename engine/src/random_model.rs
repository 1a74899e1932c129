//! Models with random weights in the shapes of real ones, built in memory: for checking one
//! backend against another and for throughput figures where the real weights cannot travel
//! (`kvmesh gpu-check`). The values are scaled so activations keep the magnitudes of a
//! trained model's (each weight row has about unit norm), not so the output means anything.

use crate::model::{Layer, LlamaModel};
use crate::model_config::{ModelConfig, RopeStyle};
use crate::Loaded;
use half::f16;
use kvmesh_common::ModelFingerprint;
use kvmesh_kernels::{QMatrix, WeightFormat};
use kvmesh_prompt::tokenizer::Tokenizer;
use std::sync::Arc;

/// SmolLM2-135M's shape (GGUF: interleaved RoPE, tied embeddings).
pub fn smollm2_135m() -> ModelConfig {
    shape(
        "smollm2-135m",
        30,
        576,
        1536,
        9,
        3,
        64,
        49152,
        8192,
        100000.0,
        true,
    )
}

/// Llama-3-8B's shape.
pub fn llama3_8b() -> ModelConfig {
    shape(
        "llama3-8b",
        32,
        4096,
        14336,
        32,
        8,
        128,
        128256,
        8192,
        500000.0,
        false,
    )
}

#[allow(clippy::too_many_arguments)]
fn shape(
    name: &str,
    num_layers: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    vocab_size: usize,
    max_context: usize,
    rope_theta: f32,
    tied_embeddings: bool,
) -> ModelConfig {
    ModelConfig {
        architecture: format!("llama ({name}-shaped, random weights)"),
        num_layers,
        hidden_size,
        intermediate_size,
        num_heads,
        num_kv_heads,
        head_dim,
        vocab_size,
        max_context,
        rope_theta,
        rope_style: RopeStyle::Interleaved,
        rms_norm_eps: 1e-5,
        tied_embeddings,
        qkv_bias: false,
        bos_token_id: None,
        eos_token_id: None,
    }
}

/// splitmix64: a seeded stream of random words, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn fill(&mut self, out: &mut [u8]) {
        for c in out.chunks_mut(8) {
            let w = self.next().to_le_bytes();
            c.copy_from_slice(&w[..c.len()]);
        }
    }
}

/// A `[rows, cols]` matrix of `format` (Q8_0 or Q4_1) with uniform random quants and scales
/// giving each element a standard deviation of `std`.
fn matrix(rng: &mut Rng, format: WeightFormat, rows: usize, cols: usize, std: f32) -> QMatrix {
    let row_bytes = format
        .row_bytes(cols)
        .unwrap_or_else(|e| panic!("random model: {e}"));
    let mut data = vec![0u8; rows * row_bytes];
    rng.fill(&mut data);
    let bb = format.block_bytes();
    match format {
        // Uniform i8 has a standard deviation of about 73.6.
        WeightFormat::Q8_0 => {
            let d = f16::from_f32(std / 73.6).to_le_bytes();
            for b in data.chunks_exact_mut(bb) {
                b[..2].copy_from_slice(&d);
            }
        }
        // Uniform nibbles have mean 7.5 and a standard deviation of about 4.6.
        WeightFormat::Q4_1 => {
            let d = std / 4.6;
            let (dh, mh) = (f16::from_f32(d).to_le_bytes(), f16::from_f32(-7.5 * d));
            for b in data.chunks_exact_mut(bb) {
                b[..2].copy_from_slice(&dh);
                b[2..4].copy_from_slice(&mh.to_le_bytes());
            }
        }
        f => panic!("random model: {f:?} is not Q8_0 or Q4_1"),
    }
    QMatrix::new(format, rows, cols, data).unwrap_or_else(|e| panic!("random model: {e}"))
}

/// The fused q, k, v projection: q and k rows `qk_scale` times `std`, v rows of `std`.
fn qkv_matrix(
    rng: &mut Rng,
    format: WeightFormat,
    c: &ModelConfig,
    std: f32,
    qk_scale: f32,
) -> QMatrix {
    let (qk_rows, v_rows) = (
        (c.num_heads + c.num_kv_heads) * c.head_dim,
        c.num_kv_heads * c.head_dim,
    );
    let qk = matrix(rng, format, qk_rows, c.hidden_size, qk_scale * std);
    let v = matrix(rng, format, v_rows, c.hidden_size, std);
    let data = [qk.data(), v.data()].concat();
    QMatrix::new(format, qk_rows + v_rows, c.hidden_size, data)
        .unwrap_or_else(|e| panic!("random model: {e}"))
}

/// A model of `config` with random `format` weights (Q8_0 or Q4_1; the embedding is Q8_0, as
/// llama.cpp keeps it in Q4_1 files), the same for the same seed, every row of about unit
/// norm except q's and k's, `qk_scale` times that. At 1 attention scores have a standard
/// deviation of 1 and a query averages most of its context (the output hardly depends on
/// it); at 2 (4) each query picks a few positions as a trained model's do, and the output
/// depends on the context, but a 30-layer stack of them amplifies rounding differences.
pub fn random_model(
    config: ModelConfig,
    format: WeightFormat,
    seed: u64,
    qk_scale: f32,
) -> LlamaModel {
    let mut rng = Rng(seed);
    let c = &config;
    let (hs, hd) = (c.hidden_size, c.head_dim);
    let inv = |n: usize| 1.0 / (n as f32).sqrt();
    let layers = (0..c.num_layers)
        .map(|_| Layer {
            attn_norm: vec![1.0; hs],
            wqkv: qkv_matrix(&mut rng, format, c, inv(hs), qk_scale),
            qkv_bias: None,
            wo: matrix(
                &mut rng,
                format,
                hs,
                c.num_heads * hd,
                inv(c.num_heads * hd),
            ),
            ffn_norm: vec![1.0; hs],
            w_gate_up: matrix(&mut rng, format, 2 * c.intermediate_size, hs, inv(hs)),
            w_down: matrix(
                &mut rng,
                format,
                hs,
                c.intermediate_size,
                inv(c.intermediate_size),
            ),
        })
        .collect();
    let embed = matrix(&mut rng, WeightFormat::Q8_0, c.vocab_size, hs, 1.0);
    let lm_head = (!c.tied_embeddings).then(|| matrix(&mut rng, format, c.vocab_size, hs, inv(hs)));
    LlamaModel {
        embed,
        layers,
        output_norm: vec![1.0; hs],
        lm_head,
        config,
    }
}

/// A random model of `config` ready to serve (see [`placeholder_tokenizer`]), its fingerprint
/// derived from the seed so two such models never share prefix hashes.
pub fn random_loaded(
    config: ModelConfig,
    format: WeightFormat,
    seed: u64,
    qk_scale: f32,
) -> Loaded {
    let tokenizer = Arc::new(placeholder_tokenizer(config.vocab_size));
    Loaded {
        model: Arc::new(random_model(config, format, seed, qk_scale)),
        tokenizer,
        fingerprint: ModelFingerprint(0x7a4d_0000_0000_0000 ^ seed),
    }
}

/// A byte-level tokenizer of exactly `vocab_size` ids (at least 256) for a model without one:
/// ids 0..256 are the bytes, id `i` above them reads as the text ` t{i}`. It has no merges,
/// no special tokens and no EOS, so engines and workers can run a random model end to end
/// (detokenizing whatever it draws); the text means nothing.
pub fn placeholder_tokenizer(vocab_size: usize) -> Tokenizer {
    assert!(
        vocab_size >= 256,
        "a byte-level vocabulary has 256 ids at least"
    );
    let spelled = |bytes: &[u8]| bytes.iter().map(|&b| byte_char(b)).collect::<String>();
    let vocab: serde_json::Map<String, serde_json::Value> = (0..vocab_size)
        .map(|i| {
            let text = match u8::try_from(i) {
                Ok(b) => spelled(&[b]),
                Err(_) => spelled(format!(" t{i}").as_bytes()),
            };
            (text, serde_json::json!(i))
        })
        .collect();
    let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
        "trim_offsets": true, "use_regex": true});
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": byte_level, "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    });
    let bytes = serde_json::to_vec(&json).unwrap_or_else(|e| unreachable!("JSON of JSON: {e}"));
    Tokenizer::from_hf_json(&bytes, None, None, None)
        .unwrap_or_else(|e| panic!("the placeholder tokenizer is well formed: {e}"))
}

/// GPT-2's byte-level alphabet: printable bytes stand for themselves, the others for the
/// characters from U+0100 on.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff);
    if printable(b) {
        char::from(b)
    } else {
        let shifted = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(256 + shifted).unwrap_or(char::REPLACEMENT_CHARACTER)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_model_and_scales_as_asked() {
        let mut c = smollm2_135m();
        c.num_layers = 1;
        c.vocab_size = 64;
        let a = random_model(c.clone(), WeightFormat::Q4_1, 7, 1.0);
        let b = random_model(c.clone(), WeightFormat::Q4_1, 7, 1.0);
        assert_eq!(a.layers[0].wqkv, b.layers[0].wqkv);
        assert_ne!(
            a.layers[0].wqkv,
            random_model(c, WeightFormat::Q4_1, 8, 1.0).layers[0].wqkv
        );
        let w = &a.layers[0].w_gate_up;
        let mut row = vec![0.0; w.cols];
        let mut sq = 0.0f64;
        for r in 0..w.rows {
            w.dequantize_row(r, &mut row);
            sq += row.iter().map(|&x| f64::from(x * x)).sum::<f64>();
        }
        // Each row about unit norm.
        let mean_norm2 = sq / w.rows as f64;
        assert!((0.8..1.2).contains(&mean_norm2), "{mean_norm2}");
    }

    #[test]
    fn the_placeholder_tokenizer_spans_the_vocabulary_and_decodes_every_id() {
        let t = placeholder_tokenizer(49152);
        assert_eq!(t.vocab_size(), 49152);
        assert_eq!(t.decode(&[72, 105], true), "Hi");
        assert_eq!(t.decode(&[300, 49151], true), " t300 t49151");
        assert_eq!(t.encode("Hi", false).unwrap(), vec![72, 105]);
        assert_eq!(t.eos_token_id(), None);
    }
}
