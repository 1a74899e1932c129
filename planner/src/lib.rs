//! kvmesh's planner core: SLO-driven autoscaling of prefill and decode capacity, with role
//! switching, as a pure state machine.
//!
//! No I/O and no clock: the caller hands [`Planner::observe`] what the mesh publishes (an
//! [`Observation`]) and asks [`Planner::decide`] for a [`Decision`] every interval, passing
//! `now` each time. The `kvmesh planner` command (actuators, leader election, metrics) and
//! `kvmesh sim --planner` are built on top (see the crate's README).
//!
//! Two policies ([`Policy`]):
//! - `load`: Dynamo-style reactive thresholds (queued prompt tokens per engine in context
//!   lengths, KV usage per decode node), one node per step, up when any node crosses, down
//!   only when every node stayed low for a while.
//! - `slo`: predicted demand ([`Predictor`]: constant, moving average, EWMA, Kalman) through
//!   a [`PerfModel`] refitted online, sized against TTFT and ITL targets (see [`slo`]).
//!
//! Both pass every scale-down through a consolidation check (would the remaining nodes
//! still carry the load?), respect per-role cooldowns, `min..=max` (decode never zero;
//! prefill may go to zero, the decode nodes then prefilling every prompt) and a node
//! budget that only ever cuts growth, turn opposite moves into role switches, and in
//! advisory mode report without acting.
//!
//! ```
//! use kvmesh_planner::{Observation, Planner, PlannerConfig};
//! use std::time::Duration;
//!
//! let mut planner = Planner::new(PlannerConfig::default()).unwrap();
//! planner.observe(Duration::ZERO, Observation {
//!     prefill_nodes: 1,
//!     decode_nodes: 1,
//!     prefill_queued_tokens: vec![20_000],
//!     decode_kv_usage: vec![0.4],
//!     ..Observation::default()
//! });
//! let decision = planner.decide(Duration::ZERO);
//! assert_eq!(decision.prefill.target, 2);
//! assert_eq!(decision.decode.target, 1);
//! ```

mod budget;
pub mod config;
pub mod decision;
mod load;
pub mod observation;
pub mod perf_model;
mod planner;
pub mod predictor;
pub mod slo;
mod swing;

pub use config::{
    ConfigError, Cooldowns, LoadConfig, PlannerConfig, Policy, RoleBounds, SloConfig, SwingHeadroom,
};
pub use decision::{Decision, Direction, Metric, Reason, Role, RoleDecision, RoleSwitches};
pub use observation::{LatencyQuantiles, Observation, StepSample};
pub use perf_model::{PerfCoefficients, PerfModel};
pub use planner::Planner;
pub use predictor::{Constant, Ewma, Kalman, MovingAverage, Predictor, PredictorConfig};
