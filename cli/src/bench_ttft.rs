//! Time to first token of a long prompt prefilled on another process (its KV streamed over
//! QUIC, layer by layer) against the same prompt prefilled locally on the decode node, and
//! how much of the KV transfer hid behind the prefill's compute; and of a prompt whose prefix
//! another decode node has cached, pulled from there over QUIC instead of recomputed.
//!
//! The prefill side is a child process (`kvmesh bench prefill-node`, hidden): a prefill
//! worker behind its gRPC service and a QUIC transport, no etcd. It prints its gRPC address
//! on stdout and exits when its stdin closes, so it never outlives the bench.

use crate::model_args::{self, ModelArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use kvmesh_common::{GenerateEvent, GenerateRequest, NodeId, RequestId, SamplingParams};
use kvmesh_decode::{DecodeConfig, DecodeHandle, DecodeWorker};
use kvmesh_engine::engine_config::EngineConfig;
use kvmesh_engine::runner::ModelRunner;
use kvmesh_prefill::{PrefillConfig, PrefillService, PrefillWorker};
use kvmesh_transfer::{QuicConfig, QuicTransport, Transport};
use kvmesh_worker::{DestinationAddresses, KvPull, PrefillTarget, RemotePrefill};
use serde::Serialize;
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const LOOPBACK: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 0);

#[derive(Clone, Debug, Serialize)]
pub struct TtftReport {
    pub prompt_tokens: usize,
    /// KV bytes one prompt moves (all layers).
    pub kv_bytes: u64,
    /// Median TTFT with the prompt prefilled on the decode node.
    pub local_ttft_s: f64,
    /// Median TTFT with the prompt prefilled on the other process.
    pub disaggregated_ttft_s: f64,
    /// disaggregated / local (target: at most 1.05).
    pub ttft_ratio: f64,
    /// Median TTFT with the prompt's prefix cached on another decode node and pulled from
    /// there (`KvCache.Export`'s path, over QUIC); only the last block's tail is computed.
    pub pulled_ttft_s: f64,
    /// pulled / local: what a pull saves against recomputing.
    pub pull_ratio: f64,
    /// How long the KV would take on its own at the measured QUIC rate.
    pub transfer_alone_s: f64,
    /// 1 - (extra TTFT of the disaggregated path) / transfer_alone, in [0, 1]: the share of
    /// the transfer that overlapped the compute (the RPC round trips count against it).
    pub transfer_hidden_fraction: f64,
    pub runs: usize,
}

/// Runs `runs` prompts of `prompt_tokens` each way (alternating, fresh prompts so no prefix
/// cache helps), on `threads` compute threads per process.
pub fn measure(
    model: &ModelArgs,
    prompt_tokens: usize,
    runs: usize,
    quic_bytes_per_s: f64,
) -> Result<TtftReport> {
    let path = model.prepare()?;
    let loaded = model_args::load(&path)?;
    let engine = engine_config(prompt_tokens).llama_engine(&loaded)?;
    let shape = engine.runner().kv_shape();
    let kv_bytes = (prompt_tokens.div_ceil(shape.block_size)
        * shape.block_bytes_per_layer()
        * shape.num_layers) as u64;
    let mut child = spawn_prefill_node(model)?;
    let prefill_addr = read_address(&mut child)?;

    let quic = QuicTransport::start(QuicConfig {
        listen: LOOPBACK,
        ..QuicConfig::default()
    })?;
    let transfer_address = quic.local_addr().to_string();
    let transport: Arc<dyn Transport> = Arc::new(quic);
    let decode = DecodeWorker::spawn(DecodeConfig::new(NodeId(0x200)), engine, transport)?;
    let handle = decode.handle();
    let runtime = crate::node::runtime()?;
    let remote = runtime.block_on(RemotePrefill::connect(
        &prefill_addr,
        None,
        DestinationAddresses::receive_only(transfer_address.clone()),
        Duration::from_secs(5),
    ))?;
    let remote: PrefillTarget = Arc::new(remote);
    // A second decode node on its own QUIC endpoint: it computes prompts the first pulls.
    let holder_quic = QuicTransport::start(QuicConfig {
        listen: LOOPBACK,
        ..QuicConfig::default()
    })?;
    holder_quic.add_peer(handle.node_id(), transfer_address.parse()?);
    let holder_engine = engine_config(prompt_tokens).llama_engine(&loaded)?;
    let holder = DecodeWorker::spawn(
        DecodeConfig::new(NodeId(0x201)),
        holder_engine,
        Arc::new(holder_quic),
    )?;
    let holder = holder.handle();

    let vocab = loaded.model.config.vocab_size as u32;
    let (mut local, mut disagg, mut pulled) = (Vec::new(), Vec::new(), Vec::new());
    // One warm-up each way, not counted.
    for run in 0..=runs {
        let l = ttft(&handle, prompt(3 * run, prompt_tokens, vocab), None, None)?;
        let d = ttft(
            &handle,
            prompt(3 * run + 1, prompt_tokens, vocab),
            Some(remote.clone()),
            None,
        )?;
        let cached_elsewhere = prompt(3 * run + 2, prompt_tokens, vocab);
        ttft(&holder, cached_elsewhere.clone(), None, None)?;
        let pull = KvPull {
            source: Arc::new(holder.clone()),
            blocks: prompt_tokens / shape.block_size,
        };
        let p = ttft(&handle, cached_elsewhere, None, Some(pull))?;
        if run > 0 {
            local.push(l);
            disagg.push(d);
            pulled.push(p);
        }
    }
    drop(child.stdin.take());
    let _ = child.wait();
    let (local_ttft_s, disaggregated_ttft_s) = (median(&mut local), median(&mut disagg));
    let pulled_ttft_s = median(&mut pulled);
    let transfer_alone_s = kv_bytes as f64 / quic_bytes_per_s;
    let extra = (disaggregated_ttft_s - local_ttft_s).max(0.0);
    Ok(TtftReport {
        prompt_tokens,
        kv_bytes,
        local_ttft_s,
        disaggregated_ttft_s,
        ttft_ratio: disaggregated_ttft_s / local_ttft_s,
        pulled_ttft_s,
        pull_ratio: pulled_ttft_s / local_ttft_s,
        transfer_alone_s,
        transfer_hidden_fraction: (1.0 - extra / transfer_alone_s).clamp(0.0, 1.0),
        runs,
    })
}

/// Room for one long prompt, prefilled in one step.
fn engine_config(prompt_tokens: usize) -> EngineConfig {
    EngineConfig {
        max_num_batched_tokens: prompt_tokens.max(2048),
        ..EngineConfig::default()
    }
}

/// A prompt no other run shares a block with (its first token differs).
fn prompt(run: usize, len: usize, vocab: u32) -> Vec<u32> {
    (0..len)
        .map(|i| ((run * 7919 + i * 104_729) as u32 % (vocab - 1000)) + 500)
        .collect()
}

fn ttft(
    handle: &DecodeHandle,
    prompt: Vec<u32>,
    prefill: Option<PrefillTarget>,
    pull: Option<KvPull>,
) -> Result<f64> {
    let request = GenerateRequest {
        request_id: RequestId(rand::random()),
        prompt,
        params: SamplingParams::greedy(2),
        resume: Vec::new(),
    };
    let start = Instant::now();
    let mut events = handle.generate_pulling(request, prefill, pull)?;
    match events.blocking_recv() {
        Some(GenerateEvent::Token(_)) => Ok(start.elapsed().as_secs_f64()),
        other => bail!("expected a first token, got {other:?}"),
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn spawn_prefill_node(model: &ModelArgs) -> Result<std::process::Child> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(["bench", "prefill-node"]);
    if let Some(m) = &model.model {
        cmd.arg("--model").arg(m);
    }
    if let Some(t) = model.threads {
        cmd.arg("--threads").arg(t.to_string());
    }
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the prefill process")
}

fn read_address(child: &mut std::process::Child) -> Result<String> {
    let stdout = child.stdout.take().context("child stdout")?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    match line.trim().strip_prefix("listening ") {
        Some(a) => Ok(a.to_string()),
        None => bail!("the prefill process did not start (it said {line:?})"),
    }
}

#[derive(Args, Debug)]
pub struct PrefillNodeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Longest prompt it must take in one step.
    #[arg(long, default_value_t = 2048)]
    pub max_prompt: usize,
}

/// The child: serves `Prefill` on loopback until stdin closes.
pub fn prefill_node(args: &PrefillNodeArgs) -> Result<()> {
    let path = args.model.prepare()?;
    let loaded = model_args::load(&path)?;
    let engine = engine_config(args.max_prompt).llama_engine(&loaded)?;
    let quic = Arc::new(QuicTransport::start(QuicConfig {
        listen: LOOPBACK,
        ..QuicConfig::default()
    })?);
    let transport: Arc<dyn Transport> = quic.clone();
    let worker = PrefillWorker::spawn(PrefillConfig::new(NodeId(0x100)), engine, transport)?;
    let learn = Arc::new(move |node, addr| quic.add_peer(node, addr));
    let service = PrefillService::new(worker.handle(), loaded.fingerprint, learn);
    crate::node::runtime()?.block_on(async {
        let listener = tokio::net::TcpListener::bind(LOOPBACK).await?;
        println!("listening {}", listener.local_addr()?);
        let stdin_closed = tokio::task::spawn_blocking(|| {
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
        });
        tonic::transport::Server::builder()
            .add_service(service.into_server())
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                async {
                    let _ = stdin_closed.await;
                },
            )
            .await?;
        anyhow::Ok(())
    })
}

/// `kvmesh bench transfer`: the transport rates, then the TTFT comparison at the measured
/// QUIC rate.
#[derive(Args, Debug)]
pub struct BenchTransferCommand {
    #[command(flatten)]
    pub transfer: crate::bench_transfer::BenchTransferArgs,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length of the TTFT comparison.
    #[arg(long, default_value_t = 2000)]
    pub ttft_prompt: usize,
    /// Timed prompts each way (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub ttft_runs: usize,
}

pub fn run(cmd: &BenchTransferCommand) -> Result<()> {
    if cmd.transfer.role.is_some() {
        return crate::bench_transfer::main(&cmd.transfer);
    }
    let transfer = crate::bench_transfer::run(&cmd.transfer)?;
    let mut model = cmd.model.clone();
    model.threads = Some(model.threads.unwrap_or(2));
    let ttft = measure(
        &model,
        cmd.ttft_prompt,
        cmd.ttft_runs.max(1),
        transfer.quic_gb_s * 1e9,
    )?;
    if cmd.transfer.json {
        let both = serde_json::json!({"transfer": transfer, "ttft": ttft});
        println!("{both}");
        return Ok(());
    }
    crate::bench_transfer::print_report(&transfer);
    println!(
        "TTFT of a {}-token prompt ({:.1} MB of KV): local {:.3} s, disaggregated {:.3} s, ratio {:.3}",
        ttft.prompt_tokens,
        ttft.kv_bytes as f64 / 1e6,
        ttft.local_ttft_s,
        ttft.disaggregated_ttft_s,
        ttft.ttft_ratio
    );
    println!(
        "transfer alone {:.1} ms; hidden behind compute: {:.0}%",
        ttft.transfer_alone_s * 1e3,
        ttft.transfer_hidden_fraction * 100.0
    );
    println!(
        "TTFT with the prefix cached on another decode node and pulled: {:.3} s, {:.3} of local",
        ttft.pulled_ttft_s, ttft.pull_ratio
    );
    Ok(())
}
