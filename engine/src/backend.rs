//! The forward pass's seam: a [`Backend`] owns a model's KV cache on its device and runs
//! steps over it. [`LlamaRunner`](crate::llama_runner::LlamaRunner) validates a step and hands
//! it to one; the CPU backend is this module's [`CpuBackend`], the CUDA one `cuda_backend`
//! (feature `cuda`). Block size, hashing and the transfer layout of KV are the same on both,
//! so KV moves between a CPU node and a GPU node unchanged.

use crate::device::Device;
use crate::kv_blocks;
use crate::llama_runner::RunnerOptions;
use crate::model::{Forward, KvCache, LlamaModel};
use crate::runner::{DeviceDraw, KvShape, KvSource, RunnerError, SeqChunk};
use kvmesh_common::{BlockId, TokenId};
use std::ops::Range;
use std::sync::Arc;

/// Runs forward passes of one model over KV storage it owns. Chunks arrive validated (block
/// tables cover them, tokens and block ids in range) and non-empty.
pub trait Backend: KvSource + Send {
    /// Computes `chunks`, writing their KV, and returns for every chunk with `want_logits`,
    /// in order, the logits of its last token, or the token drawn for it when `draws` names
    /// its sequence and the backend draws on its device. `on_layer(l, kv)` runs once layer
    /// `l`'s KV of this step is written.
    fn run(
        &mut self,
        chunks: &[SeqChunk],
        draws: &[DeviceDraw],
        on_layer: &mut (dyn FnMut(usize, &dyn KvSource) + Send),
    ) -> Result<Vec<RowOut>, RunnerError>;

    /// Whether `run` makes the `draws` it is given.
    fn draws_on_device(&self) -> bool {
        false
    }

    /// Writes KV computed elsewhere (`layers` × `blocks` in the transfer layout).
    fn write_kv_blocks(
        &mut self,
        layers: Range<usize>,
        blocks: &[BlockId],
        payload: &[u8],
    ) -> Result<(), RunnerError>;
}

/// What a chunk that asked for logits gets from a step.
#[derive(Clone, Debug, PartialEq)]
pub enum RowOut {
    Logits(Vec<f32>),
    Drawn(TokenId),
}

/// Why a backend could not be built for a device.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    // The reason is in the message, not a `source`, so error chains print it once.
    #[error("--device {device}: {reason}")]
    Cuda {
        device: Device,
        reason: kvmesh_kernels::cuda::CudaError,
    },
}

/// A backend for `model` on `device` with a KV pool of `shape`. `cuda` fails here, at start,
/// with the reason (no CUDA support built in, no driver, no such device).
pub fn open(
    device: Device,
    options: RunnerOptions,
    model: Arc<LlamaModel>,
    shape: KvShape,
) -> Result<Box<dyn Backend>, BackendError> {
    match device {
        Device::Cpu => Ok(Box::new(CpuBackend::new(model, shape))),
        Device::Cuda(ordinal) => open_cuda(ordinal, options, model, shape)
            .map_err(|reason| BackendError::Cuda { device, reason }),
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(
    ordinal: usize,
    options: RunnerOptions,
    model: Arc<LlamaModel>,
    shape: KvShape,
) -> Result<Box<dyn Backend>, kvmesh_kernels::cuda::CudaError> {
    let dev = kvmesh_kernels::cuda::CudaDevice::open(ordinal)?;
    Ok(Box::new(crate::cuda_backend::CudaBackend::new(
        dev, options, model, shape,
    )?))
}

/// Without the `cuda` feature the kernels' stub says so (`CudaError::NotBuilt`).
#[cfg(not(feature = "cuda"))]
fn open_cuda(
    ordinal: usize,
    _options: RunnerOptions,
    _model: Arc<LlamaModel>,
    _shape: KvShape,
) -> Result<Box<dyn Backend>, kvmesh_kernels::cuda::CudaError> {
    kvmesh_kernels::cuda::CudaDevice::open(ordinal)?;
    unreachable!("the stub never opens a device")
}

/// The CPU backend: the kernels' CPU ops over a host-memory [`KvCache`].
pub struct CpuBackend {
    model: Arc<LlamaModel>,
    kv: KvCache,
    forward: Forward,
    /// This backend's compute threads. A step runs inside it, so each op forks to the other
    /// pool threads directly instead of a hand-off from the worker's thread per op (about a
    /// quarter of batch-1 decode time); a pool per runner keeps the prefill and decode
    /// workers of one process from blocking inside each other's steps.
    pool: rayon::ThreadPool,
}

impl CpuBackend {
    pub fn new(model: Arc<LlamaModel>, shape: KvShape) -> Self {
        CpuBackend {
            model,
            kv: KvCache::new(shape),
            forward: Forward::new(),
            pool: compute_pool(),
        }
    }
}

impl KvSource for CpuBackend {
    fn read_kv_blocks(
        &self,
        layer: usize,
        blocks: &[BlockId],
        out: &mut Vec<u8>,
    ) -> Result<(), RunnerError> {
        self.kv.read_kv_blocks(layer, blocks, out)
    }
}

impl Backend for CpuBackend {
    /// Draws nothing: the host samples every row.
    fn run(
        &mut self,
        chunks: &[SeqChunk],
        _draws: &[DeviceDraw],
        on_layer: &mut (dyn FnMut(usize, &dyn KvSource) + Send),
    ) -> Result<Vec<RowOut>, RunnerError> {
        let (forward, model, kv) = (&mut self.forward, &self.model, &mut self.kv);
        let logits = self.pool.install(|| {
            forward.run(model, kv, chunks, &mut |layer, kv: &KvCache| {
                on_layer(layer, kv)
            })
        })?;
        Ok(logits.into_iter().map(RowOut::Logits).collect())
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
