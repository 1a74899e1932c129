//! `kvmesh tune`'s pure cores: which configurations to try, in what order and for how long,
//! and how to write the best one down. The driver (to come with the subcommand) runs
//! `kvmesh bench serve --max-goodput` against each candidate the schedule names.
//!
//! - [`space`]: the candidates: prefill:decode splits of a node budget and the in-process
//!   `serve`, the engine's step budget (`engine.max_num_batched_tokens`), the local-prefill
//!   threshold (`local_prefill_max_tokens`), the routing policy (`routing`) and admission
//!   control's TTFT target (`router.ttft_target`).
//! - [`halving`]: successive halving within a total time budget, fed max-goodput scores.
//! - [`pareto`]: the goodput against TTFT p99 trade-off of the measured candidates.
//! - [`render`]: a candidate as the TOML `kvmesh serve --config` or the node roles read.

pub mod halving;
pub mod pareto;
pub mod render;
pub mod space;
