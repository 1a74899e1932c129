//! The two rules that combine the roles' decisions: the node budget and role switching.

use crate::decision::{Reason, RoleDecision, RoleSwitches};

/// Caps growth so that prefill + decode targets stay within `budget`. Only growth is cut,
/// and never below the observed count: a clamped decision holds or grows less, it never
/// turns into a scale-down (even when a manual edit left the mesh over budget). Decisions
/// marked `exempt` (restoring a minimum) are not cut. When both roles want more than the
/// headroom, it is shared in proportion to what each wanted, the rest one node at a time
/// to the role left furthest from its want (decode first on a tie: it holds running requests).
pub(crate) fn clamp_to_budget(roles: [&mut RoleDecision; 2], budget: u32, exempt: [bool; 2]) {
    let growth = |r: &RoleDecision| r.target.saturating_sub(r.observed);
    let mut base = 0u32;
    let mut wants = [0u32; 2];
    for (i, r) in roles.iter().enumerate() {
        base += r.target.min(r.observed);
        if exempt[i] {
            base += growth(r);
        } else {
            wants[i] = growth(r);
        }
    }
    let headroom = budget.saturating_sub(base);
    let total: u32 = wants.iter().sum();
    if total <= headroom {
        return;
    }
    let mut grant: [u32; 2] = std::array::from_fn(|i| {
        (u64::from(wants[i]) * u64::from(headroom) / u64::from(total)) as u32
    });
    while grant.iter().sum::<u32>() < headroom {
        let i = if wants[1] - grant[1] >= wants[0] - grant[0] {
            1
        } else {
            0
        };
        grant[i] += 1;
    }
    for (i, r) in roles.into_iter().enumerate() {
        if grant[i] < wants[i] {
            let wanted = r.target;
            r.target = r.observed + grant[i];
            let because = std::mem::replace(&mut r.reason, Reason::Hold);
            r.reason = Reason::BudgetClamp {
                wanted,
                budget,
                because: Box::new(because),
            };
        }
    }
}

/// When one role grows while the other shrinks, `min(growth, shrink)` nodes flip roles
/// instead of one being started and another stopped.
pub(crate) fn role_switches(prefill: &RoleDecision, decode: &RoleDecision) -> RoleSwitches {
    let (p, d) = (prefill.delta(), decode.delta());
    let mut s = RoleSwitches::default();
    if p > 0 && d < 0 {
        s.decode_to_prefill = p.min(-d) as u32;
    } else if d > 0 && p < 0 {
        s.prefill_to_decode = d.min(-p) as u32;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::Direction;

    fn rd(observed: u32, target: u32) -> RoleDecision {
        RoleDecision {
            observed,
            target,
            reason: Reason::Hold,
        }
    }

    #[test]
    fn growth_within_the_budget_is_untouched() {
        let (mut p, mut d) = (rd(2, 3), rd(2, 4));
        clamp_to_budget([&mut p, &mut d], 7, [false; 2]);
        assert_eq!((p.target, d.target), (3, 4));
    }

    #[test]
    fn headroom_is_shared_in_proportion() {
        let (mut p, mut d) = (rd(2, 6), rd(2, 4));
        clamp_to_budget([&mut p, &mut d], 7, [false; 2]);
        // 3 of headroom for wants of 4 and 2: 2 and 1.
        assert_eq!((p.target, d.target), (4, 3));
        assert!(matches!(
            p.reason,
            Reason::BudgetClamp {
                wanted: 6,
                budget: 7,
                ..
            }
        ));
        assert!(matches!(d.reason, Reason::BudgetClamp { wanted: 4, .. }));
    }

    #[test]
    fn a_shrinking_role_frees_headroom_for_the_other() {
        let (mut p, mut d) = (rd(4, 6), rd(4, 3));
        clamp_to_budget([&mut p, &mut d], 8, [false; 2]);
        assert_eq!((p.target, d.target), (5, 3));
    }

    #[test]
    fn over_budget_after_a_manual_edit_holds_rather_than_shrinks() {
        let (mut p, mut d) = (rd(6, 7), rd(6, 6));
        clamp_to_budget([&mut p, &mut d], 8, [false; 2]);
        assert_eq!(p.direction(), Direction::Hold);
        assert_eq!(d.direction(), Direction::Hold);
    }

    #[test]
    fn restoring_a_minimum_is_not_cut() {
        let (mut p, mut d) = (rd(0, 1), rd(8, 8));
        clamp_to_budget([&mut p, &mut d], 8, [true, false]);
        assert_eq!(p.target, 1);
    }

    #[test]
    fn opposite_moves_become_switches() {
        let s = role_switches(&rd(2, 4), &rd(5, 4));
        assert_eq!(
            s,
            RoleSwitches {
                decode_to_prefill: 1,
                prefill_to_decode: 0
            }
        );
        let s = role_switches(&rd(3, 1), &rd(2, 5));
        assert_eq!(s.prefill_to_decode, 2);
        assert_eq!(role_switches(&rd(2, 3), &rd(2, 3)), RoleSwitches::default());
    }
}
