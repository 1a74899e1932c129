//! `kvmesh bench serve`: load-tests an OpenAI-compatible server (one load, a sweep of loads, or
//! a search for the most goodput within an SLO) and writes a report, per-request CSV and
//! plots; `kvmesh bench compare` sets two reports side by side; `kvmesh bench plot` redraws a
//! report's plots. Parsing and wiring only: the measuring, judging, rendering and drawing are
//! `kvmesh_bench`'s (probe, report, plot).

mod live;
pub mod outputs;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use humantime_serde::re::humantime;
use kvmesh_bench::arrivals::Arrivals;
use kvmesh_bench::cpu::CpuClock;
use kvmesh_bench::probe::{Bench, Measured, Progress};
use kvmesh_bench::report::{self, BenchReport, TargetInfo};
use kvmesh_bench::workload::{WorkloadOptions, WorkloadSpec};
use kvmesh_bench::Target;

use crate::measure_args::{parse_plots, ApiArg, MeasureArgs, Mode, Plots};

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
    /// Ask for exactly max_tokens tokens per request (the default).
    #[arg(long, overrides_with = "no_ignore_eos")]
    pub ignore_eos: bool,
    /// Let the model stop at its end-of-sequence token.
    #[arg(long, overrides_with = "ignore_eos")]
    pub no_ignore_eos: bool,
    /// A JSON object whose fields are set in every request body, over the generator's own
    /// (e.g. '{"response_format": {"type": "json_object"}}').
    #[arg(long, value_parser = parse_extra_body)]
    pub extra_body: Option<serde_json::Map<String, serde_json::Value>>,
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
    /// No live progress line (it is not drawn when stderr is not a terminal either).
    #[arg(long)]
    pub no_progress: bool,
    #[command(flatten)]
    pub measure: MeasureArgs,
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

impl BenchServeArgs {
    fn target(&self) -> Target {
        Target {
            url: self.url.clone(),
            api: self.api.api(),
            model: self.model.clone(),
            api_key: self.api_key.clone(),
            ignore_eos: !self.no_ignore_eos,
            request_timeout: self.request_timeout,
            extra_body: self.extra_body.clone().unwrap_or_default(),
        }
    }
}

fn parse_extra_body(s: &str) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    match serde_json::from_str(s) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(_) => Err("--extra-body must be a JSON object".into()),
        Err(e) => Err(format!("--extra-body is not JSON: {e}")),
    }
}

pub fn run_serve(args: &BenchServeArgs) -> Result<()> {
    let command_cpu = CpuClock::start();
    let target = args.target();
    let m = &args.measure;
    let requests = m.requests();
    if requests == Some(0) {
        bail!("--requests must be at least 1");
    }
    let mode = m.mode();
    // Every point sends fresh prompts (each starts where the last stopped in the workload), so
    // no point is served from what an earlier one left in the prefix cache: size a synthetic
    // workload for all of them (a search's retry runs twice as long).
    let points = mode.max_points();
    let size = match (&m.workload, requests) {
        (_, Some(n)) => n.saturating_mul(points),
        (WorkloadSpec::Synthetic(_), None) => DURATION_ONLY_SYNTHETIC,
        (_, None) => usize::MAX,
    };
    let workload = m
        .workload
        .load(&WorkloadOptions {
            seed: m.seed,
            max_tokens: m.max_tokens,
            ..WorkloadOptions::new(target.api, size)
        })
        .context("building the workload")?;
    let out = outputs::out_dir(m.out.as_deref(), "bench-serve");
    let bench = Bench {
        target: target.clone(),
        workload,
        slo: m.slo.clone(),
        seed: m.seed,
        requests,
        duration: m.duration,
        max_in_flight: args.max_in_flight,
        follow_turns: !args.no_follow_turns,
    };
    let mut report = BenchReport::new(
        TargetInfo::from(&target),
        bench.workload.name.clone(),
        m.seed,
        &m.slo,
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

    let written = outputs::write(&out, &report, &measured, &m.plots.0)?;
    if m.json {
        println!("{}", report.to_json());
    } else {
        print!("{}", report::render_table(&report));
    }
    let mut notes = run_notes(&measured, args.max_in_flight);
    if let Some(found) = found {
        notes.push(outputs::search_note(found));
    }
    if m.json {
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
