//! The load generator's report: one run or a sweep of runs at several load levels, each judged
//! against the SLO ([`SloReport`]), with a timeline and compact latency distributions, so the
//! table, the comparison and every plot can be redrawn from the JSON alone. Field by field:
//! `docs/bench-report.md`.
//!
//! Pure: the driver measures and hands over outcomes; this assembles, [`table`] renders,
//! [`compare`] sets two reports side by side and [`crate::plot`] draws.

mod cdf;
pub mod compare;
pub mod mesh;
pub mod table;
mod timeline;

use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use cdf::{Cdf, QUANTILES};
pub use compare::compare;
pub use mesh::{MeshStats, NodeStats, PrefixCacheStats};
pub use table::render_table;
pub use timeline::{bin_width, Bin, Timeline, SENDS_PER_BIN, TARGET_BINS};

use crate::arrivals::{LoadShape, OpenLoop};
use crate::cpu::GeneratorUse;
use crate::load::{Api, Target};
use crate::slo::{
    Class, Goodput, Judge, Objective, RequestOutcome, SloReport, SloSpec, SCHEMA_VERSION,
};
use crate::trace::Pacing;

/// What a report's JSON could not be read as.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("not a kvmesh bench report: {0}")]
    Json(#[from] serde_json::Error),
    #[error("not a kvmesh bench report: no `schema_version`")]
    NoVersion,
    #[error(
        "report schema version {found}, but this kvmesh reads version {expected}: \
         compare reports written by the same version"
    )]
    Version { found: u64, expected: u32 },
    #[error("reports of different schema versions ({a} and {b}) cannot be compared")]
    Mismatch { a: u32, b: u32 },
}

/// The server a run was sent to (never its key).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetInfo {
    pub url: String,
    /// `completions` or `chat`.
    pub api: String,
    /// The `model` field sent; `None`: the server's own.
    pub model: Option<String>,
}

impl From<&Target> for TargetInfo {
    fn from(t: &Target) -> TargetInfo {
        TargetInfo {
            url: t.url.clone(),
            api: match t.api {
                Api::Completions => "completions",
                Api::Chat => "chat",
            }
            .into(),
            model: t.model.clone(),
        }
    }
}

/// What a load level's number measures, for a plot's x axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadAxis {
    /// Offered requests per second.
    Rate,
    /// Requests in flight (closed loop).
    Concurrency,
}

impl LoadAxis {
    /// An axis label, with its unit.
    pub fn label(self) -> &'static str {
        match self {
            LoadAxis::Rate => "offered load (req/s)",
            LoadAxis::Concurrency => "concurrency (requests in flight)",
        }
    }
}

/// A load level as a number.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Level {
    pub axis: LoadAxis,
    pub value: f64,
}

impl Level {
    /// The shape's nominal level: the concurrency of a closed loop, the rate of a fixed-rate
    /// shape or of rate-paced replay, the mean rate over a profile (steps, ramp, day); `None`
    /// for speed-up trace replay, whose rate is the trace's.
    pub fn of(shape: &LoadShape) -> Option<Level> {
        let (axis, value) = match shape {
            LoadShape::Concurrency(n) => (LoadAxis::Concurrency, n.get() as f64),
            LoadShape::Open(OpenLoop { profile, .. }) => match profile.duration() {
                None => (LoadAxis::Rate, profile.rate_at(0.0)),
                Some(d) if d > Duration::ZERO => (
                    LoadAxis::Rate,
                    profile.expected_arrivals(f64::INFINITY) / d.as_secs_f64(),
                ),
                Some(_) => return None,
            },
            LoadShape::Trace(Pacing::RequestsPerSecond(r)) => (LoadAxis::Rate, *r),
            LoadShape::Trace(Pacing::Speedup(_)) => return None,
        };
        Some(Level { axis, value })
    }
}

/// The latency distributions of a point's completed requests, in seconds; `None` where the
/// series is empty.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cdfs {
    pub ttft: Option<Cdf>,
    /// Every gap between tokens, pooled (as [`SloReport::itl`]).
    pub itl: Option<Cdf>,
    pub e2e: Option<Cdf>,
}

impl Cdfs {
    pub fn of(outcomes: &[RequestOutcome]) -> Cdfs {
        let ok: Vec<&RequestOutcome> = outcomes.iter().filter(|o| o.class() == Class::Ok).collect();
        let of = |f: &dyn Fn(&RequestOutcome) -> Option<f64>| {
            Cdf::of(ok.iter().filter_map(|o| f(o)).collect())
        };
        Cdfs {
            ttft: of(&|o| o.statistic_s(Objective::Ttft)),
            itl: Cdf::of(
                ok.iter()
                    .flat_map(|o| o.gaps.iter().map(Duration::as_secs_f64))
                    .collect(),
            ),
            e2e: of(&|o| o.statistic_s(Objective::E2e)),
        }
    }
}

/// One load level of a run or sweep.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Point {
    /// A short name, unique in the report (compare matches points by it).
    pub label: String,
    /// The load shape in its grammar ([`LoadShape`]'s `Display`, which parses back).
    pub load: String,
    /// The load as a number, where the shape has one ([`Level::of`]).
    pub level: Option<Level>,
    pub slo: SloReport,
    pub timeline: Timeline,
    pub cdf: Cdfs,
    /// The generator's own CPU use over this run, where measured.
    pub generator: Option<GeneratorUse>,
    /// The mesh seen from inside (per node, transfers, migrations, prefix-cache tiers), where
    /// the run can see it: a simulated run; absent from the JSON otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mesh: Option<MeshStats>,
}

impl Point {
    /// A load level judged from its outcomes, over a run of `duration`.
    pub fn new(
        label: impl Into<String>,
        shape: &LoadShape,
        slo: &SloSpec,
        outcomes: &[RequestOutcome],
        duration: Duration,
    ) -> Point {
        Point {
            label: label.into(),
            load: shape.to_string(),
            level: Level::of(shape),
            slo: SloReport::new(slo, outcomes, duration),
            timeline: Timeline::new(shape, outcomes, duration),
            cdf: Cdfs::of(outcomes),
            generator: None,
            mesh: None,
        }
    }

    /// With the generator's CPU use over the run.
    pub fn with_generator(mut self, generator: Option<GeneratorUse>) -> Point {
        self.generator = generator;
        self
    }

    /// With the mesh's own statistics over the run.
    pub fn with_mesh(mut self, mesh: Option<MeshStats>) -> Point {
        self.mesh = mesh;
        self
    }
}

/// The load at which the search found the most goodput.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MaxGoodput {
    /// The point's label and load shape, as in [`Point`].
    pub label: String,
    pub load: String,
    pub level: Option<Level>,
    pub goodput: Goodput,
    /// How the search judged its probes (and so what `goodput` counts).
    #[serde(default)]
    pub judge: Judge,
}

impl MaxGoodput {
    /// The load and goodput of `point`, its goodput as `judge` counts it.
    pub fn of(point: &Point, judge: Judge) -> MaxGoodput {
        MaxGoodput {
            label: point.label.clone(),
            load: point.load.clone(),
            level: point.level,
            goodput: point.slo.goodput_by(judge),
            judge,
        }
    }
}

/// A run or sweep of `kvmesh bench serve`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BenchReport {
    /// [`SCHEMA_VERSION`]: bumped when a field changes meaning or goes.
    pub schema_version: u32,
    /// The version of kvmesh that wrote it.
    pub kvmesh_version: String,
    pub target: TargetInfo,
    /// The workload's name (its source spec, parsed).
    pub workload: String,
    /// Seeds the arrival schedules (and synthetic workloads).
    pub seed: u64,
    /// The SLO in `--slo` form.
    pub slo: String,
    /// The generator's CPU use over the whole command, where measured.
    pub generator: Option<GeneratorUse>,
    /// One per load level, in the order run.
    pub points: Vec<Point>,
    /// Where a search for the most goodput ran, what it found.
    pub max_goodput: Option<MaxGoodput>,
}

impl BenchReport {
    /// A report with no points yet.
    pub fn new(target: TargetInfo, workload: impl Into<String>, seed: u64, slo: &SloSpec) -> Self {
        BenchReport {
            schema_version: SCHEMA_VERSION,
            kvmesh_version: env!("CARGO_PKG_VERSION").into(),
            target,
            workload: workload.into(),
            seed,
            slo: slo.to_string(),
            generator: None,
            points: Vec::new(),
            max_goodput: None,
        }
    }

    /// The SLO's objectives with their targets in seconds (from the first point, where any;
    /// else parsed from [`Self::slo`]).
    pub fn targets_s(&self) -> Vec<(Objective, f64)> {
        match self.points.first() {
            Some(p) => p
                .slo
                .objectives
                .iter()
                .map(|o| (o.objective, o.target_s))
                .collect(),
            None => self
                .slo
                .parse::<SloSpec>()
                .map(|s| s.targets().map(|(o, t)| (o, t.as_secs_f64())).collect())
                .unwrap_or_default(),
        }
    }

    /// The JSON, pretty-printed.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a report holds only finite numbers and strings")
    }

    /// Reads a report, refusing one of another schema version by name before reading its
    /// fields (whose meaning may differ).
    pub fn from_json(json: &str) -> Result<BenchReport, ReportError> {
        let value: serde_json::Value = serde_json::from_str(json)?;
        let found = value
            .get("schema_version")
            .and_then(serde_json::Value::as_u64)
            .ok_or(ReportError::NoVersion)?;
        if found != u64::from(SCHEMA_VERSION) {
            return Err(ReportError::Version {
                found,
                expected: SCHEMA_VERSION,
            });
        }
        Ok(serde_json::from_value(value)?)
    }

    /// Every generator warning, whole command and points, labelled.
    pub fn warnings(&self) -> Vec<String> {
        let points = self.points.iter().filter_map(|p| {
            let w = p.generator.as_ref()?.warning()?;
            Some(format!("{}: {w}", p.label))
        });
        self.generator
            .as_ref()
            .and_then(GeneratorUse::warning)
            .into_iter()
            .chain(points)
            .collect()
    }
}
