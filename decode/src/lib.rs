//! The decode node: owns a request, reserves its KV blocks, has a prefill worker compute the
//! prompt into them (or prefills locally when the uncached prompt is short or no prefill
//! worker is usable), then decodes with continuous batching and streams tokens back.
//!
//! A [`DecodeWorker`] is a dedicated OS thread owning an engine (generic over
//! `ModelRunner`, so `MockRunner` nodes work in simulation). [`DecodeHandle`]s (cheap clones,
//! any thread) submit `GenerateRequest`s and read the worker's load; each request's events
//! stream back on its own channel. KV arrives through a `kvmesh_transfer::Transport`; every
//! chunk is verified before it is written, and a transfer that fails, is corrupt, or misses
//! its deadline is recomputed locally. A request may first pull its cached prefix from
//! another node (`kvmesh_worker::KvPull`) when that beats recomputing it; the worker also
//! serves its own cache to other nodes' pulls. What every node does whatever its role (the
//! thread's shell, load and metrics, KV movement, the prefill client) is in `kvmesh_worker`.

mod config;
mod handle;
mod remote_prefill;
mod service;
mod worker;

pub use config::DecodeConfig;
pub use handle::{DecodeHandle, EventReceiver};
pub use service::{DecodeService, PrefillDirectory};
pub use worker::{DecodeError, DecodeWorker};
