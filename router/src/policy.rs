//! Routing policies: pure functions over a snapshot of live nodes, no I/O.
//! (The KV-aware policy and the others of the prefix-reuse issue join this module.)

use kvmesh_common::NodeId;
use kvmesh_kvstore::NodeEntry;

/// The node with the fewest requests (running + waiting), then the lowest KV usage; ties go
/// to the lowest node id so the choice is deterministic.
pub fn least_loaded(nodes: &[NodeEntry]) -> Option<NodeId> {
    nodes
        .iter()
        .min_by_key(|n| {
            (
                n.load.running + n.load.waiting,
                n.load.kv_blocks_used,
                n.info.node_id,
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
}
