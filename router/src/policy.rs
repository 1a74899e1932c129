//! Routing policies: pure functions over a snapshot of live nodes, no I/O.
//!
//! The router gathers a [`RouteRequest`] (candidate nodes with their last load report, its
//! own in-flight counts, the prompt's size in blocks and how much of it each node holds by
//! tier) and asks a [`RoutingPolicy`] for a node. Which policy, and its knobs, is a
//! [`RoutingConfig`]; [`RoutingConfig::build`] makes the policy. Policies that need
//! randomness or a counter keep it inside, seeded from the config so tests are reproducible.
//!
//! [`should_prefill_remotely`] is the disaggregation rule and [`pull_holder`] names where a
//! decode node could pull a cached prefix from, pure in the same way.

mod config;
mod disaggregation;
mod kv_aware;
mod least_loaded;
mod load_order;
mod overlap;
mod power_of_two;
mod pull;
mod random;
mod round_robin;
#[cfg(test)]
mod testing;

pub use config::{KvAwareConfig, RoutingConfig, UnknownPolicy};
pub use disaggregation::{prefill_remotely_given, should_prefill_remotely, DisaggConfig};
pub use kv_aware::KvAware;
pub use least_loaded::{least_loaded, least_loaded_with, LeastLoaded};
pub use load_order::LoadOrder;
pub(crate) use load_order::Ranked;
pub use overlap::{overlap_on_device, Tier, TieredOverlap};
pub use power_of_two::PowerOfTwo;
pub use pull::pull_holder;
pub use random::Random;
pub use round_robin::RoundRobin;

use kvmesh_common::fast_hash::U64Map;
use kvmesh_common::NodeId;
use kvmesh_kvstore::NodeEntry;
use rand::rngs::StdRng;
use rand::SeedableRng;
use std::fmt::Debug;
use std::sync::{Mutex, MutexGuard};

/// Picks one node for a request from a snapshot. Implementations do no I/O and never block
/// beyond their own short critical section, so the router calls them inline per request.
pub trait RoutingPolicy: Send + Sync + Debug {
    /// The policy's config name (`kv_aware`, `least_loaded`, ...), e.g. for a metric label.
    fn name(&self) -> &'static str;
    /// One of `request.nodes`, or `None` when there are none.
    fn select(&self, request: &RouteRequest<'_>) -> Option<NodeId>;

    /// [`RoutingPolicy::select`] with the candidates also in load order (`by_load` must
    /// order `request.nodes` by [`RouteRequest::load`]): the same choice, which a policy may
    /// make without looking at every node.
    fn select_ordered(&self, request: &RouteRequest<'_>, by_load: &LoadOrder) -> Option<NodeId> {
        let _ = by_load;
        self.select(request)
    }
}

/// What a policy sees: borrowed from the router's own maps so building it costs nothing.
#[derive(Clone, Copy, Debug)]
pub struct RouteRequest<'a> {
    /// The candidates (already filtered by role, model and exclusions), in node-id order.
    pub nodes: &'a [NodeEntry],
    /// Requests this router has sent to a node that its last load report may not count yet;
    /// reports lag by up to a report interval and a burst would otherwise all go to the node
    /// that looked idle when it began. Missing = 0.
    pub in_flight: &'a U64Map<NodeId, usize>,
    /// The prompt's length in full KV blocks (what the prefix index can know of).
    pub prompt_blocks: usize,
    /// Leading prompt blocks each node holds, by tier. Missing = none.
    pub overlap: &'a U64Map<NodeId, TieredOverlap>,
}

impl RouteRequest<'_> {
    /// Requests ahead of this one on `node`: running + waiting + this router's in flight.
    pub fn load(&self, node: &NodeEntry) -> usize {
        node.load.running
            + node.load.waiting
            + self.in_flight.get(&node.info.node_id).copied().unwrap_or(0)
    }

    /// The prompt blocks `node` holds, by tier.
    pub fn overlap_of(&self, node: NodeId) -> TieredOverlap {
        self.overlap.get(&node).copied().unwrap_or_default()
    }
}

/// A generator from `seed`, or from the OS when there is none (production: routers started
/// together must not make the same "random" choices).
fn rng(seed: Option<u64>) -> Mutex<StdRng> {
    Mutex::new(seed.map_or_else(StdRng::from_entropy, StdRng::seed_from_u64))
}

/// A poisoned lock only means another selection panicked; the generator is still usable.
fn lock(rng: &Mutex<StdRng>) -> MutexGuard<'_, StdRng> {
    rng.lock().unwrap_or_else(|e| e.into_inner())
}
