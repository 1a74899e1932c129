//! A mesh whose node set changes: scripted drains and role switches, and the real planner
//! adding and draining nodes as load comes and goes. Every request completes once and
//! whole, and every node is billed from its request to its end.

mod common;

use common::{assert_all_complete, MS};
use kvmesh_bench::arrivals::{Arrivals, OpenLoop, RateProfile, Step};
use kvmesh_common::{BlockHasher, ModelFingerprint, NodeId};
use kvmesh_engine::scheduler::SchedulerConfig;
use kvmesh_router::policy::DisaggConfig;
use kvmesh_sim::autoscale::{AutoscaleReport, ChangeKind, NodeChange};
use kvmesh_sim::link::LinkClass;
use kvmesh_sim::mesh::{simulate, MeshConfig, MeshError, MeshRun, PrefillPool, SimRequest};
use kvmesh_sim::node::NodeConfig;
use kvmesh_sim::planner::{PlannerConfig, Policy, Role};
use kvmesh_sim::timing::TimingProfile;
use std::time::Duration;

const SEC: Duration = Duration::from_secs(1);
const PROMPT: u32 = 1024;
const OUTPUT: usize = 32;

/// Nodes whose every step takes 50 ms: a decode node's 25,600 tokens of KV hold about 23
/// requests; a prefill node computes 1,024 tokens a step (20 prompts a second).
fn node() -> NodeConfig {
    NodeConfig {
        scheduler: SchedulerConfig {
            block_size: 16,
            num_blocks: 1600,
            max_num_batched_tokens: 2048,
            max_num_seqs: 32,
            max_model_len: 4096,
            enable_prefix_caching: true,
            host_tier_blocks: 0,
            disk_tier_blocks: 0,
            hasher: BlockHasher::new(ModelFingerprint(7), 16),
        },
        timing: TimingProfile::fixed(50 * MS),
        vocab_size: 32_000,
    }
}

fn mesh(decode: usize, prefill: usize) -> MeshConfig {
    let node = node();
    let mut prefill_node = node.clone();
    prefill_node.scheduler.max_num_batched_tokens = 1024;
    MeshConfig {
        prefill: Some(PrefillPool {
            nodes: prefill,
            node: prefill_node,
            disaggregation: DisaggConfig {
                local_prefill_max_tokens: 64,
                ..DisaggConfig::default()
            },
            link: LinkClass::Rdma100,
            kv_bytes_per_token: 128 * 1024,
        }),
        seed: 3,
        startup: 10 * SEC,
        switch_delay: 2 * SEC,
        ..MeshConfig::new(decode, node, "kv_aware".parse().unwrap())
    }
}

/// Poisson arrivals at each `(rate, seconds)` in turn; every prompt its own (no prefix
/// hits).
fn requests(phases: &[(f64, u64)]) -> Vec<SimRequest> {
    let open = OpenLoop {
        profile: RateProfile::Steps(
            phases
                .iter()
                .map(|&(rate, s)| Step {
                    rate,
                    duration: Duration::from_secs(s),
                })
                .collect(),
        ),
        arrivals: Arrivals::Poisson,
    };
    open.schedule(11)
        .enumerate()
        .map(|(i, at)| SimRequest {
            at,
            prompt: std::iter::once(i as u32 + 1)
                .chain((1..PROMPT).map(|k| k % 30_000 + 1))
                .collect(),
            max_tokens: OUTPUT,
            after: None,
        })
        .collect()
}

/// The load policy on a short interval and short cooldowns.
fn load_planner() -> PlannerConfig {
    let mut p = PlannerConfig {
        policy: Policy::Load,
        budget: 12,
        ..PlannerConfig::default()
    };
    p.prefill.max = 6;
    p.decode.max = 6;
    p.load.interval = 2 * SEC;
    p.load.context_length = 2048;
    p.load.prefill_queue_up = 1.0;
    p.load.prefill_queue_down = 0.1;
    p.cooldown.up = 4 * SEC;
    p.cooldown.down = 10 * SEC;
    p.cooldown.down_stable_for = 10 * SEC;
    p
}

/// 10 requests a second, then 60 (more than a prefill and a decode node carry), then 10.
fn step_load() -> Vec<SimRequest> {
    requests(&[(10.0, 40), (60.0, 60), (10.0, 150)])
}

fn ledger(run: &MeshRun) -> &AutoscaleReport {
    run.autoscale
        .as_ref()
        .expect("a changing mesh reports its node set")
}

/// The most nodes of `role` serving at once, and at the end.
fn serving(report: &AutoscaleReport, role: Role) -> (u32, u32) {
    let count = |c: &kvmesh_sim::autoscale::CountsAt| match role {
        Role::Prefill => c.prefill_serving,
        Role::Decode => c.decode_serving,
    };
    let peak = report.timeline.iter().map(count).max().unwrap();
    (peak, count(report.timeline.last().unwrap()))
}

/// The bill equals the integral of the billed node counts over the timeline, up to the end.
fn assert_billed_as_timeline(run: &MeshRun) {
    let r = ledger(run);
    let end = run.duration.as_secs_f64();
    let (mut prefill, mut decode) = (0.0, 0.0);
    for (i, c) in r.timeline.iter().enumerate() {
        let until = r.timeline.get(i + 1).map_or(end, |n| n.at_s).min(end);
        let span = (until - c.at_s).max(0.0);
        prefill += f64::from(c.prefill_billed) * span;
        decode += f64::from(c.decode_billed) * span;
    }
    assert!((r.node_seconds.prefill - prefill).abs() < 1e-6, "{r:?}");
    assert!((r.node_seconds.decode - decode).abs() < 1e-6, "{r:?}");
    assert!((r.node_hours_total - (prefill + decode) / 3600.0).abs() < 1e-9);
}

#[test]
fn a_load_step_adds_nodes_then_drains_them_and_loses_nothing() {
    let reqs = step_load();
    let config = MeshConfig {
        planner: Some(load_planner()),
        ..mesh(2, 1)
    };
    let run = simulate(&config, &reqs).unwrap();
    assert_all_complete(&run, &reqs);
    let r = ledger(&run);
    let (peak_p, end_p) = serving(r, Role::Prefill);
    let (peak_d, end_d) = serving(r, Role::Decode);
    assert!(peak_p >= 2 && peak_d >= 4, "{:?}", r.timeline);
    // Once the step is over the mesh shrinks again.
    let total = |c: &kvmesh_sim::autoscale::CountsAt| c.prefill_serving + c.decode_serving;
    let peak = r.timeline.iter().map(total).max().unwrap();
    assert!(end_p + end_d <= peak - 3, "{:?}", r.timeline);
    assert!(r.nodes_requested >= 3 && r.nodes_drained >= 2, "{r:?}");
    assert!(r.decisions_acted >= 4 && r.decisions > r.decisions_acted);
    assert!(r.reasons["decode"]["kv_usage_high"] >= 1);
    // Nodes join no sooner than their start-up after the decision that asked for them (a
    // role switch moves a node between pools without adding one: it is not counted).
    let first_up = r
        .changes
        .iter()
        .find(|d| d.acted() && d.prefill.delta() + d.decode.delta() > 0)
        .unwrap()
        .at
        .as_secs_f64();
    let first_join = r
        .timeline
        .iter()
        .find(|c| total(c) > total(&r.timeline[0]))
        .unwrap();
    assert!(
        first_join.at_s >= first_up + 10.0,
        "{first_up} {first_join:?}"
    );
    // Two nodes for the whole run and more while the load lasted, billed as the timeline
    // shows.
    let two_nodes = 2.0 * run.duration.as_secs_f64();
    assert!(r.node_seconds.total() > two_nodes + 60.0, "{r:?}");
    assert_billed_as_timeline(&run);
}

#[test]
fn a_drain_finishes_what_the_node_holds_and_sends_it_nothing_more() {
    let reqs = requests(&[(40.0, 30)]);
    let drained_at = 10 * SEC;
    let config = MeshConfig {
        changes: vec![
            NodeChange {
                at: drained_at,
                kind: ChangeKind::Drain(NodeId(0)),
            },
            // A prefill node: its prefills and KV in flight finish first.
            NodeChange {
                at: drained_at,
                kind: ChangeKind::Drain(NodeId(3)),
            },
        ],
        ..mesh(3, 2)
    };
    let run = simulate(&config, &reqs).unwrap();
    assert_all_complete(&run, &reqs);
    let r = ledger(&run);
    let out = r
        .timeline
        .iter()
        .find(|c| c.decode_serving == 2 && c.prefill_serving == 1)
        .unwrap();
    assert_eq!(out.at_s, 10.0);
    // Still billed (it holds requests) when it leaves routing; gone later.
    assert_eq!((out.decode_billed, out.prefill_billed), (3, 2));
    let gone = r
        .timeline
        .iter()
        .find(|c| c.decode_billed == 2 && c.prefill_billed == 1)
        .unwrap();
    assert!(gone.at_s > 10.0 && gone.at_s < 15.0, "{:?}", r.timeline);
    assert_eq!(r.nodes_drained, 2);
    // The drained nodes served requests before, none after: their totals stop growing.
    let before = simulate(
        &mesh(3, 2),
        &reqs[..reqs.partition_point(|q| q.at < drained_at)],
    )
    .unwrap();
    for n in [0, 3] {
        assert!(run.stats.nodes[n].requests > 0);
        assert!(
            run.stats.nodes[n].requests <= before.stats.nodes[n].requests + 5,
            "node {n}: {} routed before the drain, {} in all",
            before.stats.nodes[n].requests,
            run.stats.nodes[n].requests
        );
    }
    assert_billed_as_timeline(&run);
}

#[test]
fn a_role_switch_moves_a_node_to_the_other_pool_and_loses_nothing() {
    let reqs = requests(&[(30.0, 30)]);
    let config = MeshConfig {
        changes: vec![NodeChange {
            at: 5 * SEC,
            kind: ChangeKind::Switch(NodeId(2)),
        }],
        ..mesh(2, 2)
    };
    let run = simulate(&config, &reqs).unwrap();
    assert_all_complete(&run, &reqs);
    let r = ledger(&run);
    assert_eq!(r.role_switches, 1);
    let last = r.timeline.last().unwrap();
    assert_eq!((last.prefill_serving, last.decode_serving), (1, 3));
    // It served in the other role after draining and the switch delay: node 4, decode.
    let joined = r.timeline.iter().find(|c| c.decode_serving == 3).unwrap();
    let left = r.timeline.iter().find(|c| c.prefill_billed == 1).unwrap();
    assert!(
        (joined.at_s - left.at_s - 2.0).abs() < 1e-9,
        "{:?}",
        r.timeline
    );
    assert_eq!(run.stats.nodes.len(), 5);
    assert_eq!(run.stats.nodes[4].role, "decode");
    assert!(run.stats.nodes[4].requests > 0);
    // The machine is billed throughout: prefill until drained, decode from then on.
    let end = run.duration.as_secs_f64();
    assert!((r.node_seconds.total() - 4.0 * end).abs() < 1e-6, "{r:?}");
    assert_billed_as_timeline(&run);
}

#[test]
fn advisory_mode_changes_no_node_count() {
    let reqs = step_load();
    let mut planner = load_planner();
    planner.advisory = true;
    let config = MeshConfig {
        planner: Some(planner),
        ..mesh(1, 1)
    };
    let run = simulate(&config, &reqs).unwrap();
    assert_eq!(run.outcomes.len(), reqs.len());
    let r = ledger(&run);
    assert!(!r.changes.is_empty(), "the planner advised changes");
    assert!(r.changes.iter().all(|d| d.advisory && !d.acted()));
    assert_eq!(r.decisions_acted, 0);
    assert_eq!(r.nodes_requested + r.nodes_drained + r.role_switches, 0);
    assert_eq!(r.timeline.len(), 1, "{:?}", r.timeline);
    let end = run.duration.as_secs_f64();
    assert!((r.node_seconds.total() - 2.0 * end).abs() < 1e-6);
    assert_eq!(run.stats.nodes.len(), 2);
}

#[test]
fn the_same_seed_gives_the_same_planned_run() {
    let reqs = requests(&[(10.0, 20), (60.0, 30), (10.0, 60)]);
    let config = MeshConfig {
        planner: Some(load_planner()),
        ..mesh(1, 1)
    };
    let a = simulate(&config, &reqs).unwrap();
    let b = simulate(&config, &reqs).unwrap();
    assert_eq!(a.autoscale, b.autoscale);
    assert_eq!(a.outcomes, b.outcomes);
}

#[test]
fn quiet_decode_runs_change_no_planned_run() {
    // The planner observes every node's latest steps and the tokens delivered since its
    // last tick: runs of quiet steps are caught up to each tick.
    let reqs = requests(&[(10.0, 20), (60.0, 30), (10.0, 60)]);
    let run = |quiet_runs| {
        let config = MeshConfig {
            planner: Some(load_planner()),
            quiet_runs,
            ..mesh(1, 1)
        };
        simulate(&config, &reqs).unwrap()
    };
    let (a, b) = (run(true), run(false));
    assert!(ledger(&a).decisions_acted > 0);
    assert_eq!(a.autoscale, b.autoscale);
    assert_eq!(a.outcomes, b.outcomes);
}

#[test]
fn bad_changes_are_refused() {
    let reqs = requests(&[(1.0, 5)]);
    let unknown = MeshConfig {
        changes: vec![NodeChange {
            at: SEC,
            kind: ChangeKind::Drain(NodeId(9)),
        }],
        ..mesh(2, 1)
    };
    assert!(matches!(
        simulate(&unknown, &reqs),
        Err(MeshError::Change(_))
    ));
    let mut no_pool = MeshConfig {
        planner: Some(load_planner()),
        ..mesh(2, 1)
    };
    no_pool.prefill = None;
    assert!(matches!(
        simulate(&no_pool, &reqs),
        Err(MeshError::NoPrefillPool)
    ));
    let mut bad = load_planner();
    bad.decode.min = 0;
    let invalid = MeshConfig {
        planner: Some(bad),
        ..mesh(2, 1)
    };
    assert!(matches!(
        simulate(&invalid, &reqs),
        Err(MeshError::Planner(_))
    ));
}

#[test]
fn prefill_goes_to_zero_at_light_load_and_returns_when_decode_nodes_queue_prompts() {
    // 2 requests a second for 80 s: a prefill node is idle and goes; the decode nodes
    // prefill every prompt. Then 40 a second, more than they carry: prompts queue on them
    // and a prefill node comes back.
    let reqs = requests(&[(2.0, 80), (40.0, 40), (2.0, 60)]);
    let mut planner = load_planner();
    planner.prefill.min = 0;
    let config = MeshConfig {
        planner: Some(planner),
        ..mesh(2, 1)
    };
    let run = simulate(&config, &reqs).unwrap();
    assert_all_complete(&run, &reqs);
    let r = ledger(&run);
    let gone = r
        .timeline
        .iter()
        .position(|c| c.prefill_serving == 0 && c.prefill_billed == 0)
        .unwrap_or_else(|| panic!("prefill never went to zero: {:?}", r.timeline));
    assert!(r.timeline[gone].at_s < 80.0, "{:?}", r.timeline[gone]);
    assert!(
        r.timeline[gone..].iter().any(|c| c.prefill_serving >= 1),
        "prefill never came back: {:?}",
        r.timeline
    );
    let back = r
        .changes
        .iter()
        .find(|d| d.acted() && d.prefill.observed == 0 && d.prefill.target >= 1)
        .unwrap_or_else(|| panic!("no decision brought prefill back: {:?}", r.changes));
    assert!(back.at >= 80 * SEC, "{back:?}");
    assert!(
        matches!(
            back.prefill.reason,
            kvmesh_sim::planner::Reason::PrefillQueueHigh { .. }
        ),
        "{back:?}"
    );
    assert_billed_as_timeline(&run);
}
