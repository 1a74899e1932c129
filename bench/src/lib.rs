//! The load generator of kvmesh (`kvmesh bench serve`, `kvmesh tune`, `kvmesh bench trace`),
//! for any OpenAI-compatible endpoint.
//!
//! Pure cores: [`arrivals`] turns a load shape (closed loop at a concurrency, open loop at a
//! rate with Poisson or gamma arrivals, steps, ramps, a compressed day, trace-timed) into send
//! times from a seed; [`workload`] builds the requests (synthetic lengths, JSONL, ShareGPT, the
//! Mooncake and Azure traces); [`slo`] judges request outcomes against `--slo` objectives with
//! a Wilson interval; [`search`] is GuideLLM's max-goodput search and the `--sweep` grammar;
//! [`report`] and [`plot`] turn measured points into the versioned JSON report, the terminal
//! table, comparisons and plots.
//!
//! Drivers: [`load`] streams a workload to an endpoint under a shape (and holds the scripted
//! server that benchmarks the generator itself); [`probe`] measures points over it (one load, a
//! sweep, a search) with the generator's own CPU use ([`cpu`]); [`replay`] replays a scaled
//! Mooncake trace against a router and reports the prefix-cache hit rate against the ideal.
//!
//! The engine benchmark (`kvmesh bench engine`) lives in the CLI; the comparison with
//! llama.cpp is `bench/engine_vs_llamacpp.sh`.

pub mod arrivals;
pub mod cpu;
pub mod grammar;
pub mod load;
pub mod plot;
pub mod probe;
pub mod replay;
pub mod report;
pub mod search;
pub mod slo;
pub mod stats;
pub mod trace;
pub mod workload;

pub use load::{run, Api, LoadError, Run, RunEvent, RunPlan, Target};
pub use replay::{replay, ReplayOptions, ReplayReport};
pub use trace::{
    ideal_hit_rate, load_trace, read_trace, sample_conversations, scale_trace, Pacing, ScaleConfig,
    ScaledRequest, TraceError, TraceRecord, TraceSource,
};
