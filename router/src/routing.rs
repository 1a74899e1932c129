//! Where one request goes: the decode node (by the routing policy over the prompt's cached
//! prefix and the nodes' load) and, when the disaggregation rule says so, a prefill node.
//! Shared by every backend (in-process workers, the multi-process mesh); no I/O: the prefix
//! index and discovery are read from memory.
//!
//! Only nodes serving the router's model (same fingerprint) are candidates, and the prompt
//! is hashed with the KV block size they announce, as their engines hash it. Nodes of one
//! model agree on the block size; should they not, those in the minority are left out too
//! (their KV and prefix hashes cannot be shared with the others).

use crate::policy::{
    pull_holder, should_prefill_remotely, DisaggConfig, RouteRequest, RoutingPolicy,
};
use kvmesh_common::{BlockHasher, ModelFingerprint, NodeId, TokenId};
use kvmesh_kvstore::{NodeEntry, PrefixIndex};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
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
    /// a prefill node until their first token (when the prefill is done).
    in_flight: Arc<Mutex<HashMap<NodeId, usize>>>,
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
            in_flight: Arc::default(),
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
        let block_size = self.block_size(decode)?;
        let decode = &*self.serving(decode, block_size);
        let prefill = &*self.serving(prefill, block_size);
        let hasher = BlockHasher::new(self.model, block_size);
        let hashes = hasher.sequence_hashes(prompt);
        let overlap = self.index.overlap_tiered(&hashes);
        let in_flight = lock(&self.in_flight);
        let request = |nodes| RouteRequest {
            nodes,
            in_flight: &in_flight,
            prompt_blocks: hashes.len(),
            overlap: &overlap,
        };
        let d = self.policy.select(&request(decode))?;
        let cached_tokens = request(decode).overlap_of(d).total() * block_size;
        let min_pull = self.disaggregation.pull_min_blocks;
        let pull = (min_pull > 0)
            .then(|| pull_holder(decode.iter().chain(prefill), &overlap, d, min_pull))
            .flatten();
        // Planned as if the pull fails: the decode node skips the prefill node when, after
        // the pull, little is left to compute.
        let uncached = prompt.len().saturating_sub(cached_tokens);
        let remote = should_prefill_remotely(uncached, prefill, &in_flight, &self.disaggregation);
        let p = if remote {
            self.policy.select(&request(prefill))
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
        *lock(&self.in_flight).entry(node).or_default() += 1;
        InFlight {
            counts: self.in_flight.clone(),
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
    counts: Arc<Mutex<HashMap<NodeId, usize>>>,
    node: NodeId,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut c = lock(&self.counts);
        if let Some(v) = c.get_mut(&self.node) {
            *v -= 1;
            if *v == 0 {
                c.remove(&self.node);
            }
        }
    }
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
        assert_eq!(lock(&r.in_flight)[&NodeId(2)], 8);
        assert_eq!(lock(&r.in_flight)[&NodeId(3)], 8);
        // Both have the default busy threshold queued: the decode node prefills itself.
        assert_eq!(r.route(&prompt, &decode, &prefill).unwrap().prefill, None);
        prefilling.pop();
        assert!(r
            .route(&prompt, &decode, &prefill)
            .unwrap()
            .prefill
            .is_some());
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
        assert_eq!(lock(&r.in_flight)[&NodeId(1)], 1);
    }
}
