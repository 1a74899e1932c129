//! The prefill worker on the real model: the KV it pushes is exactly the KV a local run
//! computes, block by block and layer by layer, and its first token is the local first token.

use crossbeam_channel::Receiver;
use kvmesh_common::{BlockId, NodeId, RequestId, SamplingParams, TokenId};
use kvmesh_engine::engine_config::EngineConfig;
use kvmesh_engine::llama_runner::LlamaRunner;
use kvmesh_engine::llm_engine::LlmEngine;
use kvmesh_engine::runner::{KvSource, ModelRunner};
use kvmesh_engine::sampler::Sampled;
use kvmesh_engine::Loaded;
use kvmesh_prefill::{PrefillConfig, PrefillWorker};
use kvmesh_transfer::{InProcessTransport, KvChunk, SlowTo, Transport};
use kvmesh_worker::{
    CancelToken, ExportSource, KvDestination, PrefillDone, PrefillError, PrefillReply,
    PrefillRequest,
};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

const BS: usize = 16;

fn loaded() -> &'static Loaded {
    static MODEL: OnceLock<Loaded> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = kvmesh_prompt::model_fetch::fetched_model().unwrap_or_else(|e| panic!("{e}"));
        kvmesh_engine::load(&path).expect("model loads")
    })
}

fn engine(max_num_batched_tokens: usize) -> LlmEngine<LlamaRunner> {
    EngineConfig {
        block_size: BS,
        num_blocks: 64,
        max_num_batched_tokens,
        ..EngineConfig::default()
    }
    .llama_engine(loaded())
    .unwrap()
}

fn prompt(len: usize) -> Vec<TokenId> {
    let base = loaded()
        .tokenizer
        .encode("Paged attention keeps the KV cache in fixed-size blocks, so memory is never wasted on padding and prefixes can be shared between requests.", false)
        .unwrap();
    (0..len).map(|i| base[i % base.len()]).collect()
}

/// Runs `prompt` alone on a local engine: its first sampled token and its prompt KV per
/// (layer, prompt block) in the transfer layout.
fn local_run(
    prompt: &[TokenId],
    params: &SamplingParams,
) -> (Sampled, HashMap<(usize, usize), Vec<u8>>) {
    let mut e = engine(4096);
    e.add_prefill_request(0, prompt.to_vec(), params.clone())
        .unwrap();
    let mut table = Vec::new();
    let mut kv = HashMap::new();
    let layers = e.runner().kv_shape().num_layers;
    let n_blocks = prompt.len().div_ceil(BS);
    let out = e
        .step_observed(&mut |layer, step, src: &dyn KvSource| {
            table = step.chunks[0].block_table.to_vec();
            for b in 0..n_blocks {
                let mut bytes = Vec::new();
                src.read_kv_blocks(layer, &table[b..b + 1], &mut bytes)
                    .unwrap();
                kv.insert((layer, b), bytes);
            }
        })
        .unwrap();
    assert_eq!(kv.len(), layers * n_blocks);
    (out[0].sampled.clone().unwrap(), kv)
}

struct Received {
    chunks: Vec<KvChunk>,
    reply: PrefillReply,
}

/// A request to prefill `prompt` (past its first `cached_prefix_len` tokens) into fresh
/// blocks of `dest`.
fn push_request(
    prompt: &[TokenId],
    params: SamplingParams,
    cached_prefix_len: usize,
    dest: NodeId,
) -> PrefillRequest {
    let blocks: Vec<BlockId> = (0..(prompt.len().div_ceil(BS) - cached_prefix_len / BS) as u32)
        .map(|i| BlockId(1000 + i))
        .collect();
    PrefillRequest {
        request_id: RequestId(77),
        prompt: prompt.to_vec(),
        params,
        cached_prefix_len,
        destination: KvDestination { node: dest, blocks },
        holder: None,
        cancel: CancelToken::new(),
    }
}

/// The node the workers of [`worker_for_dest`] push KV to.
const DEST: NodeId = NodeId(2);

/// A prefill worker (node 1) stepping at most `budget` tokens, and what [`DEST`] receives.
fn worker_for_dest(budget: usize) -> (PrefillWorker, Receiver<KvChunk>) {
    let transport = Arc::new(InProcessTransport::new(4096));
    let rx = transport.bind(DEST).unwrap();
    let worker = PrefillWorker::spawn(
        PrefillConfig::new(NodeId(1)),
        engine(budget),
        transport as Arc<dyn Transport>,
    )
    .unwrap();
    (worker, rx)
}

fn prefill(
    worker_budget: usize,
    prompt: &[TokenId],
    params: SamplingParams,
    cached_prefix_len: usize,
) -> Received {
    let (worker, rx) = worker_for_dest(worker_budget);
    let (reply_tx, reply_rx) = crossbeam_channel::unbounded();
    let request = push_request(prompt, params, cached_prefix_len, DEST);
    worker.handle().prefill(request, reply_tx).unwrap();
    let reply = reply_rx.recv_timeout(Duration::from_secs(60)).unwrap();
    drop(worker);
    Received {
        chunks: drain(&rx),
        reply,
    }
}

#[test]
fn a_prompt_shows_in_the_load_while_its_one_step_runs() {
    // One step computes the whole prompt.
    let (worker, _rx) = worker_for_dest(512);
    let (reply_tx, reply_rx) = crossbeam_channel::unbounded();
    let request = push_request(&prompt(480), SamplingParams::greedy(1), 0, DEST);
    worker.handle().prefill(request, reply_tx).unwrap();
    // Sample what the worker publishes until the prompt is done.
    let (mut busiest, mut queued) = (0, 0);
    while reply_rx.try_recv().is_err() {
        let load = worker.handle().load();
        busiest = busiest.max(load.running + load.waiting);
        queued = queued.max(load.queued_prompt_tokens);
        std::thread::yield_now();
    }
    assert_eq!(busiest, 1, "the prompt never showed in the published load");
    assert_eq!(queued, 480, "its tokens never showed as queued");
}

fn drain(rx: &Receiver<KvChunk>) -> Vec<KvChunk> {
    rx.try_iter().collect()
}

#[test]
fn pushed_kv_equals_local_kv_and_skips_the_destination_cache() {
    let p = prompt(100); // 7 blocks, the last one partial
    let params = SamplingParams::greedy(8);
    let (first, local_kv) = local_run(&p, &params);
    // The worker prefills in 32-token chunks, so blocks go out over four steps; the
    // destination already has the first two blocks.
    let got = prefill(32, &p, params, 32);
    let done = got.reply.result.expect("prefill succeeds");
    assert_eq!(done.first.token, first.token);
    assert_eq!(done.first.logprob, first.logprob);

    let layers = loaded().model.config.num_layers;
    let mut seen = HashMap::new();
    for c in &got.chunks {
        c.verify().unwrap();
        assert_eq!(c.header.request_id, RequestId(77));
        assert_eq!(c.header.num_layers, 1);
        let block_bytes = c.payload.len() / c.header.blocks.len();
        for (i, b) in c.header.blocks.iter().enumerate() {
            let prompt_block = (b.0 - 1000) as usize + 2;
            let bytes = &c.payload[i * block_bytes..(i + 1) * block_bytes];
            let key = (c.header.first_layer as usize, prompt_block);
            assert!(
                seen.insert(key, bytes.to_vec()).is_none(),
                "{key:?} sent twice"
            );
        }
    }
    assert_eq!(seen.len(), layers * 5, "every layer of blocks 2..7, once");
    for (key, bytes) in &seen {
        assert!(
            local_kv[key] == *bytes,
            "KV of {key:?} differs from the local run"
        );
    }
    assert_eq!(done.chunks_sent as usize, got.chunks.len());
    assert_eq!(
        done.bytes_sent as usize,
        got.chunks.iter().map(|c| c.payload.len()).sum::<usize>()
    );
}

/// Prefills `prompt` on `worker` for destination `dest`, which holds its first
/// `cached_prefix_len` tokens and names `holder` to pull them from.
fn prefill_on(
    worker: &PrefillWorker,
    dest: NodeId,
    prompt: &[TokenId],
    cached_prefix_len: usize,
    holder: Option<ExportSource>,
) -> PrefillDone {
    let blocks = (cached_prefix_len / BS..prompt.len().div_ceil(BS))
        .map(|i| BlockId(1000 + i as u32))
        .collect();
    let (reply_tx, reply_rx) = crossbeam_channel::unbounded();
    let request = PrefillRequest {
        request_id: RequestId(rand_id()),
        prompt: prompt.to_vec(),
        params: SamplingParams::greedy(4),
        cached_prefix_len,
        destination: KvDestination { node: dest, blocks },
        holder,
        cancel: CancelToken::new(),
    };
    worker.handle().prefill(request, reply_tx).unwrap();
    let reply = reply_rx.recv_timeout(Duration::from_secs(60)).unwrap();
    reply.result.expect("prefill succeeds")
}

fn rand_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

#[test]
fn a_prefix_the_destination_holds_is_pulled_from_it_not_recomputed() {
    let p = prompt(100); // 6 full blocks and a partial one
    let (first, local_kv) = local_run(&p, &SamplingParams::greedy(4));
    let transport = Arc::new(InProcessTransport::new(4096));
    let dest = NodeId(2);
    let rx = transport.bind(dest).unwrap();
    let spawn = |id| {
        let t = transport.clone() as Arc<dyn Transport>;
        PrefillWorker::spawn(PrefillConfig::new(NodeId(id)), engine(2048), t).unwrap()
    };
    // The holder stands in for a destination that computed the prompt earlier.
    let holder = spawn(3);
    prefill_on(&holder, dest, &p, 0, None);
    let source: ExportSource = Arc::new(holder.handle());
    drain(&rx);

    // Holding the first 96 tokens, the destination asks for the rest: the worker pulls
    // those 6 blocks and computes only the tail.
    let worker = spawn(1);
    let done = prefill_on(&worker, dest, &p, 96, Some(source.clone()));
    assert_eq!(done.first.token, first.token);
    assert_eq!(done.cached_tokens, 96, "the pulled prefix counts as cached");
    let chunks = drain(&rx);
    let layers = loaded().model.config.num_layers;
    assert_eq!(
        chunks.len(),
        layers,
        "one chunk per layer of the last block"
    );
    for c in &chunks {
        assert_eq!(c.header.blocks, [BlockId(1006)]);
        let key = (c.header.first_layer as usize, 6);
        assert!(
            local_kv[&key] == c.payload,
            "KV of {key:?} differs from the local run"
        );
    }

    // Without a holder, a fresh worker recomputes the prefix, to the same first token.
    let fresh = spawn(4);
    let done = prefill_on(&fresh, dest, &p, 96, None);
    assert_eq!((done.first.token, done.cached_tokens), (first.token, 0));
    // A holder that lacks the blocks costs only the attempt.
    let lacking = spawn(5);
    let empty: ExportSource = Arc::new(lacking.handle());
    let done = prefill_on(&spawn(6), dest, &p, 96, Some(empty));
    assert_eq!((done.first.token, done.cached_tokens), (first.token, 0));
}

#[test]
fn a_seeded_sample_equals_the_local_one() {
    let p = prompt(40);
    let params = SamplingParams {
        temperature: 1.5,
        top_p: 0.95,
        seed: Some(1234),
        logprobs: Some(3),
        ..SamplingParams::greedy(4)
    };
    let (first, _) = local_run(&p, &params);
    let got = prefill(2048, &p, params, 0);
    assert_eq!(got.reply.result.unwrap().first, first);
}

#[test]
fn an_unreachable_destination_fails_the_prefill() {
    let transport: Arc<dyn Transport> = Arc::new(InProcessTransport::new(4));
    let worker =
        PrefillWorker::spawn(PrefillConfig::new(NodeId(1)), engine(2048), transport).unwrap();
    let (reply_tx, reply_rx) = crossbeam_channel::unbounded();
    let request = PrefillRequest {
        request_id: RequestId(5),
        prompt: prompt(20),
        params: SamplingParams::greedy(1),
        cached_prefix_len: 0,
        destination: KvDestination {
            node: NodeId(99),
            blocks: vec![BlockId(0), BlockId(1)],
        },
        holder: None,
        cancel: CancelToken::new(),
    };
    worker
        .handle()
        .prefill(request.clone(), reply_tx.clone())
        .unwrap();
    let reply = reply_rx.recv_timeout(Duration::from_secs(60)).unwrap();
    assert!(matches!(reply.result, Err(PrefillError::Transfer(_))));

    // A destination that does not match the prompt is refused without computing.
    let bad = PrefillRequest {
        cached_prefix_len: 8,
        ..request
    };
    worker.handle().prefill(bad, reply_tx).unwrap();
    let reply = reply_rx.recv_timeout(Duration::from_secs(60)).unwrap();
    assert!(matches!(reply.result, Err(PrefillError::InvalidRequest(_))));
    assert_eq!(worker.handle().load().kv_blocks_used, 0);
}

#[test]
fn a_token_outside_the_vocabulary_is_refused_at_the_door() {
    let (worker, _kv) = worker_for_dest(4096);
    let mut bad = prompt(40);
    bad[3] = loaded().tokenizer.vocab_size() as TokenId;
    let (reply_tx, _reply_rx) = crossbeam_channel::unbounded();
    let refused = worker.handle().prefill(
        PrefillRequest {
            request_id: RequestId(rand_id()),
            prompt: bad,
            params: SamplingParams::greedy(4),
            cached_prefix_len: 0,
            destination: KvDestination {
                node: DEST,
                blocks: (0..3).map(BlockId).collect(),
            },
            holder: None,
            cancel: CancelToken::new(),
        },
        reply_tx,
    );
    // Refused before it could join a batch (and fail it, with every prompt in it).
    match refused {
        Err(PrefillError::InvalidRequest(m)) => assert!(m.contains("vocabulary"), "{m}"),
        other => panic!("not refused as invalid: {other:?}"),
    }
    prefill_on(&worker, DEST, &prompt(40), 0, None);
}

#[test]
fn a_slow_destination_holds_up_no_other_prefill() {
    let (open, gate) = crossbeam_channel::bounded::<()>(0);
    let (slow, fast) = (NodeId(2), NodeId(3));
    let transport = Arc::new(SlowTo {
        inner: InProcessTransport::new(4096),
        slow,
        gate,
    });
    let _slow_kv = transport.bind(slow).unwrap();
    let fast_kv = transport.bind(fast).unwrap();
    let config = PrefillConfig {
        send_timeout: Duration::from_secs(120),
        ..PrefillConfig::new(NodeId(1))
    };
    let worker = PrefillWorker::spawn(config, engine(4096), transport.clone()).unwrap();
    // Dropped before the worker even when the test fails: the worker's thread then never
    // waits on the gate while it is joined.
    let open = open;
    let request = |dest: NodeId| PrefillRequest {
        request_id: RequestId(rand_id()),
        prompt: prompt(40),
        params: SamplingParams::greedy(4),
        cached_prefix_len: 0,
        destination: KvDestination {
            node: dest,
            blocks: (0..3).map(BlockId).collect(),
        },
        holder: None,
        cancel: CancelToken::new(),
    };
    let (slow_tx, slow_rx) = crossbeam_channel::unbounded();
    worker.handle().prefill(request(slow), slow_tx).unwrap();
    let (fast_tx, fast_rx) = crossbeam_channel::unbounded();
    worker.handle().prefill(request(fast), fast_tx).unwrap();
    // The slow destination takes nothing yet; the other prompt is computed and delivered.
    let fast_reply = fast_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("a prefill waited behind another one's slow destination");
    let done = fast_reply.result.expect("the fast prefill succeeds");
    assert_eq!(drain(&fast_kv).len() as u32, done.chunks_sent);
    assert!(
        slow_rx.try_recv().is_err(),
        "answered before its KV was sent"
    );
    drop(open);
    let slow_reply = slow_rx.recv_timeout(Duration::from_secs(30)).unwrap();
    assert!(slow_reply.result.is_ok(), "{:?}", slow_reply.result);
}
