//! Where etcd is and how the discovery keys are laid out and refreshed.

use crate::StoreError;
use kvmesh_common::{NodeId, NodeRole};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// How to reach etcd and how quickly a dead node disappears.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EtcdConfig {
    /// Client URLs, e.g. `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// Root of every key this mesh writes (`/{cluster}/nodes/...`), so several meshes can
    /// share one etcd.
    pub cluster: String,
    /// How long a node outlives its last keep-alive. etcd leases count whole seconds, so
    /// this is rounded up; etcd may raise it to its own minimum (1.5 x election timeout).
    #[serde(with = "humantime_serde")]
    pub lease_ttl: Duration,
    /// How long `connect` keeps trying before it gives up with `Unreachable`.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// Bound on each unary etcd call; past it the call counts as unreachable.
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// Minimum time between two load-report writes of one node, so etcd write load stays
    /// bounded however fast the load changes.
    #[serde(with = "humantime_serde")]
    pub load_report_interval: Duration,
    /// Minimum time between two prefix-index writes of one node (a log batch, or a
    /// snapshot), so etcd write load stays bounded however fast blocks are cached.
    #[serde(with = "humantime_serde")]
    pub kv_flush_interval: Duration,
}

impl Default for EtcdConfig {
    fn default() -> Self {
        EtcdConfig {
            endpoints: vec!["http://127.0.0.1:2379".into()],
            cluster: "kvmesh".into(),
            lease_ttl: Duration::from_secs(3),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(2),
            load_report_interval: Duration::from_millis(250),
            kv_flush_interval: Duration::from_millis(200),
        }
    }
}

impl EtcdConfig {
    pub fn validate(&self) -> Result<(), StoreError> {
        let bad = |m: &str| Err(StoreError::InvalidConfig(m.into()));
        if self.endpoints.is_empty() {
            return bad("no endpoints");
        }
        let cluster = self.cluster.trim_matches('/');
        if cluster.is_empty() || cluster.contains('/') {
            return bad("cluster must be one non-empty key segment");
        }
        if self.lease_ttl.is_zero() {
            return bad("lease_ttl must be positive");
        }
        if self.connect_timeout.is_zero() || self.request_timeout.is_zero() {
            return bad("timeouts must be positive");
        }
        if self.kv_flush_interval.is_zero() {
            return bad("kv_flush_interval must be positive");
        }
        Ok(())
    }

    /// The lease TTL in etcd's unit: whole seconds, at least one.
    pub(crate) fn lease_ttl_secs(&self) -> i64 {
        (self.lease_ttl.as_millis().div_ceil(1000) as i64).max(1)
    }

    /// `/{cluster}/nodes/`: everything discovery watches.
    pub(crate) fn nodes_prefix(&self) -> String {
        format!("/{}/nodes/", self.cluster.trim_matches('/'))
    }

    /// `/{cluster}/kv/`: everything the prefix index watches.
    pub(crate) fn kv_prefix(&self) -> String {
        format!("/{}/kv/", self.cluster.trim_matches('/'))
    }

    /// `/{cluster}/nodes/{role}/{node_id}`.
    pub(crate) fn node_key(&self, role: NodeRole, node: NodeId) -> String {
        format!("{}{}/{}", self.nodes_prefix(), role.as_str(), node)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_ttl() {
        let c = EtcdConfig {
            cluster: "/mesh/".into(),
            lease_ttl: Duration::from_millis(1500),
            ..EtcdConfig::default()
        };
        c.validate().unwrap();
        assert_eq!(c.nodes_prefix(), "/mesh/nodes/");
        assert_eq!(
            c.node_key(NodeRole::Decode, NodeId(255)),
            "/mesh/nodes/decode/ff"
        );
        assert_eq!(c.lease_ttl_secs(), 2);
        assert_eq!(c.kv_prefix(), "/mesh/kv/");
        let bad = EtcdConfig {
            cluster: "a/b".into(),
            ..EtcdConfig::default()
        };
        assert!(matches!(bad.validate(), Err(StoreError::InvalidConfig(_))));
    }

    #[test]
    fn parses_humane_durations_and_rejects_unknown_fields() {
        let c: EtcdConfig = serde_json::from_str(
            r#"{"cluster":"x","lease_ttl":"2s","load_report_interval":"100ms","kv_flush_interval":"150ms"}"#,
        )
        .unwrap();
        assert_eq!(c.lease_ttl, Duration::from_secs(2));
        assert_eq!(c.load_report_interval, Duration::from_millis(100));
        assert_eq!(c.kv_flush_interval, Duration::from_millis(150));
        assert!(serde_json::from_str::<EtcdConfig>(r#"{"ttl":"2s"}"#).is_err());
    }
}
