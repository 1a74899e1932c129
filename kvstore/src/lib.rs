//! Discovery (node registry with leases) and the PrefixIndex (block hash -> holders), behind
//! small traits.
//!
//! - [`Discovery`] is the read side of the registry: [`InMemoryDiscovery`] serves the
//!   embedded mesh (`kvmesh serve`); [`EtcdDiscovery`] serves the multi-process mesh, where a
//!   node's registration is an etcd lease ([`NodeLease`]). Lookups never touch a remote store:
//!   the etcd implementation keeps an in-memory snapshot current from a watch and keeps
//!   serving it while etcd is away.
//! - [`EtcdServer`] runs a throwaway local etcd for tests and local clusters.
//!
//! The etcd PrefixIndex and the host-memory/disk KV tier are still to come.

pub mod discovery;
mod error;
pub mod etcd;
pub mod etcd_server;
pub mod prefix_index;

pub use discovery::{Discovery, InMemoryDiscovery, NodeEntry};
pub use error::StoreError;
pub use etcd::{EtcdConfig, EtcdDiscovery, NodeLease};
pub use etcd_server::{EtcdServer, EtcdServerError};
pub use prefix_index::{InMemoryPrefixIndex, PrefixIndex};
