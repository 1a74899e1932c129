//! The multi-process mesh: the [`MeshBackend`] reaching its decode nodes over gRPC
//! (`kvmesh.v1.Decode/Generate`), with the request's deadline as `grpc-timeout`. Dropping a
//! request's events drops the RPC, which cancels it on the decode node.

use crate::mesh::{BrokenStream, DecodeConnector, DecodeEvents, MeshBackend, MeshBackendConfig};
use crate::routing::{lock, Routing};
use async_trait::async_trait;
use futures::StreamExt;
use kvmesh_common::grpc::{self, pb, tag_request, Placement};
use kvmesh_common::tls::{grpc_endpoint, ClusterTls};
use kvmesh_common::{GenerateEvent, GenerateRequest, NodeId, WorkerError};
use kvmesh_kvstore::{Discovery, NodeEntry};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tonic::transport::Channel;
use tonic::Code;

type DecodeClient = pb::decode_client::DecodeClient<Channel>;

/// How the router reaches the multi-process mesh.
#[derive(Clone, Debug)]
pub struct RemoteConfig {
    pub connect_timeout: Duration,
    /// Mutual TLS to the decode nodes (the cluster CA and this router's certificate); `None`
    /// for plaintext gRPC.
    pub tls: Option<ClusterTls>,
    pub mesh: MeshBackendConfig,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        RemoteConfig {
            connect_timeout: Duration::from_secs(1),
            tls: None,
            mesh: MeshBackendConfig::default(),
        }
    }
}

/// The router's backend over the multi-process mesh.
pub type RemoteBackend = MeshBackend<GrpcConnector>;

impl RemoteBackend {
    pub fn new(discovery: Arc<dyn Discovery>, config: RemoteConfig, routing: Routing) -> Self {
        let connector = GrpcConnector::new(config.connect_timeout, config.tls);
        MeshBackend::with_connector(connector, discovery, config.mesh, routing)
    }
}

/// Opens requests on decode nodes over gRPC, one lazily connected channel per node.
pub struct GrpcConnector {
    connect_timeout: Duration,
    tls: Option<ClusterTls>,
    clients: Mutex<HashMap<NodeId, (String, DecodeClient)>>,
}

impl GrpcConnector {
    pub fn new(connect_timeout: Duration, tls: Option<ClusterTls>) -> Self {
        GrpcConnector {
            connect_timeout,
            tls,
            clients: Mutex::new(HashMap::new()),
        }
    }

    fn client(&self, node: &NodeEntry) -> Result<DecodeClient, WorkerError> {
        let mut clients = lock(&self.clients);
        let id = node.info.node_id;
        if let Some((address, client)) = clients.get(&id) {
            if *address == node.info.address {
                return Ok(client.clone());
            }
        }
        let endpoint = grpc_endpoint(&node.info.address, self.tls.as_ref())
            .map_err(|e| WorkerError::Internal(format!("decode node {id} has a bad address: {e}")))?
            .connect_timeout(self.connect_timeout)
            .tcp_nodelay(true);
        let client = DecodeClient::new(endpoint.connect_lazy());
        clients.insert(id, (node.info.address.clone(), client.clone()));
        Ok(client)
    }
}

#[async_trait]
impl DecodeConnector for GrpcConnector {
    async fn generate(
        &self,
        node: &NodeEntry,
        req: &GenerateRequest,
        placement: &Placement,
        timeout: Duration,
    ) -> Result<DecodeEvents, WorkerError> {
        let mut call = tonic::Request::new(grpc::generate_request_to_pb(req, placement));
        tag_request(&mut call, req.request_id);
        call.set_timeout(timeout);
        let stream = self
            .client(node)?
            .generate(call)
            .await
            .map_err(|status| grpc::worker_error_from_status(&status))?
            .into_inner();
        Ok(stream.map(event_from_pb).boxed())
    }

    fn suspect(&self, node: NodeId) {
        lock(&self.clients).remove(&node);
    }
}

fn event_from_pb(
    message: Result<pb::GenerateEvent, tonic::Status>,
) -> Result<GenerateEvent, BrokenStream> {
    match message {
        Ok(m) => GenerateEvent::try_from(m).map_err(|e| BrokenStream {
            error: WorkerError::Internal(e.to_string()),
            deadline_passed: false,
        }),
        Err(status) => Err(BrokenStream {
            error: grpc::worker_error_from_status(&status),
            deadline_passed: status.code() == Code::DeadlineExceeded,
        }),
    }
}
