//! The load policy: Dynamo-style reactive thresholds, one node at a time.
//!
//! - Prefill grows when ANY engine's queued prompt tokens reach `prefill_queue_up` context
//!   lengths, and shrinks when EVERY engine's queue has stayed below `prefill_queue_down`
//!   context lengths for `cooldown.down_stable_for`. The engines are the prefill nodes and
//!   the decode nodes, whose local prefills (prompts that found every prefill node busy, or
//!   every prompt while there is none) are prefill work waiting too.
//! - Decode does the same on KV usage (`kv_usage_up`, `kv_usage_down`).
//! - A scale-down passes the consolidation check only if the load of all nodes, spread over
//!   one node fewer, stays below the up threshold (otherwise the next decision would undo
//!   it). The last prefill node goes (with `min = 0`) only if its queue and the decode
//!   nodes', spread over the decode nodes, stay below the down threshold: no prefill work
//!   is waiting.

use crate::config::LoadConfig;
use crate::decision::{Metric, Reason, Role};
use crate::observation::Observation;
use std::time::Duration;

/// A refused consolidation: what the remaining nodes would carry, against what limit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Overload {
    pub metric: Metric,
    pub projected: f64,
    pub limit: f64,
}

#[derive(Clone, Debug)]
pub(crate) struct LoadPolicy {
    config: LoadConfig,
    /// Per role: since when every observation had every node below the down threshold.
    low_since: [Option<Duration>; 2],
}

impl LoadPolicy {
    pub fn new(config: LoadConfig) -> LoadPolicy {
        LoadPolicy {
            config,
            low_since: [None; 2],
        }
    }

    fn thresholds(&self, role: Role) -> (f64, f64) {
        match role {
            Role::Prefill => (
                self.config.prefill_up_tokens(),
                self.config.prefill_down_tokens(),
            ),
            Role::Decode => (self.config.kv_usage_up, self.config.kv_usage_down),
        }
    }

    /// Track how long every node of each role has been below its down threshold.
    pub fn observe(&mut self, now: Duration, obs: &Observation) {
        for role in Role::ALL {
            let (_, down) = self.thresholds(role);
            let loads = per_node(role, obs);
            let low = !loads.is_empty() && loads.iter().all(|&l| l < down);
            let since = &mut self.low_since[role.index()];
            *since = if low {
                Some(since.unwrap_or(now))
            } else {
                None
            };
        }
    }

    /// The role changed size: its per-node loads start over.
    pub fn changed(&mut self, role: Role) {
        self.low_since[role.index()] = None;
    }

    /// The count the thresholds ask for, one step from `observed`.
    pub fn propose(
        &self,
        role: Role,
        now: Duration,
        stable_for: Duration,
        latest: &Observation,
        observed: u32,
    ) -> (u32, Reason) {
        let (up, down) = self.thresholds(role);
        let loads = per_node(role, latest);
        let Some(max) = loads.iter().copied().reduce(f64::max) else {
            return (observed, Reason::Hold);
        };
        let reason = |high: bool| match (role, high) {
            (Role::Prefill, true) => Reason::PrefillQueueHigh {
                queued_tokens: max as u64,
                threshold: up,
            },
            (Role::Prefill, false) => Reason::PrefillQueueLow {
                queued_tokens: max as u64,
                threshold: down,
            },
            (Role::Decode, true) => Reason::KvUsageHigh {
                usage: max,
                threshold: up,
            },
            (Role::Decode, false) => Reason::KvUsageLow {
                usage: max,
                threshold: down,
            },
        };
        if max >= up {
            return (observed + 1, reason(true));
        }
        match self.low_since[role.index()] {
            Some(since) if now.saturating_sub(since) >= stable_for && observed > 0 => {
                (observed - 1, reason(false))
            }
            _ => (observed, Reason::Hold),
        }
    }

    /// Whether the thresholds are taking the role to `to`: one node fewer, every node below
    /// the down threshold now and for at least `span` (the stable time not yet waited out,
    /// perhaps).
    pub fn would_remove(
        &self,
        role: Role,
        to: u32,
        observed: u32,
        now: Duration,
        span: Duration,
        latest: &Observation,
    ) -> bool {
        let (_, down) = self.thresholds(role);
        let loads = per_node(role, latest);
        let low_now = !loads.is_empty() && loads.iter().all(|&l| l < down);
        let low_for_span = span.is_zero()
            || self.low_since[role.index()].is_some_and(|since| now.saturating_sub(since) >= span);
        to + 1 >= observed && low_now && low_for_span
    }

    /// Would `to` nodes carry the load every observation of `window` showed, below the up
    /// threshold?
    pub fn consolidation(
        &self,
        role: Role,
        to: u32,
        window: &[Observation],
    ) -> Result<(), Overload> {
        let (up, down) = self.thresholds(role);
        let metric = match role {
            Role::Prefill => Metric::QueuedPrefillTokens,
            Role::Decode => Metric::KvUsage,
        };
        let total = window
            .iter()
            .map(|o| per_node(role, o).iter().sum::<f64>())
            .fold(0.0, f64::max);
        let (spread_over, limit) = match (role, to) {
            // No prefill node left: the decode nodes take every prompt.
            (Role::Prefill, 0) => {
                let decode = window.iter().map(|o| o.decode_nodes).min().unwrap_or(0);
                (decode, down)
            }
            _ => (to, up),
        };
        let projected = total / f64::from(spread_over.max(1));
        if projected < limit {
            Ok(())
        } else {
            Err(Overload {
                metric,
                projected,
                limit,
            })
        }
    }
}

/// The per-engine load the role's thresholds apply to: for prefill, every prefill and
/// decode node's queued prompt tokens.
fn per_node(role: Role, obs: &Observation) -> Vec<f64> {
    match role {
        Role::Prefill => obs
            .prefill_queued_tokens
            .iter()
            .chain(&obs.decode_queued_prompt_tokens)
            .map(|&q| q as f64)
            .collect(),
        Role::Decode => obs.decode_kv_usage.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obs(queued: &[u64], kv: &[f64]) -> Observation {
        Observation {
            prefill_queued_tokens: queued.to_vec(),
            decode_kv_usage: kv.to_vec(),
            prefill_nodes: queued.len() as u32,
            decode_nodes: kv.len() as u32,
            ..Observation::default()
        }
    }

    fn policy() -> LoadPolicy {
        LoadPolicy::new(LoadConfig {
            context_length: 1000,
            ..LoadConfig::default()
        })
    }

    #[test]
    fn any_node_over_the_up_threshold_scales_up() {
        let p = policy();
        let o = obs(&[0, 0, 1000], &[0.1, 0.95]);
        let (t, r) = p.propose(Role::Prefill, Duration::ZERO, Duration::ZERO, &o, 3);
        assert_eq!(t, 4);
        assert!(matches!(
            r,
            Reason::PrefillQueueHigh {
                queued_tokens: 1000,
                ..
            }
        ));
        let (t, r) = p.propose(Role::Decode, Duration::ZERO, Duration::ZERO, &o, 2);
        assert_eq!(t, 3);
        assert!(matches!(r, Reason::KvUsageHigh { .. }));
    }

    #[test]
    fn scale_down_needs_every_node_low_for_the_stable_time() {
        let mut p = policy();
        let stable = Duration::from_secs(10);
        let low = obs(&[10, 20], &[0.1, 0.2]);
        let mixed = obs(&[10, 200], &[0.1, 0.6]);
        p.observe(Duration::from_secs(0), &low);
        p.observe(Duration::from_secs(5), &mixed);
        p.observe(Duration::from_secs(6), &low);
        let at = |s| Duration::from_secs(s);
        // Low only since 6 s.
        assert_eq!(p.propose(Role::Prefill, at(15), stable, &low, 2).0, 2);
        assert_eq!(p.propose(Role::Decode, at(15), stable, &low, 2).0, 2);
        p.observe(at(16), &low);
        assert_eq!(p.propose(Role::Prefill, at(16), stable, &low, 2).0, 1);
        assert_eq!(p.propose(Role::Decode, at(16), stable, &low, 2).0, 1);
        p.changed(Role::Decode);
        assert_eq!(p.propose(Role::Decode, at(16), stable, &low, 2).0, 2);
    }

    #[test]
    fn decode_nodes_queued_prompts_are_prefill_work() {
        let p = policy();
        // No prefill node: a decode node's queue alone grows the role from zero.
        let o = Observation {
            decode_queued_prompt_tokens: vec![0, 1200],
            decode_kv_usage: vec![0.1, 0.1],
            decode_nodes: 2,
            ..Observation::default()
        };
        let (t, r) = p.propose(Role::Prefill, Duration::ZERO, Duration::ZERO, &o, 0);
        assert_eq!(t, 1);
        assert!(matches!(
            r,
            Reason::PrefillQueueHigh {
                queued_tokens: 1200,
                ..
            }
        ));
        // With prefill nodes, prompts that overflowed onto a decode node count too.
        let o = Observation {
            prefill_queued_tokens: vec![400],
            prefill_nodes: 1,
            ..o
        };
        let (t, _) = p.propose(Role::Prefill, Duration::ZERO, Duration::ZERO, &o, 1);
        assert_eq!(t, 2);
    }

    #[test]
    fn consolidation_spreads_the_total_over_the_remaining_nodes() {
        let p = policy();
        // 0.45 + 0.45 on one node is 0.9: at the up threshold, refused.
        let window = [obs(&[50, 50], &[0.45, 0.45])];
        let refused = p.consolidation(Role::Decode, 1, &window).unwrap_err();
        assert_eq!(refused.metric, Metric::KvUsage);
        assert!((refused.projected - 0.9).abs() < 1e-12);
        assert!(p.consolidation(Role::Prefill, 1, &window).is_ok());
        // The worst observation of the window counts.
        let window = [obs(&[50, 50], &[0.2, 0.2]), obs(&[50, 50], &[0.45, 0.45])];
        assert!(p.consolidation(Role::Decode, 1, &window).is_err());
        assert!(p.consolidation(Role::Decode, 2, &window).is_ok());
    }
}
