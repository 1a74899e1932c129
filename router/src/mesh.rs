//! The router's [`Backend`] over a mesh of decode nodes, whatever reaches them: discovery
//! names the live nodes, the routing policy picks a decode node (and a prefill node for it),
//! and a [`DecodeConnector`] opens the request there (gRPC for the multi-process mesh, the
//! worker handles for `kvmesh serve`).
//!
//! A node that refuses a request as unavailable (it died and its lease has not expired yet,
//! or it is draining) is skipped for a short while and the request goes to the next
//! candidate, so a crash costs no request that had not started. A stream that breaks
//! mid-request (the decode node died or failed) is *migrated*: the prompt and the tokens
//! delivered so far go to another decode node, which recomputes their KV and continues after
//! them, so the client's stream goes on without a gap or a repeated token
//! (`MeshBackendConfig::max_migrations` bounds it). A stream that goes silent for many of its
//! node's steps after its first token counts as broken too: the node hung (see
//! [`crate::stream_idle`]). Dropping the event receiver drops the
//! node's stream, which cancels the request on the decode node and, through it, on the
//! prefill node.

use crate::backend::Backend;
use crate::metrics::metrics;
use crate::routing::{lock, Routing, Tracked};
use crate::stream_idle::{StepTimes, StreamIdleConfig};
use async_trait::async_trait;
use futures::stream::BoxStream;
use futures::StreamExt;
use kvmesh_common::grpc::{KvHolder, Placement, PrefillNode};
use kvmesh_common::{GenerateEvent, GenerateRequest, NodeId, NodeRole, WorkerError};
use kvmesh_kvstore::{Discovery, NodeEntry};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// How the backend reaches a decode node.
#[async_trait]
pub trait DecodeConnector: Send + Sync + 'static {
    /// Opens `req` on the decode node `node`, its prompt KV coming from `placement`, to end
    /// within `timeout`. `Err(WorkerError::Unavailable)`: the node cannot take it, another
    /// node may; any other error is the request's own.
    async fn generate(
        &self,
        node: &NodeEntry,
        req: &GenerateRequest,
        placement: &Placement,
        timeout: Duration,
    ) -> Result<DecodeEvents, WorkerError>;

    /// `node` refused a request or broke a stream: drop what is kept to reach it.
    fn suspect(&self, _node: NodeId) {}
}

/// A request's events from its decode node, until the last one (`Finished` or `Error`); a
/// stream that ends before it, or yields a [`BrokenStream`], broke.
pub type DecodeEvents = BoxStream<'static, Result<GenerateEvent, BrokenStream>>;

/// Why a decode node's stream broke under a request.
#[derive(Debug)]
pub struct BrokenStream {
    pub error: WorkerError,
    /// The request's deadline passed on the node: no other node would do better.
    pub deadline_passed: bool,
}

/// How the backend retries and migrates.
#[derive(Clone, Debug)]
pub struct MeshBackendConfig {
    /// How long a node that refused a request is left out of routing (it is usually dead
    /// and about to leave discovery).
    pub suspect_for: Duration,
    /// Decode nodes tried per request before giving up with 503.
    pub max_attempts: usize,
    /// Each request's deadline, sent with it: past it the decode node ends the request and
    /// cancels its prefill. Migrations do not extend it.
    pub request_timeout: Duration,
    /// How many times one request may move to another decode node after its stream broke.
    pub max_migrations: usize,
    /// How long a stream that has delivered a token may go silent before its node counts
    /// as hung and the request migrates.
    pub stream_idle: StreamIdleConfig,
}

impl Default for MeshBackendConfig {
    fn default() -> Self {
        MeshBackendConfig {
            suspect_for: Duration::from_secs(3),
            max_attempts: 3,
            request_timeout: Duration::from_secs(600),
            max_migrations: 3,
            stream_idle: StreamIdleConfig::default(),
        }
    }
}

pub struct MeshBackend<C> {
    mesh: Arc<Mesh<C>>,
}

/// What the request streams share: the relay of a broken stream opens the next one.
struct Mesh<C> {
    discovery: Arc<dyn Discovery>,
    connector: C,
    config: MeshBackendConfig,
    /// Nodes that refused, until when, and in which role they refused.
    suspects: Mutex<HashMap<NodeId, (Instant, NodeRole)>>,
    routing: Routing,
    draining: AtomicBool,
    /// The decode nodes' step times as their streams show them: they bound a stream's
    /// silence.
    step_times: Mutex<StepTimes>,
}

/// A request's stream open on one decode node.
struct Opened {
    node: NodeId,
    events: DecodeEvents,
    in_flight: Tracked,
    /// When the stream delivered its last event (`None` before its first).
    last_event: Option<Instant>,
}

impl<C: DecodeConnector> MeshBackend<C> {
    /// Routes over the nodes `discovery` names and reaches them through `connector`.
    pub fn with_connector(
        connector: C,
        discovery: Arc<dyn Discovery>,
        config: MeshBackendConfig,
        routing: Routing,
    ) -> Self {
        MeshBackend {
            mesh: Arc::new(Mesh {
                discovery,
                connector,
                step_times: Mutex::new(StepTimes::new(config.stream_idle)),
                config,
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

impl<C: DecodeConnector> Mesh<C> {
    /// Live nodes of `role`, less the suspects and those already tried.
    ///
    /// A suspect that has left `role`'s registrations is forgotten: it drained, switched
    /// roles or expired, and if it registers in `role` again it is a node that announced
    /// itself ready (a switch back), not the one that refused.
    fn candidates(&self, role: NodeRole, tried: &[NodeId]) -> Vec<NodeEntry> {
        let now = Instant::now();
        let nodes = self.discovery.nodes(role);
        let mut suspects = lock(&self.suspects);
        suspects.retain(|id, (until, refused_as)| {
            *until > now && (*refused_as != role || nodes.iter().any(|n| n.info.node_id == *id))
        });
        nodes
            .into_iter()
            .filter(|n| !suspects.contains_key(&n.info.node_id) && !tried.contains(&n.info.node_id))
            .collect()
    }

    /// `node` refused a call of its `role`: leave it out for `suspect_for`.
    fn suspect(&self, node: NodeId, role: NodeRole) {
        let until = Instant::now() + self.config.suspect_for;
        lock(&self.suspects).insert(node, (until, role));
        self.connector.suspect(node);
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
            // Counted on its node until its stream ends (and on its prefill node until its
            // first token): load reports lag a burst, and without this every request of the
            // burst would see the same idle node.
            let prefill = placement.prefill.as_ref().map(|p| p.node_id);
            let in_flight = self.routing.track_route(id, prefill);
            if attempt > 0 {
                metrics().decode_retries.increment(1);
            }
            match self
                .connector
                .generate(node, req, &placement, timeout)
                .await
            {
                Ok(events) => {
                    return Ok(Opened {
                        node: id,
                        events,
                        in_flight,
                        last_event: None,
                    })
                }
                Err(WorkerError::Unavailable(message)) => {
                    tracing::warn!(request_id = %req.request_id, node = %id,
                        "decode node unavailable: {message}; trying another");
                    self.suspect(id, NodeRole::Decode);
                    last_error = WorkerError::Unavailable(message);
                }
                Err(error) => return Err(error),
            }
        }
        Err(last_error)
    }
}

#[async_trait]
impl<C: DecodeConnector> Backend for MeshBackend<C> {
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
/// drops the stream: the request is cancelled). When the stream breaks first, the request
/// migrates to another decode node with the tokens delivered so far and the relay goes on
/// from there.
async fn relay<C: DecodeConnector>(
    mesh: Arc<Mesh<C>>,
    mut req: GenerateRequest,
    mut opened: Opened,
    mut tried: Vec<NodeId>,
    deadline: Instant,
    tx: mpsc::UnboundedSender<GenerateEvent>,
) {
    let mut migrations = 0;
    loop {
        let next = tokio::select! {
            () = tx.closed() => return,
            next = mesh.next_event(&mut opened) => next,
        };
        let broken = match next {
            Some(Ok(GenerateEvent::Token(t))) => {
                opened.in_flight.prefilled();
                req.resume.push(t.token);
                if tx.send(GenerateEvent::Token(t)).is_err() {
                    return;
                }
                continue;
            }
            Some(Ok(GenerateEvent::Error(e))) if is_migratable(&e) => e,
            Some(Ok(last)) => {
                let _ = tx.send(last);
                return;
            }
            Some(Err(BrokenStream {
                error,
                deadline_passed,
            })) => {
                if deadline_passed || !is_migratable(&error) {
                    let _ = tx.send(GenerateEvent::Error(error));
                    return;
                }
                error
            }
            None => WorkerError::Unavailable(
                "the decode node closed the stream before finishing".into(),
            ),
        };
        if migrations == mesh.config.max_migrations {
            let _ = tx.send(GenerateEvent::Error(broken));
            return;
        }
        migrations += 1;
        metrics().migrations.increment(1);
        tracing::warn!(request_id = %req.request_id, node = %opened.node,
            delivered = req.resume.len(), "decode stream broke ({broken}); migrating");
        mesh.suspect(opened.node, NodeRole::Decode);
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

impl<C: DecodeConnector> Mesh<C> {
    /// The stream's next event; once it has delivered one, a silence past its node's idle
    /// bound breaks it (`Unavailable`: the node is hung, not the request bad).
    async fn next_event(&self, opened: &mut Opened) -> Option<Result<GenerateEvent, BrokenStream>> {
        let node = opened.node;
        let Some(last) = opened.last_event else {
            let next = opened.events.next().await;
            opened.last_event = Some(Instant::now());
            return next;
        };
        let bound = lock(&self.step_times).idle_bound(node, Instant::now());
        let next = match tokio::time::timeout_at((last + bound).into(), opened.events.next()).await
        {
            Ok(next) => next,
            Err(_) => {
                metrics().stalled_streams.increment(1);
                return Some(Err(BrokenStream {
                    error: WorkerError::Unavailable(format!(
                        "decode node {node} sent nothing for {bound:?}: it is hung"
                    )),
                    deadline_passed: false,
                }));
            }
        };
        let now = Instant::now();
        if matches!(next, Some(Ok(GenerateEvent::Token(_)))) {
            lock(&self.step_times).observe(node, now - last, now);
        }
        opened.last_event = Some(now);
        next
    }
}

/// Failures of the node rather than of the request: another node may well succeed.
fn is_migratable(e: &WorkerError) -> bool {
    matches!(e, WorkerError::Unavailable(_) | WorkerError::Internal(_))
}
