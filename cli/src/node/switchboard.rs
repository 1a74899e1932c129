//! A node's front end: the gRPC services of both roles (`Decode`, `Prefill`), `KvCache` and
//! `Node`, served for the node's whole life. Each call goes to the worker of the role the
//! node serves now; a call for the other role, or one that arrives mid-switch, is refused
//! with `UNAVAILABLE`, so the router tries another decode node and a decode node prefills
//! locally. `Node.SwitchRole` checks the request against the node's [`RoleMachine`] and
//! hands it to the node's driver ([`super::lifecycle`]), which answers once the switch is
//! done.

use super::roles::Serving;
use kvmesh_common::grpc::{self, pb};
use kvmesh_common::{NodeId, NodeRole};
use kvmesh_decode::DecodeService;
use kvmesh_transfer::crossbeam_channel::Sender;
use kvmesh_worker::{
    ExportError, ExportReply, ExportRequest, KvExporter, RoleMachine, SwitchError, SwitchPlan,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, RwLock};
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
    machine: Mutex<RoleMachine>,
    /// The worker calls go to: the current role's, or mid-switch the old one's (draining, so
    /// it refuses new requests) until the new one starts.
    serving: RwLock<Serving>,
    /// Requests accepted by the services of workers that handed over, by role.
    retired_prefill: AtomicU64,
    retired_decode: AtomicU64,
    switches: mpsc::UnboundedSender<SwitchCall>,
    /// Wakes the driver when a shutdown is asked for.
    shutdown: Notify,
}

impl Switchboard {
    pub fn new(
        serving: Serving,
        switches: mpsc::UnboundedSender<SwitchCall>,
    ) -> anyhow::Result<Self> {
        let machine = RoleMachine::new(serving.role())?;
        let node_id = match &serving {
            Serving::Prefill(_, h) => h.node_id(),
            Serving::Decode(_, h) => h.node_id(),
        };
        Ok(Switchboard {
            node_id,
            machine: Mutex::new(machine),
            serving: RwLock::new(serving),
            retired_prefill: AtomicU64::new(0),
            retired_decode: AtomicU64::new(0),
            switches,
            shutdown: Notify::new(),
        })
    }

    pub fn machine(&self) -> std::sync::MutexGuard<'_, RoleMachine> {
        self.machine.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn serving(&self) -> Serving {
        self.serving
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Calls go to `next` from now on; `requests_total` is what the worker it replaces
    /// accepted (health replies keep counting from there).
    pub fn hand_over(&self, next: Serving, requests_total: u64) {
        let mut serving = self.serving.write().unwrap_or_else(|e| e.into_inner());
        self.retired(serving.role())
            .fetch_add(requests_total, Ordering::Relaxed);
        *serving = next;
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
        if self.machine().begin_shutdown() {
            tracing::info!("drain requested");
        }
        self.serving().drain();
        self.shutdown.notify_one();
    }

    pub fn is_shutting_down(&self) -> bool {
        self.machine().state() == kvmesh_worker::RoleState::ShuttingDown
    }

    /// Resolves once a shutdown has been asked for (also one asked for before the call).
    pub async fn shutdown_asked(&self) {
        while !self.is_shutting_down() {
            self.shutdown.notified().await;
        }
    }

    /// The services of `role` when the node serves it now, else why not.
    fn serving_as(&self, role: NodeRole) -> Result<Serving, Status> {
        let serving = self.serving();
        match self.machine().state() {
            kvmesh_worker::RoleState::Serving(r) if r == role => Ok(serving),
            kvmesh_worker::RoleState::Serving(r) => Err(Status::unavailable(format!(
                "node {} serves the {} role, not {}",
                self.node_id,
                r.as_str(),
                role.as_str()
            ))),
            kvmesh_worker::RoleState::Switching { from, to } => Err(Status::unavailable(format!(
                "node {} is switching from {} to {}",
                self.node_id,
                from.as_str(),
                to.as_str()
            ))),
            kvmesh_worker::RoleState::ShuttingDown => Err(Status::unavailable(format!(
                "node {} is draining",
                self.node_id
            ))),
        }
    }

    /// `Health` as asked of `role`'s service: serving only while the node serves `role` and
    /// is not draining; requests counted over every time it served `role`.
    async fn health(&self, role: NodeRole) -> Result<Response<pb::HealthReply>, Status> {
        let retired = self.retired(role).load(Ordering::Relaxed);
        let state = self.machine().state();
        let now = match state {
            kvmesh_worker::RoleState::Serving(r) => Some(r),
            _ => None,
        };
        let serving = self.serving();
        let mut reply = match (&serving, now == Some(role)) {
            (Serving::Decode(service, _), true) => {
                pb::decode_server::Decode::health(&**service, Request::new(pb::HealthRequest {}))
                    .await?
                    .into_inner()
            }
            (Serving::Prefill(service, _), true) => {
                pb::prefill_server::Prefill::health(&**service, Request::new(pb::HealthRequest {}))
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
            .field("state", &self.machine().state())
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
        match self.serving_as(NodeRole::Decode)? {
            Serving::Decode(service, _) => {
                pb::decode_server::Decode::generate(&*service, request).await
            }
            Serving::Prefill(..) => unreachable!("serving_as checked the role"),
        }
    }

    async fn health(
        &self,
        _request: Request<pb::HealthRequest>,
    ) -> Result<Response<pb::HealthReply>, Status> {
        Switchboard::health(self, NodeRole::Decode).await
    }

    async fn drain(
        &self,
        _request: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::DrainReply>, Status> {
        Switchboard::drain(self)
    }
}

#[tonic::async_trait]
impl pb::prefill_server::Prefill for Switchboard {
    async fn prefill(
        &self,
        request: Request<pb::PrefillRequest>,
    ) -> Result<Response<pb::PrefillReply>, Status> {
        match self.serving_as(NodeRole::Prefill)? {
            Serving::Prefill(service, _) => {
                pb::prefill_server::Prefill::prefill(&*service, request).await
            }
            Serving::Decode(..) => unreachable!("serving_as checked the role"),
        }
    }

    async fn info(
        &self,
        request: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::InfoReply>, Status> {
        match self.serving_as(NodeRole::Prefill)? {
            Serving::Prefill(service, _) => {
                pb::prefill_server::Prefill::info(&*service, request).await
            }
            Serving::Decode(..) => unreachable!("serving_as checked the role"),
        }
    }

    async fn rdma_connect(
        &self,
        request: Request<pb::RdmaConnectRequest>,
    ) -> Result<Response<pb::RdmaConnectReply>, Status> {
        match self.serving_as(NodeRole::Prefill)? {
            Serving::Prefill(service, _) => {
                pb::prefill_server::Prefill::rdma_connect(&*service, request).await
            }
            Serving::Decode(..) => unreachable!("serving_as checked the role"),
        }
    }

    async fn health(
        &self,
        _request: Request<pb::HealthRequest>,
    ) -> Result<Response<pb::HealthReply>, Status> {
        Switchboard::health(self, NodeRole::Prefill).await
    }

    async fn drain(
        &self,
        _request: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::DrainReply>, Status> {
        Switchboard::drain(self)
    }
}

#[tonic::async_trait]
impl pb::node_server::Node for Switchboard {
    async fn switch_role(
        &self,
        request: Request<pb::SwitchRoleRequest>,
    ) -> Result<Response<pb::SwitchRoleReply>, Status> {
        let to = grpc::node_role_from_pb("SwitchRoleRequest", request.into_inner().to)?;
        let asked_at = Instant::now();
        let plan = self.machine().begin_switch(to).map_err(switch_status)?;
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
