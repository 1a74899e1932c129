//! `kvmesh`: the one binary. Each subcommand lives in its own module.

mod admission_args;
mod bench_engine;
mod bench_trace;
mod bench_transfer;
mod bench_ttft;
mod certs;
mod generate;
mod model_args;
mod node;
mod serve;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// mimalloc keeps freed megabyte buffers (KV chunks, activations) for reuse instead of
/// returning them to the kernel and faulting them in again, as glibc's thread arenas do.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "kvmesh",
    version,
    about = "Disaggregated prefill/decode LLM serving mesh"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Download and verify the default model (SmolLM2-135M-Instruct Q4_1) into the cache.
    FetchModel(model_args::FetchArgs),
    /// Run the whole mesh in one process behind the OpenAI-compatible HTTP API.
    Serve(serve::ServeArgs),
    /// Run the OpenAI-compatible HTTP router of a multi-process mesh.
    Router(node::router::RouterArgs),
    /// Run a prefill node of a multi-process mesh.
    Prefill(node::prefill::PrefillArgs),
    /// Run a decode node of a multi-process mesh.
    Decode(node::decode::DecodeArgs),
    /// Make a cluster CA and node certificates for mutual TLS between nodes.
    Certs(certs::CertsArgs),
    /// Generate text for one prompt on this machine.
    Generate(generate::GenerateArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Prefill and decode throughput of the engine on the real model.
    Engine(bench_engine::BenchEngineArgs),
    /// KV transfer rates (QUIC, TCP, memcpy) and disaggregated vs local TTFT.
    Transfer(bench_ttft::BenchTransferCommand),
    /// Replay the Mooncake trace against a 2+2 cluster per routing policy.
    Trace(bench_trace::BenchTraceArgs),
    /// Internal: the prefill process of `bench transfer`.
    #[command(hide = true)]
    PrefillNode(bench_ttft::PrefillNodeArgs),
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVMESH_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::FetchModel(args) => model_args::fetch(&args),
        Command::Serve(args) => serve::run(&args),
        Command::Router(args) => node::router::run(&args),
        Command::Prefill(args) => node::prefill::run(&args),
        Command::Decode(args) => node::decode::run(&args),
        Command::Certs(args) => certs::run(&args),
        Command::Generate(args) => generate::run(&args),
        Command::Bench(BenchCommand::Engine(args)) => bench_engine::run(&args),
        Command::Bench(BenchCommand::Transfer(args)) => bench_ttft::run(&args),
        Command::Bench(BenchCommand::Trace(args)) => bench_trace::run(&args),
        Command::Bench(BenchCommand::PrefillNode(args)) => bench_ttft::prefill_node(&args),
    }
}
