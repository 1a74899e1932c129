//! `Weights`: the model's tensors under GGUF names, whatever file format they came from.
//! Data stays in the memory maps until the forward pass asks for a matrix or vector.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};
use kvmesh_kernels::{QMatrix, WeightFormat};
use memmap2::Mmap;

use kvmesh_prompt::gguf::{GgmlType, GgufFile};

use super::error::LoadError;
use crate::model_config::ModelConfig;

/// The kernels' format for a ggml type, if the kernels implement it.
pub fn weight_format(ty: GgmlType) -> Option<WeightFormat> {
    Some(match ty {
        GgmlType::F32 => WeightFormat::F32,
        GgmlType::F16 => WeightFormat::F16,
        GgmlType::BF16 => WeightFormat::BF16,
        GgmlType::Q8_0 => WeightFormat::Q8_0,
        GgmlType::Q4_0 => WeightFormat::Q4_0,
        GgmlType::Q4_1 => WeightFormat::Q4_1,
        GgmlType::Q4_K => WeightFormat::Q4_K,
        GgmlType::Q6_K => WeightFormat::Q6_K,
        _ => return None,
    })
}

/// Where one tensor lives and how it is stored.
#[derive(Clone, Debug, PartialEq)]
pub struct WeightTensor {
    /// `None` when the file's type has no kernel implementation (see `type_name`).
    pub format: Option<WeightFormat>,
    /// The storage type as the file names it, e.g. "Q4_1" or "BF16".
    pub type_name: &'static str,
    /// ggml order: `dims[0]` is the contiguous (input) dimension, `dims[1]` the rows.
    pub dims: Vec<usize>,
    source: usize,
    range: Range<usize>,
}

/// All tensors of a model, keyed by GGUF tensor name (`blk.{i}.attn_q.weight`, ...).
pub struct Weights {
    /// The model file or checkpoint directory, for error messages.
    origin: PathBuf,
    sources: Vec<Arc<Mmap>>,
    tensors: BTreeMap<String, WeightTensor>,
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Weights")
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl Weights {
    pub(crate) fn new(origin: &Path) -> Self {
        Weights {
            origin: origin.to_path_buf(),
            sources: Vec::new(),
            tensors: BTreeMap::new(),
        }
    }

    pub(crate) fn from_gguf(gguf: &GgufFile) -> Self {
        let mut w = Weights::new(&gguf.path);
        let src = w.add_source(gguf.mmap().clone());
        for t in &gguf.tensors {
            let start = t.offset as usize;
            w.insert(
                t.name.clone(),
                weight_format(t.ggml_type),
                t.ggml_type.name(),
                t.dims.iter().map(|&d| d as usize).collect(),
                src,
                start..start + t.size as usize,
            );
        }
        w
    }

    pub(crate) fn add_source(&mut self, map: Arc<Mmap>) -> usize {
        self.sources.push(map);
        self.sources.len() - 1
    }

    /// `range` must lie inside source `source`; the loaders check it against the file.
    pub(crate) fn insert(
        &mut self,
        name: String,
        format: Option<WeightFormat>,
        type_name: &'static str,
        dims: Vec<usize>,
        source: usize,
        range: Range<usize>,
    ) {
        debug_assert!(range.end <= self.sources[source].len());
        self.tensors.insert(
            name,
            WeightTensor {
                format,
                type_name,
                dims,
                source,
                range,
            },
        );
    }

    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    pub fn info(&self, name: &str) -> Result<&WeightTensor, LoadError> {
        self.tensors
            .get(name)
            .ok_or_else(|| LoadError::MissingTensor {
                path: self.origin.clone(),
                name: name.into(),
            })
    }

    /// The stored bytes, borrowed from the memory map.
    pub fn bytes(&self, name: &str) -> Result<&[u8], LoadError> {
        let t = self.info(name)?;
        Ok(&self.sources[t.source][t.range.clone()])
    }

    /// A 2-D weight as `rows = dims[1]` output features by `cols = dims[0]` inputs.
    pub fn matrix(&self, name: &str) -> Result<QMatrix, LoadError> {
        let t = self.info(name)?;
        let format = self.supported(name, t)?;
        let (cols, rows) = match t.dims[..] {
            [cols, rows, ref rest @ ..] if rest.iter().all(|&d| d == 1) => (cols, rows),
            _ => return Err(self.wrong_shape(name, t, "a matrix [cols, rows]".into())),
        };
        QMatrix::new(format, rows, cols, self.bytes(name)?.to_vec()).map_err(|source| {
            LoadError::Quant {
                name: name.into(),
                source,
            }
        })
    }

    /// A 1-D F32/F16/BF16 tensor (norm weights, biases) as f32.
    pub fn vector_f32(&self, name: &str) -> Result<Vec<f32>, LoadError> {
        let t = self.info(name)?;
        if t.dims.iter().skip(1).any(|&d| d != 1) {
            return Err(self.wrong_shape(name, t, "a vector".into()));
        }
        let bytes = self.bytes(name)?;
        let halves = || {
            bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
        };
        Ok(match self.supported(name, t)? {
            WeightFormat::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            WeightFormat::F16 => halves().map(|h| f16::from_bits(h).to_f32()).collect(),
            WeightFormat::BF16 => halves().map(|h| bf16::from_bits(h).to_f32()).collect(),
            _ => {
                return Err(LoadError::UnsupportedTensorFormat {
                    path: self.origin.clone(),
                    name: name.into(),
                    format: format!("{} (vectors must be F32, F16 or BF16)", t.type_name),
                })
            }
        })
    }

    /// Checks that every tensor the Llama forward pass reads exists with the shape
    /// `config` implies, so a bad checkpoint fails at load with the tensor's name.
    pub fn check_llama_shapes(&self, config: &ModelConfig) -> Result<(), LoadError> {
        let h = config.hidden_size;
        let q = config.num_heads * config.head_dim;
        let kv = config.num_kv_heads * config.head_dim;
        let ff = config.intermediate_size;
        let v = config.vocab_size;
        let mut expect: Vec<(String, Vec<usize>)> = vec![
            ("token_embd.weight".into(), vec![h, v]),
            ("output_norm.weight".into(), vec![h]),
        ];
        if !config.tied_embeddings {
            expect.push(("output.weight".into(), vec![h, v]));
        }
        for i in 0..config.num_layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            expect.extend([
                (n("attn_norm.weight"), vec![h]),
                (n("attn_q.weight"), vec![h, q]),
                (n("attn_k.weight"), vec![h, kv]),
                (n("attn_v.weight"), vec![h, kv]),
                (n("attn_output.weight"), vec![q, h]),
                (n("ffn_norm.weight"), vec![h]),
                (n("ffn_gate.weight"), vec![h, ff]),
                (n("ffn_up.weight"), vec![h, ff]),
                (n("ffn_down.weight"), vec![ff, h]),
            ]);
            if config.qkv_bias {
                expect.extend([
                    (n("attn_q.bias"), vec![q]),
                    (n("attn_k.bias"), vec![kv]),
                    (n("attn_v.bias"), vec![kv]),
                ]);
            }
        }
        for (name, dims) in expect {
            let t = self.info(&name)?;
            if t.dims != dims {
                return Err(self.wrong_shape(&name, t, format!("{dims:?}")));
            }
        }
        Ok(())
    }

    fn supported(&self, name: &str, t: &WeightTensor) -> Result<WeightFormat, LoadError> {
        t.format.ok_or_else(|| LoadError::UnsupportedTensorFormat {
            path: self.origin.clone(),
            name: name.into(),
            format: t.type_name.into(),
        })
    }

    fn wrong_shape(&self, name: &str, t: &WeightTensor, expected: String) -> LoadError {
        LoadError::WrongTensorShape {
            path: self.origin.clone(),
            name: name.into(),
            shape: t.dims.clone(),
            expected,
        }
    }
}
