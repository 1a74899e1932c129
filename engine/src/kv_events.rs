//! Where a worker announces its prefix-cache changes: the cluster's prefix index (in memory
//! for `kvmesh serve`, etcd for the multi-process mesh) mirrors every worker's pool from them.

use kvmesh_common::kv_tier::TieredKvEvent;
use kvmesh_common::NodeId;
use std::sync::Arc;

/// Called on the worker's thread after each step with the events of that step; it must not
/// block (hand the events to a queue or apply them to an in-memory index).
#[derive(Clone)]
pub struct KvEventSink(Arc<dyn Fn(NodeId, Vec<TieredKvEvent>) + Send + Sync>);

impl KvEventSink {
    pub fn new(f: impl Fn(NodeId, Vec<TieredKvEvent>) + Send + Sync + 'static) -> Self {
        KvEventSink(Arc::new(f))
    }

    pub fn send(&self, node: NodeId, events: Vec<TieredKvEvent>) {
        (self.0)(node, events)
    }
}

impl std::fmt::Debug for KvEventSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KvEventSink")
    }
}

/// Two sinks are equal when they are the same sink.
impl PartialEq for KvEventSink {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for KvEventSink {}
