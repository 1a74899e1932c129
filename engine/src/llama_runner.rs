//! The real `ModelRunner`: the Llama forward pass over this runner's own paged KV cache, on
//! the backend of its device (see `backend`).

use crate::backend::{self, Backend, BackendError, RowOut};
use crate::device::Device;
use crate::model::LlamaModel;
use crate::runner::{
    DeviceDraw, KvShape, KvSource, ModelRunner, RunnerError, StepInput, StepOutput,
};
use kvmesh_common::BlockId;
use std::ops::Range;
use std::sync::Arc;

/// How a runner computes, beyond its device. Ignored on the CPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunnerOptions {
    /// Replay decode steps as CUDA graphs, captured once per batch-size bucket (see
    /// `cuda_plan::graph_buckets`).
    pub cuda_graphs: bool,
    /// Draw the tokens the engine lets the device draw (`sampler::device_draw`) there,
    /// copying back a token instead of a row of logits.
    pub device_sampling: bool,
    /// On CUDA: decode's matmuls take the f32 reference GEMV instead of the int8 one
    /// (`kvmesh_kernels::cuda::GemvKernel`). To compare.
    pub reference_gemv: bool,
}

pub struct LlamaRunner {
    model: Arc<LlamaModel>,
    shape: KvShape,
    backend: Box<dyn Backend>,
}

impl LlamaRunner {
    /// A CPU runner with `num_blocks` KV blocks of `block_size` tokens.
    pub fn new(model: Arc<LlamaModel>, num_blocks: usize, block_size: usize) -> Self {
        Self::on_device(Device::Cpu, model, num_blocks, block_size)
            .unwrap_or_else(|e| unreachable!("the CPU backend cannot fail to open: {e}"))
    }

    /// A runner on `device`; an error (no CUDA support, driver or device) when it cannot run
    /// there.
    pub fn on_device(
        device: Device,
        model: Arc<LlamaModel>,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Self, BackendError> {
        Self::with_options(
            device,
            RunnerOptions::default(),
            model,
            num_blocks,
            block_size,
        )
    }

    /// [`on_device`](Self::on_device) with `options`.
    pub fn with_options(
        device: Device,
        options: RunnerOptions,
        model: Arc<LlamaModel>,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Self, BackendError> {
        let c = &model.config;
        let shape = KvShape {
            num_layers: c.num_layers,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size,
            num_blocks,
        };
        Ok(LlamaRunner {
            backend: backend::open(device, options, model.clone(), shape)?,
            model,
            shape,
        })
    }

    pub fn model(&self) -> &Arc<LlamaModel> {
        &self.model
    }

    fn validate(&self, input: &StepInput) -> Result<(), RunnerError> {
        let shape = self.shape;
        let vocab = self.model.config.vocab_size;
        let max = self.model.config.max_context;
        for ch in &input.chunks {
            let needed = ch.start_pos + ch.tokens.len();
            let covered = ch.block_table.len() * shape.block_size;
            if needed > covered {
                return Err(RunnerError::BlockTableTooShort {
                    seq_id: ch.seq_id,
                    needed,
                    covered,
                });
            }
            if needed > max {
                return Err(RunnerError::ContextOverflow { pos: needed, max });
            }
            if let Some(&token) = ch.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(RunnerError::TokenOutOfRange { token, vocab });
            }
            if let Some(b) = ch
                .block_table
                .iter()
                .find(|b| b.0 as usize >= shape.num_blocks)
            {
                return Err(RunnerError::BlockOutOfRange {
                    block: b.0,
                    num_blocks: shape.num_blocks,
                });
            }
        }
        Ok(())
    }
}

impl KvSource for LlamaRunner {
    fn read_kv_blocks(
        &self,
        layer: usize,
        blocks: &[BlockId],
        out: &mut Vec<u8>,
    ) -> Result<(), RunnerError> {
        self.backend.read_kv_blocks(layer, blocks, out)
    }
}

impl ModelRunner for LlamaRunner {
    fn kv_shape(&self) -> KvShape {
        self.shape
    }

    fn vocab_size(&self) -> usize {
        self.model.config.vocab_size
    }

    fn max_context(&self) -> usize {
        self.model.config.max_context
    }

    fn execute_observed(
        &mut self,
        input: &StepInput,
        on_layer: &mut (dyn FnMut(usize, &dyn KvSource) + Send),
    ) -> Result<StepOutput, RunnerError> {
        self.execute_drawing(input, &[], on_layer)
    }

    fn draws_on_device(&self) -> bool {
        self.backend.draws_on_device()
    }

    fn execute_drawing(
        &mut self,
        input: &StepInput,
        draws: &[DeviceDraw],
        on_layer: &mut (dyn FnMut(usize, &dyn KvSource) + Send),
    ) -> Result<StepOutput, RunnerError> {
        self.validate(input)?;
        let chunks: Vec<_> = input
            .chunks
            .iter()
            .filter(|c| !c.tokens.is_empty())
            .cloned()
            .collect();
        let rows = self.backend.run(&chunks, draws, on_layer)?;
        let ids = chunks.iter().filter(|c| c.want_logits).map(|c| c.seq_id);
        let mut out = StepOutput::default();
        for (seq_id, row) in ids.zip(rows) {
            match row {
                RowOut::Logits(l) => out.logits.push((seq_id, l)),
                RowOut::Drawn(t) => out.drawn.push((seq_id, t)),
            }
        }
        Ok(out)
    }

    fn write_kv_blocks(
        &mut self,
        layers: Range<usize>,
        blocks: &[BlockId],
        payload: &[u8],
    ) -> Result<(), RunnerError> {
        self.backend.write_kv_blocks(layers, blocks, payload)
    }
}
