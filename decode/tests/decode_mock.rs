//! The decode worker on a MockRunner: admission control and request validation, without the
//! model's compute (the real tokenizer is read for detokenization).

use crossbeam_channel::{Receiver, Sender};
use kvmesh_common::{
    BlockHasher, BlockId, GenerateEvent, GenerateRequest, ModelFingerprint, NodeId, RequestId,
    SamplingParams, WorkerError,
};
use kvmesh_decode::{DecodeConfig, DecodeHandle, DecodeWorker};
use kvmesh_engine::llm_engine::LlmEngine;
use kvmesh_engine::mock_runner::{CostModel, MockRunner};
use kvmesh_engine::runner::{KvShape, KvSource, ModelRunner, RunnerError, StepInput, StepOutput};
use kvmesh_engine::scheduler::SchedulerConfig;
use kvmesh_prompt::gguf::GgufFile;
use kvmesh_prompt::tokenizer::Tokenizer;
use kvmesh_transfer::{InProcessTransport, SlowTo, Transport};
use kvmesh_worker::{ExportRequest, KvDestination, KvExporter};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn tokenizer() -> Arc<Tokenizer> {
    let path = kvmesh_prompt::model_fetch::fetched_model().unwrap_or_else(|e| panic!("{e}"));
    let gguf = GgufFile::open(&path).expect("the model file opens");
    Arc::new(Tokenizer::from_gguf(&gguf).expect("the tokenizer loads"))
}

/// A MockRunner whose every step waits for a permit: the test decides when the worker moves.
/// Dropping the permit sender lets every step through. Each step's number of sequences goes
/// to `steps`.
struct GatedRunner {
    inner: MockRunner,
    permits: Receiver<()>,
    steps: Sender<usize>,
}

/// The test's side of a [`GatedRunner`].
struct Gate {
    permits: Sender<()>,
    steps: Receiver<usize>,
}

impl KvSource for GatedRunner {
    fn read_kv_blocks(
        &self,
        layer: usize,
        blocks: &[BlockId],
        out: &mut Vec<u8>,
    ) -> Result<(), RunnerError> {
        self.inner.read_kv_blocks(layer, blocks, out)
    }
}

impl ModelRunner for GatedRunner {
    fn kv_shape(&self) -> KvShape {
        self.inner.kv_shape()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn max_context(&self) -> usize {
        self.inner.max_context()
    }
    fn execute_observed(
        &mut self,
        input: &StepInput,
        on_layer: &mut (dyn FnMut(usize, &dyn KvSource) + Send),
    ) -> Result<StepOutput, RunnerError> {
        let _ = self.permits.recv();
        let _ = self.steps.send(input.chunks.len());
        self.inner.execute_observed(input, on_layer)
    }
    fn write_kv_blocks(
        &mut self,
        layers: Range<usize>,
        blocks: &[BlockId],
        payload: &[u8],
    ) -> Result<(), RunnerError> {
        self.inner.write_kv_blocks(layers, blocks, payload)
    }
}

fn gated_worker(max_queued_requests: usize) -> (DecodeWorker, Gate) {
    let transport: Arc<dyn Transport> = Arc::new(InProcessTransport::default());
    gated_worker_on(max_queued_requests, transport, DecodeConfig::new(NodeId(9)))
}

/// [`gated_worker`] over `transport`, with `decode`'s settings.
fn gated_worker_on(
    max_queued_requests: usize,
    transport: Arc<dyn Transport>,
    decode: DecodeConfig,
) -> (DecodeWorker, Gate) {
    let tokenizer = tokenizer();
    let shape = KvShape {
        num_layers: 2,
        num_kv_heads: 1,
        head_dim: 8,
        block_size: 16,
        num_blocks: 64,
    };
    let config = SchedulerConfig {
        block_size: 16,
        num_blocks: 64,
        max_num_batched_tokens: 256,
        max_num_seqs: 16,
        max_model_len: 512,
        enable_prefix_caching: true,
        host_tier_blocks: 0,
        disk_tier_blocks: 0,
        hasher: BlockHasher::new(ModelFingerprint(1), 16),
    };
    let (permit_tx, permits) = crossbeam_channel::unbounded();
    let (steps, step_rx) = crossbeam_channel::unbounded();
    let runner = GatedRunner {
        inner: MockRunner::new(shape, tokenizer.vocab_size(), 512, CostModel::zero()),
        permits,
        steps,
    };
    let engine = LlmEngine::new(config, runner, tokenizer);
    let decode = DecodeConfig {
        max_queued_requests,
        ..decode
    };
    (
        DecodeWorker::spawn(decode, engine, transport).unwrap(),
        Gate {
            permits: permit_tx,
            steps: step_rx,
        },
    )
}

fn request(id: u64, prompt_len: usize) -> GenerateRequest {
    GenerateRequest {
        request_id: RequestId(id),
        prompt: (0..prompt_len as u32).map(|t| 100 + t).collect(),
        params: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(4)
        },
        resume: Vec::new(),
    }
}

fn finishes(mut rx: kvmesh_decode::EventReceiver) -> bool {
    while let Some(e) = rx.blocking_recv() {
        match e {
            GenerateEvent::Token(_) => {}
            GenerateEvent::Finished { usage, .. } => return usage.completion_tokens == 4,
            GenerateEvent::Error(_) => return false,
        }
    }
    false
}

fn generate(
    d: &DecodeHandle,
    r: GenerateRequest,
) -> Result<kvmesh_decode::EventReceiver, WorkerError> {
    d.generate(r, None)
}

#[test]
fn requests_sent_together_to_an_idle_worker_start_in_one_step() {
    let config = DecodeConfig {
        gather_window: Duration::from_millis(300),
        ..DecodeConfig::new(NodeId(9))
    };
    let transport: Arc<dyn Transport> = Arc::new(InProcessTransport::default());
    let (worker, gate) = gated_worker_on(8, transport, config);
    drop(gate.permits);
    let h = worker.handle();
    let first = generate(&h, request(1, 20)).unwrap();
    // The second is sent 20 ms after the first, as a client's "simultaneous" requests arrive
    // spread out: well within the window.
    std::thread::sleep(Duration::from_millis(20));
    let second = generate(&h, request(2, 20)).unwrap();
    assert_eq!(
        gate.steps.recv().unwrap(),
        2,
        "the first step prefills both"
    );
    assert!(finishes(first) && finishes(second));
    h.drain();
    worker.join();
}

#[test]
fn a_prompt_prefilled_in_chunks_shows_its_rest_as_queued() {
    let (worker, gate) = gated_worker(8);
    let h = worker.handle();
    // The load a step waiting for its permit leaves published.
    let published = |queued: u64| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while h.load().queued_prompt_tokens != queued {
            assert!(
                Instant::now() < deadline,
                "published {:?}, not {queued} tokens queued",
                h.load()
            );
            std::thread::yield_now();
        }
    };
    // 400 tokens in steps of 256: the second step computes the last 144. The whole prompt
    // shows while the first step runs.
    let rx = generate(&h, request(1, 400)).unwrap();
    published(400);
    gate.permits.send(()).unwrap();
    assert_eq!(gate.steps.recv().unwrap(), 1);
    published(144);
    drop(gate.permits);
    assert!(finishes(rx));
    h.drain();
    worker.join();
    assert_eq!(h.load().queued_prompt_tokens, 0);
}

#[test]
fn a_full_queue_answers_overloaded() {
    let (worker, Gate { permits, .. }) = gated_worker(2);
    let d = worker.handle();
    // No step can run, so no request leaves the queue.
    let a = generate(&d, request(1, 10)).unwrap();
    let b = generate(&d, request(2, 10)).unwrap();
    assert!(matches!(
        generate(&d, request(3, 10)),
        Err(WorkerError::Overloaded(_))
    ));
    drop(permits);
    assert!(finishes(a) && finishes(b));
    // With room again, new requests are accepted.
    assert!(finishes(generate(&d, request(4, 10)).unwrap()));
}

#[test]
fn invalid_requests_are_refused_at_once() {
    let (worker, Gate { permits, .. }) = gated_worker(8);
    drop(permits);
    let d = worker.handle();
    let invalid = |r| matches!(generate(&d, r), Err(WorkerError::InvalidRequest(_)));
    assert!(invalid(request(1, 0)), "empty prompt");
    assert!(invalid(request(2, 513)), "longer than the context");
    let mut r = request(3, 5);
    r.params.temperature = -1.0;
    assert!(invalid(r), "bad sampling parameters");
    // A duplicate id of a running request ends its own stream with an error.
    let first = generate(&d, request(4, 5)).unwrap();
    let mut dup = generate(&d, request(4, 5)).unwrap();
    let dup_event = dup.blocking_recv();
    assert!(finishes(first));
    if let Some(GenerateEvent::Error(e)) = dup_event {
        assert!(matches!(e, WorkerError::InvalidRequest(_)));
    }
}

#[test]
fn an_out_of_vocabulary_token_fails_alone() {
    let (worker, Gate { permits, .. }) = gated_worker(8);
    let d = worker.handle();
    let vocab = tokenizer().vocab_size() as u32;
    // No step runs before the permits go: every request accepted until then shares the
    // first batch.
    let good = generate(&d, request(1, 20)).unwrap();
    let mut poison = request(2, 20);
    poison.prompt[7] = vocab;
    let mut bad_resume = request(3, 20);
    bad_resume.resume = vec![5, u32::MAX];
    let answers: Vec<_> = [poison, bad_resume]
        .into_iter()
        .map(|r| generate(&d, r))
        .collect();
    drop(permits);
    assert!(finishes(good), "a request batched with the bad one failed");
    for answer in answers {
        match answer {
            Err(WorkerError::InvalidRequest(m)) => assert!(m.contains("vocabulary"), "{m}"),
            Err(e) => panic!("refused as {e:?}, not as invalid"),
            Ok(_) => panic!("a token id outside the vocabulary was accepted"),
        }
    }
}

#[test]
fn a_draining_worker_finishes_its_requests_and_refuses_new_ones() {
    let (worker, Gate { permits, .. }) = gated_worker(8);
    let d = worker.handle();
    let a = generate(&d, request(1, 30)).unwrap();
    d.drain();
    assert!(matches!(
        generate(&d, request(2, 10)),
        Err(WorkerError::Unavailable(_))
    ));
    drop(permits);
    assert!(finishes(a));
    worker.join();
}

#[test]
fn an_export_to_a_slow_node_holds_up_no_decode() {
    let (open, gate) = crossbeam_channel::bounded::<()>(0);
    let slow = NodeId(50);
    let transport = Arc::new(SlowTo {
        inner: InProcessTransport::default(),
        slow,
        gate,
    });
    let slow_kv = transport.bind(slow).unwrap();
    let config = DecodeConfig {
        export_timeout: Duration::from_secs(20),
        ..DecodeConfig::new(NodeId(9))
    };
    let (worker, Gate { permits, .. }) = gated_worker_on(8, transport.clone(), config);
    // Dropped before the worker even when the test fails: the worker's thread then never
    // waits on the gate while it is joined.
    let open = open;
    drop(permits);
    let d = worker.handle();
    // Its prompt's blocks stay cached once it finished: something to export.
    let cached = request(1, 64);
    assert!(finishes(generate(&d, cached.clone()).unwrap()));
    let hashes = BlockHasher::new(ModelFingerprint(1), 16).sequence_hashes(&cached.prompt);
    let (reply_tx, reply_rx) = crossbeam_channel::unbounded();
    let export = ExportRequest {
        transfer_id: RequestId(99),
        hashes: hashes.clone(),
        destination: KvDestination {
            node: slow,
            blocks: (0..hashes.len() as u32).map(BlockId).collect(),
        },
    };
    KvExporter::export(&d, export, reply_tx).unwrap();
    // While the export waits for the slow node, another request decodes to its end.
    let started = Instant::now();
    assert!(finishes(generate(&d, request(2, 10)).unwrap()));
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "a decode waited {took:?} behind an export"
    );
    assert!(
        reply_rx.try_recv().is_err(),
        "the export answered before it sent"
    );
    drop(open);
    let reply = reply_rx.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!(reply.result.unwrap().blocks, hashes.len());
    assert_eq!(slow_kv.try_iter().count(), 2, "one chunk per layer");
}
