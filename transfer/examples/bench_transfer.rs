//! `kvmesh bench transfer` without the CLI binary, for measuring this crate on its own:
//!
//! ```text
//! cargo run --release -p kvmesh-transfer --example bench_transfer -- [--bytes N] [--chunk-bytes C] [--json]
//! ```
//!
//! It compiles the CLI's module as it is, and understands the `bench transfer --role ...`
//! arguments the module starts its receiving child process with.

#[path = "../../cli/src/bench_transfer.rs"]
mod bench_transfer;

use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: bench_transfer::BenchTransferArgs,
}

fn main() -> anyhow::Result<()> {
    let mut argv: Vec<String> = std::env::args().collect();
    if argv.len() >= 3 && argv[1] == "bench" && argv[2] == "transfer" {
        argv.drain(1..3);
    }
    bench_transfer::main(&Cli::parse_from(argv).args)
}
