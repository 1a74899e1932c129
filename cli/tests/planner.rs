//! `kvmesh planner` against a real mesh, with the `local` actuator: a local etcd and a router
//! only; the planner starts the minimum itself (one prefill, one decode node), a step load
//! from `kvmesh bench serve` (low, high, low) fills the decode node's KV pool past the load
//! policy's threshold so the planner starts a second decode node, and the low load after it
//! lets the planner drain one again. No request is lost, and the removal is a drain.

mod cluster;

use cluster::*;
use kvmesh_common::NodeRole;
use kvmesh_kvstore::{Discovery, EtcdConfig, EtcdDiscovery, EtcdServer, Leadership};
use serde_json::Value;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CLUSTER: &str = "planner-test";

/// The load policy with thresholds this small model's small KV pools cross: up when a
/// decode node has 60% of its blocks in use, down when every one stayed under 30% for 6 s.
const CONFIG: &str = r#"
policy = "load"
[prefill]
min = 1
max = 1
[decode]
min = 1
max = 2
[cooldown]
up = "0s"
down = "0s"
down_stable_for = "6s"
[load]
interval = "2s"
kv_usage_up = 0.6
kv_usage_down = 0.3
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_load_makes_the_planner_add_a_decode_node_and_drain_it_after() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdServer::start().expect("etcd starts");
    let endpoint = etcd.endpoint();
    // The planner's nodes outlive it by design; this test stops them, pass or fail, once the
    // planner (declared after this, so dropped before it) can no longer start more.
    let _nodes = StartedNodes(endpoint.clone());
    let router_addr = free_addr("127.0.0.1");
    let router = Node::spawn(
        mesh_args("router", router_addr, &endpoint, CLUSTER),
        dir.path().join("router.log"),
    );
    let config = dir.path().join("planner.toml");
    std::fs::write(&config, CONFIG).unwrap();
    let node_logs = dir.path().join("nodes");
    let metrics_addr = free_addr("127.0.0.1");
    let planner = Node::spawn(
        [
            "planner",
            "--etcd",
            &endpoint,
            "--cluster",
            CLUSTER,
            "--router",
            &format!("http://{router_addr}"),
            "--config",
            config.to_str().unwrap(),
            "--observe-every",
            "1s",
            "--metrics-listen",
            &metrics_addr.to_string(),
            "--logs",
            node_logs.to_str().unwrap(),
            // Small KV pools (32 blocks of 16 tokens), so a few requests fill one.
            "--node-arg=--threads",
            "--node-arg=1",
            "--node-arg=--kv-blocks",
            "--node-arg=32",
            "--node-arg=--lease-ttl",
            "--node-arg=2s",
        ]
        .map(String::from)
        .to_vec(),
        dir.path().join("planner.log"),
    );
    let discovery = EtcdDiscovery::connect(EtcdConfig {
        endpoints: vec![endpoint.clone()],
        cluster: CLUSTER.into(),
        ..EtcdConfig::default()
    })
    .await
    .unwrap();
    let etcd_config = discovery.config().clone();

    // The planner leads, and restores the minimum by starting one node of each role.
    await_membership(&discovery, 1, 1, START_TIMEOUT).await;
    let holder = Leadership::holder(&etcd_config, "planner").await.unwrap();
    assert!(
        holder.is_some_and(|h| h.contains("planner")),
        "the planner holds the lease"
    );
    await_health(router_addr, &[&router, &planner]);
    let first_decode = discovery.nodes(NodeRole::Decode)[0].info.node_id;

    // Low, high, low: 20 s at 0.2 requests/s, 40 s at 6/s, 40 s at 0.2/s.
    let report_dir = dir.path().join("bench");
    let mut bench = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args(["bench", "serve", "--url", &format!("http://{router_addr}")])
        .args(["--workload", "synthetic:input=128,output=64"])
        .args([
            "--load",
            "steps:0.2@20s,6@40s,0.2@40s",
            "--duration",
            "100s",
        ])
        .args(["--no-progress", "--plots", "none", "--out"])
        .arg(&report_dir)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("bench.log")).unwrap())
        .spawn()
        .unwrap();

    // The high step: a second decode node.
    let grew = tokio::time::timeout(
        Duration::from_secs(100),
        await_membership(&discovery, 1, 2, Duration::from_secs(100)),
    )
    .await;
    assert!(
        grew.is_ok(),
        "no second decode node under load; planner log:\n{}",
        planner.log_tail()
    );
    // The low step after it: back to one, by a drain.
    let shrank = tokio::time::timeout(
        Duration::from_secs(120),
        await_membership(&discovery, 1, 1, Duration::from_secs(120)),
    )
    .await;
    assert!(
        shrank.is_ok(),
        "the planner did not scale decode back down; planner log:\n{}",
        planner.log_tail()
    );
    let status = tokio::task::spawn_blocking(move || bench.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "bench serve failed");

    // Every request completed: none lost to the scale-up or the drain.
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(report_dir.join("report.json")).unwrap())
            .unwrap();
    let point = &report["points"][0]["slo"];
    assert!(point["requests"].as_u64().unwrap() > 100, "{point}");
    assert_eq!(point["failed"], 0, "{}", point["errors"]);
    assert_eq!(point["ok"], point["requests"], "{point}");

    // The planner's metrics tell the same story, once it has observed the drain (its gauges
    // follow its own observations, a second apart, not the test's view of etcd).
    let expected = [
        "kvmesh_planner_leader 1",
        "kvmesh_planner_desired_nodes{role=\"decode\"} 1",
        "kvmesh_planner_actual_nodes{role=\"decode\"} 1",
        "kvmesh_planner_decisions_total{role=\"decode\",reason=\"kv_usage_high\"}",
        "kvmesh_planner_node_seconds_total{role=\"decode\"}",
    ];
    let deadline = Instant::now() + Duration::from_secs(15);
    let metrics = loop {
        let metrics = get(metrics_addr, "/metrics");
        if expected.iter().all(|s| metrics.contains(s)) || Instant::now() > deadline {
            break metrics;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for series in expected {
        assert!(metrics.contains(series), "no {series} in:\n{metrics}");
    }

    // The decisions that did it, and the removed node drained (its log says so).
    let log = std::fs::read_to_string(dir.path().join("planner.log")).unwrap();
    assert!(log.contains("kv_usage_high"), "{log}");
    assert!(log.contains("kv_usage_low"), "{log}");
    let left = discovery.nodes(NodeRole::Decode)[0].info.node_id;
    let drained_logs: Vec<String> = std::fs::read_dir(&node_logs)
        .unwrap()
        .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap())
        .filter(|text| text.contains("drain requested"))
        .collect();
    assert_eq!(
        drained_logs.len(),
        1,
        "one node drained (the first decode node was {first_decode}, {left} is left)"
    );
}

/// Kills the nodes the planner started (every process whose command line names this test's
/// etcd), when dropped.
struct StartedNodes(String);

impl Drop for StartedNodes {
    fn drop(&mut self) {
        let Ok(procs) = std::fs::read_dir("/proc") else {
            return;
        };
        for entry in procs.flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
            let is_node =
                args.contains(&b"prefill".as_slice()) || args.contains(&b"decode".as_slice());
            if is_node && args.contains(&self.0.as_bytes()) {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
        }
    }
}
