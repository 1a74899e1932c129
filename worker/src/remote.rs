//! A prefill node across the network: the decode side of `kvmesh.v1.Prefill`.

use crate::client::PrefillClient;
use crate::request::{PrefillError, PrefillReply, PrefillRequest};
use crate::wire::{self, DestinationAddresses};
use crossbeam_channel::Sender;
use kvmesh_common::grpc::{pb, tag_request};
use kvmesh_common::tls::{grpc_endpoint, ClusterTls};
use kvmesh_common::NodeId;
use kvmesh_engine::runner::KvShape;
use kvmesh_transfer::RdmaPeerInfo;
use std::time::Duration;
use tonic::transport::Channel;

type Client = pb::prefill_client::PrefillClient<Channel>;

/// One prefill node. Each `prefill` runs as a task on `runtime`: the call is dropped (and so
/// cancelled on the prefill node) when the request's cancel token fires.
#[derive(Clone)]
pub struct RemotePrefill {
    node_id: NodeId,
    kv_shape: KvShape,
    client: Client,
    runtime: tokio::runtime::Handle,
    /// Where this (the decode) node receives KV and serves pulls; sent with every request.
    addresses: DestinationAddresses,
    /// The node answers `RdmaConnect`.
    offers_rdma: bool,
}

impl std::fmt::Debug for RemotePrefill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemotePrefill")
            .field("node_id", &self.node_id)
            .finish()
    }
}

impl RemotePrefill {
    /// Connects to the prefill node at `address` (host:port), over mutual TLS when `tls` is
    /// given, and asks what KV it produces. `addresses` say where this node receives KV and
    /// serves pulls. Call from within a tokio runtime; its tasks run there.
    pub async fn connect(
        address: &str,
        tls: Option<&ClusterTls>,
        addresses: DestinationAddresses,
        timeout: Duration,
    ) -> Result<RemotePrefill, PrefillError> {
        let unreachable = |e: &dyn std::fmt::Display| {
            PrefillError::Rpc(format!("prefill node at {address}: {e}"))
        };
        let endpoint = grpc_endpoint(address, tls)
            .map_err(|e| unreachable(&e))?
            .connect_timeout(timeout)
            .tcp_nodelay(true);
        let mut client = Client::new(endpoint.connect_lazy());
        let mut request = tonic::Request::new(pb::InfoRequest {});
        request.set_timeout(timeout);
        let info = client
            .info(request)
            .await
            .map_err(|s| unreachable(&s.message()))?
            .into_inner();
        let shape = info
            .kv_shape
            .ok_or_else(|| unreachable(&"its Info reply has no KV shape"))?;
        Ok(RemotePrefill {
            node_id: NodeId(info.node_id),
            kv_shape: wire::kv_shape_from_pb(&shape),
            client,
            runtime: tokio::runtime::Handle::current(),
            addresses,
            offers_rdma: info.rdma,
        })
    }

    /// Whether the node has RDMA and will swap connection details (`rdma_connect`).
    pub fn offers_rdma(&self) -> bool {
        self.offers_rdma
    }

    /// Sends this (decode) node's side of an RDMA connection; returns the prefill node's,
    /// which has connected to ours and from now on pushes our KV over RDMA.
    pub async fn rdma_connect(
        &self,
        decode_node: NodeId,
        mine: &RdmaPeerInfo,
    ) -> Result<RdmaPeerInfo, PrefillError> {
        let request = pb::RdmaConnectRequest {
            node_id: decode_node.0,
            info: Some(wire::rdma_info_to_pb(mine)),
        };
        let reply = self
            .client
            .clone()
            .rdma_connect(request)
            .await
            .map_err(|s| wire::error_from_status(&s))?
            .into_inner();
        wire::rdma_info_from_pb("RdmaConnectReply", reply.info)
            .map_err(|e| PrefillError::Rpc(e.to_string()))
    }
}

impl RemotePrefill {
    /// Whether the node that answered is the one discovery named (an address may be reused
    /// by a restarted node with a new id).
    pub fn node_id_matches(&self, expected: NodeId) -> bool {
        self.node_id == expected
    }
}

impl PrefillClient for RemotePrefill {
    fn node_id(&self) -> NodeId {
        self.node_id
    }

    fn kv_shape(&self) -> KvShape {
        self.kv_shape
    }

    fn prefill(
        &self,
        request: PrefillRequest,
        reply: Sender<PrefillReply>,
    ) -> Result<(), PrefillError> {
        let mut client = self.client.clone();
        let request_id = request.request_id;
        let cancel = request.cancel.clone();
        let mut call = tonic::Request::new(wire::request_to_pb(&request, &self.addresses));
        tag_request(&mut call, request_id);
        self.runtime.spawn(async move {
            let result = tokio::select! {
                r = client.prefill(call) => match r {
                    Ok(done) => wire::done_from_pb(done.into_inner())
                        .map_err(|e| PrefillError::Rpc(e.to_string())),
                    Err(status) => Err(wire::error_from_status(&status)),
                },
                () = cancel.cancelled() => Err(PrefillError::Cancelled),
            };
            // A decode worker that went away needs no answer.
            let _ = reply.send(PrefillReply { request_id, result });
        });
        Ok(())
    }
}
