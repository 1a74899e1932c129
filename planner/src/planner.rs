//! The planner: observations in, one decision per interval out.

use crate::budget::{clamp_to_budget, role_switches};
use crate::config::{ConfigError, PlannerConfig, Policy};
use crate::decision::{Decision, Reason, Role, RoleDecision, RoleSwitches};
use crate::load::{LoadPolicy, Overload};
use crate::observation::Observation;
use crate::perf_model::PerfModel;
use crate::slo::SloPolicy;
use std::time::Duration;

enum PolicyState {
    Load(LoadPolicy),
    Slo(Box<SloPolicy>),
}

/// The planner's pure core. The caller feeds it observations with [`observe`](Self::observe)
/// and asks for a decision with [`decide`](Self::decide) every interval; time is always an
/// argument, so the same planner runs in a driver's wall clock or a simulator's virtual one.
///
/// Decisions start from the node counts the latest observation shows, never from what the
/// planner asked for before: a manual edit, a crash or a slow start is simply the new
/// starting point.
pub struct Planner {
    config: PlannerConfig,
    policy: PolicyState,
    /// Observations since the last decision.
    window: Vec<Observation>,
    latest: Option<Observation>,
    last_decision: Option<Duration>,
    /// Per role: when its count last changed by a decision acted on.
    last_change: [Option<Duration>; 2],
    /// Per role: when its count last grew by a decision acted on.
    last_growth: [Option<Duration>; 2],
}

impl Planner {
    pub fn new(config: PlannerConfig) -> Result<Planner, ConfigError> {
        config.validate()?;
        let policy = match config.policy {
            Policy::Load => PolicyState::Load(LoadPolicy::new(config.load)),
            Policy::Slo => PolicyState::Slo(Box::new(SloPolicy::new(
                config.slo.clone(),
                config.load.kv_usage_up,
                (config.prefill.min == 0).then(|| config.load.prefill_down_tokens()),
            ))),
        };
        Ok(Planner {
            config,
            policy,
            window: Vec::new(),
            latest: None,
            last_decision: None,
            last_change: [None; 2],
            last_growth: [None; 2],
        })
    }

    pub fn config(&self) -> &PlannerConfig {
        &self.config
    }

    /// The SLO policy's performance model, as refitted so far.
    pub fn perf_model(&self) -> Option<&PerfModel> {
        match &self.policy {
            PolicyState::Slo(s) => Some(s.perf()),
            PolicyState::Load(_) => None,
        }
    }

    /// When the next decision is due (now, before the first one).
    pub fn next_decision_at(&self) -> Duration {
        self.last_decision
            .map_or(Duration::ZERO, |t| t + self.config.interval())
    }

    /// Absorb a snapshot of the mesh taken at `now`.
    pub fn observe(&mut self, now: Duration, obs: Observation) {
        match &mut self.policy {
            PolicyState::Load(p) => p.observe(now, &obs),
            PolicyState::Slo(p) => p.observe(&obs),
        }
        self.window.push(obs.clone());
        self.latest = Some(obs);
    }

    /// Decide the node counts for the next interval. Before the interval since the last
    /// decision has passed, or with no observation since, it holds and says why.
    pub fn decide(&mut self, now: Duration) -> Decision {
        let advisory = self.config.advisory;
        let hold_all = |latest: Option<&Observation>, reason: Reason| {
            let count = |role| latest.map_or(0, |o: &Observation| o.nodes(role));
            Decision {
                at: now,
                prefill: RoleDecision::hold(count(Role::Prefill), reason.clone()),
                decode: RoleDecision::hold(count(Role::Decode), reason),
                switches: RoleSwitches::default(),
                advisory,
            }
        };
        if self.last_decision.is_some() && now < self.next_decision_at() {
            let next = self.next_decision_at();
            return hold_all(self.latest.as_ref(), Reason::NotDue { next });
        }
        let Some(latest) = self.window.last().cloned() else {
            return hold_all(self.latest.as_ref(), Reason::NoObservation);
        };
        if let PolicyState::Slo(p) = &mut self.policy {
            p.plan(now, self.config.cooldown.down_stable_for, &self.window);
        }
        let (mut prefill, p_exempt) = self.decide_role(Role::Prefill, now, &latest);
        let (mut decode, d_exempt) = self.decide_role(Role::Decode, now, &latest);
        if self.config.allow_role_switch {
            // Before the budget: a lender's nodes free headroom for the role they join.
            self.lend(&prefill, &mut decode, Role::Decode, now, &latest);
            self.lend(&decode, &mut prefill, Role::Prefill, now, &latest);
        }
        clamp_to_budget(
            [&mut prefill, &mut decode],
            self.config.budget,
            [p_exempt, d_exempt],
        );
        let switches = if self.config.allow_role_switch {
            role_switches(&prefill, &decode)
        } else {
            RoleSwitches::default()
        };
        let decision = Decision {
            at: now,
            prefill,
            decode,
            switches,
            advisory,
        };
        if !advisory {
            for role in Role::ALL {
                if decision.role(role).delta() > 0 {
                    self.last_growth[role.index()] = Some(now);
                }
                if decision.role(role).delta() != 0 {
                    self.last_change[role.index()] = Some(now);
                    if let PolicyState::Load(p) = &mut self.policy {
                        p.changed(role);
                    }
                }
            }
        }
        self.last_decision = Some(now);
        self.window.clear();
        decision
    }

    /// One role's decision before the budget: limits, the policy, cooldowns and the
    /// consolidation check. The flag marks a decision restoring the minimum.
    fn decide_role(&self, role: Role, now: Duration, latest: &Observation) -> (RoleDecision, bool) {
        let observed = latest.nodes(role);
        let bounds = self.config.bounds(role);
        if observed < bounds.min {
            let d = RoleDecision {
                observed,
                target: bounds.min,
                reason: Reason::BelowMinimum { min: bounds.min },
            };
            return (d, true);
        }
        if observed > bounds.max {
            let d = RoleDecision {
                observed,
                target: bounds.max,
                reason: Reason::AboveMaximum { max: bounds.max },
            };
            return (d, false);
        }
        let cooldown = self.config.cooldown;
        let (wanted, mut reason) = match &self.policy {
            PolicyState::Load(p) => {
                p.propose(role, now, cooldown.down_stable_for, latest, observed)
            }
            PolicyState::Slo(p) => p.propose(role, now, cooldown.down_stable_for, observed),
        };
        let target = wanted.clamp(bounds.min, bounds.max);
        if target != wanted {
            reason = Reason::RoleLimit {
                wanted,
                limit: target,
                because: Box::new(reason),
            };
        }
        if target == observed {
            return (RoleDecision::hold(observed, reason), false);
        }
        let wait = if target > observed {
            cooldown.up
        } else {
            cooldown.down
        };
        if let Some(changed) = self.last_change[role.index()] {
            let ready = changed + wait;
            if now < ready {
                let reason = Reason::Cooldown {
                    wanted: target,
                    remaining: ready - now,
                    because: Box::new(reason),
                };
                return (RoleDecision::hold(observed, reason), false);
            }
        }
        if target > observed {
            return (
                RoleDecision {
                    observed,
                    target,
                    reason,
                },
                false,
            );
        }
        // A scale-down: the fewest nodes at or above the target that still carry the load.
        let mut refused: Option<Overload> = None;
        for to in target..observed {
            match self.consolidation(role, to, latest) {
                Ok(()) => {
                    let d = RoleDecision {
                        observed,
                        target: to,
                        reason,
                    };
                    return (d, false);
                }
                Err(o) => refused = Some(o),
            }
        }
        let o = refused.expect("a scale-down tries at least one count");
        let reason = Reason::ConsolidationRefused {
            wanted: target,
            metric: o.metric,
            projected: o.projected,
            limit: o.limit,
            because: Box::new(reason),
        };
        (RoleDecision::hold(observed, reason), false)
    }

    /// When the other role grows, `lender`'s nodes that its policy would remove (and has
    /// for `cooldown.lend_stable_for`) and the consolidation check lets go switch over now,
    /// up to that growth (the `slo` policy's `lend_headroom` lets them come out of its
    /// scale-down headroom): the growth is served after a switch instead of a start-up,
    /// and the lender stops paying for them at once instead of after its cooldown and
    /// stabilization window. A role that grew less than `cooldown.down` ago lends nothing,
    /// so two roles near their boundaries do not pass a node back and forth.
    fn lend(
        &self,
        grower: &RoleDecision,
        lender: &mut RoleDecision,
        role: Role,
        now: Duration,
        latest: &Observation,
    ) {
        let growth = grower.delta();
        if growth <= 0 || lender.delta() > 0 {
            return;
        }
        let grew = self.last_growth[role.index()];
        if grew.is_some_and(|t| now < t + self.config.cooldown.down) {
            return;
        }
        let observed = lender.observed;
        let min = self.config.bounds(role).min;
        let mut to = lender.target;
        while i64::from(observed - to) < growth && to > min {
            let fewer = to - 1;
            let spare = self.lendable(role, fewer, observed, now, latest);
            if !spare {
                break;
            }
            to = fewer;
        }
        if to < lender.target {
            let because = std::mem::replace(&mut lender.reason, Reason::Hold);
            lender.reason = Reason::Lent {
                nodes: lender.target - to,
                because: Box::new(because),
            };
            lender.target = to;
        }
    }

    /// Whether the role can lend the node that takes it to `to`: its policy has wanted it
    /// gone for `cooldown.lend_stable_for` and the consolidation check lets it go.
    fn lendable(
        &self,
        role: Role,
        to: u32,
        observed: u32,
        now: Duration,
        latest: &Observation,
    ) -> bool {
        let span = self.config.cooldown.lend_stable_for;
        match &self.policy {
            PolicyState::Load(p) => {
                p.would_remove(role, to, observed, now, span, latest)
                    && p.consolidation(role, to, &self.window).is_ok()
            }
            PolicyState::Slo(p) => p.lendable(role, to, now, span, latest),
        }
    }

    fn consolidation(&self, role: Role, to: u32, latest: &Observation) -> Result<(), Overload> {
        match &self.policy {
            PolicyState::Load(p) => p.consolidation(role, to, &self.window),
            PolicyState::Slo(p) => p.consolidation(role, to, latest),
        }
    }
}
