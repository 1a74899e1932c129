//! N prefill and M decode workers of one process, joined by the in-process transport: what
//! `kvmesh serve` runs.

use kvmesh_common::NodeId;
use kvmesh_decode::{DecodeConfig, DecodeError, DecodeHandle, DecodeWorker};
use kvmesh_engine::engine_config::EngineConfig;
use kvmesh_engine::Loaded;
use kvmesh_prefill::{PrefillConfig, PrefillHandle, PrefillWorker};
use kvmesh_transfer::{InProcessTransport, Transport};
use std::sync::Arc;

/// How many workers of each role, and how each is configured. Node ids are assigned:
/// prefill workers `NodeId(0x100 + i)`, decode workers `NodeId(0x200 + i)`; the `node_id` in
/// the templates is ignored.
#[derive(Clone, Debug)]
pub struct LocalMeshConfig {
    pub prefill_workers: usize,
    pub decode_workers: usize,
    pub prefill_engine: EngineConfig,
    pub decode_engine: EngineConfig,
    pub prefill: PrefillConfig,
    pub decode: DecodeConfig,
    /// Chunks each decode worker's KV queue holds before prefill workers wait.
    pub transport_queue_chunks: usize,
}

impl Default for LocalMeshConfig {
    fn default() -> Self {
        LocalMeshConfig {
            prefill_workers: 1,
            decode_workers: 1,
            prefill_engine: EngineConfig::default(),
            decode_engine: EngineConfig::default(),
            prefill: PrefillConfig::new(NodeId(0)),
            decode: DecodeConfig::new(NodeId(0)),
            transport_queue_chunks: 256,
        }
    }
}

/// The running workers. Dropping it stops them all.
pub struct LocalMesh {
    // Decode workers first: they stop before the prefill workers they may be waiting on.
    pub decode: Vec<DecodeWorker>,
    pub prefill: Vec<PrefillWorker>,
}

/// Why a mesh could not start.
#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    #[error("invalid engine config: {0}")]
    Engine(#[from] kvmesh_engine::scheduler::SchedulerError),
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error("starting a prefill thread: {0}")]
    Spawn(#[from] std::io::Error),
}

impl LocalMesh {
    /// Builds every engine over `loaded` (weights shared, one KV pool per worker) and starts
    /// the threads.
    pub fn start(loaded: &Loaded, config: &LocalMeshConfig) -> Result<LocalMesh, MeshError> {
        // The recorder goes in before the workers take their metric handles.
        kvmesh_router::metrics_exporter();
        let transport: Arc<dyn Transport> =
            Arc::new(InProcessTransport::new(config.transport_queue_chunks));
        let mut prefill = Vec::with_capacity(config.prefill_workers);
        for i in 0..config.prefill_workers {
            let mut c = config.prefill.clone();
            c.node_id = NodeId(0x100 + i as u64);
            let engine = config.prefill_engine.llama_engine(loaded)?;
            prefill.push(PrefillWorker::spawn(c, engine, transport.clone())?);
        }
        let mut decode = Vec::with_capacity(config.decode_workers);
        for i in 0..config.decode_workers {
            let mut c = config.decode.clone();
            c.node_id = NodeId(0x200 + i as u64);
            let engine = config.decode_engine.llama_engine(loaded)?;
            decode.push(DecodeWorker::spawn(c, engine, transport.clone())?);
        }
        Ok(LocalMesh { decode, prefill })
    }

    pub fn prefill_handles(&self) -> Vec<PrefillHandle> {
        self.prefill.iter().map(PrefillWorker::handle).collect()
    }

    pub fn decode_handles(&self) -> Vec<DecodeHandle> {
        self.decode.iter().map(DecodeWorker::handle).collect()
    }

    /// Drains every worker and waits for them: decode workers finish their open requests
    /// (which may still need the prefill workers), then the prefill workers stop.
    pub fn shutdown(self) {
        let LocalMesh { decode, prefill } = self;
        for d in &decode {
            d.handle().drain();
        }
        for d in decode {
            d.join();
        }
        for p in &prefill {
            p.handle().drain();
        }
        for p in prefill {
            p.join();
        }
    }
}

#[cfg(test)]
mod tests;
