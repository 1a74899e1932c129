//! A fluid model of the mesh for the planner's tests, in virtual time: the offered load is
//! spread evenly over the nodes alive, and an acted decision takes effect at once.
#![allow(dead_code)]

use kvmesh_planner::{
    Decision, Direction, Observation, PerfCoefficients, Planner, PlannerConfig, Policy,
    PredictorConfig, Role, RoleBounds,
};
use std::time::Duration;

/// What the mesh carries at one instant, whatever its size.
#[derive(Clone, Copy, Debug, Default)]
pub struct Load {
    /// Prompt tokens queued across all prefill nodes (across the decode nodes when there is
    /// no prefill node: they prefill every prompt then).
    pub queued_tokens: f64,
    /// KV in use across all decode nodes, in units of one node's capacity.
    pub kv_nodes: f64,
    /// Sequences decoding across all decode nodes.
    pub running: f64,
    pub arrival_rate: f64,
    pub prompt: f64,
    pub output: f64,
}

pub struct Mesh {
    pub prefill: u32,
    pub decode: u32,
}

impl Mesh {
    pub fn observe(&self, load: &Load) -> Observation {
        let p = self.prefill.max(1);
        let d = self.decode.max(1);
        let local = if self.prefill == 0 {
            (load.queued_tokens / f64::from(d)) as u64
        } else {
            0
        };
        Observation {
            arrival_rate: load.arrival_rate,
            mean_prompt_tokens: load.prompt,
            mean_output_tokens: load.output,
            prefill_queued_tokens: vec![
                (load.queued_tokens / f64::from(p)) as u64;
                self.prefill as usize
            ],
            decode_queued_prompt_tokens: vec![local; self.decode as usize],
            decode_kv_usage: vec![(load.kv_nodes / f64::from(d)).min(1.0); self.decode as usize],
            decode_running: vec![
                (load.running / f64::from(d)).round() as u32;
                self.decode as usize
            ],
            prefill_nodes: self.prefill,
            decode_nodes: self.decode,
            ..Observation::default()
        }
    }

    /// Apply a decision as an actuator would.
    pub fn apply(&mut self, d: &Decision) {
        if d.acted() {
            self.prefill = d.prefill.target;
            self.decode = d.decode.target;
        }
    }
}

/// Observe every second, decide when due, apply; returns every decision made.
pub fn run(
    planner: &mut Planner,
    mesh: &mut Mesh,
    from: Duration,
    seconds: u64,
    load: impl Fn(Duration) -> Load,
) -> Vec<Decision> {
    let mut decisions = Vec::new();
    for s in 0..seconds {
        let now = from + Duration::from_secs(s);
        planner.observe(now, mesh.observe(&load(now)));
        if now >= planner.next_decision_at() {
            let d = planner.decide(now);
            mesh.apply(&d);
            decisions.push(d);
        }
    }
    decisions
}

/// How often a role's moves change direction (up then down, or down then up).
pub fn direction_changes(decisions: &[Decision], role: Role) -> usize {
    let moves: Vec<Direction> = decisions
        .iter()
        .filter(|d| d.acted())
        .map(|d| d.role(role).direction())
        .filter(|&dir| dir != Direction::Hold)
        .collect();
    moves.windows(2).filter(|w| w[0] != w[1]).count()
}

pub fn coefficients() -> PerfCoefficients {
    PerfCoefficients {
        step_overhead_us: 5000.0,
        prefill_per_token_us: 50.0,
        prefill_per_cached_token_us: 0.0,
        decode_per_seq_us: 100.0,
        decode_per_context_token_us: 0.1,
    }
}

/// The SLO tests' planner: the targets and coefficients their hand computations use.
pub fn config(predictor: PredictorConfig) -> PlannerConfig {
    let mut c = PlannerConfig {
        policy: Policy::Slo,
        prefill: RoleBounds { min: 1, max: 10 },
        decode: RoleBounds { min: 1, max: 10 },
        budget: 20,
        ..PlannerConfig::default()
    };
    c.slo.interval = Duration::from_secs(10);
    c.slo.ttft = Duration::from_millis(250);
    c.slo.itl = Duration::from_millis(50);
    c.slo.perf = coefficients();
    c.slo.predictor = predictor;
    c.slo.max_decode_batch = 1024;
    c.cooldown.up = Duration::from_secs(10);
    c.cooldown.down = Duration::from_secs(30);
    c.cooldown.down_stable_for = Duration::from_secs(30);
    c
}
