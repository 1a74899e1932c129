//! Where one request goes: the decode node (by the routing policy over the prompt's cached
//! prefix and the nodes' load) and, when the disaggregation rule says so, a prefill node.
//! Shared by every backend (in-process workers, the multi-process mesh); no I/O: the prefix
//! index and discovery are read from memory.

use crate::policy::{
    overlap_by_tier, pull_holder, should_prefill_remotely, DisaggConfig, RouteRequest,
    RoutingPolicy,
};
use kvmesh_common::{BlockHasher, NodeId, TokenId};
use kvmesh_kvstore::{NodeEntry, PrefixIndex};
use std::collections::HashMap;
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
    hasher: BlockHasher,
    /// Requests this router has on each node: on a decode node until their stream ends, on
    /// a prefill node until their first token (when the prefill is done).
    in_flight: Arc<Mutex<HashMap<NodeId, usize>>>,
}

impl Routing {
    /// `hasher` must hash as the nodes' engines do (same model fingerprint and block size).
    pub fn new(
        policy: Box<dyn RoutingPolicy>,
        disaggregation: DisaggConfig,
        index: Arc<dyn PrefixIndex>,
        hasher: BlockHasher,
    ) -> Self {
        Routing {
            policy,
            disaggregation,
            index,
            hasher,
            in_flight: Arc::default(),
        }
    }

    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// Picks among `decode` and `prefill` (live candidates); `None` when no decode node.
    pub fn route(
        &self,
        prompt: &[TokenId],
        decode: &[NodeEntry],
        prefill: &[NodeEntry],
    ) -> Option<Route> {
        let hashes = self.hasher.sequence_hashes(prompt);
        let overlap = overlap_by_tier(self.index.overlap_tiered(&hashes));
        let in_flight = lock(&self.in_flight);
        let request = |nodes| RouteRequest {
            nodes,
            in_flight: &in_flight,
            prompt_blocks: hashes.len(),
            overlap: &overlap,
        };
        let d = self.policy.select(&request(decode))?;
        let bs = self.hasher.block_size;
        let cached_tokens = request(decode).overlap_of(d).total() * bs;
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

    fn node(id: u64, role: NodeRole) -> NodeEntry {
        NodeEntry {
            info: NodeInfo {
                node_id: NodeId(id),
                role,
                address: String::new(),
                transfer_address: String::new(),
                model_fingerprint: 0,
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
        Routing::new(
            config.build(),
            DisaggConfig::default(),
            index,
            BlockHasher::new(ModelFingerprint(7), 16),
        )
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
        let hashes = BlockHasher::new(ModelFingerprint(7), 16).sequence_hashes(&prompt);
        let stored: Vec<KvEvent> = hashes.iter().map(|h| KvEvent::Stored(*h)).collect();
        index.apply(NodeId(2), &stored);
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
        let hashes = BlockHasher::new(ModelFingerprint(7), 16).sequence_hashes(&prompt);
        let stored: Vec<KvEvent> = hashes.iter().map(|h| KvEvent::Stored(*h)).collect();
        index.apply(NodeId(1), &stored);
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
