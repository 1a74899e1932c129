//! The forward pass on a CUDA device: the same Llama-family step as `model::Forward`, on the
//! kernels' CUDA ops, over a KV cache in device memory laid out as the CPU's
//! (`[num_blocks, n_kv_heads, block_size, head_dim]` f16 per layer), so blocks move to and from
//! other nodes in the same transfer layout.
//!
//! Weights are uploaded once: their ggml bytes (the embedding gather, the reference GEMV), for
//! the int8 GEMV of decode the same bits split into quants and scales, and a bf16 copy for
//! cuBLAS (prefill). A step follows `cuda_plan::kv_pipeline`: each layer's KV
//! is read out for the observer on the copy stream while the next layer computes. With
//! `RunnerOptions::cuda_graphs`, decode steps replay a graph per batch bucket
//! (`cuda_plan::graph_buckets`). Not yet proven on a GPU (docs/gpu.md).

use crate::backend::{Backend, RowOut};
use crate::cuda_plan::graph_buckets::{bucket_for, DecodeInputs, MAX_GRAPH_BATCH};
use crate::cuda_plan::kv_pipeline::{step_plan, StepOp};
use crate::cuda_plan::staging::{staging_capacity, StagingLayout};
use crate::cuda_plan::unstaging::{blocks_per_piece, pieces, PIECE_BYTES};
use crate::kv_blocks::{check_range, payload_len};
use crate::llama_runner::RunnerOptions;
use crate::model::LlamaModel;
use crate::model_config::{ModelConfig, RopeStyle};
use crate::runner::{DeviceDraw, KvShape, KvSource, RunnerError, SeqChunk, SeqId};
use kvmesh_common::BlockId;
use kvmesh_kernels::cuda::{
    attention_tiles, tiles_pay, CudaDevice, CudaError, CudaSlice, DeviceGraph, DeviceQMatrix,
    GemvKernel, KvEvent, KvGeometry, KvStager, KvUnstager,
};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

struct DeviceLayer {
    attn_norm: CudaSlice<f32>,
    wqkv: DeviceQMatrix,
    qkv_bias: Option<CudaSlice<f32>>,
    wo: DeviceQMatrix,
    ffn_norm: CudaSlice<f32>,
    w_gate_up: DeviceQMatrix,
    w_down: DeviceQMatrix,
}

/// The model's weights on the device, and the ops of a step over them.
struct DeviceModel {
    dev: CudaDevice,
    config: ModelConfig,
    geo: KvGeometry,
    layers: Vec<DeviceLayer>,
    embed: DeviceQMatrix,
    /// `None` when tied to the embedding.
    lm_head: Option<DeviceQMatrix>,
    output_norm: CudaSlice<f32>,
}

/// The KV pool: per layer K and V, with one spare block past the pool's (`geo.num_blocks`)
/// that only a decode graph's padding rows write.
struct KvPool {
    k: Vec<CudaSlice<u16>>,
    v: Vec<CudaSlice<u16>>,
}

/// Device buffers of one step's activations.
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
    /// Tokens the buffers above hold.
    tokens: usize,
    /// Logits rows `logits` holds.
    logits_rows: usize,
}

/// A step's index arrays on the device: per row its token, position, cache slot and the
/// offset of its block table in `tables`.
struct StepIndex {
    tokens: CudaSlice<i32>,
    pos: CudaSlice<i32>,
    slots: CudaSlice<i32>,
    row_table: CudaSlice<i32>,
    tables: CudaSlice<i32>,
    /// The rows' attention tiles and how many, where they pay (prefill; see
    /// [`kvmesh_kernels::cuda::tiles_pay`]).
    tiles: Option<(CudaSlice<i32>, usize)>,
    /// Rows the step computes.
    n: usize,
}

/// The decode graphs and the fixed buffers they all read and write (they replay one at a
/// time on the compute stream, so they share them).
struct Graphs {
    by_bucket: HashMap<usize, DeviceGraph>,
    index: StepIndex,
    scratch: Scratch,
    /// Block-table entries per row.
    table_width: usize,
}

pub struct CudaBackend {
    model: DeviceModel,
    kv: KvPool,
    options: RunnerOptions,
    scratch: Option<Scratch>,
    /// Per layer: recorded on the compute stream once the step's KV of that layer is written.
    appended: Vec<KvEvent>,
    /// The copy stream's buffers (a `KvSource` reads through `&self`).
    stager: Mutex<KvStager>,
    /// The buffers KV arriving from other nodes is written through (made on the first write).
    unstager: Option<KvUnstager>,
    graphs: Option<Graphs>,
    /// Set when a capture failed: decode steps run eagerly from then on.
    graphs_failed: bool,
}

fn cuda(e: CudaError) -> RunnerError {
    RunnerError::Device(e.to_string())
}

impl Scratch {
    fn new(
        d: &CudaDevice,
        c: &ModelConfig,
        n: usize,
        logits_rows: usize,
    ) -> Result<Self, CudaError> {
        let qkv_dim = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim;
        // The bf16 copy of a GEMM's activations: its widest input.
        let widest = [c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size]
            .into_iter()
            .max()
            .unwrap_or(0);
        Ok(Scratch {
            x: d.zeros(n * c.hidden_size)?,
            h: d.zeros(n * c.hidden_size)?,
            qkv: d.zeros(n * qkv_dim)?,
            attn: d.zeros(n * c.num_heads * c.head_dim)?,
            proj: d.zeros(n * c.hidden_size)?,
            gate_up: d.zeros(n * 2 * c.intermediate_size)?,
            act: d.zeros(n * c.intermediate_size)?,
            logits: d.zeros(logits_rows * c.vocab_size)?,
            bf16: d.zeros(n * widest)?,
            tokens: n,
            logits_rows,
        })
    }
}

impl StepIndex {
    /// Uploads the index arrays of `chunks`.
    fn upload(d: &CudaDevice, chunks: &[SeqChunk], bs: usize) -> Result<Self, CudaError> {
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
        let tiles = attention_tiles(chunks.iter().map(|ch| ch.tokens.len()));
        let tiles = match tiles_pay(n, &tiles) {
            true => Some((d.upload(&tiles)?, tiles.len() - 1)),
            false => None,
        };
        Ok(StepIndex {
            tokens: d.upload(&tokens)?,
            pos: d.upload(&pos)?,
            slots: d.upload(&slots)?,
            row_table: d.upload(&row_table)?,
            tables: d.upload(&tables)?,
            tiles,
            n,
        })
    }

    /// Zeroed buffers for `rows` rows of `table_width` table entries.
    fn zeros(d: &CudaDevice, rows: usize, table_width: usize) -> Result<Self, CudaError> {
        Ok(StepIndex {
            tokens: d.zeros(rows)?,
            pos: d.zeros(rows)?,
            slots: d.zeros(rows)?,
            row_table: d.zeros(rows)?,
            tables: d.zeros(rows * table_width)?,
            tiles: None,
            n: rows,
        })
    }

    /// Copies a graph's padded inputs into the start of these buffers.
    fn fill(&mut self, d: &CudaDevice, inputs: &DecodeInputs) -> Result<(), CudaError> {
        d.copy_in(&inputs.tokens, &mut self.tokens.slice_mut(..))?;
        d.copy_in(&inputs.positions, &mut self.pos.slice_mut(..))?;
        d.copy_in(&inputs.slots, &mut self.slots.slice_mut(..))?;
        d.copy_in(&inputs.row_table, &mut self.row_table.slice_mut(..))?;
        d.copy_in(&inputs.tables, &mut self.tables.slice_mut(..))
    }
}

impl DeviceModel {
    fn embed_rows(&self, idx: &StepIndex, n: usize, s: &mut Scratch) -> Result<(), CudaError> {
        self.dev.embed(
            &self.embed,
            &idx.tokens.slice(..),
            n,
            &mut s.x.slice_mut(..),
        )
    }

    /// Layer `li` up to and including writing its K and V into the cache.
    fn append_kv(
        &self,
        li: usize,
        idx: &StepIndex,
        n: usize,
        s: &mut Scratch,
        kv: &mut KvPool,
    ) -> Result<(), CudaError> {
        let (c, d, l) = (&self.config, &self.dev, &self.layers[li]);
        let hd = c.head_dim;
        let (q_dim, kv_dim) = (c.num_heads * hd, c.num_kv_heads * hd);
        let qkv_dim = q_dim + 2 * kv_dim;
        let interleaved = c.rope_style == RopeStyle::Interleaved;
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
            &idx.pos.slice(..),
            n,
            qkv_dim,
            c.num_heads,
            hd,
            base,
            interleaved,
        )?;
        d.rope(
            &mut s.qkv.slice_mut(q_dim..),
            &idx.pos.slice(..),
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
            &idx.slots.slice(..),
            n,
            &mut kv.k[li],
            &mut kv.v[li],
        )
    }

    /// The rest of layer `li`: attention over the cache, output projection, MLP.
    fn finish_layer(
        &self,
        li: usize,
        idx: &StepIndex,
        n: usize,
        s: &mut Scratch,
        kv: &KvPool,
    ) -> Result<(), CudaError> {
        let (c, d, l) = (&self.config, &self.dev, &self.layers[li]);
        let (hs, hd) = (c.hidden_size, c.head_dim);
        let q_dim = c.num_heads * hd;
        let qkv_dim = q_dim + 2 * c.num_kv_heads * hd;
        let tiles = idx.tiles.as_ref().map(|(t, n)| (t.slice(..), *n));
        d.attention(
            &self.geo,
            &s.qkv.slice(..),
            qkv_dim,
            &idx.pos.slice(..),
            &idx.row_table.slice(..),
            &idx.tables.slice(..),
            tiles.as_ref().map(|(t, n)| (t, *n)),
            n,
            &kv.k[li],
            &kv.v[li],
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
        let inter = c.intermediate_size;
        d.silu_mul(&s.gate_up.slice(..), inter, n, &mut s.act.slice_mut(..))?;
        d.matmul(
            &l.w_down,
            &s.act.slice(..),
            n,
            &mut s.proj.slice_mut(..),
            &mut s.bf16,
        )?;
        d.add(&mut s.x.slice_mut(..), &s.proj.slice(..), n * hs)
    }

    /// Final norm and LM head over the first `m` rows of `rows` into `s.logits`.
    fn head(&self, rows: Rows, m: usize, s: &mut Scratch) -> Result<(), CudaError> {
        let (c, d) = (&self.config, &self.dev);
        let src = match rows {
            Rows::Gathered => s.proj.slice(..),
            Rows::All => s.x.slice(..),
        };
        d.rmsnorm(
            &src,
            &self.output_norm,
            c.rms_norm_eps,
            m,
            &mut s.h.slice_mut(..),
        )?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        d.matmul(
            head,
            &s.h.slice(..),
            m,
            &mut s.logits.slice_mut(..),
            &mut s.bf16,
        )
    }

    /// The rows of a step from its `want.len()` rows of logits on the device: tokens drawn
    /// there for the sequences `draws` names (with `device_sampling`), logits copied back for
    /// the rest.
    fn rows_out(
        &self,
        device_sampling: bool,
        logits: &CudaSlice<f32>,
        want: &[SeqId],
        draws: &[DeviceDraw],
    ) -> Result<Vec<RowOut>, CudaError> {
        let d = &self.dev;
        let vocab = self.config.vocab_size;
        let m = want.len();
        let per_row: Vec<Option<&DeviceDraw>> = want
            .iter()
            .map(|id| draws.iter().find(|dr| dr.seq_id == *id))
            .collect();
        let mut drawn = vec![None; m];
        if device_sampling && per_row.iter().any(Option::is_some) {
            // Rows without a draw take a greedy one, never read.
            let param = |f: fn(&DeviceDraw) -> f32, default: f32| -> Vec<f32> {
                per_row.iter().map(|r| r.map_or(default, f)).collect()
            };
            let temperature = d.upload(&param(|r| r.params.temperature, 0.0))?;
            let top_p = d.upload(&param(|r| r.params.top_p, 1.0))?;
            let uniform = d.upload(&param(|r| r.uniform, 0.0))?;
            let top_k: Vec<i32> = per_row
                .iter()
                .map(|r| r.map_or(1, |r| r.params.top_k.min(i32::MAX as u32) as i32))
                .collect();
            let top_k = d.upload(&top_k)?;
            let mut tokens = d.zeros::<i32>(m)?;
            d.sample(
                &logits.slice(..m * vocab),
                vocab,
                m,
                &temperature.slice(..),
                &top_k.slice(..),
                &top_p.slice(..),
                &uniform.slice(..),
                &mut tokens.slice_mut(..),
            )?;
            let mut host = Vec::new();
            d.download(&tokens.slice(..m), &mut host)?;
            for (slot, (t, r)) in drawn.iter_mut().zip(host.into_iter().zip(&per_row)) {
                if r.is_some() {
                    *slot = Some(t as u32);
                }
            }
        }
        let mut rows = Vec::with_capacity(m);
        let mut host = Vec::new();
        for (r, token) in drawn.into_iter().enumerate() {
            rows.push(match token {
                Some(t) => RowOut::Drawn(t),
                None => {
                    d.download(&logits.slice(r * vocab..(r + 1) * vocab), &mut host)?;
                    RowOut::Logits(std::mem::take(&mut host))
                }
            });
        }
        Ok(rows)
    }
}

/// Which rows the LM head reads: the last rows of the chunks that want logits, gathered into
/// `proj` (a mixed step), or every row of `x` (a decode graph: one row per sequence).
#[derive(Clone, Copy)]
enum Rows {
    Gathered,
    All,
}

impl CudaBackend {
    /// Uploads `model`'s weights and allocates a zeroed KV pool of `shape` on `dev`.
    pub fn new(
        mut dev: CudaDevice,
        options: RunnerOptions,
        model: Arc<LlamaModel>,
        shape: KvShape,
    ) -> Result<Self, CudaError> {
        // Before the uploads: the int8 GEMV reads a copy of the weights made there.
        dev.set_gemv(if options.reference_gemv {
            GemvKernel::Reference
        } else {
            GemvKernel::Dp4a
        });
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
        // One spare block past the pool for a decode graph's padding rows.
        let per_layer = geo.block_elems() * (geo.num_blocks + 1);
        let mut kv = KvPool {
            k: Vec::with_capacity(c.num_layers),
            v: Vec::with_capacity(c.num_layers),
        };
        let mut appended = Vec::with_capacity(c.num_layers);
        for _ in 0..c.num_layers {
            kv.k.push(dev.zeros::<u16>(per_layer)?);
            kv.v.push(dev.zeros::<u16>(per_layer)?);
            appended.push(dev.kv_event()?);
        }
        let layout = staging_layout(&geo);
        let blocks = staging_capacity(0, layout.bytes(1)) / layout.bytes(1);
        let stager = Mutex::new(dev.kv_stager(blocks.max(1), 2 * geo.block_elems())?);
        Ok(CudaBackend {
            model: DeviceModel {
                embed: dev.upload_matrix(&model.embed)?,
                lm_head: model
                    .lm_head
                    .as_ref()
                    .map(|m| dev.upload_matrix(m))
                    .transpose()?,
                output_norm: dev.upload(&model.output_norm)?,
                config: model.config.clone(),
                dev,
                geo,
                layers,
            },
            kv,
            options,
            scratch: None,
            appended,
            stager,
            unstager: None,
            graphs: None,
            graphs_failed: false,
        })
    }

    /// The step buffers for `n` tokens (and up to `n` logits rows).
    fn scratch(&mut self, n: usize) -> Result<Scratch, CudaError> {
        if let Some(s) = self.scratch.take() {
            if s.tokens >= n {
                return Ok(s);
            }
        }
        Scratch::new(
            &self.model.dev,
            &self.model.config,
            n.next_power_of_two(),
            1,
        )
    }

    fn staged(&self) -> StagedKv<'_> {
        StagedKv {
            dev: &self.model.dev,
            geo: self.model.geo,
            kv: &self.kv,
            appended: &self.appended,
            stager: &self.stager,
        }
    }

    fn forward(
        &mut self,
        chunks: &[SeqChunk],
        draws: &[DeviceDraw],
        on_layer: &mut (dyn FnMut(usize, &dyn KvSource) + Send),
    ) -> Result<Vec<RowOut>, CudaError> {
        if self.options.cuda_graphs && !self.graphs_failed {
            if let Some(rows) = self.forward_graph(chunks, draws, on_layer)? {
                return Ok(rows);
            }
        }
        let vocab = self.model.config.vocab_size;
        let hs = self.model.config.hidden_size;
        let idx = StepIndex::upload(&self.model.dev, chunks, self.model.geo.block_size)?;
        let n = idx.n;
        let mut s = self.scratch(n)?;
        let want: Vec<SeqId> = chunks
            .iter()
            .filter(|c| c.want_logits)
            .map(|c| c.seq_id)
            .collect();
        let m = want.len();
        let mut rows = Vec::new();
        for op in step_plan(self.model.config.num_layers) {
            let d = &self.model.dev;
            match op {
                StepOp::Embed => self.model.embed_rows(&idx, n, &mut s)?,
                StepOp::AppendKv(l) => self.model.append_kv(l, &idx, n, &mut s, &mut self.kv)?,
                StepOp::RecordAppended(l) => d.record(&self.appended[l])?,
                StepOp::FinishLayer(l) => self.model.finish_layer(l, &idx, n, &mut s, &self.kv)?,
                StepOp::Deliver(l) => on_layer(l, &self.staged()),
                StepOp::QueueHead if m > 0 => {
                    // The rows that end a chunk asking for logits, gathered into `proj`.
                    let (mut row, mut end) = (0, 0);
                    for ch in chunks {
                        end += ch.tokens.len();
                        if ch.want_logits {
                            d.copy_within(
                                &s.x.slice((end - 1) * hs..end * hs),
                                &mut s.proj.slice_mut(row * hs..(row + 1) * hs),
                            )?;
                            row += 1;
                        }
                    }
                    if s.logits_rows < m {
                        s.logits = d.zeros(m * vocab)?;
                        s.logits_rows = m;
                    }
                    self.model.head(Rows::Gathered, m, &mut s)?;
                }
                StepOp::QueueHead => {}
                StepOp::ReadLogits if m > 0 => {
                    let sampling = self.options.device_sampling;
                    rows = self.model.rows_out(sampling, &s.logits, &want, draws)?
                }
                StepOp::ReadLogits => d.synchronize()?,
            }
        }
        self.scratch = Some(s);
        Ok(rows)
    }

    /// A decode step replayed as its bucket's graph (captured on first use); `None` when the
    /// step is not one a graph runs (then it runs eagerly).
    fn forward_graph(
        &mut self,
        chunks: &[SeqChunk],
        draws: &[DeviceDraw],
        on_layer: &mut (dyn FnMut(usize, &dyn KvSource) + Send),
    ) -> Result<Option<Vec<RowOut>>, CudaError> {
        let Some(bucket) = bucket_for(chunks.len(), MAX_GRAPH_BATCH) else {
            return Ok(None);
        };
        let (c, geo) = (&self.model.config, self.model.geo);
        let table_width = c.max_context.div_ceil(geo.block_size);
        let spare = geo.num_blocks as u32;
        let Some(inputs) = DecodeInputs::pad(chunks, bucket, table_width, geo.block_size, spare)
        else {
            return Ok(None);
        };
        if self.graphs.is_none() {
            let d = &self.model.dev;
            self.graphs = Some(Graphs {
                by_bucket: HashMap::new(),
                index: StepIndex::zeros(d, MAX_GRAPH_BATCH, table_width)?,
                scratch: Scratch::new(d, c, MAX_GRAPH_BATCH, MAX_GRAPH_BATCH)?,
                table_width,
            });
        }
        let Some(g) = self.graphs.as_mut() else {
            return Ok(None);
        };
        debug_assert_eq!(g.table_width, table_width);
        let (model, kv) = (&self.model, &mut self.kv);
        g.index.fill(&model.dev, &inputs)?;
        if !g.by_bucket.contains_key(&bucket) {
            let (index, scratch) = (&g.index, &mut g.scratch);
            let captured = model.dev.capture(|_| {
                model.embed_rows(index, bucket, scratch)?;
                for l in 0..model.config.num_layers {
                    model.append_kv(l, index, bucket, scratch, kv)?;
                    model.finish_layer(l, index, bucket, scratch, kv)?;
                }
                model.head(Rows::All, bucket, scratch)
            });
            match captured {
                Ok(graph) => {
                    g.by_bucket.insert(bucket, graph);
                }
                Err(e) => {
                    tracing::warn!("CUDA graph capture failed, decoding without graphs: {e}");
                    self.graphs_failed = true;
                    return Ok(None);
                }
            }
        }
        let d = &self.model.dev;
        d.replay(&g.by_bucket[&bucket])?;
        // Every layer's KV is written when the graph is: the observer reads after it.
        for event in &self.appended {
            d.record(event)?;
        }
        let want: Vec<SeqId> = chunks.iter().map(|c| c.seq_id).collect();
        let sampling = self.options.device_sampling;
        let rows = self
            .model
            .rows_out(sampling, &g.scratch.logits, &want, draws)?;
        for l in 0..self.model.config.num_layers {
            on_layer(l, &self.staged());
        }
        Ok(Some(rows))
    }
}

fn staging_layout(geo: &KvGeometry) -> StagingLayout {
    StagingLayout {
        half_block_bytes: geo.block_elems() * 2,
    }
}

fn kv_shape(geo: &KvGeometry, num_layers: usize) -> KvShape {
    KvShape {
        num_layers,
        num_kv_heads: geo.n_kv_heads,
        head_dim: geo.head_dim,
        block_size: geo.block_size,
        num_blocks: geo.num_blocks,
    }
}

/// Reads device KV blocks into the transfer layout through the copy stream: each layer once
/// the compute stream has recorded its `appended` event (see `cuda_plan::kv_pipeline`).
struct StagedKv<'a> {
    dev: &'a CudaDevice,
    geo: KvGeometry,
    kv: &'a KvPool,
    appended: &'a [KvEvent],
    stager: &'a Mutex<KvStager>,
}

impl StagedKv<'_> {
    fn read(&self, layer: usize, blocks: &[BlockId], out: &mut Vec<u8>) -> Result<(), CudaError> {
        let mut stager = self
            .stager
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let layout = staging_layout(&self.geo);
        let have = stager.capacity_blocks();
        if blocks.len() > have {
            let bytes = staging_capacity(layout.bytes(have), layout.bytes(blocks.len()));
            *stager = self
                .dev
                .kv_stager(bytes / layout.bytes(1), 2 * self.geo.block_elems())?;
        }
        let ids: Vec<i32> = blocks.iter().map(|b| b.0 as i32).collect();
        out.reserve(layout.bytes(blocks.len()));
        self.dev.read_kv(
            &mut stager,
            &self.appended[layer],
            &self.geo,
            &self.kv.k[layer],
            &self.kv.v[layer],
            &ids,
            out,
        )
    }
}

impl KvSource for StagedKv<'_> {
    fn read_kv_blocks(
        &self,
        layer: usize,
        blocks: &[BlockId],
        out: &mut Vec<u8>,
    ) -> Result<(), RunnerError> {
        check_range(
            &kv_shape(&self.geo, self.kv.k.len()),
            layer..layer + 1,
            blocks,
        )?;
        self.read(layer, blocks, out).map_err(cuda)
    }
}

impl KvSource for CudaBackend {
    /// Between steps: after everything queued so far (a KV write included).
    fn read_kv_blocks(
        &self,
        layer: usize,
        blocks: &[BlockId],
        out: &mut Vec<u8>,
    ) -> Result<(), RunnerError> {
        let shape = kv_shape(&self.model.geo, self.kv.k.len());
        check_range(&shape, layer..layer + 1, blocks)?;
        self.model.dev.record(&self.appended[layer]).map_err(cuda)?;
        self.staged().read(layer, blocks, out).map_err(cuda)
    }
}

impl Backend for CudaBackend {
    fn run(
        &mut self,
        chunks: &[SeqChunk],
        draws: &[DeviceDraw],
        on_layer: &mut (dyn FnMut(usize, &dyn KvSource) + Send),
    ) -> Result<Vec<RowOut>, RunnerError> {
        self.forward(chunks, draws, on_layer).map_err(cuda)
    }

    fn draws_on_device(&self) -> bool {
        self.options.device_sampling
    }

    fn write_kv_blocks(
        &mut self,
        layers: Range<usize>,
        blocks: &[BlockId],
        payload: &[u8],
    ) -> Result<(), RunnerError> {
        let geo = self.model.geo;
        let shape = kv_shape(&geo, self.kv.k.len());
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
        let block_bytes = 4 * geo.block_elems();
        let piece = blocks_per_piece(block_bytes, PIECE_BYTES).min(blocks.len()) * block_bytes;
        let d = &self.model.dev;
        let mut st = match self.unstager.take() {
            Some(u) if u.piece_bytes() >= piece && u.capacity_blocks() >= blocks.len() => u,
            old => {
                // Grown in powers of two and kept: pinning memory costs far more than a copy.
                let have = old
                    .as_ref()
                    .map_or((0, 0), |u| (u.piece_bytes(), u.capacity_blocks()));
                drop(old); // unpinned before the larger buffers are pinned
                d.kv_unstager(
                    staging_capacity(have.0, piece),
                    blocks.len().max(have.1).next_power_of_two(),
                )
                .map_err(cuda)?
            }
        };
        let ids: Vec<i32> = blocks.iter().map(|b| b.0 as i32).collect();
        d.write_kv_ids(&mut st, &ids).map_err(cuda)?;
        for p in pieces(layers.len(), blocks.len(), block_bytes, piece) {
            let layer = layers.start + p.layer;
            d.write_kv_piece(
                &mut st,
                &geo,
                &payload[p.bytes],
                p.blocks,
                &mut self.kv.k[layer],
                &mut self.kv.v[layer],
            )
            .map_err(cuda)?;
        }
        self.unstager = Some(st);
        d.synchronize().map_err(cuda)
    }
}
