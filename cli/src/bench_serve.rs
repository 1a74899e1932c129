//! `kvmesh bench serve`: load-tests an OpenAI-compatible server (one load, a sweep of loads, or
//! a search for the most goodput within an SLO) and writes a report, per-request CSV and
//! plots; `kvmesh bench compare` sets two reports side by side; `kvmesh bench plot` redraws a
//! report's plots. Parsing and wiring only: the measuring, judging, rendering and drawing are
//! `kvmesh_bench`'s (probe, report, plot).

mod live;
mod outputs;

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use humantime_serde::re::humantime;
use kvmesh_bench::arrivals::{Arrivals, LoadShape};
use kvmesh_bench::cpu::CpuClock;
use kvmesh_bench::plot::PlotFormat;
use kvmesh_bench::probe::{Bench, Measured, Progress};
use kvmesh_bench::report::{self, BenchReport, TargetInfo};
use kvmesh_bench::search::{Axis, Criteria, Found, SearchConfig, Stop, Sweep};
use kvmesh_bench::slo::SloSpec;
use kvmesh_bench::workload::{WorkloadOptions, WorkloadSpec};
use kvmesh_bench::{Api, Target};

/// The length of each point when neither `--requests` nor `--duration` is given.
const DEFAULT_REQUESTS: usize = 200;
/// Synthetic prompts built for a run bounded by `--duration` alone (the driver cycles them;
/// enough that a repeat is rare at a few hundred requests a second for a minute).
const DURATION_ONLY_SYNTHETIC: usize = 20_000;

#[derive(Args, Debug)]
#[command(after_help = "Examples:
  kvmesh bench serve --url http://127.0.0.1:8000 --load poisson:rate=4 --requests 300
  kvmesh bench serve --url http://127.0.0.1:8000 --sweep 'concurrency=1..32x2' --slo ttft=1s,itl=100ms
  kvmesh bench serve --url http://127.0.0.1:8000 --max-goodput --search-axis rate --search-max 64
  kvmesh bench compare before/report.json after/report.json

The report's fields: docs/bench-report.md; the whole command: docs/benchmarks.md.")]
pub struct BenchServeArgs {
    /// The server's root (http://HOST:PORT) or its /v1.
    #[arg(long)]
    pub url: String,
    /// Which endpoint requests go to: /v1/completions or /v1/chat/completions.
    #[arg(long, value_enum, default_value_t = ApiArg::Completions)]
    pub api: ApiArg,
    /// The `model` field of each request [default: left out, the server's own].
    #[arg(long)]
    pub model: Option<String>,
    /// Sent as `Authorization: Bearer KEY`.
    #[arg(long, env = "KVMESH_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// What to send: synthetic:input=LEN,output=LEN[,prefix=N] (LEN: 128, uniform(a,b),
    /// normal(m,sd), azure), jsonl:PATH, sharegpt:PATH, mooncake[:PATH][,scale=S]
    /// [,conversations=N], azure[:PATH][,scale=F].
    #[arg(long, default_value = "synthetic:input=128,output=64", value_parser = WorkloadSpec::from_str)]
    pub workload: WorkloadSpec,
    /// Requests sent per point (and a synthetic workload's size) [default: 200 when
    /// --duration is not given either].
    #[arg(long, value_name = "N")]
    pub requests: Option<usize>,
    /// Wall time per point (e.g. 60s, 2m); with --requests, the first reached ends it.
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
    /// The share of completed requests that must meet every objective for a probe to pass.
    #[arg(long, default_value_t = 0.95, requires = "max_goodput")]
    pub attainment: f64,
    /// The objectives each request is judged on: ttft, itl (the longest gap between tokens),
    /// tpot ((e2e - ttft) / (tokens - 1)) and e2e, as name=duration.
    #[arg(long, value_name = "SPEC", default_value = "ttft=2s,itl=100ms", value_parser = SloSpec::from_str)]
    pub slo: SloSpec,
    /// Seeds arrival schedules and synthetic workloads.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Ask for exactly max_tokens tokens per request (the default).
    #[arg(long, overrides_with = "no_ignore_eos")]
    pub ignore_eos: bool,
    /// Let the model stop at its end-of-sequence token.
    #[arg(long, overrides_with = "ignore_eos")]
    pub no_ignore_eos: bool,
    /// Caps every output length (replaces a length the workload lacks or only estimates).
    #[arg(long, value_name = "N")]
    pub max_tokens: Option<u32>,
    /// A request still running after this fails as a timeout.
    #[arg(long, default_value = "300s", value_parser = humantime::parse_duration)]
    pub request_timeout: Duration,
    /// The most requests in flight at once; an open-loop send beyond it waits (and is
    /// counted late).
    #[arg(long, default_value_t = 1024)]
    pub max_in_flight: usize,
    /// Send a conversation's next turn on schedule, even before the turn it follows ended.
    #[arg(long)]
    pub no_follow_turns: bool,
    /// Where report.json, requests.csv and the plots go [default:
    /// target/bench-serve/<UTC timestamp>].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Plot formats: svg, png, both (svg,png) or none.
    #[arg(long, default_value = "svg,png", value_parser = parse_plots)]
    pub plots: Plots,
    /// Print the report's JSON to stdout instead of the tables.
    #[arg(long)]
    pub json: bool,
    /// No live progress line (it is not drawn when stderr is not a terminal either).
    #[arg(long)]
    pub no_progress: bool,
}

#[derive(Args, Debug)]
pub struct BenchCompareArgs {
    /// The baseline report (report.json of `kvmesh bench serve`).
    pub a: PathBuf,
    /// The report compared with it: ratios are B/A.
    pub b: PathBuf,
}

#[derive(Args, Debug)]
pub struct BenchPlotArgs {
    /// A report.json of `kvmesh bench serve`.
    pub report: PathBuf,
    /// Where the plots go (created if missing).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Plot formats: svg, png or both (svg,png).
    #[arg(long, default_value = "svg,png", value_parser = parse_plots)]
    pub plots: Plots,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ApiArg {
    Completions,
    Chat,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum AxisArg {
    Concurrency,
    Rate,
}

/// `--plots`: the formats to draw, none for `none`.
#[derive(Clone, Debug)]
pub struct Plots(pub Vec<PlotFormat>);

fn parse_plots(s: &str) -> Result<Plots, String> {
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
enum Mode {
    Points(Vec<LoadShape>),
    MaxGoodput(SearchConfig),
}

impl BenchServeArgs {
    fn target(&self) -> Target {
        Target {
            url: self.url.clone(),
            api: match self.api {
                ApiArg::Completions => Api::Completions,
                ApiArg::Chat => Api::Chat,
            },
            model: self.model.clone(),
            api_key: self.api_key.clone(),
            ignore_eos: !self.no_ignore_eos,
            request_timeout: self.request_timeout,
        }
    }

    /// Each point's length in requests: as given, or the default when no duration bounds it.
    fn requests(&self) -> Option<usize> {
        match (self.requests, self.duration) {
            (None, None) => Some(DEFAULT_REQUESTS),
            (n, _) => n,
        }
    }

    fn mode(&self) -> Mode {
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

pub fn run_serve(args: &BenchServeArgs) -> Result<()> {
    let command_cpu = CpuClock::start();
    let target = args.target();
    let requests = args.requests();
    if requests == Some(0) {
        bail!("--requests must be at least 1");
    }
    let mode = args.mode();
    // Every point sends fresh prompts (each starts where the last stopped in the workload), so
    // no point is served from what an earlier one left in the prefix cache: size a synthetic
    // workload for all of them (a search's retry runs twice as long).
    let points = match &mode {
        Mode::MaxGoodput(search) => search.max_probes.saturating_mul(2),
        Mode::Points(shapes) => shapes.len(),
    };
    let size = match (&args.workload, requests) {
        (_, Some(n)) => n.saturating_mul(points),
        (WorkloadSpec::Synthetic(_), None) => DURATION_ONLY_SYNTHETIC,
        (_, None) => usize::MAX,
    };
    let workload = args
        .workload
        .load(&WorkloadOptions {
            seed: args.seed,
            max_tokens: args.max_tokens,
            ..WorkloadOptions::new(target.api, size)
        })
        .context("building the workload")?;
    let out = outputs::out_dir(args.out.as_deref());
    let bench = Bench {
        target: target.clone(),
        workload,
        slo: args.slo.clone(),
        seed: args.seed,
        requests,
        duration: args.duration,
        max_in_flight: args.max_in_flight,
        follow_turns: !args.no_follow_turns,
    };
    let mut report = BenchReport::new(
        TargetInfo::from(&target),
        bench.workload.name.clone(),
        args.seed,
        &args.slo,
    );
    let mut live = live::Live::new(!args.no_progress, requests);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let mut observer = |p: Progress<'_>| live.observe(p);
    let (measured, found) = runtime.block_on(async {
        match mode {
            Mode::Points(shapes) => bench
                .sweep(&shapes, &mut observer)
                .await
                .map(|points| (points, None))
                .map_err(anyhow::Error::from),
            Mode::MaxGoodput(config) => {
                let search = bench
                    .max_goodput(config, Arrivals::Poisson, &mut observer)
                    .await?;
                report.max_goodput = search.max_goodput;
                Ok((search.points, Some(search.found)))
            }
        }
    })?;
    live.finish();
    report.points = measured.iter().map(|m| m.point.clone()).collect();
    report.generator = command_cpu.stop();

    let written = outputs::write(&out, &report, &measured, &args.plots.0)?;
    if args.json {
        println!("{}", report.to_json());
    } else {
        print!("{}", report::render_table(&report));
    }
    let mut notes = run_notes(&measured, args.max_in_flight);
    if let Some(found) = found {
        notes.push(search_note(found));
    }
    if args.json {
        // The table carries the report's warnings; JSON on stdout leaves them to stderr.
        notes.extend(report.warnings());
    }
    for note in notes {
        eprintln!("{note}");
    }
    eprintln!("wrote {}", written.join(", "));
    Ok(())
}

/// What the runs say about the measurement itself: errors by first message, requests that
/// waited for the in-flight cap, a generator behind its schedule.
fn run_notes(measured: &[Measured], max_in_flight: usize) -> Vec<String> {
    let mut notes = Vec::new();
    for m in measured {
        let label = &m.point.label;
        for (kind, message) in &m.run.error_examples {
            notes.push(format!("{label}: {kind}: {message}"));
        }
        if m.run.waited > 0 {
            notes.push(format!(
                "{label}: {} requests waited for --max-in-flight {max_in_flight}: the server \
                 fell behind the offered load, and their latencies exclude the wait",
                m.run.waited
            ));
        }
        // Held and waiting requests are left out of the lateness: this is the generator's.
        if m.run.max_lateness > Duration::from_millis(100) {
            notes.push(format!(
                "{label}: a send left up to {:.0} ms behind its schedule: the load generator \
                 could not keep up",
                m.run.max_lateness.as_secs_f64() * 1e3
            ));
        }
    }
    notes
}

fn search_note(found: Option<Found>) -> String {
    let Some(f) = found else {
        return "max goodput: the start load failed the SLO: no load found (try a lower \
                --search-start or a looser --slo)"
            .into();
    };
    let why = match f.stop {
        Stop::Resolved => "pass and fail within the resolution",
        Stop::ReachedMax => "--search-max passed: the limit, if any, is above it",
        Stop::ProbeLimit => "--search-max-probes ran out",
        Stop::FailsAtStart => "the start failed",
    };
    let above = f
        .lowest_fail
        .map_or(String::new(), |l| format!(", lowest fail {l}"));
    format!(
        "max goodput search: highest pass {}{above} after {} probes ({why})",
        f.load, f.probes
    )
}

pub fn run_compare(args: &BenchCompareArgs) -> Result<()> {
    let a = outputs::read_report(&args.a)?;
    let b = outputs::read_report(&args.b)?;
    let text = report::compare(&a, &b)
        .with_context(|| format!("comparing {} with {}", args.a.display(), args.b.display()))?;
    print!("{text}");
    Ok(())
}

pub fn run_plot(args: &BenchPlotArgs) -> Result<()> {
    if args.plots.0.is_empty() {
        bail!("--plots none draws nothing: name svg, png or both");
    }
    let report = outputs::read_report(&args.report)?;
    let written = kvmesh_bench::plot::write_plots(
        &args.out,
        &report,
        &args.plots.0,
        kvmesh_bench::plot::DEFAULT_SIZE,
    )?;
    for path in written {
        println!("{}", path.display());
    }
    Ok(())
}
