//! The KV transfer benchmark behind `kvmesh bench transfer`: GB/s of moving KV chunks between
//! two processes on loopback, over the QUIC transport and over raw TCP, next to an in-process
//! memcpy of the same bytes.
//!
//! The receiving process is started by the caller's [`Receiver`] command (the `kvmesh` binary
//! runs itself again) and calls [`receive`]:
//!
//! 1. [`run`] starts the receiver for `--role quic-receiver|tcp-receiver`, N bytes in chunks
//!    of C, with stdout piped;
//! 2. the child listens on 127.0.0.1 (port 0) and prints `listening <addr>`;
//! 3. the parent sends N bytes in chunks of C (QUIC: sealed KV chunks of one layer each,
//!    30 layers to a request, one stream per request; TCP: the bare payload bytes);
//! 4. the child prints `done <bytes>` once it holds all N bytes (QUIC: decoded and
//!    checksum-verified chunks) and exits. The parent's clock runs from its first send to
//!    that line.

use crate::{
    BlockShape, ChunkError, KvChunk, KvDtype, QuicConfig, QuicError, QuicTransport, Transport,
    TransportError,
};
use kvmesh_common::{BlockId, NodeId, RequestId};
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

/// One layer of a 2,000-token prompt: 125 blocks × 12,288 bytes (1.5 MB).
pub const DEFAULT_CHUNK_BYTES: u64 = 125 * 12_288;

/// What to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BenchOptions {
    /// Bytes moved by each transport.
    pub bytes: u64,
    /// Bytes per chunk, rounded down to whole blocks.
    pub chunk_bytes: u64,
    /// Rounds of each transport, alternating QUIC and TCP; the median is reported.
    pub rounds: u32,
}

/// Which receiver a child process runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    QuicReceiver,
    TcpReceiver,
}

impl Role {
    /// The name a command line gives the role.
    pub fn name(self) -> &'static str {
        match self {
            Role::QuicReceiver => "quic-receiver",
            Role::TcpReceiver => "tcp-receiver",
        }
    }
}

impl std::str::FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Role, String> {
        [Role::QuicReceiver, Role::TcpReceiver]
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| format!("unknown role {s:?} (quic-receiver, tcp-receiver)"))
    }
}

/// A receiving child process to start: its role and what it waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Receiver {
    pub role: Role,
    /// Bytes it receives before it prints `done`.
    pub bytes: u64,
    pub chunk_bytes: u64,
}

/// Why the benchmark failed.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{context}: {source}")]
    Io {
        context: &'static str,
        source: std::io::Error,
    },
    #[error("QUIC transport: {0}")]
    Quic(#[from] QuicError),
    #[error("sending KV: {0}")]
    Transport(#[from] TransportError),
    #[error("sealing a chunk: {0}")]
    Chunk(#[from] ChunkError),
    #[error("the receiving process: {0}")]
    Receiver(String),
}

fn io(context: &'static str) -> impl FnOnce(std::io::Error) -> BenchError {
    move |source| BenchError::Io { context, source }
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

/// The report as a small table.
impl std::fmt::Display for BenchTransferReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = self;
        writeln!(
            f,
            "{} chunks of {} bytes ({:.2} GB), two processes on loopback",
            r.chunks,
            r.chunk_bytes,
            r.bytes as f64 / 1e9
        )?;
        let rounds = |v: &[f64]| {
            let v: Vec<String> = v.iter().map(|x| format!("{x:.2}")).collect();
            v.join(" ")
        };
        writeln!(
            f,
            "quic    {:>7.2} GB/s  (median; rounds {})",
            r.quic_gb_s,
            rounds(&r.quic_rounds_gb_s)
        )?;
        writeln!(
            f,
            "tcp     {:>7.2} GB/s  (median; rounds {})",
            r.tcp_gb_s,
            rounds(&r.tcp_rounds_gb_s)
        )?;
        writeln!(f, "memcpy  {:>7.2} GB/s", r.memcpy_gb_s)?;
        write!(
            f,
            "quic/tcp {:.2}  quic/memcpy {:.3}",
            r.quic_over_tcp, r.quic_over_memcpy
        )
    }
}

/// Measures all three over the same bytes; `receiver` makes the command that starts a
/// receiving process (which calls [`receive`] with the same [`Receiver`]).
pub fn run(
    options: &BenchOptions,
    receiver: &dyn Fn(Receiver) -> std::io::Result<Command>,
) -> Result<BenchTransferReport, BenchError> {
    let block_bytes = SHAPE.block_bytes_per_layer(KvDtype::F16) as u64;
    let blocks = (options.chunk_bytes / block_bytes).max(1);
    let chunk_bytes = blocks * block_bytes;
    let chunks = (options.bytes / chunk_bytes).max(1);
    let bytes = chunks * chunk_bytes;
    let payload: Vec<u8> = (0..chunk_bytes).map(|i| (i * 7 + i / 4093) as u8).collect();

    let gb_s = |t: Duration| bytes as f64 / t.as_secs_f64() / 1e9;
    let (mut quic_rounds_gb_s, mut tcp_rounds_gb_s) = (Vec::new(), Vec::new());
    for _ in 0..options.rounds.max(1) {
        quic_rounds_gb_s.push(gb_s(time_quic(receiver, &payload, blocks as u32, chunks)?));
        tcp_rounds_gb_s.push(gb_s(time_tcp(receiver, &payload, chunks)?));
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

/// The receiving process's part: listens, announces its address on stdout, takes
/// `receiver.bytes` and says `done`.
pub fn receive(receiver: &Receiver) -> Result<(), BenchError> {
    match receiver.role {
        Role::QuicReceiver => quic_receiver(receiver.bytes),
        Role::TcpReceiver => tcp_receiver(receiver.bytes, receiver.chunk_bytes),
    }
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn time_quic(
    receiver: &dyn Fn(Receiver) -> std::io::Result<Command>,
    payload: &[u8],
    blocks: u32,
    chunks: u64,
) -> Result<Duration, BenchError> {
    let bytes = chunks * payload.len() as u64;
    let (mut child, mut out, addr) =
        spawn_receiver(receiver, Role::QuicReceiver, bytes, payload.len())?;
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

fn time_tcp(
    receiver: &dyn Fn(Receiver) -> std::io::Result<Command>,
    payload: &[u8],
    chunks: u64,
) -> Result<Duration, BenchError> {
    let bytes = chunks * payload.len() as u64;
    let (mut child, mut out, addr) =
        spawn_receiver(receiver, Role::TcpReceiver, bytes, payload.len())?;
    let mut stream = TcpStream::connect(addr).map_err(io("connecting to the TCP receiver"))?;
    stream
        .set_nodelay(true)
        .map_err(io("setting TCP_NODELAY"))?;
    let start = Instant::now();
    for _ in 0..chunks {
        stream.write_all(payload).map_err(io("sending over TCP"))?;
    }
    stream.flush().map_err(io("sending over TCP"))?;
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
    receiver: &dyn Fn(Receiver) -> std::io::Result<Command>,
    role: Role,
    bytes: u64,
    chunk_bytes: usize,
) -> Result<(Child, BufReader<ChildStdout>, SocketAddr), BenchError> {
    let mut child = receiver(Receiver {
        role,
        bytes,
        chunk_bytes: chunk_bytes as u64,
    })
    .map_err(io("making the receiver's command"))?
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .spawn()
    .map_err(io("starting the receiving process"))?;
    let mut out = BufReader::new(child.stdout.take().expect("piped"));
    let line = read_line(&mut out)?;
    let addr = line
        .strip_prefix("listening ")
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| BenchError::Receiver(format!("said {line:?}, expected listening ADDR")))?;
    Ok((child, out, addr))
}

fn wait_done(
    child: &mut Child,
    out: &mut BufReader<ChildStdout>,
    bytes: u64,
) -> Result<(), BenchError> {
    let line = read_line(out)?;
    if line != format!("done {bytes}") {
        return Err(BenchError::Receiver(format!(
            "said {line:?}, expected done {bytes}"
        )));
    }
    let status = child.wait().map_err(io("waiting for the receiver"))?;
    if !status.success() {
        return Err(BenchError::Receiver(format!("exited with {status}")));
    }
    Ok(())
}

fn read_line(out: &mut BufReader<ChildStdout>) -> Result<String, BenchError> {
    let mut line = String::new();
    if out
        .read_line(&mut line)
        .map_err(io("reading the receiver's output"))?
        == 0
    {
        return Err(BenchError::Receiver("exited early".into()));
    }
    Ok(line.trim_end().to_string())
}

fn quic_receiver(bytes: u64) -> Result<(), BenchError> {
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
            .map_err(|_| BenchError::Receiver("no chunk for a minute".into()))?;
        got += chunk.payload.len() as u64;
    }
    println!("done {got}");
    Ok(())
}

fn tcp_receiver(bytes: u64, chunk_bytes: u64) -> Result<(), BenchError> {
    let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .map_err(io("binding the TCP receiver"))?;
    announce(
        listener
            .local_addr()
            .map_err(io("the TCP receiver's address"))?,
    )?;
    let (mut stream, _) = listener.accept().map_err(io("accepting the sender"))?;
    let mut buf = vec![0u8; chunk_bytes as usize];
    let mut got = 0u64;
    while got < bytes {
        let n = stream.read(&mut buf).map_err(io("receiving over TCP"))?;
        if n == 0 {
            return Err(BenchError::Receiver(format!(
                "the sender closed after {got} bytes"
            )));
        }
        got += n as u64;
    }
    println!("done {got}");
    Ok(())
}

fn announce(addr: SocketAddr) -> Result<(), BenchError> {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "listening {addr}").map_err(io("announcing the address"))?;
    stdout.flush().map_err(io("announcing the address"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_read_back_from_their_names() {
        for role in [Role::QuicReceiver, Role::TcpReceiver] {
            assert_eq!(role.name().parse::<Role>(), Ok(role));
        }
        assert!("sender".parse::<Role>().is_err());
    }
}
