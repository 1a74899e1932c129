//! The planner in the simulated mesh, and the node-set changes it makes: what the mesh
//! measures between two of its decisions, and what a run reports about it.
//!
//! Every planner interval the mesh ([`crate::mesh`]) builds an `Observation` from what the
//! real mesh publishes (the router's arrivals, completions and latency histograms, each
//! serving node's queue, running sequences, KV usage and step metrics, discovery's node
//! counts), hands it to the real `Planner` and acts on its [`Decision`]: nodes are
//! requested (serving after `MeshConfig::startup`, the time a GPU node takes to load its
//! weights), drained (out of routing at once, gone when their last request has ended) or
//! switched to the other role (drained, then serving again after `MeshConfig::switch_delay`,
//! weights kept). The same changes can be scripted at instants of virtual time
//! ([`NodeChange`]), as faults are. A node is billed from the moment it is requested until
//! it is gone, start-up and draining included, as a cloud bills it.
//!
//! Decisions are acted on as an actuator sets a replica count: only a role whose target
//! differs from what the planner observed changes, and it changes to the target counting
//! the nodes still starting or switching towards it (so a hold while nodes start cancels
//! nothing, and a second scale-up does not ask twice for nodes on their way).

use kvmesh_common::NodeId;
use kvmesh_planner::{Decision, LatencyQuantiles, PlannerConfig, Role};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

/// A change to the node set at an instant of virtual time, as an operator makes it (the
/// planner makes the same ones).
#[derive(Clone, Debug, PartialEq)]
pub struct NodeChange {
    pub at: Duration,
    pub kind: ChangeKind,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ChangeKind {
    /// A node of this role is requested; it serves after the mesh's start-up delay.
    Add(Role),
    /// The node leaves routing and goes once its requests have ended. Nothing if it is not
    /// serving then.
    Drain(NodeId),
    /// The node drains, then serves in the other role after the mesh's switch delay.
    Switch(NodeId),
}

#[derive(Debug, thiserror::Error)]
pub enum ChangeError {
    #[error("a node change names node {}, which the mesh does not start with", .0 .0)]
    UnknownNode(NodeId),
}

/// Checks `changes` against a mesh that starts with `nodes` nodes.
pub fn validate_changes(changes: &[NodeChange], nodes: usize) -> Result<(), ChangeError> {
    for c in changes {
        if let ChangeKind::Drain(n) | ChangeKind::Switch(n) = c.kind {
            if n.0 >= nodes as u64 {
                return Err(ChangeError::UnknownNode(n));
            }
        }
    }
    Ok(())
}

/// A GPU node's typical start-up: loading an 8B model's weights and warming up.
pub const DEFAULT_STARTUP: Duration = Duration::from_secs(30);
/// Re-registering in the other role: no weights to load.
pub const DEFAULT_SWITCH_DELAY: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum PlannerFileError {
    #[error("reading the planner config {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("the planner config {path} is not a planner config: {message}")]
    Parse { path: String, message: String },
    #[error("the planner config {path}: {source}")]
    Invalid {
        path: String,
        source: kvmesh_planner::ConfigError,
    },
}

/// Reads a [`PlannerConfig`] from TOML: the fields at the top level, or in a `[planner]`
/// table (as a binary's config file holds them). Validated.
pub fn load_planner_config(path: &Path) -> Result<PlannerConfig, PlannerFileError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| PlannerFileError::Read {
        path: shown.clone(),
        source,
    })?;
    parse_planner_config(&text).map_err(|e| match e {
        ParseError::Toml(message) => PlannerFileError::Parse {
            path: shown,
            message,
        },
        ParseError::Invalid(source) => PlannerFileError::Invalid {
            path: shown,
            source,
        },
    })
}

#[derive(Debug)]
enum ParseError {
    Toml(String),
    Invalid(kvmesh_planner::ConfigError),
}

fn parse_planner_config(text: &str) -> Result<PlannerConfig, ParseError> {
    let mut value: toml::Table =
        toml::from_str(text).map_err(|e| ParseError::Toml(e.to_string()))?;
    let table = match value.remove("planner") {
        Some(toml::Value::Table(t)) if value.is_empty() => t,
        Some(other) => {
            value.insert("planner".into(), other);
            value
        }
        None => value,
    };
    let config: PlannerConfig = table
        .try_into()
        .map_err(|e: toml::de::Error| ParseError::Toml(e.to_string()))?;
    config.validate().map_err(ParseError::Invalid)?;
    Ok(config)
}

/// Latencies binned on a log scale (2% wide bins from 1 us), as a Prometheus histogram
/// holds them for `histogram_quantile`: a quantile is read to within a bin.
#[derive(Clone, Debug, Default)]
pub struct LatencyHistogram {
    bins: BTreeMap<u32, u64>,
    count: u64,
}

const BIN_RATIO_LN: f64 = 0.019_802_627_296_179_712; // ln(1.02)

impl LatencyHistogram {
    pub fn record(&mut self, d: Duration) {
        let us = d.as_secs_f64() * 1e6;
        let bin = if us <= 1.0 {
            0
        } else {
            (us.ln() / BIN_RATIO_LN).ceil() as u32
        };
        *self.bins.entry(bin).or_default() += 1;
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    /// The upper edge of the bin holding quantile `q`; `None` when empty.
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        if self.count == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (&bin, &n) in &self.bins {
            seen += n;
            if seen >= rank {
                let us = (f64::from(bin) * BIN_RATIO_LN).exp();
                return Some(Duration::from_secs_f64(us / 1e6));
            }
        }
        None
    }

    pub fn quantiles(&self) -> Option<LatencyQuantiles> {
        Some(LatencyQuantiles {
            p50: self.quantile(0.5)?,
            p99: self.quantile(0.99)?,
        })
    }
}

/// What the router sees between two planner ticks.
#[derive(Clone, Debug, Default)]
pub struct RouterWindow {
    pub arrivals: u64,
    pub arrived_prompt_tokens: u64,
    pub completions: u64,
    pub completed_prompt_tokens: u64,
    pub completed_cached_tokens: u64,
    pub completed_output_tokens: u64,
    pub ttft: LatencyHistogram,
    pub itl: LatencyHistogram,
}

impl RouterWindow {
    pub fn arrived(&mut self, prompt_tokens: usize) {
        self.arrivals += 1;
        self.arrived_prompt_tokens += prompt_tokens as u64;
    }

    pub fn completed(&mut self, prompt_tokens: u64, cached_tokens: u64, output_tokens: u64) {
        self.completions += 1;
        self.completed_prompt_tokens += prompt_tokens;
        self.completed_cached_tokens += cached_tokens;
        self.completed_output_tokens += output_tokens;
    }
}

/// Node-seconds billed to each role.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct RoleSeconds {
    pub prefill: f64,
    pub decode: f64,
}

impl RoleSeconds {
    pub fn total(&self) -> f64 {
        self.prefill + self.decode
    }

    pub fn add(&mut self, role: Role, seconds: f64) {
        match role {
            Role::Prefill => self.prefill += seconds,
            Role::Decode => self.decode += seconds,
        }
    }
}

/// The node counts from an instant on.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct CountsAt {
    pub at_s: f64,
    /// In routing.
    pub prefill_serving: u32,
    pub decode_serving: u32,
    /// Billed: serving, starting, draining, switching into the role.
    pub prefill_billed: u32,
    pub decode_billed: u32,
}

/// What the planner (or the scripted changes) did to the node set over a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct AutoscaleReport {
    /// `load` or `slo`; `None`: scripted changes only.
    pub policy: Option<String>,
    pub advisory: bool,
    pub allow_role_switch: bool,
    pub startup_s: f64,
    pub switch_delay_s: f64,
    /// From each node's request to its end (or the run's end).
    pub node_seconds: RoleSeconds,
    pub node_hours: RoleSeconds,
    pub node_hours_total: f64,
    /// Decisions made (one per interval) and acted on (a count changed, not advisory).
    pub decisions: u64,
    pub decisions_acted: u64,
    /// Per role, decisions by their reason's kind (`predicted_demand`, `cooldown`, ...).
    pub reasons: BTreeMap<String, BTreeMap<String, u64>>,
    /// What the actuator did.
    pub nodes_requested: u64,
    pub nodes_cancelled: u64,
    pub nodes_drained: u64,
    pub role_switches: u64,
    /// Every decision that changed a count (acted on or advised).
    pub changes: Vec<Decision>,
    /// The node counts at every change.
    pub timeline: Vec<CountsAt>,
}

impl AutoscaleReport {
    pub fn new(
        planner: Option<&PlannerConfig>,
        startup: Duration,
        switch_delay: Duration,
    ) -> AutoscaleReport {
        AutoscaleReport {
            policy: planner.map(|p| format!("{:?}", p.policy).to_lowercase()),
            advisory: planner.is_some_and(|p| p.advisory),
            allow_role_switch: planner.is_some_and(|p| p.allow_role_switch),
            startup_s: startup.as_secs_f64(),
            switch_delay_s: switch_delay.as_secs_f64(),
            ..AutoscaleReport::default()
        }
    }

    /// Counts a decision's reasons and keeps it if it changes a count.
    pub fn decided(&mut self, d: &Decision) {
        self.decisions += 1;
        if d.acted() {
            self.decisions_acted += 1;
        }
        for role in Role::ALL {
            let name = match role {
                Role::Prefill => "prefill",
                Role::Decode => "decode",
            };
            *self
                .reasons
                .entry(name.into())
                .or_default()
                .entry(d.role(role).reason.kind().into())
                .or_default() += 1;
        }
        if d.is_change() {
            self.changes.push(d.clone());
        }
    }

    /// Records the counts from `at` on (replacing a record at the same instant).
    pub fn counts(&mut self, c: CountsAt) {
        match self.timeline.last_mut() {
            Some(last) if last.at_s == c.at_s => *last = c,
            Some(last)
                if (
                    last.prefill_serving,
                    last.decode_serving,
                    last.prefill_billed,
                    last.decode_billed,
                ) == (
                    c.prefill_serving,
                    c.decode_serving,
                    c.prefill_billed,
                    c.decode_billed,
                ) => {}
            _ => self.timeline.push(c),
        }
    }

    pub fn billed(&mut self, seconds: RoleSeconds) {
        self.node_seconds = seconds;
        self.node_hours = RoleSeconds {
            prefill: seconds.prefill / 3600.0,
            decode: seconds.decode / 3600.0,
        };
        self.node_hours_total = seconds.total() / 3600.0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_read_to_within_a_bin() {
        let mut h = LatencyHistogram::default();
        assert_eq!(h.quantiles(), None);
        for ms in 1..=100 {
            h.record(Duration::from_millis(ms));
        }
        let q = h.quantiles().unwrap();
        let near = |d: Duration, ms: f64| {
            let x = d.as_secs_f64() * 1e3;
            assert!(x >= ms && x <= ms * 1.021, "{x} vs {ms}");
        };
        near(q.p50, 50.0);
        near(q.p99, 99.0);
        assert_eq!(h.count(), 100);
    }

    #[test]
    fn planner_files_parse_at_the_top_or_in_a_planner_table() {
        let top = parse_planner_config("policy = \"slo\"\n[slo]\nttft = \"2s\"\n").unwrap();
        let nested =
            parse_planner_config("[planner]\npolicy = \"slo\"\n[planner.slo]\nttft = \"2s\"\n")
                .unwrap();
        assert_eq!(top, nested);
        assert_eq!(top.slo.ttft, Duration::from_secs(2));
        assert!(matches!(
            parse_planner_config("polcy = \"slo\""),
            Err(ParseError::Toml(m)) if m.contains("polcy")
        ));
        assert!(matches!(
            parse_planner_config("[decode]\nmin = 0"),
            Err(ParseError::Invalid(_))
        ));
    }

    #[test]
    fn the_timeline_keeps_changes_only() {
        let mut r = AutoscaleReport::default();
        let c = |at_s, p| CountsAt {
            at_s,
            prefill_serving: p,
            decode_serving: 1,
            prefill_billed: p,
            decode_billed: 1,
        };
        r.counts(c(0.0, 1));
        r.counts(c(1.0, 1));
        r.counts(c(2.0, 2));
        r.counts(c(2.0, 3));
        assert_eq!(r.timeline, vec![c(0.0, 1), c(2.0, 3)]);
    }
}
