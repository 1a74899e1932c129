//! The whole mesh in virtual time: requests arrive, the router's real [`Routing`] picks a
//! node from the nodes' load and the prefix index, the node's real scheduler runs them, and
//! every request ends as a [`RequestOutcome`], bench's own type, so a simulated run reports
//! as a real one does ([`MeshRun::point`]).
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
//! router sees stale load as it does in the real mesh. The first token reaches the client when the decode node has the KV (it streams the
//! response), so TTFT includes the transfer. Simplifications, not built yet: the KV moves
//! after the whole prefill (the real prefill worker pushes blocks after each step, overlapping
//! the two), transfers never fail (no `fail_remote_prefill` path), no pull of cached prefixes
//! from another node.

use crate::events::EventQueue;
use crate::link::{Link, LinkClass};
use crate::node::{Finished, NodeConfig, NodeError, SimNode};
use kvmesh_bench::arrivals::LoadShape;
use kvmesh_bench::report::Point;
use kvmesh_bench::slo::{RequestOutcome, SloSpec};
use kvmesh_bench::trace::ScaledRequest;
use kvmesh_bench::workload::{Prompt, WorkItem};
use kvmesh_common::{NodeId, NodeInfo, NodeRole, TokenId};
use kvmesh_engine::mock_runner::MockRunner;
use kvmesh_kvstore::{InMemoryPrefixIndex, NodeEntry};
use kvmesh_router::policy::{DisaggConfig, KvAwareConfig, RoutingConfig};
use kvmesh_router::routing::{Routing, Tracked};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::collections::BTreeMap;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

/// One request offered to the mesh.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimRequest {
    /// Arrival, from the run's start.
    pub at: Duration,
    pub prompt: Vec<TokenId>,
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
            prompt: r.prompt_tokens.clone(),
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
                prompt: ids.clone(),
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
    #[error(transparent)]
    Node(#[from] NodeError),
}

/// One node's totals over a run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NodeSummary {
    pub node: u64,
    pub role: &'static str,
    pub requests: u64,
    pub steps: u64,
    pub busy_s: f64,
    pub preemptions: u64,
    /// At the end of the run: every block should be free again.
    pub free_blocks: usize,
    pub num_blocks: usize,
}

/// What a run produced.
#[derive(Debug)]
pub struct MeshRun {
    /// One per request, in request order.
    pub outcomes: Vec<RequestOutcome>,
    /// From the start to the last request's end.
    pub duration: Duration,
    pub nodes: Vec<NodeSummary>,
    /// KV bytes moved from prefill to decode nodes.
    pub kv_bytes_transferred: u64,
    /// Requests prefilled on a prefill node.
    pub remote_prefills: u64,
}

/// A run's report: bench's point plus the simulated nodes' totals.
#[derive(Clone, Debug, Serialize)]
pub struct SimReport {
    pub point: Point,
    pub nodes: Vec<NodeSummary>,
    pub kv_bytes_transferred: u64,
    pub remote_prefills: u64,
}

impl MeshRun {
    /// The run as bench reports a load level.
    pub fn point(&self, label: &str, shape: &LoadShape, slo: &SloSpec) -> Point {
        Point::new(label, shape, slo, &self.outcomes, self.duration)
    }

    pub fn report(&self, label: &str, shape: &LoadShape, slo: &SloSpec) -> SimReport {
        SimReport {
            point: self.point(label, shape, slo),
            nodes: self.nodes.clone(),
            kv_bytes_transferred: self.kv_bytes_transferred,
            remote_prefills: self.remote_prefills,
        }
    }
}

#[derive(Debug)]
enum Event {
    Arrive(usize),
    StepDone(usize),
    /// Request `.0`'s KV has reached its decode node.
    KvArrived(usize),
    /// Every node reports its load.
    Report,
}

/// A request from arrival to its end.
struct Live {
    /// Its decode node.
    node: usize,
    /// Its prefill node, while the prefill is remote and not yet complete.
    prefill: Option<usize>,
    /// KV blocks the transfer fills on the decode node.
    transfer_blocks: usize,
    tokens: Vec<Duration>,
    tracked: Tracked,
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

struct Mesh<'a> {
    requests: &'a [SimRequest],
    /// Decode nodes `0..decode`, then prefill nodes; a node's id is its index.
    nodes: Vec<SimNode>,
    entries: Vec<NodeEntry>,
    decode: usize,
    routing: Routing,
    index: Arc<InMemoryPrefixIndex>,
    queue: EventQueue<Event>,
    live: Vec<Option<Live>>,
    outcomes: Vec<Option<RequestOutcome>>,
    routed: Vec<u64>,
    /// One per (prefill node, decode node) that has carried KV.
    links: BTreeMap<(usize, usize), Link>,
    prefill: Option<PrefillPool>,
    vocab_size: usize,
    remote_prefills: u64,
    /// When each request arrived (its `at`, or when a closed loop sent it).
    sent: Vec<Duration>,
    /// Closed loop: the next request to send when one ends.
    next_closed: Option<usize>,
    report_interval: Option<Duration>,
    /// Requests due but held until the request they follow has ended, by that request.
    held: BTreeMap<usize, Vec<usize>>,
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
    let sched = &config.node.scheduler;
    if let Some(p) = &config.prefill {
        let ps = &p.node.scheduler;
        if ps.block_size != sched.block_size || ps.hasher.fingerprint != sched.hasher.fingerprint {
            return Err(MeshError::MismatchedPools);
        }
    }
    let mut rng = StdRng::seed_from_u64(config.seed);
    let index = Arc::new(InMemoryPrefixIndex::new());
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
        nodes.push(node);
        entries.push(entry(i, role, node_config));
    }
    let mut queue = EventQueue::new();
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
    let mut mesh = Mesh {
        requests,
        routed: vec![0; nodes.len()],
        nodes,
        entries,
        decode: config.nodes,
        routing,
        index,
        queue,
        live: (0..requests.len()).map(|_| None).collect(),
        outcomes: vec![None; requests.len()],
        links: BTreeMap::new(),
        prefill: config.prefill.clone(),
        vocab_size: config.node.vocab_size,
        remote_prefills: 0,
        sent: vec![Duration::ZERO; requests.len()],
        next_closed: first_sent,
        report_interval: config.report_interval,
        held: BTreeMap::new(),
    };
    while let Some((now, event)) = mesh.queue.pop() {
        match event {
            Event::Arrive(i) => mesh.arrive(i, now),
            Event::StepDone(n) => mesh.step_done(n, now)?,
            Event::KvArrived(i) => mesh.kv_arrived(i, now)?,
            Event::Report => mesh.report_loads(),
        }
    }
    Ok(mesh.finish())
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
        let r = &self.requests[i];
        let (decode, prefill) = self.entries.split_at(self.decode);
        let Some(route) = self.routing.route(&r.prompt, decode, prefill) else {
            unreachable!("every decode node serves the model");
        };
        let d = route.decode.0 as usize;
        let p = route.prefill.map(|p| p.0 as usize);
        let tracked = self.routing.track_route(route.decode, route.prefill);
        let submitted = match p {
            Some(_) => self.nodes[d].submit_remote(i as u64, r.prompt.clone(), r.max_tokens),
            None => self.nodes[d].submit(i as u64, r.prompt.clone(), r.max_tokens),
        };
        match submitted {
            Ok(()) => {
                self.routed[d] += 1;
                self.live[i] = Some(Live {
                    node: d,
                    prefill: p,
                    transfer_blocks: 0,
                    tokens: Vec::new(),
                    tracked,
                });
                self.kick(d, now);
            }
            // The node refuses it as the real engine would (a 400 from the server).
            Err(e) => self.end_failed(i, now, Some(400), e.to_string()),
        }
    }

    /// Starts a step on `n` if it is idle and has work; starts the prefills of the remote
    /// sequences it admitted.
    fn kick(&mut self, n: usize, now: Duration) {
        if let Some(end) = self.nodes[n].start_step(now) {
            self.queue.push_at(end, Event::StepDone(n));
        }
        self.publish(n);
        for a in self.nodes[n].take_remote_admissions() {
            let i = a.seq_id as usize;
            let live = self.live[i].as_mut().expect("an admitted request is live");
            let p = live.prefill.expect("a remote admission has a prefill node");
            live.transfer_blocks = a.blocks.len();
            let r = &self.requests[i];
            // The prefill node computes the prompt and samples the first token.
            self.nodes[p]
                .submit(a.seq_id, r.prompt.clone(), 1)
                .expect("the decode node accepted the same prompt");
            self.routed[p] += 1;
            self.remote_prefills += 1;
            self.kick(p, now);
        }
    }

    /// What a real node announces: its KV events to the index, its load to discovery.
    fn publish(&mut self, n: usize) {
        let events = self.nodes[n].drain_kv_events();
        if !events.is_empty() {
            self.index.apply(NodeId(n as u64), &events);
        }
        if self.report_interval.is_none() {
            self.entries[n].load = self.nodes[n].load();
        }
    }

    /// The periodic load reports; the next is due only while something else can still
    /// happen (otherwise reports alone would keep the run going for ever).
    fn report_loads(&mut self) {
        for (entry, node) in self.entries.iter_mut().zip(&self.nodes) {
            entry.load = node.load();
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

    fn step_done(&mut self, n: usize, now: Duration) -> Result<(), MeshError> {
        let report = self.nodes[n].finish_step()?;
        if n >= self.decode {
            // A prefill node's token is the first token, delivered with the KV.
            for f in &report.finished {
                self.send_kv(f.seq_id as usize, n, now);
            }
        } else {
            for (seq, _) in &report.tokens {
                if let Some(live) = self.live[*seq as usize].as_mut() {
                    live.tokens.push(now);
                }
            }
            for f in &report.finished {
                self.end_ok(f, now);
            }
        }
        self.kick(n, now);
        Ok(())
    }

    /// Queues the KV of request `i`'s prompt from prefill node `p` to its decode node.
    fn send_kv(&mut self, i: usize, p: usize, now: Duration) {
        let pool = self.prefill.as_ref().expect("prefill nodes exist");
        let live = self.live[i].as_ref().expect("a prefilling request is live");
        let block_size = self.nodes[live.node].scheduler().config().block_size;
        let bytes = (live.transfer_blocks * block_size) as u64 * pool.kv_bytes_per_token;
        let model = pool.link.model();
        let link = self
            .links
            .entry((p, live.node))
            .or_insert_with(|| Link::new(model));
        let transfer = link.enqueue(now, bytes);
        self.queue.push_at(transfer.done, Event::KvArrived(i));
    }

    fn kv_arrived(&mut self, i: usize, now: Duration) -> Result<(), MeshError> {
        let prompt = &self.requests[i].prompt;
        let last = *prompt.last().expect("prompts are never empty");
        let first = MockRunner::favoured_token(last, prompt.len(), self.vocab_size);
        let live = self.live[i]
            .as_mut()
            .expect("a transferring request is live");
        live.prefill = None;
        live.tracked.prefilled();
        live.tokens.push(now);
        let d = live.node;
        if let Some(f) = self.nodes[d].complete_remote(i as u64, first)? {
            self.end_ok(&f, now);
        }
        self.kick(d, now);
        Ok(())
    }

    fn end_ok(&mut self, f: &Finished, now: Duration) {
        let i = f.seq_id as usize;
        // Dropping `live` ends the router's in-flight count, as the stream's end does.
        let live = self.live[i].take().expect("a finished request was live");
        let sent = self.sent[i];
        let first = live.tokens[0];
        self.outcomes[i] = Some(RequestOutcome {
            item: i,
            sent,
            ended: now,
            status: Some(200),
            error: None,
            ttft: Some(first - sent),
            gaps: live.tokens.windows(2).map(|w| w[1] - w[0]).collect(),
            e2e: Some(now - sent),
            prompt_tokens: Some(self.requests[i].prompt.len() as u64),
            cached_tokens: Some(f.cached_tokens as u64),
            output_tokens: f.output_tokens as u64,
        });
        self.ended(i, now);
    }

    fn end_failed(&mut self, i: usize, now: Duration, status: Option<u16>, error: String) {
        self.live[i] = None;
        self.outcomes[i] = Some(RequestOutcome {
            item: i,
            sent: self.sent[i],
            ended: now,
            status,
            error: Some(error),
            prompt_tokens: Some(self.requests[i].prompt.len() as u64),
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
                self.end_failed(i, end, None, format!("stranded on node {node}"));
            }
        }
        // A closed loop behind stranded requests never sent the rest.
        for i in 0..self.outcomes.len() {
            if self.outcomes[i].is_none() {
                self.sent[i] = end;
                self.end_failed(i, end, None, "never sent".into());
            }
        }
        let outcomes: Vec<RequestOutcome> = self
            .outcomes
            .into_iter()
            .map(|o| o.expect("every request ends"))
            .collect();
        let duration = outcomes.iter().map(|o| o.ended).max().unwrap_or_default();
        let nodes = self
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| NodeSummary {
                node: i as u64,
                role: self.entries[i].info.role.as_str(),
                requests: self.routed[i],
                steps: n.steps(),
                busy_s: n.busy_time().as_secs_f64(),
                preemptions: n.scheduler().num_preemptions(),
                free_blocks: n.pool().num_free(),
                num_blocks: n.pool().num_blocks(),
            })
            .collect();
        MeshRun {
            outcomes,
            duration,
            nodes,
            kv_bytes_transferred: self.links.values().map(Link::bytes_sent).sum(),
            remote_prefills: self.remote_prefills,
        }
    }
}
