//! `kvmesh tune`: finds the configuration with the most goodput within an SLO on this
//! machine's node budget. Each candidate is deployed locally (a `kvmesh serve` process, or a
//! mesh of router, prefill and decode processes), its max goodput is searched over the
//! concurrency axis for as long as the schedule allows, and it is stopped again; successive
//! halving spends the time budget on the likeliest winners.
//!
//! The pure cores:
//! - [`space`]: the candidates: prefill:decode splits of a node budget and the in-process
//!   `serve`, the engine's step budget (`engine.max_num_batched_tokens`) and step-time
//!   target (`engine.max_step_time`), the local-prefill
//!   threshold (`local_prefill_max_tokens`), the routing policy (`routing`) and admission
//!   control's TTFT target (`router.ttft_target`).
//! - [`halving`]: successive halving within a total time budget, fed max-goodput scores.
//! - [`pareto`]: the goodput against TTFT p99 trade-off of the measured candidates.
//! - [`render`]: a candidate as the TOML `kvmesh serve --config` or the node roles read.
//! - [`table`]: the candidate table and the schedule, as text.

pub mod halving;
pub mod pareto;
pub mod render;
pub mod space;
pub mod table;

use crate::local_cluster::{ChildOptions, Cluster, Interrupt, MeshSpec, ServeProcess};
use anyhow::{bail, Context, Result};
use clap::Args;
use halving::{affordable, Halving, Measurement};
use humantime_serde::re::humantime;
use kvmesh_bench::arrivals::Arrivals;
use kvmesh_bench::plot::{self, PlotFormat};
use kvmesh_bench::probe::{Bench, Progress};
use kvmesh_bench::search::{Axis, Criteria, SearchConfig, Verdict};
use kvmesh_bench::slo::{Objective, SloSpec};
use kvmesh_bench::workload::{WorkloadOptions, WorkloadSpec};
use kvmesh_bench::{Api, Target};
use kvmesh_router::policy::RoutingConfig;
use render::Rendered;
use space::{Candidate, SearchSpace, Topology};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use table::Row;

#[derive(Args, Debug)]
pub struct TuneArgs {
    /// The SLO goodput counts requests within (`ttft=500ms,itl=50ms,tpot=..,e2e=..`).
    #[arg(long, default_value = "ttft=2s,itl=200ms")]
    pub slo: SloSpec,
    /// Engine nodes a mesh may use (the router apart); the in-process `serve` uses one.
    #[arg(long, default_value_t = 4)]
    pub nodes: usize,
    /// What to send (`kvmesh bench serve --workload` grammar); the default draws prompt and
    /// output lengths jointly from the bundled Azure conversation trace.
    #[arg(long, default_value = "synthetic:input=azure,output=azure")]
    pub workload: WorkloadSpec,
    /// Caps every request's output length (tokens).
    #[arg(long, default_value_t = 128)]
    pub max_tokens: u32,
    /// Total wall time for all measurements, deployments' start-up included.
    #[arg(long, default_value = "20m", value_parser = humantime::parse_duration)]
    pub budget: Duration,
    /// Candidates sampled from the space [default: as many as the budget affords].
    #[arg(long)]
    pub candidates: Option<usize>,
    /// Seeds the sample and the workload.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where the best configuration, the Pareto plot and the deployments' logs go.
    #[arg(long, default_value = "tune")]
    pub out: PathBuf,
    /// Do not measure the untuned configuration (`Candidate::baseline`: an even split, every
    /// setting at its default) beside the sample.
    #[arg(long)]
    pub no_baseline: bool,
    /// Print the candidates and the schedule; start nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Topologies to try (`serve:P+D`, `mesh:P+D`) [default: serve:0+1, serve:1+1 and every
    /// mesh split of --nodes].
    #[arg(long, value_delimiter = ',')]
    pub topologies: Option<Vec<Topology>>,
    /// `engine.max_num_batched_tokens` values to try [default: 128,256,512].
    #[arg(long, value_delimiter = ',')]
    pub step_budgets: Option<Vec<usize>>,
    /// `engine.max_step_time` values to try (`off` or a duration) [default: off, and 60% of
    /// the --slo's itl objective when it has one].
    #[arg(long, value_delimiter = ',', value_parser = parse_target)]
    pub step_times: Option<Vec<Duration>>,
    /// `local_prefill_max_tokens` values to try [default: 0,256,1024].
    #[arg(long, value_delimiter = ',')]
    pub local_prefill: Option<Vec<usize>>,
    /// Routing policies to try [default: kv_aware,least_loaded].
    #[arg(long, value_delimiter = ',')]
    pub policies: Option<Vec<RoutingConfig>>,
    /// Admission control's TTFT targets to try (`off` or a duration) [default: off,2s].
    #[arg(long, value_delimiter = ',', value_parser = parse_target)]
    pub ttft_targets: Option<Vec<Duration>>,
    /// The shortest load probe: a measurement of fewer than 3 is not made.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub min_probe: Duration,
    /// The most probes of one max-goodput search.
    #[arg(long, default_value_t = 8)]
    pub probes: usize,
    /// The highest concurrency probed.
    #[arg(long, default_value_t = 64)]
    pub max_concurrency: usize,
    /// Compute threads of each deployed process.
    #[arg(long, default_value_t = 1)]
    pub node_threads: usize,
    /// Model file (.gguf) or HF checkpoint directory [default: the cached SmolLM2].
    #[arg(long)]
    pub model: Option<PathBuf>,
}

/// `off` (or 0) disables the target (admission control's, a step's); otherwise a duration.
fn parse_target(s: &str) -> Result<Duration, String> {
    match s.trim() {
        "off" | "0" => Ok(Duration::ZERO),
        t => humantime::parse_duration(t).map_err(|e| format!("`{t}`: {e} (or `off`)")),
    }
}

/// No step-time target, and one at 60% of the SLO's longest-gap objective if it has one: the
/// gaps follow the target with what the rest of the serving path adds on top
/// (docs/benchmarks.md, "A step-time target").
fn default_step_times(slo: &SloSpec) -> Vec<Duration> {
    let itl = slo.targets().find(|&(o, _)| o == Objective::Itl);
    std::iter::once(Duration::ZERO)
        .chain(itl.map(|(_, t)| t.mul_f64(0.6)))
        .collect()
}

/// How many load probes make the shortest measurement.
const MIN_PROBES: u32 = 3;

impl TuneArgs {
    fn space(&self) -> Result<SearchSpace> {
        if self.nodes == 0 {
            bail!("--nodes must be at least 1");
        }
        let mut space = SearchSpace::for_nodes(self.nodes);
        if let Some(t) = &self.topologies {
            space.topologies = t.clone();
        }
        if let Some(s) = &self.step_budgets {
            space.step_budgets = s.clone();
        }
        space.step_times = match &self.step_times {
            Some(t) => t.clone(),
            None => default_step_times(&self.slo),
        };
        if let Some(l) = &self.local_prefill {
            space.local_prefill_thresholds = l.clone();
        }
        if let Some(p) = &self.policies {
            space.policies = p.clone();
        }
        if let Some(t) = &self.ttft_targets {
            space.ttft_targets = t.clone();
        }
        for t in &space.topologies {
            if let Topology::Mesh {
                prefill_nodes,
                decode_nodes,
            } = *t
            {
                if prefill_nodes + decode_nodes > self.nodes {
                    bail!(
                        "--topologies: {t} needs {} nodes; --nodes is {}",
                        prefill_nodes + decode_nodes,
                        self.nodes
                    );
                }
            }
        }
        if let Some(&0) = space.step_budgets.iter().min() {
            bail!("--step-budgets: a step budget must be at least 1 token");
        }
        for (name, empty) in [
            ("--topologies", space.topologies.is_empty()),
            ("--step-budgets", space.step_budgets.is_empty()),
            ("--step-times", space.step_times.is_empty()),
            ("--local-prefill", space.local_prefill_thresholds.is_empty()),
            ("--policies", space.policies.is_empty()),
            ("--ttft-targets", space.ttft_targets.is_empty()),
        ] {
            if empty {
                bail!("{name} is empty");
            }
        }
        Ok(space)
    }

    fn min_measurement(&self) -> Duration {
        self.min_probe * MIN_PROBES
    }

    /// The sample to measure and its schedule.
    fn plan(&self) -> Result<(Vec<Candidate>, Halving)> {
        if self.min_probe.is_zero() {
            bail!("--min-probe must be longer than zero");
        }
        if self.probes < MIN_PROBES as usize {
            bail!("--probes must be at least {MIN_PROBES}");
        }
        if self.max_concurrency == 0 {
            bail!("--max-concurrency must be at least 1");
        }
        let all = self.space()?.candidates();
        let fits = affordable(self.budget, self.min_measurement());
        if fits == 0 {
            bail!(
                "--budget {} affords no measurement of {} ({MIN_PROBES} probes of --min-probe)",
                humantime::format_duration(self.budget),
                humantime::format_duration(self.min_measurement())
            );
        }
        let n = match self.candidates {
            Some(0) => bail!("--candidates must be at least 1"),
            Some(n) => n,
            None => fits,
        };
        let mut sample = space::sample(all, n, self.seed);
        // The untuned configuration is measured too (in place of the last sampled one), so the
        // result is judged against it in the same run.
        let baseline = Candidate::baseline(self.nodes);
        if !self.no_baseline && !sample.contains(&baseline) {
            if sample.len() > 1 {
                sample.pop();
            }
            sample.push(baseline);
        }
        let schedule = Halving::new(sample.len(), self.budget, self.min_measurement())?;
        Ok((sample, schedule))
    }
}

pub fn run(args: &TuneArgs) -> Result<()> {
    let (candidates, mut schedule) = args.plan()?;
    println!("{}", table::plan(&candidates, &schedule));
    if args.dry_run {
        return Ok(());
    }
    crate::model_args::prepare(args.model.as_deref(), Some(1))?;
    let workload = args
        .workload
        .load(&WorkloadOptions {
            seed: args.seed,
            max_tokens: Some(args.max_tokens),
            ..WorkloadOptions::new(Api::Completions, 1000)
        })
        .with_context(|| format!("loading the workload {}", args.workload))?;
    let bench = Bench {
        target: Target {
            url: String::new(),
            api: Api::Completions,
            model: None,
            api_key: None,
            ignore_eos: true,
            request_timeout: Duration::from_secs(60),
            extra_body: Default::default(),
        },
        workload,
        slo: args.slo.clone(),
        seed: args.seed,
        requests: None,
        duration: None,
        max_in_flight: args.max_concurrency.max(1),
        follow_turns: false,
    };
    let dirs = Dirs::create(&args.out)?;
    let runtime = crate::node::runtime()?;
    let interrupt = Interrupt::on_ctrl_c(&runtime);
    let started = Instant::now();
    let mut rows: Vec<Row> = Vec::new();
    while let Some(m) = schedule.next() {
        let candidate = &candidates[m.candidate];
        eprintln!(
            "kvmesh tune: #{} rung {} ({}): {candidate}",
            m.candidate,
            m.rung,
            humantime::format_duration(round(m.budget))
        );
        let t0 = Instant::now();
        let measured = measure(
            args,
            &bench,
            candidate,
            &dirs.candidate(m.candidate, m.rung),
            m.budget,
            &runtime,
            &interrupt,
        );
        let took = t0.elapsed();
        if interrupt.is_set() {
            bail!("interrupted; every deployment is stopped");
        }
        let row = match measured {
            Ok(found) => Row::measured(m, found, took),
            Err(e) => {
                eprintln!("kvmesh tune: #{} failed: {e:#}", m.candidate);
                Row::failed(m, format!("{e:#}"), took)
            }
        };
        schedule.record(row.score(), took)?;
        rows.push(row);
    }
    let elapsed = started.elapsed();
    println!("{}", table::results(&candidates, &rows));
    for path in write_pareto(&args.out, &candidates, &rows, &args.slo)? {
        println!("wrote {}", path.display());
    }
    let Some(winner) = schedule
        .winner()
        .filter(|w| w.score.is_finite() && w.score > 0.0)
    else {
        bail!("no candidate carried any load within the SLO {}", args.slo);
    };
    let best = &candidates[winner.measurement.candidate];
    let best_row = rows
        .iter()
        .rfind(|r| r.measurement == winner.measurement)
        .context("the winner has no row")?;
    let header = format!(
        "kvmesh tune: best of {} candidates in {}\n{}\nSLO {}, workload {}, max_tokens {}",
        candidates.len(),
        humantime::format_duration(round(elapsed)),
        best_row.summary(),
        args.slo,
        args.workload,
        args.max_tokens
    );
    let files = write_rendered(&dirs.best, best, &header)?;
    println!(
        "best: #{} {best}\n{}",
        winner.measurement.candidate,
        best_row.summary()
    );
    for path in &files {
        println!(
            "== {}\n{}",
            path.display(),
            std::fs::read_to_string(path).context("reading back the best configuration")?
        );
    }
    if let Some(line) = against_baseline(args.nodes, &candidates, &rows, winner.measurement) {
        println!("{line}");
    }
    let why = match schedule.finished() {
        Some(halving::Finish::BudgetSpent) => "the budget ran out before the last rung",
        _ => "every rung measured",
    };
    println!(
        "{} measurements in {} ({} measuring; budget {}): {why}",
        schedule.measured().len(),
        humantime::format_duration(round(elapsed)),
        humantime::format_duration(round(schedule.spent())),
        humantime::format_duration(args.budget)
    );
    Ok(())
}

/// To the tenth of a second, for display.
fn round(d: Duration) -> Duration {
    Duration::from_millis((d.as_millis() as u64).div_ceil(100) * 100)
}

/// The output directory's layout.
struct Dirs {
    best: PathBuf,
    runs: PathBuf,
}

impl Dirs {
    fn create(out: &Path) -> Result<Dirs> {
        let best = out.join("best");
        let runs = out.join("candidates");
        for dir in [&best, &runs] {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        Ok(Dirs { best, runs })
    }

    /// A measurement's configuration files and logs.
    fn candidate(&self, index: usize, rung: usize) -> PathBuf {
        self.runs.join(format!("{index}-rung{rung}"))
    }
}

/// The candidate's TOML files in `dir`: `serve.toml`, or `router.toml`, `prefill.toml` and
/// `decode.toml`.
fn write_rendered(dir: &Path, c: &Candidate, header: &str) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let files: Vec<(&str, String)> = match render::render(c, header)? {
        Rendered::Serve { serve } => vec![("serve.toml", serve)],
        Rendered::Mesh {
            router,
            prefill,
            decode,
            ..
        } => vec![
            ("router.toml", router),
            ("prefill.toml", prefill),
            ("decode.toml", decode),
        ],
    };
    // A previous run's files of the other shape would read as part of this answer.
    for stale in ["serve.toml", "router.toml", "prefill.toml", "decode.toml"] {
        let _ = std::fs::remove_file(dir.join(stale));
    }
    files
        .into_iter()
        .map(|(name, text)| {
            let path = dir.join(name);
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
            Ok(path)
        })
        .collect()
}

/// A running deployment; dropping it stops every process.
enum Deployment {
    Serve(ServeProcess),
    Mesh(Cluster),
}

impl Deployment {
    fn start(
        c: &Candidate,
        dir: &Path,
        options: &ChildOptions,
        runtime: &tokio::runtime::Runtime,
    ) -> Result<Deployment> {
        let files = write_rendered(dir, c, "")?;
        match c.topology {
            Topology::Serve { .. } => {
                Ok(Deployment::Serve(ServeProcess::start(&files[0], options)?))
            }
            Topology::Mesh {
                prefill_nodes,
                decode_nodes,
            } => {
                let spec = MeshSpec {
                    prefill_nodes,
                    decode_nodes,
                    router_config: Some(files[0].clone()),
                    prefill_config: Some(files[1].clone()),
                    decode_config: Some(files[2].clone()),
                    ..MeshSpec::default()
                };
                let cluster = Cluster::start(&spec, options)?;
                runtime.block_on(async {
                    let all_up = cluster.await_nodes(crate::local_cluster::START_TIMEOUT);
                    match &options.interrupt {
                        Some(i) => tokio::select! {
                            r = all_up => r,
                            () = i.wait() => Err(anyhow::anyhow!("interrupted")),
                        },
                        None => all_up.await,
                    }
                })?;
                Ok(Deployment::Mesh(cluster))
            }
        }
    }

    fn url(&self) -> String {
        match self {
            Deployment::Serve(s) => s.url(),
            Deployment::Mesh(m) => m.url(),
        }
    }
}

/// What one measurement found.
#[derive(Clone, Debug, PartialEq)]
pub struct Found {
    /// Requests per second within the SLO at the highest concurrency that passed (else see
    /// `proven`); 0 when even concurrency 1 failed.
    pub goodput: f64,
    /// The concurrency found, if any passed.
    pub concurrency: Option<usize>,
    /// Whether a probe passed; otherwise `goodput` is the best of probes too short to show
    /// the SLO's attainment either way.
    pub proven: bool,
    /// TTFT p99 (seconds) at that concurrency (at concurrency 1 when none passed).
    pub ttft_p99: Option<f64>,
    /// How long the deployment took to come up, and each probe's length.
    pub startup: Duration,
    pub probe: Duration,
    pub probes: usize,
}

/// Deploys `c`, searches its max goodput in what is left of `budget` after start-up, and
/// stops it.
fn measure(
    args: &TuneArgs,
    bench: &Bench,
    c: &Candidate,
    dir: &Path,
    budget: Duration,
    runtime: &tokio::runtime::Runtime,
    interrupt: &Interrupt,
) -> Result<Found> {
    let options = ChildOptions {
        model: args.model.clone(),
        threads: args.node_threads,
        logs: Some(dir.join("logs")),
        interrupt: Some(interrupt.clone()),
    };
    let t0 = Instant::now();
    let deployment = Deployment::start(c, dir, &options, runtime)?;
    let startup = t0.elapsed();
    let (probe, max_probes) =
        probe_plan(budget.saturating_sub(startup), args.min_probe, args.probes);
    let bench = Bench {
        target: Target {
            url: deployment.url(),
            // A request outliving its probe this long has missed any SLO worth meeting;
            // waiting longer would only spend the budget.
            request_timeout: (probe * 2).clamp(Duration::from_secs(10), Duration::from_secs(60)),
            ..bench.target.clone()
        },
        duration: Some(probe),
        ..bench.clone()
    };
    let config = SearchConfig {
        axis: Axis::Concurrency,
        start: 1.0,
        max: args.max_concurrency as f64,
        resolution: 1.0,
        max_probes,
        criteria: Criteria::default(),
    };
    let mut quiet = |_: Progress<'_>| {};
    let search = runtime.block_on(async {
        tokio::select! {
            s = bench.max_goodput(config, Arrivals::Poisson, &mut quiet) => Ok(s),
            () = interrupt.wait() => Err(anyhow::anyhow!("interrupted")),
        }
    })??;
    drop(deployment);
    let (point, concurrency, proven) = match (&search.max_goodput, &search.found) {
        (Some(m), Some(f)) => (
            search.points.iter().rfind(|p| p.point.label == m.label),
            Some(f.load as usize),
            true,
        ),
        // No probe passed: the best goodput of a probe too short to tell (inconclusive)
        // still ranks candidates measured briefly, marked unproven; none: 0.
        _ => (
            search
                .points
                .iter()
                .zip(&search.probes)
                .filter(|(_, probe)| probe.verdict == Verdict::Inconclusive)
                .map(|(p, _)| p)
                .max_by(|a, b| {
                    a.point
                        .slo
                        .goodput
                        .rate
                        .total_cmp(&b.point.slo.goodput.rate)
                }),
            None,
            false,
        ),
    };
    Ok(Found {
        goodput: point.map_or(0.0, |p| p.point.slo.goodput.rate),
        concurrency,
        proven,
        ttft_p99: point
            .or(search.points.first())
            .and_then(|p| p.point.slo.ttft.as_ref())
            .map(|s| s.p99),
        startup,
        probe,
        probes: search.points.len(),
    })
}

/// Each probe's length and how many a search may run in `left`: as many as fit at
/// `min_probe` (one more than run, for a retry of an inconclusive one), at most `most`,
/// sharing `left` between them.
fn probe_plan(left: Duration, min_probe: Duration, most: usize) -> (Duration, usize) {
    let fit = (left.as_secs_f64() / min_probe.as_secs_f64()).floor() as usize;
    let probes = fit.saturating_sub(1).clamp(1, most);
    let length = (left / (probes as u32 + 1)).max(min_probe);
    (length, probes)
}

/// The Pareto plot of every candidate's highest-rung measurement, as SVG and PNG in `out`.
fn write_pareto(
    out: &Path,
    candidates: &[Candidate],
    rows: &[Row],
    slo: &SloSpec,
) -> Result<Vec<PathBuf>> {
    let latest = table::latest_per_candidate(rows);
    let measured: Vec<(usize, pareto::Point)> = latest
        .iter()
        .filter_map(|r| {
            let found = r.found.as_ref()?;
            Some((
                r.measurement.candidate,
                pareto::Point {
                    goodput: found.goodput,
                    ttft_p99: found.ttft_p99?,
                },
            ))
        })
        .collect();
    let points: Vec<pareto::Point> = measured.iter().map(|(_, p)| *p).collect();
    let front = pareto::pareto_front(&points);
    let trade_offs: Vec<plot::TradeOff> = measured
        .iter()
        .enumerate()
        .map(|(i, (index, p))| plot::TradeOff {
            label: format!("#{index} {}", candidates[*index]),
            goodput: p.goodput,
            ttft_p99_ms: p.ttft_p99 * 1e3,
            on_front: front.contains(&i),
        })
        .collect();
    Ok(plot::write_pareto(
        out,
        &trade_offs,
        &slo.to_string(),
        &[PlotFormat::Svg, PlotFormat::Png],
        plot::DEFAULT_SIZE,
    )?)
}

/// The winner against the untuned configuration, at the last rung the untuned one was
/// measured in (the same probe budget for both); `None` without it in the sample.
fn against_baseline(
    nodes: usize,
    candidates: &[Candidate],
    rows: &[Row],
    winner: Measurement,
) -> Option<String> {
    let baseline = candidates
        .iter()
        .position(|c| *c == Candidate::baseline(nodes))?;
    let base = rows
        .iter()
        .filter(|r| r.measurement.candidate == baseline)
        .max_by_key(|r| r.measurement.rung)?;
    let best = rows.iter().rfind(|r| {
        r.measurement.candidate == winner.candidate && r.measurement.rung == base.measurement.rung
    })?;
    let ratio = match (best.score(), base.score()) {
        (b, d) if d > 0.0 && b.is_finite() => format!("{:.2}x", b / d),
        _ => "n/a (the default carried nothing within the SLO)".to_owned(),
    };
    Some(format!(
        "best against the default (#{baseline}, rung {}, same probe budget): {ratio}; \
         best {}, default {}",
        base.measurement.rung,
        best.summary(),
        base.summary()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_times_default_to_off_and_under_the_itl_objective() {
        let slo = |s: &str| s.parse::<SloSpec>().unwrap();
        assert_eq!(
            default_step_times(&slo("ttft=2s,itl=100ms")),
            [Duration::ZERO, Duration::from_millis(60)]
        );
        assert_eq!(default_step_times(&slo("ttft=2s")), [Duration::ZERO]);
    }

    #[test]
    fn probes_share_what_is_left() {
        let s = Duration::from_secs;
        // 60 s at 5 s probes: 11 fit, 10 run (one spare for a retry), capped at 8.
        assert_eq!(probe_plan(s(60), s(5), 8), (s(60) / 9, 8));
        assert_eq!(probe_plan(s(20), s(5), 8), (s(5), 3));
        // Too little left: one probe of the shortest length.
        assert_eq!(probe_plan(s(2), s(5), 8), (s(5), 1));
    }

    #[test]
    fn the_winner_is_judged_against_the_default_at_the_defaults_last_rung() {
        let tuned = Candidate {
            max_num_batched_tokens: 512,
            ..Candidate::baseline(4)
        };
        assert_ne!(tuned, Candidate::baseline(4));
        let candidates = [tuned, Candidate::baseline(4)];
        let row = |candidate, rung, goodput| {
            let m = Measurement {
                candidate,
                rung,
                budget: Duration::from_secs(10),
            };
            let found = Found {
                goodput,
                concurrency: Some(4),
                proven: true,
                ttft_p99: Some(0.5),
                startup: Duration::ZERO,
                probe: Duration::from_secs(1),
                probes: 3,
            };
            Row::measured(m, found, Duration::from_secs(10))
        };
        // The default is out after rung 0; the winner goes on to rung 1.
        let rows = [row(0, 0, 6.0), row(1, 0, 4.0), row(0, 1, 9.0)];
        let line = against_baseline(4, &candidates, &rows, rows[2].measurement).unwrap();
        assert!(line.contains("rung 0") && line.contains("1.50x"), "{line}");
        // Without the default in the sample there is nothing to say.
        assert_eq!(
            against_baseline(4, &candidates[..1], &rows[..1], rows[0].measurement),
            None
        );
        assert_eq!(
            Candidate::baseline(4).topology,
            Topology::Mesh {
                prefill_nodes: 2,
                decode_nodes: 2
            }
        );
    }

    #[test]
    fn ttft_targets_parse_off() {
        assert_eq!(parse_target("off"), Ok(Duration::ZERO));
        assert_eq!(parse_target("2s"), Ok(Duration::from_secs(2)));
        assert!(parse_target("soon").unwrap_err().contains("or `off`"));
    }
}
