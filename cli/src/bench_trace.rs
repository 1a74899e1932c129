//! `kvmesh bench trace`: replays the Mooncake conversation trace, scaled to this model,
//! against a 2-prefill/2-decode cluster (a throwaway etcd and five processes of this binary
//! on loopback addresses), once per routing policy, each on a fresh cluster so no policy
//! inherits another's warm caches. With `--url`, replays against that router instead.

use crate::local_cluster::{ChildOptions, Cluster, MeshSpec, START_TIMEOUT};
use crate::model_args::ModelArgs;
use anyhow::{Context, Result};
use clap::Args;
use kvmesh_bench::load::csv;
use kvmesh_bench::{
    load_trace, replay, sample_conversations, scale_trace, Pacing, ReplayOptions, ReplayReport,
    ScaleConfig, TraceSource,
};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct BenchTraceArgs {
    /// The trace (JSON Lines) [default: the Mooncake conversation trace built into the
    /// binary, data/traces/mooncake_conversation_trace.jsonl in the repository].
    #[arg(long, value_name = "PATH")]
    pub trace: Option<PathBuf>,
    /// Each 512-token trace block becomes 512/scale tokens.
    #[arg(long, default_value_t = 32)]
    pub scale: u32,
    /// Mean request rate (requests/s), keeping the trace's bursts.
    #[arg(long, default_value_t = 0.5)]
    pub rate: f64,
    /// Requests replayed (from the start of the trace, or of the sampled conversations).
    #[arg(long, default_value_t = 60)]
    pub limit: usize,
    /// Replay the first N multi-turn conversations whole instead of a window of the trace
    /// (a window of a few dozen requests shares almost no prefix).
    #[arg(long)]
    pub conversations: Option<usize>,
    /// Routing policies to compare, each on a fresh cluster.
    #[arg(long, value_delimiter = ',', default_values_t = ["kv_aware".to_string(), "round_robin".to_string(), "random".to_string()])]
    pub policies: Vec<String>,
    /// Replay against this router (http://HOST:PORT) instead of starting clusters.
    #[arg(long)]
    pub url: Option<String>,
    /// The routers' `--pull-min-blocks` (0: no cross-node pulls at all: the decode nodes get
    /// `--prefill-pulls false` too).
    #[arg(long)]
    pub pull_min_blocks: Option<usize>,
    /// Send every request at its scheduled time, a follow-up turn even before the turn it
    /// follows has been answered (by default it waits for that turn's end).
    #[arg(long)]
    pub open_loop: bool,
    /// Compute threads per node process.
    #[arg(long, default_value_t = 1)]
    pub node_threads: usize,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Also write every request (policy, schedule, prompt and cached tokens, TTFT, ...) to
    /// this CSV file.
    #[arg(long)]
    pub requests_csv: Option<PathBuf>,
}

pub fn run(args: &BenchTraceArgs) -> Result<()> {
    let config = ScaleConfig {
        scale: args.scale,
        pacing: Pacing::RequestsPerSecond(args.rate),
        ..ScaleConfig::default()
    };
    let source = TraceSource::from_path(args.trace.clone());
    let requests = match args.conversations {
        None => load_trace(&source, Some(args.limit), &config),
        Some(n) => source.read(None).and_then(|all| {
            let mut sample = sample_conversations(&all, n);
            sample.truncate(args.limit);
            scale_trace(&sample, &config)
        }),
    }
    .with_context(|| format!("reading {source}"))?;
    let options = ReplayOptions {
        follow_turns: !args.open_loop,
        ..ReplayOptions::default()
    };
    let runtime = crate::node::runtime()?;
    let replay_at = |url: &str| -> Result<ReplayReport> {
        runtime
            .block_on(replay(url, "", &requests, &options))
            .context("replaying")
    };
    let mut reports = Vec::new();
    if let Some(url) = &args.url {
        reports.push(("given".to_string(), replay_at(url)?));
    } else {
        // Fetch once before five processes race for it.
        args.model.prepare()?;
        for policy in &args.policies {
            let cluster = start_cluster(policy, args)?;
            runtime.block_on(cluster.await_nodes(START_TIMEOUT))?;
            tracing::info!(policy, "cluster up; replaying");
            let report = replay_at(&cluster.url())?;
            drop(cluster);
            reports.push((policy.clone(), report));
        }
    }
    if let Some(path) = &args.requests_csv {
        write_requests_csv(path, &reports)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if args.json {
        let map: serde_json::Map<String, serde_json::Value> = reports
            .iter()
            .map(|(p, r)| Ok((p.clone(), serde_json::to_value(r)?)))
            .collect::<Result<_>>()?;
        println!("{}", serde_json::Value::Object(map));
    } else {
        for (policy, report) in &reports {
            println!("== {policy}\n{report}");
        }
    }
    Ok(())
}

fn write_requests_csv(path: &std::path::Path, reports: &[(String, ReplayReport)]) -> Result<()> {
    let mut text = csv::header("policy") + "\n";
    for (policy, report) in reports {
        for outcome in &report.per_request {
            csv::push_row(&mut text, policy, outcome, outcome.gaps.len());
            text.push('\n');
        }
    }
    Ok(std::fs::write(path, text)?)
}

/// Two prefill, two decode nodes and a router with `policy`.
fn start_cluster(policy: &str, args: &BenchTraceArgs) -> Result<Cluster> {
    let mut router_args = vec!["--routing-policy".to_string(), policy.to_string()];
    if let Some(n) = args.pull_min_blocks {
        router_args.extend(["--pull-min-blocks".to_string(), n.to_string()]);
    }
    let decode_args = if args.pull_min_blocks == Some(0) {
        vec!["--prefill-pulls".to_string(), "false".to_string()]
    } else {
        Vec::new()
    };
    let spec = MeshSpec {
        prefill_nodes: 2,
        decode_nodes: 2,
        router_args,
        decode_args,
        ..MeshSpec::default()
    };
    let options = ChildOptions {
        model: args.model.model.clone(),
        threads: args.node_threads,
        ..ChildOptions::default()
    };
    Cluster::start(&spec, &options)
}
