//! The router's [`Backend`] over the multi-process mesh: discovery names the live nodes, the
//! routing policy picks a decode node (and a prefill node for it), and `kvmesh.v1.Decode/
//! Generate` streams the tokens back.
//!
//! A node that refuses connections (it died and its lease has not expired yet) is skipped
//! for a short while and the request goes to the next candidate, so a crash costs no request
//! that had not started. Dropping the event receiver drops the RPC, which cancels the request
//! on the decode node and, through it, on the prefill node.

use crate::backend::Backend;
use crate::routing::{lock, InFlight, Routing};
use async_trait::async_trait;
use kvmesh_common::grpc::{self, pb, tag_request, PrefillTarget};
use kvmesh_common::{GenerateEvent, GenerateRequest, NodeId, NodeRole, WorkerError};
use kvmesh_kvstore::{Discovery, NodeEntry};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tonic::transport::{Channel, Endpoint};

type DecodeClient = pb::decode_client::DecodeClient<Channel>;

/// How the router reaches the mesh.
#[derive(Clone, Debug)]
pub struct RemoteConfig {
    pub connect_timeout: Duration,
    /// How long a node that refused a connection is left out of routing (it is usually dead
    /// and about to leave discovery).
    pub suspect_for: Duration,
    /// Decode nodes tried per request before giving up with 503.
    pub max_attempts: usize,
    /// Each request's deadline, sent with it (`grpc-timeout`): past it the decode node ends
    /// the request and cancels its prefill.
    pub request_timeout: Duration,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        RemoteConfig {
            connect_timeout: Duration::from_secs(1),
            suspect_for: Duration::from_secs(3),
            max_attempts: 3,
            request_timeout: Duration::from_secs(600),
        }
    }
}

pub struct RemoteBackend {
    discovery: Arc<dyn Discovery>,
    config: RemoteConfig,
    clients: Mutex<HashMap<NodeId, (String, DecodeClient)>>,
    suspects: Mutex<HashMap<NodeId, Instant>>,
    routing: Routing,
    draining: AtomicBool,
}

impl RemoteBackend {
    pub fn new(discovery: Arc<dyn Discovery>, config: RemoteConfig, routing: Routing) -> Self {
        RemoteBackend {
            discovery,
            config,
            clients: Mutex::new(HashMap::new()),
            suspects: Mutex::new(HashMap::new()),
            routing,
            draining: AtomicBool::new(false),
        }
    }

    /// Stops taking requests (`/health` turns 503) while open streams finish.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Live nodes of `role`, less the suspects and those already tried.
    fn candidates(&self, role: NodeRole, tried: &[NodeId]) -> Vec<NodeEntry> {
        let now = Instant::now();
        let mut suspects = lock(&self.suspects);
        suspects.retain(|_, until| *until > now);
        self.discovery
            .nodes(role)
            .into_iter()
            .filter(|n| !suspects.contains_key(&n.info.node_id) && !tried.contains(&n.info.node_id))
            .collect()
    }

    fn suspect(&self, node: NodeId) {
        lock(&self.suspects).insert(node, Instant::now() + self.config.suspect_for);
        lock(&self.clients).remove(&node);
    }

    fn client(&self, node: &NodeEntry) -> Result<DecodeClient, WorkerError> {
        let mut clients = lock(&self.clients);
        let id = node.info.node_id;
        if let Some((address, client)) = clients.get(&id) {
            if *address == node.info.address {
                return Ok(client.clone());
            }
        }
        let endpoint = Endpoint::from_shared(format!("http://{}", node.info.address))
            .map_err(|e| WorkerError::Internal(format!("decode node {id} has a bad address: {e}")))?
            .connect_timeout(self.config.connect_timeout)
            .tcp_nodelay(true);
        let client = DecodeClient::new(endpoint.connect_lazy());
        clients.insert(id, (node.info.address.clone(), client.clone()));
        Ok(client)
    }
}

#[async_trait]
impl Backend for RemoteBackend {
    async fn generate(
        &self,
        req: GenerateRequest,
    ) -> Result<mpsc::UnboundedReceiver<GenerateEvent>, WorkerError> {
        if self.draining.load(Ordering::Acquire) {
            return Err(WorkerError::Unavailable("the router is draining".into()));
        }
        let mut tried = Vec::new();
        let mut last_error = WorkerError::Unavailable("no decode node is registered".into());
        let prefill = self.candidates(NodeRole::Prefill, &[]);
        while tried.len() < self.config.max_attempts {
            let decode = self.candidates(NodeRole::Decode, &tried);
            let Some(route) = self.routing.route(&req.prompt, &decode, &prefill) else {
                break;
            };
            let id = route.decode;
            tried.push(id);
            let node = decode
                .iter()
                .find(|n| n.info.node_id == id)
                .expect("chosen");
            let target = route.prefill.and_then(|id| {
                let node = prefill.iter().find(|n| n.info.node_id == id)?;
                Some(PrefillTarget {
                    node_id: id,
                    address: node.info.address.clone(),
                })
            });
            let mut call = tonic::Request::new(grpc::generate_request_to_pb(&req, target.as_ref()));
            tag_request(&mut call, req.request_id);
            call.set_timeout(self.config.request_timeout);
            let in_flight = self.routing.track(id);
            let mut client = self.client(node)?;
            match client.generate(call).await {
                Ok(stream) => return Ok(forward(stream.into_inner(), in_flight)),
                Err(status) => {
                    let error = grpc::worker_error_from_status(&status);
                    if !matches!(error, WorkerError::Unavailable(_)) {
                        return Err(error);
                    }
                    tracing::warn!(request_id = %req.request_id, node = %id,
                        "decode node unavailable: {}; trying another", status.message());
                    self.suspect(id);
                    last_error = error;
                }
            }
        }
        Err(last_error)
    }

    fn is_ready(&self) -> bool {
        !self.draining.load(Ordering::Acquire) && !self.discovery.nodes(NodeRole::Decode).is_empty()
    }
}

/// Moves a Generate stream's events onto a channel until the last one, the end of the
/// stream, or the receiver going away (which drops the stream: the RPC is cancelled).
fn forward(
    mut stream: tonic::Streaming<pb::GenerateEvent>,
    in_flight: InFlight,
) -> mpsc::UnboundedReceiver<GenerateEvent> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let _in_flight = in_flight;
        loop {
            let message = tokio::select! {
                () = tx.closed() => return,
                m = stream.message() => m,
            };
            let event = match message {
                Ok(Some(m)) => GenerateEvent::try_from(m)
                    .unwrap_or_else(|e| GenerateEvent::Error(WorkerError::Internal(e.to_string()))),
                Ok(None) => GenerateEvent::Error(WorkerError::Unavailable(
                    "the decode node closed the stream before finishing".into(),
                )),
                Err(status) => GenerateEvent::Error(grpc::worker_error_from_status(&status)),
            };
            let last = !matches!(event, GenerateEvent::Token(_));
            if tx.send(event).is_err() || last {
                return;
            }
        }
    });
    rx
}
