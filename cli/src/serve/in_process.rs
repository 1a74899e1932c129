//! The in-process workers as the router's [`MeshBackend`](kvmesh_router::MeshBackend) reaches
//! them: a discovery naming them with their live load, and a connector that opens requests on
//! their handles.

use super::mesh::{LocalMesh, LocalMeshConfig};
use kvmesh_common::grpc::Placement;
use kvmesh_common::{GenerateRequest, ModelFingerprint, NodeId, NodeInfo, NodeRole, WorkerError};
use kvmesh_decode::DecodeHandle;
use kvmesh_kvstore::{Discovery, InMemoryDiscovery, NodeEntry};
use kvmesh_prefill::PrefillHandle;
use kvmesh_router::{DecodeConnector, DecodeEvents};
use kvmesh_worker::{ExportSource, KvPull};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

/// The workers of a [`LocalMesh`], by node id.
#[derive(Clone)]
pub struct LocalWorkers {
    decode: HashMap<NodeId, DecodeHandle>,
    prefill: HashMap<NodeId, PrefillHandle>,
}

impl LocalWorkers {
    pub fn of(mesh: &LocalMesh) -> Self {
        LocalWorkers {
            decode: mesh
                .decode_handles()
                .into_iter()
                .map(|h| (h.node_id(), h))
                .collect(),
            prefill: mesh
                .prefill_handles()
                .into_iter()
                .map(|h| (h.node_id(), h))
                .collect(),
        }
    }

    /// Their discovery: the workers started with `config`, serving the model
    /// `model_fingerprint`.
    pub fn discovery(
        &self,
        config: &LocalMeshConfig,
        model_fingerprint: ModelFingerprint,
    ) -> LocalDiscovery {
        let discovery = InMemoryDiscovery::new();
        let register = |node_id, role, kv_blocks_total| {
            let engine = match role {
                NodeRole::Prefill => &config.prefill_engine,
                _ => &config.decode_engine,
            };
            discovery
                .register(NodeInfo {
                    node_id,
                    role,
                    address: "in-process".into(),
                    transfer_address: String::new(),
                    model_fingerprint,
                    block_size: engine.block_size,
                    kv_blocks_total,
                })
                .expect("worker node ids are unique");
        };
        for (id, h) in &self.decode {
            register(*id, NodeRole::Decode, h.kv_blocks_total());
        }
        for (id, h) in &self.prefill {
            register(*id, NodeRole::Prefill, h.kv_blocks_total());
        }
        LocalDiscovery {
            discovery,
            workers: self.clone(),
        }
    }
}

/// The in-process workers' discovery: registered once, their load read on each look-up.
pub struct LocalDiscovery {
    discovery: InMemoryDiscovery,
    workers: LocalWorkers,
}

impl LocalDiscovery {
    /// Refreshes the load reports (atomics published by each worker thread).
    fn refresh_loads(&self) {
        let decode = self.workers.decode.iter().map(|(i, h)| (*i, h.load()));
        let prefill = self.workers.prefill.iter().map(|(i, h)| (*i, h.load()));
        for (id, load) in decode.chain(prefill) {
            // Registered in `discovery` and never removed while it lives.
            let _ = self.discovery.report_load(id, load);
        }
    }
}

impl Discovery for LocalDiscovery {
    fn nodes(&self, role: NodeRole) -> Vec<NodeEntry> {
        self.refresh_loads();
        self.discovery.nodes(role)
    }

    fn subscribe(&self) -> watch::Receiver<u64> {
        self.discovery.subscribe()
    }
}

#[kvmesh_router::async_trait]
impl DecodeConnector for LocalWorkers {
    /// Submits to the decode worker's handle; in-process requests have no deadline (the
    /// workers end them when the client leaves).
    async fn generate(
        &self,
        node: &NodeEntry,
        req: &GenerateRequest,
        placement: &Placement,
        _timeout: Duration,
    ) -> Result<DecodeEvents, WorkerError> {
        let id = node.info.node_id;
        let decode = self
            .decode
            .get(&id)
            .ok_or_else(|| WorkerError::Unavailable(format!("no decode worker {id}")))?;
        let prefill = placement
            .prefill
            .as_ref()
            .and_then(|p| self.prefill.get(&p.node_id))
            .map(|h| h.clone().into());
        let pull = placement.pull.as_ref().and_then(|holder| {
            let source: ExportSource = match self.decode.get(&holder.node_id) {
                Some(h) => Arc::new(h.clone()),
                None => Arc::new(self.prefill.get(&holder.node_id)?.clone()),
            };
            Some(KvPull {
                source,
                blocks: holder.blocks,
            })
        });
        let events = decode.generate_pulling(req.clone(), prefill, pull)?;
        Ok(Box::pin(UnboundedReceiverStream::new(events).map(Ok)))
    }
}
