//! Who is alive, in which role, under which load.
//!
//! [`Discovery`] is the read side every consumer (router, decode, planner) needs: a snapshot
//! by role and a change signal. Writing is per implementation, because a registration means
//! different things: an entry in a map for [`InMemoryDiscovery`], a lease kept alive by a
//! background task for [`crate::EtcdDiscovery`].

use crate::StoreError;
use kvmesh_common::{LoadReport, NodeId, NodeInfo, NodeRole};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::RwLock;
use tokio::sync::watch;

/// One live node and its last load report (also the JSON value stored in etcd).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeEntry {
    pub info: NodeInfo,
    pub load: LoadReport,
}

/// The read side of the node registry. Reads never touch a remote store.
pub trait Discovery: Send + Sync {
    /// Live nodes of `role`, in node-id order.
    fn nodes(&self, role: NodeRole) -> Vec<NodeEntry>;
    /// A generation counter bumped on every membership or load change; await
    /// `changed()` on it to react instead of polling `nodes`.
    fn subscribe(&self) -> watch::Receiver<u64>;
}

/// Discovery for one process: registration is an entry in a map.
#[derive(Debug)]
pub struct InMemoryDiscovery {
    nodes: RwLock<BTreeMap<NodeId, NodeEntry>>,
    generation: watch::Sender<u64>,
}

impl Default for InMemoryDiscovery {
    fn default() -> Self {
        InMemoryDiscovery {
            nodes: RwLock::default(),
            generation: watch::Sender::new(0),
        }
    }
}

impl InMemoryDiscovery {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn register(&self, info: NodeInfo) -> Result<(), StoreError> {
        let mut nodes = self.nodes.write().expect("discovery lock");
        if nodes.contains_key(&info.node_id) {
            return Err(StoreError::AlreadyRegistered(info.node_id));
        }
        let entry = NodeEntry {
            info,
            load: LoadReport::default(),
        };
        nodes.insert(entry.info.node_id, entry);
        self.bump();
        Ok(())
    }

    pub fn deregister(&self, node: NodeId) -> Result<(), StoreError> {
        let mut nodes = self.nodes.write().expect("discovery lock");
        nodes.remove(&node).ok_or(StoreError::NotRegistered(node))?;
        self.bump();
        Ok(())
    }

    pub fn report_load(&self, node: NodeId, load: LoadReport) -> Result<(), StoreError> {
        let mut nodes = self.nodes.write().expect("discovery lock");
        let entry = nodes
            .get_mut(&node)
            .ok_or(StoreError::NotRegistered(node))?;
        if entry.load != load {
            entry.load = load;
            self.bump();
        }
        Ok(())
    }

    fn bump(&self) {
        self.generation.send_modify(|g| *g += 1);
    }
}

impl Discovery for InMemoryDiscovery {
    fn nodes(&self, role: NodeRole) -> Vec<NodeEntry> {
        let nodes = self.nodes.read().expect("discovery lock");
        nodes
            .values()
            .filter(|e| e.info.role == role)
            .cloned()
            .collect()
    }

    fn subscribe(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
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
            model_fingerprint: kvmesh_common::ModelFingerprint(1),
            block_size: 16,
            kv_blocks_total: 100,
        }
    }

    #[test]
    fn nodes_come_and_go_by_role() {
        let d = InMemoryDiscovery::new();
        let mut changes = d.subscribe();
        d.register(info(1, NodeRole::Decode)).unwrap();
        assert!(changes.has_changed().unwrap());
        changes.mark_unchanged();
        d.register(info(2, NodeRole::Prefill)).unwrap();
        assert_eq!(
            d.register(info(1, NodeRole::Decode)),
            Err(StoreError::AlreadyRegistered(NodeId(1)))
        );
        assert_eq!(d.nodes(NodeRole::Decode).len(), 1);
        let load = LoadReport {
            running: 3,
            waiting: 1,
            kv_blocks_used: 10,
            queued_prompt_tokens: 300,
            ..LoadReport::default()
        };
        d.report_load(NodeId(1), load).unwrap();
        assert!(changes.has_changed().unwrap());
        changes.mark_unchanged();
        d.report_load(NodeId(1), load).unwrap();
        assert!(
            !changes.has_changed().unwrap(),
            "an unchanged report is no change"
        );
        assert_eq!(d.nodes(NodeRole::Decode)[0].load, load);
        d.deregister(NodeId(1)).unwrap();
        assert!(d.nodes(NodeRole::Decode).is_empty());
        assert_eq!(
            d.report_load(NodeId(1), load),
            Err(StoreError::NotRegistered(NodeId(1)))
        );
    }
}
