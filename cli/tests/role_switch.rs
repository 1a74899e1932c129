//! In-place role switching for real: a local etcd, a router, one prefill and two decode
//! processes, under streaming load from concurrent clients. One decode node is switched to
//! prefill and back with `kvmesh node switch-role` while requests stream. Every request must
//! complete with exactly its greedy text (the same prompt asked again on the idle mesh
//! afterwards); the switched node must show up in its new role in etcd and take work in it
//! from the router, announce its warm KV cache again, and never load the model a second
//! time (it is the same process throughout). A second switch while one runs, and a switch
//! while the node drains for shutdown, are refused. At the end the prefill node, started as
//! one, becomes a decode node and serves as one, then switches back while etcd is down and
//! registers once it is up again.

mod cluster;

use cluster::*;
use kvmesh_common::grpc::{generate_request_to_pb, pb, Placement};
use kvmesh_common::tls::grpc_endpoint;
use kvmesh_common::{GenerateRequest, NodeId, NodeRole, RequestId, SamplingParams};
use kvmesh_kvstore::{Discovery, EtcdConfig, EtcdDiscovery, EtcdPrefixIndex, EtcdServer};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tonic::Code;

const CLIENTS: usize = 4;
const MAX_TOKENS: u32 = 16;
const MAX_REQUESTS: usize = 300;
const CLUSTER: &str = "roleswitch";

/// Prompts from here on take several engine steps to prefill (about 1,200 tokens).
const LONG: usize = 1000;

/// Prompt `i`: long enough (over 32 tokens) to go to a prefill node, and its own from the
/// first block on, so no decode node has it cached and the prefill nodes get every one.
fn prompt(i: usize) -> String {
    let topic = ["rivers", "the moon", "bread", "chess", "volcanoes", "owls"][i % 6];
    let sentence = format!("Note {i} is about {topic}, written at some length. ");
    let repeat = if i >= LONG { 100 } else { 3 + i % 3 };
    format!("{}Now tell a story about {topic}.", sentence.repeat(repeat))
}

fn body(i: usize, stream: bool) -> Value {
    json!({"model": MODEL_NAME, "prompt": prompt(i), "max_tokens": MAX_TOKENS,
           "temperature": 0, "stream": stream})
}

/// Runs `kvmesh node ARGS...`; returns (success, stdout + stderr).
fn kvmesh_node(args: &[&str]) -> (bool, String) {
    kvmesh(&[&["node"], args].concat())
}

/// `kvmesh health` on a node's metrics port: what a container's health check runs.
fn kvmesh_health(metrics: SocketAddr) -> (bool, String) {
    kvmesh(&["health", "--url", &format!("http://{metrics}/health")])
}

fn kvmesh(args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args(args)
        .env("KVMESH_LOG", "warn")
        .output()
        .expect("kvmesh node runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// A sample's value in Prometheus text: the series of `name` whose labels include `label`.
fn sample(metrics: &str, name: &str, label: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |a, b| a + b)
}

/// Waits (with a deadline; etcd's watch pushes, the test polls its own snapshot) until
/// discovery lists `node` under `role` and `prefill` / `decode` nodes in all.
fn await_role(
    rt: &tokio::runtime::Runtime,
    discovery: &EtcdDiscovery,
    node: NodeId,
    role: NodeRole,
    (prefill, decode): (usize, usize),
) {
    rt.block_on(await_membership(
        discovery,
        prefill,
        decode,
        Duration::from_secs(10),
    ));
    let listed = discovery.nodes(role).iter().any(|n| n.info.node_id == node);
    assert!(listed, "node {node} is not registered as {}", role.as_str());
}

/// Raises its flags when dropped: at the end of the scope, or as a panic leaves it.
struct RaiseOnDrop<'a, const N: usize>([&'a AtomicBool; N]);

impl<const N: usize> Drop for RaiseOnDrop<'_, N> {
    fn drop(&mut self) {
        for flag in self.0 {
            flag.store(true, Ordering::Relaxed);
        }
    }
}

/// Polls `value` until it passes `check` (the nodes push nothing a test could await).
fn await_value<T: std::fmt::Debug>(
    what: &str,
    mut value: impl FnMut() -> T,
    check: impl Fn(&T) -> bool,
) -> T {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let v = value();
        if check(&v) {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: still {v:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_decode_node_switches_to_prefill_and_back_under_load_losing_nothing() {
    let started = Instant::now();
    let mut etcd = EtcdServer::start().expect("etcd starts (scripts/setup.sh installs it)");
    let logs = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("role_switch");
    std::fs::create_dir_all(&logs).unwrap();
    let log = |name: &str| logs.join(format!("{name}.log"));
    let endpoint = etcd.endpoint();
    let args = |role: &str, addr| {
        let mut a = mesh_args(role, addr, &endpoint, CLUSTER);
        if role != "prefill" {
            a.extend(["--local-prefill-max-tokens".into(), "32".into()]);
        }
        a
    };
    let router_addr = free_addr("127.0.0.2");
    let prefill_addr = free_addr("127.0.0.3");
    let decode_addrs = [free_addr("127.0.0.5"), free_addr("127.0.0.6")];
    let switched_metrics = free_addr("127.0.0.6");
    let switched_id = NodeId(0x5717c4);
    let prefill = Node::spawn(args("prefill", prefill_addr), log("prefill"));
    let stays = Node::spawn(args("decode", decode_addrs[0]), log("decode0"));
    let mut b_args = args("decode", decode_addrs[1]);
    b_args.extend([
        "--node-id".into(),
        format!("{:x}", switched_id.0),
        "--metrics-listen".into(),
        switched_metrics.to_string(),
    ]);
    let mut switched = Node::spawn(b_args, log("decode1"));
    // Round robin: both decode nodes hold open streams when one switches, and the prefill
    // nodes take turns, so the switched node gets prompts as soon as it is a prefill node.
    let mut router_args = args("router", router_addr);
    router_args.extend(["--routing-policy".into(), "round_robin".into()]);
    let router = Node::spawn(router_args, log("router"));

    let rt = tokio::runtime::Runtime::new().unwrap();
    let config = EtcdConfig {
        endpoints: vec![etcd.endpoint()],
        cluster: CLUSTER.into(),
        ..EtcdConfig::default()
    };
    let discovery = rt
        .block_on(EtcdDiscovery::connect(config.clone()))
        .expect("the test's own etcd client");
    let index = rt
        .block_on(EtcdPrefixIndex::connect(config))
        .expect("the test's own prefix index");
    rt.block_on(await_membership(&discovery, 1, 2, START_TIMEOUT));
    let all = [&prefill, &stays, &switched, &router];
    await_health(router_addr, &all);
    let ready = started.elapsed();
    let b = decode_addrs[1].to_string();
    let served = |role| rt.block_on(requests_served(&b, role));
    // Requests holding KV on the switched node, whatever its role.
    let running = || {
        let health = rt.block_on(node_health(&b, NodeRole::Decode, None));
        health.load.map_or(0, |l| l.running)
    };
    let role = || rt.block_on(node_health(&b, NodeRole::Decode, None)).role();

    let progress = Progress::default();
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let long_sent = AtomicBool::new(false);
    let outcomes: Mutex<Vec<(usize, Outcome)>> = Mutex::new(Vec::new());
    let mut switch_times = Vec::new();
    std::thread::scope(|s| {
        // The clients stop when this closure ends: after the checks below, or at the first
        // that fails (which then fails the test instead of waiting on clients for ever).
        let _stop = RaiseOnDrop([&stop, &long_sent]);
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
        // Decode -> prefill, with streams open on the node.
        progress.wait_for(CLIENTS * 2, Duration::from_secs(60));
        let held = await_value(
            "blocks the decode node announces",
            || index.node_blocks(switched_id),
            |&n| n > 0,
        );
        assert!(
            served(NodeRole::Decode) > 0,
            "the decode node served nothing before its switch"
        );
        await_value("streams open on the decode node", running, |&n| n > 0);
        let t = Instant::now();
        let (ok, out) = kvmesh_node(&["switch-role", "--addr", &b, "--to", "prefill"]);
        switch_times.push(t.elapsed());
        assert!(ok && out.contains("serves prefill now"), "{out}");
        assert!(!out.contains("drain timeout"), "{out}");
        await_role(&rt, &discovery, switched_id, NodeRole::Prefill, (2, 1));
        let decoded = served(NodeRole::Decode);
        // Same pool, announced again under the new registration (no request needed it).
        await_value(
            "blocks announced after the switch",
            || index.node_blocks(switched_id),
            |&n| n >= held,
        );
        // The router sends it prompts to prefill.
        await_value(
            "prefills on the switched node",
            || served(NodeRole::Prefill),
            |&n| n > 0,
        );
        let (ok, out) = kvmesh_node(&["switch-role", "--addr", &b, "--to", "prefill"]);
        assert!(ok && out.contains("nothing to do"), "{out}");

        // Prefill -> decode, with a prompt in flight: long prompts (several engine steps
        // each) until the node has one running; the others go to the other prefill node.
        let long_client = s.spawn(|| {
            for i in LONG.. {
                if long_sent.load(Ordering::Relaxed) {
                    return;
                }
                let o = stream_completion(router_addr, &body(i, true));
                outcomes.lock().unwrap().push((i, o));
            }
        });
        await_value("prefills running on the node", running, |&n| n > 0);
        let t = Instant::now();
        let back = s.spawn(|| kvmesh_node(&["switch-role", "--addr", &b, "--to", "decode"]));
        // While the node finishes its prefills, a second switch is refused.
        await_value("the node switching", role, |&r| {
            r == pb::NodeRole::Unspecified
        });
        let (ok, out) = kvmesh_health(switched_metrics);
        assert!(
            !ok && out.contains("503") && out.contains("switching from prefill to decode"),
            "{out}"
        );
        let refused = rt.block_on(switch_rpc(&b, NodeRole::Prefill)).unwrap_err();
        assert_eq!(refused.code(), Code::FailedPrecondition, "{refused}");
        assert!(refused.message().contains("in progress"), "{refused}");
        let (ok, out) = back.join().unwrap();
        switch_times.push(t.elapsed());
        long_sent.store(true, Ordering::Relaxed);
        assert!(ok && out.contains("serves decode now"), "{out}");
        assert!(!out.contains("drain timeout"), "{out}");
        long_client.join().unwrap();
        await_role(&rt, &discovery, switched_id, NodeRole::Decode, (1, 2));
        let (ok, out) = kvmesh_node(&["status", "--addr", &b]);
        assert!(ok && out.contains(&format!("at {b}: decode;")), "{out}");
        let (ok, out) = kvmesh_health(switched_metrics);
        assert!(ok && out.trim() == "serving decode", "{out}");
        await_value(
            "decodes on the node switched back",
            || served(NodeRole::Decode),
            |&n| n > decoded,
        );
        progress.wait_for(progress.count() + CLIENTS * 2, Duration::from_secs(60));
    });
    assert!(
        switched.child.try_wait().unwrap().is_none(),
        "the switched node's process exited"
    );

    // Every request completed with its greedy text: the same prompt on the idle mesh.
    let mut outcomes = outcomes.into_inner().unwrap();
    outcomes.sort_by_key(|(i, _)| *i);
    let mut wrong = Vec::new();
    for (i, o) in &outcomes {
        let (status, v) = post(router_addr, "/v1/completions", &body(*i, false));
        assert_eq!(status, 200, "reference {i}: {v}");
        let expected = v["choices"][0]["text"].as_str().unwrap();
        if o.status != 200 || o.error.is_some() || o.finish.is_none() || o.text != expected {
            wrong.push(format!(
                "request {i}: status {} error {:?} finish {:?}\n  got:      {:?}\n  expected: {:?}",
                o.status, o.error, o.finish, o.text, expected
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "lost or changed requests:\n{}",
        wrong.join("\n")
    );

    let metrics = get(switched_metrics, "/metrics");
    let value = |name, label| sample(&metrics, name, label);
    assert_eq!(
        value("kvmesh_node_model_loads_total", ""),
        1.0,
        "the switches loaded the model again:\n{metrics}"
    );
    assert_eq!(
        value("kvmesh_node_role_switches_total", "to=\"prefill\""),
        1.0
    );
    assert_eq!(
        value("kvmesh_node_role_switches_total", "to=\"decode\""),
        1.0
    );
    assert_eq!(value("kvmesh_node_role", "role=\"decode\""), 1.0);
    assert_eq!(value("kvmesh_node_role", "role=\"prefill\""), 0.0);
    let router_metrics = get(router_addr, "/metrics");
    let migrations = sample(&router_metrics, "kvmesh_router_migrations_total", "");
    let retries = sample(&router_metrics, "kvmesh_router_decode_retries_total", "");
    println!(
        "role_switch: mesh ready in {:.1} s; {} streamed requests; switches took {:?} \
         (decode -> prefill, prefill -> decode); {migrations} migrations, {retries} retries; \
         test {:.1} s",
        ready.as_secs_f64(),
        outcomes.len(),
        switch_times,
        started.elapsed().as_secs_f64()
    );
    // The switched node finished its streams itself: none had to move to another node.
    assert_eq!(migrations, 0.0, "streams were cut by a switch");

    // A node started as a prefill node becomes a decode node too (with the decode
    // defaults), and the router sends it requests: the mesh is three decode nodes now.
    let p = prefill_addr.to_string();
    let (ok, out) = kvmesh_node(&["switch-role", "--addr", &p, "--to", "decode"]);
    assert!(ok && out.contains("serves decode now"), "{out}");
    rt.block_on(await_membership(&discovery, 0, 3, Duration::from_secs(10)));
    for (i, o) in outcomes.iter().take(6) {
        let (status, v) = post(router_addr, "/v1/completions", &body(*i, false));
        assert_eq!(
            status, 200,
            "request {i} after the prefill node's switch: {v}"
        );
        assert_eq!(
            v["choices"][0]["text"].as_str().unwrap(),
            o.text,
            "request {i}"
        );
    }
    let decoded = rt.block_on(requests_served(&p, NodeRole::Decode));
    assert!(
        decoded > 0,
        "the router sent nothing to the former prefill node"
    );

    // etcd away during a switch: the node serves its new role's calls at once, keeps trying
    // to register, and is in the mesh as soon as etcd is back.
    etcd.stop().expect("etcd stops");
    let back = {
        let p = p.clone();
        std::thread::spawn(move || kvmesh_node(&["switch-role", "--addr", &p, "--to", "prefill"]))
    };
    let role_of = |addr: &str| {
        rt.block_on(node_health(addr, NodeRole::Decode, None))
            .role()
    };
    await_value(
        "the switched node waiting for etcd",
        || role_of(&p),
        |&r| r == pb::NodeRole::Prefill,
    );
    etcd.restart().expect("etcd restarts");
    let (ok, out) = back.join().unwrap();
    assert!(ok && out.contains("serves prefill now"), "{out}");
    let p_id = rt
        .block_on(node_health(&p, NodeRole::Prefill, None))
        .node_id;
    await_role(&rt, &discovery, NodeId(p_id), NodeRole::Prefill, (1, 2));

    rt.block_on(a_draining_node_refuses_a_switch(&b));
    let exit = switched.child.wait().unwrap();
    assert!(exit.success(), "the drained node exits cleanly: {exit}");
}

/// `Node.SwitchRole` over gRPC.
async fn switch_rpc(addr: &str, to: NodeRole) -> Result<pb::SwitchRoleReply, tonic::Status> {
    let channel = grpc_endpoint(addr, None)
        .unwrap()
        .connect()
        .await
        .expect("the node answers");
    let to = kvmesh_common::grpc::node_role_to_pb(to) as i32;
    pb::node_client::NodeClient::new(channel)
        .switch_role(pb::SwitchRoleRequest { to })
        .await
        .map(tonic::Response::into_inner)
}

/// With a long stream open on the decode node at `addr`, a `Drain` and then a switch: the
/// switch is refused, and the stream still runs to its end before the node exits.
async fn a_draining_node_refuses_a_switch(addr: &str) {
    let channel = grpc_endpoint(addr, None)
        .unwrap()
        .connect()
        .await
        .expect("the node answers");
    let mut decode = pb::decode_client::DecodeClient::new(channel);
    let request = GenerateRequest {
        request_id: RequestId(77),
        prompt: (0..40).map(|i| 1000 + i * 37).collect(),
        params: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(200)
        },
        resume: Vec::new(),
    };
    let call = generate_request_to_pb(&request, &Placement::default());
    let mut events = decode.generate(call).await.expect("generate").into_inner();
    let first = events.message().await.expect("an event");
    assert!(first.is_some(), "the stream started");
    decode.drain(pb::DrainRequest {}).await.expect("drain");
    let refused = switch_rpc(addr, NodeRole::Prefill).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused}");
    assert!(
        refused.message().contains("draining for shutdown"),
        "{refused}"
    );
    let mut tokens = 1;
    let mut finished = false;
    while let Some(event) = events.message().await.expect("the stream goes on") {
        match event.event {
            Some(pb::generate_event::Event::Token(_)) => tokens += 1,
            Some(pb::generate_event::Event::Finished(_)) => finished = true,
            other => panic!("unexpected event {other:?}"),
        }
    }
    assert!(
        finished && tokens == 200,
        "{tokens} tokens, finished: {finished}"
    );
}

#[test]
fn bad_switch_requests_get_clear_errors() {
    let (ok, out) = kvmesh_node(&["switch-role", "--addr", "127.0.0.1:1", "--to", "router"]);
    assert!(
        !ok && out.contains("possible values: prefill, decode"),
        "{out}"
    );
    let (ok, out) = kvmesh_node(&["switch-role", "--addr", "127.0.0.1:1", "--to", "decode"]);
    assert!(
        !ok && out.contains("connecting to the node at 127.0.0.1:1"),
        "{out}"
    );
    let (ok, out) = kvmesh_node(&["status", "--addr", "not an address"]);
    assert!(!ok && out.contains("is not a node address"), "{out}");
}
