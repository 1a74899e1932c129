//! Faults that do not announce themselves, on the multi-process mesh (etcd, a router, two
//! decode nodes, the real model):
//!
//! - a decode node stopped with `SIGSTOP` mid-stream keeps its sockets open and answers
//!   nothing; the router must take it as hung (HTTP/2 keepalive, the stream's idle bound)
//!   and migrate the stream, which completes with the fault-free greedy text within
//!   seconds, not at the request's 600 s deadline;
//! - a `Generate` call over gRPC with a token id outside the vocabulary, sent straight to
//!   the decode node that is running a streamed request: it is refused alone with
//!   `INVALID_ARGUMENT`, and the request beside it finishes on its node, not migrated.
//!
//! - a client that goes away before the first token of a long prompt, which a prefill node
//!   is computing: the prefill and the decode node are back to zero KV blocks in use within
//!   seconds.
//!
//! Afterwards every node's KV pool is empty (the stopped node, once continued, dropped the
//! request the router moved away from it). Prints the figures.

mod cluster;

use cluster::*;
use kvmesh_common::NodeRole;
use kvmesh_kvstore::EtcdServer;
use serde_json::{json, Value};
use std::io::Write;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

const MAX_TOKENS: u32 = 64;

fn body(stream: bool) -> Value {
    json!({"model": MODEL_NAME, "prompt": "Here is a long story about rivers and the sea:",
           "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream})
}

/// A Prometheus counter's value in `/metrics` text (0 when absent).
fn counter(router: SocketAddr, name: &str) -> f64 {
    get(router, "/metrics")
        .lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// The longest wait between two consecutive events of `o` that spans `at`.
fn stall_across(o: &Outcome, at: Instant) -> Duration {
    let before = o.events.iter().rev().find(|&&t| t <= at);
    let after = o.events.iter().find(|&&t| t > at);
    match (before, after) {
        (Some(b), Some(a)) => *a - *b,
        _ => Duration::ZERO,
    }
}

#[test]
fn hung_nodes_poison_requests_and_gone_clients_cost_nothing() {
    let etcd = EtcdServer::start().expect("etcd starts (scripts/setup.sh installs it)");
    let logs = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("silent_faults");
    std::fs::create_dir_all(&logs).unwrap();
    let log = |name: &str| logs.join(format!("{name}.log"));
    let endpoint = etcd.endpoint();
    let router_addr = free_addr("127.0.0.2");
    let decode_addrs = [free_addr("127.0.0.5"), free_addr("127.0.0.6")];
    let prefill_addr = free_addr("127.0.0.3");
    let prefill = Node::spawn(
        mesh_args("prefill", prefill_addr, &endpoint, "silent"),
        log("prefill"),
    );
    let decode: Vec<Node> = (0..2)
        .map(|i| {
            Node::spawn(
                mesh_args("decode", decode_addrs[i], &endpoint, "silent"),
                log(&format!("decode{i}")),
            )
        })
        .collect();
    let mut router_args = mesh_args("router", router_addr, &endpoint, "silent");
    router_args.extend(["--routing-policy".into(), "round_robin".into()]);
    let router = Node::spawn(router_args, log("router"));

    let rt = tokio::runtime::Runtime::new().unwrap();
    let discovery = discovery(&rt, &etcd.endpoint(), "silent");
    rt.block_on(await_membership(&discovery, 1, 2, START_TIMEOUT));
    let all: Vec<&Node> = decode.iter().chain([&router, &prefill]).collect();
    await_health(router_addr, &all);

    // The reference, from each node in turn (round robin): the same greedy text.
    let reference: Vec<String> = (0..2)
        .map(|_| {
            let (status, v) = post(router_addr, "/v1/completions", &body(false));
            assert_eq!(status, 200, "reference: {v}");
            v["choices"][0]["text"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(reference[0], reference[1], "the two nodes disagree");
    let reference = &reference[0];

    // 1. SIGSTOP the node serving a stream, mid-stream.
    let migrations_before = counter(router_addr, "kvmesh_router_migrations_total");
    let (outcome, stopped, at) = std::thread::scope(|s| {
        let client = s.spawn(|| stream_completion(router_addr, &body(true)));
        let stopped = await_streaming(&rt, &decode_addrs, None);
        signal(&decode[stopped], "-STOP");
        let at = Instant::now();
        (client.join().unwrap(), stopped, at)
    });
    let took = at.elapsed();
    // Continued, the node must drop the request the router moved away from it.
    signal(&decode[stopped], "-CONT");
    assert_eq!(outcome.status, 200);
    assert_eq!(outcome.error, None, "the stream failed");
    assert_eq!(&outcome.text, reference, "a gap or a repeat after the move");
    let stall = stall_across(&outcome, at);
    let migrated = counter(router_addr, "kvmesh_router_migrations_total") - migrations_before;
    let stalled = counter(router_addr, "kvmesh_router_stalled_streams_total");
    println!(
        "silent faults: SIGSTOP decode node mid-stream: stream stalled {:.3} s, finished {:.3} s \
         after the stop; migrations {migrated}, streams given up as hung {stalled}",
        stall.as_secs_f64(),
        took.as_secs_f64()
    );
    assert!(
        migrated >= 1.0,
        "the stream was not moved off the stopped node"
    );
    // Detection takes about 2 s (keepalive 1 s + 1 s, or the idle bound's 2 s floor), the
    // move a recompute of ~80 tokens; the bound leaves room for a slow, shared machine. The
    // 600 s deadline is what held it before.
    assert!(
        stall < Duration::from_secs(8),
        "the stream stalled {stall:?} behind a stopped node"
    );

    // 2. A poison request over gRPC, beside a streamed request on the same node.
    let migrations_before = counter(router_addr, "kvmesh_router_migrations_total");
    let (outcome, refusal) = std::thread::scope(|s| {
        let client = s.spawn(|| stream_completion(router_addr, &body(true)));
        let victim = await_streaming(&rt, &decode_addrs, None);
        let refusal = rt.block_on(poison(decode_addrs[victim], None));
        (client.join().unwrap(), refusal)
    });
    println!("silent faults: poison request answered {refusal:?}");
    assert_eq!(
        refusal.code(),
        tonic::Code::InvalidArgument,
        "the poison request was not refused: {refusal:?}"
    );
    assert!(
        refusal.message().contains("vocabulary"),
        "{}",
        refusal.message()
    );
    assert_eq!(
        outcome.error, None,
        "the request beside the poison one failed"
    );
    assert_eq!(&outcome.text, reference);
    let migrated = counter(router_addr, "kvmesh_router_migrations_total") - migrations_before;
    assert_eq!(
        migrated, 0.0,
        "the request beside the poison one failed on its node and had to move"
    );

    // 3. The client goes away while a prefill node computes its long prompt.
    let long = json!({"model": MODEL_NAME, "prompt": "rivers and the sea ".repeat(400),
                      "max_tokens": 8, "temperature": 0, "stream": true});
    let mut conn = std::net::TcpStream::connect(router_addr).unwrap();
    let text = long.to_string();
    write!(
        conn,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{text}",
        text.len()
    )
    .unwrap();
    await_prefill_holds_kv(&rt, prefill_addr);
    drop(conn);
    let closed = Instant::now();
    for addr in decode_addrs {
        await_empty_pool(&rt, addr, NodeRole::Decode, None);
    }
    await_empty_pool(&rt, prefill_addr, NodeRole::Prefill, None);
    let freed = closed.elapsed();
    println!(
        "silent faults: client gone mid-prefill: every pool empty {:.3} s later",
        freed.as_secs_f64()
    );
    assert!(
        freed < Duration::from_secs(10),
        "KV held {freed:?} after the client left"
    );

    // 4. The prefill node stops (SIGSTOP) while it computes a long prompt: the decode node
    // must notice (keepalive on its Prefill call) and prefill locally, well before its 10 s
    // remote-prefill silence bound would.
    let long = |topic: &str, stream: bool| {
        json!({"model": MODEL_NAME, "prompt": format!("{topic} and the sea ").repeat(400),
               "max_tokens": 8, "temperature": 0, "stream": stream})
    };
    // How long a fresh long prompt takes without a fault (its prefill, mostly).
    let started = Instant::now();
    let (status, v) = post(router_addr, "/v1/completions", &long("lakes", false));
    assert_eq!(status, 200, "{v}");
    let unhurried = started.elapsed();
    let (outcome, at) = std::thread::scope(|s| {
        let client = s.spawn(|| stream_completion(router_addr, &long("clouds", true)));
        await_prefill_holds_kv(&rt, prefill_addr);
        signal(&prefill, "-STOP");
        let at = Instant::now();
        (client.join().unwrap(), at)
    });
    let took = at.elapsed();
    signal(&prefill, "-CONT");
    // The reference afterwards (cached by now; the text does not depend on it).
    let (status, v) = post(router_addr, "/v1/completions", &long("clouds", false));
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        outcome.error, None,
        "the request failed with its prefill node"
    );
    assert_eq!(outcome.text, v["choices"][0]["text"].as_str().unwrap());
    println!(
        "silent faults: SIGSTOP prefill node mid-prompt: answered {:.3} s after the stop \
         (the same work without a fault: {:.3} s)",
        took.as_secs_f64(),
        unhurried.as_secs_f64()
    );
    assert!(
        took < unhurried + Duration::from_secs(6),
        "the stopped prefill node held the request {took:?}"
    );

    for addr in decode_addrs {
        await_empty_pool(&rt, addr, NodeRole::Decode, None);
    }
    await_empty_pool(&rt, prefill_addr, NodeRole::Prefill, None);
}

/// Waits (polling gRPC health) until the prefill node at `addr` holds KV in use.
fn await_prefill_holds_kv(rt: &tokio::runtime::Runtime, addr: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let h = rt.block_on(node_health(&addr.to_string(), NodeRole::Prefill, None));
        if h.load.is_some_and(|l| l.kv_blocks_used > 0) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the prefill node never took the prompt"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
