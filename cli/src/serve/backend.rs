//! The router's `Backend` over the in-process workers: registers them in the in-memory
//! discovery, refreshes their load on each request and routes with the router's policy over
//! the in-memory prefix index the workers feed, counting each request on its worker until
//! its stream ends.

use super::mesh::{LocalMesh, LocalMeshConfig};
use kvmesh_common::WorkerError;
use kvmesh_common::{GenerateEvent, GenerateRequest, ModelFingerprint, NodeId, NodeInfo, NodeRole};
use kvmesh_decode::DecodeHandle;
use kvmesh_kvstore::{Discovery, InMemoryDiscovery};
use kvmesh_prefill::PrefillHandle;
use kvmesh_router::routing::Routing;
use kvmesh_worker::{ExportSource, KvPull};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedReceiver;

pub struct MeshBackend {
    discovery: InMemoryDiscovery,
    decode: HashMap<NodeId, DecodeHandle>,
    prefill: HashMap<NodeId, PrefillHandle>,
    routing: Routing,
    ready: AtomicBool,
}

impl MeshBackend {
    /// The workers of `mesh`, started with `config`, serving the model `model_fingerprint`.
    pub fn new(
        mesh: &LocalMesh,
        config: &LocalMeshConfig,
        model_fingerprint: ModelFingerprint,
        routing: Routing,
    ) -> Self {
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
        let decode: HashMap<_, _> = mesh
            .decode_handles()
            .into_iter()
            .map(|h| (h.node_id(), h))
            .collect();
        let prefill: HashMap<_, _> = mesh
            .prefill_handles()
            .into_iter()
            .map(|h| (h.node_id(), h))
            .collect();
        for (id, h) in &decode {
            register(*id, NodeRole::Decode, h.kv_blocks_total());
        }
        for (id, h) in &prefill {
            register(*id, NodeRole::Prefill, h.kv_blocks_total());
        }
        MeshBackend {
            discovery,
            decode,
            prefill,
            routing,
            ready: AtomicBool::new(true),
        }
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Release);
    }

    /// Refreshes the load reports (atomics published by each worker thread).
    fn refresh_loads(&self) {
        let decode = self.decode.iter().map(|(i, h)| (*i, h.load()));
        let prefill = self.prefill.iter().map(|(i, h)| (*i, h.load()));
        for (id, load) in decode.chain(prefill) {
            // Registered in `new` and never removed while the backend lives.
            let _ = self.discovery.report_load(id, load);
        }
    }
}

#[kvmesh_router::async_trait]
impl kvmesh_router::Backend for MeshBackend {
    async fn generate(
        &self,
        req: GenerateRequest,
    ) -> Result<UnboundedReceiver<GenerateEvent>, WorkerError> {
        if !self.is_ready() {
            return Err(WorkerError::Unavailable("the mesh is shutting down".into()));
        }
        self.refresh_loads();
        let decode_nodes = self.discovery.nodes(NodeRole::Decode);
        let prefill_nodes = self.discovery.nodes(NodeRole::Prefill);
        let route = self
            .routing
            .route(&req.prompt, &decode_nodes, &prefill_nodes)
            .ok_or_else(|| WorkerError::Unavailable("no decode worker".into()))?;
        let decode = &self.decode[&route.decode];
        let prefill = route
            .prefill
            .and_then(|id| self.prefill.get(&id))
            .map(|h| h.clone().into());
        let pull = route.pull.and_then(|(id, blocks)| {
            let source: ExportSource = match self.decode.get(&id) {
                Some(h) => Arc::new(h.clone()),
                None => Arc::new(self.prefill.get(&id)?.clone()),
            };
            Some(KvPull { source, blocks })
        });
        // Counted on its node until its stream ends (and on its prefill node until its first
        // token): load reports lag a burst, and without this every request of the burst would
        // see the same idle node.
        let mut in_flight = self
            .routing
            .track_route(route.decode, prefill.as_ref().and(route.prefill));
        let mut events = decode.generate_pulling(req, prefill, pull)?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    event = events.recv() => {
                        let Some(e) = event else { break };
                        in_flight.prefilled();
                        if tx.send(e).is_err() {
                            break;
                        }
                    }
                    // The client left: dropping `events` cancels the request on the worker.
                    () = tx.closed() => break,
                }
            }
        });
        Ok(rx)
    }

    fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }
}
