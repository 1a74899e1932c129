//! A serving measurement through the library, the flags of `kvmesh bench serve` that
//! `bench/serve/compare_llamaserver.sh` uses: one load point, or the most goodput a server
//! carries within an SLO (`--max-goodput`, GuideLLM's doubling + bisection over the
//! concurrency, each probe judged by the Wilson interval of its attainment).
//!
//! ```text
//! serve_goodput --url http://127.0.0.1:8000 --model NAME --workload SPEC \
//!     [--load concurrency:4 | --max-goodput [--start 1] [--max 32] [--max-probes 8]] \
//!     [--slo ttft=2s,itl=100ms] [--attainment 0.99] [--requests 200] [--duration 60s] \
//!     [--api completions|chat] [--ignore-eos] [--seed 0] [--request-timeout 120s] --out DIR
//! serve_goodput compare A/report.json B/report.json
//! ```
//!
//! `--out DIR` receives `report.json` (docs/bench-report.md) and `requests.csv` (every
//! request of every point); the table goes to stdout, progress to stderr. `--requests` and
//! `--duration` bound each point (the first reached ends it; a retried probe runs twice as
//! long). `compare` prints `bench::report::compare` and the two max-goodput figures.

use std::path::PathBuf;
use std::time::Duration;

use humantime_serde::re::humantime::parse_duration;
use kvmesh_bench::arrivals::{Arrivals, LoadShape};
use kvmesh_bench::cpu::CpuClock;
use kvmesh_bench::load::csv;
use kvmesh_bench::probe::{Bench, Measured, Progress};
use kvmesh_bench::report::{self, BenchReport, MaxGoodput, TargetInfo};
use kvmesh_bench::search::{Axis, Criteria, SearchConfig};
use kvmesh_bench::slo::SloSpec;
use kvmesh_bench::workload::{WorkloadOptions, WorkloadSpec};
use kvmesh_bench::{Api, RunEvent, Target};

struct Args {
    target: Target,
    workload: WorkloadSpec,
    load: Option<LoadShape>,
    max_goodput: bool,
    search: SearchConfig,
    slo: SloSpec,
    requests: Option<usize>,
    duration: Option<Duration>,
    seed: u64,
    out: PathBuf,
}

fn parse_args(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut target = Target {
        url: String::new(),
        api: Api::Completions,
        model: None,
        api_key: None,
        ignore_eos: false,
        request_timeout: Duration::from_secs(120),
    };
    let mut workload = None;
    let mut load = None;
    let mut max_goodput = false;
    let mut search = SearchConfig {
        axis: Axis::Concurrency,
        start: 1.0,
        max: 32.0,
        resolution: 1.0,
        max_probes: 8,
        criteria: Criteria::default(),
    };
    let mut slo: SloSpec = "ttft=2s,itl=100ms".parse().map_err(|e| format!("{e}"))?;
    let (mut requests, mut duration, mut seed, mut out) = (Some(200), None, 0, None);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let number = |v: String| v.parse::<f64>().map_err(|e| format!("{flag} {v}: {e}"));
        let time = |v: String| parse_duration(&v).map_err(|e| format!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--url" => target.url = value()?,
            "--model" => target.model = Some(value()?),
            "--api" => {
                target.api = match value()?.as_str() {
                    "completions" => Api::Completions,
                    "chat" => Api::Chat,
                    other => return Err(format!("--api {other}: completions or chat")),
                }
            }
            "--ignore-eos" => target.ignore_eos = true,
            "--request-timeout" => target.request_timeout = time(value()?)?,
            "--workload" => {
                let v = value()?;
                workload = Some(v.parse().map_err(|e| format!("--workload {v}: {e}"))?);
            }
            "--load" => {
                let v = value()?;
                load = Some(v.parse().map_err(|e| format!("--load {v}: {e}"))?);
            }
            "--max-goodput" => max_goodput = true,
            "--start" => search.start = number(value()?)?,
            "--max" => search.max = number(value()?)?,
            "--max-probes" => search.max_probes = number(value()?)? as usize,
            "--attainment" => search.criteria.target_attainment = number(value()?)?,
            "--slo" => {
                let v = value()?;
                slo = v.parse().map_err(|e| format!("--slo {v}: {e}"))?;
            }
            "--requests" => requests = Some(number(value()?)? as usize).filter(|&n| n > 0),
            "--duration" => duration = Some(time(value()?)?),
            "--seed" => seed = number(value()?)? as u64,
            "--out" => out = Some(PathBuf::from(value()?)),
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if target.url.is_empty() {
        return Err("--url is required".into());
    }
    if max_goodput == load.is_some() {
        return Err("give one of --load SHAPE and --max-goodput".into());
    }
    if requests.is_none() && duration.is_none() {
        return Err("a point needs --requests or --duration to end".into());
    }
    Ok(Args {
        target,
        workload: workload.ok_or("--workload is required")?,
        load,
        max_goodput,
        search,
        slo,
        requests,
        duration,
        seed,
        out: out.ok_or("--out is required")?,
    })
}

/// A line on stderr as each point starts and every 50 requests that end.
fn progress() -> impl FnMut(Progress<'_>) + Send {
    let mut ended = 0usize;
    move |event| match event {
        Progress::Point { index, label, .. } => {
            ended = 0;
            eprintln!("[serve_goodput] point {index}: {label}");
        }
        Progress::Request(RunEvent::Ended(_)) => {
            ended += 1;
            if ended.is_multiple_of(50) {
                eprintln!("[serve_goodput]   {ended} requests ended");
            }
        }
        Progress::Request(_) => {}
    }
}

async fn measure(args: &Args) -> Result<BenchReport, String> {
    // A point is cycled through the workload, so it needs no more distinct requests than
    // the longest point sends (a retried probe: twice the configured length).
    let distinct = args.requests.unwrap_or(1000).saturating_mul(2);
    let opts = WorkloadOptions {
        seed: args.seed,
        ..WorkloadOptions::new(args.target.api, distinct)
    };
    let workload = args.workload.load(&opts).map_err(|e| e.to_string())?;
    let bench = Bench {
        target: args.target.clone(),
        workload,
        slo: args.slo.clone(),
        seed: args.seed,
        requests: args.requests,
        duration: args.duration,
        max_in_flight: 1024,
        follow_turns: false,
    };
    let mut report = BenchReport::new(
        TargetInfo::from(&args.target),
        args.workload.to_string(),
        args.seed,
        &args.slo,
    );
    let clock = CpuClock::start();
    let mut observer = progress();
    let measured: Vec<Measured> = if args.max_goodput {
        let search = bench
            .max_goodput(args.search.clone(), Arrivals::Poisson, &mut observer)
            .await
            .map_err(|e| e.to_string())?;
        report.max_goodput = search.max_goodput;
        search.points
    } else {
        let shape = args.load.as_ref().expect("checked in parse_args");
        vec![bench
            .point(shape, &mut observer)
            .await
            .map_err(|e| e.to_string())?]
    };
    report.generator = clock.stop();
    write_requests_csv(args, &measured)?;
    report.points = measured.into_iter().map(|m| m.point).collect();
    Ok(report)
}

fn write_requests_csv(args: &Args, measured: &[Measured]) -> Result<(), String> {
    let mut text = csv::header("point");
    text.push('\n');
    for m in measured {
        for o in &m.run.outcomes {
            text.push_str(&csv::row(&m.point.label, o));
            text.push('\n');
        }
    }
    let path = args.out.join("requests.csv");
    std::fs::write(&path, text).map_err(|e| format!("writing {}: {e}", path.display()))
}

fn max_goodput_line(name: &str, m: Option<&MaxGoodput>) -> String {
    match m {
        Some(m) => format!(
            "max goodput{name}: {:.3} req/s at {} (95% interval {})",
            m.goodput.rate,
            m.load,
            match (m.goodput.low, m.goodput.high) {
                (Some(l), Some(h)) => format!("{l:.3}..{h:.3}"),
                _ => "-".into(),
            }
        ),
        None => format!("max goodput{name}: none (no load passed)"),
    }
}

fn read_report(path: &str) -> Result<BenchReport, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading {path}: {e}"))?;
    BenchReport::from_json(&text).map_err(|e| format!("{path}: {e}"))
}

fn compare(paths: &[String]) -> Result<(), String> {
    let [a, b] = paths else {
        return Err("compare takes two report.json paths".into());
    };
    let (ra, rb) = (read_report(a)?, read_report(b)?);
    print!("{}", report::compare(&ra, &rb).map_err(|e| e.to_string())?);
    println!();
    println!("{}", max_goodput_line(" A", ra.max_goodput.as_ref()));
    println!("{}", max_goodput_line(" B", rb.max_goodput.as_ref()));
    if let (Some(x), Some(y)) = (&ra.max_goodput, &rb.max_goodput) {
        if y.goodput.rate > 0.0 {
            println!("max goodput A/B: {:.2}x", x.goodput.rate / y.goodput.rate);
        }
    }
    Ok(())
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let result = if argv.first().map(String::as_str) == Some("compare") {
        compare(&argv[1..])
    } else {
        parse_args(argv.into_iter()).and_then(|args| {
            std::fs::create_dir_all(&args.out)
                .map_err(|e| format!("creating {}: {e}", args.out.display()))?;
            // One runtime thread: the generator shares a small machine with the server.
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("a runtime: {e}"))?;
            let report = runtime.block_on(measure(&args))?;
            let path = args.out.join("report.json");
            std::fs::write(&path, report.to_json())
                .map_err(|e| format!("writing {}: {e}", path.display()))?;
            print!("{}", report::render_table(&report));
            println!("{}", max_goodput_line("", report.max_goodput.as_ref()));
            for w in report.warnings() {
                eprintln!("warning: {w}");
            }
            Ok(())
        })
    };
    if let Err(e) = result {
        eprintln!("serve_goodput: {e}");
        std::process::exit(2);
    }
}
