//! The mesh's hand-off on one host: a prefill node on `--device` computes each prompt and
//! pushes its KV layer by layer over QUIC to a decode node on the CPU, which decodes the
//! rest. The nodes are the workers, gRPC services and QUIC transports `kvmesh prefill` and
//! `kvmesh decode` run, in one process; requests enter at the decode node's `Generate`.
//! Greedy output must equal a CPU-only run of the same requests.

use anyhow::{bail, Context, Result};
use kvmesh_common::grpc::{self, pb, PrefillNode};
use kvmesh_common::{GenerateEvent, GenerateRequest, NodeId, RequestId, SamplingParams, TokenId};
use kvmesh_decode::{DecodeConfig, DecodeService, DecodeWorker, PrefillDirectory};
use kvmesh_engine::device::Device;
use kvmesh_engine::engine_config::EngineConfig;
use kvmesh_engine::llama_runner::LlamaRunner;
use kvmesh_engine::llm_engine::LlmEngine;
use kvmesh_engine::Loaded;
use kvmesh_prefill::{PrefillConfig, PrefillService, PrefillWorker};
use kvmesh_transfer::{KvChunk, KvReceiver, QuicConfig, QuicTransport, Transport, TransportError};
use kvmesh_worker::{DestinationAddresses, LearnPeer};
use serde_json::{json, Value};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_stream::wrappers::TcpListenerStream;

const PREFILL_NODE: NodeId = NodeId(0x6c0);
const DECODE_NODE: NodeId = NodeId(0x6c1);
/// Prompts at least this long are prefilled remotely (all of the check's are longer).
const LOCAL_PREFILL_MAX_TOKENS: usize = 16;
const LOOPBACK: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);

/// Alternatives whose log-probabilities each token reports, besides its own.
const TOP_LOGPROBS: u32 = 5;

/// The requests of the check: `prompts`, each greedy for `max_tokens` tokens, reporting
/// log-probabilities (they see a wrong KV that leaves a greedy token unchanged).
pub fn requests(prompts: &[Vec<TokenId>], max_tokens: u32) -> Vec<GenerateRequest> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| GenerateRequest {
            request_id: RequestId(i as u64 + 1),
            prompt: p.clone(),
            params: SamplingParams {
                ignore_eos: true,
                logprobs: Some(TOP_LOGPROBS),
                ..SamplingParams::greedy(max_tokens)
            },
            resume: Vec::new(),
        })
        .collect()
}

/// One generated token and the log-probabilities reported with it.
#[derive(Clone, Debug, PartialEq)]
struct Token {
    id: TokenId,
    logprob: Option<f32>,
    top: Vec<(TokenId, f32)>,
}

/// The largest difference between the log-probabilities two runs report for the same
/// tokens and alternatives (infinite where one reports and the other does not).
fn logprob_gap(a: &[Token], b: &[Token]) -> f32 {
    let mut gap = 0f32;
    for (x, y) in a.iter().zip(b) {
        match (x.logprob, y.logprob) {
            (Some(p), Some(q)) if x.id == y.id => gap = gap.max((p - q).abs()),
            (None, None) if x.id == y.id => {}
            _ => return f32::INFINITY,
        }
        for (id, p) in &x.top {
            if let Some((_, q)) = y.top.iter().find(|(j, _)| j == id) {
                gap = gap.max((p - q).abs());
            }
        }
    }
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    gap
}

fn ids(tokens: &[Token]) -> Vec<TokenId> {
    tokens.iter().map(|t| t.id).collect()
}

/// Runs `requests` through the hand-off with the prefill node on `prefill_device` and
/// compares each output with a lone CPU run: the same greedy tokens. The log-probabilities'
/// largest difference is reported (a GPU's rounding moves them; the `models` check bounds
/// the logits). A control run zeroes the KV in flight: it must move the output further from
/// the CPU's than the real run does, or the check could not see the KV.
pub fn check(
    loaded: &Loaded,
    prefill_device: Device,
    reference_gemv: bool,
    requests: &[GenerateRequest],
    failures: &mut Vec<String>,
) -> Result<Value> {
    let reference: Vec<Vec<Token>> = requests
        .iter()
        .map(|r| lone_cpu_run(loaded, r))
        .collect::<Result<_>>()?;
    let mesh = run_mesh(
        loaded,
        prefill_device,
        reference_gemv,
        requests,
        KvFault::None,
    )?;
    // Well-formed chunks of wrong KV: a check that passed them would not be checking the KV.
    let control = run_mesh(
        loaded,
        prefill_device,
        reference_gemv,
        requests,
        KvFault::Zeroed,
    )?;

    let mut per_request = Vec::new();
    let (mut all_equal, mut worst, mut control_worst) = (true, 0f32, 0f32);
    for (((r, got), want), blind) in requests
        .iter()
        .zip(&mesh.outputs)
        .zip(&reference)
        .zip(&control.outputs)
    {
        let (got_ids, want_ids) = (ids(got), ids(want));
        let first_difference = got_ids.iter().zip(&want_ids).position(|(a, b)| a != b);
        let equal = got_ids == want_ids;
        let gap = logprob_gap(got, want);
        let control_gap = logprob_gap(blind, want);
        all_equal &= equal;
        worst = worst.max(gap);
        control_worst = control_worst.max(control_gap);
        per_request.push(json!({
            "prompt_tokens": r.prompt.len(),
            "tokens": got_ids,
            "cpu_tokens": want_ids,
            "equal": equal,
            "first_difference": first_difference,
            "max_logprob_difference": finite(gap),
            "control_tokens": ids(blind),
            "control_max_logprob_difference": finite(control_gap),
        }));
    }
    let sees_kv = control_worst > worst;
    let pass = all_equal && mesh.chunks > 0 && sees_kv;
    let what = format!("handoff ({prefill_device} prefill -> cpu decode over QUIC)");
    if !all_equal {
        failures.push(format!(
            "{what}: greedy output differs from the CPU-only run"
        ));
    }
    if mesh.chunks == 0 {
        failures.push(format!("{what}: no KV went over QUIC"));
    }
    if !sees_kv {
        failures.push(format!(
            "{what}: zeroing the KV in flight moved log-probabilities by {control_worst}, no \
             more than the real run's {worst}: the check cannot see the KV"
        ));
    }
    Ok(json!({
        "prefill_device": prefill_device.to_string(),
        "decode_device": "cpu",
        "transport": "quic",
        "requests": per_request,
        "kv_chunks_sent": mesh.chunks,
        "kv_bytes_sent": mesh.bytes,
        "seconds": mesh.seconds,
        "max_logprob_difference": finite(worst),
        "control_zeroed_kv_max_logprob_difference": finite(control_worst),
        "pass": pass,
    }))
}

/// JSON has no infinity: a missing or mismatched log-probability is `null`.
fn finite(x: f32) -> Option<f32> {
    x.is_finite().then_some(x)
}

/// What one run of the mesh gave.
struct MeshRun {
    outputs: Vec<Vec<Token>>,
    chunks: u64,
    bytes: u64,
    seconds: f64,
}

/// Starts the two nodes as `kvmesh prefill` and `kvmesh decode` run them, in this process:
/// each worker behind its gRPC service, each on its own QUIC endpoint, the prefill node's
/// KV passing through `fault`. Sends `requests` to the decode node's `Generate`, all at
/// once, naming the prefill node; the decode node calls it over gRPC with its transfer
/// address, which the prefill node learns and pushes the KV to over QUIC.
fn run_mesh(
    loaded: &Loaded,
    prefill_device: Device,
    reference_gemv: bool,
    requests: &[GenerateRequest],
    fault: KvFault,
) -> Result<MeshRun> {
    let prefill_quic = Arc::new(QuicTransport::start(QuicConfig {
        listen: LOOPBACK,
        ..QuicConfig::default()
    })?);
    let decode_quic = QuicTransport::start(QuicConfig {
        listen: LOOPBACK,
        ..QuicConfig::default()
    })?;
    let transfer_address = decode_quic.local_addr().to_string();
    let sent = Arc::new(Counted::new(prefill_quic.clone(), fault));
    let prefill = PrefillWorker::spawn(
        PrefillConfig::new(PREFILL_NODE),
        engine(loaded, prefill_device, reference_gemv)?,
        sent.clone(),
    )
    .context("starting the prefill worker")?;
    let decode_config = DecodeConfig {
        local_prefill_max_tokens: LOCAL_PREFILL_MAX_TOKENS,
        remote_prefill_timeout: Duration::from_secs(120),
        ..DecodeConfig::new(DECODE_NODE)
    };
    let decode = DecodeWorker::spawn(
        decode_config,
        engine(loaded, Device::Cpu, false)?,
        Arc::new(decode_quic),
    )
    .context("starting the decode worker")?;
    let learn: LearnPeer = Arc::new(move |node, addr| prefill_quic.add_peer(node, addr));
    let prefill_service = PrefillService::new(prefill.handle(), loaded.fingerprint, learn);
    let directory = PrefillDirectory::new(
        DestinationAddresses::receive_only(transfer_address),
        None,
        Duration::from_secs(5),
    );
    let decode_service = DecodeService::new(decode.handle(), Arc::new(directory));

    let runtime = crate::node::runtime()?;
    let (outputs, seconds) = runtime.block_on(async {
        // Each node's gRPC address, a loopback port of its own.
        let (prefill_listener, decode_listener) = (
            tokio::net::TcpListener::bind(LOOPBACK).await?,
            tokio::net::TcpListener::bind(LOOPBACK).await?,
        );
        let (prefill_addr, decode_addr) = (
            prefill_listener.local_addr()?,
            decode_listener.local_addr()?,
        );
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(prefill_service.into_server())
                .serve_with_incoming(TcpListenerStream::new(prefill_listener)),
        );
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(decode_service.into_server())
                .serve_with_incoming(TcpListenerStream::new(decode_listener)),
        );
        let client = pb::decode_client::DecodeClient::connect(format!("http://{decode_addr}"))
            .await
            .context("connecting to the decode node")?;
        let target = PrefillNode {
            node_id: PREFILL_NODE,
            address: prefill_addr.to_string(),
        };
        let started = Instant::now();
        let calls: Vec<_> = requests
            .iter()
            .map(|r| tokio::spawn(generate(client.clone(), r.clone(), target.clone())))
            .collect();
        let mut outputs = Vec::with_capacity(calls.len());
        for call in calls {
            outputs.push(call.await.context("a Generate call")??);
        }
        anyhow::Ok((outputs, started.elapsed().as_secs_f64()))
    })?;
    let (chunks, bytes) = sent.totals();
    Ok(MeshRun {
        outputs,
        chunks,
        bytes,
        seconds,
    })
}

/// Streams `request`'s tokens from the decode node, prefilled on `prefill`.
async fn generate(
    mut client: pb::decode_client::DecodeClient<tonic::transport::Channel>,
    request: GenerateRequest,
    prefill: PrefillNode,
) -> Result<Vec<Token>> {
    let call = grpc::generate_request_to_pb(&request, &prefill.into());
    let mut stream = client.generate(call).await?.into_inner();
    let mut tokens = Vec::new();
    while let Some(event) = stream.message().await? {
        let event = GenerateEvent::try_from(event)
            .map_err(|e| anyhow::anyhow!("a malformed Generate event: {e:?}"))?;
        match event {
            GenerateEvent::Token(t) => tokens.push(Token {
                id: t.token,
                logprob: t.logprob,
                top: t.top_logprobs,
            }),
            GenerateEvent::Finished { .. } => return Ok(tokens),
            GenerateEvent::Error(e) => bail!("the decode node failed a request: {e}"),
        }
    }
    bail!("the decode node ended a stream before it finished")
}

/// An engine over `loaded` on `device`, as the nodes build theirs (prompts prefill in chunks).
fn engine(loaded: &Loaded, device: Device, reference_gemv: bool) -> Result<LlmEngine<LlamaRunner>> {
    let config = EngineConfig {
        num_blocks: 512,
        max_model_len: Some(4096),
        device,
        cuda_reference_gemv: reference_gemv,
        ..EngineConfig::default()
    };
    Ok(config.llama_engine(loaded)?)
}

/// What one CPU engine alone generates for `request`: the reference.
fn lone_cpu_run(loaded: &Loaded, request: &GenerateRequest) -> Result<Vec<Token>> {
    let mut e = engine(loaded, Device::Cpu, false)?;
    e.add_request(0, request.prompt.clone(), request.params.clone(), 0)?;
    let mut tokens = Vec::new();
    while e.has_work() {
        for out in e.step()? {
            tokens.extend(out.sampled.map(|s| Token {
                id: s.token,
                logprob: s.logprob,
                top: s.top_logprobs,
            }));
        }
    }
    Ok(tokens)
}

/// What happens to the KV on its way.
#[derive(Clone, Copy, PartialEq, Eq)]
enum KvFault {
    None,
    /// Every value zeroed, the chunk resealed: well-formed, wrong KV.
    Zeroed,
}

/// The prefill node's transport, counting the KV chunks and bytes it sends.
struct Counted {
    inner: Arc<dyn Transport>,
    fault: KvFault,
    chunks: AtomicU64,
    bytes: AtomicU64,
}

impl Counted {
    fn new(inner: Arc<dyn Transport>, fault: KvFault) -> Self {
        Counted {
            inner,
            fault,
            chunks: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        }
    }

    fn totals(&self) -> (u64, u64) {
        (
            self.chunks.load(Ordering::SeqCst),
            self.bytes.load(Ordering::SeqCst),
        )
    }
}

impl Transport for Counted {
    fn bind(&self, node: NodeId) -> Result<KvReceiver, TransportError> {
        self.inner.bind(node)
    }

    fn unbind(&self, node: NodeId) {
        self.inner.unbind(node)
    }

    fn send(
        &self,
        dest: NodeId,
        mut chunk: KvChunk,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let bytes = chunk.payload.len() as u64;
        if self.fault == KvFault::Zeroed {
            let h = chunk.header;
            let zeros = vec![0; chunk.payload.len()];
            chunk = KvChunk::seal(h.request_id, h.layers(), h.blocks, h.shape, zeros)
                .unwrap_or_else(|e| unreachable!("the shape of a sealed chunk reseals: {e}"));
        }
        self.inner.send(dest, chunk, deadline)?;
        self.chunks.fetch_add(1, Ordering::SeqCst);
        self.bytes.fetch_add(bytes, Ordering::SeqCst);
        Ok(())
    }

    fn end_transfer(&self, dest: NodeId, request: RequestId) {
        self.inner.end_transfer(dest, request)
    }
}
