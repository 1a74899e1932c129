//! Leadership (one holder of a cluster duty, e.g. the planner) against a real etcd.

use kvmesh_kvstore::{EtcdConfig, EtcdServer, Leadership, StoreError};
use std::time::Duration;

fn config(endpoint: String) -> EtcdConfig {
    EtcdConfig {
        endpoints: vec![endpoint],
        cluster: "leader-test".into(),
        lease_ttl: Duration::from_secs(2),
        ..EtcdConfig::default()
    }
}

/// A candidate campaigning for the planner's duty in the background.
fn candidate(
    config: &EtcdConfig,
    name: &'static str,
) -> tokio::task::JoinHandle<Result<Leadership, StoreError>> {
    let config = config.clone();
    tokio::spawn(async move { Leadership::acquire(config, "planner", name).await })
}

#[tokio::test]
async fn one_candidate_leads_the_next_takes_over_when_it_resigns_or_dies() {
    let etcd = EtcdServer::start().expect("etcd starts");
    let config = config(etcd.endpoint());
    let first = Leadership::acquire(config.clone(), "planner", "first")
        .await
        .unwrap();
    assert_eq!(
        Leadership::holder(&config, "planner")
            .await
            .unwrap()
            .as_deref(),
        Some("first")
    );
    first
        .put("desired", "{\"prefill\":2}".into())
        .await
        .unwrap();

    // A second candidate waits while the first holds the duty...
    let mut second = candidate(&config, "second");
    // Nothing to await but its success: it must not come within two lease refreshes.
    let waited = tokio::time::timeout(Duration::from_secs(2), &mut second).await;
    assert!(
        waited.is_err(),
        "the second candidate led while the first held the lease"
    );

    // ...and leads once the first resigns; the duty's keys outlive the first holder.
    first.resign().await.unwrap();
    let second = tokio::time::timeout(Duration::from_secs(5), second)
        .await
        .expect("the second candidate leads within a retry")
        .unwrap()
        .unwrap();
    assert_eq!(
        Leadership::holder(&config, "planner")
            .await
            .unwrap()
            .as_deref(),
        Some("second")
    );
    assert_eq!(
        second.get("desired").await.unwrap().as_deref(),
        Some("{\"prefill\":2}")
    );

    // A holder that stops refreshing (a crash) loses the duty when its lease expires: a
    // third candidate leads after about one TTL, and the old holder can no longer write.
    let lost = second.lost();
    let stale = second;
    let third = candidate(&config, "third");
    // A crashed holder's lease expires; revoking it from outside is that expiry, at once.
    let client = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .unwrap();
    let held = client
        .clone()
        .kv_client()
        .get("/leader-test/planner/leader", None)
        .await
        .unwrap();
    let lease = held.kvs()[0].lease();
    client.lease_client().revoke(lease).await.unwrap();
    let third = tokio::time::timeout(Duration::from_secs(5), third)
        .await
        .expect("the third candidate leads after the lease is gone")
        .unwrap()
        .unwrap();
    assert!(matches!(
        stale.put("desired", "{}".into()).await,
        Err(StoreError::LeaseExpired)
    ));
    assert!(lost.is_cancelled(), "a refused write marks the duty lost");
    assert_eq!(
        third.get("desired").await.unwrap().as_deref(),
        Some("{\"prefill\":2}")
    );
}
