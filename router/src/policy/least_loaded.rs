//! The node with the fewest requests ahead: no cache awareness, deterministic.

use super::{RouteRequest, RoutingPolicy};
use kvmesh_common::fast_hash::U64Map;
use kvmesh_common::NodeId;
use kvmesh_kvstore::NodeEntry;

/// Fewest requests (running + waiting + in flight), then lowest KV usage, then lowest node
/// id, so the choice is deterministic.
#[derive(Clone, Copy, Debug, Default)]
pub struct LeastLoaded;

impl RoutingPolicy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least_loaded"
    }

    fn select(&self, request: &RouteRequest<'_>) -> Option<NodeId> {
        request
            .nodes
            .iter()
            .min_by_key(|n| load_key(request, n))
            .map(|n| n.info.node_id)
    }
}

/// The order "less loaded first" used wherever two nodes are compared by load.
pub(super) fn load_key(request: &RouteRequest<'_>, node: &NodeEntry) -> (usize, usize, NodeId) {
    (
        request.load(node),
        node.load.kv_blocks_used,
        node.info.node_id,
    )
}

/// [`LeastLoaded`] on reported load alone.
pub fn least_loaded(nodes: &[NodeEntry]) -> Option<NodeId> {
    least_loaded_with(nodes, &U64Map::default())
}

/// [`LeastLoaded`], adding to each node's reported requests those this router has in
/// flight there.
pub fn least_loaded_with(nodes: &[NodeEntry], in_flight: &U64Map<NodeId, usize>) -> Option<NodeId> {
    LeastLoaded.select(&RouteRequest {
        nodes,
        in_flight,
        prompt_blocks: 0,
        overlap: &U64Map::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{node, snapshots};
    use proptest::prelude::*;

    #[test]
    fn picks_fewest_requests_then_least_kv() {
        assert_eq!(least_loaded(&[]), None);
        let nodes = [node(1, 3, 0, 10), node(2, 1, 1, 50), node(3, 2, 0, 5)];
        assert_eq!(least_loaded(&nodes), Some(NodeId(3)));
        let nodes = [node(1, 2, 0, 10), node(2, 2, 0, 50)];
        assert_eq!(least_loaded(&nodes), Some(NodeId(1)));
        let nodes = [node(5, 0, 0, 0), node(4, 0, 0, 0)];
        assert_eq!(least_loaded(&nodes), Some(NodeId(4)));
    }

    #[test]
    fn requests_in_flight_count_until_reports_catch_up() {
        let nodes = [node(1, 0, 0, 0), node(2, 1, 0, 0)];
        let in_flight = U64Map::from_iter([(NodeId(1), 2)]);
        assert_eq!(least_loaded_with(&nodes, &in_flight), Some(NodeId(2)));
        let in_flight = U64Map::from_iter([(NodeId(1), 1)]);
        assert_eq!(least_loaded_with(&nodes, &in_flight), Some(NodeId(1)));
    }

    proptest! {
        #[test]
        fn no_candidate_has_fewer_requests(s in snapshots()) {
            let r = s.request();
            let chosen = LeastLoaded.select(&r).unwrap();
            let chosen = r.nodes.iter().find(|n| n.info.node_id == chosen).unwrap();
            prop_assert!(r.nodes.iter().all(|n| r.load(n) >= r.load(chosen)));
        }
    }
}
