//! What `kvmesh bench serve` and `kvmesh sim` share on their command lines: the workload, the
//! load (one shape, a sweep or a max-goodput search), the SLO and where the report goes. One
//! definition, so a simulated run is asked for in the same words as a real one.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use clap::{Args, ValueEnum};
use humantime_serde::re::humantime;
use kvmesh_bench::arrivals::LoadShape;
use kvmesh_bench::plot::PlotFormat;
use kvmesh_bench::search::{Axis, Criteria, SearchConfig, Sweep};
use kvmesh_bench::slo::{Judge, SloSpec};
use kvmesh_bench::workload::WorkloadSpec;
use kvmesh_bench::Api;

/// The length of each point when neither `--requests` nor `--duration` is given.
pub const DEFAULT_REQUESTS: usize = 200;

#[derive(Args, Debug)]
pub struct MeasureArgs {
    /// What to send: synthetic:input=LEN,output=LEN[,prefix=N] (LEN: 128, uniform(a,b),
    /// normal(m,sd), azure), jsonl:PATH, sharegpt:PATH, mooncake[:PATH][,scale=S]
    /// [,conversations=N], azure[:PATH][,scale=F].
    #[arg(long, default_value = "synthetic:input=128,output=64", value_parser = WorkloadSpec::from_str)]
    pub workload: WorkloadSpec,
    /// Requests sent per point (and a synthetic workload's size) [default: 200 when
    /// --duration is not given either].
    #[arg(long, value_name = "N")]
    pub requests: Option<usize>,
    /// Time per point (e.g. 60s, 2m); with --requests, the first reached ends it.
    #[arg(long, value_name = "D", value_parser = humantime::parse_duration)]
    pub duration: Option<Duration>,
    /// The load offered: concurrency:N (closed loop), poisson:rate=R, constant:rate=R,
    /// gamma:rate=R,burstiness=K, steps:2@30s,8@30s, ramp:1..10@2m, day:1..10@10m,
    /// trace[:speedup=X|rate=R] (a trace workload's own timing).
    #[arg(long, value_name = "SHAPE", default_value = "concurrency:8", value_parser = LoadShape::from_str)]
    pub load: LoadShape,
    /// Run one point per load instead: rate=1,2,4 | concurrency=1..32x2 | rate=2..8+2
    /// [;arrivals=constant|poisson|burstiness=K].
    #[arg(long, value_name = "SPEC", conflicts_with = "load", value_parser = Sweep::from_str)]
    pub sweep: Option<Sweep>,
    /// Search for the highest load whose goodput meets the SLO (doubling from --search-start,
    /// then bisecting; each probe judged on the 95% Wilson interval of its attainment).
    #[arg(long, conflicts_with_all = ["sweep", "load"])]
    pub max_goodput: bool,
    /// What --max-goodput varies: requests in flight or requests per second (Poisson).
    #[arg(long, value_enum, default_value_t = AxisArg::Concurrency, requires = "max_goodput")]
    pub search_axis: AxisArg,
    /// The first load the search probes.
    #[arg(long, default_value_t = 1.0, requires = "max_goodput")]
    pub search_start: f64,
    /// The most load the search probes; a pass here ends it.
    #[arg(long, default_value_t = 64.0, requires = "max_goodput")]
    pub search_max: f64,
    /// When bisection stops [default: 1 request in flight; for a rate, 10% of the failing
    /// rate].
    #[arg(long, requires = "max_goodput")]
    pub search_resolution: Option<f64>,
    /// The most probes the search runs (retries of inconclusive ones included).
    #[arg(long, default_value_t = 16, requires = "max_goodput")]
    pub search_max_probes: usize,
    /// The share of completed requests that must meet every objective for a probe to pass
    /// (with --judge percentiles: the share of each objective's samples within its target).
    #[arg(long, default_value_t = 0.95, requires = "max_goodput")]
    pub attainment: f64,
    /// What --attainment counts: per-request (each request meets every objective, ITL on
    /// its longest gap) or percentiles (each objective over its own samples, ITL over every
    /// gap: --attainment 0.99 asks the run's TTFT p99 and ITL p99 within their targets).
    #[arg(long, value_enum, default_value_t = JudgeArg::PerRequest, requires = "max_goodput")]
    pub judge: JudgeArg,
    /// The objectives each request is judged on: ttft, itl (the longest gap between tokens),
    /// tpot ((e2e - ttft) / (tokens - 1)) and e2e, as name=duration.
    #[arg(long, value_name = "SPEC", default_value = "ttft=2s,itl=100ms", value_parser = SloSpec::from_str)]
    pub slo: SloSpec,
    /// Seeds arrival schedules and synthetic workloads.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Caps every output length (replaces a length the workload lacks or only estimates).
    #[arg(long, value_name = "N")]
    pub max_tokens: Option<u32>,
    /// Where report.json, requests.csv and the plots go [default: a new directory under
    /// target/, named by the UTC time].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Plot formats: svg, png, both (svg,png) or none.
    #[arg(long, default_value = "svg,png", value_parser = parse_plots)]
    pub plots: Plots,
    /// Print the report's JSON to stdout instead of the tables.
    #[arg(long)]
    pub json: bool,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ApiArg {
    Completions,
    Chat,
}

impl ApiArg {
    pub fn api(self) -> Api {
        match self {
            ApiArg::Completions => Api::Completions,
            ApiArg::Chat => Api::Chat,
        }
    }
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum AxisArg {
    Concurrency,
    Rate,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum JudgeArg {
    PerRequest,
    Percentiles,
}

/// `--plots`: the formats to draw, none for `none`.
#[derive(Clone, Debug)]
pub struct Plots(pub Vec<PlotFormat>);

pub fn parse_plots(s: &str) -> Result<Plots, String> {
    if s.trim() == "none" {
        return Ok(Plots(Vec::new()));
    }
    let mut formats = Vec::new();
    for part in s.split(',') {
        let format: PlotFormat = part.parse()?;
        if !formats.contains(&format) {
            formats.push(format);
        }
    }
    Ok(Plots(formats))
}

/// What the command measures.
pub enum Mode {
    Points(Vec<LoadShape>),
    MaxGoodput(SearchConfig),
}

impl Mode {
    /// How many points it may measure (a search's retries run twice as long).
    pub fn max_points(&self) -> usize {
        match self {
            Mode::MaxGoodput(search) => search.max_probes.saturating_mul(2),
            Mode::Points(shapes) => shapes.len(),
        }
    }
}

impl MeasureArgs {
    /// Each point's length in requests: as given, or the default when no duration bounds it.
    pub fn requests(&self) -> Option<usize> {
        match (self.requests, self.duration) {
            (None, None) => Some(DEFAULT_REQUESTS),
            (n, _) => n,
        }
    }

    pub fn mode(&self) -> Mode {
        if self.max_goodput {
            let axis = match self.search_axis {
                AxisArg::Concurrency => Axis::Concurrency,
                AxisArg::Rate => Axis::Rate,
            };
            let resolution = self.search_resolution.unwrap_or(match axis {
                Axis::Concurrency => 1.0,
                Axis::Rate => 0.1,
            });
            Mode::MaxGoodput(SearchConfig {
                axis,
                start: self.search_start,
                max: self.search_max,
                resolution,
                max_probes: self.search_max_probes,
                criteria: Criteria {
                    target_attainment: self.attainment,
                    judge: match self.judge {
                        JudgeArg::PerRequest => Judge::PerRequest,
                        JudgeArg::Percentiles => Judge::Percentiles,
                    },
                    ..Criteria::default()
                },
            })
        } else if let Some(sweep) = &self.sweep {
            Mode::Points(sweep.shapes())
        } else {
            Mode::Points(vec![self.load.clone()])
        }
    }
}
