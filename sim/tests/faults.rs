//! Faults in virtual time: nodes dying (migration, fallback to local prefill, clean failure
//! when nothing is left) and links slowing.

mod common;

use common::*;
use kvmesh_bench::slo::Class;
use kvmesh_common::NodeId;
use kvmesh_sim::fault::{Fault, FaultKind};
use kvmesh_sim::link::LinkClass;
use kvmesh_sim::mesh::{simulate, MeshRun};
use std::time::Duration;

/// The node that served the only request of `run`.
fn the_node(run: &MeshRun) -> u64 {
    let served: Vec<_> = run
        .stats
        .nodes
        .iter()
        .filter(|n| n.role == "decode" && n.requests > 0)
        .collect();
    assert_eq!(served.len(), 1);
    served[0].id
}

#[test]
fn a_request_on_a_dead_node_resumes_after_its_delivered_tokens() {
    // Steps of 10 ms: tokens at 10, 20, ... on its first node.
    let requests = [request(Duration::ZERO, 8, 5)];
    let mut config = fixed(2, 10 * MS);
    let node = the_node(&simulate(&config, &requests).unwrap());
    // Dies at 25 ms, two tokens out: the other node recomputes prompt and both tokens in one
    // step (35 ms), then decodes the rest.
    config.faults = vec![Fault::node_dies(25 * MS, node)];
    let run = simulate(&config, &requests).unwrap();
    assert_all_complete(&run, &requests);
    let o = &run.outcomes[0];
    assert_eq!(o.ttft, Some(10 * MS), "the first token keeps its time");
    assert_eq!(o.gaps, [10 * MS, 15 * MS, 10 * MS, 10 * MS]);
    assert_eq!(run.stats.migrations, 1);
    let dead = &run.stats.nodes[node as usize];
    assert_eq!(dead.died_at_s, Some(0.025));
    assert_eq!(dead.steps, 3, "the step cut short counts");
    assert_eq!(dead.utilization, 1.0, "busy for all of its 25 ms");
    let other = &run.stats.nodes[1 - node as usize];
    assert_eq!((other.requests, other.steps), (1, 3));
}

#[test]
fn migrations_are_bounded() {
    let requests = [request(Duration::ZERO, 8, 5)];
    let mut config = fixed(3, 10 * MS);
    let first = the_node(&simulate(&config, &requests).unwrap());
    config.max_migrations = 0;
    config.faults = vec![Fault::node_dies(25 * MS, first)];
    let run = simulate(&config, &requests).unwrap();
    let o = &run.outcomes[0];
    assert_eq!(o.class(), Class::Failed);
    assert_eq!(o.error.as_deref(), Some("stream_error"));
    assert_eq!((o.ended, o.output_tokens), (25 * MS, 2));
    assert_eq!(run.stats.migrations, 0);
    assert_no_leak(&run);

    // One move allowed: the second node's death ends it.
    config.max_migrations = 1;
    let run = simulate(&config, &requests).unwrap();
    let second = run
        .stats
        .nodes
        .iter()
        .find(|n| n.id != first && n.requests > 0);
    config
        .faults
        .push(Fault::node_dies(40 * MS, second.unwrap().id));
    let run = simulate(&config, &requests).unwrap();
    assert_eq!(run.outcomes[0].error.as_deref(), Some("stream_error"));
    assert_eq!(run.outcomes[0].ended, 40 * MS);
    assert_eq!(run.stats.migrations, 1);
    assert_no_leak(&run);
}

#[test]
fn a_node_dying_mid_run_moves_its_requests_and_keeps_the_rest() {
    let requests = workload(31, 1_000, 200.0, 6);
    let config = mesh(8, "kv_aware", 31);
    let base = simulate(&config, &requests).unwrap();
    assert_all_complete(&base, &requests);
    let death = Duration::from_secs(2);
    let mut faulty = config.clone();
    faulty.faults = vec![Fault::node_dies(death, 3)];
    let run = simulate(&faulty, &requests).unwrap();
    // Every request ends once, completed whole, some on a second node; no survivor leaks.
    assert_all_complete(&run, &requests);
    assert!(run.stats.migrations > 0);
    let dead = &run.stats.nodes[3];
    assert_eq!(dead.died_at_s, Some(2.0));
    assert!(dead.requests < base.stats.nodes[3].requests);
    let routed: u64 = run.stats.nodes.iter().map(|n| n.requests).sum();
    assert_eq!(routed, requests.len() as u64 + run.stats.migrations);
    // Up to the death the two runs are the same run: every token out before it kept its time.
    let mut stalled = 0;
    for (a, b) in base.outcomes.iter().zip(&run.outcomes) {
        if a.sent + a.ttft.unwrap() < death {
            assert_eq!(a.ttft, b.ttft);
        }
        let longest = |o: &kvmesh_bench::slo::RequestOutcome| o.gaps.iter().max().copied();
        if longest(b) > longest(a) {
            stalled += 1;
        }
    }
    // The moved requests recompute their KV: their gap over the move is their longest.
    assert!(stalled > 0);
}

#[test]
fn with_faults_the_same_seed_gives_the_same_report_byte_for_byte() {
    let report = |seed| {
        let requests = workload(seed, 800, 200.0, 4);
        let mut config = disaggregated(6, 3, LinkClass::Rdma50, seed);
        config.faults = vec![
            Fault::node_dies(Duration::from_millis(1500), 2),
            Fault::node_dies(Duration::from_millis(2000), 7),
            Fault::links_slow(Duration::from_millis(1000), 8.0),
        ];
        let run = simulate(&config, &requests).unwrap();
        assert_all_complete(&run, &requests);
        assert!(run.stats.migrations > 0);
        serde_json::to_string(&run.point("sim", &shape(200.0), &slo())).unwrap()
    };
    let a = report(41);
    assert_eq!(a, report(41));
    assert_ne!(a, report(42));
    let v: serde_json::Value = serde_json::from_str(&a).unwrap();
    assert_eq!(v["mesh"]["nodes"][2]["died_at_s"], 1.5);
    assert!(v["mesh"]["nodes"][0]["died_at_s"].is_null());
}

#[test]
fn when_every_decode_node_dies_the_rest_fail_cleanly() {
    let requests = workload(43, 600, 300.0, 4);
    let death = Duration::from_millis(700);
    let mut config = mesh(4, "kv_aware", 43);
    config.faults = (0..4).map(|n| Fault::node_dies(death, n)).collect();
    let run = simulate(&config, &requests).unwrap();
    assert_eq!(run.outcomes.len(), requests.len());
    let (mut ok, mut broken, mut refused) = (0, 0, 0);
    for (o, r) in run.outcomes.iter().zip(&requests) {
        match o.class() {
            Class::Ok => {
                assert!(o.ended <= death);
                ok += 1;
            }
            _ if r.at < death => {
                // In flight: its stream had started and breaks when the last node goes.
                assert_eq!(o.error.as_deref(), Some("stream_error"), "{o:?}");
                assert_eq!(o.ended, death);
                broken += 1;
            }
            _ => {
                // Sent after: the router has nowhere to send it.
                assert_eq!(
                    (o.status, o.error.as_deref()),
                    (Some(503), Some("http_503"))
                );
                assert_eq!(o.ended, r.at);
                refused += 1;
            }
        }
    }
    assert!(
        ok > 0 && broken > 0 && refused > 0,
        "{ok} {broken} {refused}"
    );
    let point = run.point("sim", &shape(300.0), &slo());
    assert_eq!(point.slo.failed, broken + refused);
    assert_eq!(point.mesh.unwrap().migrations, run.stats.migrations);
    assert!(run.blocks_in_use.iter().all(Option::is_none));
}

#[test]
fn a_remote_prefill_on_a_dead_prefill_node_falls_back_to_a_local_one() {
    // One decode node, one prefill node, 10 ms steps, a 64-token prompt sent to the prefill
    // node. Prefill alone: the prefill step ends at 10 ms, then the KV crosses the link.
    let requests = [request(Duration::ZERO, 64, 3)];
    let mut config = fixed(1, 10 * MS);
    config.routing = "kv_aware".parse().unwrap();
    config.prefill = disaggregated(1, 1, LinkClass::Tcp, 0).prefill;
    let pool = config.prefill.as_mut().unwrap();
    pool.node = config.node.clone();
    pool.disaggregation.local_prefill_max_tokens = 16;
    let base = simulate(&config, &requests).unwrap();
    assert_all_complete(&base, &requests);
    assert_eq!(base.stats.remote_prefills, 1);
    let transfer = base.outcomes[0].ttft.unwrap() - 10 * MS;
    assert!(transfer > Duration::ZERO);

    // Dies while computing (5 ms): the decode node prefills itself from then on.
    config.faults = vec![Fault::node_dies(5 * MS, 1)];
    let run = simulate(&config, &requests).unwrap();
    assert_all_complete(&run, &requests);
    assert_eq!(run.outcomes[0].ttft, Some(15 * MS));
    assert_eq!(run.stats.migrations, 0);
    assert_eq!(run.stats.nodes[1].died_at_s, Some(0.005));

    // Dies with the KV on the wire: the transfer is lost, the same fallback.
    let during = 10 * MS + transfer / 2;
    config.faults = vec![Fault::node_dies(during, 1)];
    let run = simulate(&config, &requests).unwrap();
    assert_all_complete(&run, &requests);
    assert_eq!(run.outcomes[0].ttft, Some(during + 10 * MS));
}

#[test]
fn a_dead_prefill_node_costs_no_request() {
    let requests = workload(47, 800, 200.0, 4);
    let config = disaggregated(6, 3, LinkClass::Rdma100, 47);
    let base = simulate(&config, &requests).unwrap();
    let mut one = config.clone();
    one.faults = vec![Fault::node_dies(Duration::from_secs(1), 6)];
    let run = simulate(&one, &requests).unwrap();
    assert_all_complete(&run, &requests);
    assert!(run.stats.nodes[6].requests < base.stats.nodes[6].requests);
    assert!(run.stats.remote_prefills > 0);
    // All of them: the rest prefill locally.
    let mut all = config.clone();
    all.faults = (6..9)
        .map(|n| Fault::node_dies(Duration::from_secs(1), n))
        .collect();
    let run = simulate(&all, &requests).unwrap();
    assert_all_complete(&run, &requests);
    assert!(run.stats.remote_prefills < base.stats.remote_prefills);
    assert_eq!(run.stats.migrations, 0);
}

#[test]
fn a_slowed_link_delays_the_first_tokens_of_what_crosses_it_after() {
    let requests = workload(53, 600, 100.0, 4);
    let mut config = disaggregated(6, 3, LinkClass::Rdma100, 53);
    // Every prompt is prefilled remotely while a prefill node is free.
    let pool = config.prefill.as_mut().unwrap();
    pool.disaggregation.local_prefill_max_tokens = 0;
    let slow_from = Duration::from_secs(3);
    let ttfts = |faults: Vec<Fault>| {
        let mut c = config.clone();
        c.faults = faults;
        let run = simulate(&c, &requests).unwrap();
        assert_all_complete(&run, &requests);
        let (before, after): (Vec<_>, Vec<_>) = run
            .outcomes
            .iter()
            .map(|o| (o.sent, o.ttft.unwrap().as_secs_f64()))
            .partition(|(sent, _)| *sent < slow_from);
        let values = |v: Vec<(Duration, f64)>| v.into_iter().map(|(_, t)| t).collect::<Vec<_>>();
        (values(before), values(after))
    };
    let (base_before, base_after) = ttfts(vec![]);
    // 100 Gb/s RDMA at a tenth of its bandwidth.
    let (slow_before, slow_after) = ttfts(vec![Fault::links_slow(slow_from, 10.0)]);
    assert_eq!(base_before.len(), slow_before.len());
    let (base, slow) = (median(base_after), median(slow_after));
    assert!(
        slow > base + 0.001,
        "p50 after: {slow}s slowed, {base}s not"
    );
    // Slowing one link only touches what crosses it.
    let one = Fault {
        at: slow_from,
        kind: FaultKind::LinkSlows {
            factor: 10.0,
            between: Some((NodeId(6), NodeId(0))),
        },
    };
    let (_, one_after) = ttfts(vec![one]);
    let one = median(one_after);
    assert!(one < slow, "one link slowed {one}s, all {slow}s");
}

#[test]
fn faults_must_name_nodes_the_mesh_has() {
    let requests = [request(Duration::ZERO, 8, 1)];
    let mut config = fixed(2, MS);
    config.faults = vec![Fault::node_dies(MS, 2)];
    assert!(matches!(
        simulate(&config, &requests),
        Err(kvmesh_sim::mesh::MeshError::Fault(_))
    ));
}
