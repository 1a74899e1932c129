//! The prefill worker thread and its handle.

use crate::push::KvPush;
use crate::reply::ReplyTo;
use crossbeam_channel::{Receiver, Select, Sender, TryRecvError, TrySendError};
use kvmesh_common::kv_tier::KvEventSink;
use kvmesh_common::{NodeId, RequestId};
use kvmesh_engine::llm_engine::{LlmEngine, SeqOutput};
use kvmesh_engine::runner::{KvShape, KvSource, ModelRunner, SeqId, StepInput};
use kvmesh_engine::sampler::Sampled;
use kvmesh_transfer::{BlockShape, KvChunk, KvReceiver, Transport, TransportError};
use kvmesh_worker::{
    CancelToken, Control, EngineReturn, EngineThread, ExportError, ExportJob, ExportReply,
    ExportRequest, Gather, KvExporter, KvOutbox, KvPull, LoadPublisher, NodeState, PrefillClient,
    PrefillDone, PrefillError, PrefillReply, PrefillRequest, PrefillTarget, Puller, WorkerMetrics,
};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A prefill worker's own settings (its engine is configured where it is built).
#[derive(Clone, Debug)]
pub struct PrefillConfig {
    pub node_id: NodeId,
    /// Requests accepted and not yet answered; more are refused with `Overloaded`, so the
    /// decode worker prefills locally or tries another prefill worker.
    pub max_queued_requests: usize,
    /// How long one chunk may wait for room in the destination's queue before the transfer
    /// counts as failed.
    pub send_timeout: Duration,
    /// How long a request waits for its cached prefix to be pulled from its destination
    /// before it recomputes the prefix instead.
    pub pull_timeout: Duration,
    /// Where this node announces its prefix-cache changes (none: not announced).
    pub kv_events: Option<Arc<dyn KvEventSink>>,
    /// How long an idle worker, woken by a request, waits for others before its first step
    /// (default [`kvmesh_worker::GATHER_WINDOW`]; zero: not at all).
    pub gather_window: Duration,
}

impl PrefillConfig {
    pub fn new(node_id: NodeId) -> Self {
        PrefillConfig {
            node_id,
            max_queued_requests: 256,
            send_timeout: Duration::from_secs(5),
            pull_timeout: Duration::from_secs(2),
            kv_events: None,
            gather_window: kvmesh_worker::GATHER_WINDOW,
        }
    }
}

enum Inbox {
    Prefill(Box<(PrefillRequest, ReplyTo, Instant)>),
    /// Served between two steps, ahead of queued prefills (see `kvmesh_worker::export`).
    Export(Box<ExportJob>),
    /// Wakes the thread to notice a drain.
    Wake,
    Stop,
}

impl Control for Inbox {
    fn wake() -> Self {
        Inbox::Wake
    }

    fn stop() -> Self {
        Inbox::Stop
    }
}

/// What the handles check before queueing, copied from the engine at spawn.
struct Limits {
    /// The KV the worker produces.
    kv_shape: KvShape,
    /// Token ids at or above this are refused at the door: the runner would fail the whole
    /// batch they joined, every co-batched prompt with them.
    vocab_size: usize,
}

/// What the handles and the thread share; the role adds the limits.
type Shared = NodeState<Limits>;

/// Submits requests to one prefill worker. Cheap to clone; usable from any thread.
#[derive(Clone)]
pub struct PrefillHandle {
    inbox: Sender<Inbox>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for PrefillHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillHandle")
            .field("node_id", &self.shared.node_id)
            .finish()
    }
}

impl PrefillHandle {
    pub fn node_id(&self) -> NodeId {
        self.shared.node_id
    }

    /// The worker's KV shape: a destination must use the same block size and layout.
    pub fn kv_shape(&self) -> KvShape {
        self.shared.role.kv_shape
    }

    /// Queues `request`; its reply arrives on `reply` (exactly one, also when the worker stops
    /// first). Never blocks. An error here means no reply will come.
    pub fn prefill(
        &self,
        request: PrefillRequest,
        reply: Sender<PrefillReply>,
    ) -> Result<(), PrefillError> {
        if self.shared.is_draining() {
            return Err(PrefillError::Unavailable);
        }
        let vocab = self.shared.role.vocab_size;
        if let Some(&token) = request.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(PrefillError::InvalidRequest(format!(
                "token id {token} is outside the model's vocabulary of {vocab}"
            )));
        }
        if !self.shared.queue.try_take() {
            return Err(PrefillError::Overloaded);
        }
        let reply = ReplyTo::new(request.request_id, reply);
        match self
            .inbox
            .try_send(Inbox::Prefill(Box::new((request, reply, Instant::now()))))
        {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(msg) | TrySendError::Disconnected(msg)) => {
                self.shared.queue.give_back();
                if let Inbox::Prefill(job) = msg {
                    job.1.disarm();
                }
                Err(PrefillError::Unavailable)
            }
        }
    }

    kvmesh_worker::node_handle_methods!();
}

impl PrefillClient for PrefillHandle {
    fn node_id(&self) -> NodeId {
        PrefillHandle::node_id(self)
    }

    fn kv_shape(&self) -> KvShape {
        PrefillHandle::kv_shape(self)
    }

    fn prefill(
        &self,
        request: PrefillRequest,
        reply: Sender<PrefillReply>,
    ) -> Result<(), PrefillError> {
        PrefillHandle::prefill(self, request, reply)
    }
}

impl From<PrefillHandle> for PrefillTarget {
    fn from(h: PrefillHandle) -> Self {
        Arc::new(h)
    }
}

impl KvExporter for PrefillHandle {
    fn node_id(&self) -> NodeId {
        PrefillHandle::node_id(self)
    }

    fn export(
        &self,
        request: ExportRequest,
        reply: Sender<ExportReply>,
    ) -> Result<(), ExportError> {
        ExportJob::queue(&self.inbox, Inbox::Export, request, reply)
    }
}

/// Owns the prefill thread. Dropping it stops the thread (answering every open request with
/// `Unavailable`); `drain` + `join` lets open requests finish first.
pub struct PrefillWorker {
    handle: PrefillHandle,
    thread: EngineThread<Inbox>,
}

impl PrefillWorker {
    /// Starts the thread. `engine` should have prefix caching on; its block size must match
    /// the decode workers'. The worker binds its node on `transport` to receive the prefixes
    /// it pulls.
    pub fn spawn<R: ModelRunner + 'static>(
        config: PrefillConfig,
        engine: LlmEngine<R>,
        transport: Arc<dyn Transport>,
    ) -> std::io::Result<PrefillWorker> {
        Self::start(config, engine, transport, None)
    }

    /// `spawn`, and when the thread exits (drained or stopped) it leaves the engine, with its
    /// weights and warm KV pool, in `back`: a role switch hands it to a decode worker.
    pub fn spawn_returning<R: ModelRunner + 'static>(
        config: PrefillConfig,
        engine: LlmEngine<R>,
        transport: Arc<dyn Transport>,
        back: EngineReturn<R>,
    ) -> std::io::Result<PrefillWorker> {
        Self::start(config, engine, transport, Some(back))
    }

    fn start<R: ModelRunner + 'static>(
        config: PrefillConfig,
        mut engine: LlmEngine<R>,
        transport: Arc<dyn Transport>,
        back: Option<EngineReturn<R>>,
    ) -> std::io::Result<PrefillWorker> {
        engine.set_record_kv_events(config.kv_events.is_some());
        let kv_rx = transport.bind(config.node_id).map_err(|e| {
            std::io::Error::other(format!("binding the KV transport for pulls: {e}"))
        })?;
        let (tx, rx) = kvmesh_worker::inbox(config.max_queued_requests);
        let shared = Arc::new(Shared::new(
            config.node_id,
            engine.scheduler().pool().num_blocks(),
            config.max_queued_requests,
            Limits {
                kv_shape: engine.runner().kv_shape(),
                vocab_size: engine.runner().vocab_size(),
            },
        ));
        let metrics = WorkerMetrics::new(config.node_id, "prefill");
        let node_id = config.node_id;
        let (sent_tx, sent_rx) = crossbeam_channel::unbounded();
        let mut state = Loop {
            pulls: Puller::new(config.node_id, config.pull_timeout, metrics.clone(), |a| {
                &a.request.prompt
            }),
            publisher: LoadPublisher::new(node_id, config.kv_events.clone(), metrics.clone()),
            metrics,
            config,
            engine,
            outbox: KvOutbox::new(transport.clone()),
            sent_tx,
            sent_rx,
            transport: transport.clone(),
            inbox: rx,
            kv_rx,
            kv_closed: false,
            shared: shared.clone(),
            jobs: HashMap::new(),
            next_seq_id: 0,
        };
        let thread = EngineThread::spawn(format!("prefill-{node_id}"), tx.clone(), move || {
            state.run();
            if let Some(back) = back {
                state.metrics.retire();
                back.give_back(state.engine);
            }
        })
        .inspect_err(|_| transport.unbind(node_id))?;
        Ok(PrefillWorker {
            handle: PrefillHandle { inbox: tx, shared },
            thread,
        })
    }

    pub fn handle(&self) -> PrefillHandle {
        self.handle.clone()
    }

    /// Waits for the thread to exit (after `drain`, once the open requests are answered).
    pub fn join(self) {
        self.thread.join();
    }

    /// Waits up to `timeout` for the thread to exit (after `drain`); past it, stops the
    /// thread, ending the requests still open with `Unavailable`. Returns whether they all
    /// finished in time.
    pub fn join_within(self, timeout: Duration) -> bool {
        self.thread.join_within(timeout)
    }
}

struct Job {
    request_id: RequestId,
    reply: ReplyTo,
    push: KvPush,
    dest_node: NodeId,
    cancel: CancelToken,
    enqueued_at: Instant,
    admitted: bool,
    /// Chunks handed to the outbox whose send has not ended yet.
    chunks_in_flight: u32,
    chunks_sent: u32,
    bytes_sent: u64,
    /// The prompt is computed (its first token and cached tokens): the reply waits only for
    /// the chunks in flight.
    computed: Option<(Sampled, usize)>,
}

/// A chunk's send ended, on its destination's sender thread.
struct Sent {
    seq_id: SeqId,
    bytes: u64,
    result: Result<(), TransportError>,
}

/// A request accepted and not yet in the engine: its cached prefix may be on the way.
struct Accepted {
    request: PrefillRequest,
    reply: ReplyTo,
    push: KvPush,
    enqueued_at: Instant,
}

struct Loop<R: ModelRunner> {
    config: PrefillConfig,
    engine: LlmEngine<R>,
    transport: Arc<dyn Transport>,
    /// The prompts' KV and the exports leave through it, off this thread.
    outbox: KvOutbox,
    /// Where the outbox's sender threads say how each chunk's send ended.
    sent_tx: Sender<Sent>,
    sent_rx: Receiver<Sent>,
    inbox: Receiver<Inbox>,
    /// The KV of the prefixes this worker pulls.
    kv_rx: KvReceiver,
    /// The transport let go of this node: no more pulled KV.
    kv_closed: bool,
    pulls: Puller<Accepted>,
    shared: Arc<Shared>,
    jobs: HashMap<SeqId, Job>,
    next_seq_id: SeqId,
    metrics: WorkerMetrics,
    publisher: LoadPublisher,
}

impl<R: ModelRunner> Loop<R> {
    fn run(&mut self) {
        let pool = self.engine.scheduler().pool();
        self.metrics.kv_blocks_total.set(pool.num_blocks() as f64);
        self.publisher.start(&mut self.engine);
        loop {
            let idle = !self.engine.has_work() || self.engine.last_step_tokens() == 0;
            if idle {
                let draining = self.shared.is_draining();
                if draining
                    && self.jobs.is_empty()
                    && self.pulls.is_empty()
                    && self.inbox.is_empty()
                {
                    break;
                }
                let empty = !self.engine.has_work();
                self.wait(self.pulls.next_deadline());
                if empty && !self.gather(self.config.gather_window) {
                    break;
                }
            }
            if !self.receive() {
                break;
            }
            self.drop_cancelled();
            if self.engine.has_work() {
                // What the step is about to compute shows while it runs: a prompt prefilled
                // in one step would otherwise never be seen in the queue.
                self.publish_load();
                self.step();
            }
            self.publish_load();
        }
        self.transport.unbind(self.config.node_id);
        for (seq_id, job) in self.jobs.drain() {
            self.engine.abort(seq_id);
            job.reply.send(Err(PrefillError::Unavailable));
        }
        for a in self.pulls.abandon(&mut self.engine, |_| true) {
            self.shared.queue.give_back();
            a.reply.send(Err(PrefillError::Unavailable));
        }
        // Requests that raced the drain or the stop.
        while let Ok(msg) = self.inbox.try_recv() {
            match msg {
                Inbox::Prefill(job) => {
                    self.shared.queue.give_back();
                    job.1.send(Err(PrefillError::Unavailable));
                }
                Inbox::Export(job) => job.refuse(),
                Inbox::Wake | Inbox::Stop => {}
            }
        }
    }

    /// Takes the holders' replies, then the pulled KV (a reply's chunks were sent before
    /// it), then the clock; queues the requests whose pulls ended.
    fn receive_pulls(&mut self) {
        let mut ended = self.pulls.on_replies(&mut self.engine);
        loop {
            let chunk = match self.kv_rx.try_recv() {
                Ok(chunk) => chunk,
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.kv_closed = true;
                    break;
                }
            };
            match self.pulls.on_chunk(&mut self.engine, chunk) {
                Ok(e) => ended.extend(e),
                Err(late) => {
                    tracing::debug!(transfer = %late.header.request_id, "KV of a pull that ended");
                }
            }
        }
        ended.extend(self.pulls.expire(&mut self.engine));
        for a in ended {
            self.queue(a);
        }
    }

    /// False on `Stop`, or once every handle is gone.
    fn drain_inbox(&mut self) -> bool {
        loop {
            match self.inbox.try_recv() {
                Ok(msg) => {
                    if !self.handle(msg) {
                        return false;
                    }
                }
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return false,
            }
        }
    }

    fn handle(&mut self, msg: Inbox) -> bool {
        match msg {
            Inbox::Prefill(job) => {
                let (req, reply, enqueued_at) = *job;
                self.accept(req, reply, enqueued_at)
            }
            Inbox::Export(job) => job.serve(
                &self.engine,
                &self.outbox,
                self.config.send_timeout,
                self.metrics.kv_exported_blocks.clone(),
            ),
            Inbox::Wake => {}
            Inbox::Stop => return false,
        }
        true
    }

    fn accept(&mut self, mut request: PrefillRequest, reply: ReplyTo, enqueued_at: Instant) {
        let bs = self.engine.runner().kv_shape().block_size;
        let blocks = std::mem::take(&mut request.destination.blocks);
        let push = match KvPush::new(bs, request.prompt.len(), request.cached_prefix_len, blocks) {
            Ok(p) => p,
            Err(e) => {
                self.shared.queue.give_back();
                return reply.send(Err(PrefillError::InvalidRequest(e)));
            }
        };
        let holder = request.holder.take();
        let pull_blocks = request.cached_prefix_len / bs;
        let accepted = Accepted {
            request,
            reply,
            push,
            enqueued_at,
        };
        let accepted = match holder {
            Some(source) if pull_blocks > 0 => {
                let pull = KvPull {
                    source,
                    blocks: pull_blocks,
                };
                match self.pulls.start(&mut self.engine, pull, accepted) {
                    Ok(()) => return,
                    Err(a) => a,
                }
            }
            _ => accepted,
        };
        self.queue(accepted);
    }

    /// Puts an accepted request in the engine.
    fn queue(&mut self, a: Accepted) {
        let Accepted {
            request: req,
            reply,
            push,
            enqueued_at,
        } = a;
        let seq_id = self.next_seq_id;
        self.next_seq_id += 1;
        if let Err(e) = self
            .engine
            .add_prefill_request(seq_id, req.prompt, req.params)
        {
            self.shared.queue.give_back();
            return reply.send(Err(PrefillError::InvalidRequest(e.to_string())));
        }
        self.jobs.insert(
            seq_id,
            Job {
                request_id: req.request_id,
                reply,
                push,
                dest_node: req.destination.node,
                cancel: req.cancel,
                enqueued_at,
                admitted: false,
                chunks_in_flight: 0,
                chunks_sent: 0,
                bytes_sent: 0,
                computed: None,
            },
        );
    }

    fn drop_cancelled(&mut self) {
        let cancelled: Vec<SeqId> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.cancel.is_cancelled())
            .map(|(&id, _)| id)
            .collect();
        for seq_id in cancelled {
            self.engine.abort(seq_id);
            self.end(seq_id, Err(PrefillError::Cancelled));
        }
        let pulling = |a: &Accepted| a.request.cancel.is_cancelled();
        for a in self.pulls.abandon(&mut self.engine, pulling) {
            self.shared.queue.give_back();
            a.reply.send(Err(PrefillError::Cancelled));
        }
    }

    fn step(&mut self) {
        let shape = self.engine.runner().kv_shape();
        let num_layers = shape.num_layers;
        let mut push = Pusher {
            jobs: &mut self.jobs,
            outbox: &self.outbox,
            sent: &self.sent_tx,
            block_shape: BlockShape {
                num_kv_heads: shape.num_kv_heads as u32,
                block_size: shape.block_size as u32,
                head_dim: shape.head_dim as u32,
            },
            send_timeout: self.config.send_timeout,
            last_layer: num_layers.saturating_sub(1),
        };
        let started = Instant::now();
        let result = self
            .engine
            .step_observed(&mut |layer, step, kv| push.on_layer(layer, step, kv));
        self.pulls
            .observe_step(self.engine.last_step_tokens(), started.elapsed());
        self.record_admissions();
        let outputs = match result {
            Ok(o) => o,
            Err(e) => {
                tracing::error!(node = %self.config.node_id, "prefill step failed: {e}");
                let ids: Vec<SeqId> = self.jobs.keys().copied().collect();
                for seq_id in ids {
                    self.engine.abort(seq_id);
                    self.end(seq_id, Err(PrefillError::Engine(e.to_string())));
                }
                return;
            }
        };
        for out in outputs {
            self.finish(out);
        }
    }

    /// Takes the ends of KV sends: a failed one ends its request (a transfer that failed
    /// mid-prompt is not worth finishing), the last one of a computed prompt answers it.
    fn receive_sent(&mut self) {
        while let Ok(Sent {
            seq_id,
            bytes,
            result,
        }) = self.sent_rx.try_recv()
        {
            let Some(job) = self.jobs.get_mut(&seq_id) else {
                continue; // it ended already
            };
            job.chunks_in_flight -= 1;
            match result {
                Ok(()) => {
                    job.chunks_sent += 1;
                    job.bytes_sent += bytes;
                    self.metrics.transfer_bytes.increment(bytes);
                    self.settle(seq_id);
                }
                Err(e) => {
                    tracing::warn!(request_id = %job.request_id, "KV push failed: {e}");
                    if job.computed.is_none() {
                        self.engine.abort(seq_id);
                    }
                    self.end(seq_id, Err(e.into()));
                }
            }
        }
    }

    /// Answers a computed prompt once all of its KV is sent.
    fn settle(&mut self, seq_id: SeqId) {
        let Some(job) = self.jobs.get(&seq_id) else {
            return;
        };
        let Some((first, cached_tokens)) = &job.computed else {
            return;
        };
        if job.chunks_in_flight > 0 {
            return;
        }
        let done = PrefillDone {
            first: first.clone(),
            cached_tokens: *cached_tokens,
            chunks_sent: job.chunks_sent,
            bytes_sent: job.bytes_sent,
        };
        self.end(seq_id, Ok(done));
    }

    fn finish(&mut self, out: SeqOutput) {
        let Some(first) = out.sampled else {
            return;
        };
        let Some(job) = self.jobs.get(&out.seq_id) else {
            return;
        };
        // The engine ends a prefill-only sequence with its first token.
        debug_assert!(out.finish.is_some());
        if !job.push.is_done() {
            let e =
                PrefillError::Engine("the prompt finished before all of its KV was sent".into());
            return self.end(out.seq_id, Err(e));
        }
        if let Some(job) = self.jobs.get_mut(&out.seq_id) {
            job.computed = Some((first, out.cached_tokens.unwrap_or(0)));
        }
        self.settle(out.seq_id);
    }

    fn end(&mut self, seq_id: SeqId, result: Result<PrefillDone, PrefillError>) {
        if let Some(job) = self.jobs.remove(&seq_id) {
            tracing::debug!(request_id = %job.request_id, ok = result.is_ok(), "prefill ended");
            // After the chunks handed over before it.
            let (dest, request) = (job.dest_node, job.request_id);
            self.outbox
                .hand_over(dest, Box::new(move |t| t.end_transfer(dest, request)));
            self.shared.queue.give_back();
            job.reply.send(result);
        }
    }

    fn record_admissions(&mut self) {
        for a in self.engine.last_admitted() {
            let Some(job) = self.jobs.get_mut(&a.seq_id) else {
                continue;
            };
            if std::mem::replace(&mut job.admitted, true) {
                continue;
            }
            self.metrics
                .queue_seconds
                .record(job.enqueued_at.elapsed().as_secs_f64());
            if let Some(t) = self.engine.scheduler().sequence_tokens(a.seq_id) {
                self.metrics
                    .prefix_queried_tokens
                    .increment(t.prompt.len() as u64);
            }
            self.metrics
                .prefix_hit_tokens
                .increment(a.num_cached_tokens as u64);
        }
    }

    fn publish_load(&mut self) {
        let pulling = self.pulls.len();
        self.publisher
            .publish(&mut self.engine, pulling, &self.shared.load);
    }
}

impl<R: ModelRunner> Gather for Loop<R> {
    /// Blocks until a message, a pulled chunk, a holder's reply or the end of a KV send
    /// arrives, or `deadline` (a pull's) passes.
    fn wait(&mut self, deadline: Option<Instant>) {
        let mut sel = Select::new();
        sel.recv(&self.inbox);
        sel.recv(&self.sent_rx);
        if !self.kv_closed {
            sel.recv(&self.kv_rx);
        }
        sel.recv(self.pulls.replies());
        kvmesh_worker::engine_thread::ready_until(&mut sel, deadline);
    }

    /// Takes the pulls' replies and chunks, the ends of sends and the inbox. False on `Stop`.
    fn receive(&mut self) -> bool {
        self.receive_pulls();
        self.receive_sent();
        self.drain_inbox()
    }
}

/// The per-layer hook: reads the blocks each job completed in this step and hands them to
/// the outbox; the step never waits for the network.
struct Pusher<'a> {
    jobs: &'a mut HashMap<SeqId, Job>,
    outbox: &'a KvOutbox,
    sent: &'a Sender<Sent>,
    block_shape: BlockShape,
    send_timeout: Duration,
    last_layer: usize,
}

impl Pusher<'_> {
    fn on_layer(&mut self, layer: usize, step: &StepInput, kv: &dyn KvSource) {
        for chunk in &step.chunks {
            let Some(job) = self.jobs.get_mut(&chunk.seq_id) else {
                continue;
            };
            let blocks = job.push.pending(chunk);
            if blocks.is_empty() {
                continue;
            }
            let (src, dst) = job.push.addresses(chunk, blocks.clone());
            // Sized once: a long prompt's layer is megabytes, and growing it copies them.
            let layer_bytes = src.len() * self.block_shape.block_bytes_per_layer(KvChunk::DTYPE);
            let mut payload = Vec::with_capacity(layer_bytes);
            if let Err(e) = kv.read_kv_blocks(layer, &src, &mut payload) {
                // The engine validated these blocks when it planned the step.
                unreachable!("reading blocks of a planned chunk: {e}");
            }
            let bytes = payload.len() as u64;
            let sealed = KvChunk::seal(
                job.request_id,
                layer..layer + 1,
                dst,
                self.block_shape,
                payload,
            )
            .expect("the payload matches its header by construction");
            let deadline = Instant::now() + self.send_timeout;
            let (dest, seq_id, sent) = (job.dest_node, chunk.seq_id, self.sent.clone());
            job.chunks_in_flight += 1;
            self.outbox.hand_over(
                dest,
                Box::new(move |transport| {
                    let result = transport.send(dest, sealed, deadline);
                    let _ = sent.send(Sent {
                        seq_id,
                        bytes,
                        result,
                    });
                }),
            );
            if layer == self.last_layer {
                job.push.mark_sent(blocks);
            }
        }
    }
}
