//! Each node in turn, blind to load and cache: the baseline the others are measured against.

use super::{RouteRequest, RoutingPolicy};
use kvmesh_common::NodeId;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The next node by position among the candidates. Each role's candidates take their own
/// turns: with one counter, a disaggregated request (a decode turn, then a prefill turn)
/// advanced it by two, and with an even number of decode nodes every request landed on the
/// even half of them. The counter is global to the role, so when the candidate set changes the
/// turn continues from the same count, not the same node.
#[derive(Debug, Default)]
pub struct RoundRobin {
    /// By `NodeRole`: router, prefill, decode.
    next: [AtomicUsize; 3],
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
        let counter = &self.next[request.nodes[0].info.role as usize];
        let turn = counter.fetch_add(1, Ordering::Relaxed);
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

    #[test]
    fn decode_and_prefill_nodes_take_turns_apart() {
        use kvmesh_common::NodeRole;
        let policy = RoundRobin::new();
        let decode = Snapshot::with_loads(&[0, 0], 0);
        let mut prefill = Snapshot::with_loads(&[0, 0], 0);
        for n in &mut prefill.nodes {
            n.info.role = NodeRole::Prefill;
        }
        // A request picks a decode node, then a prefill node: each set is still covered.
        let picks: Vec<(u64, u64)> = (0..4)
            .map(|_| {
                let d = policy.select(&decode.request()).unwrap().0;
                let p = policy.select(&prefill.request()).unwrap().0;
                (d, p)
            })
            .collect();
        assert_eq!(picks, [(1, 1), (2, 2), (1, 1), (2, 2)]);
    }
}
