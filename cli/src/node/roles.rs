//! Either role's worker over one engine. A node keeps what starting each role takes (its
//! settings for both, the transport, the directories of its peers) for its whole life, so
//! that a role switch starts the other role's worker over the engine the first one handed
//! back: same weights, same KV pool, no model load.

use anyhow::{Context, Result};
use kvmesh_common::{LoadReport, ModelFingerprint, NodeRole};
use kvmesh_decode::{DecodeConfig, DecodeHandle, DecodeService, DecodeWorker, PrefillDirectory};
use kvmesh_engine::llm_engine::LlmEngine;
use kvmesh_engine::runner::ModelRunner;
use kvmesh_prefill::{PrefillConfig, PrefillHandle, PrefillService, PrefillWorker};
use kvmesh_transfer::crossbeam_channel::Receiver;
use kvmesh_transfer::{NetworkTransport, Transport};
use kvmesh_worker::{engine_return, ExportSource, HolderDirectory, LearnPeer};
use std::sync::Arc;
use std::time::Duration;

/// What starting a worker in either role takes.
pub struct RoleKit {
    pub fingerprint: ModelFingerprint,
    pub network: Arc<NetworkTransport>,
    pub learn: LearnPeer,
    /// The prefill role's settings (its node id and KV event sink included).
    pub prefill: PrefillConfig,
    /// The decode role's settings.
    pub decode: DecodeConfig,
    /// Where a prefill worker pulls the prefixes its destinations hold.
    pub holders: Arc<HolderDirectory>,
    /// The prefill nodes a decode worker calls, and the holders it pulls from.
    pub prefill_nodes: Arc<PrefillDirectory>,
}

impl RoleKit {
    /// Starts `role`'s worker over `engine`; the engine comes back on the receiver when the
    /// worker's thread exits.
    pub fn start<R: ModelRunner + 'static>(
        &self,
        role: NodeRole,
        engine: LlmEngine<R>,
    ) -> Result<(RoleWorker, Receiver<LlmEngine<R>>)> {
        let (back, returned) = engine_return();
        let transport: Arc<dyn Transport> = self.network.clone();
        let worker = match role {
            NodeRole::Prefill => {
                let worker =
                    PrefillWorker::spawn_returning(self.prefill.clone(), engine, transport, back)
                        .context("starting the prefill worker")?;
                let handle = worker.handle();
                let service =
                    PrefillService::new(handle.clone(), self.fingerprint, self.learn.clone())
                        .with_rdma(self.network.clone())
                        .with_pulls(self.holders.clone());
                RoleWorker::Prefill {
                    worker,
                    serving: Serving::Prefill(Arc::new(service), handle),
                }
            }
            NodeRole::Decode => {
                let worker =
                    DecodeWorker::spawn_returning(self.decode.clone(), engine, transport, back)
                        .context("starting the decode worker")?;
                let handle = worker.handle();
                let service = DecodeService::new(handle.clone(), self.prefill_nodes.clone());
                RoleWorker::Decode {
                    worker,
                    serving: Serving::Decode(Arc::new(service), handle),
                }
            }
            NodeRole::Router => anyhow::bail!("a router is not a worker role"),
        };
        Ok((worker, returned))
    }
}

/// A role's gRPC service and its worker's handle: what the node's front end calls while
/// the node serves that role.
#[derive(Clone)]
pub enum Serving {
    Prefill(Arc<PrefillService>, PrefillHandle),
    Decode(Arc<DecodeService>, DecodeHandle),
}

impl Serving {
    pub fn role(&self) -> NodeRole {
        match self {
            Serving::Prefill(..) => NodeRole::Prefill,
            Serving::Decode(..) => NodeRole::Decode,
        }
    }

    pub fn load(&self) -> LoadReport {
        match self {
            Serving::Prefill(_, h) => h.load(),
            Serving::Decode(_, h) => h.load(),
        }
    }

    /// Stops taking requests; those accepted finish, then the worker's thread exits.
    pub fn drain(&self) {
        match self {
            Serving::Prefill(_, h) => h.drain(),
            Serving::Decode(_, h) => h.drain(),
        }
    }

    /// The worker, as other nodes pull cached KV from it.
    pub fn exporter(&self) -> ExportSource {
        match self {
            Serving::Prefill(_, h) => Arc::new(h.clone()),
            Serving::Decode(_, h) => Arc::new(h.clone()),
        }
    }
}

/// A running worker of either role.
pub enum RoleWorker {
    Prefill {
        worker: PrefillWorker,
        serving: Serving,
    },
    Decode {
        worker: DecodeWorker,
        serving: Serving,
    },
}

impl RoleWorker {
    pub fn serving(&self) -> &Serving {
        match self {
            RoleWorker::Prefill { serving, .. } | RoleWorker::Decode { serving, .. } => serving,
        }
    }

    pub fn role(&self) -> NodeRole {
        self.serving().role()
    }

    /// Stops taking requests and waits until those accepted are done, or `timeout` passes
    /// (then stops them: the router moves open streams to other nodes). Blocking. Returns
    /// whether they all finished.
    pub fn drain_and_join(self, timeout: Duration) -> bool {
        self.serving().drain();
        match self {
            RoleWorker::Prefill { worker, .. } => worker.join_within(timeout),
            RoleWorker::Decode { worker, .. } => worker.join_within(timeout),
        }
    }
}
