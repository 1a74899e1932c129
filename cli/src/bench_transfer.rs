//! `kvmesh bench transfer`'s transport rates: the flags over [`kvmesh_transfer::bench`], whose
//! receiving process is this binary again, started with the hidden `--role`.

use anyhow::Result;
use clap::Args;
use kvmesh_transfer::bench::{self, BenchOptions, BenchTransferReport, Receiver, Role};
use std::process::Command;

#[derive(Args, Debug, Clone)]
pub struct BenchTransferArgs {
    /// Bytes moved by each transport.
    #[arg(long, default_value_t = 1 << 30)]
    pub bytes: u64,
    /// Bytes per chunk, rounded down to whole blocks. The default is one layer of a
    /// 2,000-token prompt: 125 blocks × 12,288 bytes (1.5 MB).
    #[arg(long, default_value_t = bench::DEFAULT_CHUNK_BYTES)]
    pub chunk_bytes: u64,
    /// Rounds of each transport, alternating QUIC and TCP so both see the same machine; the
    /// median is reported (a shared machine's neighbours move single runs by ±30%).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub rounds: u32,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Internal: run as the receiving child process (quic-receiver, tcp-receiver).
    #[arg(long, hide = true)]
    pub role: Option<Role>,
}

/// The subcommand: the child's part when `--role` is given, else the measurement, printed.
pub fn main(args: &BenchTransferArgs) -> Result<()> {
    if let Some(role) = args.role {
        return Ok(bench::receive(&Receiver {
            role,
            bytes: args.bytes,
            chunk_bytes: args.chunk_bytes,
        })?);
    }
    let r = run(args)?;
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        print_report(&r);
    }
    Ok(())
}

/// The report as a small table.
pub fn print_report(r: &BenchTransferReport) {
    println!("{r}");
}

/// Measures QUIC, TCP and memcpy over the same bytes, receiving in a child of this binary.
pub fn run(args: &BenchTransferArgs) -> Result<BenchTransferReport> {
    let options = BenchOptions {
        bytes: args.bytes,
        chunk_bytes: args.chunk_bytes,
        rounds: args.rounds,
    };
    Ok(bench::run(&options, &receiver_command)?)
}

/// `<this binary> bench transfer --role R --bytes N --chunk-bytes C`.
fn receiver_command(receiver: Receiver) -> std::io::Result<Command> {
    let mut command = Command::new(std::env::current_exe()?);
    command
        .args(["bench", "transfer", "--role", receiver.role.name()])
        .args(["--bytes", &receiver.bytes.to_string()])
        .args(["--chunk-bytes", &receiver.chunk_bytes.to_string()]);
    Ok(command)
}
