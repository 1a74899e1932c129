//! Discovery (node registry with leases) and the PrefixIndex (block hash -> holders, tier),
//! behind small traits.
//!
//! - [`Discovery`] is the read side of the registry: [`InMemoryDiscovery`] serves the
//!   embedded mesh (`kvmesh serve`); [`EtcdDiscovery`] serves the multi-process mesh, where a
//!   node's registration is an etcd lease ([`NodeLease`]). Lookups never touch a remote store:
//!   the etcd implementation keeps an in-memory snapshot current from a watch and keeps
//!   serving it while etcd is away.
//! - [`PrefixIndex`] is the read side of "which node holds how many leading blocks of this
//!   prompt, in which [`Tier`]": [`InMemoryPrefixIndex`] is written directly in the embedded
//!   mesh; in the multi-process mesh each node's [`KvEventPublisher`] batches its events into
//!   etcd under its lease, at a bounded rate, and [`EtcdPrefixIndex`] watches them into an
//!   in-memory index. Nodes publish through `kvmesh_common::kv_tier::KvEventSink` in
//!   either mesh.
//! - [`EtcdServer`] runs a throwaway local etcd for tests and local clusters.
//!
//! The host-memory and disk tiers themselves belong to each node's engine, below its KV pool;
//! nodes announce the tier a block moved to, and the index answers with it.

pub mod discovery;
mod error;
pub mod etcd;
pub mod etcd_server;
pub mod prefix;

pub use discovery::{Discovery, InMemoryDiscovery, NodeEntry};
pub use error::StoreError;
pub use etcd::{duty_key, EtcdConfig, EtcdDiscovery, Leadership, NodeLease};
pub use etcd_server::{EtcdServer, EtcdServerError};
pub use prefix::{
    EtcdPrefixIndex, InMemoryPrefixIndex, KvEventPublisher, PrefixIndex, PublisherStats, Tier,
    TierSet, TieredKvEvent, TieredOverlap, WatcherStats,
};
