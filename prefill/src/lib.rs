//! The prefill node: computes a prompt's KV cache and pushes it, layer by layer, into the
//! blocks the decode node reserved for it, then returns the first token.
//!
//! A [`PrefillWorker`] is a dedicated OS thread that owns an engine (its own KV pool with
//! prefix caching). [`PrefillHandle`]s (cheap clones, any thread) submit
//! [`PrefillRequest`]s; the reply (first token and its log-probabilities, or why not) comes back
//! on the channel passed with the request. The KV travels separately, through a
//! `kvmesh_transfer::Transport`, one chunk per layer per engine step, so the transfer overlaps
//! the compute of the layers still to go. The same messages cross machines (gRPC for the
//! requests, QUIC or RDMA for the KV) in the multi-process mesh.
//!
//! Cached prefixes move between nodes instead of being recomputed: every worker serves its
//! cache to pullers ([`export`], [`KvCacheService`]), and both kinds of worker pull with a
//! [`Puller`]: a decode worker from the node the router names, a prefill worker from the
//! request's destination, which holds the prefix it did not ask for.

mod client;
pub mod export;
mod export_rpc;
mod incoming;
mod pull;
mod push;
mod remote;
mod request;
mod service;
mod wire;
mod worker;

pub use client::{PrefillClient, PrefillTarget};
pub use export::{
    ExportDone, ExportError, ExportJob, ExportReply, ExportRequest, ExportSource, KvExporter,
};
pub use export_rpc::{HolderDirectory, KvCacheService, RemoteExporter};
pub use incoming::{IncomingError, IncomingTransfer};
pub use pull::{KvPull, Puller};
pub use push::KvPush;
pub use remote::RemotePrefill;
pub use request::{
    CancelToken, KvDestination, PrefillDone, PrefillError, PrefillReply, PrefillRequest,
};
pub use service::{LearnPeer, PrefillService};
pub use wire::DestinationAddresses;
pub use worker::{PrefillConfig, PrefillHandle, PrefillWorker};
