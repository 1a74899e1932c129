//! The prefill node: computes a prompt's KV cache and pushes it, layer by layer, into the
//! blocks the decode node reserved for it, then returns the first token.
//!
//! A [`PrefillWorker`] is a dedicated OS thread that owns an engine (its own KV pool with
//! prefix caching). [`PrefillHandle`]s (cheap clones, any thread) submit
//! `kvmesh_worker::PrefillRequest`s; the reply (first token and its log-probabilities, or why
//! not) comes back on the channel passed with the request. The KV travels separately, through
//! a `kvmesh_transfer::Transport`, one chunk per layer per engine step ([`KvPush`]), so the
//! transfer overlaps the compute of the layers still to go. The same messages cross machines
//! (gRPC for the requests, [`PrefillService`]; QUIC or RDMA for the KV) in the multi-process
//! mesh.
//!
//! What every node does whatever its role (the thread's shell, load and metrics, pulling and
//! serving cached prefixes, the peer clients) is in `kvmesh_worker`.

mod push;
mod reply;
mod service;
mod worker;

pub use push::KvPush;
pub use service::PrefillService;
pub use worker::{PrefillConfig, PrefillHandle, PrefillWorker};
