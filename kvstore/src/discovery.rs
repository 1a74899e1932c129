//! Who is alive, in which role, under which load.

use kvmesh_common::{LoadReport, NodeId, NodeInfo, NodeRole};
use std::collections::BTreeMap;
use std::sync::RwLock;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DiscoveryError {
    #[error("node {0} is already registered")]
    AlreadyRegistered(NodeId),
    #[error("node {0} is not registered")]
    NotRegistered(NodeId),
}

/// One live node and its last load report.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeEntry {
    pub info: NodeInfo,
    pub load: LoadReport,
}

/// The node registry. A node's registration is its lease: deregistering (or, in etcd, the
/// lease expiring) removes it and everything it published.
pub trait Discovery: Send + Sync {
    fn register(&self, info: NodeInfo) -> Result<(), DiscoveryError>;
    fn deregister(&self, node: NodeId) -> Result<(), DiscoveryError>;
    fn report_load(&self, node: NodeId, load: LoadReport) -> Result<(), DiscoveryError>;
    /// Live nodes of `role`, in node-id order.
    fn nodes(&self, role: NodeRole) -> Vec<NodeEntry>;
}

/// Discovery for one process.
#[derive(Debug, Default)]
pub struct InMemoryDiscovery {
    nodes: RwLock<BTreeMap<NodeId, NodeEntry>>,
}

impl InMemoryDiscovery {
    pub fn new() -> Self {
        Self::default()
    }
}

impl Discovery for InMemoryDiscovery {
    fn register(&self, info: NodeInfo) -> Result<(), DiscoveryError> {
        let mut nodes = self.nodes.write().expect("discovery lock");
        if nodes.contains_key(&info.node_id) {
            return Err(DiscoveryError::AlreadyRegistered(info.node_id));
        }
        let entry = NodeEntry {
            info,
            load: LoadReport::default(),
        };
        nodes.insert(entry.info.node_id, entry);
        Ok(())
    }

    fn deregister(&self, node: NodeId) -> Result<(), DiscoveryError> {
        let mut nodes = self.nodes.write().expect("discovery lock");
        nodes
            .remove(&node)
            .map(|_| ())
            .ok_or(DiscoveryError::NotRegistered(node))
    }

    fn report_load(&self, node: NodeId, load: LoadReport) -> Result<(), DiscoveryError> {
        let mut nodes = self.nodes.write().expect("discovery lock");
        let entry = nodes
            .get_mut(&node)
            .ok_or(DiscoveryError::NotRegistered(node))?;
        entry.load = load;
        Ok(())
    }

    fn nodes(&self, role: NodeRole) -> Vec<NodeEntry> {
        let nodes = self.nodes.read().expect("discovery lock");
        nodes
            .values()
            .filter(|e| e.info.role == role)
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(id: u64, role: NodeRole) -> NodeInfo {
        NodeInfo {
            node_id: NodeId(id),
            role,
            address: "in-process".into(),
            transfer_address: String::new(),
            model_fingerprint: 1,
            kv_blocks_total: 100,
        }
    }

    #[test]
    fn nodes_come_and_go_by_role() {
        let d = InMemoryDiscovery::new();
        d.register(info(1, NodeRole::Decode)).unwrap();
        d.register(info(2, NodeRole::Prefill)).unwrap();
        assert_eq!(
            d.register(info(1, NodeRole::Decode)),
            Err(DiscoveryError::AlreadyRegistered(NodeId(1)))
        );
        assert_eq!(d.nodes(NodeRole::Decode).len(), 1);
        let load = LoadReport {
            running: 3,
            waiting: 1,
            kv_blocks_used: 10,
        };
        d.report_load(NodeId(1), load).unwrap();
        assert_eq!(d.nodes(NodeRole::Decode)[0].load, load);
        d.deregister(NodeId(1)).unwrap();
        assert!(d.nodes(NodeRole::Decode).is_empty());
        assert_eq!(
            d.report_load(NodeId(1), load),
            Err(DiscoveryError::NotRegistered(NodeId(1)))
        );
    }
}
