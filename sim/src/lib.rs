//! `kvmesh sim`: a discrete-event simulator of the kvmesh mesh in virtual time.
//!
//! Simulated nodes run the engine's real [`Scheduler`](kvmesh_engine::scheduler::Scheduler)
//! (and through it the real `BlockPool` and prefix cache), with a [`timing`] model in place of
//! the forward pass; the router's real [`Routing`](kvmesh_router::routing::Routing) (policy,
//! prefix index, disaggregation rule) picks nodes; [`link`] models KV transfer time. One
//! thread, a min-heap of timestamped events ([`events`]), a seeded RNG: the same seed gives
//! the same report, byte for byte. [`fault`]s (a node dying, a link slowing) happen at
//! instants of virtual time; [`stats`] gathers what bench's report carries of the mesh. With
//! [`autoscale`] the real planner adds, drains and switches nodes as the run goes. See
//! `README.md` for what is built and what is not yet.

pub use kvmesh_planner as planner;

pub mod autoscale;
pub mod clock;
pub mod cpu;
pub mod events;
pub mod fault;
pub mod gaps;
pub mod hardware;
pub mod link;
pub mod mesh;
pub mod node;
pub mod stats;
pub mod timing;
pub mod workload;
