//! The RDMA transport where it cannot run (no device here, or not compiled in) and the
//! fallback to QUIC, and what a node's transport does with RDMA peers (on a stand-in
//! device). The verbs data path needs an RDMA NIC (or rdma_rxe) to test.

use kvmesh_common::{BlockId, NodeId, RequestId};
use kvmesh_transfer::{
    BlockShape, KvChunk, KvDtype, LoopbackFabric, LoopbackRdma, NetworkTransport, QuicConfig,
    QuicTransport, RdmaConfig, RdmaEndpoint, RdmaError, RdmaPeerInfo, RdmaRegion, RdmaTransport,
    Transport,
};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[cfg(feature = "rdma")]
#[test]
fn without_a_device_open_says_so_and_points_to_quic() {
    match RdmaTransport::open(RdmaConfig::default()) {
        Err(e @ RdmaError::NoDevice(_)) => {
            let msg = e.to_string();
            assert!(msg.starts_with("no RDMA device found ("), "{msg}");
            assert!(msg.ends_with("falling back to QUIC"), "{msg}");
        }
        Err(e) => panic!("expected NoDevice, got {e}"),
        Ok(t) => eprintln!(
            "RDMA device {} present; nothing to check here",
            t.device_name()
        ),
    }
}

#[cfg(not(feature = "rdma"))]
#[test]
fn without_the_feature_open_says_so() {
    let e = RdmaTransport::open(RdmaConfig::default()).err().unwrap();
    assert!(matches!(e, RdmaError::NotCompiled));
    assert!(e.to_string().contains("falling back to QUIC"));
}

fn chunk(request: u64) -> KvChunk {
    let shape = BlockShape {
        num_kv_heads: 1,
        block_size: 16,
        head_dim: 32,
    };
    let payload = vec![request as u8; shape.block_bytes_per_layer(KvDtype::F16)];
    KvChunk::seal(RequestId(request), 0..1, vec![BlockId(0)], shape, payload).unwrap()
}

fn quic() -> QuicTransport {
    QuicTransport::start(QuicConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        ..QuicConfig::default()
    })
    .unwrap()
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

#[test]
fn without_rdma_a_node_runs_quic_only() {
    let (receiver, sender) = (
        NetworkTransport::open(quic(), RdmaConfig::default()),
        NetworkTransport::open(quic(), RdmaConfig::default()),
    );
    if receiver.offers_rdma() {
        eprintln!("an RDMA device is present; nothing to check here");
        return;
    }
    assert!(matches!(
        sender.rdma_prepare(NodeId(1)),
        Err(RdmaError::NotCompiled)
    ));
    let rx = receiver.bind(NodeId(1)).unwrap();
    sender.add_peer(NodeId(1), receiver.quic().local_addr());
    sender.send(NodeId(1), chunk(3), soon()).unwrap();
    let got = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(got.header.request_id, RequestId(3));
    assert!(!sender.uses_rdma(NodeId(1)));
}

#[test]
fn after_the_rdma_exchange_chunks_go_over_rdma_and_arrive_on_the_same_queue() {
    let (decode, prefill) = (NodeId(1), NodeId(2));
    let fabric = LoopbackFabric::default();
    let (decode_rdma, prefill_rdma) = (
        Arc::new(fabric.device(decode)),
        Arc::new(fabric.device(prefill)),
    );
    let receiver = NetworkTransport::with_rdma(quic(), Some(decode_rdma.clone()));
    let sender = NetworkTransport::with_rdma(quic(), Some(prefill_rdma.clone()));
    assert!(receiver.offers_rdma() && sender.offers_rdma());
    let rx = receiver.bind(decode).unwrap();
    sender.add_peer(decode, receiver.quic().local_addr());

    // Before the exchange: QUIC.
    sender.send(decode, chunk(1), soon()).unwrap();
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(10))
            .unwrap()
            .header
            .request_id,
        RequestId(1)
    );
    assert_eq!(prefill_rdma.chunks_sent(), 0);

    // A swapped-wrong exchange is refused and changes nothing.
    let mine = receiver.rdma_prepare(prefill).unwrap();
    assert!(sender
        .rdma_connect(decode, LoopbackRdma::info(NodeId(9), prefill))
        .is_err());
    assert!(!sender.uses_rdma(decode));

    // The exchange as the control plane runs it: decode prepares, prefill prepares and
    // connects to decode's, decode connects to prefill's.
    let theirs = sender.rdma_prepare(decode).unwrap();
    sender.rdma_connect(decode, mine).unwrap();
    receiver.rdma_connect(prefill, theirs).unwrap();
    assert!(sender.uses_rdma(decode) && receiver.uses_rdma(prefill));

    for r in 2..5 {
        sender.send(decode, chunk(r), soon()).unwrap();
    }
    sender.end_transfer(decode, RequestId(4));
    for r in 2..5 {
        let got = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(got.header.request_id, RequestId(r));
        got.verify().unwrap();
    }
    assert_eq!(prefill_rdma.chunks_sent(), 3);

    // Unbound: nothing reaches the node on either path.
    receiver.unbind(decode);
    assert!(sender.send(decode, chunk(5), soon()).is_err());
}

#[test]
fn peer_info_travels_as_json() {
    let info = RdmaPeerInfo {
        endpoint: RdmaEndpoint {
            qp_num: 0x1234,
            lid: 7,
            gid: [0xfe; 16],
            psn: 99,
        },
        region: RdmaRegion {
            addr: 0x7f00_0000_1000,
            rkey: 0xabcd,
            len: 128 << 20,
        },
    };
    let json = serde_json::to_string(&info).unwrap();
    assert_eq!(serde_json::from_str::<RdmaPeerInfo>(&json).unwrap(), info);
}

/// A decode node and a prefill node on one loopback fabric, RDMA exchanged the way the
/// control plane does it (decode prepares, prefill prepares and connects, decode connects).
struct Pair {
    fabric: LoopbackFabric,
    decode: NodeId,
    prefill: NodeId,
    receiver: NetworkTransport,
    sender: NetworkTransport,
    prefill_rdma: Arc<LoopbackRdma>,
    rx: kvmesh_transfer::KvReceiver,
}

impl Pair {
    fn new() -> Pair {
        let (decode, prefill) = (NodeId(1), NodeId(2));
        let fabric = LoopbackFabric::default();
        let prefill_rdma = Arc::new(fabric.device(prefill));
        let receiver = NetworkTransport::with_rdma(quic(), Some(Arc::new(fabric.device(decode))));
        let sender = NetworkTransport::with_rdma(quic(), Some(prefill_rdma.clone()));
        let rx = receiver.bind(decode).unwrap();
        sender.add_peer(decode, receiver.quic().local_addr());
        let pair = Pair {
            fabric,
            decode,
            prefill,
            receiver,
            sender,
            prefill_rdma,
            rx,
        };
        pair.exchange();
        pair
    }

    fn exchange(&self) {
        assert!(
            self.receiver.rdma_exchange_due(self.prefill) || self.receiver.uses_rdma(self.prefill)
        );
        let mine = self.receiver.rdma_prepare(self.prefill).unwrap();
        let theirs = self.sender.rdma_prepare(self.decode).unwrap();
        self.sender.rdma_connect(self.decode, mine).unwrap();
        self.receiver.rdma_connect(self.prefill, theirs).unwrap();
        assert!(self.sender.uses_rdma(self.decode));
    }

    fn next(&self) -> RequestId {
        let got = self.rx.recv_timeout(Duration::from_secs(10)).unwrap();
        got.verify().unwrap();
        got.header.request_id
    }
}

#[test]
fn a_chunk_in_flight_on_a_failed_link_is_sent_again_over_quic_at_the_end_of_its_transfer() {
    let p = Pair::new();
    for r in 1..4 {
        p.sender.send(p.decode, chunk(r), soon()).unwrap();
    }
    assert_eq!(
        (1..4).map(|_| p.next().0).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    assert_eq!(p.prefill_rdma.chunks_sent(), 3);

    // The link fails under the request's last chunk: the write is taken, then fails.
    p.fabric.fail_link(p.prefill, p.decode);
    p.sender.send(p.decode, chunk(4), soon()).unwrap();
    assert!(!p.sender.uses_rdma(p.decode), "a failed link is not used");
    assert!(
        p.rx.try_recv().is_err(),
        "the failed write delivered nothing"
    );
    // Ending the transfer settles it: the chunk goes again, over QUIC.
    p.sender.end_transfer(p.decode, RequestId(4));
    assert_eq!(p.next(), RequestId(4));

    // From now on QUIC, until the nodes exchange again (not at once: it backs off).
    p.sender.send(p.decode, chunk(5), soon()).unwrap();
    assert_eq!(p.next(), RequestId(5));
    assert_eq!(p.prefill_rdma.chunks_sent(), 3);
    assert!(!p.sender.rdma_exchange_due(p.decode));

    // The exchange the decode node starts puts the link back; chunks go over RDMA again.
    p.exchange();
    p.sender.send(p.decode, chunk(6), soon()).unwrap();
    assert_eq!(p.next(), RequestId(6));
    assert_eq!(p.prefill_rdma.chunks_sent(), 4);
}

#[test]
fn chunks_after_a_failure_go_over_quic_behind_the_one_the_link_lost() {
    let p = Pair::new();
    // One request's layers (QUIC keeps the order within a request: one stream each).
    let layer = |l: u32| {
        let mut c = chunk(7);
        c.header.first_layer = l;
        c
    };
    p.fabric.fail_link(p.prefill, p.decode);
    p.sender.send(p.decode, layer(0), soon()).unwrap();
    // The next send first sends the undelivered chunk, then its own, both over QUIC.
    p.sender.send(p.decode, layer(1), soon()).unwrap();
    p.sender.send(p.decode, layer(2), soon()).unwrap();
    let layers: Vec<u32> = (0..3)
        .map(|_| {
            let got = p.rx.recv_timeout(Duration::from_secs(10)).unwrap();
            got.verify().unwrap();
            got.header.first_layer
        })
        .collect();
    assert_eq!(layers, vec![0, 1, 2]);
    assert_eq!(p.prefill_rdma.chunks_sent(), 0);
}

#[test]
fn a_receiver_whose_link_failed_is_due_to_exchange_again() {
    let p = Pair::new();
    assert!(
        !p.receiver.rdma_exchange_due(p.prefill),
        "not while the link is up"
    );
    // The decode side's own link fails (its keepalive or a credit found the peer gone).
    p.fabric.fail_link(p.decode, p.prefill);
    let _ = p.receiver.send(p.prefill, chunk(9), soon());
    assert!(!p.receiver.uses_rdma(p.prefill));
    // Backing off: not due at once.
    assert!(!p.receiver.rdma_exchange_due(p.prefill));
}
