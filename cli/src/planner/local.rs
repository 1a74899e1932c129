//! The `local` actuator: nodes as processes of this binary on this host.
//!
//! A start spawns `kvmesh prefill|decode` on a free loopback port, joined to the planner's
//! etcd and cluster, in its own process group (so a planner that crashes or stops leaves
//! the mesh as it is) with its log in `--logs`. A drain is the node's `Drain` RPC, a
//! switch its `SwitchRole` RPC: both work on any node discovery lists, whoever started it,
//! so a restarted planner manages the nodes its predecessor started.

use super::actuator::{Actuator, Move};
use crate::node::control::{node_channel, switch_role};
use anyhow::{Context, Result};
use kvmesh_common::grpc::pb;
use kvmesh_common::NodeRole;
use kvmesh_kvstore::NodeEntry;
use kvmesh_planner::Decision;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a drain or switch RPC may take to answer (a switch waits for the old role's
/// requests to finish).
const RPC_TIMEOUT: Duration = Duration::from_secs(120);

/// A started node that has not registered within this is no longer counted as starting
/// (its log says why), so the planner may start another.
const START_TIMEOUT: Duration = Duration::from_secs(180);

/// A node process this actuator started.
struct Started {
    child: Child,
    role: NodeRole,
    addr: String,
    at: Instant,
    /// Seen in discovery at least once.
    registered: bool,
}

pub struct LocalActuator {
    /// This binary.
    pub exe: PathBuf,
    pub etcd: Vec<String>,
    pub cluster: String,
    /// Extra flags for every node started (model, threads, engine limits).
    pub node_args: Vec<String>,
    /// Where each started node's log goes (`<role>-<port>.log`).
    pub logs: PathBuf,
    /// Children started, reaped as they exit (never killed: a drain ends them).
    children: Vec<Started>,
}

impl LocalActuator {
    pub fn new(
        exe: PathBuf,
        etcd: Vec<String>,
        cluster: String,
        node_args: Vec<String>,
        logs: PathBuf,
    ) -> Result<Self> {
        std::fs::create_dir_all(&logs)
            .with_context(|| format!("creating the node log directory {}", logs.display()))?;
        Ok(LocalActuator {
            exe,
            etcd,
            cluster,
            node_args,
            logs,
            children: Vec::new(),
        })
    }

    /// Starts one node; returns its gRPC address.
    fn start(&mut self, role: NodeRole) -> Result<String> {
        // The port is free now; the node binds it at once, and a race with another process
        // shows in its log and as a node that never registers.
        let addr = crate::local_cluster::free_addr("127.0.0.1")?;
        let log_path = self
            .logs
            .join(format!("{}-{}.log", role.as_str(), addr.port()));
        let log = std::fs::File::create(&log_path)
            .with_context(|| format!("creating {}", log_path.display()))?;
        let child = Command::new(&self.exe)
            .arg(role.as_str())
            .args(["--etcd", &self.etcd.join(",")])
            .args(["--cluster", &self.cluster])
            .args(["--listen", &addr.to_string()])
            .args(&self.node_args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting {} {}", self.exe.display(), role.as_str()))?;
        tracing::info!(role = role.as_str(), %addr, pid = child.id(), log = %log_path.display(), "started a node");
        self.children.push(Started {
            child,
            role,
            addr: addr.to_string(),
            at: Instant::now(),
            registered: false,
        });
        Ok(addr.to_string())
    }

    /// Forgets children that exited (a drained node exits 0).
    fn reap(&mut self) {
        self.children.retain_mut(|c| match c.child.try_wait() {
            Ok(Some(status)) => {
                tracing::info!(pid = c.child.id(), %status, "a node this planner started exited");
                false
            }
            _ => true,
        });
    }
}

/// Asks `node` to drain: it leaves routing at once and exits once its requests end.
pub async fn drain(node: &NodeEntry) -> Result<()> {
    let channel = node_channel(&node.info.address, None).await?;
    let mut call = tonic::Request::new(pb::DrainRequest {});
    call.set_timeout(RPC_TIMEOUT);
    let answer = match node.info.role {
        NodeRole::Prefill => pb::prefill_client::PrefillClient::new(channel)
            .drain(call)
            .await
            .map(|_| ()),
        _ => pb::decode_client::DecodeClient::new(channel)
            .drain(call)
            .await
            .map(|_| ()),
    };
    answer.map_err(|s| anyhow::anyhow!("{} refused to drain: {}", node.info.address, s.message()))
}

/// Asks `node` to serve `to` in place; returns once routers can see it there.
pub async fn switch(node: &NodeEntry, to: NodeRole) -> Result<()> {
    let channel = node_channel(&node.info.address, None).await?;
    let s = switch_role(channel, to, RPC_TIMEOUT).await?;
    tracing::info!(
        node = %node.info.node_id,
        to = to.as_str(),
        seconds = s.seconds,
        drain_seconds = s.drain_seconds,
        drained = s.drained,
        "switched a node's role"
    );
    Ok(())
}

#[kvmesh_router::async_trait]
impl Actuator for LocalActuator {
    fn name(&self) -> &'static str {
        "local"
    }

    fn starting(&mut self, registered: &[NodeEntry]) -> [u32; 2] {
        self.reap();
        let mut starting = [0, 0];
        for c in &mut self.children {
            c.registered |= registered.iter().any(|n| n.info.address == c.addr);
            if !c.registered && c.at.elapsed() < START_TIMEOUT {
                starting[usize::from(c.role == NodeRole::Decode)] += 1;
            }
        }
        starting
    }

    async fn apply(&mut self, _decision: &Decision, moves: &[Move]) -> Result<()> {
        self.reap();
        let mut first_error = None;
        let mut note = |r: Result<()>| {
            if let Err(e) = r {
                tracing::warn!("a planner move failed: {e:#}");
                first_error.get_or_insert(e);
            }
        };
        // Switches and drains run concurrently (each waits for its node's requests).
        let mut slow = tokio::task::JoinSet::new();
        for m in moves {
            match m {
                Move::Start(role) => note(self.start(*role).map(|_| ())),
                Move::Drain(node) => {
                    let node = node.clone();
                    slow.spawn(async move { drain(&node).await });
                }
                Move::Switch { node, to } => {
                    let (node, to) = (node.clone(), *to);
                    slow.spawn(async move { switch(&node, to).await });
                }
            }
        }
        while let Some(done) = slow.join_next().await {
            note(done.context("a planner move panicked").and_then(|r| r));
        }
        first_error.map_or(Ok(()), Err)
    }
}
