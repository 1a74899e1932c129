//! The prefill node's gRPC service (`kvmesh.v1.Prefill`) over a local [`PrefillHandle`].

use crate::worker::PrefillHandle;
use kvmesh_common::grpc::{self, pb};
use kvmesh_common::{ModelFingerprint, NodeId};
use kvmesh_transfer::{NetworkTransport, RdmaError, RdmaPeerInfo};
use kvmesh_worker::{wire, CancelToken, HolderDirectory, LearnPeer};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tonic::{Request, Response, Status};

pub struct PrefillService {
    handle: PrefillHandle,
    model_fingerprint: ModelFingerprint,
    learn_peer: LearnPeer,
    /// The node's transport when it has RDMA: callers may swap RDMA details with it.
    rdma: Option<Arc<NetworkTransport>>,
    /// Where to pull the prefixes that destinations hold (`None`: never pull).
    holders: Option<Arc<HolderDirectory>>,
    accepted: AtomicU64,
}

impl PrefillService {
    pub fn new(
        handle: PrefillHandle,
        model_fingerprint: ModelFingerprint,
        learn_peer: LearnPeer,
    ) -> Self {
        PrefillService {
            handle,
            model_fingerprint,
            learn_peer,
            rdma: None,
            holders: None,
            accepted: AtomicU64::new(0),
        }
    }

    /// Pulls from each request's destination the cached prefix it holds and this node lacks,
    /// when that beats recomputing it; `holders` connects to the destinations.
    pub fn with_pulls(mut self, holders: Arc<HolderDirectory>) -> Self {
        self.holders = Some(holders);
        self
    }

    /// Answers `RdmaConnect` over `transport` when it has RDMA (else refuses it).
    pub fn with_rdma(mut self, transport: Arc<NetworkTransport>) -> Self {
        self.rdma = transport.offers_rdma().then_some(transport);
        self
    }

    pub fn into_server(self) -> pb::prefill_server::PrefillServer<Self> {
        pb::prefill_server::PrefillServer::new(self)
    }
}

#[tonic::async_trait]
impl pb::prefill_server::Prefill for PrefillService {
    async fn prefill(
        &self,
        request: Request<pb::PrefillRequest>,
    ) -> Result<Response<pb::PrefillReply>, Status> {
        let (mut request, to) = wire::request_from_pb(request.into_inner())?;
        let addr: SocketAddr = to.transfer.parse().map_err(|_| {
            Status::invalid_argument(format!(
                "destination transfer address {:?} is not host:port",
                to.transfer
            ))
        })?;
        let destination = request.destination.node;
        (self.learn_peer)(destination, addr);
        if let (Some(holders), false) = (&self.holders, to.holder.is_empty()) {
            request.holder = holders.source(destination, &to.holder);
        }
        let request_id = request.request_id;
        // Dropping this call (the decode node cancelled, died or timed out) cancels the job.
        let _cancel_on_drop = CancelOnDrop(request.cancel.clone());
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.handle.prefill(request, tx)?;
        self.accepted.fetch_add(1, Ordering::Relaxed);
        let reply = tokio::task::spawn_blocking(move || rx.recv())
            .await
            .map_err(|e| Status::internal(format!("waiting for the prefill worker: {e}")))?
            .map_err(|_| Status::unavailable("the prefill worker stopped"))?;
        debug_assert_eq!(reply.request_id, request_id);
        let done = reply.result?;
        Ok(Response::new(wire::done_to_pb(&done)))
    }

    async fn info(
        &self,
        _request: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::InfoReply>, Status> {
        Ok(Response::new(pb::InfoReply {
            node_id: self.handle.node_id().0,
            model_fingerprint: self.model_fingerprint.0,
            kv_shape: Some(wire::kv_shape_to_pb(&self.handle.kv_shape())),
            rdma: self.rdma.is_some(),
        }))
    }

    async fn rdma_connect(
        &self,
        request: Request<pb::RdmaConnectRequest>,
    ) -> Result<Response<pb::RdmaConnectReply>, Status> {
        let Some(transport) = self.rdma.clone() else {
            return Err(Status::failed_precondition(
                "this prefill node has no RDMA device; KV goes over QUIC",
            ));
        };
        let m = request.into_inner();
        let theirs = wire::rdma_info_from_pb("RdmaConnectRequest", m.info)?;
        let peer = NodeId(m.node_id);
        // Verbs calls block in the device driver.
        let mine = tokio::task::spawn_blocking(move || -> Result<RdmaPeerInfo, RdmaError> {
            let mine = transport.rdma_prepare(peer)?;
            transport.rdma_connect(peer, theirs)?;
            Ok(mine)
        })
        .await
        .map_err(|e| Status::internal(format!("RDMA connect task: {e}")))?
        .map_err(|e| Status::unavailable(format!("RDMA connect with node {peer}: {e}")))?;
        tracing::info!(node = %peer, "KV to this decode node goes over RDMA");
        Ok(Response::new(pb::RdmaConnectReply {
            info: Some(wire::rdma_info_to_pb(&mine)),
        }))
    }

    async fn health(
        &self,
        _request: Request<pb::HealthRequest>,
    ) -> Result<Response<pb::HealthReply>, Status> {
        let h = &self.handle;
        let mut reply = grpc::health_reply(
            h.node_id(),
            !h.is_draining(),
            h.load(),
            self.accepted.load(Ordering::Relaxed),
        );
        reply.role = pb::NodeRole::Prefill as i32;
        Ok(Response::new(reply))
    }

    async fn drain(
        &self,
        _request: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::DrainReply>, Status> {
        self.handle.drain();
        Ok(Response::new(pb::DrainReply {}))
    }
}

struct CancelOnDrop(CancelToken);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}
