//! N prefill and M decode workers of one process, joined by the in-process transport: what
//! `kvmesh serve` runs.
//!
//! The set may change while it serves (`--autoscale`): a worker switches roles over the
//! engine it has (weights and warm KV pool kept, no model load), a new worker starts over the
//! shared weights with a KV pool of its own, and a worker no longer needed drains and frees
//! its pool. Each change leaves the directory the router reads first, so no new request goes
//! to a worker that is about to stop; the requests it accepted finish before it stops.

use super::in_process::LocalWorkers;
use kvmesh_common::{NodeId, NodeRole};
use kvmesh_decode::{DecodeConfig, DecodeError, DecodeWorker};
use kvmesh_engine::engine_config::EngineConfig;
use kvmesh_engine::llama_runner::LlamaRunner;
use kvmesh_engine::llm_engine::LlmEngine;
use kvmesh_engine::Loaded;
use kvmesh_prefill::{PrefillConfig, PrefillWorker};
use kvmesh_transfer::crossbeam_channel::Receiver;
use kvmesh_transfer::{InProcessTransport, Transport};
use kvmesh_worker::engine_return;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How many workers of each role, and how each is configured. Node ids are assigned:
/// prefill workers `NodeId(0x100 + i)`, decode workers `NodeId(0x200 + i)`, workers added
/// later `NodeId(0x300 + n)`; the `node_id` in the templates is ignored.
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
    /// How long a worker that leaves (a switch or a removal) may take to finish its requests;
    /// past it, those still open end with `Unavailable` and the router migrates them.
    pub drain_timeout: Duration,
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
            drain_timeout: Duration::from_secs(120),
        }
    }
}

type Engine = LlmEngine<LlamaRunner>;

/// A worker's thread, in the role it serves.
enum Thread {
    Prefill(PrefillWorker),
    Decode(DecodeWorker),
}

/// A running worker and where its engine comes back when its thread exits.
struct Worker {
    thread: Thread,
    engine_back: Receiver<Engine>,
}

impl Worker {
    fn role(&self) -> NodeRole {
        match self.thread {
            Thread::Prefill(_) => NodeRole::Prefill,
            Thread::Decode(_) => NodeRole::Decode,
        }
    }

    /// Stops taking requests, lets those accepted finish within `timeout` and takes the
    /// engine back (idle, its prefix cache intact). Blocks. Returns whether every request
    /// finished in time, and the engine (`None` if the thread panicked).
    fn drain(self, timeout: Duration) -> (bool, Option<Engine>) {
        let finished = match self.thread {
            Thread::Prefill(w) => {
                w.handle().drain();
                w.join_within(timeout)
            }
            Thread::Decode(w) => {
                w.handle().drain();
                w.join_within(timeout)
            }
        };
        (finished, self.engine_back.try_recv().ok())
    }
}

/// The running workers; `closed` once a shutdown began (nothing starts after it).
#[derive(Default)]
struct Running {
    workers: BTreeMap<NodeId, Worker>,
    closed: bool,
    added: u64,
}

/// How a switch or a removal went.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Departure {
    /// Every request the worker had accepted finished (none was cut at the drain timeout).
    pub finished: bool,
    pub seconds: f64,
}

/// The running workers. Dropping it stops them all.
pub struct LocalMesh {
    loaded: Loaded,
    config: LocalMeshConfig,
    transport: Arc<dyn Transport>,
    running: Mutex<Running>,
    /// Their handles, as the router reaches them.
    workers: LocalWorkers,
}

/// Why a mesh could not start, or a worker could not be added, switched or removed.
#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    #[error(transparent)]
    Engine(#[from] kvmesh_engine::engine_config::EngineBuildError),
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error("starting a prefill thread: {0}")]
    Spawn(#[from] std::io::Error),
    #[error("no worker {0} is running")]
    UnknownWorker(NodeId),
    #[error("{} is not a worker role (prefill or decode)", .0.as_str())]
    NotAWorkerRole(NodeRole),
    #[error("worker {0} did not hand back its engine (its thread panicked)")]
    EngineLost(NodeId),
    #[error("the mesh is shutting down")]
    ShuttingDown,
}

impl LocalMesh {
    /// Builds every engine over `loaded` (weights shared, one KV pool per worker) and starts
    /// the threads.
    pub fn start(loaded: &Loaded, config: &LocalMeshConfig) -> Result<LocalMesh, MeshError> {
        // The recorder goes in before the workers take their metric handles.
        kvmesh_router::metrics_exporter();
        let mesh = LocalMesh {
            loaded: Loaded {
                model: loaded.model.clone(),
                tokenizer: loaded.tokenizer.clone(),
                fingerprint: loaded.fingerprint,
            },
            config: config.clone(),
            transport: Arc::new(InProcessTransport::new(config.transport_queue_chunks)),
            running: Mutex::new(Running::default()),
            workers: LocalWorkers::default(),
        };
        for i in 0..config.prefill_workers {
            mesh.launch(NodeId(0x100 + i as u64), NodeRole::Prefill, None)?;
        }
        for i in 0..config.decode_workers {
            mesh.launch(NodeId(0x200 + i as u64), NodeRole::Decode, None)?;
        }
        Ok(mesh)
    }

    /// The workers' handles, kept current as workers come, go and switch.
    pub fn workers(&self) -> LocalWorkers {
        self.workers.clone()
    }

    #[cfg(test)]
    pub fn prefill_handles(&self) -> Vec<kvmesh_prefill::PrefillHandle> {
        self.workers.prefill_handles()
    }

    #[cfg(test)]
    pub fn decode_handles(&self) -> Vec<kvmesh_decode::DecodeHandle> {
        self.workers.decode_handles()
    }

    /// Starts a new worker of `role` over the shared weights, with a fresh KV pool.
    pub fn add(&self, role: NodeRole) -> Result<NodeId, MeshError> {
        let id = {
            let mut running = self.lock();
            if running.closed {
                return Err(MeshError::ShuttingDown);
            }
            running.added += 1;
            NodeId(0x300 + running.added - 1)
        };
        self.launch(id, role, None)?;
        Ok(id)
    }

    /// Moves worker `node` to `to` in place: out of the directory, drained, and started in
    /// the new role over the engine it had (same node id, weights and KV pool). Blocks while
    /// it drains. A worker already serving `to` is left alone.
    pub fn switch(&self, node: NodeId, to: NodeRole) -> Result<Departure, MeshError> {
        check_worker_role(to)?;
        let started = Instant::now();
        let Some(worker) = self.take(node, Some(to))? else {
            return Ok(Departure {
                finished: true,
                seconds: 0.0,
            });
        };
        let (finished, engine) = worker.drain(self.config.drain_timeout);
        let engine = engine.ok_or(MeshError::EngineLost(node))?;
        self.launch(node, to, Some(engine))?;
        Ok(Departure {
            finished,
            seconds: started.elapsed().as_secs_f64(),
        })
    }

    /// Stops worker `node`: out of the directory, drained, its KV pool freed. Blocks while it
    /// drains.
    pub fn remove(&self, node: NodeId) -> Result<Departure, MeshError> {
        let started = Instant::now();
        let worker = self
            .take(node, None)?
            .expect("taken whatever its role when no role is kept");
        let (finished, _engine) = worker.drain(self.config.drain_timeout);
        Ok(Departure {
            finished,
            seconds: started.elapsed().as_secs_f64(),
        })
    }

    /// Drains every worker and waits for them: decode workers finish their open requests
    /// (which may still need the prefill workers), then the prefill workers stop. Nothing
    /// starts after it (a switch under way stops instead of starting its new role).
    pub fn shutdown(&self) {
        let workers = {
            let mut running = self.lock();
            running.closed = true;
            std::mem::take(&mut running.workers)
        };
        for id in workers.keys() {
            self.workers.remove(*id);
        }
        let (decode, prefill): (Vec<_>, Vec<_>) = workers
            .into_values()
            .partition(|w| w.role() == NodeRole::Decode);
        for group in [decode, prefill] {
            for w in &group {
                match &w.thread {
                    Thread::Prefill(t) => t.handle().drain(),
                    Thread::Decode(t) => t.handle().drain(),
                }
            }
            for w in group {
                match w.thread {
                    Thread::Prefill(t) => t.join(),
                    Thread::Decode(t) => t.join(),
                }
            }
        }
    }

    /// Takes worker `node` out of the directory and the running set, unless it already
    /// serves `keep_if` (then `None`).
    fn take(&self, node: NodeId, keep_if: Option<NodeRole>) -> Result<Option<Worker>, MeshError> {
        let mut running = self.lock();
        if running.closed {
            return Err(MeshError::ShuttingDown);
        }
        match running.workers.get(&node) {
            None => return Err(MeshError::UnknownWorker(node)),
            Some(w) if Some(w.role()) == keep_if => return Ok(None),
            Some(_) => {}
        }
        // Out of the directory first: from here on the router picks other workers.
        self.workers.remove(node);
        Ok(running.workers.remove(&node))
    }

    /// Starts `node` in `role` over `engine` (a new one over the shared weights if `None`)
    /// and lists it in the directory. After a shutdown began it stops at once instead.
    fn launch(
        &self,
        node: NodeId,
        role: NodeRole,
        engine: Option<Engine>,
    ) -> Result<(), MeshError> {
        let c = &self.config;
        let (back, engine_back) = engine_return();
        let thread = match role {
            NodeRole::Prefill => {
                let engine = match engine {
                    Some(e) => e,
                    None => c.prefill_engine.llama_engine(&self.loaded)?,
                };
                let config = PrefillConfig {
                    node_id: node,
                    ..c.prefill.clone()
                };
                let transport = self.transport.clone();
                Thread::Prefill(PrefillWorker::spawn_returning(
                    config, engine, transport, back,
                )?)
            }
            NodeRole::Decode => {
                let engine = match engine {
                    Some(e) => e,
                    None => c.decode_engine.llama_engine(&self.loaded)?,
                };
                let config = DecodeConfig {
                    node_id: node,
                    ..c.decode.clone()
                };
                let transport = self.transport.clone();
                Thread::Decode(DecodeWorker::spawn_returning(
                    config, engine, transport, back,
                )?)
            }
            NodeRole::Router => return Err(MeshError::NotAWorkerRole(role)),
        };
        let worker = Worker {
            thread,
            engine_back,
        };
        let mut running = self.lock();
        if running.closed {
            drop(running);
            let _ = worker.drain(Duration::ZERO);
            return Err(MeshError::ShuttingDown);
        }
        match &worker.thread {
            Thread::Prefill(t) => self.workers.insert_prefill(t.handle()),
            Thread::Decode(t) => self.workers.insert_decode(t.handle()),
        }
        running.workers.insert(node, worker);
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Running> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for LocalMesh {
    /// Stops what still runs (after `shutdown`, nothing): decode workers first, as they may
    /// be waiting on prefill workers.
    fn drop(&mut self) {
        let workers = std::mem::take(&mut self.lock().workers);
        let (decode, prefill): (Vec<_>, Vec<_>) = workers
            .into_values()
            .partition(|w| w.role() == NodeRole::Decode);
        drop(decode);
        drop(prefill);
    }
}

fn check_worker_role(role: NodeRole) -> Result<(), MeshError> {
    match role {
        NodeRole::Prefill | NodeRole::Decode => Ok(()),
        NodeRole::Router => Err(MeshError::NotAWorkerRole(role)),
    }
}

#[cfg(test)]
mod tests;
