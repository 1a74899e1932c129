//! Chaos: the multi-process mesh (etcd, a router, two prefill and three decode processes)
//! under a steady stream of streaming requests, while it suffers, in turn, a `kill -9` of a
//! decode node mid-stream, a `kill -9` of a prefill node, an etcd outage and restart, a
//! decode node stopped mid-stream (`SIGSTOP`: it hangs with its sockets open, then
//! `SIGCONT`), and a graceful drain (SIGTERM) of a decode node mid-stream. The nodes talk mutual TLS (gRPC and
//! QUIC) with certificates from `kvmesh certs`, as a production cluster would.
//!
//! Every request must complete with exactly the greedy text the mesh gives without faults
//! (no gap, no repeat where a stream moved to another node), and afterwards every surviving
//! node's KV pool must be back at its baseline (no blocks stranded by a failure). Prints the
//! figures: requests, faults, retries, migrations, and the longest stall a fault caused.

mod cluster;

use cluster::*;
use kvmesh_common::NodeRole;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Distinct prompts; request `i` sends prompt `i % PROMPTS`.
const PROMPTS: usize = 8;
/// Clients keep sending until the faults are over and `AFTER_FAULTS` more requests have
/// completed, and never more than `MAX_REQUESTS` in all.
const AFTER_FAULTS: usize = 8;
const MAX_REQUESTS: usize = 400;
const CLIENTS: usize = 4;
const MAX_TOKENS: u32 = 24;

fn prompt(i: usize) -> String {
    let topic = ["rivers", "the moon", "bread", "chess", "volcanoes", "owls"][i % 6];
    let sentence = format!("Here is note {i} about {topic}, written at some length. ");
    format!(
        "{}Now write a long story about {topic}.",
        sentence.repeat(3 + i % 4)
    )
}

fn body(i: usize, stream: bool) -> Value {
    json!({"model": MODEL_NAME, "prompt": prompt(i % PROMPTS), "max_tokens": MAX_TOKENS,
           "temperature": 0, "stream": stream})
}

/// The longest a stream that was mid-answer at `fault` (it had sent data and was not done)
/// then waited for its next event: how long the fault held up answers being streamed.
fn stall_after(outcomes: &[Outcome], fault: Instant) -> Duration {
    outcomes
        .iter()
        .filter_map(|o| {
            let before = o.events.iter().rev().find(|&&t| t <= fault)?;
            let after = o.events.iter().find(|&&t| t > fault)?;
            Some(*after - *before)
        })
        .max()
        .unwrap_or_default()
}

/// A Prometheus counter's value in `/metrics` text (0 when absent).
fn counter(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[test]
fn the_mesh_loses_no_request_to_node_deaths_an_etcd_outage_or_a_drain() {
    let ChaosMesh {
        mut etcd,
        tls,
        router_addr,
        prefill_addrs,
        decode_addrs,
        mut prefill,
        mut decode,
        router: _router,
        rt,
        discovery,
    } = ChaosMesh::start("chaos");

    // The reference: each prompt's greedy text from the mesh before any fault.
    let reference: Vec<String> = (0..PROMPTS)
        .map(|i| {
            let (status, v) = post(router_addr, "/v1/completions", &body(i, false));
            assert_eq!(status, 200, "reference {i}: {v}");
            v["choices"][0]["text"].as_str().unwrap().to_string()
        })
        .collect();

    let progress = Progress::default();
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let outcomes: Mutex<Vec<(usize, Outcome)>> = Mutex::new(Vec::new());
    let mut faults: Vec<(&str, Instant)> = Vec::new();
    let mut drain_time = Duration::ZERO;
    std::thread::scope(|s| {
        for _ in 0..CLIENTS {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= MAX_REQUESTS || stop.load(Ordering::Relaxed) {
                    return;
                }
                let o = stream_completion(router_addr, &body(i, true));
                outcomes.lock().unwrap().push((i, o));
                progress.complete_one();
            });
        }
        // The faults, each once the stream has moved on from the last one.
        progress.wait_for(5, Duration::from_secs(300));
        await_streaming(&rt, &decode_addrs[0..=0], Some(&tls));
        decode[0].child.kill().unwrap();
        faults.push(("kill -9 decode node", Instant::now()));
        decode[0].child.wait().unwrap();

        progress.wait_for(13, Duration::from_secs(300));
        prefill[0].child.kill().unwrap();
        faults.push(("kill -9 prefill node", Instant::now()));
        prefill[0].child.wait().unwrap();

        progress.wait_for(20, Duration::from_secs(300));
        etcd.stop().expect("etcd stops");
        faults.push(("etcd stopped", Instant::now()));
        progress.wait_for(27, Duration::from_secs(300));
        etcd.restart().expect("etcd restarts");
        faults.push(("etcd restarted", Instant::now()));
        // Everyone alive registers again: one prefill and two decode nodes.
        rt.block_on(await_membership(&discovery, 1, 2, Duration::from_secs(30)));

        progress.wait_for(34, Duration::from_secs(300));
        await_streaming(&rt, &decode_addrs[1..=1], Some(&tls));
        signal(&decode[1], "-STOP");
        faults.push(("SIGSTOP decode node", Instant::now()));
        progress.wait_for(progress.count() + 4, Duration::from_secs(300));
        signal(&decode[1], "-CONT");
        faults.push(("SIGCONT decode node", Instant::now()));
        // Its lease expired while it was stopped: it registers again.
        rt.block_on(await_membership(&discovery, 1, 2, Duration::from_secs(30)));

        progress.wait_for(progress.count() + 4, Duration::from_secs(300));
        await_streaming(&rt, &decode_addrs[1..=1], Some(&tls));
        signal(&decode[1], "-TERM");
        let drained = Instant::now();
        faults.push(("SIGTERM (drain) decode node", drained));
        let exit = decode[1].child.wait().unwrap();
        drain_time = drained.elapsed();
        assert!(exit.success(), "a drained node exits cleanly: {exit}");
        progress.wait_for(progress.count() + AFTER_FAULTS, Duration::from_secs(300));
        stop.store(true, Ordering::Relaxed);
    });

    let mut outcomes = outcomes.into_inner().unwrap();
    outcomes.sort_by_key(|(i, _)| *i);
    let requests = outcomes.len();
    assert!(
        requests < MAX_REQUESTS,
        "the faults took {MAX_REQUESTS} requests"
    );
    let mut lost = Vec::new();
    for (i, o) in &outcomes {
        let expected = &reference[i % PROMPTS];
        if o.status != 200 || o.error.is_some() || o.finish.is_none() || o.text != *expected {
            lost.push(format!(
                "request {i}: status {} error {:?} finish {:?}\n  got:      {:?}\n  expected: {:?}",
                o.status, o.error, o.finish, o.text, expected
            ));
        }
    }
    let router_metrics = get(router_addr, "/metrics");
    let migrations = counter(&router_metrics, "kvmesh_router_migrations_total");
    let retries = counter(&router_metrics, "kvmesh_router_decode_retries_total");
    let just_outcomes: Vec<Outcome> = outcomes.into_iter().map(|(_, o)| o).collect();
    let stalls: Vec<(&str, Duration)> = faults
        .iter()
        .map(|&(name, at)| (name, stall_after(&just_outcomes, at)))
        .collect();
    println!(
        "chaos: {requests} streamed requests, {} faults",
        faults.len()
    );
    println!(
        "chaos: lost {}, migrations {migrations}, retries {retries}",
        lost.len()
    );
    for (name, stall) in &stalls {
        println!(
            "chaos: longest stall after {name}: {:.3} s",
            stall.as_secs_f64()
        );
    }
    println!("chaos: drain took {:.3} s", drain_time.as_secs_f64());
    assert!(
        lost.is_empty(),
        "lost or changed requests:\n{}",
        lost.join("\n")
    );
    assert!(
        migrations >= 1.0,
        "the decode node was killed mid-stream, yet nothing migrated"
    );
    // The target is under 2 s (printed above); the bound here leaves room for slow, shared CI
    // machines, where the survivor recomputes the migrated KV on a portable CPU path.
    let recovery = stalls[0].1;
    println!(
        "chaos: recovery after the decode kill {:.3} s (target 2 s: {})",
        recovery.as_secs_f64(),
        if recovery < Duration::from_secs(2) {
            "met"
        } else {
            "missed"
        }
    );
    assert!(
        recovery < Duration::from_secs(5),
        "streams stalled {recovery:?} after a decode node died"
    );
    // A stopped node announces nothing: keepalive or the stream's idle bound (2 s here)
    // finds it, then the stream moves. Target 3 s; the 600 s deadline held it before.
    let hung = stalls
        .iter()
        .find(|(name, _)| *name == "SIGSTOP decode node")
        .map(|&(_, stall)| stall)
        .unwrap_or_default();
    println!(
        "chaos: recovery after the decode stop {:.3} s (target 3 s: {})",
        hung.as_secs_f64(),
        if hung < Duration::from_secs(3) {
            "met"
        } else {
            "missed"
        }
    );
    assert!(
        hung < Duration::from_secs(6),
        "streams stalled {hung:?} behind a stopped decode node"
    );

    // No KV stranded: every surviving node is back to an empty pool.
    await_empty_pool(&rt, decode_addrs[2], NodeRole::Decode, Some(&tls));
    await_empty_pool(&rt, prefill_addrs[1], NodeRole::Prefill, Some(&tls));
}
