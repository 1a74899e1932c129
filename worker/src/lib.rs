//! What every node is, whatever its role: the engine thread's shell, its load and metrics,
//! the KV it moves between nodes, and the clients it calls its peers with. The `prefill` and
//! `decode` crates are the role-specific logic over it.
//!
//! - The shell ([`engine_thread`]): the inbox a worker's handles send to, the state they share
//!   with its thread ([`NodeState`]: queue slots, the drain flag, the published load), and the
//!   thread itself ([`EngineThread`]), stopped on drop and joined with or without a deadline.
//! - Load and metrics: [`LoadCell`] (what the thread publishes and routers read without locks),
//!   [`QueueSlots`], [`WorkerMetrics`], and [`LoadPublisher`], which publishes all of it after
//!   each turn of the thread's loop.
//! - KV movement: cached prefixes move between nodes instead of being recomputed. Every worker
//!   serves its cache to pullers ([`export`], [`KvCacheService`]), and every worker pulls with
//!   a [`Puller`]: a decode worker from the node the router names, a prefill worker from the
//!   request's destination, which holds the prefix it did not ask for. [`IncomingTransfer`]
//!   checks each chunk that arrives, for a pull or a prompt's KV. KV leaves through a
//!   [`KvOutbox`]: the engine thread reads it into buffers and sender threads move them, so a
//!   slow destination never stalls an engine step.
//! - Role switching ([`role`]): the node's role state ([`RoleMachine`]) and the hand-back of
//!   a worker's engine ([`EngineReturn`]) to the other role's worker.
//! - The peer clients: a prefill worker as a decode worker sees it ([`PrefillClient`]; across
//!   the network [`RemotePrefill`]), the messages between them ([`PrefillRequest`],
//!   [`PrefillReply`]) and their wire form ([`wire`]).

mod client;
pub mod engine_thread;
pub mod export;
mod export_rpc;
mod incoming;
pub mod load;
pub mod metrics;
pub mod outbox;
mod publish;
mod pull;
mod remote;
mod request;
pub mod role;
pub mod wire;

pub use crate::metrics::WorkerMetrics;
pub use client::{PrefillClient, PrefillTarget};
pub use engine_thread::{inbox, Control, EngineThread, Gather, NodeState, GATHER_WINDOW};
pub use export::{
    ExportDone, ExportError, ExportJob, ExportReply, ExportRequest, ExportSource, KvExporter,
};
pub use export_rpc::{HolderDirectory, KvCacheService, LearnPeer, RemoteExporter};
pub use incoming::{IncomingError, IncomingTransfer};
pub use load::{LoadCell, QueueSlots};
pub use outbox::KvOutbox;
pub use publish::LoadPublisher;
pub use pull::{KvPull, Puller};
pub use remote::RemotePrefill;
pub use request::{
    CancelToken, KvDestination, PrefillDone, PrefillError, PrefillReply, PrefillRequest,
};
pub use role::{engine_return, EngineReturn, RoleMachine, RoleState, SwitchError, SwitchPlan};
pub use wire::DestinationAddresses;
