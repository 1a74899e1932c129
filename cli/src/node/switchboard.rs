//! A node's front end: the gRPC services of both roles (`Decode`, `Prefill`), `KvCache` and
//! `Node`, served for the node's whole life. Each call goes to the worker of the role the
//! node serves now; a call for the other role, or one that arrives mid-switch, is refused
//! with `UNAVAILABLE`, so the router tries another decode node and a decode node prefills
//! locally. `Node.SwitchRole` checks the request against the node's [`RoleMachine`] and
//! hands it to the node's driver ([`super::lifecycle`]), which answers once the switch is
//! done.

use super::roles::Serving;
use kvmesh_common::grpc::{self, pb};
use kvmesh_common::tls::{Authorizer, CallerRole};
use kvmesh_common::{NodeId, NodeRole};
use kvmesh_decode::DecodeService;
use kvmesh_prefill::PrefillService;
use kvmesh_transfer::crossbeam_channel::Sender;
use kvmesh_worker::{
    ExportError, ExportReply, ExportRequest, KvCacheService, KvExporter, RoleMachine, RoleState,
    SwitchError, SwitchPlan,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::{mpsc, oneshot, Notify};
use tonic::{Request, Response, Status};

/// A switch the driver is to carry out.
pub struct SwitchCall {
    pub to: NodeRole,
    pub asked_at: Instant,
    /// Where the outcome goes (nobody may be listening any more: the switch goes on).
    /// FAILED_PRECONDITION when a shutdown began meanwhile, INTERNAL when the new role's
    /// worker could not start.
    pub reply: oneshot::Sender<Result<SwitchDone, Status>>,
}

/// A finished switch.
#[derive(Clone, Copy, Debug)]
pub struct SwitchDone {
    pub role: NodeRole,
    pub drained: bool,
    pub seconds: f64,
    pub drain_seconds: f64,
}

pub struct Switchboard {
    node_id: NodeId,
    /// The role state and the worker calls go to, changed together: mid-switch the worker is
    /// the old role's (draining, so it refuses new requests) until the new one takes over.
    now: Mutex<Now>,
    /// Requests accepted by the services of workers that handed over, by role.
    retired_prefill: AtomicU64,
    retired_decode: AtomicU64,
    switches: mpsc::UnboundedSender<SwitchCall>,
    /// Wakes the driver when a shutdown is asked for.
    shutdown: Notify,
    /// Which caller may make which call (by the roles in its certificate).
    auth: Arc<Authorizer>,
}

struct Now {
    machine: RoleMachine,
    serving: Serving,
}

impl Switchboard {
    /// `auth` decides which callers may make which calls.
    pub fn new(
        serving: Serving,
        switches: mpsc::UnboundedSender<SwitchCall>,
        auth: Arc<Authorizer>,
    ) -> anyhow::Result<Self> {
        let machine = RoleMachine::new(serving.role())?;
        let node_id = match &serving {
            Serving::Prefill(_, h) => h.node_id(),
            Serving::Decode(_, h) => h.node_id(),
        };
        Ok(Switchboard {
            node_id,
            now: Mutex::new(Now { machine, serving }),
            retired_prefill: AtomicU64::new(0),
            retired_decode: AtomicU64::new(0),
            switches,
            shutdown: Notify::new(),
            auth,
        })
    }

    fn now(&self) -> std::sync::MutexGuard<'_, Now> {
        self.now.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn state(&self) -> RoleState {
        self.now().machine.state()
    }

    /// The worker calls go to now.
    pub fn serving(&self) -> Serving {
        self.now().serving.clone()
    }

    /// Ends the switch in progress: calls go to `next` from now on (`requests_total` is what
    /// the worker it replaces accepted; health replies keep counting from there). False, and
    /// `next` is not used, when a shutdown began meanwhile.
    pub fn finish_switch(&self, next: Serving, requests_total: u64) -> bool {
        let mut now = self.now();
        if now.machine.finish_switch().is_err() {
            return false;
        }
        self.retired(now.serving.role())
            .fetch_add(requests_total, Ordering::Relaxed);
        now.serving = next;
        true
    }

    fn retired(&self, role: NodeRole) -> &AtomicU64 {
        match role {
            NodeRole::Prefill => &self.retired_prefill,
            _ => &self.retired_decode,
        }
    }

    /// Starts draining for shutdown (a signal or `Drain`): the worker stops taking requests
    /// and the driver takes the node out of the mesh.
    pub fn shut_down(&self) {
        let serving = {
            let mut now = self.now();
            if now.machine.begin_shutdown() {
                tracing::info!("drain requested");
            }
            now.serving.clone()
        };
        serving.drain();
        self.shutdown.notify_one();
    }

    /// Resolves once a shutdown has been asked for (also one asked for before the call).
    pub async fn shutdown_asked(&self) {
        while self.state() != RoleState::ShuttingDown {
            self.shutdown.notified().await;
        }
    }

    /// The decode service, while the node serves the decode role.
    fn decode(&self) -> Result<Arc<DecodeService>, Status> {
        let now = self.now();
        match (now.machine.serving(), &now.serving) {
            (Some(NodeRole::Decode), Serving::Decode(service, _)) => Ok(service.clone()),
            _ => Err(self.refusal(now.machine.state(), NodeRole::Decode)),
        }
    }

    /// The prefill service, while the node serves the prefill role.
    fn prefill(&self) -> Result<Arc<PrefillService>, Status> {
        let now = self.now();
        match (now.machine.serving(), &now.serving) {
            (Some(NodeRole::Prefill), Serving::Prefill(service, _)) => Ok(service.clone()),
            _ => Err(self.refusal(now.machine.state(), NodeRole::Prefill)),
        }
    }

    /// Why a call for `role` is refused in `state`.
    fn refusal(&self, state: RoleState, role: NodeRole) -> Status {
        let node = self.node_id;
        Status::unavailable(match state {
            RoleState::Serving(r) => format!(
                "node {node} serves the {} role, not {}",
                r.as_str(),
                role.as_str()
            ),
            RoleState::Switching { from, to } => format!(
                "node {node} is switching from {} to {}",
                from.as_str(),
                to.as_str()
            ),
            RoleState::ShuttingDown => format!("node {node} is draining"),
        })
    }

    /// `Health` as asked of `role`'s service: serving only while the node serves `role` and
    /// is not draining; requests counted over every time it served `role`.
    async fn health(&self, role: NodeRole) -> Result<Response<pb::HealthReply>, Status> {
        let retired = self.retired(role).load(Ordering::Relaxed);
        let (now, serving) = {
            let now = self.now();
            (now.machine.serving(), now.serving.clone())
        };
        let ask = || Request::new(pb::HealthRequest {});
        let mut reply = match (&serving, now == Some(role)) {
            (Serving::Decode(service, _), true) => {
                pb::decode_server::Decode::health(&**service, ask())
                    .await?
                    .into_inner()
            }
            (Serving::Prefill(service, _), true) => {
                pb::prefill_server::Prefill::health(&**service, ask())
                    .await?
                    .into_inner()
            }
            _ => grpc::health_reply(self.node_id, false, serving.load(), 0),
        };
        reply.requests_total += retired;
        reply.role = now.map_or(pb::NodeRole::Unspecified, grpc::node_role_to_pb) as i32;
        Ok(Response::new(reply))
    }

    fn drain(&self) -> Result<Response<pb::DrainReply>, Status> {
        self.shut_down();
        Ok(Response::new(pb::DrainReply {}))
    }
}

impl std::fmt::Debug for Switchboard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Switchboard")
            .field("node_id", &self.node_id)
            .field("state", &self.state())
            .finish()
    }
}

/// Pulls of this node's cache go to whichever worker holds the engine now.
impl KvExporter for Switchboard {
    fn node_id(&self) -> NodeId {
        self.node_id
    }

    fn export(
        &self,
        request: ExportRequest,
        reply: Sender<ExportReply>,
    ) -> Result<(), ExportError> {
        self.serving().exporter().export(request, reply)
    }
}

type GenerateStream = <DecodeService as pb::decode_server::Decode>::GenerateStream;

#[tonic::async_trait]
impl pb::decode_server::Decode for Switchboard {
    type GenerateStream = GenerateStream;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<GenerateStream>, Status> {
        self.auth.check(
            &request,
            &[CallerRole::Router, CallerRole::Admin],
            "Generate",
        )?;
        pb::decode_server::Decode::generate(&*self.decode()?, request).await
    }

    async fn health(
        &self,
        _request: Request<pb::HealthRequest>,
    ) -> Result<Response<pb::HealthReply>, Status> {
        Switchboard::health(self, NodeRole::Decode).await
    }

    async fn drain(
        &self,
        request: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::DrainReply>, Status> {
        self.auth.check(&request, &[CallerRole::Admin], "Drain")?;
        Switchboard::drain(self)
    }
}

#[tonic::async_trait]
impl pb::prefill_server::Prefill for Switchboard {
    async fn prefill(
        &self,
        request: Request<pb::PrefillRequest>,
    ) -> Result<Response<pb::PrefillReply>, Status> {
        self.auth
            .check(&request, &[CallerRole::Decode], "Prefill")?;
        if let Some(d) = &request.get_ref().destination {
            self.auth.bind_destination(&request, NodeId(d.node_id))?;
        }
        pb::prefill_server::Prefill::prefill(&*self.prefill()?, request).await
    }

    async fn info(
        &self,
        request: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::InfoReply>, Status> {
        pb::prefill_server::Prefill::info(&*self.prefill()?, request).await
    }

    async fn rdma_connect(
        &self,
        request: Request<pb::RdmaConnectRequest>,
    ) -> Result<Response<pb::RdmaConnectReply>, Status> {
        self.auth
            .check(&request, &[CallerRole::Decode], "RdmaConnect")?;
        // The ring it pins is for the caller's own node: it may not claim another's.
        self.auth
            .bind_destination(&request, NodeId(request.get_ref().node_id))?;
        pb::prefill_server::Prefill::rdma_connect(&*self.prefill()?, request).await
    }

    async fn health(
        &self,
        _request: Request<pb::HealthRequest>,
    ) -> Result<Response<pb::HealthReply>, Status> {
        Switchboard::health(self, NodeRole::Prefill).await
    }

    async fn drain(
        &self,
        request: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::DrainReply>, Status> {
        self.auth.check(&request, &[CallerRole::Admin], "Drain")?;
        Switchboard::drain(self)
    }
}

#[tonic::async_trait]
impl pb::node_server::Node for Switchboard {
    async fn switch_role(
        &self,
        request: Request<pb::SwitchRoleRequest>,
    ) -> Result<Response<pb::SwitchRoleReply>, Status> {
        self.auth
            .check(&request, &[CallerRole::Admin], "SwitchRole")?;
        let to = grpc::node_role_from_pb("SwitchRoleRequest", request.into_inner().to)?;
        let asked_at = Instant::now();
        let plan = self.now().machine.begin_switch(to).map_err(switch_status)?;
        if let SwitchPlan::AlreadyServing(role) = plan {
            return Ok(Response::new(pb::SwitchRoleReply {
                role: grpc::node_role_to_pb(role) as i32,
                switched: false,
                drained: true,
                seconds: 0.0,
                drain_seconds: 0.0,
            }));
        }
        let (reply, done) = oneshot::channel();
        let call = SwitchCall {
            to,
            asked_at,
            reply,
        };
        if self.switches.send(call).is_err() {
            return Err(Status::unavailable("the node is stopping"));
        }
        let done = done
            .await
            .map_err(|_| Status::internal("the node stopped during the switch"))??;
        Ok(Response::new(pb::SwitchRoleReply {
            role: grpc::node_role_to_pb(done.role) as i32,
            switched: true,
            drained: done.drained,
            seconds: done.seconds,
            drain_seconds: done.drain_seconds,
        }))
    }
}

fn switch_status(e: SwitchError) -> Status {
    match e {
        SwitchError::NotAWorkerRole(_) => Status::invalid_argument(e.to_string()),
        SwitchError::InProgress { .. } | SwitchError::ShuttingDown => {
            Status::failed_precondition(e.to_string())
        }
    }
}

/// `KvCache` as the node serves it: pulls only from prefill and decode nodes, each naming
/// only itself as the KV destination (see [`Authorizer::bind_destination`]).
pub struct GuardedKvCache {
    pub inner: KvCacheService,
    pub auth: Arc<Authorizer>,
}

#[tonic::async_trait]
impl pb::kv_cache_server::KvCache for GuardedKvCache {
    async fn export(
        &self,
        request: Request<pb::ExportKvRequest>,
    ) -> Result<Response<pb::ExportKvReply>, Status> {
        let pullers = [CallerRole::Prefill, CallerRole::Decode];
        self.auth.check(&request, &pullers, "KvCache.Export")?;
        if let Some(d) = &request.get_ref().destination {
            self.auth.bind_destination(&request, NodeId(d.node_id))?;
        }
        pb::kv_cache_server::KvCache::export(&self.inner, request).await
    }
}
