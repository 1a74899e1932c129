//! One active holder of a cluster-wide duty (the planner): whoever creates
//! `/{cluster}/{duty}/leader` under its lease holds the duty until the lease goes. A crashed
//! holder's key expires with its lease TTL and the next candidate takes over; the duty's
//! other keys (e.g. the planner's desired counts) are plain keys that outlive any holder.

use super::{bounded, classify, connect_client, EtcdConfig};
use crate::StoreError;
use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp};
use std::time::Duration;
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::warn;

/// A held duty. It is lost (see [`Leadership::lost`]) when the lease cannot be kept alive;
/// dropping it stops the keep-alive, [`Leadership::resign`] hands the duty over at once.
pub struct Leadership {
    client: Client,
    config: EtcdConfig,
    duty: String,
    lease_id: i64,
    lost: CancellationToken,
    _stop_keep_alive: DropGuard,
}

impl Leadership {
    /// Waits until this candidate (`holder`: a name for logs and `kvmesh planner` status)
    /// holds `duty`, trying again every third of the lease TTL while another holds it.
    /// Fails only on errors other than etcd being away.
    pub async fn acquire(
        config: EtcdConfig,
        duty: &str,
        holder: &str,
    ) -> Result<Leadership, StoreError> {
        let client = connect_client(&config).await?;
        let key = leader_key(&config, duty);
        let retry = Duration::from_secs(config.lease_ttl_secs() as u64) / 3;
        loop {
            match try_create(&client, &config, &key, holder).await {
                Ok(Some(lease_id)) => {
                    let stop = CancellationToken::new();
                    let lost = CancellationToken::new();
                    tokio::spawn(keep_alive(
                        client.clone(),
                        config.clone(),
                        lease_id,
                        stop.clone(),
                        lost.clone(),
                    ));
                    return Ok(Leadership {
                        client,
                        config,
                        duty: duty.to_string(),
                        lease_id,
                        lost,
                        _stop_keep_alive: stop.drop_guard(),
                    });
                }
                Ok(None) | Err(StoreError::Unreachable { .. }) => {}
                Err(e) => return Err(e),
            }
            tokio::time::sleep(retry).await;
        }
    }

    /// Who holds `duty` now, if anyone.
    pub async fn holder(config: &EtcdConfig, duty: &str) -> Result<Option<String>, StoreError> {
        let client = connect_client(config).await?;
        get(&client, config, &leader_key(config, duty)).await
    }

    /// Cancelled once the lease could not be refreshed within its TTL: another candidate may
    /// hold the duty now, so the holder must stop acting.
    pub fn lost(&self) -> CancellationToken {
        self.lost.clone()
    }

    /// Writes `value` at `/{cluster}/{duty}/{name}`, a key that outlives the holder; only
    /// while this lease still holds the duty (else `LeaseExpired`).
    pub async fn put(&self, name: &str, value: String) -> Result<(), StoreError> {
        let txn = Txn::new()
            .when([Compare::lease(
                leader_key(&self.config, &self.duty),
                CompareOp::Equal,
                self.lease_id,
            )])
            .and_then([TxnOp::put(
                duty_key(&self.config, &self.duty, name),
                value,
                None,
            )]);
        let mut kv = self.client.kv_client();
        let resp = bounded(&self.config, self.config.request_timeout, kv.txn(txn)).await?;
        if resp.succeeded() {
            Ok(())
        } else {
            self.lost.cancel();
            Err(StoreError::LeaseExpired)
        }
    }

    /// Reads `/{cluster}/{duty}/{name}`.
    pub async fn get(&self, name: &str) -> Result<Option<String>, StoreError> {
        get(
            &self.client,
            &self.config,
            &duty_key(&self.config, &self.duty, name),
        )
        .await
    }

    /// Gives the duty up at once (the key goes with the lease).
    pub async fn resign(self) -> Result<(), StoreError> {
        let mut lease = self.client.lease_client();
        let revoke = lease.revoke(self.lease_id);
        match bounded(&self.config, self.config.request_timeout, revoke).await {
            Ok(_) | Err(StoreError::LeaseExpired) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// `/{cluster}/{duty}/{name}`.
pub fn duty_key(config: &EtcdConfig, duty: &str, name: &str) -> String {
    format!("/{}/{duty}/{name}", config.cluster.trim_matches('/'))
}

fn leader_key(config: &EtcdConfig, duty: &str) -> String {
    duty_key(config, duty, "leader")
}

async fn get(
    client: &Client,
    config: &EtcdConfig,
    key: &str,
) -> Result<Option<String>, StoreError> {
    let mut kv = client.kv_client();
    let resp = bounded(config, config.request_timeout, kv.get(key, None)).await?;
    Ok(resp
        .kvs()
        .first()
        .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()))
}

/// Creates `key` under a fresh lease if absent: the lease id when it did.
async fn try_create(
    client: &Client,
    config: &EtcdConfig,
    key: &str,
    holder: &str,
) -> Result<Option<i64>, StoreError> {
    let mut lease = client.lease_client();
    let ttl = config.lease_ttl_secs();
    let lease_id = bounded(config, config.request_timeout, lease.grant(ttl, None))
        .await?
        .id();
    let txn = Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, 0)])
        .and_then([TxnOp::put(
            key,
            holder,
            Some(PutOptions::new().with_lease(lease_id)),
        )]);
    let mut kv = client.kv_client();
    let created = bounded(config, config.request_timeout, kv.txn(txn))
        .await?
        .succeeded();
    if !created {
        // Unused: it holds nothing and would expire anyway.
        let _ = lease.revoke(lease_id).await;
        return Ok(None);
    }
    Ok(Some(lease_id))
}

/// Refreshes the lease every third of its TTL until `stop`; cancels `lost` once a TTL has
/// passed without a successful refresh (or etcd says the lease is gone).
async fn keep_alive(
    client: Client,
    config: EtcdConfig,
    lease_id: i64,
    stop: CancellationToken,
    lost: CancellationToken,
) {
    let ttl = Duration::from_secs(config.lease_ttl_secs() as u64);
    let mut kept = tokio::time::Instant::now();
    let mut tick = tokio::time::interval(ttl / 3);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let mut lease = client.lease_client();
        let refreshed = async {
            let (mut keeper, mut stream) = lease.keep_alive(lease_id).await?;
            keeper.keep_alive().await?;
            stream.message().await
        };
        match tokio::time::timeout(config.request_timeout, refreshed).await {
            Ok(Ok(Some(resp))) if resp.ttl() > 0 => kept = tokio::time::Instant::now(),
            Ok(Ok(_)) => {
                warn!(lease = lease_id, "leadership lease expired");
                lost.cancel();
                return;
            }
            Ok(Err(e)) => warn!(error = %classify(&config, e), "leadership lease refresh failed"),
            Err(_) => warn!("leadership lease refresh timed out"),
        }
        if kept.elapsed() >= ttl {
            lost.cancel();
            return;
        }
    }
}
