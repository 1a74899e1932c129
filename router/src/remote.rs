//! The router's [`Backend`] over the multi-process mesh: discovery names the live nodes, the
//! routing policy picks a decode node (and a prefill node for it), and `kvmesh.v1.Decode/
//! Generate` streams the tokens back.
//!
//! A node that refuses connections (it died and its lease has not expired yet) is skipped
//! for a short while and the request goes to the next candidate, so a crash costs no request
//! that had not started. A stream that breaks mid-request (the decode node died or failed) is
//! *migrated*: the prompt and the tokens delivered so far go to another decode node, which
//! recomputes their KV and continues after them, so the client's stream goes on without a gap
//! or a repeated token (`RemoteConfig::max_migrations` bounds it). Dropping the event
//! receiver drops the RPC, which cancels the request on the decode node and, through it, on
//! the prefill node.

use crate::backend::Backend;
use crate::metrics::metrics;
use crate::routing::{lock, Routing, Tracked};
use async_trait::async_trait;
use kvmesh_common::grpc::{self, pb, tag_request, KvHolder, Placement, PrefillNode};
use kvmesh_common::tls::{grpc_endpoint, ClusterTls};
use kvmesh_common::{GenerateEvent, GenerateRequest, NodeId, NodeRole, WorkerError};
use kvmesh_kvstore::{Discovery, NodeEntry};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tonic::transport::Channel;
use tonic::Code;

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
    /// the request and cancels its prefill. Migrations do not extend it.
    pub request_timeout: Duration,
    /// How many times one request may move to another decode node after its stream broke.
    pub max_migrations: usize,
    /// Mutual TLS to the decode nodes (the cluster CA and this router's certificate); `None`
    /// for plaintext gRPC.
    pub tls: Option<ClusterTls>,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        RemoteConfig {
            connect_timeout: Duration::from_secs(1),
            suspect_for: Duration::from_secs(3),
            max_attempts: 3,
            request_timeout: Duration::from_secs(600),
            max_migrations: 3,
            tls: None,
        }
    }
}

pub struct RemoteBackend {
    mesh: Arc<Mesh>,
}

/// What the request streams share: the relay of a broken stream opens the next one.
struct Mesh {
    discovery: Arc<dyn Discovery>,
    config: RemoteConfig,
    clients: Mutex<HashMap<NodeId, (String, DecodeClient)>>,
    suspects: Mutex<HashMap<NodeId, Instant>>,
    routing: Routing,
    draining: AtomicBool,
}

/// A Generate stream open on one decode node.
struct Opened {
    node: NodeId,
    stream: tonic::Streaming<pb::GenerateEvent>,
    in_flight: Tracked,
}

impl RemoteBackend {
    pub fn new(discovery: Arc<dyn Discovery>, config: RemoteConfig, routing: Routing) -> Self {
        RemoteBackend {
            mesh: Arc::new(Mesh {
                discovery,
                config,
                clients: Mutex::new(HashMap::new()),
                suspects: Mutex::new(HashMap::new()),
                routing,
                draining: AtomicBool::new(false),
            }),
        }
    }

    /// Stops taking requests (`/health` turns 503) while open streams finish.
    pub fn drain(&self) {
        self.mesh.draining.store(true, Ordering::Release);
    }
}

impl Mesh {
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
        let endpoint = grpc_endpoint(&node.info.address, self.config.tls.as_ref())
            .map_err(|e| WorkerError::Internal(format!("decode node {id} has a bad address: {e}")))?
            .connect_timeout(self.config.connect_timeout)
            .tcp_nodelay(true);
        let client = DecodeClient::new(endpoint.connect_lazy());
        clients.insert(id, (node.info.address.clone(), client.clone()));
        Ok(client)
    }

    /// Opens `req` on the best decode node not in `tried` (which it extends), moving on to
    /// the next one while nodes are unavailable, up to `max_attempts` of them.
    async fn open(
        &self,
        req: &GenerateRequest,
        tried: &mut Vec<NodeId>,
        deadline: Instant,
    ) -> Result<Opened, WorkerError> {
        let mut last_error = WorkerError::Unavailable("no decode node is registered".into());
        // A migrated request is routed by everything its KV will hold.
        let tokens: std::borrow::Cow<[_]> = if req.resume.is_empty() {
            (&req.prompt[..]).into()
        } else {
            [&req.prompt[..], &req.resume[..]].concat().into()
        };
        // The decode node recomputes a migrated request itself (see `GenerateRequest::resume`).
        let prefill = if req.resume.is_empty() {
            self.candidates(NodeRole::Prefill, &[])
        } else {
            Vec::new()
        };
        for attempt in 0..self.config.max_attempts {
            let Some(timeout) = deadline.checked_duration_since(Instant::now()) else {
                return Err(WorkerError::Unavailable(
                    "the request's deadline passed".into(),
                ));
            };
            let decode = self.candidates(NodeRole::Decode, tried);
            let Some(route) = self.routing.route(&tokens, &decode, &prefill) else {
                break;
            };
            let id = route.decode;
            tried.push(id);
            let node = decode
                .iter()
                .find(|n| n.info.node_id == id)
                .expect("chosen");
            let address_of = |id: NodeId| {
                let mut live = decode.iter().chain(&prefill);
                live.find(|n| n.info.node_id == id)
                    .map(|n| n.info.address.clone())
            };
            let placement = Placement {
                prefill: route.prefill.and_then(|id| {
                    Some(PrefillNode {
                        node_id: id,
                        address: address_of(id)?,
                    })
                }),
                pull: route.pull.and_then(|(id, blocks)| {
                    Some(KvHolder {
                        node_id: id,
                        address: address_of(id)?,
                        blocks,
                    })
                }),
            };
            let mut call = tonic::Request::new(grpc::generate_request_to_pb(req, &placement));
            tag_request(&mut call, req.request_id);
            call.set_timeout(timeout);
            let prefill = placement.prefill.as_ref().map(|p| p.node_id);
            let in_flight = self.routing.track_route(id, prefill);
            if attempt > 0 {
                metrics().decode_retries.increment(1);
            }
            match self.client(node)?.generate(call).await {
                Ok(stream) => {
                    return Ok(Opened {
                        node: id,
                        stream: stream.into_inner(),
                        in_flight,
                    })
                }
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
}

#[async_trait]
impl Backend for RemoteBackend {
    async fn generate(
        &self,
        req: GenerateRequest,
    ) -> Result<mpsc::UnboundedReceiver<GenerateEvent>, WorkerError> {
        let mesh = &self.mesh;
        if mesh.draining.load(Ordering::Acquire) {
            return Err(WorkerError::Unavailable("the router is draining".into()));
        }
        let deadline = Instant::now() + mesh.config.request_timeout;
        let mut tried = Vec::new();
        let opened = mesh.open(&req, &mut tried, deadline).await?;
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(relay(mesh.clone(), req, opened, tried, deadline, tx));
        Ok(rx)
    }

    fn is_ready(&self) -> bool {
        !self.mesh.draining.load(Ordering::Acquire)
            && !self.mesh.discovery.nodes(NodeRole::Decode).is_empty()
    }
}

/// Moves a request's events onto `tx` until the last one or the receiver going away (which
/// drops the stream: the RPC is cancelled). When the stream breaks first, the request migrates
/// to another decode node with the tokens delivered so far and the relay goes on from there.
async fn relay(
    mesh: Arc<Mesh>,
    mut req: GenerateRequest,
    mut opened: Opened,
    mut tried: Vec<NodeId>,
    deadline: Instant,
    tx: mpsc::UnboundedSender<GenerateEvent>,
) {
    let mut migrations = 0;
    loop {
        let message = tokio::select! {
            () = tx.closed() => return,
            m = opened.stream.message() => m,
        };
        let broken = match message {
            Ok(Some(m)) => match GenerateEvent::try_from(m) {
                Ok(GenerateEvent::Token(t)) => {
                    opened.in_flight.prefilled();
                    req.resume.push(t.token);
                    if tx.send(GenerateEvent::Token(t)).is_err() {
                        return;
                    }
                    continue;
                }
                Ok(GenerateEvent::Error(e)) if is_migratable(&e) => e,
                Ok(last) => {
                    let _ = tx.send(last);
                    return;
                }
                Err(e) => WorkerError::Internal(e.to_string()),
            },
            Ok(None) => WorkerError::Unavailable(
                "the decode node closed the stream before finishing".into(),
            ),
            Err(status) => {
                let error = grpc::worker_error_from_status(&status);
                if status.code() == Code::DeadlineExceeded || !is_migratable(&error) {
                    let _ = tx.send(GenerateEvent::Error(error));
                    return;
                }
                error
            }
        };
        if migrations == mesh.config.max_migrations {
            let _ = tx.send(GenerateEvent::Error(broken));
            return;
        }
        migrations += 1;
        metrics().migrations.increment(1);
        tracing::warn!(request_id = %req.request_id, node = %opened.node,
            delivered = req.resume.len(), "decode stream broke ({broken}); migrating");
        mesh.suspect(opened.node);
        let next = tokio::select! {
            () = tx.closed() => return,
            next = mesh.open(&req, &mut tried, deadline) => next,
        };
        match next {
            Ok(o) => opened = o,
            Err(e) => {
                let _ = tx.send(GenerateEvent::Error(e));
                return;
            }
        }
    }
}

/// Failures of the node rather than of the request: another node may well succeed.
fn is_migratable(e: &WorkerError) -> bool {
    matches!(e, WorkerError::Unavailable(_) | WorkerError::Internal(_))
}
