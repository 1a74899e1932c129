//! KV-aware routing: send a prompt where the most of it is already cached, unless that node
//! is much busier than the others.
//!
//! Each candidate costs
//!
//! ```text
//! cost = prefill_weight * uncached / prompt_blocks + load_weight * (running + waiting + in_flight)
//! uncached = prompt_blocks - min(prompt_blocks, Σ_tier credit(tier) * overlap(tier))
//! ```
//!
//! The prefill term is the share of the prompt still to compute (0 for a full hit, 1 for a
//! miss), so the weights read as "a full hit is worth `prefill_weight / load_weight`
//! requests of queue", whatever the prompt's length. Equal costs are broken at random, so
//! identical nodes share the traffic.
//!
//! The imbalance guard: a node whose load exceeds `min_load * imbalance_ratio +
//! imbalance_slack` is not eligible, however much it holds. Without it a popular prefix (a
//! shared system prompt) held by one node would draw all traffic there while the others
//! never get to cache it. The least-loaded node is always eligible, so when the best cached
//! node is excluded the choice falls back towards least-loaded, still preferring cache
//! among the nodes within bounds.

use super::least_loaded::LeastLoaded;
use super::{lock, rng, KvAwareConfig, RouteRequest, RoutingPolicy, Tier};
use kvmesh_common::NodeId;
use rand::rngs::StdRng;
use rand::Rng;
use std::sync::Mutex;

#[derive(Debug)]
pub struct KvAware {
    config: KvAwareConfig,
    rng: Mutex<StdRng>,
}

impl KvAware {
    pub fn new(config: KvAwareConfig) -> Self {
        KvAware {
            rng: rng(config.seed),
            config,
        }
    }

    /// The prompt's share still to prefill on a node holding `overlap`, in `0.0..=1.0`.
    fn uncached_share(&self, request: &RouteRequest<'_>, node: NodeId) -> f64 {
        if request.prompt_blocks == 0 {
            return 0.0;
        }
        let overlap = request.overlap_of(node);
        let credited: f64 = Tier::ALL
            .iter()
            .map(|&t| self.config.credit(t) * overlap.get(t) as f64)
            .sum();
        let prompt = request.prompt_blocks as f64;
        (prompt - credited.min(prompt)) / prompt
    }
}

impl RoutingPolicy for KvAware {
    fn name(&self) -> &'static str {
        "kv_aware"
    }

    fn select(&self, request: &RouteRequest<'_>) -> Option<NodeId> {
        let c = &self.config;
        let scored: Vec<(usize, f64)> = request
            .nodes
            .iter()
            .map(|n| {
                let load = request.load(n);
                let cost = c.prefill_weight * self.uncached_share(request, n.info.node_id)
                    + c.load_weight * load as f64;
                (load, cost)
            })
            .collect();
        let min_load = scored.iter().map(|&(load, _)| load).min()?;
        let max_load = min_load as f64 * c.imbalance_ratio + c.imbalance_slack as f64;
        let eligible = |&(load, _): &(usize, f64)| load as f64 <= max_load;

        let best = scored
            .iter()
            .filter(|s| eligible(s))
            .map(|&(_, cost)| cost)
            .fold(f64::INFINITY, f64::min);
        // Costs are sums of products; compare with a tolerance so equal nodes tie.
        let tolerance = 1e-9 * best.abs().max(1.0);
        let is_best = |s: &(usize, f64)| eligible(s) && s.1 <= best + tolerance;
        let ties = scored.iter().filter(|s| is_best(s)).count();
        if ties == 0 {
            // Only with weights or a ratio that `validate` rejects (NaN, ratio < 1).
            return LeastLoaded.select(request);
        }
        let pick = if ties == 1 {
            0
        } else {
            lock(&self.rng).gen_range(0..ties)
        };
        let (i, _) = scored
            .iter()
            .enumerate()
            .filter(|(_, s)| is_best(s))
            .nth(pick)?;
        Some(request.nodes[i].info.node_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{snapshots, Snapshot};
    use crate::policy::TieredOverlap;
    use proptest::prelude::*;
    use std::collections::HashSet;

    fn seeded() -> KvAware {
        KvAware::new(KvAwareConfig {
            seed: Some(11),
            ..KvAwareConfig::default()
        })
    }

    fn with_overlap(mut s: Snapshot, overlaps: &[(u64, TieredOverlap)]) -> Snapshot {
        s.overlap = overlaps.iter().map(|&(id, o)| (NodeId(id), o)).collect();
        s
    }

    #[test]
    fn prefers_the_node_holding_the_prompt() {
        let s = with_overlap(
            Snapshot::with_loads(&[2, 2, 2], 64),
            &[
                (2, TieredOverlap::on_device(48)),
                (3, TieredOverlap::on_device(16)),
            ],
        );
        assert_eq!(seeded().select(&s.request()), Some(NodeId(2)));
        assert_eq!(seeded().select(&Snapshot::default().request()), None);
    }

    #[test]
    fn cache_is_worth_a_few_requests_not_any_number() {
        // Default weights: a full hit is worth 10 requests of queue.
        let hit = |loads: &[usize]| {
            let s = with_overlap(
                Snapshot::with_loads(loads, 64),
                &[(1, TieredOverlap::on_device(64))],
            );
            seeded().select(&s.request()).unwrap().0
        };
        assert_eq!(hit(&[3, 0]), 1);
        assert_eq!(hit(&[23, 14]), 1);
        assert_eq!(hit(&[25, 14]), 2);
    }

    #[test]
    fn slower_tiers_earn_less_credit() {
        let s = with_overlap(
            Snapshot::with_loads(&[0, 0, 0], 10),
            &[
                (1, TieredOverlap::default().with(Tier::Disk, 10)),
                (2, TieredOverlap::default().with(Tier::Host, 10)),
                (3, TieredOverlap::on_device(7)),
            ],
        );
        // Device 7 * 1.0 < host 10 * 0.8 = 8; disk 10 * 0.5 = 5.
        assert_eq!(seeded().select(&s.request()), Some(NodeId(2)));
        let policy = KvAware::new(KvAwareConfig {
            host_credit: 0.6,
            ..KvAwareConfig::default()
        });
        assert_eq!(policy.select(&s.request()), Some(NodeId(3)));
    }

    #[test]
    fn guard_keeps_a_shared_prefix_from_drawing_all_traffic() {
        // Without the guard the cached node wins: 1.0 * 0 + 0.1 * 9 < 1.0 + 0.1 * 1.
        let s = with_overlap(
            Snapshot::with_loads(&[9, 1, 2], 64),
            &[
                (1, TieredOverlap::on_device(64)),
                (3, TieredOverlap::on_device(16)),
            ],
        );
        let unguarded = KvAware::new(KvAwareConfig {
            imbalance_slack: 100,
            ..KvAwareConfig::default()
        });
        assert_eq!(unguarded.select(&s.request()), Some(NodeId(1)));
        // Default guard: load <= 1 * 1.5 + 4 = 5.5 excludes node 1; among the rest the
        // partial hit on node 3 still beats the idler node 2.
        assert_eq!(seeded().select(&s.request()), Some(NodeId(3)));
        // In-flight requests count towards the guard too.
        let mut s = s;
        s.in_flight.insert(NodeId(3), 4);
        assert_eq!(seeded().select(&s.request()), Some(NodeId(2)));
    }

    #[test]
    fn ties_are_shared_at_random_and_reproducibly() {
        let s = with_overlap(
            Snapshot::with_loads(&[1, 1, 1, 5], 8),
            &[(4, TieredOverlap::on_device(2))],
        );
        let picks = |seed| {
            let policy = KvAware::new(KvAwareConfig {
                seed: Some(seed),
                ..KvAwareConfig::default()
            });
            (0..60)
                .map(|_| policy.select(&s.request()).unwrap().0)
                .collect::<Vec<_>>()
        };
        let a = picks(5);
        assert_eq!(a, picks(5));
        assert_eq!(a.iter().collect::<HashSet<_>>().len(), 3, "{a:?}");
        assert!(!a.contains(&4));
    }

    proptest! {
        #[test]
        fn chooses_an_eligible_candidate(s in snapshots(), seed: u64) {
            let policy = KvAware::new(KvAwareConfig { seed: Some(seed), ..KvAwareConfig::default() });
            let r = s.request();
            let chosen = policy.select(&r).unwrap();
            let chosen = r.nodes.iter().find(|n| n.info.node_id == chosen).unwrap();
            let min_load = r.nodes.iter().map(|n| r.load(n)).min().unwrap();
            prop_assert!(r.load(chosen) as f64 <= min_load as f64 * 1.5 + 4.0);
        }

        #[test]
        fn without_overlap_it_is_least_loaded(mut s in snapshots(), seed: u64) {
            s.overlap.clear();
            let policy = KvAware::new(KvAwareConfig { seed: Some(seed), ..KvAwareConfig::default() });
            let r = s.request();
            let chosen = policy.select(&r).unwrap();
            let chosen = r.nodes.iter().find(|n| n.info.node_id == chosen).unwrap();
            prop_assert!(r.nodes.iter().all(|n| r.load(n) >= r.load(chosen)));
        }

        #[test]
        fn a_full_hit_loses_only_to_less_load_or_another_full_hit(s in snapshots(), seed: u64) {
            let mut s = s;
            s.overlap.insert(NodeId(1), TieredOverlap::on_device(s.prompt_blocks));
            let policy = KvAware::new(KvAwareConfig { seed: Some(seed), ..KvAwareConfig::default() });
            let r = s.request();
            let chosen = policy.select(&r).unwrap();
            let load1 = r.load(&r.nodes[0]);
            let chosen = r.nodes.iter().find(|n| n.info.node_id == chosen).unwrap();
            let full_hit = policy.uncached_share(&r, chosen.info.node_id) == 0.0;
            prop_assert!(r.load(chosen) < load1 || (r.load(chosen) == load1 && full_hit));
        }
    }
}
