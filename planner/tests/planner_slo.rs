//! The SLO policy over a fluid mesh in virtual time.

mod common;

use common::{coefficients, config, direction_changes, run, Load, Mesh};
use kvmesh_planner::{
    Direction, LatencyQuantiles, Metric, Observation, PerfCoefficients, Planner, PredictorConfig,
    Reason, Role, StepSample,
};
use std::time::Duration;

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// 20 req/s of 2,000-token prompts and 200-token answers. By hand, with the coefficients:
/// prefill steps of 2,048 tokens take 0.1074 s (TTFT 0.215 s <= 0.25 s), 19,069 tokens/s a
/// node, 15,255 at 80%: 40,000 tokens/s need 3 nodes. Decode: 310 us a sequence of 2,100
/// tokens' context, (50,000 - 5,000) / 310 = 145 a batch, a step of 49.95 ms; Little:
/// 20 * 200 * 0.04995 = 199.8 sequences in flight, 2 nodes.
fn busy(_: Duration) -> Load {
    Load {
        arrival_rate: 20.0,
        prompt: 2000.0,
        output: 200.0,
        ..Load::default()
    }
}

fn idle(_: Duration) -> Load {
    Load {
        prompt: 2000.0,
        output: 200.0,
        ..Load::default()
    }
}

#[test]
fn the_replica_formulas_match_the_hand_computation() {
    let mut planner = Planner::new(config(PredictorConfig::Constant)).unwrap();
    let mesh = Mesh {
        prefill: 1,
        decode: 1,
    };
    planner.observe(secs(0), mesh.observe(&busy(secs(0))));
    let d = planner.decide(secs(0));
    assert_eq!((d.prefill.target, d.decode.target), (3, 2));
    match d.prefill.reason {
        Reason::PredictedDemand {
            demand,
            per_replica,
            correction,
            replicas,
            meets_target,
            headroom,
        } => {
            assert_eq!(demand, 40_000.0);
            assert!((per_replica - 0.8 * 2048.0 / 0.1074).abs() < 1e-6);
            assert_eq!((correction, replicas, meets_target), (1.0, 3, true));
            assert_eq!(headroom, 0.0);
        }
        ref other => panic!("{other:?}"),
    }
    match d.decode.reason {
        Reason::PredictedDemand {
            demand,
            per_replica,
            replicas,
            ..
        } => {
            assert!((demand - 199.8).abs() < 1e-6);
            assert_eq!((per_replica, replicas), (145.0, 2));
        }
        ref other => panic!("{other:?}"),
    }
}

#[test]
fn a_load_step_is_met_within_a_bounded_number_of_decisions() {
    for (predictor, bound) in [
        (PredictorConfig::Constant, 2),
        (PredictorConfig::Ewma { alpha: 0.5 }, 4),
        (
            PredictorConfig::Kalman {
                process_noise: 1.0,
                measurement_noise: 1.0,
            },
            4,
        ),
    ] {
        let mut planner = Planner::new(config(predictor.clone())).unwrap();
        let mut mesh = Mesh {
            prefill: 1,
            decode: 1,
        };
        run(&mut planner, &mut mesh, secs(0), 60, idle);
        assert_eq!((mesh.prefill, mesh.decode), (1, 1));
        let decisions = run(&mut planner, &mut mesh, secs(60), 300, busy);
        let met = decisions
            .iter()
            .position(|d| d.prefill.target >= 3 && d.decode.target >= 2)
            .map(|i| i + 1);
        assert!(
            met.is_some_and(|n| n <= bound),
            "{predictor:?}: met after {met:?} decisions"
        );
        // And it settles where the formulas say (the Kalman may overshoot once and return).
        assert_eq!((mesh.prefill, mesh.decode), (3, 2), "{predictor:?}");
    }
}

#[test]
fn idle_scales_down_to_the_minimum_and_never_below_one() {
    let mut planner = Planner::new(config(PredictorConfig::Constant)).unwrap();
    let mut mesh = Mesh {
        prefill: 6,
        decode: 6,
    };
    let decisions = run(&mut planner, &mut mesh, secs(0), 600, idle);
    assert_eq!((mesh.prefill, mesh.decode), (1, 1));
    assert!(decisions
        .iter()
        .all(|d| d.prefill.target >= 1 && d.decode.target >= 1));
    assert_eq!(direction_changes(&decisions, Role::Prefill), 0);
    // The first scale-down waits out the stabilization window.
    let first = decisions.iter().position(|d| d.acted()).unwrap();
    assert!(decisions[first].at >= secs(30), "{:?}", decisions[first]);
}

#[test]
fn a_scale_down_goes_only_as_far_as_the_running_load_allows() {
    let mut c = config(PredictorConfig::Constant);
    c.cooldown.down_stable_for = Duration::ZERO;
    // The consolidation check alone (the running floor would want the same 3 nodes).
    c.slo.running_floor = false;
    let mut planner = Planner::new(c).unwrap();
    // Arrivals stopped, but 400 sequences still decode on 4 nodes: 1 node would hold 400,
    // 2 would hold 200, both above the 145 a node decodes within ITL; 3 hold 133.
    let mesh = Mesh {
        prefill: 1,
        decode: 4,
    };
    planner.observe(
        secs(0),
        mesh.observe(&Load {
            running: 400.0,
            ..idle(secs(0))
        }),
    );
    let d = planner.decide(secs(0));
    assert_eq!((d.decode.observed, d.decode.target), (4, 3));
    assert!(matches!(
        d.decode.reason,
        Reason::PredictedDemand { replicas: 1, .. }
    ));

    // On 2 nodes with 300 running, no smaller count is safe: refused.
    let mut c = config(PredictorConfig::Constant);
    c.cooldown.down_stable_for = Duration::ZERO;
    c.slo.running_floor = false;
    let mut planner = Planner::new(c).unwrap();
    let mesh = Mesh {
        prefill: 1,
        decode: 2,
    };
    planner.observe(
        secs(0),
        mesh.observe(&Load {
            running: 300.0,
            ..idle(secs(0))
        }),
    );
    let d = planner.decide(secs(0));
    assert_eq!(d.decode.direction(), Direction::Hold);
    match d.decode.reason {
        Reason::ConsolidationRefused {
            wanted: 1,
            metric: Metric::DecodeBatch,
            projected,
            limit,
            ..
        } => assert_eq!((projected, limit), (300.0, 145.0)),
        ref other => panic!("{other:?}"),
    }
}

#[test]
fn observed_latency_above_the_model_adds_capacity_within_the_clamp() {
    let decode_target = |itl_ratio: f64| {
        let mut planner = Planner::new(config(PredictorConfig::Constant)).unwrap();
        let mesh = Mesh {
            prefill: 3,
            decode: 2,
        };
        let mut obs = mesh.observe(&Load {
            running: 200.0,
            ..busy(secs(0))
        });
        // The model's step at 100 sequences of 2,100 tokens' context: 36 ms.
        let predicted = 5000.0 + 100.0 * 310.0;
        let itl = Duration::from_secs_f64(predicted * itl_ratio / 1e6);
        obs.itl = Some(LatencyQuantiles {
            p50: itl,
            p99: itl * 2,
        });
        planner.observe(secs(0), obs);
        let d = planner.decide(secs(0));
        let Reason::PredictedDemand { correction, .. } = d.decode.reason else {
            return (d.decode.target, 1.0);
        };
        (d.decode.target, correction)
    };
    assert_eq!(decode_target(1.0), (2, 1.0));
    let (slow, k) = decode_target(2.0);
    assert!((k - 2.0).abs() < 1e-9);
    // ITL budget halves: batch (25,000 - 5,000) / 310 = 64 -> step 24.8 ms * 2 = 49.7 ms;
    // 20 * 200 * 0.0497 = 198.8 in flight / 64 = 4 nodes.
    assert_eq!(slow, 4);
    // Ten times slower is clamped to twice.
    assert_eq!(decode_target(10.0), (4, 2.0));
}

#[test]
fn the_perf_model_learns_from_measured_steps() {
    let truth = PerfCoefficients {
        step_overhead_us: 8000.0,
        prefill_per_token_us: 90.0,
        prefill_per_cached_token_us: 0.0,
        decode_per_seq_us: 150.0,
        decode_per_context_token_us: 0.2,
    };
    let time = |p: u64, s: u64, c: u64| {
        Duration::from_secs_f64(
            (truth.step_overhead_us
                + truth.prefill_per_token_us * p as f64
                + truth.decode_per_seq_us * s as f64
                + truth.decode_per_context_token_us * c as f64)
                / 1e6,
        )
    };
    let mut planner = Planner::new(config(PredictorConfig::Constant)).unwrap();
    let mesh = Mesh {
        prefill: 3,
        decode: 2,
    };
    for i in 0..30u64 {
        let mut obs = mesh.observe(&busy(secs(i)));
        for j in 0..4u64 {
            let (p, s, c) = (
                512 + 256 * ((i + j) % 8),
                8 + 9 * j + i % 5,
                4000 * (1 + j + i % 7),
            );
            obs.steps.push(StepSample {
                prefill_tokens: p,
                duration: time(p, 0, 0),
                ..StepSample::default()
            });
            obs.steps.push(StepSample {
                decode_seqs: s,
                decode_context_tokens: c,
                duration: time(0, s, c),
                ..StepSample::default()
            });
        }
        planner.observe(secs(i), obs);
    }
    // Sized with the old coefficients until a decision refits the model.
    assert_eq!(planner.perf_model().unwrap().coefficients(), coefficients());
    planner.decide(secs(30));
    let got = planner.perf_model().unwrap().coefficients();
    assert!((got.prefill_per_token_us - 90.0).abs() < 0.01, "{got:?}");
    assert!((got.decode_per_seq_us - 150.0).abs() < 0.1, "{got:?}");
    assert!((got.step_overhead_us - 8000.0).abs() < 1.0, "{got:?}");
}

#[test]
fn the_kalman_predictor_leads_a_ramp_where_a_constant_lags() {
    let ramp = |now: Duration| Load {
        arrival_rate: 2.0 + now.as_secs_f64() / 10.0,
        prompt: 2000.0,
        output: 200.0,
        ..Load::default()
    };
    let plan = |predictor: PredictorConfig| {
        let mut planner = Planner::new(config(predictor)).unwrap();
        let mut mesh = Mesh {
            prefill: 1,
            decode: 1,
        };
        let decisions = run(&mut planner, &mut mesh, secs(0), 240, ramp);
        let Reason::PredictedDemand { demand, .. } = decisions.last().unwrap().prefill.reason
        else {
            panic!("{decisions:?}")
        };
        demand
    };
    let kalman = plan(PredictorConfig::Kalman {
        process_noise: 0.01,
        measurement_noise: 0.01,
    });
    let constant = plan(PredictorConfig::Constant);
    // The last decision's window (221..=230 s) averaged 24.55 req/s; the next one (231..=240)
    // will average 25.55.
    assert!((constant - 24.55 * 2000.0).abs() < 1.0, "{constant}");
    assert!(
        (kalman - 25.55 * 2000.0).abs() < 0.01 * 25.55 * 2000.0,
        "{kalman}"
    );
}

#[test]
fn an_observation_without_latencies_or_nodes_reporting_still_decides() {
    let mut planner = Planner::new(config(PredictorConfig::Constant)).unwrap();
    planner.observe(
        secs(0),
        Observation {
            prefill_nodes: 2,
            decode_nodes: 2,
            ..Observation::default()
        },
    );
    let d = planner.decide(secs(0));
    assert_eq!((d.prefill.observed, d.decode.observed), (2, 2));
    assert!(d.prefill.target >= 1 && d.decode.target >= 1);
}

/// At light load the observed TTFT is a request's own steps, far below the prediction that
/// includes queueing; by default that does not credit nodes with more throughput: the
/// correction stays at 1 and the count is the model's.
#[test]
fn a_fast_observed_latency_does_not_shrink_the_sizing_by_default() {
    let mut planner = Planner::new(config(PredictorConfig::Constant)).unwrap();
    let mesh = Mesh {
        prefill: 3,
        decode: 2,
    };
    let mut obs = mesh.observe(&busy(secs(0)));
    obs.ttft = Some(LatencyQuantiles {
        p50: Duration::from_millis(20),
        p99: Duration::from_millis(40),
    });
    planner.observe(secs(0), obs);
    let d = planner.decide(secs(0));
    let Reason::PredictedDemand {
        correction,
        replicas,
        ..
    } = d.prefill.reason
    else {
        panic!("{:?}", d.prefill.reason);
    };
    assert_eq!((correction, replicas), (1.0, 3));
}

/// With a prefill minimum of 0, idle takes the prefill role to zero (the decode nodes
/// prefill what comes), and demand brings it back: predicted, or queued on decode nodes.
#[test]
fn prefill_goes_to_zero_at_idle_and_returns_with_demand() {
    let mut c = config(PredictorConfig::Constant);
    c.prefill.min = 0;
    let mut planner = Planner::new(c.clone()).unwrap();
    let mut mesh = Mesh {
        prefill: 2,
        decode: 2,
    };
    let decisions = run(&mut planner, &mut mesh, secs(0), 300, idle);
    assert_eq!((mesh.prefill, mesh.decode), (0, 1));
    assert!(decisions.iter().any(|d| d.acted() && d.prefill.target == 0));
    // The busy load brings prefill back at the next decision (its window mostly idle),
    // and to its 3 nodes at the one after.
    let decisions = run(&mut planner, &mut mesh, secs(300), 60, busy);
    let first = decisions.iter().find(|d| d.acted()).unwrap();
    assert_eq!(first.prefill.observed, 0);
    assert!(first.prefill.target >= 1);
    assert!(first.at <= secs(300));
    assert_eq!(mesh.prefill, 3);

    // No arrivals predicted, but prompts queued on the decode node (a context length of
    // the default 8,192): one prefill node.
    let mut planner = Planner::new(c.clone()).unwrap();
    let queued = Observation {
        mean_prompt_tokens: 2000.0,
        mean_output_tokens: 200.0,
        decode_queued_prompt_tokens: vec![1000],
        decode_running: vec![1],
        decode_kv_usage: vec![0.1],
        decode_nodes: 1,
        ..Observation::default()
    };
    planner.observe(secs(0), queued.clone());
    let d = planner.decide(secs(0));
    assert_eq!((d.prefill.observed, d.prefill.target), (0, 1));
    // Below the load policy's down threshold (819 tokens), it stays at zero.
    let mut planner = Planner::new(c).unwrap();
    planner.observe(
        secs(0),
        Observation {
            decode_queued_prompt_tokens: vec![500],
            ..queued
        },
    );
    assert_eq!(planner.decide(secs(0)).prefill.target, 0);
}

/// The last prefill node stays while its own queue holds prompt tokens, though no arrivals
/// are predicted.
#[test]
fn the_last_prefill_node_stays_while_prompts_are_queued() {
    let mut c = config(PredictorConfig::Constant);
    c.prefill.min = 0;
    c.cooldown.down_stable_for = secs(0);
    let mut planner = Planner::new(c).unwrap();
    let obs = |queued: u64| Observation {
        mean_prompt_tokens: 2000.0,
        mean_output_tokens: 200.0,
        prefill_queued_tokens: vec![queued],
        decode_running: vec![1],
        decode_kv_usage: vec![0.1],
        prefill_nodes: 1,
        decode_nodes: 1,
        ..Observation::default()
    };
    planner.observe(secs(0), obs(0));
    let d = planner.decide(secs(0));
    assert_eq!(d.prefill.target, 0, "{:?}", d.prefill.reason);
    let mut planner = Planner::new(planner.config().clone()).unwrap();
    planner.observe(secs(0), obs(900));
    let d = planner.decide(secs(0));
    assert_eq!(d.prefill.target, 1);
}

/// The mix turns from 20 req/s with 200-token answers to 28 req/s with 70-token answers
/// (2,000-token prompts): prefill needs 4 nodes (56,000 tokens/s over 15,255 a node), decode
/// 1 (28 * 70 * 49.9 ms = 97.8 sequences in flight, 148 a node). Decode lends its node at
/// once instead of holding it through the stabilization window while prefill starts one.
#[test]
fn a_turn_of_the_mix_switches_a_node_instead_of_starting_one() {
    let turned = |now: Duration| {
        if now < secs(60) {
            Load {
                running: 200.0,
                kv_nodes: 0.4,
                ..busy(now)
            }
        } else {
            Load {
                arrival_rate: 28.0,
                prompt: 2000.0,
                output: 70.0,
                running: 100.0,
                kv_nodes: 0.3,
                ..Load::default()
            }
        }
    };
    let node_seconds = |allow_role_switch: bool| {
        let mut c = config(PredictorConfig::Constant);
        c.allow_role_switch = allow_role_switch;
        let mut planner = Planner::new(c).unwrap();
        let mut mesh = Mesh {
            prefill: 3,
            decode: 2,
        };
        let mut seconds = 0;
        let mut decisions = Vec::new();
        for s in 0..180 {
            decisions.extend(run(&mut planner, &mut mesh, secs(s), 1, turned));
            seconds += mesh.prefill + mesh.decode;
        }
        assert_eq!((mesh.prefill, mesh.decode), (4, 1), "{decisions:#?}");
        let changes: Vec<_> = decisions.into_iter().filter(|d| d.acted()).collect();
        (seconds, changes)
    };
    let (switched, changes) = node_seconds(true);
    assert_eq!(changes.len(), 1, "{changes:#?}");
    let turn = &changes[0];
    assert_eq!(turn.at, secs(70), "the first decision after the turn");
    assert_eq!(turn.switches.decode_to_prefill, 1);
    assert!(matches!(
        turn.decode.reason,
        Reason::Lent { nodes: 1, ref because } if matches!(**because, Reason::PredictedDemand { replicas: 1, .. })
    ));
    let (fixed, changes) = node_seconds(false);
    assert!(changes.iter().all(|d| d.switches == Default::default()));
    assert!(
        changes[0].at == secs(70) && changes[0].decode.direction() == Direction::Hold,
        "{changes:#?}"
    );
    assert!(switched < fixed, "{switched} node-seconds against {fixed}");
}

/// A decode role that would drop below its running sequences' batch lends nothing.
#[test]
fn a_role_keeps_the_nodes_its_running_sequences_need() {
    let mut planner = Planner::new(config(PredictorConfig::Constant)).unwrap();
    let mesh = Mesh {
        prefill: 3,
        decode: 2,
    };
    // The turned mix wants 1 decode node, but 200 sequences still run: 1 node would hold
    // 200 against a batch of 148.
    planner.observe(
        secs(0),
        mesh.observe(&Load {
            arrival_rate: 28.0,
            prompt: 2000.0,
            output: 70.0,
            running: 200.0,
            kv_nodes: 0.3,
            ..Load::default()
        }),
    );
    let d = planner.decide(secs(0));
    assert_eq!((d.prefill.target, d.decode.target), (4, 2));
    assert_eq!(d.switches, Default::default());
}

/// Prompt tokens queued now are demand on top of the predicted arrivals: 20,000 tokens to
/// serve within 2 s add 10,000 tokens/s to the 40,000 arriving, 4 nodes at
/// 15,255 a node where the arrivals alone need 3.
#[test]
fn a_backlog_adds_prefill_nodes_to_work_it_off() {
    let prefill_target = |queue_drain: Duration| {
        let mut c = config(PredictorConfig::Constant);
        c.slo.queue_drain = queue_drain;
        let mut planner = Planner::new(c).unwrap();
        let mesh = Mesh {
            prefill: 3,
            decode: 2,
        };
        planner.observe(
            secs(0),
            mesh.observe(&Load {
                queued_tokens: 20_000.0,
                ..busy(secs(0))
            }),
        );
        planner.decide(secs(0)).prefill.target
    };
    assert_eq!(prefill_target(Duration::from_secs(2)), 4);
    assert_eq!(prefill_target(Duration::ZERO), 3);
}

/// The sequences running now are a floor under the predicted ones: answers longer than the
/// completed requests showed so far keep 400 sequences on the nodes where the prediction
/// says 199.8, and 400 need 3 nodes of 145.
#[test]
fn running_sequences_are_a_floor_under_the_decode_sizing() {
    let decode_target = |running_floor: bool| {
        let mut c = config(PredictorConfig::Constant);
        c.slo.running_floor = running_floor;
        let mut planner = Planner::new(c).unwrap();
        let mesh = Mesh {
            prefill: 3,
            decode: 2,
        };
        planner.observe(
            secs(0),
            mesh.observe(&Load {
                running: 400.0,
                kv_nodes: 0.5,
                ..busy(secs(0))
            }),
        );
        planner.decide(secs(0)).decode.target
    };
    assert_eq!(decode_target(true), 3);
    assert_eq!(decode_target(false), 2);
}

/// With `cooldown.lend_stable_for`, decode lends a node only when every plan over that time
/// wanted it gone: a plan or two after a turn of the mix (which may be a burst of short
/// answers) is not a spare node. Answers shorten at `short_from`; prefill's demand rises
/// after 60 s (28 req/s: 4 nodes); the stabilization window (60 s) holds a plain
/// scale-down back, so only a lend takes decode's node.
#[test]
fn a_role_lends_only_what_its_plans_have_wanted_gone_for_the_lend_stable_time() {
    let decision_at_70 = |lend_stable_for: u64, short_from: u64| {
        let mut c = config(PredictorConfig::Constant);
        c.cooldown.down_stable_for = secs(60);
        c.cooldown.lend_stable_for = secs(lend_stable_for);
        let mut planner = Planner::new(c).unwrap();
        let mut mesh = Mesh {
            prefill: 3,
            decode: 2,
        };
        let load = move |now: Duration| {
            let short = now >= secs(short_from);
            Load {
                arrival_rate: if now > secs(60) { 28.0 } else { 20.0 },
                prompt: 2000.0,
                output: if short { 70.0 } else { 200.0 },
                running: if short { 100.0 } else { 200.0 },
                kv_nodes: 0.3,
                ..Load::default()
            }
        };
        run(&mut planner, &mut mesh, secs(0), 71, load)
            .into_iter()
            .find(|d| d.at == secs(70))
            .expect("a decision at 70 s")
    };
    // Plans at 40 to 70 s want 1 decode node; 20 s of them suffice.
    let d = decision_at_70(20, 35);
    assert_eq!((d.prefill.target, d.decode.target), (4, 1), "{d:?}");
    assert_eq!(d.switches.decode_to_prefill, 1);
    // Plans at 60 and 70 s only (50 s still wanted 2): prefill starts a node instead.
    let d = decision_at_70(20, 55);
    assert_eq!((d.prefill.target, d.decode.target), (4, 2), "{d:?}");
    assert_eq!(d.switches, Default::default());
    // Without a lend stable time the latest plan alone lends.
    let d = decision_at_70(0, 55);
    assert_eq!(d.switches.decode_to_prefill, 1, "{d:?}");
}

/// `scale_down_headroom` keeps room for a burst: growth sizes at the plan, a scale-down
/// goes only to a count the demand fills within `1 - headroom`. The busy load needs 2.62
/// prefill nodes at the planned 15,255 tokens/s a node (3), and 3.28 within 80% of it.
#[test]
fn a_scale_down_keeps_the_headroom_growth_does_not_add() {
    let settle = |headroom: f64, prefill: u32| {
        let mut c = config(PredictorConfig::Constant);
        c.slo.scale_down_headroom = headroom;
        let mut planner = Planner::new(c).unwrap();
        let mut mesh = Mesh { prefill, decode: 2 };
        run(&mut planner, &mut mesh, secs(0), 300, busy);
        mesh.prefill
    };
    // From 4 nodes: without headroom it goes to 3; with 20% it keeps 4.
    assert_eq!(settle(0.0, 4), 3);
    assert_eq!(settle(0.2, 4), 4);
    // From 2 nodes both grow to 3 only.
    assert_eq!(settle(0.0, 2), 3);
    assert_eq!(settle(0.2, 2), 3);
}

/// The consolidation check keeps the headroom too: 200 sequences running fit 2 decode
/// nodes at the planned batch of 145 (100 a node, 69%), not within 60% of it.
#[test]
fn the_consolidation_check_keeps_the_headroom() {
    let decode_after = |headroom: f64| {
        let mut c = config(PredictorConfig::Constant);
        c.slo.scale_down_headroom = headroom;
        // Without the running floor the plan wants 1 node (70-token answers), headroom or
        // not: the check against the running sequences decides.
        c.slo.running_floor = false;
        let mut planner = Planner::new(c).unwrap();
        let mut mesh = Mesh {
            prefill: 3,
            decode: 3,
        };
        let load = |_| Load {
            arrival_rate: 20.0,
            prompt: 2000.0,
            output: 70.0,
            running: 200.0,
            ..Load::default()
        };
        run(&mut planner, &mut mesh, secs(0), 300, load);
        mesh.decode
    };
    assert_eq!(decode_after(0.0), 2);
    assert_eq!(decode_after(0.4), 3);
}

/// With `scale_down_headroom`, a role keeps burst room it would otherwise lend; with
/// `lend_headroom` it lends that room to the role the mix turns to. After the turn prefill
/// needs 4 nodes; 120 sequences run on decode: 1 node at the planned batch of 148, 2
/// within 70% of it.
#[test]
fn a_lend_may_spend_the_scale_down_headroom() {
    let decide = |lend_headroom: bool| {
        let mut c = config(PredictorConfig::Constant);
        c.slo.scale_down_headroom = 0.3;
        c.slo.lend_headroom = lend_headroom;
        let mut planner = Planner::new(c).unwrap();
        let mesh = Mesh {
            prefill: 3,
            decode: 2,
        };
        planner.observe(
            secs(0),
            mesh.observe(&Load {
                arrival_rate: 28.0,
                prompt: 2000.0,
                output: 70.0,
                running: 120.0,
                kv_nodes: 0.3,
                ..Load::default()
            }),
        );
        planner.decide(secs(0))
    };
    let kept = decide(false);
    assert_eq!(
        (kept.prefill.target, kept.decode.target),
        (4, 2),
        "{kept:?}"
    );
    assert_eq!(kept.switches, Default::default());
    let lent = decide(true);
    assert_eq!(
        (lent.prefill.target, lent.decode.target),
        (4, 1),
        "{lent:?}"
    );
    assert_eq!(lent.switches.decode_to_prefill, 1);
}
