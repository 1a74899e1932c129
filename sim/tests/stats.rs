//! The mesh statistics a simulated run reports (bench's `MeshStats`): exact on runs worked by
//! hand, within their ranges and consistent on random ones.

mod common;

use common::*;
use kvmesh_bench::report::MeshStats;
use kvmesh_sim::link::LinkClass;
use kvmesh_sim::mesh::simulate;
use std::time::Duration;

#[test]
fn one_fixed_time_node_reports_its_exact_busy_share_and_kv_use() {
    // Three requests of 8 tokens (one block each) for 2 tokens: two 10 ms steps each, at 0,
    // 100 and 200 ms. Busy 60 ms of a 220 ms run; one block held for each 20 ms.
    let requests: Vec<_> = [0, 100, 200]
        .map(|ms| request(Duration::from_millis(ms), 8, 2))
        .into();
    let config = fixed(1, 10 * MS);
    let run = simulate(&config, &requests).unwrap();
    assert_all_complete(&run, &requests);
    assert_eq!(run.duration, 220 * MS);
    let node = &run.stats.nodes[0];
    assert_eq!((node.id, node.role.as_str()), (0, "decode"));
    assert_eq!((node.requests, node.steps, node.preemptions), (3, 6, 0));
    assert_eq!(node.utilization, 0.06 / 0.22);
    assert_eq!(node.kv_blocks, 64);
    assert_eq!(node.kv_usage_peak, 1.0 / 64.0);
    let mean = 3.0 * 20.0 / (64.0 * 220.0);
    assert!(
        (node.kv_usage_mean - mean).abs() < 1e-15,
        "{}",
        node.kv_usage_mean
    );
    assert_eq!(node.died_at_s, None);
    // Distinct prompts of 8 tokens: looked up, never a hit.
    let p = &run.stats.prefix_cache;
    assert_eq!((p.lookup_tokens, p.device_tokens), (24, 0));
    assert_eq!(p.device_rate, Some(0.0));
}

#[test]
fn a_repeated_prompt_is_a_device_hit() {
    // 40 tokens: two full blocks are hits the second time (the last token is computed).
    let requests = [
        request(Duration::ZERO, 40, 1),
        request(Duration::from_millis(100), 40, 1),
    ];
    let run = simulate(&fixed(1, 10 * MS), &requests).unwrap();
    assert_all_complete(&run, &requests);
    let p = &run.stats.prefix_cache;
    assert_eq!(
        (p.lookup_tokens, p.device_tokens, p.host_tokens),
        (80, 32, 0)
    );
    assert_eq!(p.device_rate, Some(0.4));
    assert_eq!(run.outcomes[1].cached_tokens, Some(32));
}

/// Every statistic in its range, and the parts consistent with the whole.
fn assert_consistent(stats: &MeshStats) {
    for n in &stats.nodes {
        for (what, v) in [
            ("utilization", n.utilization),
            ("kv_usage_mean", n.kv_usage_mean),
            ("kv_usage_peak", n.kv_usage_peak),
        ] {
            assert!((0.0..=1.0).contains(&v), "node {} {what} {v}", n.id);
        }
        assert!(n.kv_usage_mean <= n.kv_usage_peak, "node {}", n.id);
        assert_eq!(n.steps > 0, n.utilization > 0.0, "node {}", n.id);
    }
    let p = &stats.prefix_cache;
    assert!(p.device_tokens + p.host_tokens + p.disk_tokens <= p.lookup_tokens);
    let rates = [p.device_rate, p.host_rate, p.disk_rate].map(Option::unwrap);
    assert!(rates.iter().sum::<f64>() <= 1.0, "{rates:?}");
    assert!(rates.iter().all(|r| (0.0..=1.0).contains(r)));
}

#[test]
fn statistics_stay_in_range_on_busy_meshes() {
    let requests = workload(61, 1_500, 300.0, 6);
    let run = simulate(&mesh(8, "kv_aware", 61), &requests).unwrap();
    assert_all_complete(&run, &requests);
    assert_consistent(&run.stats);
    assert!(run.stats.prefix_cache.device_tokens > 0);
    assert!(run.stats.nodes.iter().all(|n| n.kv_usage_peak > 0.0));
    // The mesh's prefix hits include every request's own (its first admission), so at
    // least what the outcomes report.
    let cached: u64 = run.outcomes.iter().map(|o| o.cached_tokens.unwrap()).sum();
    assert!(run.stats.prefix_cache.device_tokens >= cached);

    let requests = workload(67, 800, 200.0, 4);
    let run = simulate(&disaggregated(6, 3, LinkClass::Rdma50, 67), &requests).unwrap();
    assert_all_complete(&run, &requests);
    assert_consistent(&run.stats);
    assert!(run.stats.nodes[6..].iter().all(|n| n.role == "prefill"));
}

#[test]
fn under_memory_pressure_lower_tiers_serve_hits() {
    // 96 blocks a node, a host tier of 64 blocks and a disk tier of 512 behind it: shared
    // prefixes are evicted from the device pool and come back from the lower tiers.
    let requests = workload(71, 600, 200.0, 24);
    let mut config = mesh(2, "round_robin", 71);
    config.node.scheduler = scheduler(96, 64, true);
    config.node.scheduler.host_tier_blocks = 64;
    config.node.scheduler.disk_tier_blocks = 512;
    let run = simulate(&config, &requests).unwrap();
    assert_all_complete(&run, &requests);
    assert_consistent(&run.stats);
    let p = &run.stats.prefix_cache;
    assert!(p.host_tokens > 0 && p.disk_tokens > 0, "{p:?}");
    assert!(run.stats.nodes.iter().any(|n| n.preemptions > 0));
    assert!(run.stats.nodes.iter().all(|n| n.kv_usage_peak > 0.5));
}
