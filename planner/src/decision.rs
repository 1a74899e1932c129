//! What the planner decides: a target count per role, the role switches that reach part of
//! it, why, and whether it is to be acted on.

use serde::Serialize;
use std::time::Duration;

/// A node's role in the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub const ALL: [Role; 2] = [Role::Prefill, Role::Decode];

    pub(crate) fn index(self) -> usize {
        match self {
            Role::Prefill => 0,
            Role::Decode => 1,
        }
    }
}

/// Which way a count moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    Up,
    Down,
    Hold,
}

/// What a consolidation check measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// Queued prefill tokens per node.
    QueuedPrefillTokens,
    /// KV usage per decode node (`0..=1`).
    KvUsage,
    /// Prefill demand over the capacity of the remaining nodes.
    PrefillUtilization,
    /// Predicted TTFT, in seconds.
    TtftSeconds,
    /// Running sequences per decode node.
    DecodeBatch,
}

/// Why a role's target is what it is. Variants that override another decision keep it in
/// `because`.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Reason {
    /// Nothing crossed a threshold; the current count meets the demand.
    Hold,
    /// Called before the interval since the last decision passed.
    NotDue { next: Duration },
    /// No observation yet: the actual counts are unknown.
    NoObservation,
    /// Fewer nodes than the configured minimum are alive: restore it.
    BelowMinimum { min: u32 },
    /// More nodes than the configured maximum are alive: remove the excess.
    AboveMaximum { max: u32 },
    /// Load policy: the most loaded prefill node's queue reached the threshold.
    PrefillQueueHigh { queued_tokens: u64, threshold: f64 },
    /// Load policy: every prefill node's queue stayed below the threshold.
    PrefillQueueLow { queued_tokens: u64, threshold: f64 },
    /// Load policy: some decode node's KV usage reached the threshold.
    KvUsageHigh { usage: f64, threshold: f64 },
    /// Load policy: every decode node's KV usage stayed below the threshold.
    KvUsageLow { usage: f64, threshold: f64 },
    /// SLO policy: the replicas the predicted demand needs. `demand` is prompt tokens per
    /// second (prefill) or concurrent sequences (decode); `per_replica` is what one node
    /// serves within the target, after `correction`.
    PredictedDemand {
        demand: f64,
        per_replica: f64,
        correction: f64,
        replicas: u32,
        /// False when no step size meets the target even on an idle node.
        meets_target: bool,
        /// The share of each replica's planned share a scale-down keeps free.
        headroom: f64,
    },
    /// A scale-down to `wanted` was refused: the remaining nodes would carry `projected`
    /// (in `metric`) against `limit`.
    ConsolidationRefused {
        wanted: u32,
        metric: Metric,
        projected: f64,
        limit: f64,
        because: Box<Reason>,
    },
    /// The policy wanted `wanted`, but the role changed too recently.
    Cooldown {
        wanted: u32,
        remaining: Duration,
        because: Box<Reason>,
    },
    /// The policy wanted `wanted`, outside the role's `min..=max`.
    RoleLimit {
        wanted: u32,
        limit: u32,
        because: Box<Reason>,
    },
    /// The other role grows, and `nodes` of this role's switch over to it now: its policy
    /// would remove them (`because` says so, held back by a cooldown or the stabilization
    /// window, or not) and the consolidation check lets them go. A switched node serves in
    /// seconds where a new one takes its start-up, and this role's bill ends at once.
    Lent { nodes: u32, because: Box<Reason> },
    /// The policy wanted `wanted`, but prefill + decode may not exceed `budget`.
    BudgetClamp {
        wanted: u32,
        budget: u32,
        because: Box<Reason>,
    },
}

impl Reason {
    /// Its kind as it serializes (`predicted_demand`, `cooldown`, ...): a label for counting
    /// decisions by reason.
    pub fn kind(&self) -> &'static str {
        match self {
            Reason::Hold => "hold",
            Reason::NotDue { .. } => "not_due",
            Reason::NoObservation => "no_observation",
            Reason::BelowMinimum { .. } => "below_minimum",
            Reason::AboveMaximum { .. } => "above_maximum",
            Reason::PrefillQueueHigh { .. } => "prefill_queue_high",
            Reason::PrefillQueueLow { .. } => "prefill_queue_low",
            Reason::KvUsageHigh { .. } => "kv_usage_high",
            Reason::KvUsageLow { .. } => "kv_usage_low",
            Reason::PredictedDemand { .. } => "predicted_demand",
            Reason::ConsolidationRefused { .. } => "consolidation_refused",
            Reason::Cooldown { .. } => "cooldown",
            Reason::RoleLimit { .. } => "role_limit",
            Reason::Lent { .. } => "lent",
            Reason::BudgetClamp { .. } => "budget_clamp",
        }
    }
}

/// One role's part of a decision.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RoleDecision {
    /// Nodes alive when the decision was made (from the latest observation).
    pub observed: u32,
    /// Nodes the role should have.
    pub target: u32,
    pub reason: Reason,
}

impl RoleDecision {
    pub(crate) fn hold(observed: u32, reason: Reason) -> RoleDecision {
        RoleDecision {
            observed,
            target: observed,
            reason,
        }
    }

    /// `target - observed`.
    pub fn delta(&self) -> i64 {
        i64::from(self.target) - i64::from(self.observed)
    }

    pub fn direction(&self) -> Direction {
        match self.delta() {
            d if d > 0 => Direction::Up,
            d if d < 0 => Direction::Down,
            _ => Direction::Hold,
        }
    }
}

/// Nodes to flip instead of removing one and adding another. They are part of the targets:
/// with `decode_to_prefill: 1`, a prefill target one above the observed count and a decode
/// target one below are reached by draining one decode node, flipping it and republishing it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RoleSwitches {
    pub prefill_to_decode: u32,
    pub decode_to_prefill: u32,
}

/// The planner's answer for one interval.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decision {
    /// The `now` it was made at.
    pub at: Duration,
    pub prefill: RoleDecision,
    pub decode: RoleDecision,
    pub switches: RoleSwitches,
    /// Advisory mode: decided and reported, not to be acted on (and the planner's cooldowns
    /// did not start).
    pub advisory: bool,
}

impl Decision {
    pub fn role(&self, role: Role) -> &RoleDecision {
        match role {
            Role::Prefill => &self.prefill,
            Role::Decode => &self.decode,
        }
    }

    /// Whether any count changes.
    pub fn is_change(&self) -> bool {
        self.prefill.delta() != 0 || self.decode.delta() != 0
    }

    /// Whether the caller is to act on it: a change, outside advisory mode.
    pub fn acted(&self) -> bool {
        self.is_change() && !self.advisory
    }

    /// Total nodes after the decision.
    pub fn total_target(&self) -> u32 {
        self.prefill.target + self.decode.target
    }
}

/// One line for a log: each role's count and why, the switches, and whether it is advisory,
/// e.g. `prefill 1 -> 2 (prefill_queue_high), decode 2 -> 1 (kv_usage_low), 1 decode -> prefill`.
impl std::fmt::Display for Decision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, role) in Role::ALL.into_iter().enumerate() {
            let d = self.role(role);
            let name = match role {
                Role::Prefill => "prefill",
                Role::Decode => "decode",
            };
            let sep = if i == 0 { "" } else { ", " };
            match d.direction() {
                Direction::Hold => write!(f, "{sep}{name} {}", d.observed)?,
                _ => write!(f, "{sep}{name} {} -> {}", d.observed, d.target)?,
            }
            write!(f, " ({})", d.reason.kind())?;
        }
        let s = self.switches;
        if s.decode_to_prefill > 0 {
            write!(f, ", {} decode -> prefill", s.decode_to_prefill)?;
        }
        if s.prefill_to_decode > 0 {
            write!(f, ", {} prefill -> decode", s.prefill_to_decode)?;
        }
        if self.advisory {
            write!(f, " (advisory)")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decision_reads_as_one_line() {
        let d = Decision {
            at: Duration::ZERO,
            prefill: RoleDecision {
                observed: 1,
                target: 2,
                reason: Reason::PrefillQueueHigh {
                    queued_tokens: 900,
                    threshold: 512.0,
                },
            },
            decode: RoleDecision {
                observed: 2,
                target: 1,
                reason: Reason::KvUsageLow {
                    usage: 0.1,
                    threshold: 0.5,
                },
            },
            switches: RoleSwitches {
                prefill_to_decode: 0,
                decode_to_prefill: 1,
            },
            advisory: false,
        };
        assert_eq!(
            d.to_string(),
            "prefill 1 -> 2 (prefill_queue_high), decode 2 -> 1 (kv_usage_low), \
             1 decode -> prefill"
        );
        let hold = Decision {
            prefill: RoleDecision::hold(1, Reason::Hold),
            decode: RoleDecision::hold(3, Reason::Hold),
            switches: RoleSwitches::default(),
            advisory: true,
            ..d
        };
        assert_eq!(
            hold.to_string(),
            "prefill 1 (hold), decode 3 (hold) (advisory)"
        );
    }

    #[test]
    fn a_decision_serializes_for_reports() {
        let d = Decision {
            at: Duration::from_secs(5),
            prefill: RoleDecision {
                observed: 2,
                target: 3,
                reason: Reason::BudgetClamp {
                    wanted: 4,
                    budget: 6,
                    because: Box::new(Reason::PrefillQueueHigh {
                        queued_tokens: 9000,
                        threshold: 8192.0,
                    }),
                },
            },
            decode: RoleDecision::hold(3, Reason::Hold),
            switches: RoleSwitches::default(),
            advisory: true,
        };
        let json = serde_json::to_value(&d).unwrap();
        assert_eq!(json["prefill"]["reason"]["kind"], "budget_clamp");
        assert_eq!(
            json["prefill"]["reason"]["because"]["kind"],
            "prefill_queue_high"
        );
        assert_eq!(json["decode"]["reason"]["kind"], "hold");
        assert_eq!(json["prefill"]["reason"]["kind"], d.prefill.reason.kind());
        let queue = Reason::PrefillQueueHigh {
            queued_tokens: 1,
            threshold: 1.0,
        };
        assert_eq!(serde_json::to_value(&queue).unwrap()["kind"], queue.kind());
        assert_eq!(json["advisory"], true);
        assert_eq!(d.prefill.direction(), Direction::Up);
        assert!(d.is_change() && !d.acted());
    }
}
