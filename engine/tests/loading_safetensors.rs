//! Safetensors checkpoints (HF Llama and Qwen2 layouts) written by the test itself: a few
//! random tensors, a config.json and a byte-level BPE tokenizer.json.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use half::{bf16, f16};
use kvmesh_engine::gguf::{load_model, LoadError};
use kvmesh_engine::model_config::RopeStyle;
use kvmesh_kernels::WeightFormat;
use kvmesh_prompt::chat_template::{ChatMessage, ChatTemplate, ChatTemplateError};
use kvmesh_prompt::{ModelFileError, ModelText};
use rand::{Rng, SeedableRng};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};

const HIDDEN: usize = 8;
const HEADS: usize = 2;
const KV_HEADS: usize = 1;
const HEAD_DIM: usize = 4;
const FF: usize = 16;
const LAYERS: usize = 2;

/// GPT-2's printable stand-in for each byte.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff);
    if printable(b) {
        return b as char;
    }
    let shifted = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(0x100 + shifted).unwrap()
}

const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// A byte-level BPE tokenizer.json: 256 byte tokens, two merges, three specials.
/// `bos` adds a Llama-3-style BOS post-processor.
fn tokenizer_json(bos: bool) -> Value {
    let mut vocab = serde_json::Map::new();
    for b in 0..=255u8 {
        vocab.insert(byte_char(b).to_string(), json!(b as u32));
    }
    vocab.insert("he".into(), json!(256));
    vocab.insert("hel".into(), json!(257));
    let added: Vec<Value> = SPECIALS
        .iter()
        .enumerate()
        .map(|(i, s)| {
            json!({"id": 258 + i, "content": s, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let post = if bos {
        json!({"type": "TemplateProcessing",
               "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                          {"Sequence": {"id": "A", "type_id": 0}}],
               "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                        {"Sequence": {"id": "B", "type_id": 1}}],
               "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [259],
                                                   "tokens": ["<|im_start|>"]}}})
    } else {
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
               "use_regex": true})
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false,
                          "trim_offsets": true, "use_regex": true},
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                    "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": ["h e", "he l"]}
    })
}

const VOCAB: usize = 261;

/// Tensor bytes in `dtype` from f32 values, plus the values as stored (rounded).
fn encode(dtype: Dtype, values: &[f32]) -> (Vec<u8>, Vec<f32>) {
    match dtype {
        Dtype::F32 => (
            values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            values.to_vec(),
        ),
        Dtype::F16 => (
            values
                .iter()
                .flat_map(|&v| f16::from_f32(v).to_le_bytes())
                .collect(),
            values.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
        ),
        Dtype::BF16 => (
            values
                .iter()
                .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
                .collect(),
            values.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
        ),
        Dtype::I64 => (
            values
                .iter()
                .flat_map(|&v| (v as i64).to_le_bytes())
                .collect(),
            values.to_vec(),
        ),
        other => panic!("test does not write {other:?}"),
    }
}

struct Stored {
    dtype: Dtype,
    /// HF order: [rows, cols].
    shape: Vec<usize>,
    bytes: Vec<u8>,
    /// The values as stored (after rounding to `dtype`).
    values: Vec<f32>,
}

struct Checkpoint {
    tensors: BTreeMap<String, Stored>,
}

impl Checkpoint {
    fn new(qwen: bool, seed: u64) -> Self {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut tensors = BTreeMap::new();
        let mut add = |name: String, dtype: Dtype, shape: Vec<usize>| {
            let n: usize = shape.iter().product();
            let values: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
            let (bytes, values) = encode(dtype, &values);
            tensors.insert(
                name,
                Stored {
                    dtype,
                    shape,
                    bytes,
                    values,
                },
            );
        };
        add(
            "model.embed_tokens.weight".into(),
            Dtype::BF16,
            vec![VOCAB, HIDDEN],
        );
        add("model.norm.weight".into(), Dtype::F32, vec![HIDDEN]);
        if qwen {
            add("lm_head.weight".into(), Dtype::F16, vec![VOCAB, HIDDEN]);
        }
        let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
        for i in 0..LAYERS {
            let n = |s: &str| format!("model.layers.{i}.{s}");
            add(n("input_layernorm.weight"), Dtype::F32, vec![HIDDEN]);
            add(
                n("post_attention_layernorm.weight"),
                Dtype::F32,
                vec![HIDDEN],
            );
            add(n("self_attn.q_proj.weight"), Dtype::F32, vec![q, HIDDEN]);
            add(n("self_attn.k_proj.weight"), Dtype::F16, vec![kv, HIDDEN]);
            add(n("self_attn.v_proj.weight"), Dtype::BF16, vec![kv, HIDDEN]);
            add(n("self_attn.o_proj.weight"), Dtype::F32, vec![HIDDEN, q]);
            add(n("mlp.gate_proj.weight"), Dtype::F32, vec![FF, HIDDEN]);
            add(n("mlp.up_proj.weight"), Dtype::F32, vec![FF, HIDDEN]);
            add(n("mlp.down_proj.weight"), Dtype::F32, vec![HIDDEN, FF]);
            if qwen {
                add(n("self_attn.q_proj.bias"), Dtype::F16, vec![q]);
                add(n("self_attn.k_proj.bias"), Dtype::F32, vec![kv]);
                add(n("self_attn.v_proj.bias"), Dtype::BF16, vec![kv]);
            }
        }
        // Present in old checkpoints; must be ignored.
        add(
            "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
            Dtype::F32,
            vec![HEAD_DIM / 2],
        );
        Checkpoint { tensors }
    }

    fn write_shard(&self, path: &Path, names: &[&String]) {
        let views: Vec<(String, TensorView)> = names
            .iter()
            .map(|&name| {
                let t = &self.tensors[name];
                let view = TensorView::new(t.dtype, t.shape.clone(), &t.bytes).unwrap();
                (name.clone(), view)
            })
            .collect();
        fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
    }

    /// One model.safetensors, or two shards with an index.
    fn write(&self, dir: &Path, shards: usize) {
        let names: Vec<&String> = self.tensors.keys().collect();
        if shards == 1 {
            self.write_shard(&dir.join("model.safetensors"), &names);
            return;
        }
        let mut weight_map = serde_json::Map::new();
        let per = names.len().div_ceil(shards);
        for (s, chunk) in names.chunks(per).enumerate() {
            let file = format!("model-{:05}-of-{shards:05}.safetensors", s + 1);
            self.write_shard(&dir.join(&file), chunk);
            for name in chunk {
                weight_map.insert((*name).clone(), json!(file));
            }
        }
        let index = json!({"metadata": {}, "weight_map": weight_map});
        fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    }
}

fn config(model_type: &str, tied: bool) -> Value {
    json!({
        "architectures": ["X"],
        "model_type": model_type,
        "hidden_size": HIDDEN,
        "intermediate_size": FF,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 128,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tied,
        "rope_scaling": null,
        "bos_token_id": 259,
        "eos_token_id": [260, 258],
        "torch_dtype": "bfloat16"
    })
}

fn write_llama(dir: &Path) -> Checkpoint {
    let ckpt = Checkpoint::new(false, 7);
    ckpt.write(dir, 1);
    fs::write(dir.join("config.json"), config("llama", true).to_string()).unwrap();
    fs::write(dir.join("tokenizer.json"), tokenizer_json(true).to_string()).unwrap();
    ckpt
}

fn write_qwen(dir: &Path) -> Checkpoint {
    let ckpt = Checkpoint::new(true, 11);
    ckpt.write(dir, 2);
    fs::write(dir.join("config.json"), config("qwen2", false).to_string()).unwrap();
    fs::write(
        dir.join("tokenizer.json"),
        tokenizer_json(false).to_string(),
    )
    .unwrap();
    let template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let tok_config = json!({"chat_template": template, "eos_token": "<|im_end|>"});
    fs::write(dir.join("tokenizer_config.json"), tok_config.to_string()).unwrap();
    ckpt
}

#[test]
fn llama_checkpoint_loads_with_gguf_names() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = write_llama(dir.path());
    let model = load_model(dir.path()).unwrap();
    let c = &model.config;
    assert_eq!(c.architecture, "llama");
    assert_eq!(
        (c.num_layers, c.hidden_size, c.intermediate_size),
        (LAYERS, HIDDEN, FF)
    );
    assert_eq!(
        (c.num_heads, c.num_kv_heads, c.head_dim),
        (HEADS, KV_HEADS, HEAD_DIM)
    );
    assert_eq!(
        (c.vocab_size, c.max_context, c.rope_theta),
        (VOCAB, 128, 500000.0)
    );
    assert_eq!(c.rope_style, RopeStyle::Neox);
    assert!(c.tied_embeddings && !c.qkv_bias);
    assert_eq!((c.bos_token_id, c.eos_token_id), (Some(259), Some(260)));

    let w = &model.weights;
    assert!(!w.has("output.weight"));
    assert!(!w.names().any(|n| n.contains("inv_freq")));
    let q = w.matrix("blk.1.attn_q.weight").unwrap();
    assert_eq!(
        (q.format, q.rows, q.cols),
        (WeightFormat::F32, HEADS * HEAD_DIM, HIDDEN)
    );
    assert_eq!(
        q.data(),
        &ckpt.tensors["model.layers.1.self_attn.q_proj.weight"].bytes[..]
    );
    let k = w.matrix("blk.0.attn_k.weight").unwrap();
    assert_eq!(
        (k.format, k.rows, k.cols),
        (WeightFormat::F16, HEAD_DIM, HIDDEN)
    );
    let down = w.matrix("blk.0.ffn_down.weight").unwrap();
    assert_eq!((down.rows, down.cols), (HIDDEN, FF));
    let emb = w.matrix("token_embd.weight").unwrap();
    assert_eq!(
        (emb.format, emb.rows, emb.cols),
        (WeightFormat::BF16, VOCAB, HIDDEN)
    );
    assert_eq!(
        w.vector_f32("blk.1.ffn_norm.weight").unwrap(),
        ckpt.tensors["model.layers.1.post_attention_layernorm.weight"].values
    );

    let tok = &model.tokenizer;
    let ids = tok.encode("hello<|im_end|>", true).unwrap();
    assert_eq!(
        ids[..2],
        [259, 257],
        "BOS from the post-processor, then the merged `hel`"
    );
    assert_eq!(*ids.last().unwrap(), 260);
    assert_eq!(tok.decode(&ids, true), "hello");
    assert_eq!(tok.decode(&ids, false), "<|im_start|>hello<|im_end|>");
    assert!(tok.is_special(258) && !tok.is_special(257));
    assert!(matches!(
        ChatTemplate::from_tokenizer(tok),
        Err(ChatTemplateError::NoTemplate)
    ));

    // The same checkpoint through its .safetensors file.
    let via_file = load_model(&dir.path().join("model.safetensors")).unwrap();
    assert_eq!(via_file.config, model.config);
    assert_eq!(via_file.fingerprint, model.fingerprint);

    // The text path, which never maps the weights, agrees on the identity.
    let text = ModelText::read(dir.path()).unwrap();
    assert_eq!(text.fingerprint, model.fingerprint);
    assert_eq!(text.max_context, model.config.max_context);
    assert_eq!(text.tokenizer.encode("hello<|im_end|>", true).unwrap(), ids);
}

#[test]
fn sharded_qwen2_checkpoint_with_biases_and_chat_template() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = write_qwen(dir.path());
    let model = load_model(dir.path()).unwrap();
    let c = &model.config;
    assert_eq!(c.architecture, "qwen2");
    assert!(c.qkv_bias && !c.tied_embeddings);
    let w = &model.weights;
    let lm = w.matrix("output.weight").unwrap();
    assert_eq!(
        (lm.format, lm.rows, lm.cols),
        (WeightFormat::F16, VOCAB, HIDDEN)
    );
    assert_eq!(
        w.vector_f32("blk.1.attn_q.bias").unwrap(),
        ckpt.tensors["model.layers.1.self_attn.q_proj.bias"].values
    );
    assert_eq!(
        w.vector_f32("blk.0.attn_v.bias").unwrap(),
        ckpt.tensors["model.layers.0.self_attn.v_proj.bias"].values
    );

    // No BOS post-processor here.
    assert_eq!(model.tokenizer.encode("hel", true).unwrap(), vec![257]);
    let template = ChatTemplate::from_tokenizer(&model.tokenizer).unwrap();
    let prompt = template
        .render(&[ChatMessage::new("user", "hi")], true)
        .unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );

    let text = ModelText::read(dir.path()).unwrap();
    assert_eq!(
        text.fingerprint, model.fingerprint,
        "sharded: every shard is hashed"
    );
    assert_eq!(
        text.tokenizer.chat_template(),
        model.tokenizer.chat_template()
    );

    let llama_dir = tempfile::tempdir().unwrap();
    write_llama(llama_dir.path());
    assert_ne!(
        load_model(llama_dir.path()).unwrap().fingerprint,
        model.fingerprint
    );
}

fn load_err(dir: &Path) -> LoadError {
    load_model(dir).expect_err("broken checkpoint must not load")
}

#[test]
fn broken_checkpoints_name_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    let mut ckpt = write_llama(path);

    fs::write(
        path.join("config.json"),
        config("gpt_neox", true).to_string(),
    )
    .unwrap();
    assert!(
        matches!(load_err(path), LoadError::UnsupportedArchitecture { arch, .. } if arch == "gpt_neox")
    );

    let mut scaled = config("llama", true);
    scaled["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0});
    fs::write(path.join("config.json"), scaled.to_string()).unwrap();
    assert!(
        matches!(load_err(path), LoadError::File(ModelFileError::BadConfigValue { key, .. }) if key == "rope_scaling")
    );

    fs::write(path.join("config.json"), "{\"model_type\": \"llama\"}").unwrap();
    let err = load_err(path);
    assert!(
        matches!(&err, LoadError::File(ModelFileError::Json { .. }))
            && err.to_string().contains("config.json"),
        "{err}"
    );

    fs::write(path.join("config.json"), config("llama", false).to_string()).unwrap();
    assert!(
        matches!(load_err(path), LoadError::MissingTensor { name, .. } if name == "output.weight")
    );

    fs::write(path.join("config.json"), config("llama", true).to_string()).unwrap();
    ckpt.tensors.remove("model.layers.1.mlp.up_proj.weight");
    ckpt.write(path, 1);
    assert!(
        matches!(load_err(path), LoadError::MissingTensor { name, .. } if name == "blk.1.ffn_up.weight")
    );

    let (bytes, values) = encode(Dtype::F32, &[0.0; FF * HIDDEN]);
    let stored = Stored {
        dtype: Dtype::F32,
        shape: vec![HIDDEN, FF],
        bytes,
        values,
    };
    ckpt.tensors
        .insert("model.layers.1.mlp.up_proj.weight".into(), stored);
    ckpt.write(path, 1);
    assert!(
        matches!(load_err(path), LoadError::WrongTensorShape { name, .. } if name == "blk.1.ffn_up.weight")
    );

    // Integer weights load (shapes are right) but cannot become a matrix.
    let (bytes, values) = encode(Dtype::I64, &[1.0; FF * HIDDEN]);
    let stored = Stored {
        dtype: Dtype::I64,
        shape: vec![FF, HIDDEN],
        bytes,
        values,
    };
    ckpt.tensors
        .insert("model.layers.1.mlp.up_proj.weight".into(), stored);
    ckpt.write(path, 1);
    let model = load_model(path).unwrap();
    assert!(matches!(
        model.weights.matrix("blk.1.ffn_up.weight"),
        Err(LoadError::UnsupportedTensorFormat { name, .. }) if name == "blk.1.ffn_up.weight"
    ));

    // A truncated file is reported by the safetensors parser, naming the file.
    let file = path.join("model.safetensors");
    let bytes = fs::read(&file).unwrap();
    fs::write(&file, &bytes[..bytes.len() - 3]).unwrap();
    let err = load_err(path);
    assert!(
        matches!(&err, LoadError::Safetensors { .. })
            && err.to_string().contains("model.safetensors"),
        "{err}"
    );

    fs::remove_file(path.join("tokenizer.json")).unwrap();
    fs::write(&file, &bytes).unwrap();
    let err = load_err(path);
    assert!(
        matches!(&err, LoadError::File(ModelFileError::Io { path, .. }) if path.ends_with("tokenizer.json")),
        "{err}"
    );

    let empty = tempfile::tempdir().unwrap();
    assert!(matches!(
        load_err(empty.path()),
        LoadError::File(ModelFileError::UnknownFormat { .. })
    ));
}
