//! Discovery (node registry with leases) and the PrefixIndex (block hash -> holders), behind
//! small traits; the in-memory implementations serve the embedded mesh (`kvmesh serve`).
//!
//! The etcd implementations and the host-memory/disk KV tier arrive with the multi-process
//! mesh. Lookups never touch a remote store: an etcd-backed implementation keeps the same
//! in-memory structures current from a watch.

pub mod discovery;
pub mod prefix_index;

pub use discovery::{Discovery, DiscoveryError, InMemoryDiscovery, NodeEntry};
pub use prefix_index::{InMemoryPrefixIndex, PrefixIndex};
