//! The QUIC transport between two endpoints on loopback: routing, refusal of unbound nodes,
//! backpressure, mutual TLS, and the end of transfers.

use kvmesh_common::tls::CLUSTER_SERVER_NAME;
use kvmesh_common::{BlockId, NodeId, RequestId};
use kvmesh_transfer::{
    BlockShape, KvChunk, KvDtype, QuicConfig, QuicTransport, TlsConfig, Transport, TransportError,
};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

fn shape() -> BlockShape {
    BlockShape {
        num_kv_heads: 2,
        block_size: 16,
        head_dim: 64,
    }
}

/// A one-layer chunk of `request` over `blocks` blocks; payload bytes derived from the ids.
fn chunk(request: u64, layer: usize, blocks: u32) -> KvChunk {
    let ids = (0..blocks).map(BlockId).collect();
    let len = blocks as usize * shape().block_bytes_per_layer(KvDtype::F16);
    let payload = (0..len)
        .map(|i| (i as u64 ^ request ^ layer as u64) as u8)
        .collect();
    KvChunk::seal(RequestId(request), layer..layer + 1, ids, shape(), payload).unwrap()
}

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn start(config: QuicConfig) -> QuicTransport {
    QuicTransport::start(QuicConfig {
        listen: loopback(),
        ..config
    })
    .unwrap()
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

#[test]
fn chunks_of_several_requests_arrive_intact_at_their_nodes() {
    let sender = Arc::new(start(QuicConfig::default()));
    let receiver = start(QuicConfig::default());
    let (a, b) = (NodeId(10), NodeId(11));
    let rx_a = receiver.bind(a).unwrap();
    let rx_b = receiver.bind(b).unwrap();
    sender.add_peer(a, receiver.local_addr());
    sender.add_peer(b, receiver.local_addr());

    // Four requests from four threads, each of five layers, to one node or the other.
    let threads: Vec<_> = (1..=4u64)
        .map(|request| {
            let sender = sender.clone();
            thread::spawn(move || {
                let dest = if request % 2 == 0 { a } else { b };
                for layer in 0..5 {
                    let c = chunk(request, layer, 3 + request as u32);
                    sender.send(dest, c, soon()).unwrap();
                }
                sender.end_transfer(dest, RequestId(request));
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    for (rx, requests) in [(&rx_a, [2u64, 4]), (&rx_b, [1, 3])] {
        let mut got = HashSet::new();
        for _ in 0..10 {
            let c = rx.recv_timeout(Duration::from_secs(10)).unwrap();
            c.verify().unwrap();
            let request = c.header.request_id.0;
            assert!(requests.contains(&request), "request {request} misrouted");
            assert_eq!(
                c,
                chunk(
                    request,
                    c.header.first_layer as usize,
                    c.header.blocks.len() as u32
                )
            );
            got.insert((request, c.header.first_layer));
        }
        assert_eq!(got.len(), 10);
    }
    assert_eq!(sender.open_transfers(), 0);
}

#[test]
fn a_node_bound_nowhere_is_unreachable() {
    let sender = start(QuicConfig::default());
    let receiver = start(QuicConfig::default());
    // No address known: refused before anything is sent.
    assert_eq!(
        sender.send(NodeId(5), chunk(1, 0, 1), soon()),
        Err(TransportError::Unreachable(NodeId(5)))
    );
    // An address, but nobody bound there: the receiver stops the stream, so the transfer's
    // next sends fail (the first may already be on its way when the refusal arrives).
    sender.add_peer(NodeId(5), receiver.local_addr());
    let deadline = soon();
    let mut result = Ok(());
    for layer in 0..10_000 {
        result = sender.send(NodeId(5), chunk(1, layer % 30, 1), deadline);
        if result.is_err() || Instant::now() > deadline {
            break;
        }
    }
    assert_eq!(result, Err(TransportError::Unreachable(NodeId(5))));
    // After an unbind too.
    let rx = receiver.bind(NodeId(6)).unwrap();
    sender.add_peer(NodeId(6), receiver.local_addr());
    sender.send(NodeId(6), chunk(2, 0, 1), soon()).unwrap();
    rx.recv_timeout(Duration::from_secs(10)).unwrap();
    receiver.unbind(NodeId(6));
    let mut result = Ok(());
    for layer in 1..10_000 {
        result = sender.send(NodeId(6), chunk(2, layer % 30, 1), deadline);
        if result.is_err() || Instant::now() > deadline {
            break;
        }
    }
    assert_eq!(result, Err(TransportError::Unreachable(NodeId(6))));
}

/// Small windows so the bound is tight.
fn tight() -> QuicConfig {
    QuicConfig {
        queue_chunks: 2,
        stream_receive_window: 1 << 20,
        receive_window: 2 << 20,
        send_window: 2 << 20,
        ..QuicConfig::default()
    }
}

#[test]
fn a_receiver_that_does_not_drain_holds_the_sender_back_within_bounded_memory() {
    let sender = start(tight());
    let receiver = start(tight());
    let _rx = receiver.bind(NodeId(1)).unwrap();
    sender.add_peer(NodeId(1), receiver.local_addr());
    let blocks = 16; // 16 blocks x 8 KiB = 128 KiB per chunk
    let chunk_bytes = chunk(1, 0, blocks).payload.len();
    let mut accepted = 0;
    let error = loop {
        let deadline = Instant::now() + Duration::from_millis(300);
        match sender.send(NodeId(1), chunk(1, accepted % 30, blocks), deadline) {
            Ok(()) => accepted += 1,
            Err(e) => break e,
        }
        assert!(accepted < 1000, "the sender was never held back");
    };
    assert_eq!(error, TransportError::Timeout(NodeId(1)));
    // Queue (2) + one chunk in hand at the reader + one being assembled + what the receive
    // and send windows hold: nothing else buffers without bound.
    let windows = (2 << 20) + (2 << 20);
    let bound = 2 + 2 + windows / chunk_bytes + 1;
    assert!(
        accepted <= bound,
        "{accepted} chunks accepted, bound {bound}"
    );
    assert!(accepted >= 2);
}

#[test]
fn a_blocked_sender_resumes_when_the_receiver_drains() {
    let sender = Arc::new(start(tight()));
    let receiver = start(tight());
    let rx = receiver.bind(NodeId(1)).unwrap();
    sender.add_peer(NodeId(1), receiver.local_addr());
    let n = 40; // 40 x 256 KiB: several times what the windows and the queue hold
    let producer = {
        let sender = sender.clone();
        thread::spawn(move || {
            for layer in 0..n {
                sender.send(NodeId(1), chunk(7, layer, 32), soon()).unwrap();
            }
            sender.end_transfer(NodeId(1), RequestId(7));
        })
    };
    for layer in 0..n {
        let c = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(c, chunk(7, layer, 32));
    }
    producer.join().unwrap();
}

#[test]
fn ending_a_transfer_closes_its_stream_and_idle_ones_are_closed_anyway() {
    let sender = start(QuicConfig {
        stream_idle_timeout: Duration::from_millis(200),
        ..QuicConfig::default()
    });
    let receiver = start(QuicConfig::default());
    let rx = receiver.bind(NodeId(1)).unwrap();
    sender.add_peer(NodeId(1), receiver.local_addr());
    sender.send(NodeId(1), chunk(1, 0, 1), soon()).unwrap();
    sender.send(NodeId(1), chunk(2, 0, 1), soon()).unwrap();
    assert_eq!(sender.open_transfers(), 2);
    sender.end_transfer(NodeId(1), RequestId(1));
    assert_eq!(sender.open_transfers(), 1);
    // A later chunk of an ended request opens a fresh stream, which the receiver accepts.
    sender.send(NodeId(1), chunk(1, 1, 1), soon()).unwrap();
    for _ in 0..3 {
        rx.recv_timeout(Duration::from_secs(10))
            .unwrap()
            .verify()
            .unwrap();
    }
    // Nobody ends these two: the idle timer does (a timer, so poll for its effect).
    let deadline = soon();
    while sender.open_transfers() > 0 {
        assert!(Instant::now() < deadline, "idle streams were never closed");
        thread::sleep(Duration::from_millis(20));
    }
}

/// A CA and certificates for the cluster name it signed, as PEM files under `dir`.
fn issue(dir: &Path, ca_name: &str, leaves: &[&str]) {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
    std::fs::write(dir.join(format!("{ca_name}.pem")), ca.pem()).unwrap();
    for leaf in leaves {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec![CLUSTER_SERVER_NAME.to_string()])
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        std::fs::write(dir.join(format!("{leaf}.crt")), cert.pem()).unwrap();
        std::fs::write(dir.join(format!("{leaf}.key")), key.serialize_pem()).unwrap();
    }
}

fn files(dir: &Path, ca: &str, leaf: &str) -> QuicConfig {
    QuicConfig {
        tls: TlsConfig::Files {
            ca: dir.join(format!("{ca}.pem")),
            cert: dir.join(format!("{leaf}.crt")),
            key: dir.join(format!("{leaf}.key")),
        },
        ..QuicConfig::default()
    }
}

#[test]
fn mutual_tls_admits_peers_of_the_ca_only() {
    let dir = tempfile::tempdir().unwrap();
    issue(dir.path(), "ca", &["prefill", "decode"]);
    issue(dir.path(), "other-ca", &["intruder"]);
    let prefill = start(files(dir.path(), "ca", "prefill"));
    let decode = start(QuicConfig {
        stream_receive_window: 1 << 20,
        receive_window: 2 << 20,
        ..files(dir.path(), "ca", "decode")
    });
    let rx = decode.bind(NodeId(2)).unwrap();
    prefill.add_peer(NodeId(2), decode.local_addr());
    prefill.send(NodeId(2), chunk(1, 0, 2), soon()).unwrap();
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(10)).unwrap(),
        chunk(1, 0, 2)
    );

    // Trusting the other CA, the intruder rejects the decode node's certificate.
    let intruder = start(files(dir.path(), "other-ca", "intruder"));
    intruder.add_peer(NodeId(2), decode.local_addr());
    assert!(matches!(
        intruder.send(NodeId(2), chunk(1, 0, 2), soon()),
        Err(TransportError::Connection {
            node: NodeId(2),
            ..
        })
    ));
    // Trusting the right CA but holding the other's certificate, it is rejected by the server.
    // In TLS 1.3 a client learns that one round trip after its handshake completed, so a
    // small first write could still look accepted; a chunk larger than the windows the
    // server grants cannot, and fails with the connection.
    let big = chunk(1, 0, 512); // 4 MiB
    let impostor = start(QuicConfig {
        tls: TlsConfig::Files {
            ca: dir.path().join("ca.pem"),
            cert: dir.path().join("intruder.crt"),
            key: dir.path().join("intruder.key"),
        },
        ..QuicConfig::default()
    });
    impostor.add_peer(NodeId(2), decode.local_addr());
    assert!(matches!(
        impostor.send(NodeId(2), big.clone(), soon()),
        Err(TransportError::Connection {
            node: NodeId(2),
            ..
        })
    ));
    // And a self-signed client, which presents no certificate at all.
    let anonymous = start(QuicConfig::default());
    anonymous.add_peer(NodeId(2), decode.local_addr());
    assert!(matches!(
        anonymous.send(NodeId(2), big, soon()),
        Err(TransportError::Connection {
            node: NodeId(2),
            ..
        })
    ));
    assert!(rx.try_recv().is_err(), "nothing from the impostors arrived");
}

#[test]
fn unreadable_tls_files_fail_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let err = QuicTransport::start(files(dir.path(), "ca", "missing"))
        .err()
        .unwrap();
    assert!(err.to_string().contains("ca.pem"), "{err}");
}

/// Accepts any server certificate: the self-signed mode's client, as an outsider builds it.
#[derive(Debug)]
struct AnyCert(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AnyCert {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        let algs = &self.0.signature_verification_algorithms;
        rustls::crypto::verify_tls12_signature(message, cert, dss, algs)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        let algs = &self.0.signature_verification_algorithms;
        rustls::crypto::verify_tls13_signature(message, cert, dss, algs)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// A raw QUIC connection to a transport that speaks the transfer ALPN and then writes
/// whatever it likes on its streams.
async fn raw_peer(to: SocketAddr) -> (quinn::Endpoint, quinn::Connection) {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCert(provider)))
        .with_no_client_auth();
    tls.alpn_protocols = vec![kvmesh_transfer::quic::ALPN.to_vec()];
    let quic_tls = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
    let mut endpoint = quinn::Endpoint::client(loopback()).unwrap();
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(quic_tls)));
    let conn = endpoint
        .connect(to, CLUSTER_SERVER_NAME)
        .unwrap()
        .await
        .unwrap();
    (endpoint, conn)
}

/// Writes `bytes` on a new stream, left open, and returns the code the receiver stopped it
/// with. (Finishing it would race: a receiver that has read a finished stream to its end
/// has nothing left to stop.)
async fn stop_code(conn: &quinn::Connection, bytes: &[u8]) -> Option<quinn::VarInt> {
    let mut stream = conn.open_uni().await.unwrap();
    if let Err(quinn::WriteError::Stopped(code)) = stream.write_all(bytes).await {
        return Some(code);
    }
    tokio::time::timeout(Duration::from_secs(10), stream.stopped())
        .await
        .expect("the receiver did not stop a stream it cannot use")
        .ok()
        .flatten()
}

#[test]
fn garbage_from_an_unauthenticated_peer_is_refused_and_the_node_keeps_receiving() {
    use kvmesh_transfer::codec::FrameEncoder;
    use kvmesh_transfer::quic::error_code::{MALFORMED, UNKNOWN_NODE};
    // Self-signed mode: anyone may connect, so only the codec stands between a peer and the
    // node's KV queue.
    let receiver = start(QuicConfig::default());
    let rx = receiver.bind(NodeId(1)).unwrap();
    let encoded = |dest: u64, c: &KvChunk| {
        let mut out = Vec::new();
        FrameEncoder::new(NodeId(dest), c.header.request_id)
            .encode(c, &mut out)
            .unwrap();
        out
    };
    let good = chunk(1, 0, 2);
    let mut corrupt = encoded(1, &good);
    *corrupt.last_mut().unwrap() ^= 0x40;
    let noise: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();

    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let (_endpoint, conn) = raw_peer(receiver.local_addr()).await;
        assert_eq!(stop_code(&conn, &noise).await, Some(MALFORMED), "noise");
        assert_eq!(
            stop_code(&conn, &corrupt).await,
            Some(MALFORMED),
            "bad checksum"
        );
        let unbound = encoded(9, &good);
        assert_eq!(
            stop_code(&conn, &unbound).await,
            Some(UNKNOWN_NODE),
            "unbound node"
        );
        // Many streams of noise at once, each refused on its own.
        let floods = (0..64).map(|i| {
            let conn = conn.clone();
            let bytes = noise[i..].to_vec();
            async move { stop_code(&conn, &bytes).await }
        });
        for code in join_all(floods).await {
            assert_eq!(code, Some(MALFORMED));
        }
    });
    assert!(rx.try_recv().is_err(), "garbage reached the node's queue");

    // The node still receives from a real sender.
    let sender = start(QuicConfig::default());
    sender.add_peer(NodeId(1), receiver.local_addr());
    sender.send(NodeId(1), good.clone(), soon()).unwrap();
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), good);
}

/// Runs the futures concurrently on the current runtime (tokio tasks, no extra crate).
async fn join_all<F>(futures: impl Iterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let tasks: Vec<_> = futures.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}
