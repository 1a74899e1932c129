//! Load generation and trace replay.
//!
//! The load generator's pure cores: [`arrivals`] turns a load shape (closed loop at a
//! concurrency, open loop at a rate with Poisson or gamma arrivals, steps, ramps, a compressed
//! day, trace-timed) into send times from a seed; [`slo`] judges request outcomes against
//! `--slo` objectives and reports attainment and goodput with a Wilson interval.
//!
//! Trace replay: [`trace`] reads a Mooncake trace and scales it to a small model;
//! [`replay::replay`] sends the requests to a running router, open loop, and reports TTFT,
//! latency, throughput and the prefix-cache hit rate against the trace's ideal.
//!
//! The engine benchmark (`kvmesh bench engine`) lives in the CLI for now; the comparison with
//! llama.cpp is `bench/engine_vs_llamacpp.sh`.

pub mod arrivals;
pub mod cpu;
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
