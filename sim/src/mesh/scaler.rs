//! The planner's loop in the mesh: every interval, an [`Observation`] of the mesh as the real
//! mesh publishes it, the planner's [`Decision`], and the actuator's answer to it (see
//! [`crate::autoscale`]).

use super::lifecycle::{node_role, Life};
use super::{Event, Mesh};
use crate::autoscale::RouterWindow;
use kvmesh_common::NodeRole;
use kvmesh_planner::{
    ConfigError, Decision, Observation, Planner, PlannerConfig, Role, StepSample,
};
use std::time::Duration;

/// Steps each node keeps for the next observation (its latest; the model refits to a
/// window of a few hundred over all nodes).
pub(super) const STEPS_KEPT: usize = 16;

pub(super) struct Scaler {
    planner: Planner,
    /// What the router saw since the last tick.
    pub window: RouterWindow,
    last_tick: Duration,
    /// The last window's means, kept while a window has none to measure.
    mean_prompt: f64,
    mean_output: f64,
    hit_rate: f64,
}

impl Scaler {
    pub fn new(config: PlannerConfig) -> Result<Scaler, ConfigError> {
        Ok(Scaler {
            planner: Planner::new(config)?,
            window: RouterWindow::default(),
            last_tick: Duration::ZERO,
            mean_prompt: 0.0,
            mean_output: 0.0,
            hit_rate: 0.0,
        })
    }

    pub fn interval(&self) -> Duration {
        self.planner.config().interval()
    }

    /// A token reached its client at `now`: the first (no `last` before it) is a TTFT, the
    /// others a gap, as the router's histograms record them.
    pub fn token(&mut self, last: Option<Duration>, sent: Duration, now: Duration) {
        match last {
            None => self.window.ttft.record(now - sent),
            Some(last) => self.window.itl.record(now - last),
        }
    }
}

fn ratio(num: u64, den: u64) -> Option<f64> {
    (den > 0).then(|| num as f64 / den as f64)
}

impl Mesh<'_> {
    /// The planner's tick: observe, decide, act; the next tick is due only while anything
    /// else can still happen.
    pub(super) fn plan(&mut self, now: Duration) {
        // The observation reads each node's latest steps and delivered tokens.
        self.touch_all();
        let observation = self.observation(now);
        let s = self
            .scaler
            .as_mut()
            .expect("only a mesh with a planner plans");
        s.planner.observe(now, observation);
        let decision = s.planner.decide(now);
        let interval = s.interval();
        self.ledger_mut().decided(&decision);
        if decision.acted() {
            self.apply(&decision, now);
        }
        if !self.queue.is_empty() {
            self.queue.push_in(interval, Event::Plan);
        }
    }

    /// The mesh as it publishes itself: the router's window, the serving nodes' loads and
    /// step metrics, discovery's counts.
    fn observation(&mut self, now: Duration) -> Observation {
        let s = self
            .scaler
            .as_mut()
            .expect("only a mesh with a planner plans");
        let w = std::mem::take(&mut s.window);
        let elapsed = now.saturating_sub(s.last_tick).as_secs_f64();
        s.last_tick = now;
        s.mean_prompt = ratio(w.arrived_prompt_tokens, w.arrivals).unwrap_or(s.mean_prompt);
        s.mean_output = ratio(w.completed_output_tokens, w.completions).unwrap_or(s.mean_output);
        s.hit_rate =
            ratio(w.completed_cached_tokens, w.completed_prompt_tokens).unwrap_or(s.hit_rate);
        let mut obs = Observation {
            arrival_rate: if elapsed > 0.0 {
                w.arrivals as f64 / elapsed
            } else {
                0.0
            },
            mean_prompt_tokens: s.mean_prompt,
            mean_output_tokens: s.mean_output,
            prefix_hit_rate: s.hit_rate,
            ttft: w.ttft.quantiles(),
            itl: w.itl.quantiles(),
            ..Observation::default()
        };
        for n in 0..self.nodes.len() {
            if self.life[n] == Life::Gone {
                continue;
            }
            // Every live node's steps, a draining one's too: they measure the engine.
            obs.steps.extend(
                self.nodes[n]
                    .take_steps()
                    .into_iter()
                    .map(|(shape, d)| StepSample {
                        steps: 1,
                        prefill_tokens: shape.prefill_tokens,
                        prefill_cached_tokens: shape.prefill_cached_tokens,
                        decode_seqs: shape.decode_seqs,
                        decode_context_tokens: shape.decode_context_tokens,
                        duration: d,
                    }),
            );
            if self.life[n] != Life::Serving {
                continue;
            }
            let node = &self.nodes[n];
            match self.roles[n] {
                NodeRole::Decode => {
                    obs.decode_nodes += 1;
                    obs.decode_running.push(node.load().running as u32);
                    obs.decode_kv_usage.push(node.pool().usage());
                    obs.decode_queued_prompt_tokens
                        .push(node.queued_prefill_tokens());
                }
                _ => {
                    obs.prefill_nodes += 1;
                    obs.prefill_queued_tokens.push(node.queued_prefill_tokens());
                }
            }
        }
        obs
    }

    /// Acts on a decision: the role switches first, then each role that changes is brought
    /// to its target, counting what is already starting or switching into it.
    fn apply(&mut self, d: &Decision, now: Duration) {
        let switches = [
            (Role::Prefill, Role::Decode, d.switches.prefill_to_decode),
            (Role::Decode, Role::Prefill, d.switches.decode_to_prefill),
        ];
        for (from, to, k) in switches {
            let (fr, tr) = (node_role(from), node_role(to));
            let spare = self.provisioned(fr).saturating_sub(d.role(from).target);
            let wanted = d.role(to).target.saturating_sub(self.provisioned(tr));
            for _ in 0..k.min(spare).min(wanted) {
                let Some(n) = self.least_busy(fr) else { break };
                self.drain(n, Some(tr), now);
                self.ledger_mut().role_switches += 1;
            }
        }
        for role in Role::ALL {
            if d.role(role).delta() != 0 {
                self.scale_to(node_role(role), d.role(role).target, now);
            }
        }
    }

    /// Requests or removes nodes of `role` until it is headed for `target`: removals cancel
    /// nodes still starting (the newest first), then drain the least busy.
    fn scale_to(&mut self, role: NodeRole, target: u32, now: Duration) {
        let provisioned = self.provisioned(role);
        for _ in provisioned..target {
            self.add_node(role, now, self.startup);
            self.ledger_mut().nodes_requested += 1;
        }
        for _ in target..provisioned {
            let starting = (0..self.nodes.len())
                .rfind(|&n| self.roles[n] == role && self.life[n] == Life::Starting);
            if let Some(n) = starting {
                self.cancel(n, now);
                self.ledger_mut().nodes_cancelled += 1;
            } else if let Some(n) = self.least_busy(role) {
                self.drain(n, None, now);
                self.ledger_mut().nodes_drained += 1;
            }
        }
    }

    /// The serving node of `role` holding the fewest requests (the newest of equals): the
    /// quickest to drain.
    fn least_busy(&self, role: NodeRole) -> Option<usize> {
        self.serving(role)
            .min_by_key(|&n| (self.nodes[n].num_requests(), std::cmp::Reverse(n)))
    }
}
