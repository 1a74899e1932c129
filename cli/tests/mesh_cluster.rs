//! The multi-process mesh for real: a local etcd, then `kvmesh router`, two `kvmesh prefill`
//! and two `kvmesh decode` processes, each on its own loopback address. Requests through the
//! router must give `kvmesh serve`'s greedy output, every node must serve traffic, and the
//! mesh must survive a prefill node's `kill -9` and take it back when it restarts; cached
//! prefixes move between the processes (decode from decode, prefill from its destination).

mod cluster;

use cluster::*;
use kvmesh_common::{NodeId, NodeRole};
use kvmesh_kvstore::{EtcdConfig, EtcdDiscovery, EtcdPrefixIndex, EtcdServer, PrefixIndex};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// The request mix: completions and chat, short prompts (prefilled on the decode node) and
/// long ones (prefilled on a prefill node), several lengths of output.
fn request(i: usize) -> (&'static str, Value) {
    let topic = ["rivers", "the moon", "bread", "chess", "volcanoes"][i % 5];
    let long = !i.is_multiple_of(3);
    let text = if long {
        let sentence = format!("Here is note {i} about {topic}, written at length. ");
        format!(
            "{}Summarize the notes about {topic}.",
            sentence.repeat(4 + i % 7)
        )
    } else {
        format!("Tell me one fact about {topic}.")
    };
    let max_tokens = 4 + (i % 4) * 4;
    if i.is_multiple_of(2) {
        let body = json!({"model": MODEL_NAME, "prompt": text, "max_tokens": max_tokens,
                          "temperature": 0});
        ("/v1/completions", body)
    } else {
        let body = json!({"model": MODEL_NAME, "messages": [{"role": "user", "content": text}],
                          "max_tokens": max_tokens, "temperature": 0});
        ("/v1/chat/completions", body)
    }
}

fn output_text(path: &str, v: &Value) -> String {
    let choice = &v["choices"][0];
    let text = if path == "/v1/completions" {
        &choice["text"]
    } else {
        &choice["message"]["content"]
    };
    text.as_str().expect("a text output").to_string()
}

/// Sends requests `ids` through `addr` on `threads` connections at once; returns the texts.
fn run_requests(addr: SocketAddr, ids: &[usize], threads: usize) -> Vec<String> {
    let mut out = vec![String::new(); ids.len()];
    std::thread::scope(|s| {
        for (t, chunk) in out.chunks_mut(ids.len().div_ceil(threads)).enumerate() {
            let start = t * ids.len().div_ceil(threads);
            s.spawn(move || {
                for (k, slot) in chunk.iter_mut().enumerate() {
                    let (path, body) = request(ids[start + k]);
                    let (status, v) = post(addr, path, &body);
                    assert_eq!(status, 200, "request {}: {v}", ids[start + k]);
                    *slot = output_text(path, &v);
                }
            });
        }
    });
    out
}

/// Token ids of a long prompt: `prefix` shared, then a tail of its own.
fn shared_prefix_prompt(tail: u32) -> Vec<u32> {
    (0..1000u32)
        .map(|i| 1000 + (i * 7919) % 30000)
        .chain((0..24).map(|i| 2000 + tail * 100 + i))
        .collect()
}

/// Returns the index of the decode node that holds the shared prefix.
async fn prefix_reuse(etcd: &str, router: SocketAddr, decode: &[SocketAddr]) -> usize {
    let index = EtcdPrefixIndex::connect(EtcdConfig {
        endpoints: vec![etcd.to_string()],
        cluster: "meshtest".into(),
        ..EtcdConfig::default()
    })
    .await
    .expect("the test's own index");
    let served = |addrs: Vec<SocketAddr>| async move {
        let mut v = Vec::new();
        for a in addrs {
            v.push(requests_served(&a.to_string(), NodeRole::Decode).await);
        }
        v
    };
    let completion = |prompt: Vec<u32>| {
        let body = json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4,
                          "temperature": 0});
        tokio::task::spawn_blocking(move || post(router, "/v1/completions", &body))
    };
    let first = shared_prefix_prompt(1);
    let before = served(decode.to_vec()).await;
    let (status, _) = completion(first.clone()).await.unwrap();
    assert_eq!(status, 200);
    let after_first = served(decode.to_vec()).await;
    let holder = (0..decode.len())
        .find(|&i| after_first[i] > before[i])
        .expect("one decode node served it");
    // Wait until the cluster's index shows the prefix (what the router reads too).
    let hasher = kvmesh_common::BlockHasher::new(
        kvmesh_prompt::ModelText::read(
            &kvmesh_prompt::model_fetch::fetched_model().unwrap_or_else(|e| panic!("{e}")),
        )
        .unwrap()
        .fingerprint,
        16,
    );
    let hashes = hasher.sequence_hashes(&first[..1000]);
    // The decode node that served it, not the prefill node that computed it (which
    // publishes the same blocks, maybe first).
    let holder_id = NodeId(
        node_health(&decode[holder].to_string(), NodeRole::Decode, None)
            .await
            .node_id,
    );
    let mut changes = index.subscribe();
    let deadline = Instant::now() + Duration::from_secs(10);
    while index.overlap(&hashes).get(&holder_id) < Some(&hashes.len()) {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            matches!(
                tokio::time::timeout(left, changes.changed()).await,
                Ok(Ok(()))
            ),
            "the prefix never showed up in the index"
        );
    }
    // The router watches the same etcd from another process: wait until its index (the
    // entries it exports, refreshed every second) has caught up with this one.
    let seen = index.len() as f64;
    let router_entries = move || {
        let page = get(router, "/metrics");
        metric_value(&page, "kvmesh_router_prefix_index_entries")
    };
    while tokio::task::spawn_blocking(router_entries).await.unwrap() < seen {
        assert!(
            Instant::now() < deadline,
            "the router's prefix index never caught up ({seen} entries here)"
        );
        // The gauge is refreshed every second: a polling cadence, with a deadline.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, v) = completion(shared_prefix_prompt(2)).await.unwrap();
    assert_eq!(status, 200, "{v}");
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 992, "only {cached} cached tokens: {v}");
    let after_second = served(decode.to_vec()).await;
    assert_eq!(
        after_second[holder],
        after_first[holder] + 1,
        "the second request went elsewhere"
    );
    holder
}

/// Requests for the shared prefix pile onto its holder until the router's imbalance guard
/// passes it over; the one that goes to the other decode node pulls the prefix from the busy
/// holder instead of recomputing it, and answers exactly as `kvmesh serve` does.
fn pull_from_a_busy_holder(
    rt: &tokio::runtime::Runtime,
    router: SocketAddr,
    serve: SocketAddr,
    decode: &[SocketAddr; 2],
    metrics: &[SocketAddr; 2],
    holder: usize,
) {
    let other = 1 - holder;
    let served = |i: usize| rt.block_on(requests_served(&decode[i].to_string(), NodeRole::Decode));
    let body = |tail: u32| {
        json!({"model": MODEL_NAME, "prompt": shared_prefix_prompt(tail), "max_tokens": 48,
               "temperature": 0, "ignore_eos": true})
    };
    let pulled = |i: usize| {
        metric_value(
            &get(metrics[i], "/metrics"),
            "kvmesh_worker_kv_pulled_blocks_total",
        )
    };
    let pulled_before = pulled(other);
    let other_before = served(other);
    let before = served(0) + served(1);
    let mut busy = Vec::new();
    let mut landed = None;
    for (k, tail) in (10..20).enumerate() {
        let b = body(tail);
        busy.push(std::thread::spawn(move || {
            post(router, "/v1/completions", &b)
        }));
        // Wait until a decode node took it, so the router counts it before the next one.
        let deadline = Instant::now() + Duration::from_secs(30);
        while served(0) + served(1) <= before + k as u64 {
            assert!(
                Instant::now() < deadline,
                "request {tail} was never accepted"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        if served(other) > other_before {
            landed = Some((tail, busy.len() - 1));
            break;
        }
    }
    let (tail, i) = landed.expect("the busy holder took every request");
    assert!(
        i >= 1,
        "the first request for a held prefix went to its holder"
    );
    let results: Vec<(u16, Value)> = busy.into_iter().map(|t| t.join().unwrap()).collect();
    let (status, v) = &results[i];
    assert_eq!(*status, 200, "{v}");
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 992, "the pulled prefix was not reused: {v}");
    assert!(
        pulled(other) >= pulled_before + 62.0,
        "the other node did not pull the prefix"
    );
    let (status, reference) = post(serve, "/v1/completions", &body(tail));
    assert_eq!(status, 200);
    assert_eq!(
        output_text("/v1/completions", v),
        output_text("/v1/completions", &reference),
        "pulled KV changed the output"
    );
}

/// A metric's value in Prometheus text, summed over its label sets.
/// A JSON-schema request whose prompt is disaggregated (the prefill node draws the first
/// token under the schema, the decode node goes on from there): valid against the schema,
/// and the same text as `kvmesh serve` gives.
fn structured_output_crosses_the_mesh(router: SocketAddr, serve: SocketAddr) {
    let schema = json!({
        "type": "object",
        "properties": {
            "topic": {"enum": ["rivers", "bread", "chess"]},
            "facts": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 2}
        },
        "required": ["topic", "facts"],
        "additionalProperties": false
    });
    let notes = "Rivers carry water to the sea and shape valleys over time. ".repeat(6);
    let body = json!({"model": MODEL_NAME, "max_tokens": 120, "temperature": 0,
        "messages": [{"role": "user", "content": format!("{notes}Summarize as JSON.")}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "summary", "schema": schema}}});
    let path = "/v1/chat/completions";
    let (status, v) = post(router, path, &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let text = output_text(path, &v);
    let parsed: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(
        ["rivers", "bread", "chess"].contains(&parsed["topic"].as_str().unwrap()),
        "{text}"
    );
    let facts = parsed["facts"].as_array().unwrap();
    assert!(
        facts.len() <= 2
            && facts
                .iter()
                .all(|f| f.as_str().unwrap().chars().count() <= 30)
    );
    let (_, reference) = post(serve, path, &body);
    assert_eq!(
        text,
        output_text(path, &reference),
        "the mesh and `kvmesh serve` disagree"
    );
    // The tokens the schema forced count as generated, on both.
    assert_eq!(
        v["usage"]["completion_tokens"], reference["usage"]["completion_tokens"],
        "{v}\n{reference}"
    );
}

fn metric_value(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn five_processes_serve_as_one_mesh_and_survive_a_prefill_crash() {
    let etcd = EtcdServer::start().expect("etcd starts (scripts/setup.sh installs it)");
    // Kept after the run for a look at what each process said.
    let logs = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("mesh_cluster");
    std::fs::create_dir_all(&logs).unwrap();
    let log = |name: &str| logs.join(format!("{name}.log"));
    let mesh_args = |role: &str, addr| mesh_args(role, addr, &etcd.endpoint(), "meshtest");
    let router_addr = free_addr("127.0.0.2");
    let prefill_addrs = [free_addr("127.0.0.3"), free_addr("127.0.0.4")];
    let decode_addrs = [free_addr("127.0.0.5"), free_addr("127.0.0.6")];
    let prefill_metrics = [free_addr("127.0.0.3"), free_addr("127.0.0.4")];
    let mut prefill: Vec<Node> = prefill_addrs
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let mut args = mesh_args("prefill", *a);
            args.extend(["--metrics-listen".into(), prefill_metrics[i].to_string()]);
            Node::spawn(args, log(&format!("prefill{i}")))
        })
        .collect();
    let decode_metrics = [free_addr("127.0.0.5"), free_addr("127.0.0.6")];
    let decode: Vec<Node> = decode_addrs
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let mut args = mesh_args("decode", *a);
            // Disaggregate every prompt of 32 tokens or more.
            args.extend(["--local-prefill-max-tokens".into(), "32".into()]);
            args.extend(["--metrics-listen".into(), decode_metrics[i].to_string()]);
            Node::spawn(args, log(&format!("decode{i}")))
        })
        .collect();
    let mut args = mesh_args("router", router_addr);
    args.extend(["--local-prefill-max-tokens".into(), "32".into()]);
    let router = Node::spawn(args, log("router"));
    // The reference: the whole mesh in one process.
    let serve_addr = free_addr("127.0.0.7");
    let serve = Node::spawn(
        [
            "serve",
            "--listen",
            &serve_addr.to_string(),
            "--threads",
            "1",
        ]
        .map(String::from)
        .to_vec(),
        log("serve"),
    );

    let rt = tokio::runtime::Runtime::new().unwrap();
    let discovery = discovery(&rt, &etcd.endpoint(), "meshtest");
    rt.block_on(await_membership(&discovery, 2, 2, START_TIMEOUT));
    let all: Vec<&Node> = prefill.iter().chain(&decode).chain([&router]).collect();
    await_health(router_addr, &all);
    await_health(serve_addr, &[&serve]);

    // 100 mixed requests, 4 at a time, through both systems.
    let ids: Vec<usize> = (0..100).collect();
    let mesh = run_requests(router_addr, &ids, 4);
    let reference = run_requests(serve_addr, &ids, 4);
    for (i, (m, r)) in mesh.iter().zip(&reference).enumerate() {
        assert_eq!(m, r, "request {i}: the mesh and `kvmesh serve` disagree");
    }
    rt.block_on(async {
        for a in prefill_addrs {
            let n = requests_served(&a.to_string(), NodeRole::Prefill).await;
            assert!(n > 0, "prefill node {a} served nothing");
        }
        for a in decode_addrs {
            let n = requests_served(&a.to_string(), NodeRole::Decode).await;
            assert!(n > 0, "decode node {a} served nothing");
        }
    });

    structured_output_crosses_the_mesh(router_addr, serve_addr);

    // Prefix reuse: a second prompt sharing a 1,000-token prefix goes to the decode node that
    // holds it and is served from its cache.
    let holder = rt.block_on(prefix_reuse(&etcd.endpoint(), router_addr, &decode_addrs));
    pull_from_a_busy_holder(
        &rt,
        router_addr,
        serve_addr,
        &decode_addrs,
        &decode_metrics,
        holder,
    );
    // A node process exports its workers' and its prefix publishing's metrics.
    let metrics = get(decode_metrics[0], "/metrics");
    for name in [
        "kvmesh_worker_requests_running",
        "kvmesh_worker_prefix_cache_hit_tokens_total",
        "kvmesh_kvstore_kv_etcd_writes_total",
        "kvmesh_kvstore_kv_held_blocks",
    ] {
        assert!(metrics.contains(name), "{name} missing from:\n{metrics}");
    }

    // kill -9 a prefill node: it leaves routing within the lease TTL, requests keep working.
    prefill[0].child.kill().unwrap();
    prefill[0].child.wait().unwrap();
    let long_ids: Vec<usize> = (100..124)
        .filter(|i: &usize| !i.is_multiple_of(3))
        .collect();
    let during = run_requests(router_addr, &long_ids, 4);
    assert!(during.iter().all(|t| !t.is_empty()));
    let gone = rt.block_on(await_membership(&discovery, 1, 2, LEASE_TTL * 3));
    assert!(gone <= LEASE_TTL + Duration::from_secs(2), "took {gone:?}");
    let after = run_requests(router_addr, &long_ids, 4);
    assert_eq!(after, during, "greedy output changed with one prefill node");

    // Restarted, it rejoins and serves again (new prompts: the decode nodes have the old ones
    // cached and would not ask for a prefill).
    prefill[0].restart();
    rt.block_on(await_membership(&discovery, 2, 2, START_TIMEOUT));
    let new_ids: Vec<usize> = (124..148)
        .filter(|i: &usize| !i.is_multiple_of(3))
        .collect();
    let again = run_requests(router_addr, &new_ids, 4);
    assert_eq!(again, run_requests(serve_addr, &new_ids, 4));
    let served = rt.block_on(requests_served(
        &prefill_addrs[0].to_string(),
        NodeRole::Prefill,
    ));
    assert!(served > 0, "the restarted prefill node served nothing");

    prefill_pulls_from_its_destination(
        &rt,
        &discovery,
        &mut prefill,
        prefill_metrics[0],
        router_addr,
        serve_addr,
    );
}

/// With only the restarted prefill node left (its cache empty), a prompt that extends the
/// shared prefix a decode node holds by a tail long enough for a prefill node: that node
/// pulls the prefix from the decode node (QUIC into the prefill node's port) instead of
/// recomputing it, and the answer is `kvmesh serve`'s.
fn prefill_pulls_from_its_destination(
    rt: &tokio::runtime::Runtime,
    discovery: &EtcdDiscovery,
    prefill: &mut [Node],
    metrics: SocketAddr,
    router: SocketAddr,
    serve: SocketAddr,
) {
    prefill[1].child.kill().unwrap();
    prefill[1].child.wait().unwrap();
    rt.block_on(await_membership(discovery, 1, 2, LEASE_TTL * 3));
    let pulled = || {
        metric_value(
            &get(metrics, "/metrics"),
            "kvmesh_worker_kv_pulled_blocks_total",
        )
    };
    let before = pulled();
    let mut prompt = shared_prefix_prompt(30);
    prompt.extend((0..200).map(|i| 5000 + i));
    let body = json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8,
                      "temperature": 0});
    let (status, v) = post(router, "/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    assert!(
        pulled() >= before + 62.0,
        "the prefill node recomputed the prefix its destination holds"
    );
    let (status, reference) = post(serve, "/v1/completions", &body);
    assert_eq!(status, 200);
    assert_eq!(
        output_text("/v1/completions", &v),
        output_text("/v1/completions", &reference),
        "pulled KV changed the output"
    );
}
