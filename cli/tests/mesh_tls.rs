//! Access control between nodes, with certificates made by `kvmesh certs`: a prefill and a
//! decode node (the real tonic services, workers and QUIC transport, in this process) serve
//! each other and a router over mutual TLS; a peer without a cluster certificate is refused
//! on gRPC and on QUIC; and garbage from unauthenticated peers, on the gRPC port, in gRPC
//! messages and on the KV transfer port, leaves the nodes serving.

use kvmesh_common::grpc::{self, pb, PrefillNode};
use kvmesh_common::tls::{grpc_endpoint, ClusterTls, CLUSTER_SERVER_NAME};
use kvmesh_common::{GenerateEvent, GenerateRequest, NodeId, RequestId, SamplingParams, TokenId};
use kvmesh_decode::{DecodeConfig, DecodeService, DecodeWorker, PrefillDirectory};
use kvmesh_engine::engine_config::EngineConfig;
use kvmesh_engine::Loaded;
use kvmesh_prefill::{PrefillConfig, PrefillService, PrefillWorker};
use kvmesh_transfer::{
    BlockShape, KvChunk, KvDtype, QuicConfig, QuicTransport, TlsConfig, Transport, TransportError,
};
use kvmesh_worker::DestinationAddresses;
use rand::{Rng, SeedableRng};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// Generous: these tests share two cores with whatever else runs; what they check is who
/// gets in, not how fast.
const PATIENCE: Duration = Duration::from_secs(300);

const LOOPBACK: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 0);

fn loaded() -> &'static Loaded {
    static MODEL: OnceLock<Loaded> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = kvmesh_prompt::model_fetch::fetched_model().unwrap_or_else(|e| panic!("{e}"));
        kvmesh_engine::load(&path).expect("the model (run `kvmesh fetch-model`)")
    })
}

/// Every test worker gets one of these engines; the metrics recorder goes in first, so the
/// workers' metric handles record (the tests read them).
fn engine() -> kvmesh_engine::llm_engine::LlmEngine<kvmesh_engine::llama_runner::LlamaRunner> {
    kvmesh_router::metrics_exporter();
    EngineConfig {
        block_size: 16,
        num_blocks: 128,
        max_num_batched_tokens: 256,
        max_num_seqs: 8,
        max_model_len: Some(1024),
        enable_prefix_caching: true,
        host_tier_blocks: 0,
        disk_tier_blocks: 0,
        disk_tier_dir: None,
        grammar_fast_forward: true,
        device: kvmesh_engine::device::Device::Cpu,
    }
    .llama_engine(loaded())
    .unwrap()
}

/// `kvmesh certs --out dir --nodes nodes`.
fn make_certs(dir: &Path, nodes: &str) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args(["certs", "--out", dir.to_str().unwrap(), "--nodes", nodes])
        .env("KVMESH_LOG", "warn")
        .output()
        .expect("kvmesh runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn load(dir: &Path, node: &str) -> ClusterTls {
    ClusterTls::load(
        &dir.join("ca.pem"),
        &dir.join(format!("{node}.pem")),
        &dir.join(format!("{node}.key")),
    )
    .unwrap()
}

/// The cluster's certificates and an outsider's, from a CA of its own.
struct Certs {
    _dirs: [tempfile::TempDir; 2],
    cluster: PathPair,
    other: PathPair,
}

struct PathPair(std::path::PathBuf);

impl Certs {
    fn new() -> Certs {
        let (cluster, other) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        make_certs(cluster.path(), "prefill-1,decode-1,router");
        make_certs(other.path(), "intruder");
        Certs {
            cluster: PathPair(cluster.path().to_path_buf()),
            other: PathPair(other.path().to_path_buf()),
            _dirs: [cluster, other],
        }
    }

    fn node(&self, name: &str) -> ClusterTls {
        load(&self.cluster.0, name)
    }

    fn intruder(&self) -> ClusterTls {
        load(&self.other.0, "intruder")
    }

    fn pem(&self, dir: &PathPair, file: &str) -> Vec<u8> {
        std::fs::read(dir.0.join(file)).unwrap()
    }
}

/// Serves `routes` on a fresh loopback port, with mutual TLS when `tls` is given.
async fn serve(routes: tonic::service::Routes, tls: Option<&ClusterTls>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind(LOOPBACK).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        server = server.tls_config(tls.grpc_server()).unwrap();
    }
    tokio::spawn(
        server
            .add_routes(routes)
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    addr
}

struct Mesh {
    _prefill: PrefillWorker,
    _decode: DecodeWorker,
    decode_id: NodeId,
    decode_addr: SocketAddr,
    /// Where the decode node receives KV (UDP).
    transfer_addr: SocketAddr,
    prefill: PrefillNode,
}

/// A prefill and a decode node; both present their certificate when `certs` is given.
async fn mesh(certs: Option<&Certs>, decode_id: NodeId) -> Mesh {
    let tls = |name| certs.map(|c| c.node(name));
    let quic = |tls: &Option<ClusterTls>| {
        QuicTransport::start(QuicConfig {
            listen: LOOPBACK,
            tls: tls
                .clone()
                .map_or(TlsConfig::SelfSigned, TlsConfig::Cluster),
            ..QuicConfig::default()
        })
        .unwrap()
    };
    let prefill_id = NodeId(decode_id.0 + 1);
    let prefill_tls = tls("prefill-1");
    let prefill_quic = Arc::new(quic(&prefill_tls));
    let transport: Arc<dyn Transport> = prefill_quic.clone();
    let prefill =
        PrefillWorker::spawn(PrefillConfig::new(prefill_id), engine(), transport).unwrap();
    let learn = Arc::new(move |node, addr| prefill_quic.add_peer(node, addr));
    let service = PrefillService::new(prefill.handle(), loaded().fingerprint, learn);
    let routes = tonic::service::Routes::new(service.into_server());
    let prefill_addr = serve(routes, prefill_tls.as_ref()).await;

    let decode_tls = tls("decode-1");
    let decode_quic = quic(&decode_tls);
    let transfer_addr = decode_quic.local_addr();
    let mut config = DecodeConfig::new(decode_id);
    config.local_prefill_max_tokens = 16;
    let decode = DecodeWorker::spawn(config, engine(), Arc::new(decode_quic)).unwrap();
    let directory = Arc::new(PrefillDirectory::new(
        DestinationAddresses::receive_only(transfer_addr.to_string()),
        decode_tls.clone(),
        PATIENCE,
    ));
    let routes =
        tonic::service::Routes::new(DecodeService::new(decode.handle(), directory).into_server());
    let decode_addr = serve(routes, decode_tls.as_ref()).await;
    Mesh {
        _prefill: prefill,
        _decode: decode,
        decode_id,
        decode_addr,
        transfer_addr,
        prefill: PrefillNode {
            node_id: prefill_id,
            address: prefill_addr.to_string(),
        },
    }
}

async fn channel(addr: SocketAddr, tls: Option<&ClusterTls>) -> Result<Channel, String> {
    let endpoint = grpc_endpoint(&addr.to_string(), tls).unwrap();
    connect(endpoint).await
}

async fn connect(endpoint: Endpoint) -> Result<Channel, String> {
    endpoint
        .connect_timeout(PATIENCE)
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))
}

fn request(id: u64, len: usize, max_tokens: u32) -> GenerateRequest {
    let text = "Mutual TLS keeps strangers out of the mesh: every node proves itself with a \
        certificate the cluster authority signed, and refuses anyone who cannot.";
    let base = loaded().tokenizer.encode(text, false).unwrap();
    GenerateRequest {
        request_id: RequestId(id),
        prompt: (0..len).map(|i| base[i % base.len()]).collect(),
        params: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(max_tokens)
        },
        resume: Vec::new(),
    }
}

/// Generates through the decode node, prefilled on `prefill` (or locally with `None`).
async fn generate(
    channel: Channel,
    req: &GenerateRequest,
    prefill: Option<&PrefillNode>,
) -> Result<Vec<TokenId>, tonic::Status> {
    let mut client = pb::decode_client::DecodeClient::new(channel);
    let placement = grpc::Placement {
        prefill: prefill.cloned(),
        pull: None,
    };
    let mut call = tonic::Request::new(grpc::generate_request_to_pb(req, &placement));
    call.set_timeout(PATIENCE);
    let mut stream = client.generate(call).await?.into_inner();
    let mut tokens = Vec::new();
    while let Some(e) = stream.message().await? {
        match GenerateEvent::try_from(e).unwrap() {
            GenerateEvent::Token(t) => tokens.push(t.token),
            GenerateEvent::Finished { .. } => return Ok(tokens),
            GenerateEvent::Error(e) => panic!("{e}"),
        }
    }
    panic!("the stream ended without Finished")
}

/// Remote prefills whose KV the decode node `node` received whole (from its metrics).
fn transfers_completed(node: NodeId) -> u64 {
    let node = node.to_string();
    let labels = [("node", &node[..]), ("role", "decode")];
    let scrape = kvmesh_router::metrics_exporter().render();
    let count = format!("{}_count", kvmesh_common::metrics::TRANSFER_SECONDS);
    kvmesh_common::metrics::scraped_sum(&scrape, &count, &labels) as u64
}

/// A request prefilled on the prefill node, whose KV crossed QUIC, gives the tokens of a
/// request prefilled on the decode node itself.
async fn assert_remote_prefill_works(m: &Mesh, router: Option<&ClusterTls>, id: u64) {
    let before = transfers_completed(m.decode_id);
    let c = channel(m.decode_addr, router).await.unwrap();
    let req = request(id, 48, 4);
    let local = generate(c.clone(), &req, None).await.unwrap();
    let remote = generate(c, &req, Some(&m.prefill)).await.unwrap();
    assert_eq!(local.len(), 4);
    assert_eq!(remote, local);
    assert_eq!(
        transfers_completed(m.decode_id),
        before + 1,
        "the decode node prefilled locally: it could not use the prefill node"
    );
}

async fn health(channel: Channel, service: &str) -> Result<pb::HealthReply, tonic::Status> {
    let mut call = tonic::Request::new(pb::HealthRequest {});
    call.set_timeout(PATIENCE);
    match service {
        "decode" => {
            pb::decode_client::DecodeClient::new(channel)
                .health(call)
                .await
        }
        _ => {
            pb::prefill_client::PrefillClient::new(channel)
                .health(call)
                .await
        }
    }
    .map(|r| r.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_with_cluster_certificates_serve_each_other_over_mutual_tls() {
    let certs = Certs::new();
    let m = mesh(Some(&certs), NodeId(0x1100)).await;
    assert_remote_prefill_works(&m, Some(&certs.node("router")), 1).await;
    let prefill = m.prefill.address.parse().unwrap();
    let c = channel(prefill, Some(&certs.node("router"))).await.unwrap();
    assert_eq!(
        health(c, "prefill").await.unwrap().node_id,
        m.prefill.node_id.0
    );
}

/// What a peer without a cluster certificate gets from `addr`: an error, not a reply.
async fn refused(addr: SocketAddr, service: &str, endpoint: Endpoint) -> String {
    let channel = match connect(endpoint).await {
        Err(e) => return e,
        Ok(c) => c,
    };
    match health(channel, service).await {
        Ok(reply) => panic!("{service} at {addr} answered an outsider: {reply:?}"),
        Err(status) => format!("{status:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_without_a_cluster_certificate_are_refused() {
    let certs = Certs::new();
    let m = mesh(Some(&certs), NodeId(0x2100)).await;
    let ca = Certificate::from_pem(certs.pem(&certs.cluster, "ca.pem"));
    let intruder = Identity::from_pem(
        certs.pem(&certs.other, "intruder.pem"),
        certs.pem(&certs.other, "intruder.key"),
    );
    let https = |addr: SocketAddr, tls: ClientTlsConfig| {
        Endpoint::from_shared(format!("https://{addr}"))
            .unwrap()
            .tls_config(tls.domain_name(CLUSTER_SERVER_NAME))
            .unwrap()
    };
    let prefill: SocketAddr = m.prefill.address.parse().unwrap();
    for (addr, service) in [(m.decode_addr, "decode"), (prefill, "prefill")] {
        // It trusts the cluster CA, but has no certificate to show.
        let why = refused(
            addr,
            service,
            https(addr, ClientTlsConfig::new().ca_certificate(ca.clone())),
        )
        .await;
        eprintln!("{service}, no client certificate: {why}");
        // It trusts the cluster CA and shows a certificate of another CA.
        let tls = ClientTlsConfig::new()
            .ca_certificate(ca.clone())
            .identity(intruder.clone());
        let why = refused(addr, service, https(addr, tls)).await;
        eprintln!("{service}, foreign certificate: {why}");
        // A node of another cluster altogether (it does not trust this one's servers either).
        let endpoint = grpc_endpoint(&addr.to_string(), Some(&certs.intruder())).unwrap();
        refused(addr, service, endpoint).await;
        // Plaintext gRPC.
        refused(
            addr,
            service,
            grpc_endpoint(&addr.to_string(), None).unwrap(),
        )
        .await;
    }

    // The KV transport: an outsider cannot push KV to the decode node.
    let chunk = {
        let shape = BlockShape {
            num_kv_heads: 2,
            block_size: 16,
            head_dim: 64,
        };
        let blocks = 512; // 4 MiB: more than the flow-control windows of a refused handshake
        let len = blocks * shape.block_bytes_per_layer(KvDtype::F16);
        let ids = (0..blocks as u32).map(kvmesh_common::BlockId).collect();
        KvChunk::seal(RequestId(9), 0..1, ids, shape, vec![7; len]).unwrap()
    };
    for tls in [TlsConfig::Cluster(certs.intruder()), TlsConfig::SelfSigned] {
        let outsider = QuicTransport::start(QuicConfig {
            listen: LOOPBACK,
            tls,
            ..QuicConfig::default()
        })
        .unwrap();
        outsider.add_peer(m.decode_id, m.transfer_addr);
        let sent = outsider.send(m.decode_id, chunk.clone(), Instant::now() + PATIENCE);
        assert!(
            matches!(sent, Err(TransportError::Connection { .. })),
            "{sent:?}"
        );
    }

    // Members still get in.
    assert_remote_prefill_works(&m, Some(&certs.node("router")), 2).await;
}

/// Sends `bytes` over TCP to `addr` and waits until the node hangs up (bounded).
async fn spray_tcp(addr: SocketAddr, bytes: &[u8]) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    // The node may hang up before reading everything: a failed write is an answer too.
    let _ = s.write_all(bytes).await;
    let mut sink = vec![0; 4096];
    let closed = tokio::time::timeout(PATIENCE, async {
        loop {
            match s.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(_) => continue,
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "{addr} kept a garbage connection open");
}

fn random_bytes(rng: &mut impl Rng, len: usize) -> Vec<u8> {
    (0..len).map(|_| rng.gen()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_from_outsiders_leaves_a_tls_node_serving() {
    let certs = Certs::new();
    let m = mesh(Some(&certs), NodeId(0x3100)).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(6);
    let prefill: SocketAddr = m.prefill.address.parse().unwrap();
    for addr in [m.decode_addr, prefill] {
        // (Fewer than 5 bytes, a partial record header, would be held until the handshake
        // timeout, like any slow client.)
        for len in [5, 300, 64 << 10] {
            spray_tcp(addr, &random_bytes(&mut rng, len)).await;
        }
        // A well-framed but truncated ClientHello.
        spray_tcp(
            addr,
            &[0x16, 0x03, 0x01, 0x00, 0x05, 0x01, 0x00, 0x00, 0x01, 0x00],
        )
        .await;
    }
    // Random datagrams, and some that look like QUIC long-header packets, at the KV port.
    let udp = tokio::net::UdpSocket::bind(LOOPBACK).await.unwrap();
    for i in 0..200 {
        let mut d = random_bytes(&mut rng, 1 + (i * 37) % 1400);
        if i % 2 == 0 && d.len() > 6 {
            d[0] = 0xc0 | (d[0] & 0x0f); // long header, Initial
            d[1..5].copy_from_slice(&1u32.to_be_bytes()); // QUIC v1
        }
        udp.send_to(&d, m.transfer_addr).await.unwrap();
    }
    assert_remote_prefill_works(&m, Some(&certs.node("router")), 3).await;
}

/// gRPC with a raw body, so a test can send bytes no generated client would.
#[derive(Clone, Default)]
struct RawCodec;

struct RawEncoder;
struct RawDecoder;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;

    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }

    fn decoder(&mut self) -> RawDecoder {
        RawDecoder
    }
}

impl tonic::codec::Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawDecoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        let n = bytes::Buf::remaining(src);
        Ok(Some(bytes::Buf::copy_to_bytes(src, n).to_vec()))
    }
}

/// Calls `path` with `body` as the message; the status the node answers with.
async fn raw_call(channel: Channel, path: &'static str, body: Vec<u8>) -> tonic::Status {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let mut call = tonic::Request::new(body);
    call.set_timeout(PATIENCE);
    let method = tonic::codegen::http::uri::PathAndQuery::from_static(path);
    if path.ends_with("/Generate") {
        let reply = grpc.server_streaming(call, method, RawCodec).await;
        match reply {
            Err(s) => s,
            Ok(stream) => match stream.into_inner().message().await {
                Err(s) => s,
                Ok(m) => panic!("Generate accepted garbage: {m:?}"),
            },
        }
    } else {
        match grpc.unary(call, method, RawCodec).await {
            Err(s) => s,
            Ok(r) => panic!("{path} accepted garbage: {:?}", r.into_inner()),
        }
    }
}

/// Without certificates anyone can reach the handlers: what they send is refused, message
/// by message, and the node keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_rpcs_are_refused_by_a_plaintext_node_that_keeps_serving() {
    let m = mesh(None, NodeId(0x4100)).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let prefill: SocketAddr = m.prefill.address.parse().unwrap();
    for addr in [m.decode_addr, prefill] {
        for len in [1, 24, 300, 64 << 10] {
            spray_tcp(addr, &random_bytes(&mut rng, len)).await;
        }
    }
    let calls = [
        (m.decode_addr, "/kvmesh.v1.Decode/Generate"),
        (prefill, "/kvmesh.v1.Prefill/Prefill"),
    ];
    for (addr, path) in calls {
        let c = channel(addr, None).await.unwrap();
        // Random bytes (almost never valid protobuf), and valid protobuf that is not a
        // valid message: a GenerateRequest / PrefillRequest without its required fields.
        let bodies = [
            random_bytes(&mut rng, 64),
            random_bytes(&mut rng, 5000),
            vec![0xff; 16],
            vec![0x08, 0x2a],
        ];
        for body in bodies {
            let status = raw_call(c.clone(), path, body.clone()).await;
            assert!(
                matches!(
                    status.code(),
                    tonic::Code::InvalidArgument | tonic::Code::Internal
                ),
                "{path} with {} bytes: {status:?}",
                body.len()
            );
        }
    }
    assert_remote_prefill_works(&m, None, 4).await;
}
