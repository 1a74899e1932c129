//! Where one request goes: the decode node (by the routing policy over the prompt's cached
//! prefix and the nodes' load) and, when the disaggregation rule says so, a prefill node.
//! Shared by every backend (in-process workers, the multi-process mesh); no I/O: the prefix
//! index and discovery are read from memory.
//!
//! Only nodes serving the router's model (same fingerprint) are candidates, and the prompt
//! is hashed with the KV block size they announce, as their engines hash it. Nodes of one
//! model agree on the block size; should they not, those in the minority are left out too
//! (their KV and prefix hashes cannot be shared with the others).

mod kept;

use crate::policy::{
    prefill_remotely_given, pull_holder, should_prefill_remotely, DisaggConfig, LoadOrder,
    RouteRequest, RoutingPolicy,
};
use kept::{Kept, Loads, Role};
use kvmesh_common::fast_hash::U64Map;
use kvmesh_common::{
    BlockHasher, LoadReport, ModelFingerprint, NodeId, PromptHashes, SequenceHash, TokenId,
};
use kvmesh_kvstore::{NodeEntry, PrefixIndex};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};

/// The decision for one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub decode: NodeId,
    /// Where to prefill; `None`: on the decode node.
    pub prefill: Option<NodeId>,
    /// Leading prompt tokens the decode node holds (by the index).
    pub cached_tokens: usize,
    /// A node holding more of the prompt than the decode node, and how many leading blocks:
    /// the decode node may pull them from there.
    pub pull: Option<(NodeId, usize)>,
}

pub struct Routing {
    policy: Box<dyn RoutingPolicy>,
    disaggregation: DisaggConfig,
    index: Arc<dyn PrefixIndex>,
    /// The model requests are for: nodes with another fingerprint are not candidates.
    model: ModelFingerprint,
    /// Requests this router has on each node: on a decode node until their stream ends, on
    /// a prefill node until their first token (when the prefill is done); and the candidates
    /// a caller keeps here ([`Routing::keep_candidates`]).
    loads: Arc<Mutex<Loads>>,
    /// Nodes already logged as left out (each is logged once).
    left_out: Mutex<HashSet<NodeId>>,
}

impl Routing {
    /// Routes requests for `model` (the fingerprint its nodes announce).
    pub fn new(
        policy: Box<dyn RoutingPolicy>,
        disaggregation: DisaggConfig,
        index: Arc<dyn PrefixIndex>,
        model: ModelFingerprint,
    ) -> Self {
        Routing {
            policy,
            disaggregation,
            index,
            model,
            loads: Arc::default(),
            left_out: Mutex::default(),
        }
    }

    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// Picks among `decode` and `prefill` (live candidates) those serving the model; `None`
    /// when no decode node does.
    pub fn route(
        &self,
        prompt: &[TokenId],
        decode: &[NodeEntry],
        prefill: &[NodeEntry],
    ) -> Option<Route> {
        self.route_hashed(prompt, None, decode, prefill)
    }

    /// [`Routing::route`] for a caller that hashed `prompt` already: `hashed` is used when
    /// its hasher is the one the candidates call for, else the prompt is hashed here.
    pub fn route_hashed(
        &self,
        prompt: &[TokenId],
        hashed: Option<&PromptHashes>,
        decode: &[NodeEntry],
        prefill: &[NodeEntry],
    ) -> Option<Route> {
        let block_size = self.block_size(decode)?;
        let decode = &*self.serving(decode, block_size);
        let prefill = &*self.serving(prefill, block_size);
        let hashes = self.hashes(prompt, hashed, block_size);
        let loads = lock(&self.loads);
        let candidates = Candidates {
            decode,
            prefill,
            in_flight: &loads.in_flight,
            kept: None,
        };
        self.decide(prompt, &hashes, block_size, candidates)
    }

    /// Keeps `decode` and `prefill` (live candidates) here in place of the slices
    /// [`Routing::route`] takes, for a caller that hears of every change to their load (it
    /// calls [`Routing::report`]); [`Routing::route_kept`] then routes among them without
    /// looking at every node, to the node `route` would choose.
    pub fn keep_candidates(&self, decode: Vec<NodeEntry>, prefill: Vec<NodeEntry>) {
        let block_size = self.block_size(&decode);
        let serving = |nodes: Vec<NodeEntry>| match block_size {
            Some(bs) => self.serving(&nodes, bs).into_owned(),
            None => Vec::new(),
        };
        let (decode, prefill) = (serving(decode), serving(prefill));
        let mut loads = lock(&self.loads);
        let kept = Kept {
            block_size,
            decode: Role::new(decode, &loads.in_flight),
            prefill: Role::new(prefill, &loads.in_flight),
        };
        loads.kept = Some(kept);
    }

    /// A kept candidate reports its load ([`Routing::keep_candidates`]).
    pub fn report(&self, node: NodeId, load: LoadReport) {
        lock(&self.loads).report(node, load);
    }

    /// [`Routing::route_hashed`] among the kept candidates; `None` when none is kept, or no
    /// decode node serves the model.
    pub fn route_kept(&self, prompt: &[TokenId], hashed: Option<&PromptHashes>) -> Option<Route> {
        let loads = lock(&self.loads);
        let kept = loads.kept.as_ref()?;
        let block_size = kept.block_size?;
        let hashes = self.hashes(prompt, hashed, block_size);
        let candidates = Candidates {
            decode: &kept.decode.nodes,
            prefill: &kept.prefill.nodes,
            in_flight: &loads.in_flight,
            kept: Some(kept),
        };
        self.decide(prompt, &hashes, block_size, candidates)
    }

    /// The prompt's block hashes as nodes announcing `block_size` hash it: `hashed` when
    /// made so.
    fn hashes<'a>(
        &self,
        prompt: &[TokenId],
        hashed: Option<&'a PromptHashes>,
        block_size: usize,
    ) -> Cow<'a, [SequenceHash]> {
        let hasher = BlockHasher::new(self.model, block_size);
        let hashes: Cow<[_]> = match hashed.and_then(|h| h.made_by(&hasher)) {
            Some(hashes) => hashes.into(),
            None => hasher.sequence_hashes(prompt).into(),
        };
        debug_assert_eq!(
            hashes.len(),
            prompt.len() / block_size,
            "another prompt's hashes"
        );
        hashes
    }

    /// The route of `prompt` (whose block hashes are `hashes`) among `candidates`, all
    /// serving the model with `block_size`.
    fn decide(
        &self,
        prompt: &[TokenId],
        hashes: &[SequenceHash],
        block_size: usize,
        candidates: Candidates<'_>,
    ) -> Option<Route> {
        let Candidates {
            decode,
            prefill,
            in_flight,
            kept,
        } = candidates;
        let overlap = self.index.overlap_tiered(hashes);
        let request = |nodes| RouteRequest {
            nodes,
            in_flight,
            prompt_blocks: hashes.len(),
            overlap: &overlap,
        };
        let select = |nodes, by_load: Option<&LoadOrder>| match by_load {
            Some(by_load) => self.policy.select_ordered(&request(nodes), by_load),
            None => self.policy.select(&request(nodes)),
        };
        let d = select(decode, kept.map(|k| &k.decode.by_load))?;
        let cached_tokens = request(decode).overlap_of(d).total() * block_size;
        let min_pull = self.disaggregation.pull_min_blocks;
        let pull = (min_pull > 0)
            .then(|| pull_holder(decode.iter().chain(prefill), &overlap, d, min_pull))
            .flatten();
        // Planned as if the pull fails: the decode node skips the prefill node when, after
        // the pull, little is left to compute.
        let uncached = prompt.len().saturating_sub(cached_tokens);
        let config = &self.disaggregation;
        let remote = match kept {
            Some(k) => prefill_remotely_given(uncached, k.prefill.least_queue(), config),
            None => should_prefill_remotely(uncached, prefill, in_flight, config),
        };
        let p = if remote {
            select(prefill, kept.map(|k| &k.prefill.by_load))
        } else {
            None
        };
        Some(Route {
            decode: d,
            prefill: p,
            cached_tokens,
            pull,
        })
    }

    /// The block size most decode nodes of the model announce (the smallest on a tie);
    /// `None` when none serves the model.
    fn block_size(&self, decode: &[NodeEntry]) -> Option<usize> {
        // Nodes of one model agree: one pass, nothing counted.
        let first = decode.first()?.info.block_size;
        let serves_first =
            |n: &NodeEntry| n.info.model_fingerprint == self.model && n.info.block_size == first;
        if first > 0 && decode.iter().all(serves_first) {
            return Some(first);
        }
        let mut count = BTreeMap::<usize, usize>::new();
        for n in decode {
            if n.info.model_fingerprint == self.model && n.info.block_size > 0 {
                *count.entry(n.info.block_size).or_default() += 1;
            }
        }
        let most = *count.values().max()?;
        count
            .into_iter()
            .find(|&(_, c)| c == most)
            .map(|(bs, _)| bs)
    }

    /// The nodes of `nodes` that serve the model with `block_size`; the others are logged
    /// (once per node) and left out.
    fn serving<'a>(&self, nodes: &'a [NodeEntry], block_size: usize) -> Cow<'a, [NodeEntry]> {
        let serves = |n: &NodeEntry| {
            n.info.model_fingerprint == self.model && n.info.block_size == block_size
        };
        if nodes.iter().all(serves) {
            return Cow::Borrowed(nodes);
        }
        let mut left_out = lock(&self.left_out);
        for n in nodes.iter().filter(|n| !serves(n)) {
            if left_out.insert(n.info.node_id) {
                tracing::warn!(
                    node = %n.info.node_id,
                    role = n.info.role.as_str(),
                    fingerprint = ?n.info.model_fingerprint,
                    block_size = n.info.block_size,
                    expected_fingerprint = ?self.model,
                    expected_block_size = block_size,
                    "node serves another model or block size; not routing to it"
                );
            }
        }
        Cow::Owned(nodes.iter().filter(|n| serves(n)).cloned().collect())
    }

    /// Counts a request on `node` until the guard is dropped: on its decode node when its
    /// stream ends, on its prefill node at its first token.
    pub fn track(&self, node: NodeId) -> InFlight {
        lock(&self.loads).count(node, true);
        InFlight {
            loads: self.loads.clone(),
            node,
        }
    }

    /// Counts a routed request on its decode node and, when it has one, its prefill node;
    /// see [`Tracked`].
    pub fn track_route(&self, decode: NodeId, prefill: Option<NodeId>) -> Tracked {
        Tracked {
            _decode: self.track(decode),
            prefilling: prefill.map(|p| self.track(p)),
        }
    }
}

/// A request counted on its decode node until dropped (when its stream ends), and on its
/// prefill node until [`Tracked::prefilled`] (its first token: the prefill is done).
pub struct Tracked {
    _decode: InFlight,
    prefilling: Option<InFlight>,
}

impl Tracked {
    /// The first token is out: the request no longer counts on its prefill node.
    pub fn prefilled(&mut self) {
        self.prefilling = None;
    }
}

/// See [`Routing::track`].
pub struct InFlight {
    loads: Arc<Mutex<Loads>>,
    node: NodeId,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        lock(&self.loads).count(self.node, false);
    }
}

/// What [`Routing::decide`] routes among.
struct Candidates<'a> {
    decode: &'a [NodeEntry],
    prefill: &'a [NodeEntry],
    in_flight: &'a U64Map<NodeId, usize>,
    /// The same candidates in load order, when kept in the router.
    kept: Option<&'a Kept>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{KvAwareConfig, RoutingConfig};
    use kvmesh_common::{KvEvent, LoadReport, ModelFingerprint, NodeInfo, NodeRole};
    use kvmesh_kvstore::InMemoryPrefixIndex;

    const MODEL: ModelFingerprint = ModelFingerprint(7);

    fn node(id: u64, role: NodeRole) -> NodeEntry {
        NodeEntry {
            info: NodeInfo {
                node_id: NodeId(id),
                role,
                address: String::new(),
                transfer_address: String::new(),
                model_fingerprint: MODEL,
                block_size: 16,
                kv_blocks_total: 100,
            },
            load: LoadReport::default(),
        }
    }

    fn routing(index: Arc<InMemoryPrefixIndex>) -> Routing {
        let config = RoutingConfig::KvAware(KvAwareConfig {
            seed: Some(1),
            ..KvAwareConfig::default()
        });
        Routing::new(config.build(), DisaggConfig::default(), index, MODEL)
    }

    fn store_prefix(index: &InMemoryPrefixIndex, node: u64, block_size: usize, prompt: &[TokenId]) {
        let hashes = BlockHasher::new(MODEL, block_size).sequence_hashes(prompt);
        let stored: Vec<KvEvent> = hashes.iter().map(|h| KvEvent::Stored(*h)).collect();
        index.apply(NodeId(node), &stored);
    }

    #[test]
    fn a_node_of_another_model_is_never_a_candidate() {
        let index = Arc::new(InMemoryPrefixIndex::new());
        let r = routing(index.clone());
        let prompt: Vec<TokenId> = (0..1000).collect();
        // Node 1 is idle and (by hash) holds the whole prompt, but serves another model.
        let mut foreign = node(1, NodeRole::Decode);
        foreign.info.model_fingerprint = ModelFingerprint(8);
        store_prefix(&index, 1, 16, &prompt);
        let mut busy = node(2, NodeRole::Decode);
        busy.load.running = 50;
        let mut foreign_prefill = node(3, NodeRole::Prefill);
        foreign_prefill.info.model_fingerprint = ModelFingerprint(8);
        let decode = [foreign.clone(), busy];
        let prefill = [foreign_prefill.clone(), node(4, NodeRole::Prefill)];
        for _ in 0..50 {
            let route = r.route(&prompt, &decode, &prefill).unwrap();
            assert_eq!(route.decode, NodeId(2));
            assert_eq!(route.prefill, Some(NodeId(4)));
            assert_eq!(route.cached_tokens, 0);
            assert_eq!(route.pull, None, "no pulls from another model's KV");
        }
        assert_eq!(
            r.route(&prompt, &[foreign], &[foreign_prefill]),
            None,
            "no node serves the model"
        );
    }

    #[test]
    fn prompts_are_hashed_with_the_block_size_the_nodes_announce() {
        let index = Arc::new(InMemoryPrefixIndex::new());
        let r = routing(index.clone());
        let prompt: Vec<TokenId> = (0..1000).collect();
        let with_block_size = |id, bs| {
            let mut n = node(id, NodeRole::Decode);
            n.info.block_size = bs;
            n
        };
        // Node 2 cached the prompt in blocks of 32; node 1 holds 16-token hashes that only a
        // router hashing with the wrong block size would credit.
        store_prefix(&index, 2, 32, &prompt);
        store_prefix(&index, 1, 16, &prompt);
        let decode = [with_block_size(1, 32), with_block_size(2, 32)];
        let route = r.route(&prompt, &decode, &[]).unwrap();
        assert_eq!(route.decode, NodeId(2));
        assert_eq!(route.cached_tokens, 31 * 32);
        // A node announcing another block size than the rest is left out; one announcing 0
        // (nonsense) too, without a panic.
        let decode = [
            with_block_size(1, 16),
            with_block_size(2, 32),
            with_block_size(3, 32),
            with_block_size(4, 0),
        ];
        for _ in 0..20 {
            let d = r.route(&prompt, &decode, &[]).unwrap().decode;
            assert!(d == NodeId(2) || d == NodeId(3), "{d}");
        }
        assert_eq!(r.route(&prompt, &[with_block_size(4, 0)], &[]), None);
    }

    #[test]
    fn a_cached_prefix_draws_the_request_and_stays_local() {
        let index = Arc::new(InMemoryPrefixIndex::new());
        let r = routing(index.clone());
        let prompt: Vec<TokenId> = (0..1000).collect();
        let decode = [node(1, NodeRole::Decode), node(2, NodeRole::Decode)];
        let prefill = [node(3, NodeRole::Prefill)];
        // Nothing cached: a long prompt goes to the prefill node.
        let first = r.route(&prompt, &decode, &prefill).unwrap();
        assert_eq!(first.prefill, Some(NodeId(3)));
        assert_eq!(first.cached_tokens, 0);
        // Node 2 holds the whole prefix: it wins, and only a short tail is left to prefill.
        store_prefix(&index, 2, 16, &prompt);
        let second = r.route(&prompt, &decode, &prefill).unwrap();
        assert_eq!(second.decode, NodeId(2));
        assert_eq!(second.cached_tokens, 992);
        assert_eq!(second.prefill, None);
        assert_eq!(second.pull, None);
    }

    #[test]
    fn a_busy_holder_is_passed_over_and_named_to_pull_from() {
        let index = Arc::new(InMemoryPrefixIndex::new());
        let r = routing(index.clone());
        let prompt: Vec<TokenId> = (0..1000).collect();
        store_prefix(&index, 1, 16, &prompt);
        let mut busy = node(1, NodeRole::Decode);
        busy.load.running = 20;
        let decode = [busy, node(2, NodeRole::Decode)];
        let prefill = [node(3, NodeRole::Prefill)];
        let route = r.route(&prompt, &decode, &prefill).unwrap();
        assert_eq!(
            route.decode,
            NodeId(2),
            "the imbalance guard passes over node 1"
        );
        assert_eq!(route.pull, Some((NodeId(1), 62)));
        // Should the pull fail, the prompt is long: a prefill node stands by.
        assert_eq!((route.cached_tokens, route.prefill), (0, Some(NodeId(3))));
    }

    #[test]
    fn a_burst_spreads_over_the_prefill_nodes_until_they_are_busy() {
        let r = routing(Arc::new(InMemoryPrefixIndex::new()));
        let prompt: Vec<TokenId> = (0..1000).collect();
        let decode = [node(1, NodeRole::Decode)];
        let prefill = [node(2, NodeRole::Prefill), node(3, NodeRole::Prefill)];
        // Their load reports lag: only the router's own count tells the nodes apart.
        let mut prefilling = Vec::new();
        for _ in 0..16 {
            let p = r.route(&prompt, &decode, &prefill).unwrap().prefill;
            prefilling.push(r.track(p.expect("a prefill node is not busy yet")));
        }
        assert_eq!(lock(&r.loads).in_flight[&NodeId(2)], 8);
        assert_eq!(lock(&r.loads).in_flight[&NodeId(3)], 8);
        // Both have the default busy threshold queued: the decode node prefills itself.
        assert_eq!(r.route(&prompt, &decode, &prefill).unwrap().prefill, None);
        prefilling.pop();
        assert!(r
            .route(&prompt, &decode, &prefill)
            .unwrap()
            .prefill
            .is_some());
    }

    proptest::proptest! {
        /// Candidates kept in the router, told of every report, route as the slices do:
        /// the same nodes, draw for draw, while requests come and go and loads change.
        #[test]
        fn kept_candidates_route_as_the_slices_do(
            ops in proptest::collection::vec((0..4u8, 0..12u64, 0..6usize), 1..120),
            prompts in proptest::collection::vec(proptest::collection::vec(0..3u32, 16..600), 1..4),
            seed: u64,
        ) {
            let index = Arc::new(InMemoryPrefixIndex::new());
            for (i, p) in prompts.iter().enumerate() {
                store_prefix(&index, i as u64 * 3 + 1, 16, p);
            }
            let make = || {
                let config = RoutingConfig::KvAware(KvAwareConfig {
                    seed: Some(seed),
                    ..KvAwareConfig::default()
                });
                Routing::new(config.build(), DisaggConfig::default(), index.clone(), MODEL)
            };
            let (sliced, kept) = (make(), make());
            let mut decode: Vec<NodeEntry> = (1..=8).map(|id| node(id, NodeRole::Decode)).collect();
            let mut prefill: Vec<NodeEntry> = (9..=11).map(|id| node(id, NodeRole::Prefill)).collect();
            kept.keep_candidates(decode.clone(), prefill.clone());
            let mut guards = Vec::new();
            for (op, id, n) in ops {
                match op {
                    // A node reports its load.
                    0 | 1 => {
                        let nodes = decode.iter_mut().chain(prefill.iter_mut());
                        if let Some(e) = nodes.into_iter().find(|e| e.info.node_id.0 == id) {
                            e.load.running = n * 3;
                            e.load.waiting = n % 4;
                            kept.report(e.info.node_id, e.load);
                        }
                    }
                    // A request is routed and tracked.
                    2 => {
                        let prompt = &prompts[n % prompts.len()];
                        let route = sliced.route(prompt, &decode, &prefill);
                        proptest::prop_assert_eq!(&route, &kept.route_kept(prompt, None));
                        if let Some(r) = route {
                            guards.push((
                                sliced.track_route(r.decode, r.prefill),
                                kept.track_route(r.decode, r.prefill),
                            ));
                        }
                    }
                    // A request's prefill ends, or it ends.
                    _ if !guards.is_empty() => {
                        let i = id as usize % guards.len();
                        if n % 2 == 0 {
                            guards[i].0.prefilled();
                            guards[i].1.prefilled();
                        } else {
                            guards.swap_remove(i);
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    #[test]
    fn in_flight_requests_count_until_their_guard_drops() {
        let r = routing(Arc::new(InMemoryPrefixIndex::new()));
        let decode = [node(1, NodeRole::Decode), node(2, NodeRole::Decode)];
        let g1 = r.track(NodeId(1));
        let _g2 = r.track(NodeId(1));
        let route = r.route(&[1, 2, 3], &decode, &[]).unwrap();
        assert_eq!(route.decode, NodeId(2));
        drop(g1);
        assert_eq!(lock(&r.loads).in_flight[&NodeId(1)], 1);
    }
}
