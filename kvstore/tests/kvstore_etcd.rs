//! EtcdDiscovery against a real etcd (Debian's etcd-server, started per test).

mod support;

use etcd_client::Client;
use kvmesh_common::{LoadReport, NodeId, NodeInfo, NodeRole, StepTotals};
use kvmesh_kvstore::{Discovery, EtcdConfig, EtcdDiscovery, EtcdServer, StoreError};
use std::time::Duration;
use support::Proxy;
use tokio::time::Instant;

/// How fast a change must reach another process's reader.
const PROPAGATION: Duration = Duration::from_secs(1);

fn info(id: u64, role: NodeRole) -> NodeInfo {
    NodeInfo {
        node_id: NodeId(id),
        role,
        address: format!("127.0.0.1:{}", 7000 + id),
        transfer_address: format!("127.0.0.1:{}", 8000 + id),
        model_fingerprint: kvmesh_common::ModelFingerprint(42),
        block_size: 16,
        kv_blocks_total: 1000,
    }
}

fn config(endpoint: String, lease_ttl: Duration) -> EtcdConfig {
    EtcdConfig {
        endpoints: vec![endpoint],
        cluster: "test".into(),
        lease_ttl,
        connect_timeout: Duration::from_secs(5),
        request_timeout: Duration::from_secs(1),
        load_report_interval: Duration::from_millis(50),
        kv_flush_interval: Duration::from_millis(50),
    }
}

async fn connect(server: &EtcdServer, lease_ttl: Duration) -> EtcdDiscovery {
    EtcdDiscovery::connect(config(server.endpoint(), lease_ttl))
        .await
        .expect("connect")
}

fn start_etcd() -> EtcdServer {
    // The client's reconnect story shows in the output of a failing test.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "kvmesh_kvstore=debug".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
    EtcdServer::start().expect("start etcd")
}

fn has(d: &dyn Discovery, role: NodeRole, id: u64) -> bool {
    d.nodes(role).iter().any(|e| e.info.node_id == NodeId(id))
}

/// Awaits change events until `done` holds; panics after `limit`. Returns the time taken.
async fn wait_for(
    d: &dyn Discovery,
    limit: Duration,
    what: &str,
    done: impl Fn(&dyn Discovery) -> bool,
) -> Duration {
    let start = Instant::now();
    let mut changes = d.subscribe();
    loop {
        changes.mark_unchanged();
        if done(d) {
            return start.elapsed();
        }
        match tokio::time::timeout_at(start + limit, changes.changed()).await {
            Ok(result) => result.expect("discovery alive"),
            Err(_) => panic!("{what}: not within {limit:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_node_is_seen_by_another_process_within_a_second() {
    let etcd = start_etcd();
    let reader = connect(&etcd, Duration::from_secs(2)).await;
    let writer = connect(&etcd, Duration::from_secs(2)).await;
    assert!(reader.nodes(NodeRole::Decode).is_empty());

    let lease = writer.register(info(1, NodeRole::Decode)).await.unwrap();
    let took = wait_for(&reader, PROPAGATION, "registration", |d| {
        has(d, NodeRole::Decode, 1)
    })
    .await;
    assert!(took < PROPAGATION, "took {took:?}");
    let entry = &reader.nodes(NodeRole::Decode)[0];
    assert_eq!(entry.info, info(1, NodeRole::Decode));
    assert_eq!(entry.load, LoadReport::default());
    assert!(reader.nodes(NodeRole::Prefill).is_empty());

    // Several nodes, several roles, in node-id order.
    let _p = writer.register(info(3, NodeRole::Prefill)).await.unwrap();
    let _d = writer.register(info(2, NodeRole::Decode)).await.unwrap();
    wait_for(&reader, PROPAGATION, "three nodes", |d| {
        d.nodes(NodeRole::Decode).len() == 2 && d.nodes(NodeRole::Prefill).len() == 1
    })
    .await;
    let ids: Vec<NodeId> = reader
        .nodes(NodeRole::Decode)
        .iter()
        .map(|e| e.info.node_id)
        .collect();
    assert_eq!(ids, [NodeId(1), NodeId(2)]);
    drop(lease);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_reports_propagate_and_coalesce() {
    let etcd = start_etcd();
    let reader = connect(&etcd, Duration::from_secs(2)).await;
    let writer = connect(&etcd, Duration::from_secs(2)).await;
    let lease = writer.register(info(1, NodeRole::Prefill)).await.unwrap();

    let load = |n: usize| LoadReport {
        running: n,
        waiting: n / 2,
        kv_blocks_used: 10 * n,
        queued_prompt_tokens: 100 * n as u64,
        steps: StepTotals {
            steps: 7 * n as u64,
            prefill_tokens: 500 * n as u64,
            prefill_cached_tokens: 64 * n as u64,
            decode_seqs: 6 * n as u64,
            decode_context_tokens: 3_000 * n as u64,
            micros: 90_000 * n as u64,
        },
    };
    lease.report_load(load(3));
    wait_for(&reader, PROPAGATION, "a load report", |d| {
        d.nodes(NodeRole::Prefill)
            .first()
            .is_some_and(|e| e.load == load(3))
    })
    .await;

    // A burst is coalesced to at most one write per interval; the last value wins.
    for n in 0..=100 {
        lease.report_load(load(n));
    }
    wait_for(&reader, PROPAGATION, "the last of a burst", |d| {
        d.nodes(NodeRole::Prefill)
            .first()
            .is_some_and(|e| e.load == load(100))
    })
    .await;
    lease.revoke().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_node_disappears_at_once() {
    let etcd = start_etcd();
    let reader = connect(&etcd, Duration::from_secs(10)).await;
    let writer = connect(&etcd, Duration::from_secs(10)).await;
    let lease = writer.register(info(7, NodeRole::Decode)).await.unwrap();
    wait_for(&reader, PROPAGATION, "registration", |d| {
        has(d, NodeRole::Decode, 7)
    })
    .await;

    let start = Instant::now();
    lease.revoke().await.unwrap();
    wait_for(&reader, PROPAGATION, "removal", |d| {
        !has(d, NodeRole::Decode, 7)
    })
    .await;
    // Far sooner than the 10 s TTL would allow.
    assert!(start.elapsed() < PROPAGATION, "took {:?}", start.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_node_expires_with_its_ttl() {
    let ttl = Duration::from_secs(2);
    let etcd = start_etcd();
    let reader = connect(&etcd, ttl).await;
    let writer = connect(&etcd, ttl).await;
    let lease = writer.register(info(5, NodeRole::Decode)).await.unwrap();
    wait_for(&reader, PROPAGATION, "registration", |d| {
        has(d, NodeRole::Decode, 5)
    })
    .await;

    drop(lease); // no revoke: the process "crashed"
                 // etcd checks expiry every 500 ms; allow that and some scheduling slack.
    let took = wait_for(&reader, ttl + Duration::from_millis(1500), "expiry", |d| {
        !has(d, NodeRole::Decode, 5)
    })
    .await;
    // The last keep-alive was at most TTL/3 before the drop.
    assert!(took >= ttl / 2, "expired after only {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_node_id_cannot_register_twice() {
    let etcd = start_etcd();
    let first = connect(&etcd, Duration::from_secs(2)).await;
    let second = connect(&etcd, Duration::from_secs(2)).await;
    let lease = first.register(info(9, NodeRole::Decode)).await.unwrap();
    let again = second.register(info(9, NodeRole::Decode)).await;
    assert_eq!(again.unwrap_err(), StoreError::AlreadyRegistered(NodeId(9)));
    // Nor in another role: peers know a node by its id alone.
    let other_role = second.register(info(9, NodeRole::Prefill)).await;
    assert_eq!(
        other_role.unwrap_err(),
        StoreError::AlreadyRegistered(NodeId(9))
    );

    lease.revoke().await.unwrap();
    let lease = second.register(info(9, NodeRole::Decode)).await.unwrap();
    assert_eq!(lease.node_id(), NodeId(9));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_keep_the_last_membership_while_etcd_is_down_and_catch_up_after() {
    let ttl = Duration::from_secs(1);
    let mut etcd = start_etcd();
    let reader = connect(&etcd, ttl).await;
    let writer = connect(&etcd, ttl).await;
    let a = writer.register(info(1, NodeRole::Decode)).await.unwrap();
    wait_for(&reader, PROPAGATION, "registration", |d| {
        has(d, NodeRole::Decode, 1)
    })
    .await;

    etcd.stop().unwrap();
    // Longer than the TTL: no change may be reported, the membership stays as it was.
    let mut changes = reader.subscribe();
    changes.mark_unchanged();
    let quiet = tokio::time::timeout(ttl * 2, changes.changed()).await;
    assert!(quiet.is_err(), "membership changed while etcd was down");
    assert!(has(&reader, NodeRole::Decode, 1));
    // A read during the outage is a snapshot read: it returns at once.
    let start = Instant::now();
    assert_eq!(reader.nodes(NodeRole::Decode).len(), 1);
    assert!(start.elapsed() < Duration::from_millis(50));

    // Blocking (it waits for etcd to be healthy); the client tasks keep running meanwhile.
    tokio::task::block_in_place(|| etcd.restart()).unwrap();
    // New changes are seen again: a node registering now, and the old one leaving.
    let b = writer.register(info(2, NodeRole::Decode)).await.unwrap();
    wait_for(&reader, PROPAGATION, "a registration after restart", |d| {
        has(d, NodeRole::Decode, 2)
    })
    .await;
    // The first node is still (or again) registered, and its lease task still writes.
    assert!(has(&reader, NodeRole::Decode, 1));
    a.report_load(LoadReport {
        running: 4,
        waiting: 0,
        kv_blocks_used: 1,
        ..LoadReport::default()
    });
    wait_for(&reader, PROPAGATION, "a load report after restart", |d| {
        d.nodes(NodeRole::Decode)
            .first()
            .is_some_and(|e| e.load.running == 4)
    })
    .await;
    a.revoke().await.unwrap();
    wait_for(&reader, PROPAGATION, "a removal after restart", |d| {
        !has(d, NodeRole::Decode, 1)
    })
    .await;
    b.revoke().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_lease_is_lost_registers_again() {
    let ttl = Duration::from_secs(1);
    let etcd = start_etcd();
    let reader = connect(&etcd, ttl).await;
    let writer = connect(&etcd, ttl).await;
    let lease = writer.register(info(4, NodeRole::Prefill)).await.unwrap();
    wait_for(&reader, PROPAGATION, "registration", |d| {
        has(d, NodeRole::Prefill, 4)
    })
    .await;
    let old = lease.lease_id();

    // What etcd does to a node that was cut off longer than its TTL.
    let mut raw = Client::connect([etcd.endpoint()], None).await.unwrap();
    raw.lease_revoke(old).await.unwrap();
    wait_for(&reader, PROPAGATION, "the lost lease's key gone", |d| {
        !has(d, NodeRole::Prefill, 4)
    })
    .await;
    // The keep-alive (every TTL/3) notices and re-registers.
    wait_for(&reader, ttl + PROPAGATION, "re-registration", |d| {
        has(d, NodeRole::Prefill, 4)
    })
    .await;
    assert_ne!(lease.lease_id(), old);
    lease.revoke().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_values_under_the_prefix_are_skipped() {
    let etcd = start_etcd();
    let mut raw = Client::connect([etcd.endpoint()], None).await.unwrap();
    raw.put("/test/nodes/decode/1", "not json", None)
        .await
        .unwrap();
    let before = connect(&etcd, Duration::from_secs(2)).await;
    assert!(before.nodes(NodeRole::Decode).is_empty());

    // Through the watch: garbage, an entry filed under another node's key, then a valid node.
    raw.put("/test/nodes/decode/2", "{\"info\":", None)
        .await
        .unwrap();
    let misfiled = serde_json::json!({
        "info": info(3, NodeRole::Decode),
        "load": LoadReport::default(),
    });
    raw.put("/test/nodes/decode/99", misfiled.to_string(), None)
        .await
        .unwrap();
    let lease = before.register(info(5, NodeRole::Decode)).await.unwrap();
    wait_for(&before, PROPAGATION, "the valid node", |d| {
        has(d, NodeRole::Decode, 5)
    })
    .await;
    assert_eq!(before.nodes(NodeRole::Decode).len(), 1);

    // Through the initial list.
    let after = connect(&etcd, Duration::from_secs(2)).await;
    let ids: Vec<NodeId> = after
        .nodes(NodeRole::Decode)
        .iter()
        .map(|e| e.info.node_id)
        .collect();
    assert_eq!(ids, [NodeId(5)]);

    // A valid entry overwritten with garbage is dropped, not kept stale.
    raw.put("/test/nodes/decode/5", "garbage", None)
        .await
        .unwrap();
    wait_for(&before, PROPAGATION, "the overwritten node dropped", |d| {
        d.nodes(NodeRole::Decode).is_empty()
    })
    .await;
    drop(lease);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_cut_off_from_etcd_catches_up_on_what_it_missed() {
    let etcd = start_etcd();
    let proxy = Proxy::start(&etcd.endpoint()).await;
    let ttl = Duration::from_secs(10);
    let reader = EtcdDiscovery::connect(config(proxy.endpoint(), ttl))
        .await
        .unwrap();
    let writer = connect(&etcd, ttl).await;
    let a = writer.register(info(1, NodeRole::Decode)).await.unwrap();
    let _b = writer.register(info(2, NodeRole::Decode)).await.unwrap();
    wait_for(&reader, PROPAGATION, "two nodes", |d| {
        d.nodes(NodeRole::Decode).len() == 2
    })
    .await;

    proxy.cut();
    a.revoke().await.unwrap();
    let _c = writer.register(info(3, NodeRole::Decode)).await.unwrap();
    // Compacting away the missed history: only a fresh list can recover the delete.
    let mut raw = Client::connect([etcd.endpoint()], None).await.unwrap();
    let revision = raw
        .get("x", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    raw.compact(revision, None).await.unwrap();
    assert!(
        has(&reader, NodeRole::Decode, 1),
        "the last known membership"
    );
    assert!(!has(&reader, NodeRole::Decode, 3));

    proxy.heal();
    let ids = |d: &dyn Discovery| -> Vec<u64> {
        d.nodes(NodeRole::Decode)
            .iter()
            .map(|e| e.info.node_id.0)
            .collect()
    };
    // Reconnect backoff (at most 500 ms) plus propagation.
    wait_for(&reader, 2 * PROPAGATION, "the missed changes", |d| {
        ids(d) == [2, 3]
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_off_longer_than_its_ttl_registers_again_when_back() {
    let ttl = Duration::from_secs(1);
    let etcd = start_etcd();
    let proxy = Proxy::start(&etcd.endpoint()).await;
    let reader = connect(&etcd, ttl).await;
    let writer = EtcdDiscovery::connect(config(proxy.endpoint(), ttl))
        .await
        .unwrap();
    let lease = writer.register(info(6, NodeRole::Prefill)).await.unwrap();
    wait_for(&reader, PROPAGATION, "registration", |d| {
        has(d, NodeRole::Prefill, 6)
    })
    .await;
    let old = lease.lease_id();

    proxy.cut();
    wait_for(&reader, ttl + Duration::from_millis(1500), "expiry", |d| {
        !has(d, NodeRole::Prefill, 6)
    })
    .await;
    lease.report_load(LoadReport {
        running: 2,
        waiting: 0,
        kv_blocks_used: 0,
        ..LoadReport::default()
    });

    proxy.heal();
    // Noticed at the next keep-alive (TTL/3) or reconnect, then granted and put again, with
    // the load reported while it was away.
    wait_for(&reader, ttl + PROPAGATION, "re-registration", |d| {
        d.nodes(NodeRole::Prefill)
            .first()
            .is_some_and(|e| e.load.running == 2)
    })
    .await;
    assert_ne!(lease.lease_id(), old);
    lease.revoke().await.unwrap();
    wait_for(&reader, PROPAGATION, "removal", |d| {
        !has(d, NodeRole::Prefill, 6)
    })
    .await;
}

#[tokio::test]
async fn connect_reports_an_unreachable_etcd_and_a_bad_endpoint() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = EtcdConfig {
        endpoints: vec![format!("http://127.0.0.1:{port}")],
        connect_timeout: Duration::from_millis(500),
        ..EtcdConfig::default()
    };
    let start = Instant::now();
    let err = EtcdDiscovery::connect(config).await.unwrap_err();
    assert!(matches!(err, StoreError::Unreachable { .. }), "{err}");
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
}
