//! Pulls across the network: `kvmesh.v1.KvCache`, served by every node next to its role's
//! service ([`KvCacheService`]), and its client ([`RemoteExporter`]).

use crate::export::{
    ExportDone, ExportError, ExportReply, ExportRequest, ExportSource, KvExporter,
};
use crate::request::KvDestination;
use crossbeam_channel::Sender;
use kvmesh_common::grpc::{pb, tag_request, WireError};
use kvmesh_common::tls::{grpc_endpoint, ClusterTls};
use kvmesh_common::{BlockId, NodeId, RequestId, SequenceHash};
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

/// Tells the KV transport where a node receives (learned from each request that names it).
pub type LearnPeer = Arc<dyn Fn(NodeId, SocketAddr) + Send + Sync>;

/// The holder's side: hands each call to the local worker, which pushes the KV to the
/// caller's transfer address and answers.
pub struct KvCacheService {
    exporter: ExportSource,
    learn_peer: LearnPeer,
}

impl KvCacheService {
    /// `learn_peer` tells the transport where a caller receives KV.
    pub fn new(exporter: ExportSource, learn_peer: LearnPeer) -> Self {
        KvCacheService {
            exporter,
            learn_peer,
        }
    }

    pub fn into_server(self) -> pb::kv_cache_server::KvCacheServer<Self> {
        pb::kv_cache_server::KvCacheServer::new(self)
    }
}

#[tonic::async_trait]
impl pb::kv_cache_server::KvCache for KvCacheService {
    async fn export(
        &self,
        request: Request<pb::ExportKvRequest>,
    ) -> Result<Response<pb::ExportKvReply>, Status> {
        let (request, transfer_address) = request_from_pb(request.into_inner())?;
        let addr: SocketAddr = transfer_address.parse().map_err(|_| {
            Status::invalid_argument(format!(
                "destination transfer address {transfer_address:?} is not host:port"
            ))
        })?;
        (self.learn_peer)(request.destination.node, addr);
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.exporter.export(request, tx)?;
        let reply = tokio::task::spawn_blocking(move || rx.recv())
            .await
            .map_err(|e| Status::internal(format!("waiting for the worker: {e}")))?
            .map_err(|_| Status::unavailable("the worker stopped"))?;
        let done = reply.result?;
        Ok(Response::new(pb::ExportKvReply {
            blocks_sent: done.blocks as u32,
            bytes_sent: done.bytes,
        }))
    }
}

/// A holder across the network, as a puller sees it. Each export runs as a task on the
/// runtime it was made in.
#[derive(Clone)]
pub struct RemoteExporter {
    node_id: NodeId,
    client: pb::kv_cache_client::KvCacheClient<Channel>,
    runtime: tokio::runtime::Handle,
    /// Where this (the pulling) node receives KV; sent with every request.
    transfer_address: String,
    timeout: Duration,
}

impl std::fmt::Debug for RemoteExporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteExporter")
            .field("node_id", &self.node_id)
            .finish()
    }
}

impl RemoteExporter {
    /// A client of the node `node_id` at `address` (host:port; mutual TLS when `tls` is
    /// given), connecting on first use; each call may take `timeout`. Call within a tokio
    /// runtime.
    pub fn new(
        node_id: NodeId,
        address: &str,
        tls: Option<&ClusterTls>,
        transfer_address: String,
        timeout: Duration,
    ) -> Result<RemoteExporter, ExportError> {
        let endpoint = grpc_endpoint(address, tls)
            .map_err(|e| ExportError::Rpc(format!("node {node_id} at {address}: {e}")))?
            .connect_timeout(timeout)
            .tcp_nodelay(true);
        Ok(RemoteExporter {
            node_id,
            client: pb::kv_cache_client::KvCacheClient::new(endpoint.connect_lazy()),
            runtime: tokio::runtime::Handle::current(),
            transfer_address,
            timeout,
        })
    }
}

impl KvExporter for RemoteExporter {
    fn node_id(&self) -> NodeId {
        self.node_id
    }

    fn export(
        &self,
        request: ExportRequest,
        reply: Sender<ExportReply>,
    ) -> Result<(), ExportError> {
        let mut client = self.client.clone();
        let transfer_id = request.transfer_id;
        let mut call = Request::new(request_to_pb(&request, &self.transfer_address));
        tag_request(&mut call, transfer_id);
        call.set_timeout(self.timeout);
        self.runtime.spawn(async move {
            let result = match client.export(call).await {
                Ok(r) => {
                    let r = r.into_inner();
                    Ok(ExportDone {
                        blocks: r.blocks_sent as usize,
                        bytes: r.bytes_sent,
                    })
                }
                Err(status) => Err(error_from_status(&status)),
            };
            let _ = reply.send(ExportReply {
                transfer_id,
                result,
            });
        });
        Ok(())
    }
}

pub fn request_to_pb(r: &ExportRequest, transfer_address: &str) -> pb::ExportKvRequest {
    pb::ExportKvRequest {
        request_id: r.transfer_id.0,
        hashes: r.hashes.iter().map(|h| h.0).collect(),
        destination: Some(pb::KvDestination {
            node_id: r.destination.node.0,
            transfer_address: transfer_address.to_string(),
            blocks: r.destination.blocks.iter().map(|b| b.0).collect(),
        }),
    }
}

/// The request and the destination's transfer address.
pub fn request_from_pb(m: pb::ExportKvRequest) -> Result<(ExportRequest, String), WireError> {
    let dest = m
        .destination
        .ok_or_else(|| WireError::missing("ExportKvRequest", "destination"))?;
    let request = ExportRequest {
        transfer_id: RequestId(m.request_id),
        hashes: m.hashes.into_iter().map(SequenceHash).collect(),
        destination: KvDestination {
            node: NodeId(dest.node_id),
            blocks: dest.blocks.into_iter().map(BlockId).collect(),
        },
    };
    Ok((request, dest.transfer_address))
}

impl From<ExportError> for Status {
    fn from(e: ExportError) -> Self {
        let code = match &e {
            ExportError::InvalidRequest(_) => Code::InvalidArgument,
            ExportError::NotHeld => Code::NotFound,
            ExportError::Unavailable => Code::Unavailable,
            ExportError::Transfer(_) => Code::Aborted,
            ExportError::Engine(_) | ExportError::Rpc(_) => Code::Internal,
        };
        Status::new(code, e.to_string())
    }
}

fn error_from_status(s: &Status) -> ExportError {
    match s.code() {
        Code::NotFound => ExportError::NotHeld,
        Code::InvalidArgument => ExportError::InvalidRequest(s.message().to_string()),
        _ => ExportError::Rpc(format!("{:?}: {}", s.code(), s.message())),
    }
}

/// Connections to the nodes this one pulls cached KV from, made on first use and kept.
pub struct HolderDirectory {
    /// Where this node receives KV (told to every holder).
    transfer_address: String,
    tls: Option<ClusterTls>,
    timeout: Duration,
    holders: Mutex<HashMap<NodeId, (String, ExportSource)>>,
}

impl HolderDirectory {
    /// Holders are called over mutual TLS when `tls` is given; each call may take `timeout`.
    pub fn new(transfer_address: String, tls: Option<ClusterTls>, timeout: Duration) -> Self {
        HolderDirectory {
            transfer_address,
            tls,
            timeout,
            holders: Mutex::new(HashMap::new()),
        }
    }

    /// The node `node` serving pulls at `address`; `None` when the address is unusable
    /// (then the prefix is recomputed). Call within a tokio runtime.
    pub fn source(&self, node: NodeId, address: &str) -> Option<ExportSource> {
        let mut holders = self.holders.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((known, source)) = holders.get(&node) {
            if known == address {
                return Some(source.clone());
            }
        }
        let client = RemoteExporter::new(
            node,
            address,
            self.tls.as_ref(),
            self.transfer_address.clone(),
            self.timeout,
        );
        match client {
            Ok(c) => {
                let source: ExportSource = Arc::new(c);
                holders.insert(node, (address.to_string(), source.clone()));
                Some(source)
            }
            Err(e) => {
                tracing::warn!(%node, "{e}; not pulling from it");
                None
            }
        }
    }

    /// Forgets the nodes not in `alive` (they left the mesh).
    pub fn retain(&self, alive: &HashSet<NodeId>) {
        let mut holders = self.holders.lock().unwrap_or_else(|e| e.into_inner());
        holders.retain(|id, _| alive.contains(id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_requests_round_trip_and_errors_keep_their_meaning() {
        let r = ExportRequest {
            transfer_id: RequestId(77),
            hashes: vec![SequenceHash(1), SequenceHash(u64::MAX)],
            destination: KvDestination {
                node: NodeId(0x201),
                blocks: vec![BlockId(3), BlockId(8)],
            },
        };
        let (back, addr) = request_from_pb(request_to_pb(&r, "127.0.0.6:7000")).unwrap();
        assert_eq!((back, addr.as_str()), (r, "127.0.0.6:7000"));
        assert!(request_from_pb(pb::ExportKvRequest::default()).is_err());
        for e in [
            ExportError::NotHeld,
            ExportError::InvalidRequest("bad".into()),
        ] {
            let status = Status::from(e.clone());
            let back = error_from_status(&status);
            assert_eq!(std::mem::discriminant(&back), std::mem::discriminant(&e));
        }
    }
}
