//! Chaos, the compound and hostile faults: the multi-process mesh (etcd, a router, two
//! prefill and three decode processes, mutual TLS) under a steady stream of streamed
//! requests, while, in turn:
//!
//! - a prefill node is stopped (`SIGSTOP`) while it computes and sends a prompt's KV, then
//!   continued: the decode node waiting for that KV prefills itself;
//! - two faults at once: etcd goes down and, during the outage, a decode node serving a
//!   stream is killed (`kill -9`): the router moves its streams on its last view of the mesh;
//! - poison from a cluster member: a `Generate` with token ids outside the vocabulary sent
//!   straight to a decode node, and malformed KV frames on its KV port (a valid client
//!   certificate, a valid preamble, then a corrupted frame; then noise): each is refused
//!   alone while the node keeps streaming;
//! - the router is killed (`kill -9`) and restarted: the streams it owned end with a clean
//!   error at once (no hang), requests sent while it is down are refused by the OS, and new
//!   requests succeed once it is back; the decode nodes drop the orphaned requests.
//!
//! Every request other than those the router's death cut must complete with exactly its
//! fault-free greedy text, and every surviving node's KV pool must be empty at the end.
//! Prints per fault: the requests in flight, lost, the longest stall, the recovery time.

mod cluster;

use cluster::*;
use kvmesh_common::tls::{ClusterTls, CLUSTER_SERVER_NAME};
use kvmesh_common::{BlockId, NodeId, NodeRole, RequestId};
use kvmesh_kvstore::Discovery;
use kvmesh_transfer::quic::error_code::MALFORMED;
use kvmesh_transfer::{BlockShape, KvChunk, KvDtype};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const AFTER_FAULTS: usize = 8;
const MAX_REQUESTS: usize = 400;
const CLIENTS: usize = 4;
const MAX_TOKENS: u32 = 24;

fn prompt(i: usize) -> String {
    let topic = ["lakes", "the sun", "cheese", "go", "glaciers", "hawks"][i % 6];
    let sentence = format!("Remark {i} is about {topic}, spelled out in some detail. ");
    // Distinct from the first words on, so no node ever holds a prefix of another prompt;
    // 300-400 tokens, so a prefill node is busy with each for a while.
    format!(
        "{}Now tell a long tale about {topic}.",
        sentence.repeat(24 + i % 8)
    )
}

fn body(i: usize, stream: bool) -> Value {
    json!({"model": MODEL_NAME, "prompt": prompt(i), "max_tokens": MAX_TOKENS,
           "temperature": 0, "stream": stream})
}

/// One request as a client saw it.
struct Sent {
    i: usize,
    start: Instant,
    end: Instant,
    outcome: Outcome,
}

/// The figures of one fault.
struct Figures {
    name: &'static str,
    /// Requests in flight when it struck.
    in_flight: usize,
    lost: usize,
    /// The longest wait, across the fault, of a stream in flight at it for its next event.
    stall: Duration,
    /// From the fault until a request sent after it got its first token.
    recovery: Duration,
}

fn figures(name: &'static str, at: Instant, sent: &[Sent], lost: &[usize]) -> Figures {
    let in_flight: Vec<&Sent> = sent
        .iter()
        .filter(|s| s.start <= at && s.end > at)
        .collect();
    // The gap (from its start, if nothing came yet) that the fault fell into.
    let stall = in_flight
        .iter()
        .map(|s| {
            let before = s.outcome.events.iter().rev().find(|&&t| t <= at);
            let after = s.outcome.events.iter().find(|&&t| t > at);
            *after.unwrap_or(&s.end) - *before.unwrap_or(&s.start)
        })
        .max()
        .unwrap_or_default();
    let recovery = sent
        .iter()
        .filter(|s| s.start > at && s.outcome.error.is_none())
        .filter_map(|s| s.outcome.events.first())
        .min()
        .map(|&t| t - at)
        .unwrap_or(Duration::MAX);
    Figures {
        name,
        in_flight: in_flight.len(),
        lost: in_flight.iter().filter(|s| lost.contains(&s.i)).count(),
        stall,
        recovery,
    }
}

/// A node that runs a request or holds KV (a prefill node's work is brief: its KV shows it).
fn working(l: &kvmesh_common::grpc::pb::LoadReport) -> bool {
    l.running > 0 || l.kv_blocks_used > 0
}

/// A QUIC connection to a node's KV port as a cluster member (the cluster's certificate).
async fn kv_peer(to: SocketAddr, tls: &ClusterTls) -> (quinn::Endpoint, quinn::Connection) {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(tls.roots().unwrap())
        .with_client_auth_cert(tls.chain(), tls.key())
        .unwrap();
    config.alpn_protocols = vec![kvmesh_transfer::quic::ALPN.to_vec()];
    let quic = quinn::crypto::rustls::QuicClientConfig::try_from(config).unwrap();
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(quic)));
    let conn = endpoint
        .connect(to, CLUSTER_SERVER_NAME)
        .unwrap()
        .await
        .expect("a cluster member reaches the KV port");
    (endpoint, conn)
}

/// Writes `bytes` on a new stream (left open) and returns the code the node stopped it with.
async fn stop_code(conn: &quinn::Connection, bytes: &[u8]) -> Option<quinn::VarInt> {
    let mut stream = conn.open_uni().await.unwrap();
    if let Err(quinn::WriteError::Stopped(code)) = stream.write_all(bytes).await {
        return Some(code);
    }
    tokio::time::timeout(Duration::from_secs(10), stream.stopped())
        .await
        .expect("the node did not stop a stream it cannot use")
        .ok()
        .flatten()
}

/// Malformed KV for node `dest`: a valid preamble and a frame with a corrupted payload, then
/// noise. Returns the codes the node stopped each stream with.
async fn poison_kv(to: SocketAddr, dest: NodeId, tls: &ClusterTls) -> Vec<Option<quinn::VarInt>> {
    use kvmesh_transfer::codec::FrameEncoder;
    let shape = BlockShape {
        num_kv_heads: 3,
        block_size: 16,
        head_dim: 64,
    };
    let payload = vec![7; shape.block_bytes_per_layer(KvDtype::F16)];
    let chunk = KvChunk::seal(
        RequestId(0xbad_c0de),
        0..1,
        vec![BlockId(1)],
        shape,
        payload,
    )
    .expect("a well-formed chunk");
    let mut corrupt = Vec::new();
    FrameEncoder::new(dest, chunk.header.request_id)
        .encode(&chunk, &mut corrupt)
        .unwrap();
    *corrupt.last_mut().unwrap() ^= 0x40;
    let noise: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let (_endpoint, conn) = kv_peer(to, tls).await;
    vec![
        stop_code(&conn, &corrupt).await,
        stop_code(&conn, &noise).await,
    ]
}

#[test]
fn compound_and_hostile_faults_cost_only_what_they_must() {
    let ChaosMesh {
        mut etcd,
        tls,
        router_addr,
        prefill_addrs,
        decode_addrs,
        prefill,
        mut decode,
        mut router,
        rt,
        discovery,
    } = ChaosMesh::start("compound");
    let victim_kv = discovery
        .nodes(NodeRole::Decode)
        .into_iter()
        .map(|n| n.info)
        .find(|n| n.address == decode_addrs[2].to_string())
        .expect("decode node 2 registered");

    let progress = Progress::default();
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let sent: Mutex<Vec<Sent>> = Mutex::new(Vec::new());
    let mut faults: Vec<(&'static str, Instant)> = Vec::new();
    let mut router_down = (Instant::now(), Instant::now());
    let mut poison_codes = Vec::new();
    let mut poison_refusal = None;
    std::thread::scope(|s| {
        for _ in 0..CLIENTS {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= MAX_REQUESTS || stop.load(Ordering::Relaxed) {
                    return;
                }
                let start = Instant::now();
                let outcome = stream_completion(router_addr, &body(i, true));
                if outcome.status == 0 && outcome.events.is_empty() {
                    // The router is down: not a request it took. Try again shortly.
                    std::thread::sleep(Duration::from_millis(50));
                }
                let end = Instant::now();
                sent.lock().unwrap().push(Sent {
                    i,
                    start,
                    end,
                    outcome,
                });
                progress.complete_one();
            });
        }
        // Should anything below fail, the clients stop too.
        let _stop = StopOnDrop(&stop);
        progress.wait_for(5, Duration::from_secs(300));

        // A prefill node stopped while it computes and sends a prompt's KV.
        let busy = await_load(&rt, &prefill_addrs, NodeRole::Prefill, Some(&tls), working);
        signal(&prefill[busy], "-STOP");
        faults.push(("SIGSTOP prefill node mid-transfer", Instant::now()));
        progress.wait_for(progress.count() + 6, Duration::from_secs(300));
        signal(&prefill[busy], "-CONT");
        rt.block_on(await_membership(&discovery, 2, 3, Duration::from_secs(30)));

        // Two at once: etcd down, and during the outage a decode node dies mid-stream.
        progress.wait_for(progress.count() + 4, Duration::from_secs(300));
        etcd.stop().expect("etcd stops");
        faults.push(("etcd stopped", Instant::now()));
        await_load(
            &rt,
            &decode_addrs[0..=0],
            NodeRole::Decode,
            Some(&tls),
            working,
        );
        decode[0].child.kill().unwrap();
        faults.push(("kill -9 decode node during the etcd outage", Instant::now()));
        decode[0].child.wait().unwrap();
        progress.wait_for(progress.count() + 6, Duration::from_secs(300));
        etcd.restart().expect("etcd restarts");
        rt.block_on(await_membership(&discovery, 2, 2, Duration::from_secs(30)));

        // Poison from a member, at a decode node that is streaming.
        progress.wait_for(progress.count() + 4, Duration::from_secs(300));
        await_load(
            &rt,
            &decode_addrs[2..=2],
            NodeRole::Decode,
            Some(&tls),
            working,
        );
        faults.push(("poison: bad token ids, malformed KV", Instant::now()));
        poison_refusal = Some(rt.block_on(poison(decode_addrs[2], Some(&tls))));
        let kv: SocketAddr = victim_kv.transfer_address.parse().expect("a KV address");
        poison_codes = rt.block_on(poison_kv(kv, victim_kv.node_id, &tls));

        // The router killed and restarted.
        progress.wait_for(progress.count() + 6, Duration::from_secs(300));
        await_load(
            &rt,
            &decode_addrs[1..=1],
            NodeRole::Decode,
            Some(&tls),
            working,
        );
        // Taken first: the streams it owned break as soon as it dies.
        let killed = Instant::now();
        router.child.kill().unwrap();
        router.child.wait().unwrap();
        faults.push(("kill -9 router", killed));
        router.restart();
        await_health(router_addr, &[&router]);
        router_down = (killed, Instant::now());
        faults.push(("router back", router_down.1));

        progress.wait_for(progress.count() + AFTER_FAULTS, Duration::from_secs(300));
        stop.store(true, Ordering::Relaxed);
    });

    let mut sent = sent.into_inner().unwrap();
    sent.sort_by_key(|s| s.i);
    assert!(
        sent.len() < MAX_REQUESTS,
        "the faults took {MAX_REQUESTS} requests"
    );
    // Requests the router's death cut or that found it down: a clean error, promptly.
    let (killed, back) = router_down;
    let cut = |s: &Sent| s.start < back && s.end > killed;
    // Each request's prompt is new to the mesh when sent (no node holds its prefix: a
    // prefill node computes it); its fault-free text is the mesh's answer once all is well.
    let reference = |i: usize| {
        let (status, v) = post(router_addr, "/v1/completions", &body(i, false));
        assert_eq!(status, 200, "reference {i}: {v}");
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let mut lost = Vec::new();
    let mut wrong = Vec::new();
    for s in &sent {
        let o = &s.outcome;
        if cut(s) {
            if o.error.is_none() && o.text != reference(s.i) {
                wrong.push(format!(
                    "request {} across the router restart: {:?}",
                    s.i, o.text
                ));
            }
            if o.error.is_some() && s.end > killed + Duration::from_secs(2) {
                wrong.push(format!(
                    "request {} took {:?} after the router died to fail",
                    s.i,
                    s.end - killed
                ));
            }
            continue;
        }
        let expected = &reference(s.i);
        if o.status != 200 || o.error.is_some() || o.finish.is_none() || o.text != *expected {
            lost.push(s.i);
            wrong.push(format!(
                "request {}: status {} error {:?} finish {:?}\n  got:      {:?}\n  expected: {:?}",
                s.i, o.status, o.error, o.finish, o.text, expected
            ));
        }
    }
    let orphaned = sent
        .iter()
        .filter(|s| s.start < killed && s.end >= killed && s.outcome.error.is_some())
        .count();
    let refused_while_down = sent
        .iter()
        .filter(|s| s.start >= killed && s.start < back && s.outcome.status == 0)
        .count();
    let served_after = sent
        .iter()
        .filter(|s| s.start >= back && s.outcome.error.is_none())
        .count();

    let first_fault = faults[0].1;
    let mut ttft: Vec<Duration> = sent
        .iter()
        .filter(|s| s.end < first_fault)
        .filter_map(|s| Some(*s.outcome.events.first()? - s.start))
        .collect();
    ttft.sort();
    println!(
        "compound chaos: before any fault, first token after {:.3} s (median) to {:.3} s (max)",
        ttft.get(ttft.len() / 2)
            .copied()
            .unwrap_or_default()
            .as_secs_f64(),
        ttft.last().copied().unwrap_or_default().as_secs_f64()
    );
    println!(
        "compound chaos: {} requests, {} faults",
        sent.len(),
        faults.len()
    );
    for &(name, at) in &faults {
        let f = figures(name, at, &sent, &lost);
        println!(
            "compound chaos: {:<45} in flight {:>2}, lost {}, longest stall {:.3} s, recovery {:.3} s",
            f.name,
            f.in_flight,
            f.lost,
            f.stall.as_secs_f64(),
            f.recovery.as_secs_f64()
        );
    }
    println!(
        "compound chaos: router restart: {orphaned} streams cut with an error, {refused_while_down} \
         refused while down ({:.3} s), {served_after} served after",
        (back - killed).as_secs_f64()
    );
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(lost.is_empty());

    let refusal = poison_refusal.expect("the poison was sent");
    assert_eq!(refusal.code(), tonic::Code::InvalidArgument, "{refusal:?}");
    assert_eq!(
        poison_codes,
        vec![Some(MALFORMED), Some(MALFORMED)],
        "malformed KV frames are refused"
    );
    assert!(orphaned >= 1, "the router died with no stream of its own");
    assert!(
        served_after >= AFTER_FAULTS,
        "the restarted router served {served_after}"
    );

    // Every surviving node drops what it held: the orphaned requests included.
    for addr in &decode_addrs[1..] {
        await_empty_pool(&rt, *addr, NodeRole::Decode, Some(&tls));
    }
    for addr in &prefill_addrs {
        await_empty_pool(&rt, *addr, NodeRole::Prefill, Some(&tls));
    }
}
