//! The router's in-flight counts and, for a caller that keeps its candidates in the router
//! ([`super::Routing::keep_candidates`]), those candidates in load order: every change to a
//! node's load (its report, a request tracked or let go) moves it in the order at once, so a
//! request is routed without looking at every node.

use crate::policy::{LoadOrder, Ranked};
use kvmesh_common::fast_hash::U64Map;
use kvmesh_common::{LoadReport, NodeId};
use kvmesh_kvstore::NodeEntry;

/// Behind the router's one lock: the in-flight guards update it as they drop.
#[derive(Debug, Default)]
pub(super) struct Loads {
    /// Requests this router has on each node (see [`super::Routing::track`]). Missing = 0.
    pub(super) in_flight: U64Map<NodeId, usize>,
    pub(super) kept: Option<Kept>,
}

/// The candidates a caller keeps in the router, already filtered to those serving the model.
#[derive(Debug)]
pub(super) struct Kept {
    /// The block size the decode nodes announce; `None` when no decode node serves the model.
    pub(super) block_size: Option<usize>,
    pub(super) decode: Role,
    pub(super) prefill: Role,
}

/// One role's kept candidates.
#[derive(Debug)]
pub(super) struct Role {
    pub(super) nodes: Vec<NodeEntry>,
    /// By running + waiting + in flight: what the policies weigh.
    pub(super) by_load: LoadOrder,
    /// `(waiting + in flight, position)`, the least first: what the disaggregation rule
    /// calls a prefill node's queue.
    by_queue: Ranked,
}

impl Role {
    pub(super) fn new(nodes: Vec<NodeEntry>, in_flight: &U64Map<NodeId, usize>) -> Role {
        let by_load = LoadOrder::new(&nodes, |n| load(n, in_flight));
        let by_queue = Ranked::new(nodes.iter().map(|n| queue(n, in_flight)));
        Role {
            nodes,
            by_load,
            by_queue,
        }
    }

    /// The shortest queue among the nodes; `None` when there are none.
    pub(super) fn least_queue(&self) -> Option<usize> {
        self.by_queue.least()
    }

    /// Node `i`'s entry changes by `change`, its in-flight count being `in_flight`'s.
    fn update(
        &mut self,
        i: usize,
        in_flight: &U64Map<NodeId, usize>,
        change: impl FnOnce(&mut NodeEntry),
    ) {
        let n = &mut self.nodes[i];
        let queue_was = queue(n, in_flight);
        change(n);
        self.moved(i, queue_was, in_flight);
    }

    fn moved(&mut self, i: usize, queue_was: usize, in_flight: &U64Map<NodeId, usize>) {
        let n = &self.nodes[i];
        self.by_load.reload(i, load(n, in_flight));
        let queue_now = queue(n, in_flight);
        self.by_queue.rerank(i, queue_was, queue_now);
    }
}

impl Loads {
    /// One more (`up`) or one fewer request in flight on `node`.
    pub(super) fn count(&mut self, node: NodeId, up: bool) {
        let was = self.in_flight.get(&node).copied().unwrap_or(0);
        let now = if up { was + 1 } else { was.saturating_sub(1) };
        match now {
            0 => self.in_flight.remove(&node),
            n => self.in_flight.insert(node, n),
        };
        let Some(kept) = self.kept.as_mut() else {
            return;
        };
        for role in [&mut kept.decode, &mut kept.prefill] {
            if let Some(i) = role.by_load.position(node) {
                let reported = role.nodes[i].load;
                role.moved(i, reported.waiting + was, &self.in_flight);
            }
        }
    }

    /// A kept node reports `load`; nothing for a node not kept.
    pub(super) fn report(&mut self, node: NodeId, load: LoadReport) {
        let Some(kept) = self.kept.as_mut() else {
            return;
        };
        for role in [&mut kept.decode, &mut kept.prefill] {
            if let Some(i) = role.by_load.position(node) {
                role.update(i, &self.in_flight, |n| n.load = load);
            }
        }
    }
}

/// What the policies weigh: running + waiting + in flight (as `RouteRequest::load`).
fn load(n: &NodeEntry, in_flight: &U64Map<NodeId, usize>) -> usize {
    n.load.running + n.load.waiting + in_flight.get(&n.info.node_id).copied().unwrap_or(0)
}

/// A prefill node's queue as the disaggregation rule counts it: waiting + in flight.
fn queue(n: &NodeEntry, in_flight: &U64Map<NodeId, usize>) -> usize {
    n.load.waiting + in_flight.get(&n.info.node_id).copied().unwrap_or(0)
}
