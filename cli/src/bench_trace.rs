//! `kvmesh bench trace`: replays the Mooncake conversation trace, scaled to this model,
//! against a 2-prefill/2-decode cluster (a throwaway etcd and five processes of this binary
//! on loopback addresses), once per routing policy, each on a fresh cluster so no policy
//! inherits another's warm caches. With `--url`, replays against that router instead.

use crate::model_args::ModelArgs;
use anyhow::{bail, Context, Result};
use clap::Args;
use kvmesh_bench::load::csv;
use kvmesh_bench::{
    load_trace, replay, sample_conversations, scale_trace, Pacing, ReplayOptions, ReplayReport,
    ScaleConfig, TraceSource,
};
use kvmesh_common::NodeRole;
use kvmesh_kvstore::{Discovery, EtcdConfig, EtcdDiscovery, EtcdServer};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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
            let cluster = Cluster::start(policy, args)?;
            runtime.block_on(cluster.await_nodes(Duration::from_secs(120)))?;
            tracing::info!(policy, "cluster up; replaying");
            let report = replay_at(&format!("http://{}", cluster.router))?;
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
            text.push_str(&csv::row(policy, outcome));
            text.push('\n');
        }
    }
    Ok(std::fs::write(path, text)?)
}

/// etcd, two prefill, two decode nodes and a router with `policy`; stopped on drop.
struct Cluster {
    children: Vec<Child>,
    router: SocketAddr,
    _etcd: EtcdServer,
}

impl Cluster {
    fn start(policy: &str, args: &BenchTraceArgs) -> Result<Cluster> {
        let etcd = EtcdServer::start()?;
        let exe = std::env::current_exe()?;
        let mut children = Vec::new();
        let mut spawn = |role: &str, ip: &str, extra: &[&str]| -> Result<SocketAddr> {
            let addr = TcpListener::bind((ip, 0))?.local_addr()?;
            let mut cmd = Command::new(&exe);
            cmd.args([
                role,
                "--etcd",
                &etcd.endpoint(),
                "--listen",
                &addr.to_string(),
            ])
            .args([
                "--cluster",
                "bench",
                "--threads",
                &args.node_threads.to_string(),
            ])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
            if let Some(m) = &args.model.model {
                cmd.arg("--model").arg(m);
            }
            children.push(cmd.spawn().with_context(|| format!("starting {role}"))?);
            Ok(addr)
        };
        for ip in ["127.0.0.3", "127.0.0.4"] {
            spawn("prefill", ip, &[])?;
        }
        let no_pulls = args.pull_min_blocks == Some(0);
        let decode_args: &[&str] = if no_pulls {
            &["--prefill-pulls", "false"]
        } else {
            &[]
        };
        for ip in ["127.0.0.5", "127.0.0.6"] {
            spawn("decode", ip, decode_args)?;
        }
        let mut router_args = vec!["--routing-policy".to_string(), policy.to_string()];
        if let Some(n) = args.pull_min_blocks {
            router_args.extend(["--pull-min-blocks".to_string(), n.to_string()]);
        }
        let router_args: Vec<&str> = router_args.iter().map(String::as_str).collect();
        let router = spawn("router", "127.0.0.2", &router_args)?;
        let cluster = Cluster {
            children,
            router,
            _etcd: etcd,
        };
        cluster.await_ready(Duration::from_secs(120))?;
        Ok(cluster)
    }

    /// Until discovery shows every node (they register once their model is loaded).
    async fn await_nodes(&self, within: Duration) -> Result<()> {
        let config = EtcdConfig {
            endpoints: vec![self._etcd.endpoint()],
            cluster: "bench".into(),
            ..EtcdConfig::default()
        };
        let discovery = EtcdDiscovery::connect(config).await?;
        let mut changes = discovery.subscribe();
        let all_up = || {
            discovery.nodes(NodeRole::Prefill).len() == 2
                && discovery.nodes(NodeRole::Decode).len() == 2
        };
        tokio::time::timeout(within, async {
            while !all_up() {
                if changes.changed().await.is_err() {
                    break;
                }
            }
        })
        .await
        .context("waiting for the nodes to register")?;
        Ok(())
    }

    /// The router answers /health 200 once a decode node is registered.
    fn await_ready(&self, within: Duration) -> Result<()> {
        let deadline = Instant::now() + within;
        while !crate::bench_trace::health_ok(self.router) {
            if Instant::now() > deadline {
                bail!("the cluster did not come up within {within:?}");
            }
            // A process start-up with no push signal to await; bounded by the deadline.
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn health_ok(addr: SocketAddr) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return false;
    };
    let _ = write!(
        s,
        "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    );
    let mut r = String::new();
    let _ = s.read_to_string(&mut r);
    r.starts_with("HTTP/1.1 200")
}
