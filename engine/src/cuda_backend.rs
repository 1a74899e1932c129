//! The forward pass on a CUDA device: the same Llama-family step as `model::Forward`, on the
//! kernels' CUDA ops, over a KV cache in device memory laid out as the CPU's
//! (`[num_blocks, n_kv_heads, block_size, head_dim]` f16 per layer), so blocks move to and from
//! other nodes in the same transfer layout.
//!
//! Weights are uploaded once: their ggml bytes for the fused dequantizing GEMV (decode) and a
//! bf16 copy for cuBLAS (prefill). Not yet proven on a GPU (docs/gpu.md).

use crate::backend::Backend;
use crate::kv_blocks::{check_range, payload_len};
use crate::model::LlamaModel;
use crate::model_config::RopeStyle;
use crate::runner::{KvShape, KvSource, RunnerError, SeqChunk};
use kvmesh_common::BlockId;
use kvmesh_kernels::cuda::{CudaDevice, CudaError, CudaSlice, DeviceQMatrix, KvGeometry};
use std::ops::Range;
use std::sync::Arc;

struct DeviceLayer {
    attn_norm: CudaSlice<f32>,
    wqkv: DeviceQMatrix,
    qkv_bias: Option<CudaSlice<f32>>,
    wo: DeviceQMatrix,
    ffn_norm: CudaSlice<f32>,
    w_gate_up: DeviceQMatrix,
    w_down: DeviceQMatrix,
}

/// Device buffers of one step, grown to the largest step seen.
struct Scratch {
    x: CudaSlice<f32>,
    h: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    proj: CudaSlice<f32>,
    gate_up: CudaSlice<f32>,
    act: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    bf16: CudaSlice<u16>,
    /// Tokens handled by the buffers above.
    tokens: usize,
    /// Logits rows `logits` holds (grown apart: a long prefill asks for one row).
    logits_rows: usize,
}

pub struct CudaBackend {
    dev: CudaDevice,
    model: Arc<LlamaModel>,
    geo: KvGeometry,
    layers: Vec<DeviceLayer>,
    embed: DeviceQMatrix,
    /// `None` when tied to the embedding.
    lm_head: Option<DeviceQMatrix>,
    output_norm: CudaSlice<f32>,
    k: Vec<CudaSlice<u16>>,
    v: Vec<CudaSlice<u16>>,
    scratch: Option<Scratch>,
}

fn cuda(e: CudaError) -> RunnerError {
    RunnerError::Device(e.to_string())
}

impl CudaBackend {
    /// Uploads `model`'s weights and allocates a zeroed KV pool of `shape` on `dev`.
    pub fn new(dev: CudaDevice, model: Arc<LlamaModel>, shape: KvShape) -> Result<Self, CudaError> {
        let c = &model.config;
        let geo = KvGeometry {
            n_heads: c.num_heads,
            n_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size: shape.block_size,
            num_blocks: shape.num_blocks,
        };
        let mut layers = Vec::with_capacity(model.layers.len());
        for l in &model.layers {
            layers.push(DeviceLayer {
                attn_norm: dev.upload(&l.attn_norm)?,
                wqkv: dev.upload_matrix(&l.wqkv)?,
                qkv_bias: l.qkv_bias.as_deref().map(|b| dev.upload(b)).transpose()?,
                wo: dev.upload_matrix(&l.wo)?,
                ffn_norm: dev.upload(&l.ffn_norm)?,
                w_gate_up: dev.upload_matrix(&l.w_gate_up)?,
                w_down: dev.upload_matrix(&l.w_down)?,
            });
        }
        let per_layer = geo.block_elems() * geo.num_blocks;
        let mut k = Vec::with_capacity(c.num_layers);
        let mut v = Vec::with_capacity(c.num_layers);
        for _ in 0..c.num_layers {
            k.push(dev.zeros::<u16>(per_layer)?);
            v.push(dev.zeros::<u16>(per_layer)?);
        }
        Ok(CudaBackend {
            embed: dev.upload_matrix(&model.embed)?,
            lm_head: model
                .lm_head
                .as_ref()
                .map(|m| dev.upload_matrix(m))
                .transpose()?,
            output_norm: dev.upload(&model.output_norm)?,
            dev,
            model,
            geo,
            layers,
            k,
            v,
            scratch: None,
        })
    }

    /// The step buffers for `n` tokens (and up to `n` logits rows).
    fn scratch(&mut self, n: usize) -> Result<Scratch, CudaError> {
        if let Some(s) = self.scratch.take() {
            if s.tokens >= n {
                return Ok(s);
            }
        }
        let c = &self.model.config;
        let n = n.next_power_of_two();
        let qkv_dim = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim;
        // The bf16 copy of a GEMM's activations: its widest input.
        let widest = [c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size]
            .into_iter()
            .max()
            .unwrap_or(0);
        let d = &self.dev;
        Ok(Scratch {
            x: d.zeros(n * c.hidden_size)?,
            h: d.zeros(n * c.hidden_size)?,
            qkv: d.zeros(n * qkv_dim)?,
            attn: d.zeros(n * c.num_heads * c.head_dim)?,
            proj: d.zeros(n * c.hidden_size)?,
            gate_up: d.zeros(n * 2 * c.intermediate_size)?,
            act: d.zeros(n * c.intermediate_size)?,
            logits: d.zeros(c.vocab_size)?,
            bf16: d.zeros(n * widest)?,
            tokens: n,
            logits_rows: 1,
        })
    }

    fn forward(
        &mut self,
        chunks: &[SeqChunk],
        on_layer: &mut (dyn FnMut(usize, &dyn KvSource) + Send),
    ) -> Result<Vec<Vec<f32>>, CudaError> {
        let c = self.model.config.clone();
        let (hs, hd) = (c.hidden_size, c.head_dim);
        let (q_dim, kv_dim) = (c.num_heads * hd, c.num_kv_heads * hd);
        let qkv_dim = q_dim + 2 * kv_dim;
        let inter = c.intermediate_size;
        let bs = self.geo.block_size;
        // The step's index arrays: per token its id, position and cache slot; per token the
        // offset of its sequence's block table in `tables`.
        let n: usize = chunks.iter().map(|ch| ch.tokens.len()).sum();
        let (mut tokens, mut pos, mut slots, mut row_table, mut tables) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::new(),
        );
        for ch in chunks {
            let at = tables.len() as i32;
            tables.extend(ch.block_table.iter().map(|b| b.0 as i32));
            for (i, &t) in ch.tokens.iter().enumerate() {
                let p = ch.start_pos + i;
                tokens.push(t as i32);
                pos.push(p as i32);
                slots.push(ch.block_table[p / bs].0 as i32 * bs as i32 + (p % bs) as i32);
                row_table.push(at);
            }
        }
        let mut s = self.scratch(n)?;
        let d = &self.dev;
        let (tokens, pos, slots, row_table, tables) = (
            d.upload(&tokens)?,
            d.upload(&pos)?,
            d.upload(&slots)?,
            d.upload(&row_table)?,
            d.upload(&tables)?,
        );
        let interleaved = c.rope_style == RopeStyle::Interleaved;
        d.embed(&self.embed, &tokens.slice(..), n, &mut s.x.slice_mut(..))?;
        for (li, l) in self.layers.iter().enumerate() {
            d.rmsnorm(
                &s.x.slice(..),
                &l.attn_norm,
                c.rms_norm_eps,
                n,
                &mut s.h.slice_mut(..),
            )?;
            d.matmul(
                &l.wqkv,
                &s.h.slice(..),
                n,
                &mut s.qkv.slice_mut(..),
                &mut s.bf16,
            )?;
            if let Some(b) = &l.qkv_bias {
                d.add_rows(&mut s.qkv.slice_mut(..n * qkv_dim), b, n)?;
            }
            let base = c.rope_theta;
            d.rope(
                &mut s.qkv.slice_mut(..),
                &pos.slice(..),
                n,
                qkv_dim,
                c.num_heads,
                hd,
                base,
                interleaved,
            )?;
            d.rope(
                &mut s.qkv.slice_mut(q_dim..),
                &pos.slice(..),
                n,
                qkv_dim,
                c.num_kv_heads,
                hd,
                base,
                interleaved,
            )?;
            d.kv_append(
                &self.geo,
                &s.qkv.slice(q_dim..),
                &s.qkv.slice(q_dim + kv_dim..),
                qkv_dim,
                &slots.slice(..),
                n,
                &mut self.k[li],
                &mut self.v[li],
            )?;
            on_layer(
                li,
                &DeviceKv {
                    dev: d,
                    geo: self.geo,
                    k: &self.k,
                    v: &self.v,
                },
            );
            d.attention(
                &self.geo,
                &s.qkv.slice(..),
                qkv_dim,
                &pos.slice(..),
                &row_table.slice(..),
                &tables.slice(..),
                n,
                &self.k[li],
                &self.v[li],
                &mut s.attn.slice_mut(..),
                q_dim,
            )?;
            d.matmul(
                &l.wo,
                &s.attn.slice(..),
                n,
                &mut s.proj.slice_mut(..),
                &mut s.bf16,
            )?;
            d.add(&mut s.x.slice_mut(..), &s.proj.slice(..), n * hs)?;
            d.rmsnorm(
                &s.x.slice(..),
                &l.ffn_norm,
                c.rms_norm_eps,
                n,
                &mut s.h.slice_mut(..),
            )?;
            d.matmul(
                &l.w_gate_up,
                &s.h.slice(..),
                n,
                &mut s.gate_up.slice_mut(..),
                &mut s.bf16,
            )?;
            d.silu_mul(&s.gate_up.slice(..), inter, n, &mut s.act.slice_mut(..))?;
            d.matmul(
                &l.w_down,
                &s.act.slice(..),
                n,
                &mut s.proj.slice_mut(..),
                &mut s.bf16,
            )?;
            d.add(&mut s.x.slice_mut(..), &s.proj.slice(..), n * hs)?;
        }
        // Only the rows that end a chunk asking for logits go through the LM head: gathered
        // into `h` by device copies.
        let mut m = 0;
        let mut end = 0;
        for ch in chunks {
            end += ch.tokens.len();
            if ch.want_logits {
                d.copy_within(
                    &s.x.slice((end - 1) * hs..end * hs),
                    &mut s.proj.slice_mut(m * hs..(m + 1) * hs),
                )?;
                m += 1;
            }
        }
        if m == 0 {
            self.scratch = Some(s);
            return Ok(Vec::new());
        }
        d.rmsnorm(
            &s.proj.slice(..),
            &self.output_norm,
            c.rms_norm_eps,
            m,
            &mut s.h.slice_mut(..),
        )?;
        if s.logits_rows < m {
            s.logits = d.zeros(m * c.vocab_size)?;
            s.logits_rows = m;
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        d.matmul(
            head,
            &s.h.slice(..),
            m,
            &mut s.logits.slice_mut(..),
            &mut s.bf16,
        )?;
        let mut host = Vec::new();
        d.download(&s.logits.slice(..m * c.vocab_size), &mut host)?;
        self.scratch = Some(s);
        Ok(host
            .chunks_exact(c.vocab_size)
            .map(<[f32]>::to_vec)
            .collect())
    }
}

/// Reads device KV blocks into the transfer layout: packed on the device, then one copy back.
struct DeviceKv<'a> {
    dev: &'a CudaDevice,
    geo: KvGeometry,
    k: &'a [CudaSlice<u16>],
    v: &'a [CudaSlice<u16>],
}

impl DeviceKv<'_> {
    fn shape(&self) -> KvShape {
        KvShape {
            num_layers: self.k.len(),
            num_kv_heads: self.geo.n_kv_heads,
            head_dim: self.geo.head_dim,
            block_size: self.geo.block_size,
            num_blocks: self.geo.num_blocks,
        }
    }

    fn pack(&self, layer: usize, blocks: &[BlockId], out: &mut Vec<u8>) -> Result<(), CudaError> {
        if blocks.is_empty() {
            return Ok(());
        }
        let ids: Vec<i32> = blocks.iter().map(|b| b.0 as i32).collect();
        let ids = self.dev.upload(&ids)?;
        let mut packed = self
            .dev
            .zeros::<u16>(2 * blocks.len() * self.geo.block_elems())?;
        self.dev.kv_pack(
            &self.geo,
            &self.k[layer],
            &self.v[layer],
            &ids.slice(..),
            blocks.len(),
            &mut packed.slice_mut(..),
        )?;
        let mut host = Vec::new();
        self.dev.download(&packed.slice(..), &mut host)?;
        out.extend_from_slice(bytemuck::cast_slice(&host));
        Ok(())
    }
}

impl KvSource for DeviceKv<'_> {
    fn read_kv_blocks(
        &self,
        layer: usize,
        blocks: &[BlockId],
        out: &mut Vec<u8>,
    ) -> Result<(), RunnerError> {
        check_range(&self.shape(), layer..layer + 1, blocks)?;
        self.pack(layer, blocks, out).map_err(cuda)
    }
}

impl KvSource for CudaBackend {
    fn read_kv_blocks(
        &self,
        layer: usize,
        blocks: &[BlockId],
        out: &mut Vec<u8>,
    ) -> Result<(), RunnerError> {
        DeviceKv {
            dev: &self.dev,
            geo: self.geo,
            k: &self.k,
            v: &self.v,
        }
        .read_kv_blocks(layer, blocks, out)
    }
}

impl Backend for CudaBackend {
    fn run(
        &mut self,
        chunks: &[SeqChunk],
        on_layer: &mut (dyn FnMut(usize, &dyn KvSource) + Send),
    ) -> Result<Vec<Vec<f32>>, RunnerError> {
        self.forward(chunks, on_layer).map_err(cuda)
    }

    fn write_kv_blocks(
        &mut self,
        layers: Range<usize>,
        blocks: &[BlockId],
        payload: &[u8],
    ) -> Result<(), RunnerError> {
        let shape = DeviceKv {
            dev: &self.dev,
            geo: self.geo,
            k: &self.k,
            v: &self.v,
        }
        .shape();
        check_range(&shape, layers.clone(), blocks)?;
        let expected = payload_len(&shape, layers.len(), blocks.len());
        if payload.len() != expected {
            return Err(RunnerError::KvPayloadSize {
                expected,
                got: payload.len(),
            });
        }
        if blocks.is_empty() {
            return Ok(());
        }
        let halves: Vec<u16> = payload
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        let per_layer = 2 * blocks.len() * self.geo.block_elems();
        let ids: Vec<i32> = blocks.iter().map(|b| b.0 as i32).collect();
        let d = &self.dev;
        let ids = d.upload(&ids).map_err(cuda)?;
        let payload = d.upload(&halves).map_err(cuda)?;
        for (i, layer) in layers.enumerate() {
            d.kv_unpack(
                &self.geo,
                &payload.slice(i * per_layer..(i + 1) * per_layer),
                &ids.slice(..),
                blocks.len(),
                &mut self.k[layer],
                &mut self.v[layer],
            )
            .map_err(cuda)?;
        }
        d.synchronize().map_err(cuda)
    }
}
