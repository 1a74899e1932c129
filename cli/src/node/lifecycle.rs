//! The life of a prefill or decode node process. It serves its front end
//! ([`Switchboard`]) on `--listen` from start to end, registers the role it serves, reports
//! load, and:
//!
//! - on `Node.SwitchRole`, leaves the mesh in its old role (revokes the lease: routers stop
//!   sending within a watch round trip), lets the old worker finish what it accepted (up to
//!   `--drain-timeout`; past it the router migrates what is still open), takes the engine
//!   back from it, starts the other role's worker over the same engine (weights and KV pool
//!   kept), registers in the new role and answers;
//! - on SIGINT/SIGTERM or `Drain`, leaves the mesh, drains the worker and stops.

use super::metrics::{PublisherMetrics, RoleMetrics};
use super::roles::{RoleKit, RoleWorker, Serving};
use super::switchboard::{GuardedKvCache, SwitchCall, SwitchDone, Switchboard};
use super::KvPublisherSlot;
use crate::node::config::MeshNodeConfig;
use anyhow::{Context, Result};
use kvmesh_common::grpc::{self, pb};
use kvmesh_common::tls::{Authorizer, ClusterTls};
use kvmesh_common::NodeInfo;
use kvmesh_engine::llm_engine::LlmEngine;
use kvmesh_engine::runner::ModelRunner;
use kvmesh_kvstore::{EtcdDiscovery, KvEventPublisher, NodeLease};
use kvmesh_transfer::crossbeam_channel::Receiver;
use kvmesh_worker::{KvCacheService, RoleState};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tonic::Status;

/// Runs the node until it has drained after a signal or `Drain`. `info` names the role it
/// starts in; `kit` starts either role's worker over `engine`.
pub async fn run_node<R: ModelRunner + 'static>(
    args: &MeshNodeConfig,
    tls: Option<&ClusterTls>,
    discovery: &EtcdDiscovery,
    mut info: NodeInfo,
    kv_events: &KvPublisherSlot,
    kit: RoleKit,
    engine: LlmEngine<R>,
) -> Result<()> {
    let node = info.node_id;
    let (first, mut returned) = kit.start(info.role, engine)?;
    let (switch_tx, mut switches) = mpsc::unbounded_channel();
    let auth = Arc::new(Authorizer::new(tls).context("the cluster CA for authorizing calls")?);
    let board = Arc::new(Switchboard::new(
        first.serving().clone(),
        switch_tx,
        auth.clone(),
    )?);
    if let Some(addr) = args.metrics_listen {
        super::metrics::serve(addr, Some(board.clone()))?;
    }
    let mut worker = Some(first);
    let role_metrics = RoleMetrics::new(node);
    let (server, stop) = serve_front(&board, &kit, args.listen()?, tls, auth)?;
    tracing::info!(%node, role = info.role.as_str(), "serving");
    {
        let board = board.clone();
        tokio::spawn(async move {
            crate::serve::shutdown_signal().await;
            board.shut_down();
        });
    }

    // A switch answers once the node is registered in its new role.
    let mut answer: Option<(SwitchCall, SwitchDone)> = None;
    while let Some(current) = &worker {
        info.role = current.role();
        let lease = match &answer {
            None => register(discovery, info.clone(), kv_events).await?,
            Some(_) => match register_after_switch(discovery, &info, kv_events, &board).await {
                Some(lease) => lease,
                None => {
                    if let Some((call, _)) = answer.take() {
                        let _ = call.reply.send(Err(Status::failed_precondition(
                            "the node is draining for shutdown",
                        )));
                    }
                    break;
                }
            },
        };
        role_metrics.serving(Some(info.role));
        if let Some((call, mut done)) = answer.take() {
            done.seconds = call.asked_at.elapsed().as_secs_f64();
            role_metrics.switched(done.role, done.seconds);
            tracing::info!(%node, role = done.role.as_str(), seconds = done.seconds,
                drain_seconds = done.drain_seconds, "switched roles");
            let _ = call.reply.send(Ok(done));
        }
        let next = serve_lease(&lease, kv_events, &board, &mut switches).await;
        leave(lease, kv_events).await;
        let Some(call) = next else {
            break;
        };
        role_metrics.serving(None);
        tracing::info!(%node, from = info.role.as_str(), to = call.to.as_str(),
            "switching roles: left the mesh; finishing the accepted requests");
        let old = worker.take().expect("the loop runs while a worker serves");
        match flip(old, &returned, &board, &kit, args.drain_timeout).await {
            Ok(Some((next, back, done))) => {
                worker = Some(next);
                returned = back;
                answer = Some((call, done));
            }
            // A shutdown began meanwhile: the old worker has drained, the node stops.
            Ok(None) => {
                let _ = call.reply.send(Err(Status::failed_precondition(
                    "the node is draining for shutdown",
                )));
            }
            Err(status) => {
                let failed = anyhow::anyhow!("switching roles: {}", status.message());
                let _ = call.reply.send(Err(status));
                board.shut_down();
                let _ = stop.send(());
                return Err(failed);
            }
        }
    }
    // Switches asked for as the shutdown began.
    while let Ok(call) = switches.try_recv() {
        let _ = call.reply.send(Err(Status::failed_precondition(
            "the node is draining for shutdown",
        )));
    }
    if let Some(worker) = worker {
        let drained = drain(worker, args.drain_timeout).await?;
        tracing::info!(%node, finished = drained.finished, seconds = drained.seconds,
            requests_total = drained.requests_total, "drained; stopping");
    }
    let _ = stop.send(());
    server.await?.context("gRPC server")
}

/// The front end's server task, and what stops it.
type Front = (
    JoinHandle<Result<(), tonic::transport::Error>>,
    oneshot::Sender<()>,
);

/// Serves the node's front end on `listen` (mutual TLS with `tls`) until `stop` is sent.
fn serve_front(
    board: &Arc<Switchboard>,
    kit: &RoleKit,
    listen: SocketAddr,
    tls: Option<&ClusterTls>,
    auth: Arc<Authorizer>,
) -> Result<Front> {
    // Bound here, not in the server's task: a taken port fails the node's start, where it
    // would otherwise register in the mesh and answer nothing.
    let incoming = tonic::transport::server::TcpIncoming::bind(listen)
        .with_context(|| format!("binding the gRPC address {listen}"))?
        .with_nodelay(Some(true));
    let (stop, stopped) = oneshot::channel::<()>();
    // Keepalive from this side too: a caller that hangs (a stopped router) has its streams
    // dropped, which cancels its requests and frees their KV.
    let mut server = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(grpc::KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(grpc::KEEPALIVE_TIMEOUT));
    if let Some(tls) = tls {
        server = server
            .tls_config(tls.grpc_server())
            .context("gRPC server TLS")?;
    }
    let kv_cache = pb::kv_cache_server::KvCacheServer::new(GuardedKvCache {
        inner: KvCacheService::new(board.clone(), kit.learn.clone()),
        auth,
    });
    if tls.is_none() {
        // Said once at start-up is easily missed; an open control plane is worth repeating.
        tokio::spawn(async {
            let mut every = tokio::time::interval(Duration::from_secs(600));
            every.tick().await;
            loop {
                every.tick().await;
                tracing::warn!(
                    "still no --tls-ca/--tls-cert/--tls-key: any caller that reaches this node \
                     can drain it, switch its role and send it requests and KV"
                );
            }
        });
    }
    let server = server
        .add_service(pb::decode_server::DecodeServer::from_arc(board.clone()))
        .add_service(pb::prefill_server::PrefillServer::from_arc(board.clone()))
        .add_service(kv_cache)
        .add_service(pb::node_server::NodeServer::from_arc(board.clone()))
        .serve_with_incoming_shutdown(incoming, async {
            let _ = stopped.await;
        });
    tracing::info!(%listen, "gRPC: Decode, Prefill, KvCache, Node");
    Ok((tokio::spawn(server), stop))
}

/// A role's worker started over the engine the old one handed back, the receiver its own
/// engine will come back on, and how the switch went so far.
type Flipped<R> = (RoleWorker, Receiver<LlmEngine<R>>, SwitchDone);

/// The middle of a switch, once the node has left the mesh: drains the old role's worker,
/// takes its engine back and starts the new role's worker over it (to be registered).
/// `None` when a shutdown began meanwhile; an error (for the caller of the switch) when the
/// engine did not come back or the new worker did not start.
async fn flip<R: ModelRunner + 'static>(
    old: RoleWorker,
    returned: &Receiver<LlmEngine<R>>,
    board: &Switchboard,
    kit: &RoleKit,
    timeout: Duration,
) -> Result<Option<Flipped<R>>, Status> {
    let drain = drain(old, timeout)
        .await
        .map_err(|e| Status::internal(format!("draining the old role's worker: {e:#}")))?;
    let Ok(engine) = returned.try_recv() else {
        return Err(Status::internal(
            "the old role's worker did not hand back its engine (its thread panicked)",
        ));
    };
    let RoleState::Switching { to, .. } = board.state() else {
        return Ok(None); // a shutdown began
    };
    let (next, back) = kit
        .start(to, engine)
        .map_err(|e| Status::internal(format!("starting the {} worker: {e:#}", to.as_str())))?;
    if !board.finish_switch(next.serving().clone(), drain.requests_total) {
        // A shutdown began while the worker started; it has taken nothing (the node is not
        // registered), so it stops at once.
        let _ = tokio::task::spawn_blocking(move || next.drain_and_join(Duration::ZERO)).await;
        return Ok(None);
    }
    let done = SwitchDone {
        role: to,
        drained: drain.finished,
        seconds: 0.0,
        drain_seconds: drain.seconds,
    };
    Ok(Some((next, back, done)))
}

/// Registers `info` and starts publishing the node's prefix-cache changes under its lease.
async fn register(
    discovery: &EtcdDiscovery,
    info: NodeInfo,
    kv_events: &KvPublisherSlot,
) -> Result<NodeLease> {
    let (node, role) = (info.node_id, info.role);
    let lease = discovery.register(info).await.map_err(|e| {
        let hint = match e {
            kvmesh_kvstore::StoreError::AlreadyRegistered(_) => {
                " (a certificate from `kvmesh certs` is one node's and gives it its id; \
                 replicas that share a certificate need one made with --shared)"
            }
            _ => "",
        };
        anyhow::anyhow!("registering {} node {node}: {e}{hint}", role.as_str())
    })?;
    tracing::info!(%node, role = role.as_str(), "registered");
    kv_events.install(KvEventPublisher::start(&lease));
    Ok(lease)
}

/// Registers in the role the node switched to. While etcd cannot take the registration
/// (unreachable, or a key of that role whose revoke failed not yet expired) the node keeps
/// trying, as its lease task would, until a shutdown is asked for (`None`).
async fn register_after_switch(
    discovery: &EtcdDiscovery,
    info: &NodeInfo,
    kv_events: &KvPublisherSlot,
    board: &Switchboard,
) -> Option<NodeLease> {
    let mut pause = Duration::from_millis(100);
    loop {
        match register(discovery, info.clone(), kv_events).await {
            Ok(lease) => return Some(lease),
            Err(e) => tracing::warn!("{e:#}; trying again in {pause:?}"),
        }
        tokio::select! {
            () = board.shutdown_asked() => return None,
            () = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(Duration::from_secs(2));
    }
}

/// Leaves the mesh at once: routers stop sending within a watch round trip, and the node's
/// prefix-index entries go with the lease.
async fn leave(lease: NodeLease, kv_events: &KvPublisherSlot) {
    let node = lease.node_id();
    kv_events.retire();
    if let Err(e) = lease.revoke().await {
        tracing::warn!("revoking the lease: {e}; the node leaves when it expires");
    }
    tracing::info!(%node, "left the mesh");
}

/// Reports load until a shutdown or a switch is asked for (`None`: shutdown).
async fn serve_lease(
    lease: &NodeLease,
    kv_events: &KvPublisherSlot,
    board: &Switchboard,
    switches: &mut mpsc::UnboundedReceiver<SwitchCall>,
) -> Option<SwitchCall> {
    let mut publisher_metrics = PublisherMetrics::new(lease.node_id());
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            biased;
            () = board.shutdown_asked() => return None,
            Some(call) = switches.recv() => return Some(call),
            _ = tick.tick() => {
                lease.report_load(board.serving().load());
                if let Some(stats) = kv_events.stats() {
                    publisher_metrics.update(&stats);
                }
            }
        }
    }
}

/// How a worker's drain went.
struct Drained {
    finished: bool,
    seconds: f64,
    /// What its service accepted over its life.
    requests_total: u64,
}

/// Drains `worker` (blocking, off the runtime) within `timeout`.
async fn drain(worker: RoleWorker, timeout: Duration) -> Result<Drained> {
    let serving = worker.serving().clone();
    let started = Instant::now();
    let finished = tokio::task::spawn_blocking(move || worker.drain_and_join(timeout)).await?;
    if !finished {
        tracing::warn!(
            "drain timeout ({timeout:?}) passed; stopped with requests open (the router \
             moves them to other nodes)"
        );
    }
    Ok(Drained {
        finished,
        seconds: started.elapsed().as_secs_f64(),
        requests_total: requests_total(&serving).await,
    })
}

async fn requests_total(serving: &Serving) -> u64 {
    let ask = || tonic::Request::new(pb::HealthRequest {});
    let reply = match serving {
        Serving::Prefill(service, _) => {
            pb::prefill_server::Prefill::health(&**service, ask()).await
        }
        Serving::Decode(service, _) => pb::decode_server::Decode::health(&**service, ask()).await,
    };
    reply.map_or(0, |r| r.into_inner().requests_total)
}
