//! `kvmesh`: the one binary. Each subcommand lives in its own module.

mod admission_args;
mod allocator;
mod bench_engine;
mod bench_scripted;
mod bench_serve;
mod bench_trace;
mod bench_transfer;
mod bench_ttft;
mod certs;
mod config;
mod generate;
mod gpu_check;
mod health;
mod local_cluster;
mod measure_args;
mod model_args;
mod node;
mod planner;
mod profile;
mod serve;
mod sim;
mod tune;

use anyhow::Result;
use clap::{CommandFactory, FromArgMatches, Subcommand};

#[derive(clap::Parser)]
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
    /// Operate a running prefill or decode node: switch its role in place, show its status,
    /// drain it.
    #[command(subcommand)]
    Node(node::control::NodeCommand),
    /// Make a cluster CA and node certificates for mutual TLS between nodes.
    Certs(certs::CertsArgs),
    /// Check a node's or router's health endpoint (the container health check): exit 0 on
    /// 2xx.
    Health(health::HealthArgs),
    /// Generate text for one prompt on this machine.
    Generate(generate::GenerateArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Search configurations for the most goodput within an SLO on a node budget.
    Tune(tune::TuneArgs),
    /// Measure this machine's engine step times and fit a timing profile for `kvmesh sim`.
    Profile(profile::ProfileArgs),
    /// Check the CUDA backend on this machine's GPU against the CPU one and measure it (random
    /// weights in real models' shapes; writes one JSON; see docs/gpu.md).
    GpuCheck(gpu_check::GpuCheckArgs),
    /// Simulate the mesh in virtual time (any size, real policies, bench serve's workloads
    /// and reports).
    Sim(Box<sim::SimArgs>),
    /// Scale prefill and decode capacity of a running mesh against load or SLO targets (one
    /// active planner per cluster; actuators: local processes, etcd desired counts).
    Planner(Box<planner::PlannerArgs>),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Load-test an OpenAI-compatible server: one load, a sweep, or the most goodput within
    /// an SLO; writes report.json, requests.csv and plots.
    Serve(Box<bench_serve::BenchServeArgs>),
    /// Compare two reports of `bench serve`, point by point (ratios B/A).
    Compare(bench_serve::BenchCompareArgs),
    /// Redraw a `bench serve` report's plots.
    Plot(bench_serve::BenchPlotArgs),
    /// Prefill and decode throughput of the engine on the real model.
    Engine(bench_engine::BenchEngineArgs),
    /// KV transfer rates (QUIC, TCP, memcpy) and disaggregated vs local TTFT.
    Transfer(bench_ttft::BenchTransferCommand),
    /// Replay the Mooncake trace against a 2+2 cluster per routing policy.
    Trace(bench_trace::BenchTraceArgs),
    /// Internal: the prefill process of `bench transfer`.
    #[command(hide = true)]
    PrefillNode(bench_ttft::PrefillNodeArgs),
    /// An OpenAI-compatible server streaming on a fixed script, to benchmark the generator.
    #[command(hide = true)]
    ScriptedServer(bench_scripted::ScriptedServerArgs),
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env(config::env_vars::LOG)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal: container and file logs stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let env = config::process_env();
    let command = parse_cli().command;
    if matches!(
        command,
        Command::Serve(_) | Command::Router(_) | Command::Prefill(_) | Command::Decode(_)
    ) {
        // Metric handles taken before the recorder is installed record nothing.
        kvmesh_router::metrics_exporter();
    }
    match command {
        Command::FetchModel(args) => model_args::fetch(&args),
        Command::Serve(args) => config::run(&args, &env, serve::run),
        Command::Router(args) => config::run(&args, &env, node::router::run),
        Command::Prefill(args) => config::run(&args, &env, node::prefill::run),
        Command::Decode(args) => config::run(&args, &env, node::decode::run),
        Command::Node(command) => node::control::run(&command),
        Command::Certs(args) => certs::run(&args),
        Command::Health(args) => health::run(&args),
        Command::Generate(args) => generate::run(&args),
        Command::Tune(args) => tune::run(&args),
        Command::Profile(args) => profile::run(&args),
        Command::GpuCheck(args) => gpu_check::run(&args),
        Command::Sim(args) => sim::run(&args),
        Command::Planner(args) => planner::run(&args),
        Command::Bench(BenchCommand::Serve(args)) => bench_serve::run_serve(&args),
        Command::Bench(BenchCommand::Compare(args)) => bench_serve::run_compare(&args),
        Command::Bench(BenchCommand::Plot(args)) => bench_serve::run_plot(&args),
        Command::Bench(BenchCommand::Engine(args)) => bench_engine::run(&args),
        Command::Bench(BenchCommand::Transfer(args)) => bench_ttft::run(&args),
        Command::Bench(BenchCommand::Trace(args)) => bench_trace::run(&args),
        Command::Bench(BenchCommand::PrefillNode(args)) => bench_ttft::prefill_node(&args),
        Command::Bench(BenchCommand::ScriptedServer(args)) => bench_scripted::run(&args),
    }
}

/// The command line; the layered roles' flags without their environment variables, which
/// `config::run` layers itself (between the TOML file and the flags).
fn parse_cli() -> Cli {
    let command = Cli::command();
    let command = config::layered::<serve::ServeConfig>(command);
    let command = config::layered::<node::config::RouterNodeConfig>(command);
    let command = config::layered::<node::config::PrefillNodeConfig>(command);
    let command = config::layered::<node::config::DecodeNodeConfig>(command);
    Cli::from_arg_matches(&command.get_matches()).unwrap_or_else(|e| e.exit())
}
