//! Pulling a cached prefix from another decode worker: the request is served from KV that
//! node computed, with exactly the tokens of recomputing it; a holder that lacks the blocks
//! or never answers costs a recompute, never a wrong or a lost request.

mod workers;

use crossbeam_channel::Sender;
use kvmesh_common::metrics as names;
use kvmesh_common::{NodeId, TokenId};
use kvmesh_decode::{DecodeConfig, DecodeHandle, DecodeWorker, EventReceiver};
use kvmesh_transfer::{InProcessTransport, Transport};
use kvmesh_worker::{ExportError, ExportReply, ExportRequest, KvExporter, KvPull};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use workers::*;

fn worker(node: NodeId, transport: &Arc<dyn Transport>) -> DecodeWorker {
    let config = DecodeConfig {
        pull_timeout: Duration::from_secs(30),
        ..DecodeConfig::new(node)
    };
    DecodeWorker::spawn(config, engine(), transport.clone()).unwrap()
}

fn transport() -> Arc<dyn Transport> {
    Arc::new(InProcessTransport::new(64))
}

/// A 1,000-token shared prefix, then a tail of its own.
fn shared_prefix_prompt(tail: usize) -> Vec<TokenId> {
    let mut p = prompt(3, 1000);
    p.extend(prompt(100 + tail, 24));
    p
}

/// Workers A and B on one transport, A holding the shared prefix.
fn holder_and_puller(a_id: NodeId, b_id: NodeId) -> [DecodeWorker; 2] {
    let t = transport();
    let (a, b) = (worker(a_id, &t), worker(b_id, &t));
    let first = request(1, shared_prefix_prompt(1), 4);
    collect(a.handle().generate(first, None).unwrap());
    [a, b]
}

/// Keeps `a` decoding four long requests for others until the streams are dropped, so that
/// it answers pulls only between its steps.
fn keep_busy(a: &DecodeHandle) -> Vec<EventReceiver> {
    (0..4)
        .map(|i| {
            a.generate(request(10 + i, prompt(20 + i as usize, 64), 1500), None)
                .unwrap()
        })
        .collect()
}

/// A pull of the shared prefix's 62 blocks from `a`.
fn the_prefix_from(a: &DecodeHandle) -> KvPull {
    KvPull {
        source: Arc::new(a.clone()),
        blocks: 62,
    }
}

#[test]
fn a_prefix_pulled_from_a_busy_node_gives_the_tokens_of_recomputing_it() {
    let (a_id, b_id) = (NodeId(0x3000), NodeId(0x3001));
    let [a, b] = holder_and_puller(a_id, b_id);
    let (a, b) = (a.handle(), b.handle());
    let busy = keep_busy(&a);
    let second = request(2, shared_prefix_prompt(2), 12);
    let pull = the_prefix_from(&a);
    let (tokens, _, usage) = collect(
        b.generate_pulling(second.clone(), None, Some(pull))
            .unwrap(),
    );
    assert_eq!(tokens, reference(&second), "pulled KV changed the output");
    assert!(usage.cached_tokens >= 992, "{usage:?}");
    assert_eq!(counter(names::WORKER_KV_PULLED_BLOCKS_TOTAL, b_id), 62);
    assert_eq!(counter(names::WORKER_KV_EXPORTED_BLOCKS_TOTAL, a_id), 62);
    assert_eq!(counter(names::WORKER_KV_PULL_FAILURES_TOTAL, b_id), 0);
    drop(busy);
    // The prefix is now B's own: a third request finds it without pulling.
    let third = request(3, shared_prefix_prompt(3), 4);
    let (_, _, usage) = collect(b.generate(third, None).unwrap());
    assert!(usage.cached_tokens >= 992, "{usage:?}");
    wait_until_idle(|| b.load(), Duration::from_secs(30));
}

/// A burst of requests on one prefix, each offered the same holder: the prefix moves once,
/// and every request is served from it with the tokens of recomputing it.
#[test]
fn a_burst_on_one_prefix_pulls_it_once() {
    let (a_id, b_id) = (NodeId(0x3300), NodeId(0x3301));
    let [a, b] = holder_and_puller(a_id, b_id);
    let (a, b) = (a.handle(), b.handle());
    // A answers pulls only between its steps: the burst arrives while the first pull is in
    // flight.
    let busy = keep_busy(&a);
    let burst: Vec<_> = (0..4)
        .map(|i| {
            let req = request(20 + i, shared_prefix_prompt(2 + i as usize), 6);
            let pull = the_prefix_from(&a);
            let rx = b.generate_pulling(req.clone(), None, Some(pull)).unwrap();
            (req, rx)
        })
        .collect();
    for (req, rx) in burst {
        let (tokens, _, usage) = collect(rx);
        assert_eq!(tokens, reference(&req), "request {}", req.request_id);
        assert!(usage.cached_tokens >= 992, "{usage:?}");
    }
    assert_eq!(counter(names::WORKER_KV_EXPORTED_BLOCKS_TOTAL, a_id), 62);
    assert_eq!(counter(names::WORKER_KV_PULLED_BLOCKS_TOTAL, b_id), 62);
    drop(busy);
    wait_until_idle(|| b.load(), Duration::from_secs(30));
}

#[test]
fn a_holder_without_the_prefix_costs_a_recompute() {
    let t = transport();
    let (a_id, b_id) = (NodeId(0x3100), NodeId(0x3101));
    let (a, b) = (worker(a_id, &t), worker(b_id, &t));
    let (a, b) = (a.handle(), b.handle());
    let req = request(1, shared_prefix_prompt(1), 8);
    let pull = the_prefix_from(&a);
    let (tokens, _, usage) = collect(b.generate_pulling(req.clone(), None, Some(pull)).unwrap());
    assert_eq!(tokens, reference(&req));
    assert_eq!(usage.cached_tokens, 0);
    assert_eq!(counter(names::WORKER_KV_PULL_FAILURES_TOTAL, b_id), 1);
    assert_eq!(counter(names::WORKER_KV_PULLED_BLOCKS_TOTAL, b_id), 0);
    wait_until_idle(|| b.load(), Duration::from_secs(30));
}

/// A holder that takes pulls and never answers (a hung node).
#[derive(Debug, Default)]
struct Silent(Mutex<Vec<Sender<ExportReply>>>);

impl KvExporter for Silent {
    fn node_id(&self) -> NodeId {
        NodeId(0x3299)
    }

    fn export(&self, _: ExportRequest, reply: Sender<ExportReply>) -> Result<(), ExportError> {
        self.0.lock().unwrap().push(reply);
        Ok(())
    }
}

#[test]
fn a_pull_that_times_out_recomputes_and_releases_its_blocks() {
    let t = transport();
    let b_id = NodeId(0x3201);
    let config = DecodeConfig {
        pull_timeout: Duration::from_millis(200),
        ..DecodeConfig::new(b_id)
    };
    let b = DecodeWorker::spawn(config, engine(), t).unwrap();
    let b = b.handle();
    let req = request(1, shared_prefix_prompt(1), 8);
    let silent = Arc::new(Silent::default());
    let pull = KvPull {
        source: silent.clone(),
        blocks: 62,
    };
    let rx = b
        .generate_pulling(req.clone(), None, Some(pull.clone()))
        .unwrap();
    // Another request for the same prefix waits for the same pull, and recomputes with it
    // rather than ask the silent holder again.
    let other = request(2, shared_prefix_prompt(2), 8);
    let other_rx = b.generate_pulling(other.clone(), None, Some(pull)).unwrap();
    let (tokens, _, usage) = collect(rx);
    assert_eq!(tokens, reference(&req));
    assert_eq!(usage.cached_tokens, 0);
    let (tokens, _, _) = collect(other_rx);
    assert_eq!(tokens, reference(&other));
    assert_eq!(
        silent.0.lock().unwrap().len(),
        1,
        "the holder was asked once"
    );
    assert_eq!(counter(names::WORKER_KV_PULL_FAILURES_TOTAL, b_id), 1);
    wait_until_idle(|| b.load(), Duration::from_secs(30));
}
