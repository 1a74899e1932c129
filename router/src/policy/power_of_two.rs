//! Power of two choices: sample two nodes, keep the less loaded. Nearly as even as
//! least-loaded, but two routers acting on the same stale reports do not all pick the same
//! node.

use super::least_loaded::load_key;
use super::{lock, rng, RouteRequest, RoutingPolicy};
use kvmesh_common::NodeId;
use rand::rngs::StdRng;
use rand::Rng;
use std::sync::Mutex;

#[derive(Debug)]
pub struct PowerOfTwo {
    rng: Mutex<StdRng>,
}

impl PowerOfTwo {
    /// Seeded for reproducible choices; `None` seeds from the OS.
    pub fn new(seed: Option<u64>) -> Self {
        PowerOfTwo { rng: rng(seed) }
    }
}

impl RoutingPolicy for PowerOfTwo {
    fn name(&self) -> &'static str {
        "power_of_two"
    }

    fn select(&self, request: &RouteRequest<'_>) -> Option<NodeId> {
        let nodes = request.nodes;
        if nodes.len() < 2 {
            return nodes.first().map(|n| n.info.node_id);
        }
        // Two distinct positions: draw the second from the n - 1 others.
        let (a, mut b) = {
            let mut rng = lock(&self.rng);
            (
                rng.gen_range(0..nodes.len()),
                rng.gen_range(0..nodes.len() - 1),
            )
        };
        if b >= a {
            b += 1;
        }
        let (a, b) = (&nodes[a], &nodes[b]);
        let chosen = if load_key(request, b) < load_key(request, a) {
            b
        } else {
            a
        };
        Some(chosen.info.node_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{snapshots, Snapshot};
    use proptest::prelude::*;

    #[test]
    fn two_nodes_always_the_less_loaded() {
        let policy = PowerOfTwo::new(Some(1));
        assert_eq!(policy.select(&Snapshot::default().request()), None);
        let one = Snapshot::with_loads(&[5], 0);
        assert_eq!(policy.select(&one.request()), Some(NodeId(1)));
        let two = Snapshot::with_loads(&[5, 2], 0);
        for _ in 0..50 {
            assert_eq!(policy.select(&two.request()), Some(NodeId(2)));
        }
    }

    #[test]
    fn the_most_loaded_node_is_never_chosen() {
        let policy = PowerOfTwo::new(Some(3));
        let s = Snapshot::with_loads(&[1, 9, 2, 3], 0);
        let picks: Vec<u64> = (0..300)
            .map(|_| policy.select(&s.request()).unwrap().0)
            .collect();
        assert!(!picks.contains(&2));
        // The least loaded wins every draw it is in: 3 of the 6 pairs.
        let n = picks.iter().filter(|&&x| x == 1).count();
        assert!((110..190).contains(&n), "node 1 got {n} of 300");
    }

    proptest! {
        #[test]
        fn chooses_a_candidate_beating_at_least_one_other(s in snapshots(), seed: u64) {
            let r = s.request();
            let chosen = PowerOfTwo::new(Some(seed)).select(&r).unwrap();
            let chosen = r.nodes.iter().find(|n| n.info.node_id == chosen).unwrap();
            let worse = r.nodes.iter().filter(|n| load_key(&r, n) >= load_key(&r, chosen)).count();
            // Itself and the other sampled node.
            prop_assert!(worse >= r.nodes.len().min(2));
        }
    }
}
