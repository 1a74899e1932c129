//! The Llama-family forward pass (Llama, Qwen2: GQA, RoPE, SwiGLU, optional QKV bias, tied
//! embeddings) over a paged f16 KV cache, on the kernels CPU backend (the CUDA one is
//! `cuda_backend`; both behind `backend::Backend`).

use crate::gguf::{LoadError, Weights};
use crate::model_config::{ModelConfig, RopeStyle};
use crate::runner::{KvShape, RunnerError, SeqChunk};
use half::f16;
use kvmesh_kernels::cpu::{self, AttentionSeq, AttentionShape};
use kvmesh_kernels::QMatrix;

pub(crate) struct Layer {
    pub(crate) attn_norm: Vec<f32>,
    /// q | k | v projections fused into one matrix: one pass over the activations.
    pub(crate) wqkv: QMatrix,
    pub(crate) qkv_bias: Option<Vec<f32>>,
    pub(crate) wo: QMatrix,
    pub(crate) ffn_norm: Vec<f32>,
    /// gate | up fused.
    pub(crate) w_gate_up: QMatrix,
    pub(crate) w_down: QMatrix,
}

/// Immutable weights; shared by every runner of a process.
pub struct LlamaModel {
    pub config: ModelConfig,
    pub(crate) embed: QMatrix,
    pub(crate) layers: Vec<Layer>,
    pub(crate) output_norm: Vec<f32>,
    /// `None` when tied to the embedding.
    pub(crate) lm_head: Option<QMatrix>,
}

fn concat(name: &str, parts: &[QMatrix]) -> Result<QMatrix, LoadError> {
    QMatrix::concat_rows(parts).map_err(|source| LoadError::Quant {
        name: name.to_string(),
        source,
    })
}

impl LlamaModel {
    /// Builds the model from weights the loader has already shape-checked against `config`.
    pub fn load(config: ModelConfig, w: &Weights) -> Result<Self, LoadError> {
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            let wqkv = concat(
                &n("attn_qkv"),
                &[
                    w.matrix(&n("attn_q.weight"))?,
                    w.matrix(&n("attn_k.weight"))?,
                    w.matrix(&n("attn_v.weight"))?,
                ],
            )?;
            let qkv_bias = if config.qkv_bias {
                let mut b = w.vector_f32(&n("attn_q.bias"))?;
                b.extend(w.vector_f32(&n("attn_k.bias"))?);
                b.extend(w.vector_f32(&n("attn_v.bias"))?);
                Some(b)
            } else {
                None
            };
            let w_gate_up = concat(
                &n("ffn_gate_up"),
                &[
                    w.matrix(&n("ffn_gate.weight"))?,
                    w.matrix(&n("ffn_up.weight"))?,
                ],
            )?;
            layers.push(Layer {
                attn_norm: w.vector_f32(&n("attn_norm.weight"))?,
                wqkv,
                qkv_bias,
                wo: w.matrix(&n("attn_output.weight"))?,
                ffn_norm: w.vector_f32(&n("ffn_norm.weight"))?,
                w_gate_up,
                w_down: w.matrix(&n("ffn_down.weight"))?,
            });
        }
        let lm_head = if config.tied_embeddings || !w.has("output.weight") {
            None
        } else {
            Some(w.matrix("output.weight")?)
        };
        Ok(LlamaModel {
            embed: w.matrix("token_embd.weight")?,
            output_norm: w.vector_f32("output_norm.weight")?,
            layers,
            lm_head,
            config,
        })
    }

    pub(crate) fn lm_head(&self) -> &QMatrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    fn attention_shape(&self, block_size: usize) -> AttentionShape {
        AttentionShape {
            n_heads: self.config.num_heads,
            n_kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
            block_size,
        }
    }
}

/// Paged KV storage for every layer: `[num_blocks, n_kv_heads, block_size, head_dim]` f16.
pub struct KvCache {
    pub shape: KvShape,
    pub k: Vec<Vec<f16>>,
    pub v: Vec<Vec<f16>>,
}

impl KvCache {
    pub fn new(shape: KvShape) -> Self {
        let per_layer = shape.num_blocks * shape.num_kv_heads * shape.block_size * shape.head_dim;
        KvCache {
            shape,
            k: vec![vec![f16::ZERO; per_layer]; shape.num_layers],
            v: vec![vec![f16::ZERO; per_layer]; shape.num_layers],
        }
    }

    /// Elements of one block in one layer's K (or V) buffer.
    pub fn block_elems(&self) -> usize {
        self.shape.num_kv_heads * self.shape.block_size * self.shape.head_dim
    }
}

/// Reusable activation buffers, grown to the largest step seen.
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    qkv: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    /// LM head output; reused, as a fresh `[m, vocab]` buffer faults in megabytes a step.
    logits: Vec<f32>,
    last_rows: Vec<f32>,
}

fn sized(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    buf.resize(len, 0.0);
    &mut buf[..len]
}

/// Runs forward passes of one model over one KV cache.
pub struct Forward {
    scratch: Scratch,
}

impl Default for Forward {
    fn default() -> Self {
        Self::new()
    }
}

impl Forward {
    pub fn new() -> Self {
        Forward {
            scratch: Scratch::default(),
        }
    }

    /// Computes `chunks` (already validated), writing their KV, and returns the logits of
    /// the last token of every chunk with `want_logits`, in order. `on_layer(l, kv)` runs as
    /// soon as layer `l`'s KV for this step is written, so a transfer of that layer can
    /// overlap the layers still to compute.
    pub fn run(
        &mut self,
        model: &LlamaModel,
        kv: &mut KvCache,
        chunks: &[SeqChunk],
        on_layer: &mut dyn FnMut(usize, &KvCache),
    ) -> Result<Vec<Vec<f32>>, RunnerError> {
        let c = &model.config;
        let (hs, hd) = (c.hidden_size, c.head_dim);
        let (q_dim, kv_dim) = (c.num_heads * hd, c.num_kv_heads * hd);
        let n: usize = chunks.iter().map(|ch| ch.tokens.len()).sum();
        let shape = model.attention_shape(kv.shape.block_size);
        let tables: Vec<Vec<u32>> = chunks
            .iter()
            .map(|ch| ch.block_table.iter().map(|b| b.0).collect())
            .collect();
        let mut positions = Vec::with_capacity(n);
        for ch in chunks {
            positions.extend(ch.start_pos..ch.start_pos + ch.tokens.len());
        }
        let rope_table = cpu::rope_table(&positions, hd, c.rope_theta);
        let s = &mut self.scratch;

        let x = sized(&mut s.x, n * hs);
        for (row, &tok) in x
            .chunks_exact_mut(hs)
            .zip(chunks.iter().flat_map(|ch| &ch.tokens))
        {
            model.embed.dequantize_row(tok as usize, row);
        }

        for (li, layer) in model.layers.iter().enumerate() {
            let h = sized(&mut s.h, n * hs);
            cpu::rmsnorm(&s.x, &layer.attn_norm, c.rms_norm_eps, h);
            let qkv_dim = q_dim + 2 * kv_dim;
            let qkv = sized(&mut s.qkv, n * qkv_dim);
            cpu::matmul(&layer.wqkv, h, n, qkv);
            if let Some(bias) = &layer.qkv_bias {
                for row in qkv.chunks_exact_mut(qkv_dim) {
                    cpu::add_in_place(row, bias);
                }
            }
            let (q, k, v) = (
                sized(&mut s.q, n * q_dim),
                sized(&mut s.k, n * kv_dim),
                sized(&mut s.v, n * kv_dim),
            );
            for (t, row) in qkv.chunks_exact(qkv_dim).enumerate() {
                q[t * q_dim..(t + 1) * q_dim].copy_from_slice(&row[..q_dim]);
                k[t * kv_dim..(t + 1) * kv_dim].copy_from_slice(&row[q_dim..q_dim + kv_dim]);
                v[t * kv_dim..(t + 1) * kv_dim].copy_from_slice(&row[q_dim + kv_dim..]);
            }
            let interleaved = c.rope_style == RopeStyle::Interleaved;
            cpu::rope_with(q, &rope_table, c.num_heads, hd, interleaved);
            cpu::rope_with(k, &rope_table, c.num_kv_heads, hd, interleaved);

            let mut offset = 0;
            let mut seqs = Vec::with_capacity(chunks.len());
            for (ch, table) in chunks.iter().zip(&tables) {
                let rows = offset..offset + ch.tokens.len();
                cpu::write_kv(
                    &shape,
                    table,
                    ch.start_pos,
                    &k[rows.start * kv_dim..rows.end * kv_dim],
                    &v[rows.start * kv_dim..rows.end * kv_dim],
                    &mut kv.k[li],
                    &mut kv.v[li],
                );
                seqs.push(AttentionSeq {
                    q_offset: offset,
                    n_q: ch.tokens.len(),
                    start_pos: ch.start_pos,
                    block_table: table,
                });
                offset = rows.end;
            }
            on_layer(li, kv);
            let attn = sized(&mut s.attn, n * q_dim);
            cpu::paged_attention(&shape, &seqs, q, &kv.k[li], &kv.v[li], attn);
            let proj = sized(&mut s.proj, n * hs);
            cpu::matmul(&layer.wo, attn, n, proj);
            cpu::add_in_place(&mut s.x, proj);

            let h = sized(&mut s.h, n * hs);
            cpu::rmsnorm(&s.x, &layer.ffn_norm, c.rms_norm_eps, h);
            let inter = c.intermediate_size;
            let gate_up = sized(&mut s.gate_up, n * 2 * inter);
            cpu::matmul(&layer.w_gate_up, h, n, gate_up);
            let act = sized(&mut s.act, n * inter);
            cpu::silu_mul(gate_up, inter, act);
            let proj = sized(&mut s.proj, n * hs);
            cpu::matmul(&layer.w_down, act, n, proj);
            cpu::add_in_place(&mut s.x, proj);
        }

        // Only the rows that end a chunk asking for logits go through the (large) LM head.
        let last_rows = &mut s.last_rows;
        last_rows.clear();
        let mut end = 0;
        for ch in chunks {
            end += ch.tokens.len();
            if ch.want_logits {
                last_rows.extend_from_slice(&s.x[(end - 1) * hs..end * hs]);
            }
        }
        let m = last_rows.len() / hs;
        if m == 0 {
            return Ok(Vec::new());
        }
        let h = sized(&mut s.h, m * hs);
        cpu::rmsnorm(last_rows, &model.output_norm, c.rms_norm_eps, h);
        let vocab = c.vocab_size;
        let logits = sized(&mut s.logits, m * vocab);
        cpu::matmul(model.lm_head(), h, m, logits);
        Ok(logits.chunks_exact(vocab).map(<[f32]>::to_vec).collect())
    }
}
