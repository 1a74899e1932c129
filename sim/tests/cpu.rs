//! Nodes sharing a host's cores: an oversubscribed host slows every busy node on it, a host
//! with cores to spare does not, and nothing else about a run changes.

mod common;

use common::{assert_all_complete, fixed, request, workload, MS};
use kvmesh_sim::cpu::SharedCpu;
use kvmesh_sim::mesh::{simulate, MeshError};
use std::time::Duration;

fn shared(cores: f64, nodes_per_host: usize) -> Option<SharedCpu> {
    Some(SharedCpu {
        cores,
        threads_per_node: 1.0,
        nodes_per_host,
    })
}

#[test]
fn two_nodes_on_one_core_take_twice_as_long() {
    // Two requests at once on two round-robin nodes: one prefill step and one decode step
    // each, 10 ms apiece alone.
    let requests = vec![request(Duration::ZERO, 8, 2), request(Duration::ZERO, 8, 2)];
    let mut config = fixed(2, 10 * MS);
    let alone = simulate(&config, &requests).unwrap();
    config.cpu = shared(1.0, 2);
    let sharing = simulate(&config, &requests).unwrap();
    config.cpu = shared(2.0, 2);
    let enough = simulate(&config, &requests).unwrap();
    let ttft = |run: &kvmesh_sim::mesh::MeshRun| {
        run.outcomes
            .iter()
            .map(|o| o.ttft.unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(ttft(&alone), [10 * MS, 10 * MS]);
    assert_eq!(ttft(&sharing), [20 * MS, 20 * MS]);
    assert_eq!(ttft(&enough), ttft(&alone));
    assert_eq!(sharing.duration, 40 * MS);
    // Busy is the time a step was in flight: all of the run, on both nodes.
    for n in &sharing.stats.nodes {
        assert_eq!(n.utilization, 1.0);
    }
    for run in [&alone, &sharing, &enough] {
        assert_all_complete(run, &requests);
    }
}

#[test]
fn a_node_alone_on_its_host_is_not_slowed() {
    let requests = vec![request(Duration::ZERO, 8, 2), request(Duration::ZERO, 8, 2)];
    let mut config = fixed(2, 10 * MS);
    // One node per host: nobody shares.
    config.cpu = shared(1.0, 1);
    let run = simulate(&config, &requests).unwrap();
    assert!(run.outcomes.iter().all(|o| o.ttft == Some(10 * MS)));
}

#[test]
fn sharing_only_slows_a_busy_mesh_and_loses_nothing() {
    let requests = workload(3, 400, 400.0, 8);
    let mut config = common::mesh(4, "round_robin", 3);
    let alone = simulate(&config, &requests).unwrap();
    config.cpu = shared(2.0, 4);
    let sharing = simulate(&config, &requests).unwrap();
    assert_all_complete(&sharing, &requests);
    let total = |run: &kvmesh_sim::mesh::MeshRun| -> Duration {
        run.outcomes.iter().map(|o| o.e2e.unwrap()).sum()
    };
    assert!(total(&sharing) > total(&alone));
    // The same seed gives the same run.
    let again = simulate(&config, &requests).unwrap();
    assert_eq!(again.outcomes, sharing.outcomes);
}

#[test]
fn a_bad_host_is_an_error() {
    let mut config = fixed(2, MS);
    config.cpu = shared(0.0, 2);
    assert!(matches!(
        simulate(&config, &[request(Duration::ZERO, 4, 1)]),
        Err(MeshError::Cpu(_))
    ));
}
