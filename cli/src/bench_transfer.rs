//! `kvmesh bench transfer`: GB/s of moving KV chunks between two processes on loopback, over
//! the QUIC transport and over raw TCP, next to an in-process memcpy of the same bytes.
//!
//! The receiving process is this binary again, started with the hidden `--role`:
//!
//! 1. the parent runs `<exe> bench transfer --role quic-receiver|tcp-receiver --bytes N
//!    --chunk-bytes C` with stdout piped;
//! 2. the child listens on 127.0.0.1 (port 0) and prints `listening <addr>`;
//! 3. the parent sends N bytes in chunks of C (QUIC: sealed KV chunks of one layer each,
//!    30 layers to a request, one stream per request; TCP: the bare payload bytes);
//! 4. the child prints `done <bytes>` once it holds all N bytes (QUIC: decoded and
//!    checksum-verified chunks) and exits. The parent's clock runs from its first send to
//!    that line.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use kvmesh_common::{BlockId, NodeId, RequestId};
use kvmesh_transfer::{BlockShape, KvChunk, KvDtype, QuicConfig, QuicTransport, Transport};
use serde::Serialize;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// SmolLM2-135M's KV block: 3 KV heads × 16 tokens × 64 dims, f16; K and V are 12,288 bytes
/// per block and layer.
const SHAPE: BlockShape = BlockShape {
    num_kv_heads: 3,
    block_size: 16,
    head_dim: 64,
};
const LAYERS_PER_REQUEST: usize = 30;
const RECEIVER: NodeId = NodeId(1);

#[derive(Args, Debug, Clone)]
pub struct BenchTransferArgs {
    /// Bytes moved by each transport.
    #[arg(long, default_value_t = 1 << 30)]
    pub bytes: u64,
    /// Bytes per chunk, rounded down to whole blocks. The default is one layer of a
    /// 2,000-token prompt: 125 blocks × 12,288 bytes (1.5 MB).
    #[arg(long, default_value_t = 125 * 12_288)]
    pub chunk_bytes: u64,
    /// Rounds of each transport, alternating QUIC and TCP so both see the same machine; the
    /// median is reported (a shared machine's neighbours move single runs by ±30%).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub rounds: u32,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Internal: run as the receiving child process.
    #[arg(long, hide = true, value_enum)]
    pub role: Option<Role>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Role {
    QuicReceiver,
    TcpReceiver,
}

#[derive(Clone, Debug, Serialize)]
pub struct BenchTransferReport {
    /// Bytes each transport moved (whole chunks).
    pub bytes: u64,
    pub chunk_bytes: u64,
    pub chunks: u64,
    /// Medians over the rounds.
    pub quic_gb_s: f64,
    pub tcp_gb_s: f64,
    pub memcpy_gb_s: f64,
    /// Every round, in order.
    pub quic_rounds_gb_s: Vec<f64>,
    pub tcp_rounds_gb_s: Vec<f64>,
    pub quic_over_tcp: f64,
    pub quic_over_memcpy: f64,
}

/// The subcommand: the child's part when `--role` is given, else the measurement, printed.
pub fn main(args: &BenchTransferArgs) -> Result<()> {
    match args.role {
        Some(Role::QuicReceiver) => return quic_receiver(args.bytes),
        Some(Role::TcpReceiver) => return tcp_receiver(args.bytes, args.chunk_bytes),
        None => {}
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
    println!(
        "{} chunks of {} bytes ({:.2} GB), two processes on loopback",
        r.chunks,
        r.chunk_bytes,
        r.bytes as f64 / 1e9
    );
    let rounds = |v: &[f64]| {
        let v: Vec<String> = v.iter().map(|x| format!("{x:.2}")).collect();
        v.join(" ")
    };
    println!(
        "quic    {:>7.2} GB/s  (median; rounds {})",
        r.quic_gb_s,
        rounds(&r.quic_rounds_gb_s)
    );
    println!(
        "tcp     {:>7.2} GB/s  (median; rounds {})",
        r.tcp_gb_s,
        rounds(&r.tcp_rounds_gb_s)
    );
    println!("memcpy  {:>7.2} GB/s", r.memcpy_gb_s);
    println!(
        "quic/tcp {:.2}  quic/memcpy {:.3}",
        r.quic_over_tcp, r.quic_over_memcpy
    );
}

/// Measures all three over the same bytes.
pub fn run(args: &BenchTransferArgs) -> Result<BenchTransferReport> {
    let block_bytes = SHAPE.block_bytes_per_layer(KvDtype::F16) as u64;
    let blocks = (args.chunk_bytes / block_bytes).max(1);
    let chunk_bytes = blocks * block_bytes;
    let chunks = (args.bytes / chunk_bytes).max(1);
    let bytes = chunks * chunk_bytes;
    let payload: Vec<u8> = (0..chunk_bytes).map(|i| (i * 7 + i / 4093) as u8).collect();

    let gb_s = |t: Duration| bytes as f64 / t.as_secs_f64() / 1e9;
    let (mut quic_rounds_gb_s, mut tcp_rounds_gb_s) = (Vec::new(), Vec::new());
    for _ in 0..args.rounds {
        quic_rounds_gb_s.push(gb_s(time_quic(&payload, blocks as u32, chunks)?));
        tcp_rounds_gb_s.push(gb_s(time_tcp(&payload, chunks)?));
    }
    let memcpy_gb_s = gb_s(time_memcpy(&payload, chunks));
    let (quic_gb_s, tcp_gb_s) = (median(&quic_rounds_gb_s), median(&tcp_rounds_gb_s));
    Ok(BenchTransferReport {
        bytes,
        chunk_bytes,
        chunks,
        quic_gb_s,
        tcp_gb_s,
        memcpy_gb_s,
        quic_rounds_gb_s,
        tcp_rounds_gb_s,
        quic_over_tcp: quic_gb_s / tcp_gb_s,
        quic_over_memcpy: quic_gb_s / memcpy_gb_s,
    })
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn time_quic(payload: &[u8], blocks: u32, chunks: u64) -> Result<Duration> {
    let bytes = chunks * payload.len() as u64;
    let (mut child, mut out, addr) = spawn_receiver(Role::QuicReceiver, bytes, payload.len())?;
    let transport = QuicTransport::start(QuicConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        ..QuicConfig::default()
    })?;
    transport.add_peer(RECEIVER, addr);
    // Sealed up front: the clock measures the transfer, not filling buffers.
    let all: Vec<KvChunk> = (0..chunks as usize)
        .map(|i| {
            let request = RequestId((i / LAYERS_PER_REQUEST) as u64 + 1);
            let layer = i % LAYERS_PER_REQUEST;
            let ids = (0..blocks).map(BlockId).collect();
            KvChunk::seal(request, layer..layer + 1, ids, SHAPE, payload.to_vec())
        })
        .collect::<Result<_, _>>()?;
    let start = Instant::now();
    for chunk in all {
        let (request, layer) = (chunk.header.request_id, chunk.header.first_layer);
        transport.send(RECEIVER, chunk, Instant::now() + Duration::from_secs(30))?;
        if layer as usize == LAYERS_PER_REQUEST - 1 {
            transport.end_transfer(RECEIVER, request);
        }
    }
    // The last request may be short of a full set of layers.
    transport.end_transfer(
        RECEIVER,
        RequestId(((chunks as usize - 1) / LAYERS_PER_REQUEST) as u64 + 1),
    );
    wait_done(&mut child, &mut out, bytes)?;
    Ok(start.elapsed())
}

fn time_tcp(payload: &[u8], chunks: u64) -> Result<Duration> {
    let bytes = chunks * payload.len() as u64;
    let (mut child, mut out, addr) = spawn_receiver(Role::TcpReceiver, bytes, payload.len())?;
    let mut stream = TcpStream::connect(addr).context("connecting to the TCP receiver")?;
    stream.set_nodelay(true)?;
    let start = Instant::now();
    for _ in 0..chunks {
        stream.write_all(payload)?;
    }
    stream.flush()?;
    wait_done(&mut child, &mut out, bytes)?;
    Ok(start.elapsed())
}

/// Copies every chunk into a 64 MiB ring, larger than caches, as a receiver placing KV would.
fn time_memcpy(payload: &[u8], chunks: u64) -> Duration {
    let slots = ((64 << 20) / payload.len()).max(2);
    // Touched before the clock starts: page faults are not what this measures.
    let mut ring = vec![1u8; slots * payload.len()];
    let start = Instant::now();
    for i in 0..chunks as usize {
        let at = (i % slots) * payload.len();
        ring[at..at + payload.len()].copy_from_slice(payload);
    }
    std::hint::black_box(&ring);
    start.elapsed()
}

fn spawn_receiver(
    role: Role,
    bytes: u64,
    chunk_bytes: usize,
) -> Result<(Child, BufReader<ChildStdout>, SocketAddr)> {
    let role = role.to_possible_value().expect("no skipped roles");
    let mut child = Command::new(std::env::current_exe()?)
        .args(["bench", "transfer", "--role", role.get_name()])
        .args(["--bytes", &bytes.to_string()])
        .args(["--chunk-bytes", &chunk_bytes.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the receiving process")?;
    let mut out = BufReader::new(child.stdout.take().expect("piped"));
    let line = read_line(&mut out)?;
    let addr = line
        .strip_prefix("listening ")
        .with_context(|| format!("receiver said {line:?}"))?
        .parse()?;
    Ok((child, out, addr))
}

fn wait_done(child: &mut Child, out: &mut BufReader<ChildStdout>, bytes: u64) -> Result<()> {
    let line = read_line(out)?;
    if line != format!("done {bytes}") {
        bail!("receiver said {line:?}, expected done {bytes}");
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("receiver exited with {status}");
    }
    Ok(())
}

fn read_line(out: &mut BufReader<ChildStdout>) -> Result<String> {
    let mut line = String::new();
    if out.read_line(&mut line)? == 0 {
        bail!("the receiving process exited early");
    }
    Ok(line.trim_end().to_string())
}

fn quic_receiver(bytes: u64) -> Result<()> {
    let transport = QuicTransport::start(QuicConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        ..QuicConfig::default()
    })?;
    let rx = transport.bind(RECEIVER)?;
    announce(transport.local_addr())?;
    let mut got = 0u64;
    while got < bytes {
        // The transport verified each chunk's checksum before queueing it.
        let chunk = rx
            .recv_timeout(Duration::from_secs(60))
            .context("no chunk for a minute")?;
        got += chunk.payload.len() as u64;
    }
    println!("done {got}");
    Ok(())
}

fn tcp_receiver(bytes: u64, chunk_bytes: u64) -> Result<()> {
    let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
    announce(listener.local_addr()?)?;
    let (mut stream, _) = listener.accept()?;
    let mut buf = vec![0u8; chunk_bytes as usize];
    let mut got = 0u64;
    while got < bytes {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            bail!("the sender closed after {got} bytes");
        }
        got += n as u64;
    }
    println!("done {got}");
    Ok(())
}

fn announce(addr: SocketAddr) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "listening {addr}")?;
    stdout.flush()?;
    Ok(())
}
