//! `kvmesh planner`: the planner core driven against a running mesh.
//!
//! One active planner per cluster: candidates take turns on an etcd lease
//! (`/{cluster}/planner/leader`); the leader observes every `--observe-every` (discovery's
//! nodes and load reports, the routers' metrics differenced over the interval), decides when
//! its policy's interval is due, and hands decisions that change counts to its actuator.
//! Each decision is logged (JSON) and written to `/{cluster}/planner/decision`. A leader that
//! loses its lease stops acting and campaigns again; a planner that stops or crashes leaves
//! the nodes as they are.

pub mod actuator;
pub mod compose;
pub mod etcd;
pub mod kubernetes;
pub mod local;
pub mod metrics;
pub mod observe;
#[cfg(test)]
mod testing;

use crate::config::env_vars;
use actuator::{moves, Actuator, NoActuator};
use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use humantime_serde::re::humantime;
use kvmesh_common::NodeRole;
use kvmesh_kvstore::{Discovery, EtcdConfig, EtcdDiscovery, Leadership, NodeEntry};
use kvmesh_planner::{Decision, Observation, Planner, PlannerConfig, Policy};
use observe::RouterTotals;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The planner's duty in etcd: `/{cluster}/planner/...`.
pub const DUTY: &str = "planner";

#[derive(Args, Debug)]
pub struct PlannerArgs {
    /// etcd client URLs, comma-separated.
    #[arg(long, env = env_vars::ETCD, value_delimiter = ',', required = true)]
    pub etcd: Vec<String>,
    /// The mesh's name (the root of its etcd keys).
    #[arg(long, env = env_vars::CLUSTER, default_value = "kvmesh")]
    pub cluster: String,
    /// The routers' base URLs (http://host:port), comma-separated: their /metrics give the
    /// arrival rate, prompt and output lengths, TTFT and ITL.
    #[arg(long, value_delimiter = ',')]
    pub router: Vec<String>,
    /// The planner's TOML (policy, bounds, budget, cooldowns, thresholds, SLO targets;
    /// planner/README.md). Default: the defaults, load policy.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Overrides the file's policy.
    #[arg(long, value_enum)]
    pub policy: Option<PolicyArg>,
    /// Overrides the SLO policy's targets: `ttft=500ms,itl=50ms` (either or both).
    #[arg(long)]
    pub slo: Option<String>,
    /// Decide and report, act on nothing.
    #[arg(long)]
    pub advisory: bool,
    /// Who carries decisions out: `local` (processes of this binary on this host),
    /// `compose` (`docker-compose up --scale` on the Compose cluster), `kubernetes` (the
    /// Deployments' scale subresource, from inside the cluster), `etcd` (desired counts for
    /// an external orchestrator), `none`.
    #[arg(long, value_enum, default_value = "local")]
    pub actuator: ActuatorArg,
    /// A flag for every node the local actuator starts (repeat; e.g.
    /// `--node-arg=--threads --node-arg=1`).
    #[arg(long = "node-arg", allow_hyphen_values = true)]
    pub node_args: Vec<String>,
    /// The Compose file of the cluster the `compose` actuator scales (its services
    /// `prefill` and `decode`; deploy/compose.yaml).
    #[arg(long, required_if_eq("actuator", "compose"))]
    pub compose_file: Option<PathBuf>,
    /// The Compose project name (`-p`), when not the file's directory name.
    #[arg(long)]
    pub compose_project: Option<String>,
    /// The namespace of the Deployments the `kubernetes` actuator scales (default: the
    /// planner pod's own).
    #[arg(long)]
    pub k8s_namespace: Option<String>,
    /// The Deployment of the prefill nodes, for the `kubernetes` actuator.
    #[arg(long, default_value = "prefill")]
    pub k8s_prefill_deployment: String,
    /// The Deployment of the decode nodes, for the `kubernetes` actuator.
    #[arg(long, default_value = "decode")]
    pub k8s_decode_deployment: String,
    /// How to run Compose (e.g. `docker compose`).
    #[arg(long, default_value = "docker-compose")]
    pub compose_command: String,
    /// Where the local actuator's nodes write their logs.
    #[arg(long, default_value = "kvmesh-planner-nodes")]
    pub logs: PathBuf,
    /// How often the mesh is observed (decisions come at the policy's interval).
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub observe_every: Duration,
    /// The planner's lease: a crashed leader is replaced after this.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub lease_ttl: Duration,
    /// Serve the planner's metrics (kvmesh_planner_*) on this address at /metrics.
    #[arg(long)]
    pub metrics_listen: Option<std::net::SocketAddr>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyArg {
    Load,
    Slo,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ActuatorArg {
    Local,
    Compose,
    Kubernetes,
    Etcd,
    None,
}

/// The configuration `args` describe: the file, then the flags over it, validated.
pub fn planner_config(args: &PlannerArgs) -> Result<PlannerConfig> {
    load_planner_config(
        args.config.as_deref(),
        args.policy,
        args.slo.as_deref(),
        args.advisory,
    )
}

/// A planner configuration: the TOML `file` (the defaults without one), then the overrides
/// (`--policy`, `--slo ttft=500ms,itl=50ms`, `--advisory`), validated. `kvmesh planner` and
/// `kvmesh serve --autoscale` read theirs through it.
pub fn load_planner_config(
    file: Option<&Path>,
    policy: Option<PolicyArg>,
    slo: Option<&str>,
    advisory: bool,
) -> Result<PlannerConfig> {
    let mut config: PlannerConfig = match file {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the planner config {}", path.display()))?;
            toml::from_str(&text)
                .with_context(|| format!("the planner config {}", path.display()))?
        }
        None => PlannerConfig::default(),
    };
    if let Some(p) = policy {
        config.policy = match p {
            PolicyArg::Load => Policy::Load,
            PolicyArg::Slo => Policy::Slo,
        };
    }
    if let Some(slo) = slo {
        for part in slo.split(',').filter(|p| !p.is_empty()) {
            let (key, value) = part
                .split_once('=')
                .with_context(|| format!("--slo {slo:?}: expected key=duration"))?;
            let value = humantime::parse_duration(value.trim())
                .with_context(|| format!("--slo {key}: {value:?} is not a duration"))?;
            match key.trim() {
                "ttft" => config.slo.ttft = value,
                "itl" => config.slo.itl = value,
                other => bail!("--slo: unknown objective {other:?} (ttft, itl)"),
            }
        }
    }
    config.advisory |= advisory;
    config
        .validate()
        .map_err(|e| anyhow::anyhow!("invalid planner config: {e}"))?;
    Ok(config)
}

pub fn run(args: &PlannerArgs) -> Result<()> {
    let config = planner_config(args)?;
    if args.router.is_empty() {
        tracing::warn!(
            "no --router: arrival rate, lengths and latencies are unknown; only the nodes' \
             load reports drive decisions"
        );
    }
    crate::node::runtime()?.block_on(async {
        if let Some(addr) = args.metrics_listen {
            crate::node::metrics::serve(addr, None)?;
        }
        let etcd = EtcdConfig {
            endpoints: args.etcd.clone(),
            cluster: args.cluster.clone(),
            lease_ttl: args.lease_ttl,
            ..EtcdConfig::default()
        };
        let discovery = EtcdDiscovery::connect(etcd.clone())
            .await
            .context("connecting to etcd")?;
        let holder = format!("kvmesh planner, pid {}", std::process::id());
        let metrics = metrics::PlannerMetrics::new();
        loop {
            tracing::info!(cluster = %args.cluster, "waiting to lead the cluster's planning");
            let leadership = tokio::select! {
                l = Leadership::acquire(etcd.clone(), DUTY, &holder) => l?,
                _ = crate::serve::shutdown_signal() => return Ok(()),
            };
            let leadership = Arc::new(leadership);
            tracing::info!(policy = ?config.policy, actuator = ?args.actuator, "leading");
            metrics.leader.set(1.0);
            let mut actuator: Box<dyn Actuator> = match args.actuator {
                ActuatorArg::Local => Box::new(local::LocalActuator::new(
                    std::env::current_exe().context("finding this binary")?,
                    args.etcd.clone(),
                    args.cluster.clone(),
                    args.node_args.clone(),
                    args.logs.clone(),
                )?),
                ActuatorArg::Compose => Box::new(compose::ComposeActuator::new(
                    &args.compose_command,
                    args.compose_file.clone().context("--compose-file")?,
                    args.compose_project.clone(),
                )?),
                ActuatorArg::Kubernetes => {
                    let (api, own) = kubernetes::KubeApi::in_cluster()?;
                    Box::new(kubernetes::KubernetesActuator::new(
                        api,
                        args.k8s_namespace
                            .clone()
                            .or(own)
                            .context("--k8s-namespace: the pod's namespace is not mounted")?,
                        [
                            args.k8s_prefill_deployment.clone(),
                            args.k8s_decode_deployment.clone(),
                        ],
                    ))
                }
                ActuatorArg::Etcd => Box::new(etcd::EtcdActuator::new(leadership.clone()).await?),
                ActuatorArg::None => Box::new(NoActuator),
            };
            let lost = leadership.lost();
            let led = tokio::select! {
                r = lead(args, &config, &discovery, &leadership, &mut *actuator, &metrics) => r,
                _ = lost.cancelled() => Ok(()),
                _ = crate::serve::shutdown_signal() => {
                    metrics.leader.set(0.0);
                    if let Ok(l) = Arc::try_unwrap(leadership) {
                        let _ = l.resign().await;
                    }
                    tracing::info!("stopped; the nodes stay as they are");
                    return Ok(());
                }
            };
            metrics.leader.set(0.0);
            led?;
            tracing::warn!("lost the planner lease; stopped acting");
        }
    })
}

/// Observes and decides until an error (the caller stops it when the lease is lost).
async fn lead(
    args: &PlannerArgs,
    config: &PlannerConfig,
    discovery: &EtcdDiscovery,
    leadership: &Leadership,
    actuator: &mut dyn Actuator,
    metrics: &metrics::PlannerMetrics,
) -> Result<()> {
    let mut planner = Planner::new(config.clone()).map_err(|e| anyhow::anyhow!("{e}"))?;
    let start = Instant::now();
    let mut last = scrape_all(&args.router).await;
    let mut observed_at = Instant::now();
    let mut observer = observe::Observer::default();
    let mut tick = tokio::time::interval(args.observe_every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let prefill = discovery.nodes(NodeRole::Prefill);
        let decode = discovery.nodes(NodeRole::Decode);
        let now_readings = scrape_all(&args.router).await;
        let mut window = RouterTotals::default();
        for (url, after) in &now_readings {
            if let Some((_, before)) = last.iter().find(|(u, _)| u == url) {
                window.add(&after.since(before));
            }
        }
        last = now_readings;
        let elapsed = observed_at.elapsed();
        observed_at = Instant::now();
        let mut obs = observer.observe(&prefill, &decode, &window, elapsed);
        let registered: Vec<_> = prefill.iter().chain(&decode).cloned().collect();
        let [p, d] = actuator.starting(&registered);
        obs.prefill_nodes += p;
        obs.decode_nodes += d;
        let now = start.elapsed();
        let Some(decision) = decide_round(&mut planner, now, obs, elapsed, metrics) else {
            continue;
        };
        let json = serde_json::to_string(&decision).expect("a decision serializes");
        leadership.put("decision", json).await?;
        act(&decision, &prefill, &decode, actuator, metrics).await;
    }
}

/// A driver's round after observing `obs` (covering the `elapsed` before `now`): the planner
/// absorbs it and, when a decision is due, makes one, exports and logs it (one readable line,
/// the JSON in a field). `kvmesh planner` and `kvmesh serve --autoscale` both run it.
pub fn decide_round(
    planner: &mut Planner,
    now: Duration,
    obs: Observation,
    elapsed: Duration,
    metrics: &metrics::PlannerMetrics,
) -> Option<Decision> {
    metrics.observed(&obs, elapsed);
    planner.observe(now, obs);
    if now < planner.next_decision_at() {
        return None;
    }
    let decision = planner.decide(now);
    metrics.decided(&decision);
    let json = serde_json::to_string(&decision).expect("a decision serializes");
    tracing::info!(decision = %json, "decided: {decision}");
    Some(decision)
}

/// Has `actuator` carry out `decision` (unless it changes nothing or is advisory) on the
/// nodes listed; a failure is counted and logged, and the next decision starts from what
/// the mesh then is.
pub async fn act(
    decision: &Decision,
    prefill: &[NodeEntry],
    decode: &[NodeEntry],
    actuator: &mut dyn Actuator,
    metrics: &metrics::PlannerMetrics,
) {
    if !decision.acted() {
        return;
    }
    let moves = moves(decision, prefill, decode);
    if let Err(e) = actuator.apply(decision, &moves).await {
        metrics.actuation_failures.increment(1);
        tracing::warn!(actuator = actuator.name(), "acting on a decision: {e:#}");
    }
}

/// Every router's totals now; a router that does not answer is left out (warned).
async fn scrape_all(routers: &[String]) -> Vec<(String, RouterTotals)> {
    let mut out = Vec::new();
    for url in routers {
        match scrape(url).await {
            Ok(page) => {
                let mut totals = RouterTotals::default();
                totals.add_page(&page);
                out.push((url.clone(), totals));
            }
            Err(e) => tracing::warn!(router = %url, "reading the router's metrics: {e:#}"),
        }
    }
    out
}

/// `GET {base}/metrics` over plain HTTP/1.1.
async fn scrape(base: &str) -> Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let host = base
        .strip_prefix("http://")
        .with_context(|| format!("{base:?}: expected http://host:port"))?
        .trim_end_matches('/');
    let read = async {
        let mut s = tokio::net::TcpStream::connect(host).await?;
        let request = format!("GET /metrics HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        s.write_all(request.as_bytes()).await?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await?;
        Ok::<_, std::io::Error>(buf)
    };
    let buf = tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .context("no answer within 5 s")??;
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .context("not an HTTP response")?;
    if !head.starts_with("HTTP/1.1 200") {
        bail!("{}", head.lines().next().unwrap_or_default());
    }
    Ok(body.to_string())
}
