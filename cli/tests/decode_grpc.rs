//! The decode and prefill services over real gRPC and KV over real QUIC, in one process:
//! disaggregated output equals a lone local run, a call's deadline ends it and frees its
//! blocks, and dropping the call cancels it.

mod workers;

use kvmesh_common::grpc::{self, pb, PrefillNode};
use kvmesh_common::{metrics, GenerateEvent, GenerateRequest, NodeId};
use kvmesh_decode::{DecodeConfig, DecodeHandle, DecodeService, DecodeWorker, PrefillDirectory};
use kvmesh_prefill::{PrefillConfig, PrefillService, PrefillWorker};
use kvmesh_transfer::{
    LoopbackFabric, LoopbackRdma, NetworkTransport, QuicConfig, QuicTransport, RdmaPeering,
    Transport,
};
use kvmesh_worker::{DestinationAddresses, HolderDirectory, KvCacheService, LearnPeer};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio_stream::wrappers::TcpListenerStream;
use workers::*;

const LOOPBACK: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 0);

struct Mesh {
    /// The prefill node's RDMA device (`mesh_with(true)`).
    prefill_rdma: Option<Arc<LoopbackRdma>>,
    decode_network: Arc<NetworkTransport>,
    _prefill: PrefillWorker,
    _decode: DecodeWorker,
    decode: DecodeHandle,
    decode_addr: SocketAddr,
    prefill: PrefillNode,
}

async fn serve<S>(service: S) -> SocketAddr
where
    S: tonic::server::NamedService
        + tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    let listener = tokio::net::TcpListener::bind(LOOPBACK).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    addr
}

async fn mesh() -> Mesh {
    mesh_with(false).await
}

/// The two nodes over QUIC, plus loopback RDMA devices on both when `rdma`.
async fn mesh_with(rdma: bool) -> Mesh {
    let (prefill_id, decode_id) = (NodeId(0x100), NodeId(0x200));
    let fabric = LoopbackFabric::default();
    let network = |node| {
        let quic = QuicTransport::start(QuicConfig {
            listen: LOOPBACK,
            ..QuicConfig::default()
        })
        .unwrap();
        let device = rdma.then(|| Arc::new(fabric.device(node)));
        let peering = device.clone().map(|d| d as Arc<dyn RdmaPeering>);
        (Arc::new(NetworkTransport::with_rdma(quic, peering)), device)
    };
    let (prefill_network, prefill_rdma) = network(prefill_id);
    let (decode_network, _) = network(decode_id);
    let transfer_address = decode_network.quic().local_addr().to_string();
    let prefill_transport: Arc<dyn Transport> = prefill_network.clone();
    let prefill =
        PrefillWorker::spawn(PrefillConfig::new(prefill_id), engine(), prefill_transport).unwrap();
    let learn = {
        let network = prefill_network.clone();
        Arc::new(move |node, addr| network.add_peer(node, addr))
    };
    let service = PrefillService::new(prefill.handle(), loaded().fingerprint, learn)
        .with_rdma(prefill_network);
    let prefill_addr = serve(service.into_server()).await;

    let mut config = DecodeConfig::new(decode_id);
    config.local_prefill_max_tokens = 32;
    let decode = DecodeWorker::spawn(config, engine(), decode_network.clone()).unwrap();
    let directory = Arc::new(
        PrefillDirectory::new(
            DestinationAddresses::receive_only(transfer_address),
            None,
            Duration::from_secs(2),
        )
        .with_rdma(decode_id, decode_network.clone()),
    );
    let service = DecodeService::new(decode.handle(), directory);
    let decode_addr = serve(service.into_server()).await;
    Mesh {
        prefill_rdma,
        decode_network,
        decode: decode.handle(),
        _prefill: prefill,
        _decode: decode,
        decode_addr,
        prefill: PrefillNode {
            node_id: NodeId(0x100),
            address: prefill_addr.to_string(),
        },
    }
}

async fn client(addr: SocketAddr) -> pb::decode_client::DecodeClient<tonic::transport::Channel> {
    pb::decode_client::DecodeClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_prefill_over_grpc_and_quic_matches_a_local_run() {
    let m = mesh().await;
    remote_prefills_match_local_runs(&m).await;
    assert!(!m.decode_network.uses_rdma(m.prefill.node_id));
}

/// Both nodes have RDMA: the decode node swaps RDMA details with the prefill node over gRPC
/// before its first remote prefill, and the KV then comes over RDMA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_rdma_on_both_nodes_the_kv_comes_over_rdma() {
    let m = mesh_with(true).await;
    remote_prefills_match_local_runs(&m).await;
    assert!(m.decode_network.uses_rdma(m.prefill.node_id));
    let sent = m.prefill_rdma.as_ref().unwrap().chunks_sent();
    assert!(
        sent >= 2 * 30,
        "{sent} chunks over RDMA for 2 remote prefills of 30 layers"
    );
}

/// Two prefill nodes, the second pulling prefixes from its destinations; the decode node
/// serves pulls (`KvCache`) on its gRPC address. A prompt the decode node holds the first
/// 192 tokens of, prefilled on the node that lacks them: that node pulls those 12 blocks
/// from the decode node instead of recomputing them, and the output is a lone run's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_node_pulls_the_prefix_its_destination_holds() {
    let (p1_id, p2_id, d_id) = (NodeId(0x110), NodeId(0x111), NodeId(0x210));
    let quic = || {
        let quic = QuicTransport::start(QuicConfig {
            listen: LOOPBACK,
            ..QuicConfig::default()
        })
        .unwrap();
        Arc::new(NetworkTransport::with_rdma(quic, None))
    };
    let learn = |n: &Arc<NetworkTransport>| -> LearnPeer {
        let n = n.clone();
        Arc::new(move |node, addr| n.add_peer(node, addr))
    };
    let fingerprint = loaded().fingerprint;
    let (p1_net, p2_net, d_net) = (quic(), quic(), quic());
    let p1 = PrefillWorker::spawn(PrefillConfig::new(p1_id), engine(), p1_net.clone()).unwrap();
    let p2 = PrefillWorker::spawn(PrefillConfig::new(p2_id), engine(), p2_net.clone()).unwrap();
    let p1_addr =
        serve(PrefillService::new(p1.handle(), fingerprint, learn(&p1_net)).into_server()).await;
    let p2_transfer = p2_net.quic().local_addr().to_string();
    let holders = HolderDirectory::new(p2_transfer, None, Duration::from_secs(2));
    let p2_service =
        PrefillService::new(p2.handle(), fingerprint, learn(&p2_net)).with_pulls(Arc::new(holders));
    let p2_addr = serve(p2_service.into_server()).await;

    let mut config = DecodeConfig::new(d_id);
    config.local_prefill_max_tokens = 32;
    let decode = DecodeWorker::spawn(config, engine(), d_net.clone()).unwrap();
    let listener = tokio::net::TcpListener::bind(LOOPBACK).await.unwrap();
    let d_addr = listener.local_addr().unwrap();
    let addresses = DestinationAddresses {
        transfer: d_net.quic().local_addr().to_string(),
        holder: d_addr.to_string(),
    };
    let directory = Arc::new(PrefillDirectory::new(
        addresses,
        None,
        Duration::from_secs(2),
    ));
    let kv_cache = KvCacheService::new(Arc::new(decode.handle()), learn(&d_net));
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DecodeService::new(decode.handle(), directory).into_server())
            .add_service(kv_cache.into_server())
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );

    let mut c = client(d_addr).await;
    let target = |node_id, addr: SocketAddr| PrefillNode {
        node_id,
        address: addr.to_string(),
    };
    let prefix = prompt(7, 192);
    generate(
        &mut c,
        &request(41, prefix.clone(), 4),
        target(p1_id, p1_addr),
    )
    .await;
    let mut long = prefix;
    long.extend(prompt(8, 100));
    let second = request(42, long, 12);
    let want = tokio::task::spawn_blocking({
        let req = second.clone();
        move || reference(&req)
    })
    .await
    .unwrap();
    let got = generate(&mut c, &second, target(p2_id, p2_addr)).await;
    assert_eq!(got, want, "the pulled prefix changed the output");
    assert_eq!(counter(metrics::WORKER_KV_PULLED_BLOCKS_TOTAL, p2_id), 12);
    assert_eq!(counter(metrics::WORKER_KV_EXPORTED_BLOCKS_TOTAL, d_id), 12);
}

/// Streams `req`'s tokens from the decode node, prefilled on `prefill`.
async fn generate(
    c: &mut pb::decode_client::DecodeClient<tonic::transport::Channel>,
    req: &GenerateRequest,
    prefill: PrefillNode,
) -> Vec<u32> {
    let call = grpc::generate_request_to_pb(req, &prefill.into());
    let mut stream = c.generate(call).await.unwrap().into_inner();
    let mut got = Vec::new();
    while let Some(e) = stream.message().await.unwrap() {
        match GenerateEvent::try_from(e).unwrap() {
            GenerateEvent::Token(t) => got.push(t.token),
            GenerateEvent::Finished { .. } => break,
            GenerateEvent::Error(e) => panic!("{e}"),
        }
    }
    got
}

async fn remote_prefills_match_local_runs(m: &Mesh) {
    let mut c = client(m.decode_addr).await;
    for (id, len) in [(1, 200), (2, 20), (3, 300)] {
        let req = request(id, prompt(id as usize, len), 12);
        let want = tokio::task::spawn_blocking({
            let req = req.clone();
            move || reference(&req)
        })
        .await
        .unwrap();
        let got = generate(&mut c, &req, m.prefill.clone()).await;
        assert_eq!(got, want, "prompt of {len} tokens");
    }
    let prefill_served = transfers_completed(NodeId(0x200));
    assert!(prefill_served >= 2, "{prefill_served} remote prefills");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_ends_the_call_and_frees_its_blocks() {
    let m = mesh().await;
    let mut c = client(m.decode_addr).await;
    let req = request(7, prompt(7, 100), 100_000);
    let mut call = tonic::Request::new(grpc::generate_request_to_pb(
        &req,
        &m.prefill.clone().into(),
    ));
    call.set_timeout(Duration::from_millis(1500));
    let mut stream = c.generate(call).await.unwrap().into_inner();
    let status = loop {
        match stream.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the stream ended without its deadline"),
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
    let d = m.decode.clone();
    tokio::task::spawn_blocking(move || wait_until_idle(|| d.load(), Duration::from_secs(10)))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_call_cancels_the_request() {
    let m = mesh().await;
    let mut c = client(m.decode_addr).await;
    let req = request(8, prompt(8, 100), 100_000);
    let call = grpc::generate_request_to_pb(&req, &m.prefill.clone().into());
    let mut stream = c.generate(call).await.unwrap().into_inner();
    for _ in 0..3 {
        let e = stream.message().await.unwrap().expect("a token");
        assert!(matches!(
            GenerateEvent::try_from(e).unwrap(),
            GenerateEvent::Token(_)
        ));
    }
    drop(stream);
    let d = m.decode.clone();
    tokio::task::spawn_blocking(move || wait_until_idle(|| d.load(), Duration::from_secs(10)))
        .await
        .unwrap();
}
