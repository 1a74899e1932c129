//! The SLO policy's `swing_headroom` over a fluid mesh in virtual time: a scale-down keeps
//! free the spread of a role's demand swings over a node's start-up, beyond the noise.

mod common;

use common::{run, Load, Mesh};
use kvmesh_planner::{
    Decision, Planner, PlannerConfig, PredictorConfig, Reason, Role, SwingHeadroom,
};
use std::time::Duration;

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// The SLO tests' planner (20 req/s of 2,000-token prompts need 2.62 prefill nodes at the
/// planned 15,255 tokens/s a node), with a swing headroom.
fn config() -> PlannerConfig {
    let mut c = common::config(PredictorConfig::Constant);
    c.slo.swing_headroom = Some(SwingHeadroom {
        over: secs(30),
        remember: secs(300),
        noise: 0.07,
        deviations: 1.0,
        max: 0.5,
    });
    c
}

fn requests(rate: f64) -> Load {
    Load {
        arrival_rate: rate,
        prompt: 2000.0,
        output: 200.0,
        ..Load::default()
    }
}

/// The headroom of the plan behind a role's decision, through any override.
fn headroom(reason: &Reason) -> Option<f64> {
    match reason {
        Reason::PredictedDemand { headroom, .. } => Some(*headroom),
        Reason::ConsolidationRefused { because, .. }
        | Reason::Cooldown { because, .. }
        | Reason::RoleLimit { because, .. }
        | Reason::Lent { because, .. }
        | Reason::BudgetClamp { because, .. } => headroom(because),
        _ => None,
    }
}

fn headrooms(decisions: &[Decision], role: Role) -> Vec<f64> {
    decisions
        .iter()
        .filter_map(|d| headroom(&d.role(role).reason))
        .collect()
}

/// A ramp from 10 to 20 req/s over ten minutes moves the demand under 5% from one 30 s
/// span to the next, within the noise: no headroom, and the counts follow the plan up.
/// The same ramp within 40 s is a swing.
#[test]
fn a_smooth_ramp_gets_no_headroom_a_fast_one_does() {
    let ramp = |over_s: f64| {
        move |now: Duration| requests(10.0 + 10.0 * (now.as_secs_f64() / over_s).min(1.0))
    };
    let mut planner = Planner::new(config()).unwrap();
    let mut mesh = Mesh {
        prefill: 2,
        decode: 2,
    };
    let decisions = run(&mut planner, &mut mesh, secs(0), 600, ramp(600.0));
    for role in Role::ALL {
        let h = headrooms(&decisions, role);
        assert_eq!(h.len(), decisions.len());
        assert!(h.iter().all(|&h| h == 0.0), "{role:?}: {h:?}");
    }
    assert_eq!(mesh.prefill, 3);

    let mut planner = Planner::new(config()).unwrap();
    let mut mesh = Mesh {
        prefill: 2,
        decode: 2,
    };
    let decisions = run(&mut planner, &mut mesh, secs(0), 120, ramp(40.0));
    let largest = headrooms(&decisions, Role::Prefill)
        .into_iter()
        .fold(0.0, f64::max);
    // The plans 10 s apart see their window's mean: 11.75 req/s over the three plans to 20 s
    // against 18.4 over the three to 50 s, a swing of 0.36 (0.355 beyond the noise).
    assert!(largest > 0.3 && largest < 0.5, "{largest}");
}

/// A demand that swings between 20 and 30 req/s every 30 s (each plan's window at one rate)
/// gets a headroom on both roles. When it settles at 20 req/s (2.62 prefill nodes' demand),
/// a scale-down from 6 prefill nodes holds at 4 while the swings are remembered, and goes
/// to the plan's 3 once they are forgotten.
#[test]
fn a_scale_down_holds_within_the_headroom_of_a_swinging_demand() {
    let swinging = |now: Duration| {
        // The plan at 10 w s sees the observations after 10 (w - 1) s up to it.
        let window = now.as_secs().div_ceil(10);
        if window < 18 && (window / 3) % 2 == 1 {
            requests(30.0)
        } else {
            requests(20.0)
        }
    };
    let mut planner = Planner::new(config()).unwrap();
    let mut mesh = Mesh {
        prefill: 6,
        decode: 3,
    };
    // The first swing alone (at 50 s, 30 against 20 req/s): its share beyond the noise.
    let first = ((1.0f64 / 3.0).powi(2) - 0.07 * 0.07).sqrt();
    let swung = run(&mut planner, &mut mesh, secs(0), 180, swinging);
    for role in Role::ALL {
        let largest = headrooms(&swung, role).into_iter().fold(0.0, f64::max);
        assert!((largest - first).abs() < 1e-9, "{role:?}: {largest}");
    }
    // Settled for two minutes: the stabilization window has long passed, the swings are
    // still remembered, and a headroom between 0.127 and 0.345 keeps 4 nodes.
    let settled = run(&mut planner, &mut mesh, secs(180), 120, swinging);
    let last = headroom(&settled.last().unwrap().prefill.reason).unwrap();
    assert!(last > 0.127 && last < 0.345, "{last}");
    assert_eq!(mesh.prefill, 4, "{:?}", settled.last());
    // Five minutes after the last swing the headroom is gone and the count follows the plan.
    let after = run(&mut planner, &mut mesh, secs(300), 300, swinging);
    assert_eq!(mesh.prefill, 3, "{:?}", after.last());
    assert_eq!(headroom(&after.last().unwrap().prefill.reason), Some(0.0));
}

/// The swing headroom and the fixed one: the larger is kept.
#[test]
fn the_fixed_headroom_is_a_floor_under_the_swing() {
    let mut c = config();
    c.slo.scale_down_headroom = 0.2;
    let mut planner = Planner::new(c).unwrap();
    let mut mesh = Mesh {
        prefill: 6,
        decode: 3,
    };
    let decisions = run(&mut planner, &mut mesh, secs(0), 200, |_| requests(20.0));
    let h = headrooms(&decisions, Role::Prefill);
    assert!(h.iter().all(|&h| h == 0.2), "{h:?}");
    // 2.62 nodes' demand within 80%: 3.28, so 4.
    assert_eq!(mesh.prefill, 4);
}
