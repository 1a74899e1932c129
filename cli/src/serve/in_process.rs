//! The in-process workers as the router's [`MeshBackend`](kvmesh_router::MeshBackend) reaches
//! them: a directory of their handles (kept current by the [`LocalMesh`](super::mesh::LocalMesh)
//! as workers come, go and switch roles), a discovery naming them with their live load, and a
//! connector that opens requests on their handles.

use super::mesh::LocalMeshConfig;
use kvmesh_common::grpc::Placement;
use kvmesh_common::{GenerateRequest, ModelFingerprint, NodeId, NodeInfo, NodeRole, WorkerError};
use kvmesh_decode::DecodeHandle;
use kvmesh_kvstore::{Discovery, NodeEntry};
use kvmesh_prefill::PrefillHandle;
use kvmesh_router::{DecodeConnector, DecodeEvents};
use kvmesh_worker::{ExportSource, KvPull};
use std::collections::BTreeMap;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;
use tokio::sync::watch;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

/// The workers serving now, by node id. Clones share one directory.
#[derive(Clone)]
pub struct LocalWorkers {
    inner: Arc<Directory>,
}

struct Directory {
    handles: RwLock<Handles>,
    /// Bumped on every change of membership.
    generation: watch::Sender<u64>,
}

#[derive(Default)]
struct Handles {
    decode: BTreeMap<NodeId, DecodeHandle>,
    prefill: BTreeMap<NodeId, PrefillHandle>,
}

impl Default for LocalWorkers {
    fn default() -> Self {
        LocalWorkers {
            inner: Arc::new(Directory {
                handles: RwLock::default(),
                generation: watch::Sender::new(0),
            }),
        }
    }
}

impl LocalWorkers {
    pub fn of(mesh: &super::mesh::LocalMesh) -> Self {
        mesh.workers()
    }

    #[cfg(test)]
    pub fn prefill_handles(&self) -> Vec<PrefillHandle> {
        self.read().prefill.values().cloned().collect()
    }

    #[cfg(test)]
    pub fn decode_handles(&self) -> Vec<DecodeHandle> {
        self.read().decode.values().cloned().collect()
    }

    pub(super) fn insert_prefill(&self, handle: PrefillHandle) {
        self.write().prefill.insert(handle.node_id(), handle);
        self.changed();
    }

    pub(super) fn insert_decode(&self, handle: DecodeHandle) {
        self.write().decode.insert(handle.node_id(), handle);
        self.changed();
    }

    /// Takes `node` out, whatever its role (nothing if it is not listed).
    pub(super) fn remove(&self, node: NodeId) {
        let mut handles = self.write();
        let gone = handles.prefill.remove(&node).is_some() | handles.decode.remove(&node).is_some();
        drop(handles);
        if gone {
            self.changed();
        }
    }

    fn changed(&self) {
        self.inner.generation.send_modify(|g| *g += 1);
    }

    fn read(&self) -> RwLockReadGuard<'_, Handles> {
        self.inner.handles.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Handles> {
        self.inner
            .handles
            .write()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Their discovery: the workers of a mesh started with `config`, serving the model
    /// `model_fingerprint`.
    pub fn discovery(
        &self,
        config: &LocalMeshConfig,
        model_fingerprint: ModelFingerprint,
    ) -> LocalDiscovery {
        LocalDiscovery {
            workers: self.clone(),
            model_fingerprint,
            block_size: [
                config.prefill_engine.block_size,
                config.decode_engine.block_size,
            ],
        }
    }
}

/// The in-process workers' discovery: whoever the directory lists now, with the load each
/// worker thread last published.
pub struct LocalDiscovery {
    workers: LocalWorkers,
    model_fingerprint: ModelFingerprint,
    /// Prefill's, decode's.
    block_size: [usize; 2],
}

impl LocalDiscovery {
    fn entry(&self, node_id: NodeId, role: NodeRole, kv_blocks_total: usize) -> NodeInfo {
        NodeInfo {
            node_id,
            role,
            address: "in-process".into(),
            transfer_address: String::new(),
            model_fingerprint: self.model_fingerprint,
            block_size: self.block_size[usize::from(role == NodeRole::Decode)],
            kv_blocks_total,
        }
    }
}

impl Discovery for LocalDiscovery {
    fn nodes(&self, role: NodeRole) -> Vec<NodeEntry> {
        let handles = self.workers.read();
        match role {
            NodeRole::Prefill => handles
                .prefill
                .iter()
                .map(|(id, h)| NodeEntry {
                    info: self.entry(*id, role, h.kv_blocks_total()),
                    load: h.load(),
                })
                .collect(),
            NodeRole::Decode => handles
                .decode
                .iter()
                .map(|(id, h)| NodeEntry {
                    info: self.entry(*id, role, h.kv_blocks_total()),
                    load: h.load(),
                })
                .collect(),
            NodeRole::Router => Vec::new(),
        }
    }

    fn subscribe(&self) -> watch::Receiver<u64> {
        self.workers.inner.generation.subscribe()
    }
}

#[kvmesh_router::async_trait]
impl DecodeConnector for LocalWorkers {
    /// Submits to the decode worker's handle; in-process requests have no deadline (the
    /// workers end them when the client leaves). A worker that left the directory (switching
    /// roles or stopping) is `Unavailable`: the router tries another.
    async fn generate(
        &self,
        node: &NodeEntry,
        req: &GenerateRequest,
        placement: &Placement,
        _timeout: Duration,
    ) -> Result<DecodeEvents, WorkerError> {
        let id = node.info.node_id;
        let (decode, prefill, pull) = {
            let handles = self.read();
            let decode = handles
                .decode
                .get(&id)
                .cloned()
                .ok_or_else(|| WorkerError::Unavailable(format!("no decode worker {id}")))?;
            let prefill = placement
                .prefill
                .as_ref()
                .and_then(|p| handles.prefill.get(&p.node_id))
                .map(|h| h.clone().into());
            let pull = placement.pull.as_ref().and_then(|holder| {
                let source: ExportSource = match handles.decode.get(&holder.node_id) {
                    Some(h) => Arc::new(h.clone()),
                    None => Arc::new(handles.prefill.get(&holder.node_id)?.clone()),
                };
                Some(KvPull {
                    source,
                    blocks: holder.blocks,
                })
            });
            (decode, prefill, pull)
        };
        let events = decode.generate_pulling(req.clone(), prefill, pull)?;
        Ok(Box::pin(UnboundedReceiverStream::new(events).map(Ok)))
    }
}
