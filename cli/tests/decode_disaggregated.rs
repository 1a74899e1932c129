//! The decode worker with a prefill worker on the real model: remote prefill gives exactly the
//! tokens a lone local run gives, under concurrency, cancellation, corrupt or lost KV and a
//! dead prefill worker.

mod workers;

use kvmesh_common::{metrics, NodeId, TokenId};
use kvmesh_decode::{DecodeConfig, DecodeWorker};
use kvmesh_prefill::{PrefillConfig, PrefillWorker};
use kvmesh_transfer::{InProcessTransport, KvChunk, KvReceiver, Transport, TransportError};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use workers::*;

/// Wraps the in-process transport: counts chunks, and corrupts or drops the `nth` one.
struct TestTransport {
    inner: InProcessTransport,
    sent: AtomicUsize,
    nth: usize,
    fault: Fault,
}

#[derive(Clone, Copy, PartialEq)]
enum Fault {
    None,
    Corrupt,
    Drop,
}

impl TestTransport {
    fn new(fault: Fault, nth: usize) -> Arc<Self> {
        Arc::new(TestTransport {
            inner: InProcessTransport::new(64),
            sent: AtomicUsize::new(0),
            nth,
            fault,
        })
    }

    fn sent(&self) -> usize {
        self.sent.load(Ordering::SeqCst)
    }
}

impl Transport for TestTransport {
    fn bind(&self, node: NodeId) -> Result<KvReceiver, TransportError> {
        self.inner.bind(node)
    }

    fn unbind(&self, node: NodeId) {
        self.inner.unbind(node)
    }

    fn send(
        &self,
        dest: NodeId,
        mut chunk: KvChunk,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let n = self.sent.fetch_add(1, Ordering::SeqCst);
        if n == self.nth {
            match self.fault {
                Fault::None => {}
                Fault::Corrupt => {
                    let mid = chunk.payload.len() / 2;
                    chunk.payload[mid] ^= 0x40;
                }
                Fault::Drop => return Ok(()),
            }
        }
        self.inner.send(dest, chunk, deadline)
    }
}

struct Pair {
    decode: DecodeWorker,
    prefill: PrefillWorker,
}

/// A decode worker `node` and a prefill worker `node + 1`. Each test uses its own node ids,
/// so the process-wide metrics tell the tests apart.
fn start(
    node: NodeId,
    transport: Arc<dyn Transport>,
    local_prefill_max_tokens: usize,
    timeout: Duration,
) -> Pair {
    let prefill_node = NodeId(node.0 + 1);
    let prefill = PrefillWorker::spawn(
        PrefillConfig::new(prefill_node),
        engine(),
        transport.clone(),
    )
    .unwrap();
    let config = DecodeConfig {
        local_prefill_max_tokens,
        remote_prefill_timeout: timeout,
        ..DecodeConfig::new(node)
    };
    let decode = DecodeWorker::spawn(config, engine(), transport).unwrap();
    Pair { decode, prefill }
}

/// The decode worker holds a prefix the prefill worker lacks (another prefill worker
/// computed it): the prefill worker pulls it from the decode worker rather than recompute it,
/// unless the decode worker's config says no; the tokens are the same either way.
#[test]
fn a_prefill_worker_pulls_the_prefix_the_decode_worker_holds() {
    for (base, prefill_pulls) in [(0x1400, true), (0x1500, false)] {
        let transport: Arc<dyn Transport> = Arc::new(InProcessTransport::new(256));
        let config = DecodeConfig {
            local_prefill_max_tokens: 32,
            prefill_pulls,
            ..DecodeConfig::new(NodeId(base))
        };
        let decode = DecodeWorker::spawn(config, engine(), transport.clone()).unwrap();
        let spawn = |i| {
            let config = PrefillConfig::new(NodeId(base + i));
            PrefillWorker::spawn(config, engine(), transport.clone()).unwrap()
        };
        let (p1, p2) = (spawn(1), spawn(2));
        let d = decode.handle();
        let first = request(1, prompt(9, 192), 4);
        collect(d.generate(first, Some(p1.handle().into())).unwrap());
        let mut long = prompt(9, 192);
        long.extend(prompt(10, 100));
        let second = request(2, long, 10);
        let (tokens, _, usage) = collect(
            d.generate(second.clone(), Some(p2.handle().into()))
                .unwrap(),
        );
        assert_eq!(usage.cached_tokens, 192);
        assert_eq!(tokens, reference(&second));
        let pulled = counter(metrics::WORKER_KV_PULLED_BLOCKS_TOTAL, NodeId(base + 2));
        assert_eq!(
            pulled,
            if prefill_pulls { 12 } else { 0 },
            "prefill_pulls {prefill_pulls}"
        );
    }
}

#[test]
fn a_remote_prefill_gives_the_tokens_of_a_local_one() {
    let transport = TestTransport::new(Fault::None, 0);
    let node = NodeId(0x1000);
    let pair = start(node, transport.clone(), 32, Duration::from_secs(60));
    let (d, p) = (pair.decode.handle(), pair.prefill.handle());

    let first = request(1, prompt(1, 200), 12);
    let (tokens, text, usage) = collect(d.generate(first.clone(), Some(p.clone().into())).unwrap());
    assert!(transport.sent() > 0, "the prompt was prefilled remotely");
    assert_eq!(tokens, reference(&first));
    assert_eq!(text, loaded().tokenizer.decode(&tokens, true));
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (200, 12));

    // A longer prompt sharing the first one's prefix: the decode node already holds 192 of
    // its tokens, so only the rest is transferred.
    let mut long = prompt(1, 200);
    long.extend(prompt(5, 100));
    let second = request(2, long, 10);
    let before = transport.sent();
    let (tokens, _, usage) = collect(d.generate(second.clone(), Some(p.clone().into())).unwrap());
    assert!(transport.sent() > before);
    assert_eq!(usage.cached_tokens, 192);
    assert_eq!(tokens, reference(&second));

    // Short prompts stay local even when a prefill worker is offered.
    let before = transport.sent();
    let short = request(3, prompt(9, 20), 5);
    let (tokens, _, _) = collect(d.generate(short.clone(), Some(p.into())).unwrap());
    assert_eq!(transport.sent(), before);
    assert_eq!(tokens, reference(&short));
    assert_eq!(transfers_completed(node), 2);
    wait_until_idle(|| d.load(), Duration::from_secs(10));
}

#[test]
fn thirty_two_concurrent_requests_each_match_their_lone_run() {
    let transport = TestTransport::new(Fault::None, 0);
    let pair = start(
        NodeId(0x2000),
        transport.clone(),
        48,
        Duration::from_secs(120),
    );
    let (d, p) = (pair.decode.handle(), pair.prefill.handle());
    let lens = [5, 17, 40, 64, 100, 150, 220, 300];
    let requests: Vec<_> = (0..32)
        .map(|i| {
            request(
                100 + i as u64,
                prompt(i, lens[i % lens.len()]),
                6 + (i % 5) as u32,
            )
        })
        .collect();
    let streams: Vec<_> = requests
        .iter()
        .map(|r| d.generate(r.clone(), Some(p.clone().into())).unwrap())
        .collect();
    let outputs: Vec<Vec<TokenId>> = streams.into_iter().map(|s| collect(s).0).collect();
    // 20 of the 32 prompts are long enough to prefill remotely.
    assert_eq!(transfers_completed(NodeId(0x2000)), 20);
    wait_until_idle(|| d.load(), Duration::from_secs(10));
    wait_until_idle(|| p.load(), Duration::from_secs(10));
    for (r, out) in requests.iter().zip(&outputs) {
        assert_eq!(out, &reference(r), "request {}", r.request_id);
    }
}

#[test]
fn dropping_the_stream_frees_the_request_blocks() {
    let transport = TestTransport::new(Fault::None, 0);
    let pair = start(NodeId(0x3000), transport, 32, Duration::from_secs(60));
    let (d, p) = (pair.decode.handle(), pair.prefill.handle());
    for (id, len) in [(1, 20), (2, 120)] {
        // Far more tokens than the test waits for: only cancellation ends it in time.
        let mut rx = d
            .generate(
                request(id, prompt(id as usize, len), 1_500),
                Some(p.clone().into()),
            )
            .unwrap();
        for _ in 0..2 {
            assert!(matches!(
                rx.blocking_recv(),
                Some(kvmesh_common::GenerateEvent::Token(_))
            ));
        }
        assert!(d.load().kv_blocks_used > 0);
        drop(rx);
        wait_until_idle(|| d.load(), Duration::from_secs(5));
    }
}

#[test]
fn a_corrupt_chunk_is_recomputed_locally() {
    let transport = TestTransport::new(Fault::Corrupt, 3);
    let node = NodeId(0x4000);
    let pair = start(node, transport.clone(), 32, Duration::from_secs(60));
    let r = request(1, prompt(3, 180), 10);
    let (tokens, _, _) = collect(
        pair.decode
            .handle()
            .generate(r.clone(), Some(pair.prefill.handle().into()))
            .unwrap(),
    );
    assert!(transport.sent() > 3, "the corrupt chunk was sent");
    assert_eq!(transfers_completed(node), 0, "the transfer was refused");
    assert_eq!(tokens, reference(&r));
    wait_until_idle(|| pair.decode.handle().load(), Duration::from_secs(10));
}

#[test]
fn a_lost_chunk_times_out_and_is_recomputed_locally() {
    let transport = TestTransport::new(Fault::Drop, 5);
    let node = NodeId(0x5000);
    let pair = start(node, transport.clone(), 32, Duration::from_millis(500));
    let r = request(1, prompt(4, 150), 8);
    let (tokens, _, _) = collect(
        pair.decode
            .handle()
            .generate(r.clone(), Some(pair.prefill.handle().into()))
            .unwrap(),
    );
    assert!(transport.sent() > 5);
    assert_eq!(transfers_completed(node), 0, "the transfer never completed");
    assert_eq!(tokens, reference(&r));
    wait_until_idle(|| pair.decode.handle().load(), Duration::from_secs(10));
}

#[test]
fn a_gone_prefill_worker_means_a_local_prefill() {
    let transport = TestTransport::new(Fault::None, 0);
    let Pair { decode, prefill } = start(
        NodeId(0x6000),
        transport.clone(),
        32,
        Duration::from_secs(60),
    );
    let p = prefill.handle();
    drop(prefill); // stops its thread
    let r = request(1, prompt(6, 120), 8);
    let (tokens, _, _) = collect(decode.handle().generate(r.clone(), Some(p.into())).unwrap());
    assert_eq!(transport.sent(), 0);
    assert_eq!(tokens, reference(&r));
}

#[test]
fn seeded_sampling_continues_the_same_random_stream_after_a_remote_prefill() {
    let transport = TestTransport::new(Fault::None, 0);
    let node = NodeId(0x7000);
    let pair = start(node, transport.clone(), 32, Duration::from_secs(60));
    let mut r = request(1, prompt(8, 150), 16);
    r.params.temperature = 0.9;
    r.params.top_k = 40;
    r.params.seed = Some(42);
    let (tokens, _, _) = collect(
        pair.decode
            .handle()
            .generate(r.clone(), Some(pair.prefill.handle().into()))
            .unwrap(),
    );
    assert_eq!(transfers_completed(node), 1);
    assert_eq!(tokens, reference(&r));
}

#[test]
fn a_worker_announces_the_prefixes_it_caches() {
    use kvmesh_common::kv_tier::{KvEventSink, TieredKvEvent};
    use kvmesh_common::{BlockHasher, KvEvent};
    /// Hands each announcement to the test.
    #[derive(Debug)]
    struct Announced(crossbeam_channel::Sender<(NodeId, Vec<TieredKvEvent>)>);
    impl KvEventSink for Announced {
        fn publish(&self, node: NodeId, events: Vec<TieredKvEvent>) {
            let _ = self.0.send((node, events));
        }
    }
    let (tx, rx) = crossbeam_channel::unbounded();
    let mut config = DecodeConfig::new(NodeId(0x2ff));
    config.kv_events = Some(Arc::new(Announced(tx)));
    let worker =
        DecodeWorker::spawn(config, engine(), Arc::new(InProcessTransport::new(16))).unwrap();
    let req = request(51, prompt(51, 40), 4);
    collect(worker.handle().generate(req.clone(), None).unwrap());
    let hasher = BlockHasher::new(loaded().fingerprint, engine_config().block_size);
    let mut missing = hasher.sequence_hashes(&req.prompt);
    assert_eq!(missing.len(), 2, "two full blocks in a 40-token prompt");
    while !missing.is_empty() {
        let (node, events) = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the prompt's blocks are announced");
        assert_eq!(node, NodeId(0x2ff));
        for e in events {
            if let KvEvent::Stored(h) = e.event {
                missing.retain(|m| *m != h);
            }
        }
    }
}
