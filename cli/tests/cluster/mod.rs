//! Shared by the multi-process tests: starting `kvmesh` node processes on loopback
//! addresses, plain HTTP/1.1 and gRPC probes, and waiting for health and membership.

#![allow(dead_code)]

use kvmesh_common::grpc::{self, pb, Placement};
use kvmesh_common::tls::{grpc_endpoint, ClusterTls};
use kvmesh_common::{GenerateRequest, NodeRole, RequestId, SamplingParams};
use kvmesh_kvstore::{Discovery, EtcdDiscovery};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

pub const LEASE_TTL: Duration = Duration::from_secs(2);
pub const START_TIMEOUT: Duration = Duration::from_secs(120);
pub const MODEL_NAME: &str = "SmolLM2-135M-Instruct";

/// A free TCP port on `ip`, never one handed out before in this test (the node also binds UDP
/// on it; that is free too in practice).
pub fn free_addr(ip: &str) -> SocketAddr {
    kvmesh_common::net::free_addr(ip).expect("bind a loopback address")
}

pub struct Node {
    pub child: Child,
    pub args: Vec<String>,
    pub log: std::path::PathBuf,
    /// The network namespace it runs in (`None`: the test's own).
    pub netns: Option<String>,
}

impl Node {
    pub fn spawn(args: Vec<String>, log: std::path::PathBuf) -> Node {
        Self::spawn_in(None, args, log)
    }

    /// Spawns the node in network namespace `netns` (`ip netns exec`, which execs it: the
    /// child is the node itself), or in this one.
    pub fn spawn_in(netns: Option<&str>, args: Vec<String>, log: std::path::PathBuf) -> Node {
        let out = std::fs::File::create(&log).expect("log file");
        let bin = env!("CARGO_BIN_EXE_kvmesh");
        let mut command = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, bin]);
                c
            }
            None => Command::new(bin),
        };
        let child = command
            .args(&args)
            .env("KVMESH_LOG", "info")
            .env_remove("KVMESH_DECODE_WORKERS")
            .env_remove("KVMESH_CONFIG")
            .stdout(Stdio::null())
            .stderr(out)
            .spawn()
            .expect("kvmesh starts");
        Node {
            child,
            args,
            log,
            netns: netns.map(String::from),
        }
    }

    pub fn restart(&mut self) {
        // Reopening the log truncates it: keep what the first run wrote.
        let _ = std::fs::copy(&self.log, self.log.with_extension("log.1"));
        *self = Node::spawn_in(self.netns.as_deref(), self.args.clone(), self.log.clone());
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// POSTs JSON over plain HTTP/1.1 and returns (status, body).
pub fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let body = body.to_string();
    let mut s = TcpStream::connect(addr).expect("connect to the router");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    s.read_to_string(&mut response).expect("a response");
    let (head, body) = response.split_once("\r\n\r\n").expect("HTTP response");
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

/// The body of a GET.
pub fn get(addr: SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut r = String::new();
    s.read_to_string(&mut r).unwrap();
    r.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default()
}

pub fn health_ok(addr: SocketAddr) -> bool {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return false;
    };
    let _ = write!(
        s,
        "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    );
    let mut r = String::new();
    let _ = s.read_to_string(&mut r);
    r.starts_with("HTTP/1.1 200")
}

/// Waits for `addr`'s /health to answer 200.
pub fn await_health(addr: SocketAddr, nodes: &[&Node]) {
    let deadline = Instant::now() + START_TIMEOUT;
    while !health_ok(addr) {
        assert!(
            Instant::now() < deadline,
            "no healthy server at {addr}; logs:\n{}",
            nodes
                .iter()
                .map(|n| n.log_tail())
                .collect::<Vec<_>>()
                .join("\n---\n")
        );
        // Polling an HTTP endpoint that gives no push signal; bounded by the deadline.
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A node's gRPC `Health` reply (over mutual TLS with `tls`).
pub async fn node_health(
    address: &str,
    role: NodeRole,
    tls: Option<&ClusterTls>,
) -> pb::HealthReply {
    let channel = grpc_endpoint(address, tls)
        .expect("a node address")
        .connect()
        .await
        .expect("the node answers");
    let request = tonic::Request::new(pb::HealthRequest {});
    let reply = match role {
        NodeRole::Prefill => {
            pb::prefill_client::PrefillClient::new(channel)
                .health(request)
                .await
        }
        _ => {
            pb::decode_client::DecodeClient::new(channel)
                .health(request)
                .await
        }
    };
    reply.expect("health").into_inner()
}

pub async fn requests_served(address: &str, role: NodeRole) -> u64 {
    node_health(address, role, None).await.requests_total
}

/// A cluster CA and one certificate every node shares (`node.pem`, `node.key`, made by
/// `kvmesh certs --shared` in `dir`, as for replicas), and the flags that make a node use them.
pub fn cluster_certs(dir: &std::path::Path) -> (ClusterTls, Vec<String>) {
    let ok = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args(["certs", "--shared", "--out"])
        .arg(dir)
        .status()
        .expect("kvmesh certs runs")
        .success();
    assert!(ok, "kvmesh certs failed");
    let path = |f: &str| dir.join(f);
    let tls = ClusterTls::load(&path("ca.pem"), &path("node.pem"), &path("node.key"))
        .expect("the certificates load");
    let flags = [
        ("--tls-ca", "ca.pem"),
        ("--tls-cert", "node.pem"),
        ("--tls-key", "node.key"),
    ]
    .into_iter()
    .flat_map(|(flag, f)| [flag.to_string(), path(f).display().to_string()])
    .collect();
    (tls, flags)
}

/// The arguments of a mesh node: `role` listening on `addr`, in `cluster` on `etcd`, one
/// compute thread and a short lease (so a killed node leaves membership quickly).
pub fn mesh_args(role: &str, addr: SocketAddr, etcd: &str, cluster: &str) -> Vec<String> {
    let addr = addr.to_string();
    [
        role,
        "--etcd",
        etcd,
        "--listen",
        &addr,
        "--cluster",
        cluster,
        "--threads",
        "1",
        "--lease-ttl",
        "2s",
    ]
    .map(String::from)
    .to_vec()
}

/// Waits until discovery shows `prefill` and `decode` nodes; returns how long it took.
pub async fn await_membership(
    discovery: &EtcdDiscovery,
    prefill: usize,
    decode: usize,
    within: Duration,
) -> Duration {
    let start = Instant::now();
    let mut changes = discovery.subscribe();
    loop {
        let (p, d) = (
            discovery.nodes(NodeRole::Prefill).len(),
            discovery.nodes(NodeRole::Decode).len(),
        );
        if p == prefill && d == decode {
            return start.elapsed();
        }
        let left = within.saturating_sub(start.elapsed());
        let changed = tokio::time::timeout(left, changes.changed()).await;
        assert!(
            matches!(changed, Ok(Ok(()))),
            "membership stayed at {p} prefill / {d} decode; wanted {prefill} / {decode}"
        );
    }
}

/// What a client saw of one streamed request.
pub struct Outcome {
    pub status: u16,
    pub text: String,
    pub finish: Option<String>,
    /// Set when the stream carried an error or ended without `[DONE]`.
    pub error: Option<String>,
    /// When each SSE data event arrived.
    pub events: Vec<Instant>,
}

/// POSTs a streaming completion and reads its SSE events (HTTP/1.1, chunked) as they come.
/// A router that cannot be reached or whose connection breaks gives an outcome with the
/// error (status 0 when no status line came).
pub fn stream_completion(addr: SocketAddr, body: &Value) -> Outcome {
    let mut out = Outcome {
        status: 0,
        text: String::new(),
        finish: None,
        error: None,
        events: Vec::new(),
    };
    if let Err(e) = read_stream(addr, body, &mut out) {
        out.error.get_or_insert(e);
    }
    out
}

fn read_stream(addr: SocketAddr, body: &Value, out: &mut Outcome) -> Result<(), String> {
    let body = body.to_string();
    let mut conn = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    conn.set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    write!(
        conn,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| format!("send: {e}"))?;
    let broken = |e: std::io::Error| format!("the connection broke: {e}");
    let mut r = BufReader::new(conn);
    let mut line = String::new();
    r.read_line(&mut line).map_err(broken)?;
    out.status = line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status line: {line:?}"))?;
    let mut chunked = false;
    loop {
        line.clear();
        if r.read_line(&mut line).map_err(broken)? == 0 {
            return Err("the connection closed in the headers".into());
        }
        if line == "\r\n" {
            break;
        }
        chunked |= line
            .to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked");
    }
    if out.status != 200 || !chunked {
        let mut text = String::new();
        r.read_to_string(&mut text).unwrap_or_default();
        return Err(text);
    }
    let (mut pending, mut done) = (String::new(), false);
    loop {
        line.clear();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            break;
        }
        let size = usize::from_str_radix(line.trim(), 16)
            .map_err(|_| format!("not a chunk size: {line:?}"))?;
        if size == 0 {
            break;
        }
        let mut chunk = vec![0; size + 2];
        r.read_exact(&mut chunk).map_err(broken)?;
        pending.push_str(std::str::from_utf8(&chunk[..size]).expect("UTF-8 SSE"));
        while let Some(end) = pending.find("\n\n") {
            let event: String = pending.drain(..end + 2).collect();
            for data in event.lines().filter_map(|l| l.strip_prefix("data: ")) {
                out.events.push(Instant::now());
                if data == "[DONE]" {
                    done = true;
                    continue;
                }
                let v: Value = serde_json::from_str(data).expect("JSON event");
                if let Some(e) = v.get("error") {
                    out.error = Some(e.to_string());
                    continue;
                }
                let choice = &v["choices"][0];
                out.text
                    .push_str(choice["text"].as_str().unwrap_or_default());
                if let Some(f) = choice["finish_reason"].as_str() {
                    out.finish = Some(f.to_string());
                }
            }
        }
    }
    if !done && out.error.is_none() {
        return Err("the stream ended without [DONE]".into());
    }
    Ok(())
}

/// Sets its flag when dropped: a test's clients stop when its driver returns or fails.
pub struct StopOnDrop<'a>(pub &'a std::sync::atomic::AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// How many requests have completed; a test's driver waits on it.
#[derive(Default)]
pub struct Progress {
    done: Mutex<usize>,
    changed: Condvar,
}

impl Progress {
    pub fn complete_one(&self) {
        *self.done.lock().unwrap() += 1;
        self.changed.notify_all();
    }

    pub fn count(&self) -> usize {
        *self.done.lock().unwrap()
    }

    /// Waits until `n` requests have completed; fails if that takes longer than `within`.
    pub fn wait_for(&self, n: usize, within: Duration) {
        let done = self.done.lock().unwrap();
        let (_done, timeout) = self
            .changed
            .wait_timeout_while(done, within, |d| *d < n)
            .unwrap();
        assert!(!timeout.timed_out(), "requests stopped completing");
    }
}

/// Waits until the node at `addr` runs and queues nothing and holds no KV block (its
/// requests' KV freed), failing after 20 s.
pub fn await_empty_pool(
    rt: &tokio::runtime::Runtime,
    addr: SocketAddr,
    role: NodeRole,
    tls: Option<&ClusterTls>,
) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let load = rt
            .block_on(node_health(&addr.to_string(), role, tls))
            .load
            .unwrap_or_default();
        if load.running == 0 && load.waiting == 0 && load.kv_blocks_used == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{addr} ({role:?}) kept {load:?}: KV stranded"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Sends `signal` (`-STOP`, `-CONT`, `-KILL`, ...) to `node`'s process.
pub fn signal(node: &Node, signal: &str) {
    let ok = Command::new("kill")
        .args([signal, &node.child.id().to_string()])
        .status()
        .expect("kill runs")
        .success();
    assert!(ok, "kill {signal} failed");
}

/// The test's own view of `cluster`'s discovery in the etcd at `endpoint`.
pub fn discovery(rt: &tokio::runtime::Runtime, endpoint: &str, cluster: &str) -> EtcdDiscovery {
    rt.block_on(EtcdDiscovery::connect(kvmesh_kvstore::EtcdConfig {
        endpoints: vec![endpoint.to_string()],
        cluster: cluster.into(),
        ..Default::default()
    }))
    .expect("the test's own etcd client")
}

/// Sends a `Generate` with a token id past any vocabulary straight to the decode node at
/// `addr`; returns how the call (or its stream) failed.
pub async fn poison(addr: SocketAddr, tls: Option<&ClusterTls>) -> tonic::Status {
    let channel = grpc_endpoint(&addr.to_string(), tls)
        .unwrap()
        .connect()
        .await
        .expect("the decode node answers");
    let request = GenerateRequest {
        request_id: RequestId(0xbad),
        prompt: vec![1, 2, u32::MAX - 1, 3],
        params: SamplingParams::greedy(8),
        resume: Vec::new(),
    };
    let call = pb::decode_client::DecodeClient::new(channel)
        .generate(grpc::generate_request_to_pb(
            &request,
            &Placement::default(),
        ))
        .await;
    let mut stream = match call {
        Err(status) => return status,
        Ok(stream) => stream.into_inner(),
    };
    // Accepted: what the stream then says.
    loop {
        match stream.message().await {
            Err(status) => return status,
            Ok(None) => return tonic::Status::ok("the stream ended"),
            Ok(Some(event)) => {
                if let Some(pb::generate_event::Event::Error(e)) = event.event {
                    return tonic::Status::internal(format!("accepted, then failed: {e:?}"));
                }
            }
        }
    }
}

/// The chaos tests' mesh: etcd, a router (round robin), two prefill and three decode
/// processes under mutual TLS, prompts of 32 tokens or more prefilled on prefill nodes;
/// started, registered and healthy. Logs under the test target's `name/`.
pub struct ChaosMesh {
    pub etcd: kvmesh_kvstore::EtcdServer,
    pub tls: ClusterTls,
    pub router_addr: SocketAddr,
    pub prefill_addrs: [SocketAddr; 2],
    pub decode_addrs: [SocketAddr; 3],
    pub prefill: Vec<Node>,
    pub decode: Vec<Node>,
    pub router: Node,
    pub rt: tokio::runtime::Runtime,
    pub discovery: EtcdDiscovery,
}

impl ChaosMesh {
    pub fn start(name: &str) -> ChaosMesh {
        let etcd = kvmesh_kvstore::EtcdServer::start()
            .expect("etcd starts (scripts/setup.sh installs it)");
        let logs = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
        std::fs::create_dir_all(&logs).unwrap();
        let log = |node: &str| logs.join(format!("{node}.log"));
        let certs = logs.join("certs");
        let _ = std::fs::remove_dir_all(&certs);
        let (tls, tls_flags) = cluster_certs(&certs);
        let endpoint = etcd.endpoint();
        let args = |role: &str, addr| {
            let mut a = mesh_args(role, addr, &endpoint, name);
            a.extend(tls_flags.iter().cloned());
            if role != "prefill" {
                a.extend(["--local-prefill-max-tokens".into(), "32".into()]);
            }
            a
        };
        let router_addr = free_addr("127.0.0.2");
        let prefill_addrs = [free_addr("127.0.0.3"), free_addr("127.0.0.4")];
        let decode_addrs = [
            free_addr("127.0.0.5"),
            free_addr("127.0.0.6"),
            free_addr("127.0.0.8"),
        ];
        let prefill: Vec<Node> = (0..2)
            .map(|i| {
                Node::spawn(
                    args("prefill", prefill_addrs[i]),
                    log(&format!("prefill{i}")),
                )
            })
            .collect();
        let decode: Vec<Node> = (0..3)
            .map(|i| Node::spawn(args("decode", decode_addrs[i]), log(&format!("decode{i}"))))
            .collect();
        let mut router_args = args("router", router_addr);
        // Round robin spreads repeats of a prompt over the decode nodes.
        router_args.extend(["--routing-policy".into(), "round_robin".into()]);
        let router = Node::spawn(router_args, log("router"));

        let rt = tokio::runtime::Runtime::new().unwrap();
        let discovery = discovery(&rt, &etcd.endpoint(), name);
        rt.block_on(await_membership(&discovery, 2, 3, START_TIMEOUT));
        let all: Vec<&Node> = prefill.iter().chain(&decode).chain([&router]).collect();
        await_health(router_addr, &all);
        ChaosMesh {
            etcd,
            tls,
            router_addr,
            prefill_addrs,
            decode_addrs,
            prefill,
            decode,
            router,
            rt,
            discovery,
        }
    }
}

/// [`await_load`] until one of the decode nodes at `addrs` is streaming a request.
pub fn await_streaming(
    rt: &tokio::runtime::Runtime,
    addrs: &[SocketAddr],
    tls: Option<&ClusterTls>,
) -> usize {
    await_load(rt, addrs, NodeRole::Decode, tls, |l| l.running > 0)
}

/// Waits (polling gRPC health; nodes push nothing) until the load of one of `addrs` meets
/// `busy`; returns its index. Fails after 60 s, with what each node reported.
pub fn await_load(
    rt: &tokio::runtime::Runtime,
    addrs: &[SocketAddr],
    role: NodeRole,
    tls: Option<&ClusterTls>,
    busy: impl Fn(&pb::LoadReport) -> bool,
) -> usize {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        for (i, addr) in addrs.iter().enumerate() {
            let h = rt.block_on(node_health(&addr.to_string(), role, tls));
            if h.load.as_ref().is_some_and(&busy) {
                return i;
            }
        }
        if Instant::now() > deadline {
            let seen: Vec<_> = addrs
                .iter()
                .map(|a| rt.block_on(node_health(&a.to_string(), role, tls)))
                .map(|h| (h.requests_total, h.load))
                .collect();
            panic!("none of {addrs:?} ({role:?}) was seen busy: {seen:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
