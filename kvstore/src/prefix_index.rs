//! Which nodes hold which cached prefixes, answered as "how many leading blocks of this
//! prompt does each node hold".

use kvmesh_common::{KvEvent, NodeId, SequenceHash};
use std::collections::{HashMap, HashSet};
use std::sync::RwLock;

pub trait PrefixIndex: Send + Sync {
    /// Applies a node's batch of stored/removed events, in order.
    fn apply(&self, node: NodeId, events: &[KvEvent]);
    /// Forgets everything a node published (it left or its lease expired).
    fn remove_node(&self, node: NodeId);
    /// For each node holding at least the first block: how many leading blocks of
    /// `hashes` (a prompt's chained sequence hashes) it holds.
    fn overlap(&self, hashes: &[SequenceHash]) -> HashMap<NodeId, usize>;
    /// Number of (block, node) entries: the index's size.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A hash map from sequence hash to holders. Chained hashes make a prefix lookup a walk from
/// the first block that stops when no node holds the next one.
#[derive(Debug, Default)]
pub struct InMemoryPrefixIndex {
    holders: RwLock<HashMap<SequenceHash, HashSet<NodeId>>>,
}

impl InMemoryPrefixIndex {
    pub fn new() -> Self {
        Self::default()
    }
}

impl PrefixIndex for InMemoryPrefixIndex {
    fn apply(&self, node: NodeId, events: &[KvEvent]) {
        let mut holders = self.holders.write().expect("prefix index lock");
        for event in events {
            match *event {
                KvEvent::Stored(h) => {
                    holders.entry(h).or_default().insert(node);
                }
                KvEvent::Removed(h) => {
                    if let Some(set) = holders.get_mut(&h) {
                        set.remove(&node);
                        if set.is_empty() {
                            holders.remove(&h);
                        }
                    }
                }
            }
        }
    }

    fn remove_node(&self, node: NodeId) {
        let mut holders = self.holders.write().expect("prefix index lock");
        holders.retain(|_, set| {
            set.remove(&node);
            !set.is_empty()
        });
    }

    fn overlap(&self, hashes: &[SequenceHash]) -> HashMap<NodeId, usize> {
        let holders = self.holders.read().expect("prefix index lock");
        let mut result: HashMap<NodeId, usize> = HashMap::new();
        let Some(first) = hashes.first().and_then(|h| holders.get(h)) else {
            return result;
        };
        let mut alive: HashSet<NodeId> = first.clone();
        for (i, h) in hashes.iter().enumerate() {
            let Some(set) = holders.get(h) else { break };
            alive.retain(|n| set.contains(n));
            if alive.is_empty() {
                break;
            }
            for &n in &alive {
                result.insert(n, i + 1);
            }
        }
        result
    }

    fn len(&self) -> usize {
        let holders = self.holders.read().expect("prefix index lock");
        holders.values().map(HashSet::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u64) -> SequenceHash {
        SequenceHash(i)
    }

    #[test]
    fn overlap_counts_leading_blocks_per_node() {
        let idx = InMemoryPrefixIndex::new();
        idx.apply(
            NodeId(1),
            &[
                KvEvent::Stored(h(1)),
                KvEvent::Stored(h(2)),
                KvEvent::Stored(h(3)),
            ],
        );
        idx.apply(NodeId(2), &[KvEvent::Stored(h(1)), KvEvent::Stored(h(3))]);
        let o = idx.overlap(&[h(1), h(2), h(3), h(4)]);
        assert_eq!(o[&NodeId(1)], 3);
        // Node 2 lacks block 2, so block 3 cannot be a prefix hit there.
        assert_eq!(o[&NodeId(2)], 1);
        assert_eq!(idx.len(), 5);
    }

    #[test]
    fn removal_and_node_loss_forget_entries() {
        let idx = InMemoryPrefixIndex::new();
        idx.apply(NodeId(1), &[KvEvent::Stored(h(1)), KvEvent::Stored(h(2))]);
        idx.apply(NodeId(1), &[KvEvent::Removed(h(2))]);
        assert_eq!(idx.overlap(&[h(1), h(2)])[&NodeId(1)], 1);
        idx.remove_node(NodeId(1));
        assert!(idx.overlap(&[h(1)]).is_empty());
        assert!(idx.is_empty());
    }
}
