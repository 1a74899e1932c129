//! Quiet decode steps planned at once (`MeshConfig::quiet_runs`) change nothing: every run
//! below gives the same outcomes, token times and mesh statistics with them as with every
//! step planned one by one, on busy meshes, with prefill nodes, faults, memory pressure,
//! stale load reports and fixed-time nodes whose events tie; and keeping only each request's
//! longest gap (`MeshConfig::every_gap` off) pools the same gaps.

mod common;

use common::*;
use kvmesh_sim::fault::Fault;
use kvmesh_sim::link::LinkClass;
use kvmesh_sim::mesh::{simulate, MeshConfig, SimRequest};
use std::time::Duration;

/// Runs `requests` on `config` with and without quiet runs and asserts the same result.
fn assert_same(mut config: MeshConfig, requests: &[SimRequest]) {
    let mut runs = [true, false].map(|quiet| {
        config.quiet_runs = quiet;
        simulate(&config, requests).unwrap()
    });
    let [quiet, stepped] = &mut runs;
    assert_eq!(
        quiet.outcomes, stepped.outcomes,
        "every token at the same time"
    );
    assert_eq!(quiet.duration, stepped.duration);
    assert_eq!(quiet.blocks_in_use, stepped.blocks_in_use);
    assert_eq!(quiet.error_examples, stepped.error_examples);
    let json = |r: &kvmesh_sim::mesh::MeshRun| {
        serde_json::to_string(&r.point("sim", &shape(1.0), &slo())).unwrap()
    };
    assert_eq!(json(quiet), json(stepped));
    // Keeping only each request's longest gap pools the same gaps.
    config.quiet_runs = true;
    config.every_gap = false;
    let longest = simulate(&config, requests).unwrap();
    assert_eq!(longest.itl.summary(), quiet.itl.summary());
    assert_eq!(longest.itl.cdf(), quiet.itl.cdf());
    for (o, every) in longest.outcomes.iter().zip(&quiet.outcomes) {
        let max = every.gaps.iter().max();
        assert_eq!(o.gaps.iter().collect::<Vec<_>>(), Vec::from_iter(max));
    }
    let steps: u64 = quiet.stats.nodes.iter().map(|n| n.steps).sum();
    assert!(
        steps > requests.len() as u64,
        "{steps} steps: decodes were run"
    );
}

#[test]
fn a_busy_mesh_runs_the_same() {
    let requests = workload(5, 2_000, 400.0, 8);
    assert_same(mesh(16, "kv_aware", 5), &requests);
    assert_same(mesh(16, "least_loaded", 5), &requests);
}

#[test]
fn prefill_nodes_faults_and_slow_links_run_the_same() {
    let requests = workload(9, 1_500, 300.0, 4);
    let mut config = disaggregated(8, 4, LinkClass::Rdma50, 9);
    config.faults = vec![
        Fault::node_dies(Duration::from_secs(1), 3),
        Fault::node_dies(Duration::from_secs(2), 9),
        Fault::links_slow(Duration::from_millis(1500), 4.0),
    ];
    assert_same(config, &requests);
}

#[test]
fn memory_pressure_and_stale_reports_run_the_same() {
    let requests = workload(3, 1_000, 300.0, 4);
    let mut config = mesh(4, "least_loaded", 3);
    config.node.scheduler = scheduler(96, 32, true);
    config.report_interval = Some(Duration::from_millis(100));
    assert_same(config, &requests);
}

#[test]
fn fixed_time_nodes_whose_events_tie_run_the_same() {
    // Steps of exactly 10 ms and arrivals on whole milliseconds: arrivals, step ends and a
    // death fall on the same instants.
    let requests: Vec<SimRequest> = (0..300)
        .map(|i| {
            request(
                Duration::from_millis(i * 7 % 1000 + i),
                20 + i as u32 % 50,
                40,
            )
        })
        .collect::<Vec<_>>();
    let mut requests = requests;
    requests.sort_by_key(|r| r.at);
    let mut config = fixed(3, 10 * MS);
    config.faults = vec![Fault::node_dies(Duration::from_millis(600), 1)];
    assert_same(config, &requests);
}
