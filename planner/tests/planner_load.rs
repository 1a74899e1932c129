//! The load policy over a fluid mesh in virtual time.

mod common;

use common::{direction_changes, run, Load, Mesh};
use kvmesh_planner::{
    Direction, Metric, Observation, Planner, PlannerConfig, Reason, Role, RoleBounds,
};
use std::time::Duration;

const CTX: u64 = 1000;

fn config() -> PlannerConfig {
    let mut c = PlannerConfig::default();
    c.load.context_length = CTX;
    c.load.interval = Duration::from_secs(5);
    c.cooldown.up = Duration::from_secs(10);
    c.cooldown.down = Duration::from_secs(30);
    c.cooldown.down_stable_for = Duration::from_secs(30);
    c.prefill = RoleBounds { min: 1, max: 10 };
    c.decode = RoleBounds { min: 1, max: 10 };
    c.budget = 20;
    c
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

#[test]
fn a_load_step_scales_up_within_a_bounded_number_of_decisions() {
    let mut planner = Planner::new(config()).unwrap();
    let mut mesh = Mesh {
        prefill: 1,
        decode: 1,
    };
    // 5.5 context lengths queued and 3.5 nodes' worth of KV: 6 prefill nodes bring each
    // queue under one context length, 4 decode nodes bring KV usage under 0.9.
    let load = |_| Load {
        queued_tokens: 5.5 * CTX as f64,
        kv_nodes: 3.5,
        ..Load::default()
    };
    let decisions = run(&mut planner, &mut mesh, secs(0), 200, load);
    assert_eq!((mesh.prefill, mesh.decode), (6, 4));
    // One node per step, a step at most every up-cooldown (two intervals) plus one interval.
    let reached = decisions
        .iter()
        .position(|d| d.prefill.target == 6)
        .unwrap();
    assert!(
        reached < 5 * 3,
        "reached 6 prefill nodes after {reached} decisions"
    );
    assert!(decisions
        .iter()
        .all(|d| d.prefill.delta() <= 1 && d.decode.delta() <= 1));
    assert_eq!(direction_changes(&decisions, Role::Prefill), 0);
    assert_eq!(direction_changes(&decisions, Role::Decode), 0);
}

#[test]
fn idle_scales_down_to_the_minimum_and_never_below_one() {
    let mut planner = Planner::new(config()).unwrap();
    let mut mesh = Mesh {
        prefill: 8,
        decode: 8,
    };
    let decisions = run(&mut planner, &mut mesh, secs(0), 3600, |_| Load::default());
    assert_eq!((mesh.prefill, mesh.decode), (1, 1));
    assert!(decisions
        .iter()
        .all(|d| d.prefill.target >= 1 && d.decode.target >= 1));
    let last = decisions.last().unwrap();
    assert_eq!(last.prefill.direction(), Direction::Hold);
    // At the minimum the policy still wants one fewer; the limit says no.
    assert!(matches!(
        last.prefill.reason,
        Reason::RoleLimit {
            wanted: 0,
            limit: 1,
            ..
        }
    ));
}

#[test]
fn an_oscillating_load_does_not_flap() {
    let mut planner = Planner::new(config()).unwrap();
    let mut mesh = Mesh {
        prefill: 1,
        decode: 1,
    };
    // 10 s of 3 context lengths queued and 2.5 nodes of KV, then 10 s of nothing, for an hour.
    let load = |now: Duration| {
        if now.as_secs() % 20 < 10 {
            Load {
                queued_tokens: 3.0 * CTX as f64,
                kv_nodes: 2.5,
                ..Load::default()
            }
        } else {
            Load::default()
        }
    };
    let decisions = run(&mut planner, &mut mesh, secs(0), 3600, load);
    assert_eq!(direction_changes(&decisions, Role::Prefill), 0);
    assert_eq!(direction_changes(&decisions, Role::Decode), 0);
    let changes = decisions.iter().filter(|d| d.acted()).count();
    assert!(changes <= 6, "{changes} changes");
    assert_eq!((mesh.prefill, mesh.decode), (4, 3));
    // When the oscillation stops, the mesh shrinks back.
    let decisions = run(&mut planner, &mut mesh, secs(3600), 1800, |_| {
        Load::default()
    });
    assert_eq!((mesh.prefill, mesh.decode), (1, 1));
    assert_eq!(direction_changes(&decisions, Role::Decode), 0);
}

#[test]
fn the_consolidation_check_refuses_an_unsafe_scale_down() {
    let mut planner = Planner::new(config()).unwrap();
    let mut mesh = Mesh {
        prefill: 1,
        decode: 2,
    };
    // Each decode node at 0.45 KV: below the down threshold (0.5), but one node would hold
    // 0.9, the up threshold.
    let load = |_| Load {
        kv_nodes: 0.9,
        ..Load::default()
    };
    let decisions = run(&mut planner, &mut mesh, secs(0), 600, load);
    assert_eq!(mesh.decode, 2);
    let last = decisions.last().unwrap();
    match &last.decode.reason {
        Reason::ConsolidationRefused {
            wanted: 1,
            metric: Metric::KvUsage,
            projected,
            limit,
            because,
        } => {
            assert!((projected - 0.9).abs() < 1e-9 && (limit - 0.9).abs() < 1e-9);
            assert!(matches!(**because, Reason::KvUsageLow { .. }));
        }
        other => panic!("{other:?}"),
    }
    // At 0.4 per node, one node holds 0.8 and the scale-down goes ahead.
    run(&mut planner, &mut mesh, secs(600), 600, |_| Load {
        kv_nodes: 0.8,
        ..Load::default()
    });
    assert_eq!(mesh.decode, 1);
}

#[test]
fn the_budget_clamp_never_reverses_a_decision() {
    // Every combination of counts (including over budget, as after a manual edit) and loads.
    let mut clamped = 0;
    for budget in 2..=8u32 {
        for p in 1..=8u32 {
            for d in 1..=8u32 {
                for (queued, kv) in [
                    (0u64, 0.0),
                    (5000, 0.0),
                    (0, 0.95),
                    (5000, 0.95),
                    (5000, 0.1),
                ] {
                    let mut c = config();
                    c.budget = budget;
                    c.cooldown.down_stable_for = Duration::ZERO;
                    c.prefill = RoleBounds { min: 1, max: 8 };
                    c.decode = RoleBounds { min: 1, max: 8 };
                    let mut planner = Planner::new(c).unwrap();
                    planner.observe(
                        secs(0),
                        Observation {
                            prefill_nodes: p,
                            decode_nodes: d,
                            prefill_queued_tokens: vec![queued; p as usize],
                            decode_kv_usage: vec![kv; d as usize],
                            ..Observation::default()
                        },
                    );
                    let decision = planner.decide(secs(0));
                    for role in Role::ALL {
                        let r = decision.role(role);
                        if let Reason::BudgetClamp {
                            wanted, because, ..
                        } = &r.reason
                        {
                            clamped += 1;
                            // The policy wanted growth; the clamp granted less, never a loss.
                            assert!(*wanted > r.observed, "{decision:?}");
                            assert!(r.target >= r.observed && r.target < *wanted, "{decision:?}");
                            assert!(!matches!(**because, Reason::BudgetClamp { .. }));
                        }
                    }
                    // Growth never takes the mesh over budget.
                    let growth = decision.prefill.delta().max(0) + decision.decode.delta().max(0);
                    if growth > 0 {
                        assert!(decision.total_target() <= budget, "{decision:?}");
                    }
                }
            }
        }
    }
    assert!(clamped > 100, "the clamp was exercised {clamped} times");
}

#[test]
fn advisory_mode_reports_but_does_not_act() {
    let mut c = config();
    c.advisory = true;
    let mut planner = Planner::new(c).unwrap();
    let mut mesh = Mesh {
        prefill: 1,
        decode: 1,
    };
    let load = |_| Load {
        queued_tokens: 5.0 * CTX as f64,
        ..Load::default()
    };
    let decisions = run(&mut planner, &mut mesh, secs(0), 60, load);
    assert_eq!(decisions.len(), 12);
    for d in &decisions {
        // The same advice every interval, from the counts that are, with no cooldown.
        assert!(d.advisory && d.is_change() && !d.acted());
        assert_eq!((d.prefill.observed, d.prefill.target), (1, 2));
        assert!(matches!(d.prefill.reason, Reason::PrefillQueueHigh { .. }));
    }
    assert_eq!((mesh.prefill, mesh.decode), (1, 1));
}

#[test]
fn a_scale_down_works_after_a_manual_edit() {
    let mut planner = Planner::new(config()).unwrap();
    let mut mesh = Mesh {
        prefill: 1,
        decode: 1,
    };
    // The planner grows decode to 2.
    let busy = |_| Load {
        kv_nodes: 1.2,
        ..Load::default()
    };
    run(&mut planner, &mut mesh, secs(0), 10, busy);
    assert_eq!(mesh.decode, 2);
    // An operator scales decode to 5 by hand, and the load goes away.
    mesh.decode = 5;
    let decisions = run(&mut planner, &mut mesh, secs(10), 120, |_| Load::default());
    let first_down = decisions
        .iter()
        .find(|d| d.decode.direction() == Direction::Down)
        .expect("a scale-down");
    // From the 5 observed, not the 2 it last asked for.
    assert_eq!(
        (first_down.decode.observed, first_down.decode.target),
        (5, 4)
    );
    run(&mut planner, &mut mesh, secs(130), 600, |_| Load::default());
    assert_eq!(mesh.decode, 1);
}

#[test]
fn a_role_switch_is_chosen_when_prefill_is_over_and_decode_under_at_full_budget() {
    let mut c = config();
    c.budget = 4;
    let mut planner = Planner::new(c.clone()).unwrap();
    let mut mesh = Mesh {
        prefill: 2,
        decode: 2,
    };
    let load = |_| Load {
        queued_tokens: 2.5 * CTX as f64,
        kv_nodes: 0.2,
        ..Load::default()
    };
    let decisions = run(&mut planner, &mut mesh, secs(0), 60, load);
    // Decode's nodes are below the down threshold and one carries both's KV: it lends one
    // at once, though it has not been low for the stable time, and the budget holds.
    let first = &decisions[0];
    assert_eq!(first.switches.decode_to_prefill, 1);
    assert_eq!(first.switches.prefill_to_decode, 0);
    assert_eq!((first.prefill.target, first.decode.target), (3, 1));
    assert!(matches!(
        first.decode.reason,
        Reason::Lent { nodes: 1, ref because } if **because == Reason::Hold
    ));
    assert_eq!((mesh.prefill, mesh.decode), (3, 1));

    // Without role switching, prefill's growth is cut by the budget until decode has been
    // low long enough, then reached by a stop and a start.
    c.allow_role_switch = false;
    let mut planner = Planner::new(c).unwrap();
    let mut mesh = Mesh {
        prefill: 2,
        decode: 2,
    };
    let decisions = run(&mut planner, &mut mesh, secs(0), 60, load);
    assert!(matches!(
        decisions[0].prefill.reason,
        Reason::BudgetClamp {
            wanted: 3,
            budget: 4,
            ..
        }
    ));
    assert_eq!(decisions[0].prefill.direction(), Direction::Hold);
    let change = decisions.iter().find(|d| d.acted()).unwrap();
    assert_eq!(change.switches, Default::default());
    assert!(change.at >= secs(30), "{change:?}");
    assert_eq!((mesh.prefill, mesh.decode), (3, 1));
}

/// Below the budget, a role that grows takes a node the other would remove instead of
/// starting one: fewer node-seconds than a start now and a removal after the stable time.
#[test]
fn a_growing_role_takes_a_node_the_other_would_remove() {
    let load = |_| Load {
        queued_tokens: 2.5 * CTX as f64,
        // 0.4 a node on 3, below the down threshold; 0.6 on 2, above it.
        kv_nodes: 1.2,
        ..Load::default()
    };
    let node_seconds = |allow_role_switch: bool| {
        let mut c = config();
        c.allow_role_switch = allow_role_switch;
        let mut planner = Planner::new(c).unwrap();
        let mut mesh = Mesh {
            prefill: 2,
            decode: 3,
        };
        let mut seconds = 0;
        let mut decisions = Vec::new();
        for s in 0..60 {
            decisions.extend(run(&mut planner, &mut mesh, secs(s), 1, load));
            seconds += mesh.prefill + mesh.decode;
        }
        (seconds, decisions, mesh.prefill, mesh.decode)
    };
    let (switched, decisions, p, d) = node_seconds(true);
    let first = &decisions[0];
    assert_eq!(first.switches.decode_to_prefill, 1);
    assert!(matches!(first.decode.reason, Reason::Lent { nodes: 1, .. }));
    assert_eq!((p, d), (3, 2));
    let (fixed, decisions, p, d) = node_seconds(false);
    assert_eq!(decisions[0].switches, Default::default());
    assert_eq!(
        (decisions[0].prefill.target, decisions[0].decode.target),
        (3, 3)
    );
    assert_eq!((p, d), (3, 2));
    assert!(switched < fixed, "{switched} node-seconds against {fixed}");
}

/// A role lends nothing its policy would keep, or that the consolidation check refuses.
#[test]
fn a_role_lends_only_nodes_it_can_spare() {
    let planner_with = |kv_nodes: f64| {
        let mut planner = Planner::new(config()).unwrap();
        let mesh = Mesh {
            prefill: 2,
            decode: 2,
        };
        let load = Load {
            queued_tokens: 2.5 * CTX as f64,
            kv_nodes,
            ..Load::default()
        };
        planner.observe(secs(0), mesh.observe(&load));
        planner.decide(secs(0))
    };
    // Decode nodes at 0.6 each: above the down threshold (0.5), the policy keeps them.
    let d = planner_with(1.2);
    assert_eq!(d.switches, Default::default());
    assert_eq!((d.prefill.target, d.decode.target), (3, 2));
    // Below it, a lone node would be at the up threshold (0.45 + 0.45): refused.
    let d = planner_with(0.9);
    assert_eq!(d.switches, Default::default());
    assert_eq!((d.prefill.target, d.decode.target), (3, 2));
    // At the decode minimum nothing is lent.
    let mut c = config();
    c.decode.min = 2;
    let mut planner = Planner::new(c).unwrap();
    let mesh = Mesh {
        prefill: 2,
        decode: 2,
    };
    planner.observe(
        secs(0),
        mesh.observe(&Load {
            queued_tokens: 2.5 * CTX as f64,
            kv_nodes: 0.2,
            ..Load::default()
        }),
    );
    let d = planner.decide(secs(0));
    assert_eq!(d.switches, Default::default());
    assert_eq!(d.decode.target, 2);
}

#[test]
fn a_lost_node_is_replaced_at_once() {
    let mut planner = Planner::new(config()).unwrap();
    let mut mesh = Mesh {
        prefill: 2,
        decode: 2,
    };
    // Up one decode node (starting its cooldown), then both prefill nodes crash.
    run(&mut planner, &mut mesh, secs(0), 1, |_| Load {
        kv_nodes: 2.0,
        ..Load::default()
    });
    mesh.prefill = 0;
    planner.observe(secs(5), mesh.observe(&Load::default()));
    let d = planner.decide(secs(5));
    assert_eq!((d.prefill.observed, d.prefill.target), (0, 1));
    assert_eq!(d.prefill.reason, Reason::BelowMinimum { min: 1 });
}

#[test]
fn decisions_are_due_once_per_interval_and_need_fresh_observations() {
    let mut planner = Planner::new(config()).unwrap();
    let d = planner.decide(secs(0));
    assert_eq!(d.prefill.reason, Reason::NoObservation);
    let mesh = Mesh {
        prefill: 1,
        decode: 1,
    };
    planner.observe(secs(0), mesh.observe(&Load::default()));
    planner.decide(secs(0));
    planner.observe(secs(1), mesh.observe(&Load::default()));
    let d = planner.decide(secs(2));
    assert_eq!(d.prefill.reason, Reason::NotDue { next: secs(5) });
    assert_eq!(planner.decide(secs(5)).prefill.reason, Reason::Hold);
    assert_eq!(
        planner.decide(secs(10)).prefill.reason,
        Reason::NoObservation
    );
}

/// The prefill role may go to zero: idle, the last prefill node goes; prompt tokens queued
/// on the decode nodes (which prefill everything then) bring one back.
#[test]
fn prefill_goes_to_zero_when_idle_and_returns_when_decode_nodes_queue_prompts() {
    let mut c = config();
    c.prefill.min = 0;
    c.decode.min = 2;
    let mut planner = Planner::new(c).unwrap();
    let mut mesh = Mesh {
        prefill: 3,
        decode: 2,
    };
    let idle = Load {
        kv_nodes: 0.4,
        ..Load::default()
    };
    let decisions = run(&mut planner, &mut mesh, secs(0), 600, |_| idle);
    assert_eq!(mesh.prefill, 0);
    let last_prefill = decisions
        .iter()
        .rfind(|d| d.acted() && d.prefill.delta() != 0)
        .unwrap();
    assert_eq!(
        (last_prefill.prefill.observed, last_prefill.prefill.target),
        (1, 0)
    );
    assert!(matches!(
        last_prefill.prefill.reason,
        Reason::PrefillQueueLow { .. }
    ));

    // Three context lengths of prompts queued over two decode nodes: 1.5 each.
    let busy = Load {
        queued_tokens: 3.0 * CTX as f64,
        kv_nodes: 0.4,
        ..Load::default()
    };
    let decisions = run(&mut planner, &mut mesh, secs(600), 60, |_| busy);
    let first = decisions.iter().find(|d| d.acted()).unwrap();
    assert_eq!((first.prefill.observed, first.prefill.target), (0, 1));
    assert!(matches!(
        first.prefill.reason,
        Reason::PrefillQueueHigh {
            queued_tokens: 1500,
            ..
        }
    ));
    assert!(first.at <= secs(600 + 5), "first decision due at once");
    assert!(mesh.prefill >= 1);
}

/// The last prefill node stays while prompt tokens wait anywhere: every engine's queue
/// must be low, and the decode nodes must be able to take what the prefill node holds.
#[test]
fn the_last_prefill_node_stays_while_prompts_are_queued() {
    let mut c = config();
    c.prefill.min = 0;
    let obs = |prefill: u64, decode: [u64; 2]| Observation {
        prefill_queued_tokens: vec![prefill],
        decode_queued_prompt_tokens: decode.to_vec(),
        decode_kv_usage: vec![0.6, 0.6],
        prefill_nodes: 1,
        decode_nodes: 2,
        ..Observation::default()
    };
    let decide_after = |o: Observation| {
        let mut planner = Planner::new(c.clone()).unwrap();
        for s in (0..=60).step_by(5) {
            planner.observe(secs(s), o.clone());
        }
        planner.decide(secs(60)).prefill
    };
    // A decode node's local queue above the down threshold (0.1 context lengths): not idle.
    let held = decide_after(obs(0, [300, 0]));
    assert_eq!(held.target, 1);
    assert_eq!(held.reason, Reason::Hold);
    // Every queue below it, but together more than the decode nodes would hold below it.
    let refused = decide_after(obs(90, [90, 90]));
    assert_eq!(refused.target, 1);
    match refused.reason {
        Reason::ConsolidationRefused {
            wanted: 0,
            metric: Metric::QueuedPrefillTokens,
            projected,
            limit,
            ..
        } => {
            assert_eq!(projected, 135.0);
            assert_eq!(limit, 100.0);
        }
        r => panic!("{r:?}"),
    }
    let removed = decide_after(obs(60, [50, 50]));
    assert_eq!(removed.target, 0);
}

/// A role that grew lends nothing for `cooldown.down`: two roles near their thresholds do
/// not pass a node back and forth.
#[test]
fn a_role_that_just_grew_lends_nothing() {
    let mut planner = Planner::new(config()).unwrap();
    let mut mesh = Mesh {
        prefill: 2,
        decode: 2,
    };
    // Decode's KV high: it grows to 3 (prefill's queue between its thresholds: it lends
    // nothing).
    let high = |_| Load {
        queued_tokens: 0.5 * CTX as f64,
        kv_nodes: 1.9,
        ..Load::default()
    };
    let d = run(&mut planner, &mut mesh, secs(0), 1, high);
    assert_eq!((d[0].decode.target, mesh.decode), (3, 3));
    // Then the KV falls below the down threshold and prefill's queue rises: prefill starts
    // a node while decode's growth is less than 30 s old, and takes one of decode's after.
    let turned = |_| Load {
        queued_tokens: 4.0 * CTX as f64,
        kv_nodes: 0.9,
        ..Load::default()
    };
    let decisions = run(&mut planner, &mut mesh, secs(10), 30, turned);
    let acted: Vec<_> = decisions.iter().filter(|d| d.acted()).collect();
    assert_eq!(acted[0].at, secs(10));
    assert_eq!(acted[0].switches, Default::default());
    assert_eq!((acted[0].prefill.target, acted[0].decode.target), (3, 3));
    let lent = acted
        .iter()
        .find(|d| d.switches.decode_to_prefill > 0)
        .expect("a lend once the cooldown has passed");
    assert!(lent.at >= secs(30), "{lent:?}");
    assert!(matches!(lent.decode.reason, Reason::Lent { nodes: 1, .. }));
}

/// With `cooldown.lend_stable_for`, a role lends only what has been below its down threshold
/// that long: one low reading after a busy spell is not a spare node.
#[test]
fn a_role_lends_only_after_low_readings_for_the_lend_stable_time() {
    // Prefill's queue between its thresholds until `turn`, then high; decode's KV low from
    // `low_from` on (0.4 a node on 2 before: above the down threshold of 0.3, and one node
    // would carry both's below the up threshold, so the consolidation check passes).
    let decisions_with = |lend_stable_for: u64, low_from: u64| {
        let mut c = config();
        c.load.kv_usage_down = 0.3;
        c.cooldown.lend_stable_for = secs(lend_stable_for);
        let mut planner = Planner::new(c).unwrap();
        let mut mesh = Mesh {
            prefill: 2,
            decode: 2,
        };
        let turn = 20;
        let load = move |now: Duration| Load {
            queued_tokens: if now >= secs(turn) { 2.5 } else { 0.5 } * CTX as f64,
            kv_nodes: if now >= secs(low_from) { 0.2 } else { 0.8 },
            ..Load::default()
        };
        run(&mut planner, &mut mesh, secs(0), 21, load)
            .into_iter()
            .find(|d| d.at == secs(turn))
            .expect("a decision at the turn")
    };
    // Low for 15 s of a 10 s lend stable time: lent.
    let d = decisions_with(10, 5);
    assert_eq!(d.switches.decode_to_prefill, 1, "{d:?}");
    assert!(matches!(d.decode.reason, Reason::Lent { nodes: 1, .. }));
    // Low for one reading only: prefill starts a node, decode keeps both.
    let d = decisions_with(10, 20);
    assert_eq!(d.switches, Default::default(), "{d:?}");
    assert_eq!((d.prefill.target, d.decode.target), (3, 2));
    // Without a lend stable time, that one reading lends.
    let d = decisions_with(0, 20);
    assert_eq!(d.switches.decode_to_prefill, 1, "{d:?}");
}
