//! `kvmesh serve` with two decode workers: a burst of requests for one cached prefix spreads
//! over both workers (the router counts what it sent each until it ends), and the worker
//! without the prefix pulls it from the other instead of recomputing it, with the output of
//! computing it.

mod cluster;

use cluster::*;
use serde_json::{json, Value};

fn completion(tail: u32) -> Value {
    let prompt: Vec<u32> = (0..1000u32)
        .map(|i| 1000 + (i * 7919) % 30000)
        .chain((0..24).map(|i| 2000 + tail * 100 + i))
        .collect();
    json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0,
           "ignore_eos": true})
}

/// A metric's value per `node` label, from Prometheus text.
fn per_node(metrics: &str, name: &str) -> Vec<(String, f64)> {
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter_map(|l| {
            let node = l.split("node=\"").nth(1)?.split('"').next()?.to_string();
            Some((node, l.rsplit(' ').next()?.parse().ok()?))
        })
        .collect()
}

fn serve(args: &[&str], name: &str) -> (Node, std::net::SocketAddr) {
    let logs = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("serve_pull");
    std::fs::create_dir_all(&logs).unwrap();
    let addr = free_addr("127.0.0.1");
    let mut all = vec!["serve", "--threads", "1", "--listen"];
    let listen = addr.to_string();
    all.push(&listen);
    all.extend_from_slice(args);
    let node = Node::spawn(
        all.into_iter().map(String::from).collect(),
        logs.join(format!("{name}.log")),
    );
    await_health(addr, &[&node]);
    (node, addr)
}

#[test]
fn a_burst_on_one_cached_prefix_spreads_and_the_other_worker_pulls_it() {
    let (_two, addr) = serve(&["--decode-workers", "2"], "two_workers");
    let (status, v) = post(addr, "/v1/completions", &completion(1));
    assert_eq!(status, 200, "{v}");

    let tails: Vec<u32> = (10..20).collect();
    let burst: Vec<(u16, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> = tails
            .iter()
            .map(|&t| s.spawn(move || post(addr, "/v1/completions", &completion(t))))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (status, v) in &burst {
        assert_eq!(*status, 200, "{v}");
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert!(cached >= 992, "the prefix was recomputed: {v}");
    }
    let metrics = get(addr, "/metrics");
    let served = per_node(&metrics, "kvmesh_worker_prefix_cache_queried_tokens_total");
    assert_eq!(served.len(), 2, "{served:?}");
    assert!(
        served.iter().all(|(_, tokens)| *tokens > 0.0),
        "one worker took the whole burst: {served:?}"
    );
    let pulled: f64 = per_node(&metrics, "kvmesh_worker_kv_pulled_blocks_total")
        .iter()
        .map(|(_, n)| n)
        .sum();
    assert!(
        pulled >= 62.0,
        "no worker pulled the prefix ({pulled} blocks)"
    );

    // The same prompts, computed by one worker that never pulls.
    let (_one, reference) = serve(&[], "one_worker");
    for (&t, (_, v)) in tails.iter().zip(&burst) {
        let (status, r) = post(reference, "/v1/completions", &completion(t));
        assert_eq!(status, 200, "{r}");
        assert_eq!(v["choices"][0]["text"], r["choices"][0]["text"], "tail {t}");
    }
}
