//! The mesh end to end: determinism, conservation, and a queueing-theory check.

mod common;

use common::{
    assert_all_complete, disaggregated, fixed, mesh, scheduler, shape, slo, workload, MS,
};
use kvmesh_bench::arrivals::LoadShape;
use kvmesh_router::policy::RoutingConfig;
use kvmesh_sim::link::LinkClass;
use kvmesh_sim::mesh::{simulate, simulate_closed, MeshConfig, MeshRun, SimRequest};
use kvmesh_sim::node::NodeConfig;
use kvmesh_sim::timing::TimingProfile;
use std::num::NonZeroUsize;
use std::time::Duration;

fn report_json(run: &MeshRun, rate: f64) -> String {
    serde_json::to_string(&run.point("sim", &shape(rate), &slo())).unwrap()
}

#[test]
fn the_same_seed_gives_the_same_report_byte_for_byte() {
    let run = |seed| {
        let requests = workload(seed, 2_000, 400.0, 8);
        let config = mesh(16, "kv_aware", seed);
        report_json(&simulate(&config, &requests).unwrap(), 400.0)
    };
    let a = run(7);
    assert_eq!(a, run(7));
    assert_ne!(a, run(8));
    // The report is bench's: it parses back as a Point's JSON would.
    let v: serde_json::Value = serde_json::from_str(&a).unwrap();
    assert_eq!(v["label"], "sim");
    assert!(v["slo"].is_object());
    assert_eq!(v["mesh"]["nodes"].as_array().unwrap().len(), 16);

    // With prefill nodes and KV transfers too.
    let disagg = |seed| {
        let requests = workload(seed, 1_000, 200.0, 4);
        let run = simulate(&disaggregated(8, 4, LinkClass::Rdma50, seed), &requests).unwrap();
        assert!(run.stats.remote_prefills > 0);
        report_json(&run, 200.0)
    };
    assert_eq!(disagg(21), disagg(21));
    assert_ne!(disagg(21), disagg(22));
}

fn assert_conserved(run: &MeshRun, requests: &[SimRequest]) {
    assert_all_complete(run, requests);
    assert!(run
        .outcomes
        .iter()
        .all(|o| o.ttft.unwrap() > Duration::ZERO));
    let routed: u64 = run
        .stats
        .nodes
        .iter()
        .filter(|n| n.role == "decode")
        .map(|n| n.requests)
        .sum();
    assert_eq!(routed as usize, requests.len());
}

#[test]
fn every_request_ends_once_and_no_block_leaks_under_every_policy() {
    let requests = workload(3, 1_500, 300.0, 6);
    for policy in RoutingConfig::NAMES {
        let config = mesh(12, policy, 3);
        let run = simulate(&config, &requests).unwrap();
        assert_conserved(&run, &requests);
        let busy = run.stats.nodes.iter().filter(|n| n.requests > 0).count();
        assert!(busy > 1, "{policy}: only {busy} node served");
    }
}

#[test]
fn memory_pressure_preempts_and_still_conserves() {
    // 96 blocks a node: a few long requests fill it, so the scheduler preempts.
    let requests = workload(5, 400, 200.0, 4);
    let mut config = mesh(2, "round_robin", 5);
    config.node.scheduler = scheduler(96, 64, true);
    let run = simulate(&config, &requests).unwrap();
    assert_conserved(&run, &requests);
    assert!(
        run.stats.nodes.iter().any(|n| n.preemptions > 0),
        "{:?}",
        run.stats.nodes
    );
}

#[test]
fn kv_aware_routing_finds_more_cache_than_round_robin() {
    let requests = workload(9, 3_000, 300.0, 8);
    let cached = |policy: &str| {
        let run = simulate(&mesh(16, policy, 9), &requests).unwrap();
        assert_conserved(&run, &requests);
        run.outcomes
            .iter()
            .map(|o| o.cached_tokens.unwrap())
            .sum::<u64>()
    };
    let (kv, rr) = (cached("kv_aware"), cached("round_robin"));
    assert!(kv > rr, "kv_aware {kv} cached tokens, round_robin {rr}");
}

#[test]
fn a_thousand_nodes() {
    let requests = workload(11, 20_000, 20_000.0, 64);
    let run = simulate(&mesh(1_000, "kv_aware", 11), &requests).unwrap();
    assert_conserved(&run, &requests);
    let used = run.stats.nodes.iter().filter(|n| n.requests > 0).count();
    assert!(used > 900, "only {used} of 1000 nodes served");
}

/// One node serving one request at a time in a fixed time, Poisson arrivals: an M/D/1 queue,
/// whose mean wait is `W = rho / (2 mu (1 - rho))` (Pollaczek–Khinchine with zero service
/// variance).
#[test]
fn one_fixed_time_server_matches_md1() {
    let service = Duration::from_millis(10);
    let mu = 1.0 / service.as_secs_f64();
    for rho in [0.5, 0.7] {
        let lambda = rho * mu;
        let n = 200_000;
        let LoadShape::Open(open) = shape(lambda) else {
            unreachable!()
        };
        let requests: Vec<SimRequest> = open
            .schedule(1)
            .take(n)
            .map(|at| SimRequest {
                at,
                prompt: vec![1, 2, 3, 4, 5, 6, 7, 8].into(),
                max_tokens: 1,
                after: None,
            })
            .collect();
        let config = one_fixed_node(service);
        let run = simulate(&config, &requests).unwrap();
        assert_conserved(&run, &requests);
        // The wait is the time to the first (only) token less the service itself.
        let mean_wait = run
            .outcomes
            .iter()
            .map(|o| (o.ttft.unwrap() - service).as_secs_f64())
            .sum::<f64>()
            / n as f64;
        let expected = rho / (2.0 * mu * (1.0 - rho));
        let error = (mean_wait - expected).abs() / expected;
        assert!(
            error < 0.05,
            "rho {rho}: mean wait {mean_wait:.6}s, M/D/1 {expected:.6}s ({:.1}% off)",
            error * 100.0
        );
    }
}

#[test]
fn disaggregated_prefill_moves_kv_and_conserves() {
    let requests = workload(13, 1_000, 200.0, 4);
    let run = simulate(&disaggregated(8, 4, LinkClass::Rdma100, 13), &requests).unwrap();
    assert_conserved(&run, &requests);
    assert!(
        run.stats.remote_prefills > 100,
        "{} remote",
        run.stats.remote_prefills
    );
    let prefill_served: u64 = run
        .stats
        .nodes
        .iter()
        .filter(|n| n.role == "prefill")
        .map(|n| n.requests)
        .sum();
    assert_eq!(prefill_served, run.stats.remote_prefills);
    // Every remote prefill sent at least one block of 16 tokens at 128 KiB a token.
    assert!(run.stats.kv_bytes_transferred >= run.stats.remote_prefills * 16 * 128 * 1024);
}

#[test]
fn a_slower_link_delays_the_first_token() {
    let requests = workload(17, 600, 100.0, 4);
    let mean_ttft = |link| {
        let run = simulate(&disaggregated(8, 4, link, 17), &requests).unwrap();
        assert_conserved(&run, &requests);
        let sum: f64 = run
            .outcomes
            .iter()
            .map(|o| o.ttft.unwrap().as_secs_f64())
            .sum();
        sum / requests.len() as f64
    };
    let (fast, slow) = (mean_ttft(LinkClass::Rdma400), mean_ttft(LinkClass::Tcp));
    // About 1 MiB a request: ~0.3 ms over 400 Gb/s RDMA, ~0.6 ms more over 25 Gb/s TCP.
    assert!(slow > fast + 0.000_3, "tcp {slow}s, rdma400 {fast}s");
}

fn one_fixed_node(service: Duration) -> MeshConfig {
    let node = NodeConfig {
        scheduler: scheduler(64, 1, false),
        timing: TimingProfile::fixed(service),
        vocab_size: 100,
    };
    MeshConfig {
        seed: 1,
        // A queueing model's server starts serving at once.
        gather_window: Duration::ZERO,
        ..MeshConfig::new(1, node, "round_robin".parse().unwrap())
    }
}

/// An idle node woken by a request waits the real worker's gather window before its first
/// step, so requests sent a moment apart share that step; a busy node never waits.
#[test]
fn an_idle_node_gathers_what_arrives_within_the_workers_window() {
    let service = 10 * MS;
    let window = kvmesh_worker::GATHER_WINDOW;
    assert_eq!(
        mesh(1, "kv_aware", 1).gather_window,
        window,
        "the worker's default"
    );
    let config = MeshConfig {
        gather_window: window,
        ..fixed(1, service)
    };
    let at = |t: Duration, first: u32| SimRequest {
        at: t,
        prompt: vec![first, 2, 3].into(),
        max_tokens: 2,
        after: None,
    };
    // Two within the window, a third while the first step runs.
    let requests = [
        at(Duration::ZERO, 1),
        at(window / 2, 4),
        at(window + service / 2, 7),
    ];
    let ttfts = |config: &MeshConfig| {
        let run = simulate(config, &requests).unwrap();
        assert_all_complete(&run, &requests);
        run.outcomes
            .iter()
            .map(|o| o.ttft.unwrap())
            .collect::<Vec<_>>()
    };
    // The first two prefill in one step after the window; the third joins the next step
    // (the first two's decodes) as soon as the first ends.
    assert_eq!(
        ttfts(&config),
        [
            window + service,
            window / 2 + service,
            2 * service - service / 2
        ]
    );
    // Without the window the second waits for the first's whole step.
    let at_once = MeshConfig {
        gather_window: Duration::ZERO,
        ..config
    };
    assert_eq!(
        ttfts(&at_once),
        [
            service,
            2 * service - window / 2,
            2 * service - window - service / 2
        ]
    );
}

#[test]
fn a_closed_loop_sends_each_request_when_one_ends() {
    let service = Duration::from_millis(10);
    let requests: Vec<SimRequest> = (0..20)
        .map(|_| SimRequest {
            at: Duration::from_secs(999),
            prompt: vec![1, 2, 3].into(),
            max_tokens: 1,
            after: None,
        })
        .collect();
    let config = one_fixed_node(service);
    // One at a time: back to back, never waiting.
    let one = simulate_closed(&config, &requests, NonZeroUsize::new(1).unwrap()).unwrap();
    assert_conserved(&one, &requests);
    for (i, o) in one.outcomes.iter().enumerate() {
        assert_eq!(o.sent, service * i as u32);
        assert_eq!(o.ttft, Some(service));
    }
    // Four in flight on a server of one: after the start each waits for the three ahead.
    let four = simulate_closed(&config, &requests, NonZeroUsize::new(4).unwrap()).unwrap();
    assert_conserved(&four, &requests);
    assert_eq!(four.duration, service * 20);
    assert!(four.outcomes[4..]
        .iter()
        .all(|o| o.ttft == Some(service * 4)));
}

#[test]
fn periodic_load_reports_are_stale_and_change_decisions() {
    let requests = workload(23, 1_500, 400.0, 6);
    let run = |interval| {
        let mut config = mesh(12, "least_loaded", 23);
        config.report_interval = interval;
        let run = simulate(&config, &requests).unwrap();
        assert_conserved(&run, &requests);
        run.stats
            .nodes
            .iter()
            .map(|n| n.requests)
            .collect::<Vec<_>>()
    };
    let fresh = run(None);
    assert_eq!(fresh, run(None));
    assert_ne!(fresh, run(Some(Duration::from_millis(500))));
    assert!(matches!(
        simulate(
            &MeshConfig {
                report_interval: Some(Duration::ZERO),
                ..mesh(1, "least_loaded", 1)
            },
            &requests
        ),
        Err(kvmesh_sim::mesh::MeshError::ZeroReportInterval)
    ));
}

#[test]
fn a_turn_waits_for_the_turn_it_follows() {
    let service = Duration::from_millis(10);
    let ms = Duration::from_millis;
    let turn = |at, after| SimRequest {
        at,
        prompt: vec![1, 2, 3].into(),
        max_tokens: 3,
        after,
    };
    // Request 1 is due at 5 ms but follows request 0, which ends at 30 ms.
    let requests = [turn(ms(0), None), turn(ms(5), Some(0)), turn(ms(6), None)];
    let mut config = one_fixed_node(service);
    config.node.scheduler.max_num_seqs = 4;
    let run = simulate(&config, &requests).unwrap();
    assert_conserved(&run, &requests);
    assert_eq!(run.outcomes[0].ended, ms(30));
    assert_eq!(run.outcomes[1].sent, ms(30));
    assert_eq!(run.outcomes[2].sent, ms(6));
    let bad = [turn(ms(0), Some(0))];
    assert!(matches!(
        simulate(&config, &bad),
        Err(kvmesh_sim::mesh::MeshError::BadPreviousTurn(0))
    ));
}
