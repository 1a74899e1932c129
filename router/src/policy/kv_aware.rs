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
//!
//! Given the candidates in load order ([`RoutingPolicy::select_ordered`]), only the nodes the
//! prefix index names are scored one by one: every other node costs the prefill of the whole
//! prompt plus its load, so the least loaded of them is the best of them, and the nodes tied
//! with the best are a run from the start of the order. The choice is the one scoring every
//! node makes, ties and the generator's draws included.

use super::least_loaded::LeastLoaded;
use super::{
    lock, rng, KvAwareConfig, LoadOrder, RouteRequest, RoutingConfig, RoutingPolicy, Tier,
    TieredOverlap,
};
use kvmesh_common::NodeId;
use rand::rngs::StdRng;
use rand::Rng;
use std::sync::Mutex;

#[derive(Debug)]
pub struct KvAware {
    config: KvAwareConfig,
    rng: Mutex<StdRng>,
    /// The config is one `validate` accepts: costs are finite, never negative and grow with
    /// load, and the least-loaded node is eligible, which the ordered selection relies on.
    valid: bool,
}

impl KvAware {
    pub fn new(config: KvAwareConfig) -> Self {
        KvAware {
            rng: rng(config.seed),
            valid: RoutingConfig::KvAware(config.clone()).validate().is_ok(),
            config,
        }
    }

    fn cost(&self, uncached_share: f64, load: usize) -> f64 {
        self.config.prefill_weight * uncached_share + self.config.load_weight * load as f64
    }

    /// The prompt's share still to prefill on a node holding `overlap`, in `0.0..=1.0`.
    fn uncached_share(&self, request: &RouteRequest<'_>, overlap: TieredOverlap) -> f64 {
        if request.prompt_blocks == 0 {
            return 0.0;
        }
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
        // Most candidates hold none of the prompt (the index names only those that do): they
        // share one uncached share, and only the others are looked up.
        let none_held = self.uncached_share(request, TieredOverlap::default());
        let share = |node: NodeId| match request.overlap.get(&node) {
            Some(&overlap) => self.uncached_share(request, overlap),
            None => none_held,
        };
        let scored: Vec<(usize, f64)> = request
            .nodes
            .iter()
            .map(|n| {
                let load = request.load(n);
                (load, self.cost(share(n.info.node_id), load))
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

    fn select_ordered(&self, request: &RouteRequest<'_>, by_load: &LoadOrder) -> Option<NodeId> {
        debug_assert!(
            by_load.len() == request.nodes.len()
                && by_load
                    .iter()
                    .all(|(load, i)| request.load(&request.nodes[i]) == load
                        && by_load.load(i) == load),
            "the load order is stale"
        );
        if !self.valid {
            return self.select(request);
        }
        let c = &self.config;
        let (min_load, _) = by_load.iter().next()?;
        let max_load = min_load as f64 * c.imbalance_ratio + c.imbalance_slack as f64;
        let eligible = |load: usize| load as f64 <= max_load;
        // (position, load, cost) of the candidates the index names. Most of them hold the
        // same blocks (a shared system prompt), so a share is worked out once in a row.
        let mut last: Option<(TieredOverlap, f64)> = None;
        // Sized for them all: grown a push at a time, it was copied over and over.
        let mut held: Vec<(usize, usize, f64)> = Vec::with_capacity(request.overlap.len());
        held.extend(request.overlap.iter().filter_map(|(&node, &overlap)| {
            let i = by_load.position(node)?;
            let load = by_load.load(i);
            let share = match last {
                Some((o, share)) if o == overlap => share,
                _ => {
                    last.insert((overlap, self.uncached_share(request, overlap)))
                        .1
                }
            };
            Some((i, load, self.cost(share, load)))
        }));
        let none_held = self.uncached_share(request, TieredOverlap::default());
        // The held positions a bit each: the nodes the index does not name are taken a load
        // level at a time (all the least loaded may tie), never one by one.
        let words = by_load.len().div_ceil(64);
        let mut is_held = vec![0u64; words];
        for &(i, _, _) in &held {
            is_held[i / 64] |= 1 << (i % 64);
        }
        let has_unheld = |level: &[u64]| without(level, &is_held).any(|w| w != 0);
        let first_unheld = by_load
            .levels()
            .find(|&(_, level)| has_unheld(level))
            .map(|(load, _)| (usize::MAX, load, self.cost(none_held, load)));
        // Costs are never negative nor NaN here, so the minimum is the same in any order.
        let best = held
            .iter()
            .copied()
            .chain(first_unheld)
            .filter(|&(_, load, _)| eligible(load))
            .map(|(_, _, cost)| cost)
            .fold(f64::INFINITY, f64::min);
        let tolerance = 1e-9 * best.abs().max(1.0);
        let is_best = |load: usize, cost: f64| eligible(load) && cost <= best + tolerance;
        // The tied positions a bit each, so that they count and order without a sort.
        let mut ties = vec![0u64; words];
        for &(i, load, cost) in &held {
            if is_best(load, cost) {
                ties[i / 64] |= 1 << (i % 64);
            }
        }
        // Eligibility and cost only grow along the order: the tied levels come first.
        for (load, level) in by_load.levels().filter(|&(_, level)| has_unheld(level)) {
            if !is_best(load, self.cost(none_held, load)) {
                break;
            }
            for (tie, bits) in ties.iter_mut().zip(without(level, &is_held)) {
                *tie |= bits;
            }
        }
        let count: usize = ties.iter().map(|w| w.count_ones() as usize).sum();
        if count == 0 {
            return self.select(request);
        }
        let pick = if count == 1 {
            0
        } else {
            lock(&self.rng).gen_range(0..count)
        };
        Some(request.nodes[nth_set_bit(&ties, pick)?].info.node_id)
    }
}

/// The positions of `level` not in `held`, both a bit each, a word at a time.
fn without<'a>(level: &'a [u64], held: &'a [u64]) -> impl Iterator<Item = u64> + 'a {
    level.iter().zip(held).map(|(&nodes, &held)| nodes & !held)
}

/// The position of the `n`th (from 0) set bit of `words`, counting from bit 0 of the first.
fn nth_set_bit(words: &[u64], mut n: usize) -> Option<usize> {
    for (w, &word) in words.iter().enumerate() {
        let ones = word.count_ones() as usize;
        if n < ones {
            let mut rest = word;
            for _ in 0..n {
                rest &= rest - 1;
            }
            return Some(w * 64 + rest.trailing_zeros() as usize);
        }
        n -= ones;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{snapshots, Snapshot};
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

    /// Any config `validate` accepts, from a few values each knob often takes.
    fn valid_configs() -> impl Strategy<Value = KvAwareConfig> {
        let weights = prop::sample::select(vec![0.0, 0.1, 0.5, 1.0, 3.0]);
        let credits = prop::sample::select(vec![0.0, 0.5, 0.8, 1.0]);
        let ratios = prop::sample::select(vec![1.0, 1.5, 4.0]);
        (
            (weights.clone(), weights),
            (credits.clone(), credits.clone(), credits),
            (ratios, 0..6usize),
        )
            .prop_map(
                |((p, l), (device, host, disk), (ratio, slack))| KvAwareConfig {
                    prefill_weight: p,
                    load_weight: l,
                    device_credit: device,
                    host_credit: host,
                    disk_credit: disk,
                    imbalance_ratio: ratio,
                    imbalance_slack: slack,
                    seed: None,
                },
            )
    }

    /// Up to 300 nodes with few distinct loads (so many tie) and overlaps on some of them,
    /// some naming nodes that are not candidates.
    fn crowded_snapshots() -> impl Strategy<Value = Snapshot> {
        let node = (
            0..4usize,
            0..2usize,
            0..3usize,
            prop::option::weighted(0.2, (1..=16usize, 0..3usize)),
        );
        (
            prop::collection::vec(node, 1..300),
            1..=16usize,
            prop::collection::vec(1..400u64, 0..4),
        )
            .prop_map(|(nodes, prompt_blocks, strangers)| {
                let mut s = Snapshot {
                    prompt_blocks,
                    ..Snapshot::default()
                };
                for (id, (running, waiting, in_flight, held)) in (1..).zip(nodes) {
                    s.nodes
                        .push(crate::policy::testing::node(id, running, waiting, 0));
                    if in_flight > 0 {
                        s.in_flight.insert(NodeId(id), in_flight);
                    }
                    if let Some((blocks, tier)) = held {
                        let o = TieredOverlap::default()
                            .with(Tier::ALL[tier], blocks.min(prompt_blocks));
                        s.overlap.insert(NodeId(id), o);
                    }
                }
                for id in strangers {
                    s.overlap
                        .insert(NodeId(1000 + id), TieredOverlap::on_device(prompt_blocks));
                }
                s
            })
    }

    proptest! {
        /// Scoring only the nodes the index names and the least loaded of the rest chooses
        /// what scoring every node chooses, draw for draw.
        #[test]
        fn the_ordered_selection_is_the_plain_one(
            s in prop_oneof![snapshots(), crowded_snapshots()],
            config in valid_configs(),
            seed: u64,
        ) {
            let seeded = || KvAware::new(KvAwareConfig { seed: Some(seed), ..config.clone() });
            let (plain, ordered) = (seeded(), seeded());
            let r = s.request();
            let by_load = LoadOrder::of(&r);
            for _ in 0..4 {
                prop_assert_eq!(ordered.select_ordered(&r, &by_load), plain.select(&r));
            }
        }

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
            let full_hit = policy.uncached_share(&r, r.overlap_of(chosen.info.node_id)) == 0.0;
            prop_assert!(r.load(chosen) < load1 || (r.load(chosen) == load1 && full_hit));
        }
    }
}
