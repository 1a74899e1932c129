//! The whole mesh in virtual time: requests arrive, the router's real [`Routing`] picks a
//! node from the nodes' load and the prefix index, the node's real scheduler runs them, and
//! every request ends as a [`RequestOutcome`], bench's own type, so a simulated run reports
//! as a real one does ([`MeshRun::point`], with the mesh's own [`MeshStats`]).
//!
//! Nodes are decode nodes (which prefill locally when the router says so) and, optionally,
//! prefill nodes. A request the disaggregation rule sends to a prefill node is queued on its
//! decode node as a remote prefill; when the decode node admits it (reserving the blocks the
//! KV will fill) the prefill node computes the prompt, then the KV the decode node lacks
//! crosses the [`Link`] between them (FIFO per ordered node pair), and the decode node
//! completes the prefill with the prefill node's first token and decodes. The prefix
//! index is the router's [`InMemoryPrefixIndex`], fed with each node's KV events after every
//! step, as the nodes' publishers feed it in the real mesh. Load reports are refreshed at every
//! step boundary and submission, so they are fresher than the real mesh's periodic reports;
//! the router's own in-flight counts (its [`Tracked`] guards) are kept exactly as in the
//! router. With `report_interval` set, load reports arrive periodically instead, so the
//! router sees stale load as it does in the real mesh. The first token reaches the client
//! when the decode node has the KV (it streams the response), so TTFT includes the transfer.
//!
//! A decode node runs its quiet decode steps as one event ([`crate::node`]); the mesh catches
//! such a run up whenever something touches the node (`mesh/quiet.rs`), so a run is the one
//! stepping one by one gives ([`MeshConfig::quiet_runs`]).
//!
//! # Faults
//!
//! [`MeshConfig::faults`] kill nodes and slow links at instants of virtual time
//! ([`crate::fault`]). A dead node leaves the routing candidates and the prefix index, and
//! its requests go where the real mesh sends them:
//!
//! - a request on a dead decode node *migrates* as the router's `MeshBackend` migrates a
//!   broken stream: its prompt and the tokens delivered so far are sent to another decode
//!   node (none it ran on before), routed by everything its KV will hold, which recomputes
//!   them and goes on after them; a request that had delivered nothing may be prefilled
//!   remotely again. Its tokens keep their times, so its TTFT stands and the move shows as
//!   one long gap. After `max_migrations` moves, or with no decode node left, it fails
//!   (`stream_error`, the stream having started). Its prefill on a prefill node, if one was
//!   running, is cancelled.
//! - a request whose remote prefill was on a dead prefill node (computing, or its KV in
//!   flight) falls back to a local prefill on its decode node, as the decode worker does
//!   with `fail_remote_prefill` when a prefill worker fails.
//!
//! Simplifications, not built yet: the KV moves after the whole prefill (the real prefill
//! worker pushes blocks after each step, overlapping the two), transfers fail only when a
//! node dies, no pull of cached prefixes from another node.

use crate::autoscale::{self, AutoscaleReport, ChangeError, NodeChange};
use crate::cpu::{CpuError, Hosts, SharedCpu};
use crate::events::EventQueue;
use crate::fault::{self, Fault, FaultError, FaultKind, LinkFactors};
use crate::gaps::{GapHistogram, TokenTimes};
use crate::link::{Link, LinkClass};
use crate::node::{Finished, NodeConfig, NodeError, SimNode, Started};
use crate::stats::{mesh_stats, NodeTotals};
use kvmesh_bench::arrivals::LoadShape;
use kvmesh_bench::report::{MeshStats, Point};
use kvmesh_bench::slo::{RequestOutcome, SloSpec};
use kvmesh_bench::trace::ScaledRequest;
use kvmesh_bench::workload::{Prompt, WorkItem};
use kvmesh_common::fast_hash::U64Map;
use kvmesh_common::kv_tier::TieredKvEvent;
use kvmesh_common::{BlockHasher, NodeId, NodeInfo, NodeRole, PromptHashes, TokenId};
use kvmesh_engine::mock_runner::MockRunner;
use kvmesh_kvstore::{InMemoryPrefixIndex, NodeEntry};
use kvmesh_planner::PlannerConfig;
use kvmesh_router::policy::{DisaggConfig, KvAwareConfig, RoutingConfig};
use kvmesh_router::routing::{Routing, Tracked};
use kvmesh_router::MeshBackendConfig;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

mod lifecycle;
mod prompt;
mod quiet;
mod scaler;

pub use prompt::SimPrompt;

use lifecycle::{Life, NodeTimes};
use scaler::Scaler;

/// One request offered to the mesh.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimRequest {
    /// Arrival, from the run's start.
    pub at: Duration,
    pub prompt: SimPrompt,
    pub max_tokens: usize,
    /// The previous turn of its conversation (an earlier request): this one is not sent
    /// before that one has ended, as bench does not send it.
    pub after: Option<usize>,
}

impl SimRequest {
    /// A request of a scaled Mooncake trace (its prompt is already token ids).
    pub fn from_scaled(r: &ScaledRequest) -> SimRequest {
        SimRequest {
            at: r.at,
            prompt: SimPrompt::from(&r.prompt_tokens[..]),
            max_tokens: r.max_tokens as usize,
            after: r.previous_turn,
        }
    }

    /// A workload item sent at `at`. Only token-id prompts: text would need the model's
    /// tokenizer, which the simulator does not load.
    pub fn from_work_item(item: &WorkItem, at: Duration) -> Result<SimRequest, MeshError> {
        match &item.prompt {
            Prompt::Tokens(ids) => Ok(SimRequest {
                at,
                prompt: SimPrompt::from(&ids[..]),
                max_tokens: item.max_tokens as usize,
                after: item.previous_turn,
            }),
            _ => Err(MeshError::TextPrompt),
        }
    }
}

#[derive(Clone, Debug)]
pub struct MeshConfig {
    /// Decode nodes (each prefills what the router keeps local).
    pub nodes: usize,
    pub node: NodeConfig,
    pub routing: RoutingConfig,
    /// Prefill nodes and how KV reaches the decode nodes; `None`: aggregated serving.
    pub prefill: Option<PrefillPool>,
    /// How often nodes report their load to the router (all at once, every interval);
    /// `None`: a node's report is refreshed at every step boundary and submission.
    pub report_interval: Option<Duration>,
    /// Seeds every random choice (the policies' generators where the config names none).
    pub seed: u64,
    /// What goes wrong, and when (any order).
    pub faults: Vec<Fault>,
    /// How many times one request may move to another decode node after its node died (the
    /// router's `MeshBackendConfig::max_migrations`).
    pub max_migrations: usize,
    /// Nodes that share their host's cores; `None`: every node has its own.
    pub cpu: Option<SharedCpu>,
    /// Nodes added, drained or switched to the other role at instants of virtual time (any
    /// order), as an operator changes a mesh.
    pub changes: Vec<NodeChange>,
    /// The planner adds, drains and switches nodes every interval ([`crate::autoscale`]);
    /// `None`: only `changes` do.
    pub planner: Option<PlannerConfig>,
    /// From a node's request to its first request served (loading weights, registering).
    pub startup: Duration,
    /// From a drained node's flip to serving in its other role (weights kept).
    pub switch_delay: Duration,
    /// Each outcome carries every gap between its tokens (bench's `RequestOutcome::gaps`);
    /// `false`: only its longest, all the ITL objective judges per request, so a long run
    /// keeps no list of every token. The report's pooled ITL comes from the run's own
    /// histogram either way ([`MeshRun::itl`]).
    pub every_gap: bool,
    /// Decode nodes plan runs of quiet decode steps at once ([`crate::node`]): the same
    /// run, many times faster. Off with [`MeshConfig::cpu`], where other nodes' steps move
    /// a step's end.
    pub quiet_runs: bool,
    /// How long an idle node woken by a request waits for others before its first step, as
    /// a real worker's engine thread does ([`kvmesh_worker::GATHER_WINDOW`], the default);
    /// zero: it steps at once.
    pub gather_window: Duration,
}

impl MeshConfig {
    /// `nodes` decode nodes of `node`, routed by `routing`: no prefill nodes, load reports
    /// fresh at every step, seed 0, no faults, the router's default migration bound.
    pub fn new(nodes: usize, node: NodeConfig, routing: RoutingConfig) -> MeshConfig {
        MeshConfig {
            nodes,
            node,
            routing,
            prefill: None,
            report_interval: None,
            seed: 0,
            faults: Vec::new(),
            max_migrations: MeshBackendConfig::default().max_migrations,
            cpu: None,
            changes: Vec::new(),
            planner: None,
            startup: autoscale::DEFAULT_STARTUP,
            switch_delay: autoscale::DEFAULT_SWITCH_DELAY,
            every_gap: true,
            quiet_runs: true,
            gather_window: kvmesh_worker::GATHER_WINDOW,
        }
    }
}

/// Prefill nodes, with the link that carries their KV to decode nodes.
#[derive(Clone, Debug)]
pub struct PrefillPool {
    pub nodes: usize,
    pub node: NodeConfig,
    pub disaggregation: DisaggConfig,
    /// Between every prefill node and every decode node.
    pub link: LinkClass,
    /// K and V bytes of one token over all layers (what a block of the model holds, divided
    /// by the block size).
    pub kv_bytes_per_token: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    #[error("the mesh needs at least one node")]
    NoNodes,
    #[error("text prompts need a tokenizer; give the simulator token-id prompts")]
    TextPrompt,
    #[error("request {0} follows a request that is not before it")]
    BadPreviousTurn(usize),
    #[error("requests must come in arrival order (request {0} is earlier than the one before)")]
    Unordered(usize),
    #[error("report_interval must be positive")]
    ZeroReportInterval,
    #[error("prefill and decode nodes must share the KV block size and model")]
    MismatchedPools,
    #[error("adding nodes needs a prefill pool (its node kind and link), even of 0 nodes")]
    NoPrefillPool,
    #[error("nodes cannot come and go while they share hosts' cores")]
    ChangesWithSharedCpu,
    #[error(transparent)]
    Change(#[from] ChangeError),
    #[error("the planner's config: {0}")]
    Planner(#[from] kvmesh_planner::ConfigError),
    #[error(transparent)]
    Fault(#[from] FaultError),
    #[error(transparent)]
    Cpu(#[from] CpuError),
    #[error(transparent)]
    Node(#[from] NodeError),
}

/// What a run produced.
#[derive(Debug)]
pub struct MeshRun {
    /// One per request, in request order.
    pub outcomes: Vec<RequestOutcome>,
    /// From the start to the last request's end.
    pub duration: Duration,
    /// The mesh over the run, as bench's report carries it.
    pub stats: MeshStats,
    /// KV blocks each node still holds at the end, by node id; `None` for a dead node. Every
    /// surviving node's is 0 unless a request was stranded: nothing leaked.
    pub blocks_in_use: Vec<Option<usize>>,
    /// The first message of each error kind in `outcomes` (as bench's `Run` carries them).
    pub error_examples: BTreeMap<String, String>,
    /// What the planner and the scripted changes did to the node set, with
    /// [`MeshConfig::planner`] or [`MeshConfig::changes`].
    pub autoscale: Option<AutoscaleReport>,
    /// Every gap between tokens of the completed requests, pooled.
    pub itl: GapHistogram,
    /// Events the loop handled (a run of quiet steps is one).
    pub events: u64,
}

impl MeshRun {
    /// The run as bench reports a load level, with the mesh's statistics.
    /// The pooled ITL is read from [`MeshRun::itl`] (see [`crate::gaps`]), whatever the
    /// outcomes carry.
    pub fn point(&self, label: &str, shape: &LoadShape, slo: &SloSpec) -> Point {
        let mut point = Point::new(label, shape, slo, &self.outcomes, self.duration)
            .with_mesh(Some(self.stats.clone()));
        point.slo.itl = self.itl.summary();
        point.cdf.itl = self.itl.cdf();
        point
    }
}

#[derive(Debug)]
enum Event {
    Arrive(usize),
    /// Node `.0`'s step ends, if `.1` is still its step's number (a step whose end moved, or
    /// whose node died, leaves its old event behind).
    StepDone(usize, u64),
    /// Request `.0`'s KV has reached its decode node, on its placement `.1` (a KV that
    /// arrives for an earlier placement, before a migration or a fallback, is dropped).
    KvArrived(usize, u32),
    /// Every node reports its load.
    Report,
    /// `faults[.0]` happens.
    Fault(usize),
    /// Node `.0` has started (or switched roles) and joins the routing candidates.
    Ready(usize),
    /// Draining prefill node `.0`'s last KV has left: it may be gone.
    Drained(usize),
    /// The planner observes the mesh and decides.
    Plan,
    /// `changes[.0]` happens.
    Change(usize),
    /// Node `.0`'s gather window ends: its first step starts.
    Gathered(usize),
}

/// A request from arrival to its end.
struct Live {
    /// Its prompt's tokens, shared with the nodes that hold it.
    prompt: Arc<[TokenId]>,
    /// Its prompt's block hashes: hashed once on arrival for the router and both its nodes.
    hashed: PromptHashes,
    /// Its decode node.
    node: usize,
    /// Its prefill node, while the prefill is remote and not yet complete.
    prefill: Option<usize>,
    /// KV blocks the transfer fills on the decode node.
    transfer_blocks: usize,
    /// When its tokens reached the client, across migrations.
    tokens: TokenTimes,
    tracked: Tracked,
    /// Decode nodes it was sent to, in order (a migration tries none of them again).
    tried: Vec<usize>,
    /// Bumped at every new placement, so that a transfer for an old one is dropped.
    placement: u32,
}

/// The policy's own generator seeded from the run's seed when its config names no seed, so
/// no choice depends on the OS's entropy.
fn seeded(routing: &RoutingConfig, rng: &mut StdRng) -> RoutingConfig {
    let mut r = routing.clone();
    match &mut r {
        RoutingConfig::KvAware(KvAwareConfig { seed, .. })
        | RoutingConfig::Random { seed }
        | RoutingConfig::PowerOfTwo { seed } => {
            seed.get_or_insert_with(|| rng.gen());
        }
        RoutingConfig::LeastLoaded {} | RoutingConfig::RoundRobin {} => {}
    }
    r
}

/// Where a request was opened.
enum Opened {
    On {
        decode: usize,
        prefill: Option<usize>,
        tracked: Tracked,
    },
    /// No decode node is left to take it.
    NoNode,
    /// The node refused it (as the engine refuses a prompt too long).
    Refused(NodeError),
}

/// The routing candidates: live nodes by role, each node's position among them.
struct Candidates {
    decode: Vec<NodeEntry>,
    prefill: Vec<NodeEntry>,
    /// By node id: its role's list and position there; `None` once it died.
    slot: Vec<Option<(NodeRole, usize)>>,
}

impl Candidates {
    fn new(entries: Vec<NodeEntry>) -> Candidates {
        let (decode, prefill) = entries
            .into_iter()
            .partition(|e| e.info.role == NodeRole::Decode);
        let mut c = Candidates {
            decode,
            prefill,
            slot: Vec::new(),
        };
        c.index();
        c
    }

    fn index(&mut self) {
        let ids = self.decode.iter().chain(&self.prefill);
        let n = ids
            .map(|e| e.info.node_id.0 as usize + 1)
            .max()
            .unwrap_or(0);
        let mut slot = vec![None; self.slot.len().max(n)];
        for (role, list) in [
            (NodeRole::Decode, &self.decode),
            (NodeRole::Prefill, &self.prefill),
        ] {
            for (pos, e) in list.iter().enumerate() {
                slot[e.info.node_id.0 as usize] = Some((role, pos));
            }
        }
        self.slot = slot;
    }

    fn entry_mut(&mut self, n: usize) -> Option<&mut NodeEntry> {
        match self.slot.get(n).copied().flatten()? {
            (NodeRole::Decode, pos) => Some(&mut self.decode[pos]),
            (_, pos) => Some(&mut self.prefill[pos]),
        }
    }

    /// A node joins.
    fn add(&mut self, entry: NodeEntry) {
        match entry.info.role {
            NodeRole::Decode => self.decode.push(entry),
            _ => self.prefill.push(entry),
        }
        self.index();
    }

    /// Node `n` leaves.
    fn remove(&mut self, n: usize) {
        match self.slot.get(n).copied().flatten() {
            Some((NodeRole::Decode, pos)) => drop(self.decode.remove(pos)),
            Some((_, pos)) => drop(self.prefill.remove(pos)),
            None => return,
        }
        self.slot[n] = None;
        self.index();
    }
}

struct Mesh<'a> {
    requests: &'a [SimRequest],
    /// Decode nodes `0..decode`, then prefill nodes, then the nodes a planner added; a node's
    /// id is its index.
    nodes: Vec<SimNode>,
    roles: Vec<NodeRole>,
    /// Where each node is in its life, and when it got there.
    life: Vec<Life>,
    times: Vec<NodeTimes>,
    /// Until when each prefill node's KV is on the wire.
    sending_until: Vec<Duration>,
    /// What a new decode node is.
    decode_node: NodeConfig,
    startup: Duration,
    switch_delay: Duration,
    changes: &'a [NodeChange],
    /// The planner and what it measures, with `MeshConfig::planner`.
    scaler: Option<Box<Scaler>>,
    /// The node set's changes and bill, when it can change.
    ledger: Option<AutoscaleReport>,
    candidates: Candidates,
    routing: Routing,
    /// The nodes' block hasher (prefill and decode nodes share it).
    hasher: BlockHasher,
    index: Arc<InMemoryPrefixIndex>,
    queue: EventQueue<Event>,
    /// A slot a request, boxed: a few thousand are live at once, among a million slots.
    live: Vec<Option<Box<Live>>>,
    outcomes: Vec<Option<RequestOutcome>>,
    routed: Vec<u64>,
    /// One per (prefill node, decode node) that has carried KV, by [`link_key`]: up to
    /// one per pair of 300 x 700 nodes, looked up for every remote prefill.
    links: U64Map<u64, Link>,
    /// A buffer the nodes' KV events pass through to the index (nodes swap theirs for it).
    kv_events: Vec<TieredKvEvent>,
    link_factors: LinkFactors,
    prefill: Option<PrefillPool>,
    vocab_size: usize,
    remote_prefills: u64,
    migrations: u64,
    max_migrations: usize,
    faults: &'a [Fault],
    error_examples: BTreeMap<String, String>,
    /// When each request arrived (its `at`, or when a closed loop sent it).
    sent: Vec<Duration>,
    /// Closed loop: the next request to send when one ends.
    next_closed: Option<usize>,
    report_interval: Option<Duration>,
    /// Requests due but held until the request they follow has ended, by that request.
    held: BTreeMap<usize, Vec<usize>>,
    /// Each node's step-end events are numbered; only the latest counts.
    step_event: Vec<u64>,
    /// The sequence number of each node's step-end event while it runs quiet steps at once:
    /// every step of the run sorts as its own event would have, with this number.
    run_seq: Vec<u64>,
    cpu: Option<Hosts>,
    every_gap: bool,
    quiet_runs: bool,
    gather_window: Duration,
    itl: GapHistogram,
}

fn entry(i: usize, role: NodeRole, config: &NodeConfig) -> NodeEntry {
    let sched = &config.scheduler;
    NodeEntry {
        info: NodeInfo {
            node_id: NodeId(i as u64),
            role,
            address: format!("sim-{i}"),
            transfer_address: String::new(),
            model_fingerprint: sched.hasher.fingerprint,
            block_size: sched.block_size,
            kv_blocks_total: sched.num_blocks,
        },
        load: Default::default(),
    }
}

/// Runs `requests` (in arrival order) through the mesh until every one has ended: an open
/// loop, each request arriving at its `at`.
pub fn simulate(config: &MeshConfig, requests: &[SimRequest]) -> Result<MeshRun, MeshError> {
    if let Some(i) = (1..requests.len()).find(|&i| requests[i].at < requests[i - 1].at) {
        return Err(MeshError::Unordered(i));
    }
    run(config, requests, None)
}

/// Runs `requests` as a closed loop: `concurrency` of them in flight from the start, each of
/// the rest sent when one ends (bench's `concurrency=N`); their `at` is ignored.
pub fn simulate_closed(
    config: &MeshConfig,
    requests: &[SimRequest],
    concurrency: NonZeroUsize,
) -> Result<MeshRun, MeshError> {
    run(config, requests, Some(concurrency.get()))
}

fn run(
    config: &MeshConfig,
    requests: &[SimRequest],
    concurrency: Option<usize>,
) -> Result<MeshRun, MeshError> {
    if config.nodes == 0 {
        return Err(MeshError::NoNodes);
    }
    if let Some(i) = (0..requests.len()).find(|&i| requests[i].after.is_some_and(|p| p >= i)) {
        return Err(MeshError::BadPreviousTurn(i));
    }
    if config.report_interval == Some(Duration::ZERO) {
        return Err(MeshError::ZeroReportInterval);
    }
    let prefill_nodes = config.prefill.as_ref().map_or(0, |p| p.nodes);
    fault::validate(&config.faults, config.nodes, prefill_nodes)?;
    let sched = &config.node.scheduler;
    if let Some(p) = &config.prefill {
        let ps = &p.node.scheduler;
        if ps.block_size != sched.block_size || ps.hasher.fingerprint != sched.hasher.fingerprint {
            return Err(MeshError::MismatchedPools);
        }
    }
    let cpu = config.cpu.map(Hosts::new).transpose()?;
    let dynamic = config.planner.is_some() || !config.changes.is_empty();
    if dynamic && config.prefill.is_none() {
        return Err(MeshError::NoPrefillPool);
    }
    if dynamic && config.cpu.is_some() {
        return Err(MeshError::ChangesWithSharedCpu);
    }
    autoscale::validate_changes(&config.changes, config.nodes + prefill_nodes)?;
    let scaler = match &config.planner {
        None => None,
        Some(p) => Some(Box::new(Scaler::new(p.clone())?)),
    };
    let ledger = dynamic.then(|| {
        AutoscaleReport::new(config.planner.as_ref(), config.startup, config.switch_delay)
    });
    let mut rng = StdRng::seed_from_u64(config.seed);
    let index = Arc::new(InMemoryPrefixIndex::without_node_maps());
    let disaggregation = config
        .prefill
        .as_ref()
        .map(|p| p.disaggregation.clone())
        .unwrap_or_default();
    let routing = Routing::new(
        seeded(&config.routing, &mut rng).build(),
        disaggregation,
        index.clone(),
        sched.hasher.fingerprint,
    );
    let roles = (0..config.nodes)
        .map(|_| (NodeRole::Decode, &config.node))
        .chain(
            config
                .prefill
                .iter()
                .flat_map(|p| (0..p.nodes).map(|_| (NodeRole::Prefill, &p.node))),
        );
    let mut nodes = Vec::new();
    let mut entries = Vec::new();
    for (i, (role, node_config)) in roles.enumerate() {
        let mut node = SimNode::new(node_config.clone())?;
        node.set_record_kv_events(node_config.scheduler.enable_prefix_caching);
        // A node sharing its host's cores has its steps' ends moved by the others' steps.
        node.set_coalesce(config.quiet_runs && config.cpu.is_none());
        node.set_gather_window(config.gather_window);
        if scaler.is_some() {
            node.set_record_steps(scaler::STEPS_KEPT);
        }
        nodes.push(node);
        entries.push(entry(i, role, node_config));
    }
    // At most every block of every node, once the pools have filled.
    index.reserve(nodes.iter().map(|n| n.pool().num_blocks()).sum());
    let mut queue = EventQueue::new();
    // A fault at an instant comes before everything else due then.
    for (k, f) in config.faults.iter().enumerate() {
        queue.push_at(f.at, Event::Fault(k));
    }
    let first_sent = match concurrency {
        None => {
            for (i, r) in requests.iter().enumerate() {
                queue.push_at(r.at, Event::Arrive(i));
            }
            None
        }
        Some(c) => {
            let c = c.min(requests.len());
            for i in 0..c {
                queue.push_at(Duration::ZERO, Event::Arrive(i));
            }
            Some(c)
        }
    };
    if let Some(interval) = config.report_interval {
        queue.push_at(interval, Event::Report);
    }
    if let Some(s) = &scaler {
        queue.push_at(s.interval(), Event::Plan);
    }
    for (k, c) in config.changes.iter().enumerate() {
        queue.push_at(c.at, Event::Change(k));
    }
    let mut mesh = Mesh {
        requests,
        life: vec![Life::Serving; nodes.len()],
        times: vec![NodeTimes::initial(); nodes.len()],
        sending_until: vec![Duration::ZERO; nodes.len()],
        decode_node: config.node.clone(),
        startup: config.startup,
        switch_delay: config.switch_delay,
        changes: &config.changes,
        scaler,
        ledger,
        routed: vec![0; nodes.len()],
        step_event: vec![0; nodes.len()],
        run_seq: vec![0; nodes.len()],
        cpu,
        every_gap: config.every_gap,
        quiet_runs: config.quiet_runs,
        gather_window: config.gather_window,
        itl: GapHistogram::default(),
        roles: entries.iter().map(|e| e.info.role).collect(),
        nodes,
        candidates: Candidates::new(entries),
        routing,
        hasher: sched.hasher,
        index,
        queue,
        live: (0..requests.len()).map(|_| None).collect(),
        outcomes: vec![None; requests.len()],
        links: U64Map::default(),
        kv_events: Vec::new(),
        link_factors: LinkFactors::default(),
        prefill: config.prefill.clone(),
        vocab_size: config.node.vocab_size,
        remote_prefills: 0,
        migrations: 0,
        max_migrations: config.max_migrations,
        faults: &config.faults,
        error_examples: BTreeMap::new(),
        sent: vec![Duration::ZERO; requests.len()],
        next_closed: first_sent,
        report_interval: config.report_interval,
        held: BTreeMap::new(),
    };
    mesh.keep_candidates();
    mesh.record_counts(Duration::ZERO);
    let mut events = 0;
    while let Some((now, event)) = mesh.queue.pop() {
        events += 1;
        match event {
            Event::Arrive(i) => mesh.arrive(i, now),
            Event::StepDone(n, event) => mesh.step_done(n, event, now)?,
            Event::KvArrived(i, placement) => mesh.kv_arrived(i, placement, now)?,
            Event::Report => mesh.report_loads(),
            Event::Fault(k) => mesh.fault(k, now),
            Event::Ready(n) => mesh.ready(n, now),
            Event::Drained(n) => mesh.settle(n, now),
            Event::Plan => mesh.plan(now),
            Event::Change(k) => mesh.change(k, now),
            Event::Gathered(n) => mesh.kick(n, now),
        }
    }
    let mut run = mesh.finish();
    run.events = events;
    Ok(run)
}

impl Mesh<'_> {
    fn arrive(&mut self, i: usize, now: Duration) {
        if let Some(p) = self.requests[i]
            .after
            .filter(|&p| self.outcomes[p].is_none())
        {
            self.held.entry(p).or_default().push(i);
            return;
        }
        self.sent[i] = now;
        if let Some(s) = self.scaler.as_mut() {
            s.window.arrived(self.requests[i].prompt.len());
        }
        let prompt = self.requests[i].prompt.tokens();
        let hashed = self.requests[i].prompt.hashes(self.hasher, &prompt);
        match self.open(i, &prompt, &hashed, &[], &[]) {
            Opened::On {
                decode,
                prefill,
                tracked,
            } => {
                self.live[i] = Some(Box::new(Live {
                    prompt,
                    hashed,
                    node: decode,
                    prefill,
                    transfer_blocks: 0,
                    tokens: TokenTimes::new(self.every_gap),
                    tracked,
                    tried: vec![decode],
                    placement: 0,
                }));
                self.kick(decode, now);
            }
            // The router has no decode node to send it to: 503.
            Opened::NoNode => {
                let why = "no decode node is alive".to_string();
                self.end_failed(i, now, Some(503), "http_503", why)
            }
            // The node refuses it as the real engine would (a 400 from the server).
            Opened::Refused(e) => self.end_failed(i, now, Some(400), "http_400", e.to_string()),
        }
    }

    /// Routes request `i` to a live decode node not in `tried` and queues it there: with
    /// `resume`, the tokens it delivered before its node died, it is routed by everything
    /// its KV will hold and the decode node recomputes them itself (no prefill node), as the
    /// router's `MeshBackend::open` does.
    fn open(
        &mut self,
        i: usize,
        prompt: &Arc<[TokenId]>,
        hashed: &PromptHashes,
        resume: &[TokenId],
        tried: &[usize],
    ) -> Opened {
        let r = &self.requests[i];
        let tokens: Cow<[TokenId]> = if resume.is_empty() {
            Cow::Borrowed(prompt)
        } else {
            Cow::Owned([&prompt[..], resume].concat())
        };
        // A migrated request is routed by more than its prompt: hashed again.
        let hashed = resume.is_empty().then_some(hashed);
        let route = if tried.is_empty() {
            // The candidates the router keeps, as the sim's own lists are.
            self.routing.route_kept(&tokens, hashed)
        } else {
            let untried: Vec<NodeEntry> = self
                .candidates
                .decode
                .iter()
                .filter(|e| !tried.contains(&(e.info.node_id.0 as usize)))
                .cloned()
                .collect();
            let prefill = if resume.is_empty() {
                &self.candidates.prefill[..]
            } else {
                &[]
            };
            self.routing
                .route_hashed(&tokens, hashed, &untried, prefill)
        };
        let Some(route) = route else {
            return Opened::NoNode;
        };
        let d = route.decode.0 as usize;
        let p = route.prefill.map(|p| p.0 as usize);
        let tracked = self.routing.track_route(route.decode, route.prefill);
        let (seq, prompt) = (i as u64, prompt.clone());
        self.touch(d);
        let submitted = match p {
            Some(_) => self.nodes[d].submit_remote(seq, prompt, hashed, r.max_tokens),
            None if resume.is_empty() => match hashed {
                Some(hashed) => self.nodes[d].submit_hashed(seq, prompt, hashed, r.max_tokens),
                None => self.nodes[d].submit(seq, prompt, r.max_tokens),
            },
            None => self.nodes[d].submit_resumed(seq, prompt, resume.to_vec(), r.max_tokens),
        };
        match submitted {
            Ok(()) => {
                self.routed[d] += 1;
                Opened::On {
                    decode: d,
                    prefill: p,
                    tracked,
                }
            }
            Err(e) => Opened::Refused(e),
        }
    }

    /// Starts a step on `n` if it is idle and has work (or its gather window, when a request
    /// has just woken it); starts the prefills of the remote sequences it admitted.
    fn kick(&mut self, n: usize, now: Duration) {
        match self.nodes[n].start_step(now) {
            None => {}
            Some(Started::Gather(until)) => self.queue.push_at(until, Event::Gathered(n)),
            Some(Started::Step(end)) => match self.cpu.as_mut() {
                None => self.step_ends(n, end),
                Some(hosts) => {
                    for (m, end) in hosts.start(n, end - now, now) {
                        self.nodes[m].set_step_end(end);
                        self.step_ends(m, end);
                    }
                }
            },
        }
        self.publish(n);
        for a in self.nodes[n].take_remote_admissions() {
            let i = a.seq_id as usize;
            let live = self.live[i].as_mut().expect("an admitted request is live");
            let p = live.prefill.expect("a remote admission has a prefill node");
            live.transfer_blocks = a.blocks.len();
            let prompt = live.prompt.clone();
            // The prefill node computes the prompt and samples the first token.
            self.nodes[p]
                .submit_hashed(a.seq_id, prompt, &live.hashed, 1)
                .expect("the decode node accepted the same prompt");
            self.routed[p] += 1;
            self.remote_prefills += 1;
            self.kick(p, now);
        }
    }

    /// What a real node announces: its KV events to the index, its load to discovery.
    fn publish(&mut self, n: usize) {
        let mut events = std::mem::take(&mut self.kv_events);
        self.nodes[n].drain_kv_events_into(&mut events);
        // A node out of routing (draining) is out of the index too.
        if !events.is_empty() && self.life[n] == Life::Serving {
            self.index.apply(NodeId(n as u64), &events);
        }
        self.kv_events = events;
        if self.report_interval.is_none() {
            self.report_load(n);
        }
    }

    /// Node `n`'s load reaches the router (its candidates and the ones it keeps).
    fn report_load(&mut self, n: usize) {
        let Some(e) = self.candidates.entry_mut(n) else {
            return;
        };
        let load = self.nodes[n].load();
        // The router has every report the sim's entry has: the same one again changes nothing.
        if e.load != load {
            e.load = load;
            self.routing.report(NodeId(n as u64), load);
        }
    }

    /// The candidates changed: the router keeps them anew.
    fn keep_candidates(&self) {
        let c = &self.candidates;
        self.routing
            .keep_candidates(c.decode.clone(), c.prefill.clone());
    }

    /// The periodic load reports; the next is due only while something else can still
    /// happen (otherwise reports alone would keep the run going for ever).
    fn report_loads(&mut self) {
        for n in 0..self.nodes.len() {
            self.report_load(n);
        }
        if let (false, Some(interval)) = (self.queue.is_empty(), self.report_interval) {
            self.queue.push_in(interval, Event::Report);
        }
    }

    /// Request `i` has ended: the turns following it are sent, and a closed loop sends the
    /// next request.
    fn ended(&mut self, i: usize, now: Duration) {
        for next in self.held.remove(&i).unwrap_or_default() {
            self.queue.push_at(now, Event::Arrive(next));
        }
        if let Some(next) = self.next_closed.filter(|&n| n < self.requests.len()) {
            self.queue.push_at(now, Event::Arrive(next));
            self.next_closed = Some(next + 1);
        }
    }

    /// Node `n`'s step in flight ends at `end` (replacing any end it had). A run of quiet
    /// steps' event sorts as its last step's own would have, pushed when the one before ended.
    fn step_ends(&mut self, n: usize, end: Duration) {
        self.step_event[n] += 1;
        let event = Event::StepDone(n, self.step_event[n]);
        match self.nodes[n].run() {
            Some((_, ends)) => {
                let as_of = Duration::from_nanos(ends[ends.len() - 2]);
                self.run_seq[n] = self.queue.next_seq();
                self.queue.push_as_of(end, as_of, event);
            }
            None => self.queue.push_at(end, event),
        }
    }

    /// Node `n`'s step is over (done, or cut short by its death): the other nodes of its
    /// host speed up.
    fn step_over(&mut self, n: usize, now: Duration) {
        self.step_event[n] += 1;
        if let Some(hosts) = self.cpu.as_mut() {
            for (m, end) in hosts.stop(n, now) {
                self.nodes[m].set_step_end(end);
                self.step_ends(m, end);
            }
        }
    }

    fn step_done(&mut self, n: usize, event: u64, now: Duration) -> Result<(), MeshError> {
        if event != self.step_event[n] {
            return Ok(());
        }
        self.step_over(n, now);
        if self.nodes[n].run().is_some() {
            let tokens = self.nodes[n].finish_run()?;
            self.deliver(&tokens);
            self.kick(n, now);
            self.settle(n, now);
            return Ok(());
        }
        let report = self.nodes[n].finish_step()?;
        if self.roles[n] == NodeRole::Prefill {
            // A prefill node's token is the first token, delivered with the KV.
            for f in &report.finished {
                self.send_kv(f.seq_id as usize, n, now);
            }
        } else {
            for (seq, _) in &report.tokens {
                let i = *seq as usize;
                if let Some(live) = self.live[i].as_mut() {
                    if let Some(s) = self.scaler.as_mut() {
                        s.token(live.tokens.last(), self.sent[i], now);
                    }
                    live.tokens.push(now);
                }
            }
            for f in &report.finished {
                self.end_ok(f, now);
            }
        }
        self.kick(n, now);
        self.settle(n, now);
        Ok(())
    }

    /// Queues the KV of request `i`'s prompt from prefill node `p` to its decode node.
    fn send_kv(&mut self, i: usize, p: usize, now: Duration) {
        let pool = self.prefill.as_ref().expect("prefill nodes exist");
        let Some(live) = self.live[i].as_ref().filter(|l| l.prefill == Some(p)) else {
            // Its decode node gave up on this prefill (a cancelled prefill never ends, so
            // this does not happen; nothing would wait for the KV if it did).
            return;
        };
        let block_size = self.nodes[live.node].scheduler().config().block_size;
        let bytes = (live.transfer_blocks * block_size) as u64 * pool.kv_bytes_per_token;
        let model = self.link_factors.model(pool.link.model(), p, live.node);
        let link = self
            .links
            .entry(link_key(p, live.node))
            .or_insert_with(|| Link::new(model));
        link.set_model(model);
        let transfer = link.enqueue(now, bytes);
        self.sending_until[p] = self.sending_until[p].max(transfer.done);
        self.queue
            .push_at(transfer.done, Event::KvArrived(i, live.placement));
    }

    fn kv_arrived(&mut self, i: usize, placement: u32, now: Duration) -> Result<(), MeshError> {
        let current = self.live[i]
            .as_ref()
            .is_some_and(|l| l.placement == placement && l.prefill.is_some());
        if !current {
            // For a placement given up since (its decode or prefill node died).
            return Ok(());
        }
        let prompt = &self.requests[i].prompt;
        let last = prompt.last().expect("prompts are never empty");
        let first = MockRunner::favoured_token(last, prompt.len(), self.vocab_size);
        let live = self.live[i].as_mut().expect("checked above");
        let p = live.prefill.take().expect("checked above");
        live.tracked.prefilled();
        if let Some(s) = self.scaler.as_mut() {
            s.token(live.tokens.last(), self.sent[i], now);
        }
        live.tokens.push(now);
        let d = live.node;
        self.touch(d);
        if let Some(f) = self.nodes[d].complete_remote(i as u64, first)? {
            self.end_ok(&f, now);
        }
        self.kick(d, now);
        self.settle(d, now);
        self.settle(p, now);
        Ok(())
    }

    fn fault(&mut self, k: usize, now: Duration) {
        match &self.faults[k].kind {
            FaultKind::NodeDies(n) => self.node_dies(n.0 as usize, now),
            FaultKind::LinkSlows { factor, between } => {
                let pair = between.map(|(p, d)| (p.0 as usize, d.0 as usize));
                self.link_factors.set(*factor, pair);
            }
        }
    }

    /// Node `n` dies: it leaves the candidates and the index; its decode requests migrate,
    /// the remote prefills it was computing fall back to their decode nodes.
    fn node_dies(&mut self, n: usize, now: Duration) {
        if self.nodes[n].died_at().is_some() || self.life[n] == Life::Gone {
            return;
        }
        self.touch(n);
        self.nodes[n].die(now);
        self.step_over(n, now);
        self.leave_routing(n);
        self.gone(n, now);
        let mut touched = BTreeSet::new();
        for i in 0..self.live.len() {
            let Some(live) = self.live[i].as_mut() else {
                continue;
            };
            if live.node == n {
                touched.extend(self.migrate(i, n, now));
            } else if live.prefill == Some(n) {
                // The decode worker gives up on the prefill and computes it itself.
                live.prefill = None;
                live.placement += 1;
                live.transfer_blocks = 0;
                let d = live.node;
                self.touch(d);
                self.nodes[d].fail_remote(i as u64);
                touched.insert(d);
            }
        }
        for d in touched {
            self.kick(d, now);
            self.settle(d, now);
        }
    }

    /// Request `i`'s decode node `dead` died: it moves to another decode node with the
    /// tokens delivered so far, or fails. Returns the nodes to kick: its new decode node and
    /// the prefill node whose work for it was cancelled.
    fn migrate(&mut self, i: usize, dead: usize, now: Duration) -> Vec<usize> {
        let mut live = self.live[i].take().expect("a migrating request is live");
        let mut touched = Vec::new();
        if let Some(p) = live.prefill.take() {
            // Its prefill is cancelled with it (the decode node's cancel reaches the prefill
            // node; the transfer would have nowhere to go).
            self.touch(p);
            self.nodes[p].abort(i as u64);
            touched.push(p);
        }
        let delivered = live.tokens.len();
        let resume: Vec<TokenId> = match self.nodes[dead].output_tokens(i as u64) {
            Some(out) => out[..delivered].to_vec(),
            None => Vec::new(),
        };
        debug_assert_eq!(resume.len(), delivered, "request {i}'s delivered tokens");
        // Every node it was sent to but the first was a migration.
        if live.tried.len() > self.max_migrations {
            self.live[i] = Some(live);
            let why = format!(
                "its decode node died after {} migrations",
                self.max_migrations
            );
            self.end_failed(i, now, Some(200), "stream_error", why);
            return touched;
        }
        match self.open(i, &live.prompt, &live.hashed, &resume, &live.tried) {
            Opened::On {
                decode,
                prefill,
                tracked,
            } => {
                // Counted when it moves (the router's counter also counts an attempt that
                // finds no node).
                self.migrations += 1;
                live.node = decode;
                live.prefill = prefill;
                live.transfer_blocks = 0;
                // The old node's in-flight count ends with its stream.
                live.tracked = tracked;
                live.tried.push(decode);
                live.placement += 1;
                self.live[i] = Some(live);
                touched.push(decode);
            }
            Opened::NoNode | Opened::Refused(_) => {
                self.live[i] = Some(live);
                let why = "its decode node died and no other could take it".to_string();
                self.end_failed(i, now, Some(200), "stream_error", why);
            }
        }
        touched
    }

    fn end_ok(&mut self, f: &Finished, now: Duration) {
        let i = f.seq_id as usize;
        // Dropping `live` ends the router's in-flight count, as the stream's end does.
        let live = self.live[i].take().expect("a finished request was live");
        let sent = self.sent[i];
        let first = live
            .tokens
            .first()
            .expect("a completed request got a token");
        let prompt_tokens = self.requests[i].prompt.len();
        if let Some(s) = self.scaler.as_mut() {
            let cached = f.cached_tokens.min(prompt_tokens) as u64;
            s.window
                .completed(prompt_tokens as u64, cached, f.output_tokens as u64);
        }
        self.outcomes[i] = Some(RequestOutcome {
            item: i,
            sent,
            ended: now,
            status: Some(200),
            error: None,
            ttft: Some(first - sent),
            gaps: self.gaps_of(&live.tokens),
            e2e: Some(now - sent),
            prompt_tokens: Some(prompt_tokens as u64),
            // A migrated request's lookup covered its generated tokens too.
            cached_tokens: Some(f.cached_tokens.min(prompt_tokens) as u64),
            output_tokens: f.output_tokens as u64,
        });
        self.ended(i, now);
    }

    /// A completed request's gaps between `tokens`, pooled into the run's histogram: every
    /// one for its outcome, or only its longest ([`MeshConfig::every_gap`]).
    fn gaps_of(&mut self, tokens: &TokenTimes) -> Vec<Duration> {
        let longest = self.itl.pool(tokens);
        match tokens.every() {
            Some(times) => times.windows(2).map(|w| w[1] - w[0]).collect(),
            None => longest.into_iter().collect(),
        }
    }

    /// Request `i` ends without completing: `kind` in its outcome, as bench's driver names
    /// failures, and `message` as the kind's example if it is the first.
    fn end_failed(
        &mut self,
        i: usize,
        now: Duration,
        status: Option<u16>,
        kind: &str,
        message: String,
    ) {
        self.error_examples.entry(kind.into()).or_insert(message);
        let delivered = self.live[i].take().map_or(0, |l| l.tokens.len());
        self.outcomes[i] = Some(RequestOutcome {
            item: i,
            sent: self.sent[i],
            ended: now,
            status,
            error: Some(kind.into()),
            prompt_tokens: Some(self.requests[i].prompt.len() as u64),
            output_tokens: delivered as u64,
            ..RequestOutcome::default()
        });
        self.ended(i, now);
    }

    fn finish(mut self) -> MeshRun {
        let end = self.queue.now();
        // A request still live when no event is left could never finish (its node waits for
        // memory nothing will free): it ends as a failure, so every request ends once.
        for i in 0..self.live.len() {
            if let Some(live) = &self.live[i] {
                let node = live.node;
                let why = format!("stranded on node {node}: it waits for memory nothing frees");
                self.end_failed(i, end, None, "stranded", why);
            }
        }
        // A closed loop behind stranded requests never sent the rest.
        for i in 0..self.outcomes.len() {
            if self.outcomes[i].is_none() {
                self.sent[i] = end;
                let why = "the closed loop stopped before sending it".to_string();
                self.end_failed(i, end, None, "never_sent", why);
            }
        }
        let outcomes: Vec<RequestOutcome> = self
            .outcomes
            .into_iter()
            .map(|o| o.expect("every request ends"))
            .collect();
        let duration = outcomes.iter().map(|o| o.ended).max().unwrap_or_default();
        let totals: Vec<NodeTotals> = self
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let mut t = n.totals(i as u64, self.roles[i].as_str(), self.routed[i]);
                let times = &self.times[i];
                // A node that never served has no lifetime: it joined as it left.
                t.joined_at = times.serving.or(times.left).unwrap_or(duration);
                t.left_at = times.left.filter(|_| n.died_at().is_none());
                t
            })
            .collect();
        let autoscale = self.ledger.take().map(|mut ledger| {
            ledger.billed(lifecycle::billed(&self.roles, &self.times, duration));
            ledger
        });
        let stats = mesh_stats(
            &totals,
            duration,
            self.links.values().map(Link::bytes_sent).sum(),
            self.remote_prefills,
            self.migrations,
        );
        let blocks_in_use = self
            .nodes
            .iter()
            .map(|n| n.died_at().is_none().then(|| n.pool().num_used()))
            .collect();
        MeshRun {
            outcomes,
            duration,
            stats,
            blocks_in_use,
            error_examples: self.error_examples,
            autoscale,
            itl: self.itl,
            events: 0,
        }
    }
}

/// The key of the link from prefill node `p` to decode node `d`.
fn link_key(p: usize, d: usize) -> u64 {
    (p as u64) << 32 | d as u64
}
