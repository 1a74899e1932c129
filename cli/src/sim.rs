//! `kvmesh sim`: the mesh in virtual time. The nodes run the engine's real scheduler with a
//! timing model in place of the forward pass, the router's real policies pick them (see the
//! `kvmesh-sim` crate); the workload, load shapes, SLO, sweep and max-goodput search are `kvmesh
//! bench serve`'s, and so are the report, CSV and plots. Parsing and wiring only.

use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use humantime_serde::re::humantime;
use kvmesh_bench::arrivals::{Arrivals, LoadShape};
use kvmesh_bench::load::{csv, Run};
use kvmesh_bench::probe::Measured;
use kvmesh_bench::report::{self, BenchReport, MaxGoodput, TargetInfo};
use kvmesh_bench::search::{MaxGoodputSearch, Probe, SearchConfig};
use kvmesh_bench::slo::{Class, RequestOutcome};
use kvmesh_bench::workload::{Prompt, Workload, WorkloadOptions, WorkloadSpec};
use kvmesh_common::NodeId;
use kvmesh_prompt::chat_template::{ChatMessage, ChatTemplate};
use kvmesh_router::policy::{DisaggConfig, RoutingConfig};
use kvmesh_sim::autoscale::{load_planner_config, AutoscaleReport, ChangeKind, NodeChange};
use kvmesh_sim::cpu::SharedCpu;
use kvmesh_sim::fault::{Fault, FaultKind};
use kvmesh_sim::hardware::Hardware;
use kvmesh_sim::link::LinkClass;
use kvmesh_sim::mesh::SimPrompt;
use kvmesh_sim::mesh::{simulate, simulate_closed, MeshConfig, MeshRun, PrefillPool, SimRequest};
use kvmesh_sim::planner::Role;
use kvmesh_sim::timing::TimingProfile;
use kvmesh_sim::workload::{multiply, multiply_within, requests_sharing, take_prompts};

use crate::bench_serve::outputs;
use crate::measure_args::{ApiArg, MeasureArgs, Mode};

/// Synthetic prompts built for a point bounded by `--duration` alone.
const DURATION_ONLY_SYNTHETIC: usize = 100_000;

#[derive(Args, Debug)]
#[command(after_help = "Examples:
  kvmesh sim --decode-nodes 8 --workload mooncake --load trace --routing kv_aware
  kvmesh sim --decode-nodes 700 --prefill-nodes 300 --workload mooncake --load trace --copies 40
  kvmesh sim --profile target/profile/cpu.json --decode-nodes 2 --prefill-nodes 2 --workload mooncake --load trace --requests 60
  kvmesh sim --decode-nodes 16 --max-goodput --search-axis rate --search-max 512 --slo ttft=2s,itl=50ms
  kvmesh sim --decode-nodes 2 --prefill-nodes 1 --planner bench/sim/planner-slo.toml --workload synthetic:input=azure,output=azure --load day:2..20@1h

The report's fields: docs/bench-report.md; the simulator: docs/sim.md.")]
pub struct SimArgs {
    /// Decode nodes (each also prefills the prompts the router keeps local).
    #[arg(long, default_value_t = 4)]
    pub decode_nodes: usize,
    /// Prefill nodes (0: aggregated serving, every decode node prefills its own requests).
    #[arg(long, default_value_t = 0)]
    pub prefill_nodes: usize,
    /// A built-in node: h200-llama8b-fp8 (fitted to NVIDIA Dynamo's measurements of vLLM on
    /// an H200), or the rooflines h200-llama8b, h100-llama8b, h100x4-llama70b (Llama 3.1 in
    /// BF16); see docs/sim.md for where the numbers come from.
    #[arg(long, default_value = "h200-llama8b-fp8", conflicts_with = "profile")]
    pub hardware: String,
    /// This repository's CPU engine serving SmolLM2-135M instead, timed by a profile `kvmesh
    /// profile` measured.
    #[arg(long, value_name = "FILE")]
    pub profile: Option<PathBuf>,
    /// Tokens per KV block, the prefix cache's granularity [default: 16, as real nodes];
    /// larger blocks simulate faster (fewer blocks to hash, index and allocate).
    #[arg(long, value_name = "N")]
    pub block_size: Option<usize>,
    /// KV blocks per node [default: the node's: what a GPU's memory leaves after the
    /// weights; the CPU engine's default pool].
    #[arg(long, value_name = "N")]
    pub kv_blocks: Option<usize>,
    /// A step's token budget (`max_num_batched_tokens`) [default: the node's].
    #[arg(long, value_name = "N")]
    pub max_num_batched_tokens: Option<usize>,
    /// Most sequences running on a node at once [default: the node's].
    #[arg(long, value_name = "N")]
    pub max_num_seqs: Option<usize>,
    /// How the router picks decode nodes: kv_aware, round_robin, random, least_loaded,
    /// power_of_two.
    #[arg(long, default_value = "kv_aware", value_parser = RoutingConfig::from_str)]
    pub routing: RoutingConfig,
    /// Prompts with at most this many tokens not cached on their decode node prefill there,
    /// not on a prefill node [default: the router's].
    #[arg(long, value_name = "N")]
    pub local_prefill_max_tokens: Option<usize>,
    /// What carries KV from prefill to decode nodes: same_host, rdma25, rdma50, rdma100,
    /// rdma400 or tcp (QUIC over a 25 Gb/s NIC).
    #[arg(long, default_value = "rdma100", value_parser = LinkClass::from_str)]
    pub link: LinkClass,
    /// Nodes report their load every D, so the router routes on stale load as in a real
    /// mesh [default: a node's load is fresh at every step].
    #[arg(long, value_name = "D", value_parser = humantime::parse_duration)]
    pub report_interval: Option<Duration>,
    /// Nodes share hosts of this many cores, as processes on one machine do: while more
    /// nodes compute than the cores hold, each runs that much slower [default: every node
    /// has cores of its own].
    #[arg(long, value_name = "CORES")]
    pub host_cores: Option<f64>,
    /// Nodes on each host with --host-cores, by id (decode nodes first) [default: all on
    /// one].
    #[arg(long, value_name = "N", requires = "host_cores")]
    pub nodes_per_host: Option<usize>,
    /// Compute threads of each node with --host-cores (those its timing was measured with).
    #[arg(long, value_name = "N", default_value_t = 1.0, requires = "host_cores")]
    pub node_threads: f64,
    /// The endpoint the workload is written for: chat workloads (JSONL or ShareGPT
    /// conversations) need `chat`. Text prompts and conversations are tokenized with
    /// --tokenizer's tokenizer and chat template.
    #[arg(long, value_enum, default_value_t = ApiArg::Completions)]
    pub api: ApiArg,
    /// The model whose tokenizer (and chat template) turns text prompts into tokens (.gguf
    /// or an HF checkpoint directory) [default: the cached SmolLM2, fetched when missing].
    #[arg(long, value_name = "MODEL")]
    pub tokenizer: Option<PathBuf>,
    /// Run the workload this many times over, as that many independent user populations:
    /// each copy's prompts share prefixes only with each other, and its conversations start
    /// spread over the workload's span (to load a large cluster from one trace).
    #[arg(long, default_value_t = NonZeroUsize::MIN)]
    pub copies: NonZeroUsize,
    /// With --copies: copy k starts k/K of D after the workload (no wrapping) instead of
    /// spread round its whole span, so the load keeps its shape over time (its rate's and
    /// its lengths' mix) on scales longer than D, at K times the rate.
    #[arg(long, value_name = "D", value_parser = humantime::parse_duration, requires = "copies")]
    pub copies_within: Option<Duration>,
    /// A fault in virtual time (repeatable): `die:N@T` (node N stops at T; decode nodes are
    /// 0.., prefill nodes follow), `slow:F@T` (every KV link F times slower from T),
    /// `slow:F:P-D@T` (only the link from prefill node P to decode node D).
    #[arg(long = "fault", value_name = "FAULT", value_parser = parse_fault)]
    pub faults: Vec<Fault>,
    /// Run the planner in the mesh: a PlannerConfig in TOML (its fields at the top level or
    /// in a [planner] table). It adds, drains and switches nodes every interval; the report
    /// gains each point's `planner` (node-hours per role, the node counts over time,
    /// decisions by reason).
    #[arg(long, value_name = "FILE")]
    pub planner: Option<PathBuf>,
    /// A change to the node set in virtual time (repeatable): `add:prefill@T`,
    /// `add:decode@T`, `drain:N@T` (node N stops taking requests at T and goes once they
    /// end), `switch:N@T` (node N drains, then serves in the other role).
    #[arg(long = "change", value_name = "CHANGE", value_parser = parse_change)]
    pub changes: Vec<NodeChange>,
    /// How long a node takes from its request to serving (loading weights), with --planner
    /// or --change.
    #[arg(long, value_name = "D", value_parser = humantime::parse_duration, default_value = "30s")]
    pub startup_delay: Duration,
    /// How long a drained node takes to serve in its other role (weights kept), with
    /// --planner or --change.
    #[arg(long, value_name = "D", value_parser = humantime::parse_duration, default_value = "5s")]
    pub switch_delay: Duration,
    #[command(flatten)]
    pub measure: MeasureArgs,
}

impl SimArgs {
    fn hardware(&self) -> Result<Hardware> {
        match &self.profile {
            Some(path) => Ok(Hardware::profiled(TimingProfile::load(path)?)),
            None => Ok(Hardware::named(&self.hardware)?),
        }
    }

    fn hardware_name(&self) -> String {
        match &self.profile {
            Some(path) => path.display().to_string(),
            None => self.hardware.clone(),
        }
    }

    fn mesh_config(&self, hardware: &Hardware) -> Result<MeshConfig> {
        if self.decode_nodes == 0 {
            bail!("--decode-nodes must be at least 1");
        }
        let mut engine = hardware.engine.clone();
        if let Some(size) = self.block_size {
            // The same KV memory in blocks of the size asked for.
            let tokens = engine.num_blocks * engine.block_size;
            engine.num_blocks = tokens / size.max(1);
            engine.block_size = size;
        }
        engine.num_blocks = self.kv_blocks.unwrap_or(engine.num_blocks);
        engine.max_num_batched_tokens = self
            .max_num_batched_tokens
            .unwrap_or(engine.max_num_batched_tokens);
        engine.max_num_seqs = self.max_num_seqs.unwrap_or(engine.max_num_seqs);
        let node = hardware.node(&engine);
        node.scheduler
            .validate()
            .context("the node's engine limits")?;
        let mut disaggregation = DisaggConfig::default();
        if let Some(n) = self.local_prefill_max_tokens {
            disaggregation.local_prefill_max_tokens = n;
        }
        disaggregation.validate()?;
        // Nodes that come and go need the prefill nodes' kind even when none starts.
        let dynamic = self.planner.is_some() || !self.changes.is_empty();
        let prefill = (self.prefill_nodes > 0 || dynamic).then(|| PrefillPool {
            nodes: self.prefill_nodes,
            node: node.clone(),
            disaggregation,
            link: self.link,
            kv_bytes_per_token: hardware.model.kv_bytes_per_token,
        });
        if prefill.is_none() && self.local_prefill_max_tokens.is_some() {
            bail!("--local-prefill-max-tokens needs --prefill-nodes");
        }
        let planner = match &self.planner {
            Some(path) => Some(load_planner_config(path)?),
            None => None,
        };
        Ok(MeshConfig {
            prefill,
            report_interval: self.report_interval,
            seed: self.measure.seed,
            faults: self.faults.clone(),
            cpu: self.host_cores.map(|cores| SharedCpu {
                cores,
                threads_per_node: self.node_threads,
                nodes_per_host: self.nodes_per_host.unwrap_or(usize::MAX),
            }),
            changes: self.changes.clone(),
            planner,
            startup: self.startup_delay,
            switch_delay: self.switch_delay,
            // A simulated hour delivers hundreds of millions of tokens: the report reads the
            // pooled gaps from the run's histogram, the CSV counts them (`requests_csv`).
            every_gap: false,
            ..MeshConfig::new(self.decode_nodes, node, self.routing.clone())
        })
    }

    /// The report's target: the simulated mesh, as a URL-like name.
    fn target(&self, hardware: &Hardware) -> TargetInfo {
        TargetInfo {
            url: format!(
                "sim://{}?decode={}&prefill={}&routing={}&link={}&copies={}",
                self.hardware_name(),
                self.decode_nodes,
                self.prefill_nodes,
                self.routing,
                self.link,
                self.copies
            ),
            api: match self.api {
                ApiArg::Completions => "completions",
                ApiArg::Chat => "chat",
            }
            .into(),
            model: Some(hardware.model.name.into()),
        }
    }
}

/// Turns the workload's text prompts and conversations into tokens with `model`'s tokenizer
/// and chat template, as the router would (the simulator prices tokens, not text). Loads no
/// tokenizer when every prompt is tokens already.
fn tokenize(workload: &mut Workload, model: Option<&Path>) -> Result<()> {
    if workload
        .items
        .iter()
        .all(|i| matches!(i.prompt, Prompt::Tokens(_)))
    {
        return Ok(());
    }
    let path = crate::model_args::ensure_model(model)?;
    let text = crate::model_args::read_text(&path)?;
    let tokenizer = &text.tokenizer;
    let template = ChatTemplate::from_tokenizer(tokenizer);
    for (i, item) in workload.items.iter_mut().enumerate() {
        let ids = match &item.prompt {
            Prompt::Tokens(_) => continue,
            Prompt::Text(t) => tokenizer.encode(t, false),
            Prompt::Messages(messages) => {
                let template = template.as_ref().map_err(|e| {
                    anyhow::anyhow!("{} has no usable chat template: {e}", path.display())
                })?;
                let messages: Vec<ChatMessage> = messages
                    .iter()
                    .map(|m| ChatMessage::new(&m.role, &m.content))
                    .collect();
                let rendered = template
                    .render(&messages, true)
                    .with_context(|| format!("rendering request {i}'s conversation"))?;
                tokenizer.encode(&rendered, true)
            }
        }
        .with_context(|| format!("tokenizing request {i}"))?;
        if ids.is_empty() {
            bail!("request {i}'s prompt has no tokens");
        }
        item.prompt = Prompt::Tokens(ids);
    }
    Ok(())
}

/// `--fault`'s grammar (see [`SimArgs::faults`]).
fn parse_fault(s: &str) -> Result<Fault, String> {
    let bad = |why: &str| format!("bad fault `{s}`: {why} (die:N@T, slow:F@T or slow:F:P-D@T)");
    let (what, at) = timed_spec(s, &bad)?;
    let node = |n: &str| node_number(n, &bad);
    let kind = match what[..] {
        ["die", n] => FaultKind::NodeDies(node(n)?),
        ["slow", factor, ref between @ ..] if between.len() <= 1 => {
            let factor: f64 = factor
                .trim_end_matches('x')
                .parse()
                .map_err(|_| bad("the slow-down is a number"))?;
            if !(factor.is_finite() && factor > 0.0) {
                return Err(bad("the slow-down must be positive"));
            }
            let between = match between.first() {
                None => None,
                Some(pair) => {
                    let (p, d) = pair.split_once('-').ok_or_else(|| bad("a link is P-D"))?;
                    Some((node(p)?, node(d)?))
                }
            };
            FaultKind::LinkSlows { factor, between }
        }
        _ => return Err(bad("unknown kind")),
    };
    Ok(Fault { at, kind })
}

/// `--change`'s grammar (see [`SimArgs::changes`]).
fn parse_change(s: &str) -> Result<NodeChange, String> {
    let bad = |why: &str| {
        format!("bad change `{s}`: {why} (add:prefill@T, add:decode@T, drain:N@T or switch:N@T)")
    };
    let (what, at) = timed_spec(s, &bad)?;
    let node = |n: &str| node_number(n, &bad);
    let kind = match what[..] {
        ["add", "prefill"] => ChangeKind::Add(Role::Prefill),
        ["add", "decode"] => ChangeKind::Add(Role::Decode),
        ["add", _] => return Err(bad("a role is prefill or decode")),
        ["drain", n] => ChangeKind::Drain(node(n)?),
        ["switch", n] => ChangeKind::Switch(node(n)?),
        _ => return Err(bad("unknown kind")),
    };
    Ok(NodeChange { at, kind })
}

/// `WHAT@TIME`, the shape of `--fault` and `--change`: WHAT's `:`-separated parts and TIME.
fn timed_spec<'a>(
    s: &'a str,
    bad: &impl Fn(&str) -> String,
) -> Result<(Vec<&'a str>, Duration), String> {
    let (what, at) = s.rsplit_once('@').ok_or_else(|| bad("no @TIME"))?;
    let at = humantime::parse_duration(at).map_err(|e| bad(&e.to_string()))?;
    Ok((what.split(':').collect(), at))
}

/// A node named by its number in `--fault` and `--change`.
fn node_number(n: &str, bad: &impl Fn(&str) -> String) -> Result<NodeId, String> {
    n.parse::<u64>()
        .map(NodeId)
        .map_err(|_| bad("a node is a number"))
}

/// What every point of a simulation shares.
struct Simulation<'a> {
    args: &'a SimArgs,
    config: MeshConfig,
    /// The workload, its token prompts moved into `prompts`.
    workload: Workload,
    /// Each item's prompt, shared by every point's requests.
    prompts: Vec<SimPrompt>,
    /// Wall time spent simulating and virtual time simulated, over every point.
    wall: Duration,
    simulated: Duration,
    /// Events handled and engine steps simulated, over every point.
    events: u64,
    steps: u64,
    /// Per point, what the planner (or the changes) did to the node set.
    planned: Vec<Option<AutoscaleReport>>,
}

impl Simulation<'_> {
    /// The requests of a point at `shape`, `length` times the configured length: the
    /// workload's first items, multiplied, cut at the point's duration.
    fn requests(&self, shape: &LoadShape, length: u32) -> Result<Vec<SimRequest>> {
        let m = &self.args.measure;
        let copies = self.args.copies.get();
        let wanted = m.requests().map(|n| n.saturating_mul(length as usize));
        let all = &self.workload.items;
        let items = wanted.map_or(all.len(), |n| n.div_ceil(copies).min(all.len()));
        let timed = requests_sharing(&all[..items], &self.prompts[..items], shape, m.seed)?;
        let mut reqs = match self.args.copies_within {
            Some(window) => multiply_within(&timed, self.args.copies, window),
            None => multiply(&timed, self.args.copies),
        };
        if let Some(n) = wanted {
            reqs.truncate(n);
        }
        if let Some(d) = m.duration {
            if matches!(shape, LoadShape::Concurrency(_)) {
                bail!("a closed loop (concurrency:N) in the simulator is as long as --requests");
            }
            let end = d * length;
            reqs.retain(|r| r.at < end);
        }
        if reqs.is_empty() {
            bail!("no request of the workload falls in the point");
        }
        Ok(reqs)
    }

    fn point(&mut self, index: usize, shape: &LoadShape, length: u32) -> Result<Measured> {
        let reqs = self.requests(shape, length)?;
        let label = match length {
            1 => shape.to_string(),
            _ => format!("{shape} retry"),
        };
        eprintln!(
            "point {}: {label}: {} requests on {} nodes",
            index + 1,
            reqs.len(),
            self.config.nodes + self.config.prefill.as_ref().map_or(0, |p| p.nodes)
        );
        let started = Instant::now();
        let run = match shape {
            LoadShape::Concurrency(n) => simulate_closed(&self.config, &reqs, *n),
            _ => simulate(&self.config, &reqs),
        }?;
        self.wall += started.elapsed();
        self.simulated += run.duration;
        self.events += run.events;
        self.steps += run.stats.nodes.iter().map(|n| n.steps).sum::<u64>();
        let point = run.point(&label, shape, &self.args.measure.slo);
        self.planned.push(run.autoscale.clone());
        Ok(Measured {
            point,
            run: as_run(run),
        })
    }
}

/// The report's JSON with each point's `planner` (bench's report ignores fields it does not
/// know, so `bench compare` reads it as before).
fn with_planner(report: &BenchReport, planned: &[Option<AutoscaleReport>]) -> Result<String> {
    let mut value = serde_json::to_value(report)?;
    if let Some(points) = value["points"].as_array_mut() {
        for (point, planned) in points.iter_mut().zip(planned) {
            if let Some(p) = planned {
                point["planner"] = serde_json::to_value(p)?;
            }
        }
    }
    Ok(serde_json::to_string_pretty(&value)?)
}

/// The node counts over time, one row per change, per point.
fn planner_csv(report: &BenchReport, planned: &[Option<AutoscaleReport>]) -> String {
    let mut out =
        String::from("point,at_s,prefill_serving,decode_serving,prefill_billed,decode_billed\n");
    for (point, p) in report.points.iter().zip(planned) {
        for c in p.iter().flat_map(|p| &p.timeline) {
            out.push_str(&format!(
                "{},{:.3},{},{},{},{}\n",
                point.label,
                c.at_s,
                c.prefill_serving,
                c.decode_serving,
                c.prefill_billed,
                c.decode_billed
            ));
        }
    }
    out
}

/// Node-hours and decisions per point, for the terminal.
fn planner_table(report: &BenchReport, planned: &[Option<AutoscaleReport>]) -> String {
    let mut out = String::new();
    for (point, p) in report.points.iter().zip(planned) {
        let Some(p) = p else { continue };
        let peak = |f: fn(&kvmesh_sim::autoscale::CountsAt) -> u32| {
            p.timeline.iter().map(f).max().unwrap_or(0)
        };
        out.push_str(&format!(
            "\nnode set ({}): node-hours prefill {:.2}, decode {:.2}, total {:.2}; most serving: {} prefill, {} decode\n",
            point.label,
            p.node_hours.prefill,
            p.node_hours.decode,
            p.node_hours_total,
            peak(|c| c.prefill_serving),
            peak(|c| c.decode_serving),
        ));
        out.push_str(&format!(
            "  {} nodes requested, {} cancelled, {} drained, {} switched\n",
            p.nodes_requested, p.nodes_cancelled, p.nodes_drained, p.role_switches
        ));
        if let Some(policy) = &p.policy {
            out.push_str(&format!(
                "  planner {policy}{}: {} decisions, {} acted on\n",
                if p.advisory { " (advisory)" } else { "" },
                p.decisions,
                p.decisions_acted
            ));
            for (role, reasons) in &p.reasons {
                let list: Vec<String> = reasons.iter().map(|(k, n)| format!("{k} {n}")).collect();
                out.push_str(&format!("  {role}: {}\n", list.join(", ")));
            }
        }
    }
    out
}

/// Every request of every point, as `kvmesh bench serve` writes them, but for the gaps
/// column: a simulated outcome keeps only its longest gap (`MeshConfig::every_gap`), and a
/// completed request has one gap fewer than tokens.
fn requests_csv(measured: &[Measured], outcomes: &[Vec<RequestOutcome>]) -> String {
    let mut out = csv::header("point");
    out.push('\n');
    for (m, outcomes) in measured.iter().zip(outcomes) {
        for o in outcomes {
            let gaps = match o.class() {
                Class::Ok => o.output_tokens.saturating_sub(1) as usize,
                _ => o.gaps.len(),
            };
            csv::push_row(&mut out, &m.point.label, o, gaps);
            out.push('\n');
        }
    }
    out
}

/// A simulated run in the load generator's terms (for the per-request CSV and the notes).
fn as_run(run: MeshRun) -> Run {
    Run {
        outcomes: run.outcomes,
        duration: run.duration,
        max_lateness: Duration::ZERO,
        waited: 0,
        held: 0,
        error_examples: run.error_examples,
        stopped: false,
    }
}

/// GuideLLM's max-goodput search (see `kvmesh_bench::search`) over simulated probes, open-loop
/// ones Poisson when it searches a rate.
fn max_goodput(
    sim: &mut Simulation<'_>,
    config: SearchConfig,
) -> Result<(Vec<Measured>, MaxGoodputSearch)> {
    let criteria = config.criteria;
    let axis = config.axis;
    let mut search = MaxGoodputSearch::new(config)?;
    let mut points: Vec<Measured> = Vec::new();
    while let Some(request) = search.next_probe() {
        let Some(shape) = axis.shape(request.load, Arrivals::Poisson) else {
            bail!(
                "the search asked for a load that is no shape: {}",
                request.load
            );
        };
        let measured = sim.point(points.len(), &shape, request.length)?;
        let probe = Probe::judged(request, &measured.point.slo, &criteria, None);
        points.push(measured);
        search.record(probe)?;
    }
    Ok((points, search))
}

pub fn run(args: &SimArgs) -> Result<()> {
    crate::allocator::keep_freed_pages();
    let m = &args.measure;
    let hardware = args.hardware()?;
    let config = args.mesh_config(&hardware)?;
    let requests = m.requests();
    if requests == Some(0) {
        bail!("--requests must be at least 1");
    }
    let mode = m.mode();
    // Every point is a fresh mesh, so points reuse the workload's first requests; a search's
    // retry runs twice as long.
    let longest = match &mode {
        Mode::MaxGoodput(_) => 2,
        Mode::Points(_) => 1,
    };
    let size = match (&m.workload, requests) {
        (_, Some(n)) => n.saturating_mul(longest).div_ceil(args.copies.get()),
        (WorkloadSpec::Synthetic(_), None) => DURATION_ONLY_SYNTHETIC,
        (_, None) => usize::MAX,
    };
    let mut workload = m
        .workload
        .load(&WorkloadOptions {
            seed: m.seed,
            max_tokens: m.max_tokens,
            ..WorkloadOptions::new(args.api.api(), size)
        })
        .context("building the workload")?;
    tokenize(&mut workload, args.tokenizer.as_deref())?;
    // Their tokens live in `prompts` now: one copy of each, however many points use them.
    let prompts = take_prompts(&mut workload.items)?;
    let mut report = BenchReport::new(
        args.target(&hardware),
        workload.name.clone(),
        m.seed,
        &m.slo,
    );
    let mut sim = Simulation {
        args,
        config,
        workload,
        prompts,
        wall: Duration::ZERO,
        simulated: Duration::ZERO,
        events: 0,
        steps: 0,
        planned: Vec::new(),
    };
    let mut found = None;
    let measured = match mode {
        Mode::Points(shapes) => shapes
            .iter()
            .enumerate()
            .map(|(i, shape)| sim.point(i, shape, 1))
            .collect::<Result<Vec<_>>>()?,
        Mode::MaxGoodput(config) => {
            let (points, search) = max_goodput(&mut sim, config)?;
            let judge = search.config().criteria.judge;
            report.max_goodput = search
                .answer()
                .map(|i| MaxGoodput::of(&points[i].point, judge));
            found = Some(search.result());
            points
        }
    };
    report.points = measured.iter().map(|m| m.point.clone()).collect();

    let out = outputs::out_dir(m.out.as_deref(), "sim");
    let mut measured = measured;
    let outcomes: Vec<Vec<RequestOutcome>> = measured
        .iter_mut()
        .map(|m| std::mem::take(&mut m.run.outcomes))
        .collect();
    let mut written = outputs::write(&out, &report, &measured, &m.plots.0)?;
    let csv_path = out.join("requests.csv");
    std::fs::write(&csv_path, requests_csv(&measured, &outcomes))
        .with_context(|| format!("writing {}", csv_path.display()))?;
    let json = match sim.planned.iter().any(Option::is_some) {
        true => {
            let json = with_planner(&report, &sim.planned)?;
            let path = out.join("report.json");
            std::fs::write(&path, json.clone() + "\n")
                .with_context(|| format!("writing {}", path.display()))?;
            let csv = out.join("planner.csv");
            std::fs::write(&csv, planner_csv(&report, &sim.planned))
                .with_context(|| format!("writing {}", csv.display()))?;
            written.push(csv.display().to_string());
            json
        }
        false => report.to_json(),
    };
    if m.json {
        println!("{json}");
    } else {
        print!("{}", report::render_table(&report));
        print!("{}", planner_table(&report, &sim.planned));
    }
    if let Some(found) = found {
        eprintln!("{}", outputs::search_note(found));
    }
    let wall = sim.wall.as_secs_f64().max(1e-9);
    eprintln!(
        "simulated {:.1} s in {:.2} s of wall time ({:.0}x real time; {} events, {:.0} a second; \
         {} engine steps, {:.0} a second)",
        sim.simulated.as_secs_f64(),
        sim.wall.as_secs_f64(),
        sim.simulated.as_secs_f64() / wall,
        sim.events,
        sim.events as f64 / wall,
        sim.steps,
        sim.steps as f64 / wall,
    );
    eprintln!("wrote {}", written.join(", "));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_parse() {
        assert_eq!(
            parse_fault("die:3@90s").unwrap(),
            Fault {
                at: Duration::from_secs(90),
                kind: FaultKind::NodeDies(NodeId(3)),
            }
        );
        assert_eq!(
            parse_fault("slow:4x@2m").unwrap(),
            Fault {
                at: Duration::from_secs(120),
                kind: FaultKind::LinkSlows {
                    factor: 4.0,
                    between: None,
                },
            }
        );
        assert_eq!(
            parse_fault("slow:2.5:5-1@1s").unwrap().kind,
            FaultKind::LinkSlows {
                factor: 2.5,
                between: Some((NodeId(5), NodeId(1))),
            }
        );
        for bad in [
            "die:3",
            "die:x@1s",
            "die:3@soon",
            "slow:0@1s",
            "slow:-2@1s",
            "slow:2:5@1s",
            "slow:2:5-1:6-2@1s",
            "melt:3@1s",
        ] {
            let err = parse_fault(bad).unwrap_err();
            assert!(err.contains(bad), "{bad}: {err}");
        }
    }

    #[test]
    fn the_delays_default_to_the_simulators() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            sim: SimArgs,
        }
        let cli = Cli::parse_from(["kvmesh"]);
        assert_eq!(
            cli.sim.startup_delay,
            kvmesh_sim::autoscale::DEFAULT_STARTUP
        );
        assert_eq!(
            cli.sim.switch_delay,
            kvmesh_sim::autoscale::DEFAULT_SWITCH_DELAY
        );
    }

    #[test]
    fn changes_parse() {
        assert_eq!(
            parse_change("add:prefill@30s").unwrap(),
            NodeChange {
                at: Duration::from_secs(30),
                kind: ChangeKind::Add(Role::Prefill),
            }
        );
        assert_eq!(
            parse_change("switch:2@1m").unwrap().kind,
            ChangeKind::Switch(NodeId(2))
        );
        assert_eq!(
            parse_change("drain:0@5s").unwrap().kind,
            ChangeKind::Drain(NodeId(0))
        );
        for bad in ["add:gpu@1s", "drain:x@1s", "drain:1", "grow:1@1s"] {
            let err = parse_change(bad).unwrap_err();
            assert!(err.contains(bad), "{bad}: {err}");
        }
    }
}
