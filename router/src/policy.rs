//! Routing policies: pure functions over a snapshot of live nodes, no I/O.
//! (The KV-aware policy and the others of the prefix-reuse issue join this module.)

use kvmesh_common::NodeId;
use kvmesh_kvstore::NodeEntry;
use std::collections::HashMap;

/// The node with the fewest requests (running + waiting), then the lowest KV usage; ties go
/// to the lowest node id so the choice is deterministic.
pub fn least_loaded(nodes: &[NodeEntry]) -> Option<NodeId> {
    least_loaded_with(nodes, &HashMap::new())
}

/// [`least_loaded`], adding to each node's reported requests those this router has in
/// flight there: reports lag by up to a load-report interval, and without this a burst would
/// all go to the node that looked idle when it began.
pub fn least_loaded_with(
    nodes: &[NodeEntry],
    in_flight: &HashMap<NodeId, usize>,
) -> Option<NodeId> {
    nodes
        .iter()
        .min_by_key(|n| {
            let id = n.info.node_id;
            (
                n.load.running + n.load.waiting + in_flight.get(&id).copied().unwrap_or(0),
                n.load.kv_blocks_used,
                id,
            )
        })
        .map(|n| n.info.node_id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_common::{LoadReport, NodeInfo, NodeRole};

    fn node(id: u64, running: usize, waiting: usize, used: usize) -> NodeEntry {
        NodeEntry {
            info: NodeInfo {
                node_id: NodeId(id),
                role: NodeRole::Decode,
                address: "in-process".into(),
                transfer_address: String::new(),
                model_fingerprint: 0,
                kv_blocks_total: 100,
            },
            load: LoadReport {
                running,
                waiting,
                kv_blocks_used: used,
            },
        }
    }

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
        let in_flight = HashMap::from([(NodeId(1), 2)]);
        assert_eq!(least_loaded_with(&nodes, &in_flight), Some(NodeId(2)));
        let in_flight = HashMap::from([(NodeId(1), 1)]);
        assert_eq!(least_loaded_with(&nodes, &in_flight), Some(NodeId(1)));
    }
}
