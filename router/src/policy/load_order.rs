//! The candidates ordered by load, for a router that keeps its candidates between requests
//! and hears of every change to their load: a policy can then find the least-loaded nodes
//! without looking at every node ([`RoutingPolicy::select_ordered`]).
//!
//! [`RoutingPolicy::select_ordered`]: super::RoutingPolicy::select_ordered

use super::RouteRequest;
use kvmesh_common::fast_hash::U64Map;
use kvmesh_common::NodeId;
use kvmesh_kvstore::NodeEntry;
use std::collections::BTreeSet;

/// Positions in [`RouteRequest::nodes`] by load (running + waiting + in flight, as
/// [`RouteRequest::load`] counts it), the least loaded first, equal loads in position order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadOrder {
    by_load: BTreeSet<(usize, usize)>,
    /// Each node's position, by id.
    positions: U64Map<NodeId, usize>,
}

impl LoadOrder {
    /// `nodes` (in their order) with each one's `load`.
    pub fn new(nodes: &[NodeEntry], load: impl Fn(&NodeEntry) -> usize) -> Self {
        LoadOrder {
            by_load: nodes
                .iter()
                .enumerate()
                .map(|(i, n)| (load(n), i))
                .collect(),
            positions: nodes
                .iter()
                .enumerate()
                .map(|(i, n)| (n.info.node_id, i))
                .collect(),
        }
    }

    /// The nodes of `request`, loaded as it counts load.
    pub fn of(request: &RouteRequest<'_>) -> Self {
        Self::new(request.nodes, |n| request.load(n))
    }

    /// The node at `position` went from load `from` to `to`.
    pub fn reload(&mut self, position: usize, from: usize, to: usize) {
        if from != to && self.by_load.remove(&(from, position)) {
            self.by_load.insert((to, position));
        }
    }

    /// Where `node` is among the nodes; `None` if it is not one.
    pub fn position(&self, node: NodeId) -> Option<usize> {
        self.positions.get(&node).copied()
    }

    /// `(load, position)` of every node, the least loaded first.
    pub fn iter(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.by_load.iter().copied()
    }

    pub fn len(&self) -> usize {
        self.by_load.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_load.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::Snapshot;

    #[test]
    fn least_loaded_first_then_by_position() {
        let s = Snapshot::with_loads(&[3, 1, 3, 0], 4);
        let order = LoadOrder::of(&s.request());
        assert_eq!(
            order.iter().collect::<Vec<_>>(),
            [(0, 3), (1, 1), (3, 0), (3, 2)]
        );
        let mut moved = order.clone();
        moved.reload(1, 1, 4);
        assert_eq!(moved.iter().last(), Some((4, 1)));
        assert_eq!(moved.len(), 4);
        assert_eq!(moved.position(NodeId(2)), Some(1));
        assert_eq!(moved.position(NodeId(9)), None);
    }
}
