//! The real `ModelRunner`: the Llama forward pass over this runner's own paged KV cache.

use crate::kv_blocks;
use crate::model::{Forward, KvCache, LlamaModel};
use crate::runner::{KvShape, KvSource, ModelRunner, RunnerError, StepInput, StepOutput};
use kvmesh_common::BlockId;
use std::ops::Range;
use std::sync::Arc;

pub struct LlamaRunner {
    model: Arc<LlamaModel>,
    kv: KvCache,
    forward: Forward,
    /// This runner's compute threads. A step runs inside it, so each op forks to the other
    /// pool threads directly instead of a hand-off from the worker's thread per op (about a
    /// quarter of batch-1 decode time); a pool per runner keeps the prefill and decode
    /// workers of one process from blocking inside each other's steps.
    pool: rayon::ThreadPool,
}

impl LlamaRunner {
    /// A runner with `num_blocks` KV blocks of `block_size` tokens.
    pub fn new(model: Arc<LlamaModel>, num_blocks: usize, block_size: usize) -> Self {
        let c = &model.config;
        let shape = KvShape {
            num_layers: c.num_layers,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size,
            num_blocks,
        };
        LlamaRunner {
            kv: KvCache::new(shape),
            forward: Forward::new(),
            model,
            pool: compute_pool(),
        }
    }

    pub fn model(&self) -> &Arc<LlamaModel> {
        &self.model
    }

    /// The KV storage, for transfer (pack/unpack of blocks) and tests.
    pub fn kv_cache(&self) -> &KvCache {
        &self.kv
    }

    pub fn kv_cache_mut(&mut self) -> &mut KvCache {
        &mut self.kv
    }

    fn validate(&self, input: &StepInput) -> Result<(), RunnerError> {
        let shape = self.kv.shape;
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
        self.kv.read_kv_blocks(layer, blocks, out)
    }
}

impl ModelRunner for LlamaRunner {
    fn kv_shape(&self) -> KvShape {
        self.kv.shape
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
        self.validate(input)?;
        let chunks: Vec<_> = input
            .chunks
            .iter()
            .filter(|c| !c.tokens.is_empty())
            .cloned()
            .collect();
        let (forward, model, kv) = (&mut self.forward, &self.model, &mut self.kv);
        let logits = self.pool.install(|| {
            forward.run(model, kv, &chunks, &mut |layer, kv: &KvCache| {
                on_layer(layer, kv)
            })
        })?;
        let ids = chunks.iter().filter(|c| c.want_logits).map(|c| c.seq_id);
        Ok(StepOutput {
            logits: ids.zip(logits).collect(),
        })
    }

    fn write_kv_blocks(
        &mut self,
        layers: Range<usize>,
        blocks: &[BlockId],
        payload: &[u8],
    ) -> Result<(), RunnerError> {
        kv_blocks::write_kv_blocks(&mut self.kv, layers, blocks, payload)
    }
}

/// As many threads as the global pool (which the binary sizes with `--threads`).
fn compute_pool() -> rayon::ThreadPool {
    let threads = rayon::current_num_threads();
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("kvmesh-compute-{i}"))
        .build()
        .unwrap_or_else(|e| panic!("cannot start {threads} compute threads: {e}"))
}
