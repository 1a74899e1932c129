//! The whole mesh in virtual time: requests arrive, the router's real [`Routing`] picks a
//! node from the nodes' load and the prefix index, the node's real scheduler runs them, and
//! every request ends as a [`RequestOutcome`], bench's own type, so a simulated run reports
//! as a real one does ([`MeshRun::point`]).
//!
//! Built so far: aggregated nodes (each prefills and decodes its own requests). The prefix
//! index is the router's [`InMemoryPrefixIndex`], fed with each node's KV events after every
//! step, as the nodes' publishers feed it in the real mesh. Load reports are refreshed at every
//! step boundary and submission, so they are fresher than the real mesh's periodic reports;
//! the router's own in-flight counts (its [`Tracked`] guards) are kept exactly as in the
//! router. Not built yet: prefill nodes and the KV transfer to decode nodes over
//! [`crate::link`], report lag, multi-turn ordering (`previous_turn`).

use crate::events::EventQueue;
use crate::node::{NodeConfig, NodeError, SimNode};
use kvmesh_bench::arrivals::LoadShape;
use kvmesh_bench::report::Point;
use kvmesh_bench::slo::{RequestOutcome, SloSpec};
use kvmesh_bench::trace::ScaledRequest;
use kvmesh_bench::workload::{Prompt, WorkItem};
use kvmesh_common::{NodeId, NodeInfo, NodeRole, TokenId};
use kvmesh_kvstore::{InMemoryPrefixIndex, NodeEntry};
use kvmesh_router::policy::{DisaggConfig, KvAwareConfig, RoutingConfig};
use kvmesh_router::routing::{Routing, Tracked};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;

/// One request offered to the mesh.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimRequest {
    /// Arrival, from the run's start.
    pub at: Duration,
    pub prompt: Vec<TokenId>,
    pub max_tokens: usize,
}

impl SimRequest {
    /// A request of a scaled Mooncake trace (its prompt is already token ids).
    pub fn from_scaled(r: &ScaledRequest) -> SimRequest {
        SimRequest {
            at: r.at,
            prompt: r.prompt_tokens.clone(),
            max_tokens: r.max_tokens as usize,
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
            }),
            _ => Err(MeshError::TextPrompt),
        }
    }
}

#[derive(Clone, Debug)]
pub struct MeshConfig {
    /// Aggregated nodes, each prefilling and decoding.
    pub nodes: usize,
    pub node: NodeConfig,
    pub routing: RoutingConfig,
    /// Seeds every random choice (the policies' generators where the config names none).
    pub seed: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    #[error("the mesh needs at least one node")]
    NoNodes,
    #[error("text prompts need a tokenizer; give the simulator token-id prompts")]
    TextPrompt,
    #[error("requests must come in arrival order (request {0} is earlier than the one before)")]
    Unordered(usize),
    #[error(transparent)]
    Node(#[from] NodeError),
}

/// One node's totals over a run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NodeSummary {
    pub node: u64,
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
}

/// A run's report: bench's point plus the simulated nodes' totals.
#[derive(Clone, Debug, Serialize)]
pub struct SimReport {
    pub point: Point,
    pub nodes: Vec<NodeSummary>,
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
        }
    }
}

#[derive(Debug)]
enum Event {
    Arrive(usize),
    StepDone(usize),
}

/// A request from arrival to its end.
struct Live {
    node: usize,
    tokens: Vec<Duration>,
    _tracked: Tracked,
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
    nodes: Vec<SimNode>,
    entries: Vec<NodeEntry>,
    routing: Routing,
    index: Arc<InMemoryPrefixIndex>,
    queue: EventQueue<Event>,
    live: Vec<Option<Live>>,
    outcomes: Vec<Option<RequestOutcome>>,
    routed: Vec<u64>,
}

/// Runs `requests` (in arrival order) through the mesh until every one has ended.
pub fn simulate(config: &MeshConfig, requests: &[SimRequest]) -> Result<MeshRun, MeshError> {
    if config.nodes == 0 {
        return Err(MeshError::NoNodes);
    }
    if let Some(i) = (1..requests.len()).find(|&i| requests[i].at < requests[i - 1].at) {
        return Err(MeshError::Unordered(i));
    }
    let mut rng = StdRng::seed_from_u64(config.seed);
    let sched = &config.node.scheduler;
    let index = Arc::new(InMemoryPrefixIndex::new());
    let routing = Routing::new(
        seeded(&config.routing, &mut rng).build(),
        DisaggConfig::default(),
        index.clone(),
        sched.hasher.fingerprint,
    );
    let mut nodes = Vec::with_capacity(config.nodes);
    let mut entries = Vec::with_capacity(config.nodes);
    for i in 0..config.nodes {
        let mut node = SimNode::new(config.node.clone())?;
        node.set_record_kv_events(sched.enable_prefix_caching);
        nodes.push(node);
        entries.push(NodeEntry {
            info: NodeInfo {
                node_id: NodeId(i as u64),
                role: NodeRole::Decode,
                address: format!("sim-{i}"),
                transfer_address: String::new(),
                model_fingerprint: sched.hasher.fingerprint,
                block_size: sched.block_size,
                kv_blocks_total: sched.num_blocks,
            },
            load: Default::default(),
        });
    }
    let mut queue = EventQueue::new();
    for (i, r) in requests.iter().enumerate() {
        queue.push_at(r.at, Event::Arrive(i));
    }
    let mut mesh = Mesh {
        requests,
        nodes,
        entries,
        routing,
        index,
        queue,
        live: (0..requests.len()).map(|_| None).collect(),
        outcomes: vec![None; requests.len()],
        routed: vec![0; config.nodes],
    };
    while let Some((now, event)) = mesh.queue.pop() {
        match event {
            Event::Arrive(i) => mesh.arrive(i, now),
            Event::StepDone(n) => mesh.step_done(n, now)?,
        }
    }
    Ok(mesh.finish())
}

impl Mesh<'_> {
    fn arrive(&mut self, i: usize, now: Duration) {
        let r = &self.requests[i];
        let Some(route) = self.routing.route(&r.prompt, &self.entries, &[]) else {
            unreachable!("every node serves the model");
        };
        let n = route.decode.0 as usize;
        let tracked = self.routing.track_route(route.decode, None);
        match self.nodes[n].submit(i as u64, r.prompt.clone(), r.max_tokens) {
            Ok(()) => {
                self.routed[n] += 1;
                self.live[i] = Some(Live {
                    node: n,
                    tokens: Vec::new(),
                    _tracked: tracked,
                });
                self.kick(n, now);
            }
            // The node refuses it as the real engine would (a 400 from the server).
            Err(e) => self.end_failed(i, now, Some(400), e.to_string()),
        }
    }

    /// Starts a step on `n` if it is idle and has work.
    fn kick(&mut self, n: usize, now: Duration) {
        if let Some(end) = self.nodes[n].start_step(now) {
            self.queue.push_at(end, Event::StepDone(n));
        }
        self.publish(n);
    }

    /// What a real node announces: its KV events to the index, its load to discovery.
    fn publish(&mut self, n: usize) {
        let events = self.nodes[n].drain_kv_events();
        if !events.is_empty() {
            self.index.apply(NodeId(n as u64), &events);
        }
        self.entries[n].load = self.nodes[n].load();
    }

    fn step_done(&mut self, n: usize, now: Duration) -> Result<(), MeshError> {
        let report = self.nodes[n].finish_step()?;
        for (seq, _) in &report.tokens {
            if let Some(live) = self.live[*seq as usize].as_mut() {
                live.tokens.push(now);
            }
        }
        for f in &report.finished {
            let i = f.seq_id as usize;
            let live = self.live[i].take().expect("a finished request was live");
            let sent = self.requests[i].at;
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
            // Dropping `live` ends the router's in-flight count, as the stream's end does.
        }
        self.kick(n, now);
        Ok(())
    }

    fn end_failed(&mut self, i: usize, now: Duration, status: Option<u16>, error: String) {
        self.live[i] = None;
        self.outcomes[i] = Some(RequestOutcome {
            item: i,
            sent: self.requests[i].at,
            ended: now,
            status,
            error: Some(error),
            prompt_tokens: Some(self.requests[i].prompt.len() as u64),
            ..RequestOutcome::default()
        });
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
        }
    }
}
