//! Each node in turn, blind to load and cache: the baseline the others are measured against.

use super::{RouteRequest, RoutingPolicy};
use kvmesh_common::NodeId;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The next node by position among the candidates. The counter is global to the policy, so
/// when the candidate set changes the turn continues from the same count, not the same node.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl RoundRobin {
    pub fn new() -> Self {
        Self::default()
    }
}

impl RoutingPolicy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn select(&self, request: &RouteRequest<'_>) -> Option<NodeId> {
        if request.nodes.is_empty() {
            return None;
        }
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        Some(request.nodes[turn % request.nodes.len()].info.node_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::Snapshot;

    #[test]
    fn takes_turns_ignoring_load() {
        let policy = RoundRobin::new();
        assert_eq!(policy.select(&Snapshot::default().request()), None);
        let s = Snapshot::with_loads(&[9, 0, 5], 0);
        let picks: Vec<u64> = (0..6)
            .map(|_| policy.select(&s.request()).unwrap().0)
            .collect();
        assert_eq!(picks, [1, 2, 3, 1, 2, 3]);
    }
}
