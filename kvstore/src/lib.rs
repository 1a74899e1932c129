//! Discovery (node registry with leases) and the PrefixIndex (block hash -> holders, tier),
//! each with an etcd and an in-memory implementation, and the host-memory/disk KV tier.
//!
//! Not built yet: the in-memory implementations arrive with `kvmesh serve`, etcd with the
//! multi-process mesh.
