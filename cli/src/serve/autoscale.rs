//! `kvmesh serve --autoscale`: the planner core inside the serving process.
//!
//! Every `observe_every` it reads the in-process workers (running and waiting requests, KV
//! blocks in use, prompt tokens queued, as their threads publish them) and the router's own counters and histograms
//! (rendered in-process, differenced over the interval), as `kvmesh planner` reads a mesh
//! through etcd and `/metrics`; when the policy's interval is due it decides, logs one line
//! and exports `kvmesh_planner_*`. The [`InProcessActuator`] carries decisions out on the
//! [`LocalMesh`]: a role switch moves a worker's engine to the other role (drain, flip, no
//! weight load), a start adds a worker over the shared weights, a removal drains one and
//! frees its KV pool.

pub mod config;

use super::in_process::LocalDiscovery;
use super::mesh::{LocalMesh, LocalMeshConfig};
use crate::planner::actuator::{Actuator, Move};
use crate::planner::metrics::PlannerMetrics;
use crate::planner::observe::{self, RouterTotals};
use crate::planner::{act, decide_round};
use anyhow::Result;
use kvmesh_common::NodeRole;
use kvmesh_kvstore::{Discovery, InMemoryPrefixIndex};
use kvmesh_planner::{Decision, Planner, PlannerConfig, RoleBounds};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// The workers `kvmesh serve --autoscale` starts with, `[prefill, decode]`: those configured,
/// brought within the planner's bounds (it would restore a minimum, or remove the excess, at
/// its first decision anyway).
pub fn starting_workers(configured: [usize; 2], planner: &PlannerConfig) -> [usize; 2] {
    let within = |n: usize, b: RoleBounds| n.clamp(b.min as usize, b.max as usize);
    [
        within(configured[0], planner.prefill),
        within(configured[1], planner.decode),
    ]
}

/// Brings the worker counts of `mesh` within the planner's bounds, saying so when it changes
/// them (below 8 cores serve starts no prefill worker, and a prefill minimum of 1 starts
/// one).
pub fn fit_workers(mesh: &mut LocalMeshConfig, planner: &PlannerConfig) {
    let configured = [mesh.prefill_workers, mesh.decode_workers];
    let [prefill, decode] = starting_workers(configured, planner);
    if [prefill, decode] != configured {
        tracing::info!(
            "autoscale: starting {prefill} prefill and {decode} decode workers instead of {} \
             and {}: the planner keeps each role within its bounds (prefill {}..={}, decode \
             {}..={}); below 8 cores the workers share the same cores",
            configured[0],
            configured[1],
            planner.prefill.min,
            planner.prefill.max,
            planner.decode.min,
            planner.decode.max,
        );
    }
    mesh.prefill_workers = prefill;
    mesh.decode_workers = decode;
}

/// The planner's task in a serving process.
pub struct Autoscaler {
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<()>>,
}

impl Autoscaler {
    /// Starts observing every `every` and deciding, on the runtime this is called on.
    pub fn start(
        config: PlannerConfig,
        every: Duration,
        discovery: Arc<LocalDiscovery>,
        actuator: InProcessActuator,
    ) -> Autoscaler {
        tracing::info!(
            policy = ?config.policy,
            prefill = format!("{}..={}", config.prefill.min, config.prefill.max),
            decode = format!("{}..={}", config.decode.min, config.decode.max),
            budget = config.budget,
            advisory = config.advisory,
            "autoscale: the planner runs in this process"
        );
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(run(config, every, discovery, actuator, stopped));
        Autoscaler { stop, task }
    }

    /// Stops it, after the decision being carried out (if any) is done.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        match self.task.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!("autoscale: {e:#}"),
            Err(e) => tracing::warn!("autoscale: {e}"),
        }
    }
}

/// Observes and decides every `every` until `stop` fires; the decision being carried out
/// then is finished first.
async fn run(
    config: PlannerConfig,
    every: Duration,
    discovery: Arc<LocalDiscovery>,
    mut actuator: InProcessActuator,
    mut stop: oneshot::Receiver<()>,
) -> Result<()> {
    let mut planner = Planner::new(config).map_err(|e| anyhow::anyhow!("{e}"))?;
    let metrics = PlannerMetrics::new();
    // The only planner of this mesh: it leads for the process's life.
    metrics.leader.set(1.0);
    let start = Instant::now();
    let mut last = router_totals();
    let mut observed_at = Instant::now();
    let mut observer = observe::Observer::default();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = &mut stop => return Ok(()),
        }
        let prefill = discovery.nodes(NodeRole::Prefill);
        let decode = discovery.nodes(NodeRole::Decode);
        let totals = router_totals();
        let window = totals.since(&last);
        last = totals;
        let elapsed = observed_at.elapsed();
        observed_at = Instant::now();
        let obs = observer.observe(&prefill, &decode, &window, elapsed);
        if let Some(decision) = decide_round(&mut planner, start.elapsed(), obs, elapsed, &metrics)
        {
            act(&decision, &prefill, &decode, &mut actuator, &metrics).await;
        }
    }
}

/// The router's counters and histograms now, from this process's recorder.
fn router_totals() -> RouterTotals {
    let mut totals = RouterTotals::default();
    totals.add_page(&kvmesh_router::metrics_exporter().render());
    totals
}

/// Carries decisions out on the workers of this process.
pub struct InProcessActuator {
    pub mesh: Arc<LocalMesh>,
    /// The router's prefix index: a removed worker's blocks leave it.
    pub index: Arc<InMemoryPrefixIndex>,
}

#[kvmesh_router::async_trait]
impl Actuator for InProcessActuator {
    fn name(&self) -> &'static str {
        "in-process"
    }

    /// One move after the other, off the runtime (a switch or a removal waits for the
    /// worker's requests to finish).
    async fn apply(&mut self, _decision: &Decision, moves: &[Move]) -> Result<()> {
        let mesh = self.mesh.clone();
        let index = self.index.clone();
        let moves = moves.to_vec();
        tokio::task::spawn_blocking(move || carry_out(&mesh, &index, &moves)).await?
    }
}

/// Makes each move; every one is tried, the first failure is returned.
fn carry_out(mesh: &LocalMesh, index: &InMemoryPrefixIndex, moves: &[Move]) -> Result<()> {
    let mut first_error = None;
    for m in moves {
        let done = match m {
            Move::Switch { node, to } => {
                let id = node.info.node_id;
                mesh.switch(id, *to).map(|d| {
                    tracing::info!(node = %id, to = to.as_str(), seconds = d.seconds,
                        finished = d.finished, "autoscale: switched a worker's role");
                })
            }
            Move::Drain(node) => {
                let id = node.info.node_id;
                mesh.remove(id).map(|d| {
                    index.remove_node(id);
                    tracing::info!(node = %id, role = node.info.role.as_str(), seconds = d.seconds,
                        finished = d.finished, "autoscale: drained and stopped a worker");
                })
            }
            Move::Start(role) => mesh.add(*role).map(|id| {
                tracing::info!(node = %id, role = role.as_str(), "autoscale: started a worker");
            }),
        };
        if let Err(e) = done {
            tracing::warn!("autoscale: {m:?}: {e}");
            first_error.get_or_insert(anyhow::Error::from(e));
        }
    }
    first_error.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_starting_workers_are_brought_within_the_planners_bounds() {
        let planner = PlannerConfig {
            prefill: RoleBounds { min: 1, max: 2 },
            decode: RoleBounds { min: 2, max: 3 },
            ..PlannerConfig::default()
        };
        // Below 8 cores serve starts no prefill worker; a minimum of 1 starts one.
        assert_eq!(starting_workers([0, 1], &planner), [1, 2]);
        assert_eq!(starting_workers([4, 5], &planner), [2, 3]);
        assert_eq!(starting_workers([2, 2], &planner), [2, 2]);
        // A prefill role that may go to zero starts as configured.
        let planner = PlannerConfig {
            prefill: RoleBounds { min: 0, max: 2 },
            ..planner
        };
        assert_eq!(starting_workers([0, 1], &planner), [0, 2]);
    }
}
