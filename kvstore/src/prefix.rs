//! Which nodes hold which cached prefixes, in which tier.
//!
//! - [`PrefixIndex`] is the read side every router and prefill node needs: "how many leading
//!   blocks of this prompt does each node hold, and where". Reads never touch a remote store.
//! - [`InMemoryPrefixIndex`] is the index itself, written directly in a single-process mesh.
//! - [`KvEventPublisher`] is one node's writer to etcd: events are batched into at most one
//!   log key per `kv_flush_interval`, compacted into a snapshot as the log grows, all under
//!   the node's lease. [`EtcdPrefixIndex`] watches those keys into an in-memory index.
//! - Nodes publish through `kvmesh_common::kv_tier::KvEventSink`: [`InMemoryPrefixIndex`] is
//!   one; a node of the multi-process mesh forwards to its [`KvEventPublisher`].

mod codec;
mod index;
mod journal;
#[cfg(test)]
mod pipeline_tests;
mod publisher;
mod replica;
mod tier;
mod watcher;

pub use index::InMemoryPrefixIndex;
pub use publisher::{KvEventPublisher, PublisherStats};
pub use tier::{Tier, TierSet, TieredKvEvent, TieredOverlap};
pub use watcher::{EtcdPrefixIndex, WatcherStats};

use kvmesh_common::fast_hash::U64Map;
use kvmesh_common::kv_tier::KvEventSink;
use kvmesh_common::{NodeId, SequenceHash};
use tokio::sync::watch;

/// The read side of the prefix index.
pub trait PrefixIndex: Send + Sync {
    /// For each node holding the first of `hashes` (a prompt's chained sequence hashes): how
    /// many leading blocks it holds, each counted in the fastest tier it holds it in.
    /// (A map on a fast hasher: the router looks up every candidate node in it per request.)
    fn overlap_tiered(&self, hashes: &[SequenceHash]) -> U64Map<NodeId, TieredOverlap>;

    /// For each node holding the first of `hashes`: how many leading blocks it holds, in any
    /// tier.
    fn overlap(&self, hashes: &[SequenceHash]) -> U64Map<NodeId, usize> {
        self.overlap_tiered(hashes)
            .into_iter()
            .map(|(node, o)| (node, o.total()))
            .collect()
    }

    /// Number of (block, node) entries: the index's size.
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A generation counter bumped whenever the index changes; await `changed()` on it to
    /// react instead of polling.
    fn subscribe(&self) -> watch::Receiver<u64>;
}

/// The sink of the single-process mesh: every node's events go straight into the shared index.
impl KvEventSink for InMemoryPrefixIndex {
    fn publish(&self, node: NodeId, events: Vec<TieredKvEvent>) {
        self.apply(node, &events);
    }
}
