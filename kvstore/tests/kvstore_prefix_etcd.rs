//! The etcd-backed prefix index against a real etcd (Debian's etcd-server, started per test):
//! nodes publish KV events through `KvEventPublisher`, other processes read them from an
//! `EtcdPrefixIndex`.

mod support;

use etcd_client::{Client, GetOptions};
use kvmesh_common::{NodeId, NodeInfo, NodeRole, SequenceHash};
use kvmesh_kvstore::{
    EtcdConfig, EtcdDiscovery, EtcdPrefixIndex, EtcdServer, KvEventPublisher, NodeLease,
    PrefixIndex, Tier, TieredKvEvent, TieredOverlap,
};
use std::time::Duration;
use support::Proxy;
use tokio::time::Instant;

const FLUSH: Duration = Duration::from_millis(50);
/// A flush interval plus a watch round trip, with slack for a loaded machine.
const PROPAGATION: Duration = Duration::from_secs(2);

fn config(endpoint: String, lease_ttl: Duration) -> EtcdConfig {
    EtcdConfig {
        endpoints: vec![endpoint],
        cluster: "test".into(),
        lease_ttl,
        request_timeout: Duration::from_secs(1),
        kv_flush_interval: FLUSH,
        ..EtcdConfig::default()
    }
}

fn start_etcd() -> EtcdServer {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "kvmesh_kvstore=debug".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
    EtcdServer::start().expect("start etcd")
}

fn info(id: u64) -> NodeInfo {
    NodeInfo {
        node_id: NodeId(id),
        role: NodeRole::Prefill,
        address: format!("127.0.0.1:{}", 7000 + id),
        transfer_address: format!("127.0.0.1:{}", 8000 + id),
        model_fingerprint: kvmesh_common::ModelFingerprint(42),
        block_size: 16,
        kv_blocks_total: 1000,
    }
}

/// A node: its registration and its publisher.
async fn node(etcd: &EtcdServer, id: u64, ttl: Duration) -> (NodeLease, KvEventPublisher) {
    let discovery = EtcdDiscovery::connect(config(etcd.endpoint(), ttl))
        .await
        .unwrap();
    let lease = discovery.register(info(id)).await.unwrap();
    let publisher = KvEventPublisher::start(&lease);
    (lease, publisher)
}

async fn reader(endpoint: String) -> EtcdPrefixIndex {
    EtcdPrefixIndex::connect(config(endpoint, Duration::from_secs(10)))
        .await
        .unwrap()
}

fn chain(blocks: std::ops::RangeInclusive<u64>) -> Vec<SequenceHash> {
    blocks.map(SequenceHash).collect()
}

fn stored(tier: Tier, blocks: std::ops::RangeInclusive<u64>) -> Vec<TieredKvEvent> {
    blocks
        .map(|i| TieredKvEvent::stored(tier, SequenceHash(i)))
        .collect()
}

fn removed(tier: Tier, blocks: std::ops::RangeInclusive<u64>) -> Vec<TieredKvEvent> {
    blocks
        .map(|i| TieredKvEvent::removed(tier, SequenceHash(i)))
        .collect()
}

/// Leading blocks of `prompt` that `node` holds, as the index says.
fn held(index: &dyn PrefixIndex, node: u64, prompt: &[SequenceHash]) -> usize {
    index
        .overlap(prompt)
        .get(&NodeId(node))
        .copied()
        .unwrap_or(0)
}

/// Awaits index changes until `done` holds; panics after `limit`. Returns the time taken.
async fn wait_for(
    index: &dyn PrefixIndex,
    limit: Duration,
    what: &str,
    done: impl Fn(&dyn PrefixIndex) -> bool,
) -> Duration {
    let start = Instant::now();
    let mut changes = index.subscribe();
    loop {
        changes.mark_unchanged();
        if done(index) {
            return start.elapsed();
        }
        match tokio::time::timeout_at(start + limit, changes.changed()).await {
            Ok(result) => result.expect("index alive"),
            Err(_) => panic!("{what}: not within {limit:?}"),
        }
    }
}

/// Waits for the publisher's first write (a snapshot of what it had then).
async fn first_snapshot(publisher: &KvEventPublisher) {
    let deadline = Instant::now() + PROPAGATION;
    while publisher.stats().snapshots_written == 0 {
        assert!(Instant::now() < deadline, "no first snapshot");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Keys under `/test/kv/{node}/{kind}/` in etcd right now.
async fn keys(raw: &mut Client, node: u64, kind: &str) -> usize {
    let prefix = format!("/test/kv/{node:x}/{kind}/");
    let options = GetOptions::new().with_prefix().with_keys_only();
    raw.get(prefix, Some(options)).await.unwrap().kvs().len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_blocks_reach_another_process_with_their_tiers() {
    let etcd = start_etcd();
    let index = reader(etcd.endpoint()).await;
    let (_lease, publisher) = node(&etcd, 1, Duration::from_secs(5)).await;
    let (_lease2, other) = node(&etcd, 2, Duration::from_secs(5)).await;
    let prompt = chain(1..=8);

    let mut events = stored(Tier::Device, 1..=4);
    events.extend(stored(Tier::Host, 3..=5)); // 3 and 4 on both: they count as device
    events.extend(stored(Tier::Disk, 6..=6));
    publisher.publish(events);
    other.publish(stored(Tier::Device, 1..=2));
    let took = wait_for(&index, PROPAGATION, "both nodes' blocks", |i| {
        held(i, 1, &prompt) == 6 && held(i, 2, &prompt) == 2
    })
    .await;
    assert!(took < PROPAGATION, "took {took:?}");
    let tiered = index.overlap_tiered(&prompt);
    assert_eq!(
        tiered[&NodeId(1)],
        TieredOverlap {
            device: 4,
            host: 1,
            disk: 1
        }
    );
    assert_eq!(index.len(), 6 + 2);

    // Evicted from the device, kept in host memory: still a hit, a slower one.
    publisher.publish(removed(Tier::Device, 3..=4));
    wait_for(&index, PROPAGATION, "the device eviction", |i| {
        i.overlap_tiered(&prompt)[&NodeId(1)].host == 3
    })
    .await;
    // Gone from every tier: the prefix ends before it.
    publisher.publish(removed(Tier::Host, 3..=3));
    wait_for(&index, PROPAGATION, "the removal", |i| {
        held(i, 1, &prompt) == 2
    })
    .await;
    assert_eq!(index.stats().nodes, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_events_costs_a_bounded_number_of_writes() {
    let etcd = start_etcd();
    let index = reader(etcd.endpoint()).await;
    let (_lease, publisher) = node(&etcd, 3, Duration::from_secs(5)).await;
    let start = Instant::now();
    // 10,000 events in 1,000 calls, far faster than one flush interval each.
    for i in 0..1000u64 {
        let from = i * 10 + 1;
        publisher.publish(stored(Tier::Device, from..=from + 9));
        if i.is_multiple_of(100) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let prompt = chain(1..=10_000);
    wait_for(&index, PROPAGATION * 2, "10,000 blocks", |i| {
        held(i, 3, &prompt) == 10_000
    })
    .await;
    let elapsed = start.elapsed();
    let stats = publisher.stats();
    assert_eq!(stats.events_published, 10_000);
    assert_eq!(stats.held_blocks, 10_000);
    // One flush per interval, each one write, plus the reset of the first snapshot.
    let flushes = (elapsed.as_millis() / FLUSH.as_millis()) as u64 + 1;
    assert!(
        stats.etcd_writes <= flushes + 1,
        "{} writes in {elapsed:?} ({flushes} flushes)",
        stats.etcd_writes
    );
    assert!(stats.etcd_writes < 100, "{stats:?}");
    assert_eq!(stats.write_failures, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_is_compacted_into_snapshots() {
    let etcd = start_etcd();
    let mut raw = Client::connect([etcd.endpoint()], None).await.unwrap();
    let index = reader(etcd.endpoint()).await;
    let (_lease, publisher) = node(&etcd, 4, Duration::from_secs(5)).await;
    let prompt = chain(1..=2000);
    first_snapshot(&publisher).await;
    publisher.publish(stored(Tier::Device, 1..=2000));
    wait_for(&index, PROPAGATION, "2,000 blocks", |i| {
        held(i, 4, &prompt) == 2000
    })
    .await;
    assert_eq!(
        keys(&mut raw, 4, "log").await,
        1,
        "one batch after the first snapshot"
    );

    // The log would now outgrow the held set: the next change is written as a snapshot,
    // which deletes the log it replaces.
    publisher.publish(removed(Tier::Device, 2000..=2000));
    wait_for(&index, PROPAGATION, "the removal", |i| {
        held(i, 4, &prompt) == 1999
    })
    .await;
    assert_eq!(keys(&mut raw, 4, "log").await, 0);
    assert_eq!(keys(&mut raw, 4, "snapshot").await, 1);
    assert!(publisher.stats().snapshots_written >= 2);

    // Churn on a few blocks for many intervals: the log is compacted every 64 batches, so
    // the number of keys stays bounded.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut most = 0;
    let mut round = 0u64;
    while publisher.stats().snapshots_written < 4 {
        assert!(Instant::now() < deadline, "{:?}", publisher.stats());
        let b = 1 + round % 4;
        let (from, to) = if (round / 4).is_multiple_of(2) {
            (Tier::Device, Tier::Host)
        } else {
            (Tier::Host, Tier::Device)
        };
        publisher.publish(removed(from, b..=b));
        publisher.publish(stored(to, b..=b));
        round += 1;
        tokio::time::sleep(FLUSH / 2).await;
        most = most.max(keys(&mut raw, 4, "log").await);
    }
    assert!(most <= 64, "{most} log keys");
    // Settle on device copies; the reader ends up with the publisher's state.
    publisher.publish(removed(Tier::Host, 1..=4));
    publisher.publish(stored(Tier::Device, 1..=4));
    let expected = TieredOverlap {
        device: 1999,
        host: 0,
        disk: 0,
    };
    wait_for(&index, PROPAGATION, "the churned tiers", |i| {
        i.overlap_tiered(&prompt).get(&NodeId(4)) == Some(&expected)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_holding_many_blocks_publishes_its_snapshot_in_parts() {
    let etcd = start_etcd();
    let mut raw = Client::connect([etcd.endpoint()], None).await.unwrap();
    let index = reader(etcd.endpoint()).await;
    let (_lease, publisher) = node(&etcd, 5, Duration::from_secs(5)).await;
    let mut events = stored(Tier::Device, 1..=10_000);
    events.extend(stored(Tier::Disk, 10_001..=30_000));
    publisher.publish(events);
    let prompt = chain(1..=30_000);
    wait_for(&index, PROPAGATION * 2, "30,000 blocks", |i| {
        held(i, 5, &prompt) == 30_000
    })
    .await;
    assert!(keys(&mut raw, 5, "snapshot").await >= 3);
    assert_eq!(
        index.overlap_tiered(&prompt)[&NodeId(5)],
        TieredOverlap {
            device: 10_000,
            host: 0,
            disk: 20_000
        }
    );
    // A reader that starts now loads it from the listing alone.
    let late = reader(etcd.endpoint()).await;
    assert_eq!(held(&late, 5, &prompt), 30_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_nodes_entries_vanish_with_its_lease_and_a_drained_ones_at_once() {
    let ttl = Duration::from_secs(2);
    let etcd = start_etcd();
    let index = reader(etcd.endpoint()).await;
    let (crashed, p1) = node(&etcd, 6, ttl).await;
    let (drained, p2) = node(&etcd, 7, ttl).await;
    let prompt = chain(1..=4);
    p1.publish(stored(Tier::Device, 1..=4));
    p2.publish(stored(Tier::Device, 1..=4));
    wait_for(&index, PROPAGATION, "both nodes", |i| {
        held(i, 6, &prompt) == 4 && held(i, 7, &prompt) == 4
    })
    .await;

    let start = Instant::now();
    drained.revoke().await.unwrap();
    wait_for(&index, PROPAGATION, "the drained node gone", |i| {
        held(i, 7, &prompt) == 0
    })
    .await;
    assert!(start.elapsed() < ttl, "took {:?}", start.elapsed());

    drop(p1);
    drop(crashed); // no revoke: the process "crashed"
    let took = wait_for(&index, ttl + Duration::from_millis(1500), "expiry", |i| {
        i.is_empty()
    })
    .await;
    assert!(took >= ttl / 2, "expired after only {took:?}");
    drop(p2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_lease_is_lost_publishes_again_under_the_new_one() {
    let ttl = Duration::from_secs(1);
    let etcd = start_etcd();
    let index = reader(etcd.endpoint()).await;
    let (lease, publisher) = node(&etcd, 8, ttl).await;
    let prompt = chain(1..=3);
    publisher.publish(stored(Tier::Host, 1..=3));
    wait_for(&index, PROPAGATION, "the blocks", |i| {
        held(i, 8, &prompt) == 3
    })
    .await;

    // What etcd does to a node cut off for longer than its TTL.
    let old = lease.lease_id();
    let mut raw = Client::connect([etcd.endpoint()], None).await.unwrap();
    raw.lease_revoke(old).await.unwrap();
    wait_for(
        &index,
        PROPAGATION,
        "the entries gone with the lease",
        |i| held(i, 8, &prompt) == 0,
    )
    .await;
    publisher.publish(stored(Tier::Host, 4..=4)); // while it is away
    wait_for(&index, ttl + PROPAGATION, "a fresh snapshot", |i| {
        held(i, 8, &chain(1..=4)) == 4
    })
    .await;
    assert_ne!(lease.lease_id(), old);
    assert!(
        publisher.stats().write_failures <= 2,
        "{:?}",
        publisher.stats()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_publisher_replaces_what_an_earlier_one_left() {
    let etcd = start_etcd();
    let index = reader(etcd.endpoint()).await;
    let (lease, first) = node(&etcd, 9, Duration::from_secs(5)).await;
    // Many writes, so the first publisher's seq numbers run ahead of a new one's.
    for i in 1..=10 {
        first.publish(stored(Tier::Device, i..=i));
        tokio::time::sleep(FLUSH).await;
    }
    wait_for(&index, PROPAGATION, "the first", |i| {
        held(i, 9, &chain(1..=10)) == 10
    })
    .await;
    drop(first); // a restarted engine under the same registration

    let second = KvEventPublisher::start(&lease);
    second.publish(stored(Tier::Disk, 100..=101));
    wait_for(&index, PROPAGATION, "only the second's blocks", |i| {
        held(i, 9, &chain(1..=1)) == 0 && held(i, 9, &chain(100..=101)) == 2
    })
    .await;
    second.publish(stored(Tier::Disk, 102..=102));
    wait_for(&index, PROPAGATION, "the second's log", |i| {
        held(i, 9, &chain(100..=102)) == 3
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_cut_off_from_etcd_catches_up_by_relisting() {
    let etcd = start_etcd();
    let proxy = Proxy::start(&etcd.endpoint()).await;
    let index = reader(proxy.endpoint()).await;
    let (_lease, publisher) = node(&etcd, 10, Duration::from_secs(10)).await;
    let prompt = chain(1..=6);
    publisher.publish(stored(Tier::Device, 1..=4));
    wait_for(&index, PROPAGATION, "the blocks", |i| {
        held(i, 10, &prompt) == 4
    })
    .await;

    proxy.cut();
    publisher.publish(removed(Tier::Device, 4..=4));
    publisher.publish(stored(Tier::Host, 4..=6));
    let (_lease2, newcomer) = node(&etcd, 11, Duration::from_secs(10)).await;
    newcomer.publish(stored(Tier::Disk, 1..=2));
    tokio::time::sleep(FLUSH * 4).await;
    // Compacting away the missed history: only a fresh list can recover it.
    let mut raw = Client::connect([etcd.endpoint()], None).await.unwrap();
    let revision = raw
        .get("x", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    raw.compact(revision, None).await.unwrap();
    assert_eq!(held(&index, 10, &prompt), 4, "the last known index");

    proxy.heal();
    wait_for(&index, PROPAGATION * 2, "the missed changes", |i| {
        i.overlap_tiered(&prompt).get(&NodeId(10))
            == Some(&TieredOverlap {
                device: 3,
                host: 3,
                disk: 0,
            })
            && held(i, 11, &prompt) == 2
    })
    .await;
    assert!(index.stats().resyncs >= 1, "{:?}", index.stats());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_keys_and_values_are_skipped() {
    let etcd = start_etcd();
    let mut raw = Client::connect([etcd.endpoint()], None).await.unwrap();
    // Through the initial list: garbage at a log key, a bad key, a snapshot with a bad length.
    raw.put("/test/kv/1/log/00000000000000000001", "garbage", None)
        .await
        .unwrap();
    raw.put("/test/kv/zz/other", "x", None).await.unwrap();
    let mut truncated = b"KVS1".to_vec();
    truncated.extend_from_slice(&1u64.to_le_bytes());
    truncated.extend_from_slice(&0u32.to_le_bytes());
    truncated.extend_from_slice(&1u32.to_le_bytes());
    truncated.extend_from_slice(&1000u32.to_le_bytes()); // 1,000 entries, none there
    raw.put(
        "/test/kv/2/snapshot/00000000000000000001/000000",
        truncated.clone(),
        None,
    )
    .await
    .unwrap();
    let index = reader(etcd.endpoint()).await;
    assert!(index.is_empty());
    assert_eq!(index.stats().corrupt_values, 3);

    // Through the watch, then a valid node.
    raw.put(
        "/test/kv/3/snapshot/00000000000000000001/000000",
        truncated,
        None,
    )
    .await
    .unwrap();
    raw.put("/test/kv/4/log/1", "x", None).await.unwrap();
    raw.put(
        "/test/kv/5/snapshot/00000000000000000001/000000",
        vec![0xff; 1 << 20], // larger than any part, within etcd's request limit
        None,
    )
    .await
    .unwrap();
    let (_lease, publisher) = node(&etcd, 12, Duration::from_secs(5)).await;
    publisher.publish(stored(Tier::Device, 1..=2));
    wait_for(&index, PROPAGATION, "the valid node", |i| {
        held(i, 12, &chain(1..=2)) == 2
    })
    .await;
    assert_eq!(index.stats().nodes, 1);
    assert_eq!(index.stats().corrupt_values, 6);
}
