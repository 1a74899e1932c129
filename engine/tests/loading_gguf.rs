//! GGUF loading: the real SmolLM2 file, a tiny model written here, and corrupt files that
//! must fail with an error naming the file and the field (never a panic or a huge
//! allocation).

use std::path::{Path, PathBuf};

use kvmesh_engine::gguf::{load_model, LoadError};
use kvmesh_engine::model_config::RopeStyle;
use kvmesh_kernels::WeightFormat;
use kvmesh_prompt::gguf::{GgmlType, GgufFile, GgufValue};
use kvmesh_prompt::{ModelFileError, ModelText};
use proptest::prelude::*;

fn model_path() -> PathBuf {
    kvmesh_prompt::model_fetch::fetched_model().unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn smollm2_loads_with_expected_config_and_weights() {
    let path = model_path();
    let model = load_model(&path).expect("load SmolLM2");
    let c = &model.config;
    assert_eq!(c.architecture, "llama");
    assert_eq!(
        (c.num_layers, c.hidden_size, c.intermediate_size),
        (30, 576, 1536)
    );
    assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (9, 3, 64));
    assert_eq!((c.vocab_size, c.max_context), (49152, 8192));
    assert_eq!(c.rope_theta, 100_000.0);
    assert_eq!(c.rope_style, RopeStyle::Interleaved);
    assert!((c.rms_norm_eps - 1e-5).abs() < 1e-9);
    assert!(c.tied_embeddings && !c.qkv_bias);
    assert_eq!((c.bos_token_id, c.eos_token_id), (Some(1), Some(2)));

    let w = &model.weights;
    assert!(!w.has("output.weight"));
    let q = w.matrix("blk.0.attn_q.weight").unwrap();
    assert_eq!((q.format, q.rows, q.cols), (WeightFormat::Q4_1, 576, 576));
    let k = w.matrix("blk.29.attn_k.weight").unwrap();
    assert_eq!((k.rows, k.cols), (192, 576));
    let down = w.matrix("blk.3.ffn_down.weight").unwrap();
    assert_eq!((down.rows, down.cols), (576, 1536));
    let emb = w.matrix("token_embd.weight").unwrap();
    assert_eq!(
        (emb.format, emb.rows, emb.cols),
        (WeightFormat::Q8_0, 49152, 576)
    );
    let norm = w.vector_f32("output_norm.weight").unwrap();
    assert_eq!(norm.len(), 576);
    assert!(norm.iter().all(|x| x.is_finite()) && norm.iter().any(|&x| x != 0.0));

    assert!(matches!(
        w.matrix("blk.30.attn_q.weight"),
        Err(LoadError::MissingTensor { name, .. }) if name == "blk.30.attn_q.weight"
    ));
    assert!(matches!(
        w.vector_f32("blk.0.attn_q.weight"),
        Err(LoadError::WrongTensorShape { .. })
    ));
    assert!(matches!(
        w.matrix("blk.0.attn_norm.weight"),
        Err(LoadError::WrongTensorShape { .. })
    ));

    assert_eq!(model.tokenizer.vocab_size(), 49152);
    // The fingerprint is a pure function of the file.
    assert_eq!(load_model(&path).unwrap().fingerprint, model.fingerprint);
    // The text path, which never maps the weights, agrees on everything it reads.
    let text = ModelText::read(&path).unwrap();
    assert_eq!(text.fingerprint, model.fingerprint);
    assert_eq!(text.max_context, c.max_context);
    assert_eq!(text.tokenizer.vocab_size(), model.tokenizer.vocab_size());
    assert_eq!(
        (text.tokenizer.bos_token_id(), text.tokenizer.eos_token_id()),
        (c.bos_token_id, c.eos_token_id)
    );
    assert_eq!(
        text.tokenizer.chat_template(),
        model.tokenizer.chat_template()
    );

    let gguf = GgufFile::open(&path).unwrap();
    assert_eq!(gguf.version, 3);
    assert_eq!(gguf.tensors.len(), 272);
    let info = gguf.tensor("blk.0.ffn_gate.weight").unwrap();
    assert_eq!(
        (info.ggml_type, &info.dims[..]),
        (GgmlType::Q4_1, &[576, 1536][..])
    );
    assert_eq!(
        gguf.tensor_bytes("blk.0.ffn_gate.weight").unwrap().len(),
        1536 * 18 * 20
    );
}

// ---- a tiny GGUF writer ------------------------------------------------------------

/// Metadata value in GGUF encoding: (type id, payload).
#[derive(Clone)]
struct Kv(String, u32, Vec<u8>);

fn gstr(s: &str) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(s.as_bytes());
    v
}

fn kv_u32(k: &str, v: u32) -> Kv {
    Kv(k.into(), 4, v.to_le_bytes().to_vec())
}

fn kv_f32(k: &str, v: f32) -> Kv {
    Kv(k.into(), 6, v.to_le_bytes().to_vec())
}

fn kv_str(k: &str, v: &str) -> Kv {
    Kv(k.into(), 8, gstr(v))
}

fn kv_bool(k: &str, v: bool) -> Kv {
    Kv(k.into(), 7, vec![v as u8])
}

fn kv_str_array(k: &str, items: &[String]) -> Kv {
    let mut p = 8u32.to_le_bytes().to_vec();
    p.extend((items.len() as u64).to_le_bytes());
    for s in items {
        p.extend(gstr(s));
    }
    Kv(k.into(), 9, p)
}

fn kv_i32_array(k: &str, items: &[i32]) -> Kv {
    let mut p = 5u32.to_le_bytes().to_vec();
    p.extend((items.len() as u64).to_le_bytes());
    for x in items {
        p.extend(x.to_le_bytes());
    }
    Kv(k.into(), 9, p)
}

struct Tensor {
    name: String,
    dims: Vec<u64>,
    ty: u32,
    data: Vec<u8>,
    /// Overrides the data offset the writer would choose.
    offset: Option<u64>,
}

fn f32_tensor(name: &str, dims: &[u64], values: impl Fn(usize) -> f32) -> Tensor {
    let n: u64 = dims.iter().product();
    Tensor {
        name: name.into(),
        dims: dims.to_vec(),
        ty: 0,
        data: (0..n as usize)
            .flat_map(|i| values(i).to_le_bytes())
            .collect(),
        offset: None,
    }
}

/// Q8_0 blocks: f16 scale 1.0 then 32 int8 values.
fn q8_tensor(name: &str, dims: &[u64]) -> Tensor {
    let n: u64 = dims.iter().product();
    let mut data = Vec::new();
    for b in 0..n / 32 {
        data.extend(half::f16::from_f32(1.0).to_le_bytes());
        data.extend((0..32).map(|i| ((b as i32 + i) % 7 - 3) as u8));
    }
    Tensor {
        name: name.into(),
        dims: dims.to_vec(),
        ty: 8,
        data,
        offset: None,
    }
}

fn build_gguf(version: u32, kvs: &[Kv], tensors: &[Tensor]) -> Vec<u8> {
    const ALIGN: usize = 32;
    let mut out = b"GGUF".to_vec();
    out.extend(version.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((kvs.len() as u64).to_le_bytes());
    for Kv(k, ty, payload) in kvs {
        out.extend(gstr(k));
        out.extend(ty.to_le_bytes());
        out.extend(payload);
    }
    let mut offset = 0usize;
    let mut offsets = Vec::new();
    for t in tensors {
        out.extend(gstr(&t.name));
        out.extend((t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend(d.to_le_bytes());
        }
        out.extend(t.ty.to_le_bytes());
        out.extend(t.offset.unwrap_or(offset as u64).to_le_bytes());
        offsets.push(offset);
        offset = (offset + t.data.len()).next_multiple_of(ALIGN);
    }
    out.resize(out.len().next_multiple_of(ALIGN), 0);
    let data_start = out.len();
    for (t, off) in tensors.iter().zip(offsets) {
        out.resize(data_start + off, 0);
        out.extend(&t.data);
    }
    out
}

/// GPT-2's printable stand-in for each byte.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff);
    if printable(b) {
        return b as char;
    }
    let shifted = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(0x100 + shifted).unwrap()
}

const H: u64 = 32;
const FF: u64 = 64;

/// A 1-layer llama (hidden 32, 2 heads of 16, 1 KV head) with a byte-level vocabulary.
fn tiny_model() -> (Vec<Kv>, Vec<Tensor>) {
    let mut tokens: Vec<String> = vec!["<|endoftext|>".into(), "<|im_start|>".into()];
    tokens.extend((0..=255u8).map(|b| byte_char(b).to_string()));
    tokens.extend(["he".to_string(), "hel".into(), "Ġw".into()]);
    let mut types = vec![3, 3];
    types.resize(tokens.len(), 1);
    let merges: Vec<String> = ["h e", "he l", "Ġ w"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let vocab = tokens.len() as u64;
    let kvs = vec![
        kv_str("general.architecture", "llama"),
        kv_u32("llama.block_count", 1),
        kv_u32("llama.context_length", 256),
        kv_u32("llama.embedding_length", H as u32),
        kv_u32("llama.feed_forward_length", FF as u32),
        kv_u32("llama.attention.head_count", 2),
        kv_u32("llama.attention.head_count_kv", 1),
        kv_f32("llama.rope.freq_base", 5000.0),
        kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-6),
        kv_str("tokenizer.ggml.model", "gpt2"),
        kv_str("tokenizer.ggml.pre", "smollm"),
        kv_str_array("tokenizer.ggml.tokens", &tokens),
        kv_str_array("tokenizer.ggml.merges", &merges),
        kv_i32_array("tokenizer.ggml.token_type", &types),
        kv_u32("tokenizer.ggml.bos_token_id", 1),
        kv_u32("tokenizer.ggml.eos_token_id", 0),
        kv_bool("tokenizer.ggml.add_bos_token", true),
    ];
    let tensors = vec![
        q8_tensor("token_embd.weight", &[H, vocab]),
        f32_tensor("output_norm.weight", &[H], |i| i as f32 * 0.5),
        f32_tensor("blk.0.attn_norm.weight", &[H], |_| 1.0),
        f32_tensor("blk.0.ffn_norm.weight", &[H], |_| 2.0),
        q8_tensor("blk.0.attn_q.weight", &[H, H]),
        q8_tensor("blk.0.attn_k.weight", &[H, 16]),
        q8_tensor("blk.0.attn_v.weight", &[H, 16]),
        q8_tensor("blk.0.attn_output.weight", &[H, H]),
        q8_tensor("blk.0.ffn_gate.weight", &[H, FF]),
        q8_tensor("blk.0.ffn_up.weight", &[H, FF]),
        q8_tensor("blk.0.ffn_down.weight", &[FF, H]),
        f32_tensor("output.weight", &[H, vocab], |i| i as f32),
    ];
    (kvs, tensors)
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn tiny_gguf_loads_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let (kvs, tensors) = tiny_model();
    let path = write(dir.path(), "tiny.gguf", &build_gguf(3, &kvs, &tensors));
    let model = load_model(&path).unwrap();
    let c = &model.config;
    assert_eq!(
        (c.num_layers, c.hidden_size, c.head_dim, c.num_kv_heads),
        (1, 32, 16, 1)
    );
    assert_eq!(c.vocab_size, 261);
    assert_eq!(c.rope_theta, 5000.0);
    assert!(!c.tied_embeddings, "output.weight is present");
    assert_eq!(
        model.weights.vector_f32("output_norm.weight").unwrap()[3],
        1.5
    );
    let out = model.weights.matrix("output.weight").unwrap();
    assert_eq!(
        (out.format, out.rows, out.cols),
        (WeightFormat::F32, 261, 32)
    );
    let q = model.weights.matrix("blk.0.attn_k.weight").unwrap();
    assert_eq!((q.format, q.rows, q.cols), (WeightFormat::Q8_0, 16, 32));

    // add_bos_token = true: BOS is prepended; "hel" is merged; specials are parsed.
    let tok = &model.tokenizer;
    let hel = tok.token_id("hel").unwrap();
    assert_eq!(tok.encode("hel", true).unwrap(), vec![1, hel]);
    let ids = tok.encode("<|endoftext|>hel w", true).unwrap();
    assert_eq!(ids, vec![1, 0, hel, tok.token_id("Ġw").unwrap()]);
    assert_eq!(tok.decode(&ids, true), "hel w");
    assert_eq!(tok.chat_template(), None);

    // A different file gives a different fingerprint; the same file the same one.
    let mut other = tensors;
    other[1] = f32_tensor("output_norm.weight", &[H], |_| 0.0);
    let path2 = write(dir.path(), "tiny2.gguf", &build_gguf(3, &kvs, &other));
    assert_ne!(load_model(&path2).unwrap().fingerprint, model.fingerprint);
    assert_eq!(load_model(&path).unwrap().fingerprint, model.fingerprint);
    assert_eq!(
        ModelText::read(&path).unwrap().fingerprint,
        model.fingerprint
    );
    assert_eq!(ModelText::read(&path).unwrap().max_context, 256);
}

#[test]
fn version_2_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let (kvs, tensors) = tiny_model();
    let path = write(dir.path(), "v2.gguf", &build_gguf(2, &kvs, &tensors));
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.version, 2);
    assert_eq!(g.get("llama.block_count"), Some(&GgufValue::U32(1)));
}

/// Opens `bytes` as a GGUF file and returns the error, which must name the file.
fn open_err(bytes: &[u8]) -> ModelFileError {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "bad.gguf", bytes);
    let err = GgufFile::open(&path).expect_err("corrupt file must not open");
    assert!(
        err.to_string().contains("bad.gguf"),
        "error does not name the file: {err}"
    );
    err
}

#[test]
fn corrupt_headers_give_specific_errors() {
    let (kvs, tensors) = tiny_model();
    let good = build_gguf(3, &kvs, &tensors);

    assert!(matches!(open_err(b""), ModelFileError::Truncated { .. }));
    assert!(matches!(
        open_err(b"GGML\x03\0\0\0"),
        ModelFileError::BadMagic { .. }
    ));
    assert!(matches!(
        open_err(&build_gguf(1, &kvs, &tensors)),
        ModelFileError::UnsupportedVersion { version: 1, .. }
    ));
    assert!(matches!(
        open_err(&good[..20]),
        ModelFileError::Truncated { .. }
    ));

    // Counts far beyond the file size are refused before anything is allocated.
    let mut huge_kv = good.clone();
    huge_kv[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        open_err(&huge_kv),
        ModelFileError::CountTooLarge { .. }
    ));
    let mut huge_tensors = good.clone();
    huge_tensors[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(matches!(
        open_err(&huge_tensors),
        ModelFileError::CountTooLarge { .. }
    ));

    let huge_string = build_gguf(
        3,
        &[Kv("k".into(), 8, u64::MAX.to_le_bytes().to_vec())],
        &[],
    );
    assert!(
        matches!(open_err(&huge_string), ModelFileError::Truncated { what, .. } if what.contains("`k`"))
    );

    let mut arr = 4u32.to_le_bytes().to_vec();
    arr.extend((1u64 << 60).to_le_bytes());
    let huge_array = build_gguf(3, &[Kv("arr".into(), 9, arr)], &[]);
    assert!(
        matches!(open_err(&huge_array), ModelFileError::CountTooLarge { what, .. } if what.contains("`arr`"))
    );

    let unknown_type = build_gguf(3, &[Kv("k".into(), 13, vec![0; 8])], &[]);
    assert!(matches!(
        open_err(&unknown_type),
        ModelFileError::UnknownValueType { type_id: 13, .. }
    ));

    let bad_utf8 = build_gguf(
        3,
        &[Kv(
            "k".into(),
            8,
            [&2u64.to_le_bytes()[..], &[0xff, 0xfe]].concat(),
        )],
        &[],
    );
    assert!(matches!(
        open_err(&bad_utf8),
        ModelFileError::InvalidUtf8 { .. }
    ));

    let dup = build_gguf(3, &[kv_u32("k", 1), kv_u32("k", 2)], &[]);
    assert!(matches!(open_err(&dup), ModelFileError::DuplicateKey { key, .. } if key == "k"));

    // Arrays of arrays of arrays.
    let mut nested = 9u32.to_le_bytes().to_vec();
    nested.extend(1u64.to_le_bytes());
    nested.extend(9u32.to_le_bytes());
    nested.extend(1u64.to_le_bytes());
    nested.extend(4u32.to_le_bytes());
    nested.extend(1u64.to_le_bytes());
    nested.extend(7u32.to_le_bytes());
    let nested = build_gguf(3, &[Kv("deep".into(), 9, nested)], &[]);
    assert!(matches!(
        open_err(&nested),
        ModelFileError::NestingTooDeep { .. }
    ));

    let align = build_gguf(3, &[kv_u32("general.alignment", 24)], &[]);
    assert!(matches!(
        open_err(&align),
        ModelFileError::BadAlignment { alignment: 24, .. }
    ));
}

#[test]
fn corrupt_tensor_tables_give_specific_errors() {
    let one = |t: Tensor| build_gguf(3, &[], &[t]);
    let t = |dims: &[u64], ty: u32, len: usize| Tensor {
        name: "w".into(),
        dims: dims.to_vec(),
        ty,
        data: vec![0; len],
        offset: None,
    };
    assert!(matches!(
        open_err(&one(t(&[4], 99, 16))),
        ModelFileError::UnknownTensorType { type_id: 99, tensor, .. } if tensor == "w"
    ));
    assert!(matches!(
        open_err(&one(t(&[1, 1, 1, 1, 1], 0, 4))),
        ModelFileError::BadTensorInfo { .. }
    ));
    // Q8_0 rows must be whole 32-element blocks.
    assert!(matches!(
        open_err(&one(t(&[33], 8, 64))),
        ModelFileError::BadTensorInfo { .. }
    ));
    // Declares more data than the file holds.
    assert!(matches!(
        open_err(&one(t(&[64, 2], 0, 16))),
        ModelFileError::TensorOutOfBounds { tensor, .. } if tensor == "w"
    ));
    // Element counts whose byte size overflows.
    assert!(matches!(
        open_err(&one(t(&[u64::MAX / 2, 4], 0, 4))),
        ModelFileError::BadTensorInfo { .. }
    ));
    let two = build_gguf(3, &[], &[t(&[4], 0, 16), t(&[4], 0, 16)]);
    assert!(matches!(
        open_err(&two),
        ModelFileError::DuplicateTensor { .. }
    ));

    // A data offset that breaks the alignment.
    let mut misaligned = t(&[8], 0, 32);
    misaligned.offset = Some(4);
    assert!(matches!(
        open_err(&one(misaligned)),
        ModelFileError::BadTensorInfo { reason, .. } if reason.contains("alignment")
    ));
}

#[test]
fn metadata_type_errors_name_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let (mut kvs, tensors) = tiny_model();
    kvs[1] = kv_str("llama.block_count", "thirty");
    let path = write(dir.path(), "typed.gguf", &build_gguf(3, &kvs, &tensors));
    let err = load_model(&path).unwrap_err();
    assert!(
        matches!(&err, LoadError::File(ModelFileError::WrongMetadataType { key, .. }) if key == "llama.block_count"),
        "{err}"
    );

    let (mut kvs, tensors) = tiny_model();
    kvs.remove(3); // llama.embedding_length
    let path = write(dir.path(), "missing.gguf", &build_gguf(3, &kvs, &tensors));
    let err = load_model(&path).unwrap_err();
    assert!(
        matches!(&err, LoadError::File(ModelFileError::MissingMetadata { key, .. }) if key == "llama.embedding_length"),
        "{err}"
    );

    let (mut kvs, tensors) = tiny_model();
    kvs[0] = kv_str("general.architecture", "mamba");
    let path = write(dir.path(), "arch.gguf", &build_gguf(3, &kvs, &tensors));
    assert!(matches!(
        load_model(&path).unwrap_err(),
        LoadError::UnsupportedArchitecture { .. }
    ));

    // A tensor with the wrong shape for the config is caught at load, by name.
    let (kvs, mut tensors) = tiny_model();
    tensors[5] = q8_tensor("blk.0.attn_k.weight", &[H, 32]);
    let path = write(dir.path(), "shape.gguf", &build_gguf(3, &kvs, &tensors));
    assert!(matches!(
        load_model(&path).unwrap_err(),
        LoadError::WrongTensorShape { name, .. } if name == "blk.0.attn_k.weight"
    ));

    let path = write(dir.path(), "notes.txt", b"hello, world");
    assert!(matches!(
        load_model(&path).unwrap_err(),
        LoadError::File(ModelFileError::UnknownFormat { .. })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Corrupting or truncating any bytes gives an error or a file, never a panic.
    #[test]
    fn mutated_files_never_panic(
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let (kvs, tensors) = tiny_model();
        let mut bytes = build_gguf(3, &kvs, &tensors);
        // Mutate the header region, where the parser reads.
        let header_len = bytes.len() - tensors.iter().map(|t| t.data.len()).sum::<usize>();
        for (at, value) in flips {
            let i = at.index(header_len);
            bytes[i] = value;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len()));
        }
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "fuzz.gguf", &bytes);
        if let Ok(model) = load_model(&path) {
            for name in model.weights.names() {
                let _ = model.weights.matrix(name);
                let _ = model.weights.vector_f32(name);
            }
        }
    }
}
