//! A uniformly random node: spreads load with no shared state, blind to cache.

use super::{lock, rng, RouteRequest, RoutingPolicy};
use kvmesh_common::NodeId;
use rand::rngs::StdRng;
use rand::Rng;
use std::sync::Mutex;

#[derive(Debug)]
pub struct Random {
    rng: Mutex<StdRng>,
}

impl Random {
    /// Seeded for reproducible choices; `None` seeds from the OS.
    pub fn new(seed: Option<u64>) -> Self {
        Random { rng: rng(seed) }
    }
}

impl RoutingPolicy for Random {
    fn name(&self) -> &'static str {
        "random"
    }

    fn select(&self, request: &RouteRequest<'_>) -> Option<NodeId> {
        if request.nodes.is_empty() {
            return None;
        }
        let i = lock(&self.rng).gen_range(0..request.nodes.len());
        Some(request.nodes[i].info.node_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::Snapshot;

    #[test]
    fn same_seed_same_choices_and_every_node_gets_some() {
        let s = Snapshot::with_loads(&[0, 0, 0, 0], 0);
        let picks = |seed| {
            let policy = Random::new(Some(seed));
            (0..400)
                .map(|_| policy.select(&s.request()).unwrap().0)
                .collect::<Vec<_>>()
        };
        let a = picks(7);
        assert_eq!(a, picks(7));
        for id in 1..=4 {
            let n = a.iter().filter(|&&x| x == id).count();
            assert!((60..140).contains(&n), "node {id} got {n} of 400");
        }
        assert_eq!(
            Random::new(None).select(&Snapshot::default().request()),
            None
        );
    }
}
