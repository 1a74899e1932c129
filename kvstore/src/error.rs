//! The crate's one error type: every way a store call can fail, comparable in tests.

use kvmesh_common::NodeId;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// A live registration already holds this node id.
    #[error("node {0} is already registered")]
    AlreadyRegistered(NodeId),
    /// The node was never registered, or has been deregistered.
    #[error("node {0} is not registered")]
    NotRegistered(NodeId),
    /// The node's lease is gone (expired, or revoked elsewhere), and its keys with it.
    #[error("the lease expired or was revoked")]
    LeaseExpired,
    /// No etcd endpoint answered in time (down, partitioned, or refusing connections).
    #[error("etcd unreachable at {endpoints}: {reason}")]
    Unreachable { endpoints: String, reason: String },
    /// A value under the discovery prefix that does not decode; watchers skip it.
    #[error("corrupt value at {key}: {reason}")]
    Corrupt { key: String, reason: String },
    /// The configuration cannot work (no endpoints, bad cluster name, zero TTL...).
    #[error("invalid etcd config: {0}")]
    InvalidConfig(String),
    /// etcd answered with an error (a request it rejected, not a transport failure).
    #[error("etcd error: {0}")]
    Etcd(String),
}
