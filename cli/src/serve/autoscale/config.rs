//! The `[autoscale]` table of `kvmesh serve` and its flags: whether the planner runs in the
//! process, and where its own configuration comes from (read as `kvmesh planner` reads it).

use crate::planner::{load_planner_config, PolicyArg};
use clap::Args;
use humantime_serde::re::humantime;
use kvmesh_planner::PlannerConfig;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AutoscaleConfig {
    /// Run the planner in this process: it moves workers between the prefill and decode
    /// roles, and starts and stops them, within its bounds and budget (docs/planner.md).
    pub enabled: bool,
    /// The planner's TOML (policy, bounds, budget, cooldowns, thresholds, SLO targets;
    /// planner/README.md). Unset: its defaults, load policy.
    pub planner_config: Option<PathBuf>,
    /// Overrides the planner file's policy (`load`, `slo`).
    pub policy: Option<PolicyArg>,
    /// Overrides the SLO policy's targets: `ttft=500ms,itl=50ms` (either or both).
    pub slo: Option<String>,
    /// Decide and log, move no worker.
    pub advisory: bool,
    /// How often the workers and the router's latencies are observed (decisions come at the
    /// policy's interval).
    #[serde(with = "humantime_serde")]
    pub observe_every: Duration,
}

impl Default for AutoscaleConfig {
    fn default() -> Self {
        AutoscaleConfig {
            enabled: false,
            planner_config: None,
            policy: None,
            slo: None,
            advisory: false,
            observe_every: Duration::from_secs(2),
        }
    }
}

impl AutoscaleConfig {
    /// The planner's configuration when autoscaling is on; an error names what is wrong.
    pub fn planner(&self) -> anyhow::Result<Option<PlannerConfig>> {
        if !self.enabled {
            return Ok(None);
        }
        load_planner_config(
            self.planner_config.as_deref(),
            self.policy,
            self.slo.as_deref(),
            self.advisory,
        )
        .map(Some)
    }
}

/// The flags of the `[autoscale]` table.
#[derive(Args, Clone, Debug, Default, Serialize)]
pub struct AutoscaleArgs {
    /// Run the planner in this process: it moves workers between prefill and decode, and
    /// starts and stops them, within its bounds and budget (docs/planner.md).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub autoscale: Option<bool>,
    /// The planner's TOML, as `kvmesh planner --config` reads it (planner/README.md).
    #[arg(long)]
    pub planner_config: Option<PathBuf>,
    /// Overrides the planner file's policy.
    #[arg(long, value_enum)]
    pub planner_policy: Option<PolicyArg>,
    /// Overrides the SLO policy's targets: `ttft=500ms,itl=50ms` (either or both).
    #[arg(long)]
    pub slo: Option<String>,
    /// With --autoscale: decide and log, move no worker.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub advisory: Option<bool>,
    /// With --autoscale: how often the workers and the router's latencies are observed.
    #[arg(long, value_parser = humantime::parse_duration)]
    #[serde(with = "humantime_serde")]
    pub observe_every: Option<Duration>,
}

/// Where the autoscale flags go in the TOML.
pub const KEYS: &[(&str, &str)] = &[
    ("autoscale", "autoscale.enabled"),
    ("planner_config", "autoscale.planner_config"),
    ("planner_policy", "autoscale.policy"),
    ("slo", "autoscale.slo"),
    ("advisory", "autoscale.advisory"),
    ("observe_every", "autoscale.observe_every"),
];
