//! Migration in `RemoteBackend`: when a decode node's stream breaks mid-request (an error, or
//! the node vanishing with its connections), the request moves to another decode node with
//! the tokens delivered so far, and the caller's stream goes on without a gap or a repeat.
//!
//! The decode nodes here are scripted gRPC servers (real tonic servers on loopback), so the
//! test controls exactly when and how a stream breaks.

use async_trait::async_trait;
use kvmesh_common::grpc::{self, pb};
use kvmesh_common::{
    FinishReason, GenerateEvent, GenerateRequest, ModelFingerprint, NodeId, NodeInfo, NodeRole,
    RequestId, SamplingParams, TokenEvent, Usage,
};
use kvmesh_kvstore::{InMemoryDiscovery, InMemoryPrefixIndex};
use kvmesh_router::policy::{DisaggConfig, RoutingConfig};
use kvmesh_router::routing::Routing;
use kvmesh_router::{Backend, MeshBackendConfig, RemoteBackend, RemoteConfig, StreamIdleConfig};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

const MAX_TOKENS: u32 = 10;

/// How a scripted node ends its streams.
#[derive(Clone, Copy)]
enum Script {
    /// Continues after `resume` and finishes.
    Serve,
    /// Sends `n` tokens, then fails the stream with this status code.
    FailAfter(usize, tonic::Code),
    /// Sends `n` tokens, then hangs until its process (runtime) is torn down.
    HangAfter(usize),
    /// Refuses its first request with UNAVAILABLE (as a node leaving the decode role does),
    /// then serves.
    RefuseFirst,
}

/// Token `i` of every request's answer: what a deterministic model would say.
fn token(i: usize) -> TokenEvent {
    TokenEvent {
        token: 100 + i as u32,
        text: format!("w{i} "),
        logprob: None,
        top_logprobs: Vec::new(),
    }
}

struct ScriptedNode {
    script: Script,
    requests: Arc<Mutex<Vec<GenerateRequest>>>,
}

type EventStream =
    Pin<Box<dyn futures::Stream<Item = Result<pb::GenerateEvent, Status>> + Send + 'static>>;

#[async_trait]
impl pb::decode_server::Decode for ScriptedNode {
    type GenerateStream = EventStream;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let (req, _) = grpc::generate_request_from_pb(request.into_inner())?;
        let start = req.resume.len();
        let max = req.params.max_tokens as usize;
        let first = {
            let mut requests = self.requests.lock().unwrap();
            requests.push(req);
            requests.len() == 1
        };
        let script = self.script;
        if matches!(script, Script::RefuseFirst) && first {
            return Err(Status::unavailable("this node serves prefill now"));
        }
        let stream = async_stream::stream! {
            let stop = match script {
                Script::Serve | Script::RefuseFirst => max,
                Script::FailAfter(n, _) | Script::HangAfter(n) => (start + n).min(max),
            };
            for i in start..stop {
                yield Ok(pb::GenerateEvent::from(&GenerateEvent::Token(token(i))));
            }
            match script {
                Script::Serve | Script::RefuseFirst => {
                    let finished = GenerateEvent::Finished {
                        reason: FinishReason::Length,
                        text: String::new(),
                        usage: Usage { prompt_tokens: 3, completion_tokens: max as u32, cached_tokens: 0 },
                    };
                    yield Ok(pb::GenerateEvent::from(&finished));
                }
                Script::FailAfter(_, code) => yield Err(Status::new(code, "scripted failure")),
                Script::HangAfter(_) => std::future::pending::<()>().await,
            }
        };
        Ok(Response::new(Box::pin(stream)))
    }

    async fn health(
        &self,
        _: Request<pb::HealthRequest>,
    ) -> Result<Response<pb::HealthReply>, Status> {
        Err(Status::unimplemented("scripted"))
    }

    async fn drain(
        &self,
        _: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::DrainReply>, Status> {
        Err(Status::unimplemented("scripted"))
    }
}

/// A scripted decode node in a runtime of its own, so that dropping it closes its sockets
/// as a dying process would.
struct Node {
    id: NodeId,
    addr: SocketAddr,
    requests: Arc<Mutex<Vec<GenerateRequest>>>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Node {
    fn start(id: u64, script: Script) -> Node {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let listener = {
            let _in_runtime = runtime.enter();
            tokio::net::TcpListener::from_std(listener).unwrap()
        };
        let addr = listener.local_addr().unwrap();
        let requests = Arc::default();
        let service = ScriptedNode {
            script,
            requests: Arc::clone(&requests),
        };
        runtime.spawn(
            tonic::transport::Server::builder()
                .add_service(pb::decode_server::DecodeServer::new(service))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        Node {
            id: NodeId(id),
            addr,
            requests,
            runtime: Some(runtime),
        }
    }

    /// Ends the node's runtime: every task and connection of it is gone at once.
    fn kill(&mut self) {
        self.runtime.take().unwrap().shutdown_background();
    }

    fn requests(&self) -> Vec<GenerateRequest> {
        self.requests.lock().unwrap().clone()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

fn info(n: &Node) -> NodeInfo {
    NodeInfo {
        node_id: n.id,
        role: NodeRole::Decode,
        address: n.addr.to_string(),
        transfer_address: String::new(),
        model_fingerprint: ModelFingerprint(1),
        block_size: 16,
        kv_blocks_total: 100,
    }
}

fn backend(nodes: &[&Node], config: RemoteConfig) -> RemoteBackend {
    backend_on(Arc::new(InMemoryDiscovery::new()), nodes, config)
}

/// A backend over `discovery`, with `nodes` registered in it as decode nodes.
fn backend_on(
    discovery: Arc<InMemoryDiscovery>,
    nodes: &[&Node],
    config: RemoteConfig,
) -> RemoteBackend {
    for n in nodes {
        discovery.register(info(n)).unwrap();
    }
    // Round robin from the first registered node: the tests pick who serves first by order.
    let routing = Routing::new(
        "round_robin".parse::<RoutingConfig>().unwrap().build(),
        DisaggConfig::default(),
        Arc::new(InMemoryPrefixIndex::new()),
        ModelFingerprint(1),
    );
    RemoteBackend::new(discovery, config, routing)
}

fn request() -> GenerateRequest {
    GenerateRequest {
        request_id: RequestId(7),
        prompt: vec![1, 2, 3],
        params: SamplingParams::greedy(MAX_TOKENS),
        resume: Vec::new(),
    }
}

/// Every event until the stream's last one.
async fn collect(mut rx: mpsc::UnboundedReceiver<GenerateEvent>) -> Vec<GenerateEvent> {
    let mut events = Vec::new();
    while let Some(e) = tokio::time::timeout(Duration::from_secs(20), rx.recv())
        .await
        .expect("the stream must end, not hang")
    {
        let last = !matches!(e, GenerateEvent::Token(_));
        events.push(e);
        if last {
            break;
        }
    }
    events
}

fn assert_whole_answer(events: &[GenerateEvent]) {
    let tokens: Vec<TokenEvent> = events
        .iter()
        .filter_map(|e| match e {
            GenerateEvent::Token(t) => Some(t.clone()),
            _ => None,
        })
        .collect();
    let expected: Vec<TokenEvent> = (0..MAX_TOKENS as usize).map(token).collect();
    assert_eq!(tokens, expected, "a gap or a repeat in the stream");
    assert!(
        matches!(events.last(), Some(GenerateEvent::Finished { .. })),
        "ends with {:?}",
        events.last()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_fails_mid_request_continues_on_another_node() {
    let a = Node::start(1, Script::FailAfter(4, tonic::Code::Internal));
    let b = Node::start(2, Script::FailAfter(4, tonic::Code::Internal));
    let c = Node::start(3, Script::Serve);
    let backend = backend(&[&a, &b, &c], RemoteConfig::default());
    let events = collect(backend.generate(request()).await.unwrap()).await;
    assert_whole_answer(&events);
    let mut resumes: Vec<usize> = [&a, &b, &c]
        .iter()
        .flat_map(|n| n.requests())
        .map(|r| r.resume.len())
        .collect();
    resumes.sort_unstable();
    // One or two breaks, by the order the nodes were picked in; each next node was asked
    // to go on after what the client already had.
    let expected: Vec<usize> = (0..resumes.len()).map(|k| 4 * k).collect();
    assert!(resumes.len() >= 2, "no migration: {resumes:?}");
    assert_eq!(resumes, expected);
    for n in [&a, &b, &c] {
        for r in n.requests() {
            let expected: Vec<u32> = (0..r.resume.len() as u32).map(|i| 100 + i).collect();
            assert_eq!(r.resume, expected);
            assert_eq!(r.params.max_tokens, MAX_TOKENS, "params travel unchanged");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_dies_mid_stream_loses_nothing() {
    let mut a = Node::start(1, Script::HangAfter(3));
    let mut b = Node::start(2, Script::HangAfter(3));
    let backend = backend(&[&a, &b], RemoteConfig::default());
    let mut rx = backend.generate(request()).await.unwrap();
    // Once the caller holds the first node's three tokens (none still in flight), kill
    // that node as kill -9 would.
    let mut events = receive_tokens(&mut rx, 3).await;
    let (dead, survivor) = if a.requests().is_empty() {
        (&mut b, &mut a)
    } else {
        (&mut a, &mut b)
    };
    dead.kill();
    // The survivor goes on after what the caller had, and hangs after three more tokens:
    // kill it too once those arrived.
    events.extend(receive_tokens(&mut rx, 3).await);
    let resumed = survivor.requests();
    assert_eq!(resumed.len(), 1);
    assert_eq!(resumed[0].resume, [100, 101, 102]);
    survivor.kill();
    // Both nodes are gone: the request ends with an error instead of hanging.
    events.extend(collect(rx).await);
    let tokens: Vec<u32> = events
        .iter()
        .filter_map(|e| match e {
            GenerateEvent::Token(t) => Some(t.token),
            _ => None,
        })
        .collect();
    assert_eq!(
        tokens,
        (100..106).collect::<Vec<_>>(),
        "each token once: {events:?}"
    );
    assert!(matches!(events.last(), Some(GenerateEvent::Error(_))));
}

/// The next `n` events, which must all be tokens.
async fn receive_tokens(
    rx: &mut mpsc::UnboundedReceiver<GenerateEvent>,
    n: usize,
) -> Vec<GenerateEvent> {
    let mut tokens = Vec::new();
    while tokens.len() < n {
        let e = tokio::time::timeout(Duration::from_secs(20), rx.recv())
            .await
            .expect("tokens must arrive")
            .expect("the stream must not end yet");
        assert!(
            matches!(e, GenerateEvent::Token(_)),
            "expected a token: {e:?}"
        );
        tokens.push(e);
    }
    tokens
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_stop_at_the_limit() {
    let nodes: Vec<Node> = (1..=4)
        .map(|i| Node::start(i, Script::FailAfter(1, tonic::Code::Unavailable)))
        .collect();
    let config = RemoteConfig {
        mesh: MeshBackendConfig {
            max_migrations: 2,
            ..MeshBackendConfig::default()
        },
        ..RemoteConfig::default()
    };
    let backend = backend(&nodes.iter().collect::<Vec<_>>(), config);
    let events = collect(backend.generate(request()).await.unwrap()).await;
    let asked: usize = nodes.iter().map(|n| n.requests().len()).sum();
    assert_eq!(asked, 3, "the first node and two migrations");
    assert_eq!(events.len(), 4, "three tokens and the error: {events:?}");
    assert!(matches!(events.last(), Some(GenerateEvent::Error(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_errors_are_not_migrated() {
    for code in [tonic::Code::DeadlineExceeded, tonic::Code::InvalidArgument] {
        let a = Node::start(1, Script::FailAfter(2, code));
        let b = Node::start(2, Script::Serve);
        let backend = backend(&[&a, &b], RemoteConfig::default());
        let events = collect(backend.generate(request()).await.unwrap()).await;
        assert_eq!(
            a.requests().len(),
            1,
            "round robin starts with the first node"
        );
        assert!(
            b.requests().is_empty(),
            "{code:?} was migrated: it is the request's failure, not the node's"
        );
        assert!(matches!(events.last(), Some(GenerateEvent::Error(_))));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_back_in_the_decode_role_is_routed_to_at_once() {
    let a = Node::start(1, Script::RefuseFirst);
    let discovery = Arc::new(InMemoryDiscovery::new());
    let backend = backend_on(discovery.clone(), &[&a], RemoteConfig::default());
    // It refuses, as a node switching roles does; with no other node the request fails.
    let refused = backend.generate(request()).await;
    assert!(
        refused.is_err(),
        "the only node refused, yet the request was taken"
    );
    // It leaves the decode role (a request meanwhile finds no node) and comes back...
    discovery.deregister(a.id).unwrap();
    assert!(backend.generate(request()).await.is_err());
    discovery.register(info(&a)).unwrap();
    // ...and serves the next request at once, not after the suspicion's 3 s.
    let events = collect(backend.generate(request()).await.unwrap()).await;
    assert_whole_answer(&events);
    assert_eq!(
        a.requests().len(),
        2,
        "the refusal and the request it served"
    );
}

/// A stream idle bound that only a hang well past it would meet: with it, what catches a
/// hung node in a test is HTTP/2 keepalive alone.
fn without_idle_bound() -> RemoteConfig {
    RemoteConfig {
        mesh: MeshBackendConfig {
            stream_idle: StreamIdleConfig {
                min: Duration::from_secs(60),
                ..StreamIdleConfig::default()
            },
            ..MeshBackendConfig::default()
        },
        ..RemoteConfig::default()
    }
}

/// The request's whole answer, which must come well before its 600 s deadline.
async fn answer_within(
    rx: mpsc::UnboundedReceiver<GenerateEvent>,
    start: std::time::Instant,
    bound: Duration,
) -> Vec<GenerateEvent> {
    let events = collect(rx).await;
    assert_whole_answer(&events);
    let took = start.elapsed();
    assert!(took < bound, "the hung node held the request {took:?}");
    events
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_hangs_mid_stream_with_its_process_alive_is_migrated() {
    // The node's process answers (keepalive PINGs too); only its stream goes quiet, as when
    // an engine thread wedges.
    let a = Node::start(1, Script::HangAfter(3));
    let b = Node::start(2, Script::Serve);
    let config = RemoteConfig {
        mesh: MeshBackendConfig {
            stream_idle: StreamIdleConfig {
                min: Duration::from_millis(300),
                ..StreamIdleConfig::default()
            },
            ..MeshBackendConfig::default()
        },
        ..RemoteConfig::default()
    };
    let backend = backend(&[&a, &b], config);
    let start = std::time::Instant::now();
    let rx = backend.generate(request()).await.unwrap();
    answer_within(rx, start, Duration::from_secs(5)).await;
    let resumed = b.requests();
    assert_eq!(resumed.len(), 1, "the hung node's request moved once");
    assert_eq!(resumed[0].resume, [100, 101, 102]);
}

/// A TCP relay in front of a node that can freeze: it then moves no byte either way but
/// keeps its sockets open, as the kernel does for a process stopped with SIGSTOP.
struct FreezingRelay {
    addr: SocketAddr,
    freeze: tokio::sync::watch::Sender<bool>,
}

impl FreezingRelay {
    async fn start(target: SocketAddr) -> FreezingRelay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (freeze, frozen) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let frozen = frozen.clone();
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(target).await else {
                        return;
                    };
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    tokio::spawn(Self::pipe(client_read, server_write, frozen.clone()));
                    Self::pipe(server_read, client_write, frozen).await;
                });
            }
        });
        FreezingRelay { addr, freeze }
    }

    async fn pipe(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        mut frozen: tokio::sync::watch::Receiver<bool>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut buf = vec![0; 1 << 16];
        loop {
            let read = tokio::select! {
                read = from.read(&mut buf) => read,
                _ = frozen.wait_for(|&f| f) => break,
            };
            let n = match read {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if *frozen.borrow() || to.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        // Frozen: hold both sockets open, silent, until the test ends.
        std::future::pending::<()>().await;
        drop((from, to));
    }

    fn freeze(&self) {
        self.freeze.send_replace(true);
    }
}

/// A backend whose first decode node is `a` reached through `relay`, then `b`.
fn backend_through(relay: &FreezingRelay, a: &Node, b: &Node) -> RemoteBackend {
    let discovery = Arc::new(InMemoryDiscovery::new());
    discovery
        .register(NodeInfo {
            address: relay.addr.to_string(),
            ..info(a)
        })
        .unwrap();
    backend_on(discovery, &[b], without_idle_bound())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalive_moves_a_stream_off_a_node_that_stopped_mid_stream() {
    let a = Node::start(1, Script::HangAfter(3));
    let b = Node::start(2, Script::Serve);
    let relay = FreezingRelay::start(a.addr).await;
    let backend = backend_through(&relay, &a, &b);
    let start = std::time::Instant::now();
    let mut rx = backend.generate(request()).await.unwrap();
    let mut events = receive_tokens(&mut rx, 3).await;
    relay.freeze();
    events.extend(collect(rx).await);
    assert_whole_answer(&events);
    let took = start.elapsed();
    assert!(
        took < Duration::from_secs(8),
        "the stopped node held the request {took:?}"
    );
    assert_eq!(b.requests()[0].resume, [100, 101, 102]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalive_moves_a_request_off_a_node_stopped_before_it_answered() {
    let a = Node::start(1, Script::Serve);
    let b = Node::start(2, Script::Serve);
    let relay = FreezingRelay::start(a.addr).await;
    // Stopped before the call: the kernel still accepts the connection, nothing answers.
    relay.freeze();
    let backend = backend_through(&relay, &a, &b);
    let start = std::time::Instant::now();
    let rx = backend.generate(request()).await.unwrap();
    answer_within(rx, start, Duration::from_secs(8)).await;
    assert!(a.requests().is_empty());
    assert_eq!(b.requests().len(), 1);
}
