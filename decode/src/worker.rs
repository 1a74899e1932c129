//! The decode worker thread: a driver of the engine, the remote-prefill tracker and the pulls.

use crate::config::DecodeConfig;
use crate::handle::{DecodeHandle, Inbox, Limits, Shared, Submission};
use crate::remote_prefill::{
    Action, ChunkVerdict, Completion, FallBack, FallBackReason, RemotePrefills,
};
use crossbeam_channel::{Receiver, Select, Sender, TryRecvError};
use kvmesh_common::{
    GenerateEvent, GenerateRequest, RequestId, SamplingParams, TokenEvent, Usage, WorkerError,
};
use kvmesh_engine::llm_engine::{LlmEngine, SeqOutput};
use kvmesh_engine::runner::{KvShape, ModelRunner, SeqId};
use kvmesh_transfer::{KvChunk, KvReceiver, Transport, TransportError};
use kvmesh_worker::{
    CancelToken, EngineReturn, EngineThread, ExportSource, Gather, IncomingTransfer, KvDestination,
    KvOutbox, LoadPublisher, PrefillReply, PrefillRequest, PrefillTarget, Puller, WorkerMetrics,
};
use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("binding the KV transport: {0}")]
    Bind(#[from] TransportError),
    #[error("starting the decode thread: {0}")]
    Spawn(#[from] std::io::Error),
}

/// Owns the decode thread. Dropping it stops the thread (every open stream ends with
/// `Error(Unavailable)`); `drain` + `join` lets open requests finish first.
pub struct DecodeWorker {
    handle: DecodeHandle,
    thread: EngineThread<Inbox>,
}

impl DecodeWorker {
    /// Binds `config.node_id` on `transport` (where prefill workers send this node's KV) and
    /// starts the thread.
    pub fn spawn<R: ModelRunner + 'static>(
        config: DecodeConfig,
        engine: LlmEngine<R>,
        transport: Arc<dyn Transport>,
    ) -> Result<DecodeWorker, DecodeError> {
        Self::start(config, engine, transport, None)
    }

    /// `spawn`, and when the thread exits (drained or stopped) it leaves the engine, with its
    /// weights and warm KV pool, in `back`: a role switch hands it to a prefill worker.
    pub fn spawn_returning<R: ModelRunner + 'static>(
        config: DecodeConfig,
        engine: LlmEngine<R>,
        transport: Arc<dyn Transport>,
        back: EngineReturn<R>,
    ) -> Result<DecodeWorker, DecodeError> {
        Self::start(config, engine, transport, Some(back))
    }

    fn start<R: ModelRunner + 'static>(
        config: DecodeConfig,
        mut engine: LlmEngine<R>,
        transport: Arc<dyn Transport>,
        back: Option<EngineReturn<R>>,
    ) -> Result<DecodeWorker, DecodeError> {
        engine.set_record_kv_events(config.kv_events.is_some());
        let sc = engine.scheduler().config();
        let limits = Limits {
            max_model_len: sc.max_model_len,
            num_blocks: sc.num_blocks,
            block_size: sc.block_size,
            vocab_size: engine.runner().vocab_size(),
        };
        let kv_rx = transport.bind(config.node_id)?;
        let (tx, rx) = kvmesh_worker::inbox(config.max_queued_requests);
        let (reply_tx, reply_rx) = crossbeam_channel::unbounded();
        let shared = Arc::new(Shared::new(
            config.node_id,
            engine.scheduler().pool().num_blocks(),
            config.max_queued_requests,
            limits,
        ));
        let node_id = config.node_id;
        let inbox = Arc::new(tx);
        let metrics = WorkerMetrics::new(config.node_id, "decode");
        let mut state = Loop {
            pulls: Puller::new(config.node_id, config.pull_timeout, metrics.clone(), |s| {
                &s.request.prompt
            }),
            publisher: LoadPublisher::new(node_id, config.kv_events.clone(), metrics.clone()),
            metrics,
            kv_shape: engine.runner().kv_shape(),
            remote: RemotePrefills::new(config.remote_prefill_timeout),
            config,
            engine,
            outbox: KvOutbox::new(transport.clone()),
            transport: transport.clone(),
            inbox: rx,
            myself: Arc::downgrade(&inbox),
            kv_rx,
            reply_tx,
            reply_rx,
            shared: shared.clone(),
            active: HashMap::new(),
            by_request: HashMap::new(),
            next_seq_id: 0,
            kicked: false,
            inbox_closed: false,
            kv_closed: false,
        };
        let name = format!("decode-{node_id}");
        let run = move || {
            state.run();
            if let Some(back) = back {
                state.metrics.retire();
                back.give_back(state.engine);
            }
        };
        let thread = match EngineThread::spawn(name, (*inbox).clone(), run) {
            Ok(t) => t,
            Err(e) => {
                transport.unbind(node_id);
                return Err(e.into());
            }
        };
        Ok(DecodeWorker {
            handle: DecodeHandle { inbox, shared },
            thread,
        })
    }

    pub fn handle(&self) -> DecodeHandle {
        self.handle.clone()
    }

    /// Waits for the thread to exit (after `drain`, once open requests are finished).
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

struct Active {
    request_id: RequestId,
    events: UnboundedSender<GenerateEvent>,
    params: SamplingParams,
    prompt_tokens: u32,
    completion_tokens: u32,
    cached_tokens: u32,
    enqueued_at: Instant,
    /// Holds a queue slot (not yet admitted).
    in_queue: bool,
    /// Queued for blocks to be prefilled remotely: the prefill worker to ask once it has them.
    /// Once asked, the transfer is in `Loop::remote`.
    prefill: Option<PrefillTarget>,
}

struct Loop<R: ModelRunner> {
    config: DecodeConfig,
    engine: LlmEngine<R>,
    kv_shape: KvShape,
    transport: Arc<dyn Transport>,
    /// Exports leave through it, off this thread.
    outbox: KvOutbox,
    inbox: Receiver<Inbox>,
    /// Where this worker's handles send: its prefill workers pull cached prefixes from it.
    myself: Weak<Sender<Inbox>>,
    kv_rx: KvReceiver,
    /// The transfers of the remote prefills in flight.
    remote: RemotePrefills,
    reply_tx: Sender<PrefillReply>,
    reply_rx: Receiver<PrefillReply>,
    /// Requests waiting for their prefix to be pulled.
    pulls: Puller<Submission>,
    shared: Arc<Shared>,
    active: HashMap<SeqId, Active>,
    by_request: HashMap<RequestId, SeqId>,
    next_seq_id: SeqId,
    /// Something changed since the last step (so an empty last step says nothing).
    kicked: bool,
    inbox_closed: bool,
    kv_closed: bool,
    metrics: WorkerMetrics,
    publisher: LoadPublisher,
}

impl<R: ModelRunner> Loop<R> {
    fn run(&mut self) {
        let total = self.engine.scheduler().pool().num_blocks();
        self.metrics.kv_blocks_total.set(total as f64);
        self.publisher.start(&mut self.engine);
        self.publish_load();
        loop {
            let idle =
                !self.engine.has_work() || (self.engine.last_step_tokens() == 0 && !self.kicked);
            if idle {
                let draining = self.shared.is_draining() || self.inbox_closed;
                if draining
                    && self.active.is_empty()
                    && self.pulls.is_empty()
                    && self.inbox.is_empty()
                {
                    break;
                }
                let empty = !self.engine.has_work();
                self.wait(self.next_timeout());
                if empty && !self.gather(self.config.gather_window) {
                    break;
                }
            }
            if !self.receive() {
                break;
            }
            self.drop_gone_clients();
            self.handle_timeouts();
            if self.engine.has_work() {
                self.kicked = false;
                if self.engine.scheduler().num_waiting() > 0 {
                    // Prompts about to prefill here show while the step runs (a prompt
                    // prefilled in one step would otherwise never be seen queued).
                    self.publish_load();
                }
                self.step();
                self.start_transfers();
                self.handle_timeouts();
            }
            self.publish_load();
        }
        self.transport.unbind(self.config.node_id);
        // Requests that raced the drain or the stop: answer rather than strand them.
        let stopped = || WorkerError::Unavailable("the decode worker stopped".into());
        while let Ok(msg) = self.inbox.try_recv() {
            match msg {
                Inbox::Generate(s) => {
                    self.shared.queue.give_back();
                    let _ = s.events.send(GenerateEvent::Error(stopped()));
                }
                Inbox::Export(job) => job.refuse(),
                Inbox::Wake | Inbox::Stop => {}
            }
        }
        for s in self.pulls.abandon(&mut self.engine, |_| true) {
            self.shared.queue.give_back();
            let _ = s.events.send(GenerateEvent::Error(stopped()));
        }
        let ids: Vec<SeqId> = self.active.keys().copied().collect();
        for seq_id in ids {
            self.fail(seq_id, stopped());
        }
        self.publish_load();
    }

    /// When a remote prefill's transfer or a pull next times out.
    fn next_timeout(&self) -> Option<Instant> {
        match (self.remote.next_deadline(), self.pulls.next_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn accept(&mut self, submission: Submission) {
        let request_id = submission.request.request_id;
        let pulling = self.pulls.any(|s| s.request.request_id == request_id);
        if pulling || self.by_request.contains_key(&request_id) {
            self.shared.queue.give_back();
            let e = WorkerError::InvalidRequest(format!("request {request_id} is already running"));
            let _ = submission.events.send(GenerateEvent::Error(e));
            return;
        }
        if let Some(submission) = self.start_pull(submission) {
            self.admit(submission);
        }
    }

    /// Starts pulling `s`'s cached prefix from the node the router named, when that node has
    /// blocks this one lacks and moving them is cheaper than recomputing them; otherwise
    /// hands `s` back to be admitted at once.
    fn start_pull(&mut self, mut s: Submission) -> Option<Submission> {
        let Some(pull) = s.pull.take() else {
            return Some(s);
        };
        if !s.request.resume.is_empty() {
            return Some(s);
        }
        self.pulls.start(&mut self.engine, pull, s).err()
    }

    /// Queues the request of a pull that ended: it finds the blocks that arrived in the
    /// prefix cache.
    fn pull_ended(&mut self, s: Submission) {
        self.kicked = true;
        self.admit(s);
    }

    /// Queues a request in the engine.
    fn admit(&mut self, submission: Submission) {
        let Submission {
            request,
            prefill,
            events,
            enqueued_at,
            ..
        } = submission;
        let GenerateRequest {
            request_id,
            prompt,
            mut params,
            resume,
        } = request;
        // The prefill worker samples the first token; with the same seed, this node's later
        // draws continue the same random stream.
        params.seed.get_or_insert_with(rand::random);
        let uncached = prompt.len() - self.engine.scheduler().probe_prefix(&prompt);
        // A migrated request recomputes its prompt and the tokens it already has here: the
        // prefill protocol carries prompts, not generated tokens.
        let prefill = prefill.filter(|p| {
            resume.is_empty()
                && uncached >= self.config.local_prefill_max_tokens
                && self.compatible(p)
        });
        let seq_id = self.next_seq_id;
        self.next_seq_id += 1;
        let prompt_tokens = prompt.len() as u32;
        let resumed_tokens = resume.len() as u32;
        let added = match &prefill {
            Some(_) => self
                .engine
                .add_remote_request(seq_id, prompt, params.clone(), 0),
            None if resumed_tokens > 0 => {
                self.engine
                    .resume_request(seq_id, prompt, resume, params.clone(), 0)
            }
            None => self.engine.add_request(seq_id, prompt, params.clone(), 0),
        };
        if let Err(e) = added {
            self.shared.queue.give_back();
            let _ = events.send(GenerateEvent::Error(WorkerError::InvalidRequest(
                e.to_string(),
            )));
            return;
        }
        self.by_request.insert(request_id, seq_id);
        self.active.insert(
            seq_id,
            Active {
                request_id,
                events,
                params,
                prompt_tokens,
                // Usage covers the whole request, across migrations.
                completion_tokens: resumed_tokens,
                cached_tokens: 0,
                enqueued_at,
                in_queue: true,
                prefill,
            },
        );
        self.kicked = true;
    }

    /// Whether `p` computes KV this node can use.
    fn compatible(&self, p: &PrefillTarget) -> bool {
        let (a, b) = (p.kv_shape(), self.kv_shape);
        let ok = a.num_layers == b.num_layers
            && a.num_kv_heads == b.num_kv_heads
            && a.head_dim == b.head_dim
            && a.block_size == b.block_size;
        if !ok {
            tracing::warn!(
                node = %self.config.node_id,
                prefill = %p.node_id(),
                "prefill worker's KV shape {a:?} differs from ours {b:?}; prefilling locally"
            );
        }
        ok
    }

    fn on_chunk(&mut self, chunk: KvChunk) {
        let request_id = chunk.header.request_id;
        let chunk = match self.pulls.on_chunk(&mut self.engine, chunk) {
            Ok(ended) => {
                for s in ended {
                    self.pull_ended(s);
                }
                return;
            }
            Err(chunk) => chunk,
        };
        let Some(&seq_id) = self.by_request.get(&request_id) else {
            return; // finished or cancelled: a late chunk
        };
        match self.remote.on_chunk(seq_id, &chunk) {
            ChunkVerdict::Late => return,
            ChunkVerdict::FallBack(f) => return self.fall_back(f),
            ChunkVerdict::Write => {}
        }
        let h = &chunk.header;
        if let Err(e) = self
            .engine
            .write_kv_blocks(h.layers(), &h.blocks, &chunk.payload)
        {
            if let Some(f) = self.remote.not_written(seq_id, e.to_string()) {
                self.fall_back(f);
            }
            return;
        }
        self.metrics
            .transfer_bytes
            .increment(chunk.payload.len() as u64);
        if let Some(c) = self.remote.written(Instant::now(), seq_id, &chunk) {
            self.complete(c);
        }
    }

    fn on_reply(&mut self, reply: PrefillReply) {
        let Some(&seq_id) = self.by_request.get(&reply.request_id) else {
            return;
        };
        match self.remote.on_reply(Instant::now(), seq_id, reply.result) {
            Some(Action::Complete(c)) => self.complete(c),
            Some(Action::FallBack(f)) => self.fall_back(f),
            None => {}
        }
    }

    /// Hands a transfer whose reply and KV are all in to the engine.
    fn complete(&mut self, c: Completion) {
        let Completion {
            seq_id,
            done,
            elapsed,
        } = c;
        self.kicked = true;
        match self
            .engine
            .complete_remote_prefill(seq_id, done.first, done.cached_tokens)
        {
            Ok(outputs) => {
                self.metrics.transfer_seconds.record(elapsed.as_secs_f64());
                for out in outputs {
                    self.emit(out);
                }
            }
            Err(e) => {
                tracing::warn!("completing a remote prefill: {e}; prefilling locally");
                self.engine.fail_remote_prefill(seq_id);
            }
        }
    }

    /// Gives up on a remote prefill: tells the prefill worker to stop and prefills locally.
    fn fall_back(&mut self, f: FallBack) {
        if let Some(a) = self.active.get(&f.seq_id) {
            let (request_id, reason) = (a.request_id, &f.reason);
            match reason {
                FallBackReason::Failed(_) => {
                    tracing::info!(%request_id, "{reason}; prefilling locally")
                }
                FallBackReason::Refused(_)
                | FallBackReason::TimedOut
                | FallBackReason::NotWritten(_) => {
                    tracing::warn!(%request_id, "{reason}; prefilling locally")
                }
            }
        }
        f.cancel.cancel();
        self.engine.fail_remote_prefill(f.seq_id);
        self.kicked = true;
    }

    fn handle_timeouts(&mut self) {
        for ended in self.pulls.expire(&mut self.engine) {
            self.pull_ended(ended);
        }
        for f in self.remote.on_tick(Instant::now()) {
            self.fall_back(f);
        }
    }

    /// Cancels the requests whose clients dropped their event receiver.
    fn drop_gone_clients(&mut self) {
        let gone: Vec<SeqId> = self
            .active
            .iter()
            .filter(|(_, a)| a.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for seq_id in gone {
            self.remove(seq_id);
        }
        let gone = self
            .pulls
            .abandon(&mut self.engine, |s| s.events.is_closed());
        for _ in gone {
            self.shared.queue.give_back();
        }
    }

    fn step(&mut self) {
        let started = Instant::now();
        let outputs = self.engine.step();
        self.pulls
            .observe_step(self.engine.last_step_tokens(), started.elapsed());
        self.record_admissions();
        match outputs {
            Ok(outputs) => {
                for out in outputs {
                    self.emit(out);
                }
            }
            Err(e) => {
                tracing::error!(node = %self.config.node_id, "decode step failed: {e}");
                let ids: Vec<SeqId> = self.active.keys().copied().collect();
                for seq_id in ids {
                    self.fail(seq_id, WorkerError::Internal(e.to_string()));
                }
            }
        }
    }

    /// This worker, for a prefill worker to pull the prompt's cached prefix from.
    fn as_holder(&self) -> Option<ExportSource> {
        let inbox = self.myself.upgrade()?;
        let shared = self.shared.clone();
        Some(Arc::new(DecodeHandle { inbox, shared }))
    }

    /// Asks the prefill worker of every newly admitted remote prefill to start.
    fn start_transfers(&mut self) {
        let admitted = self.engine.last_remote_admitted().to_vec();
        for adm in admitted {
            let holder = (self.config.prefill_pulls && adm.num_cached_tokens > 0)
                .then(|| self.as_holder())
                .flatten();
            let Some(a) = self.active.get_mut(&adm.seq_id) else {
                continue;
            };
            let Some(prefill) = a.prefill.take() else {
                // Not ours to transfer: never leave its blocks waiting for KV.
                self.engine.fail_remote_prefill(adm.seq_id);
                continue;
            };
            let prompt = self
                .engine
                .scheduler()
                .sequence_tokens(adm.seq_id)
                .map(|t| t.prompt.to_vec())
                .unwrap_or_default();
            let cancel = CancelToken::new();
            let request = PrefillRequest {
                request_id: a.request_id,
                prompt,
                params: a.params.clone(),
                cached_prefix_len: adm.num_cached_tokens,
                destination: KvDestination {
                    node: self.config.node_id,
                    blocks: adm.blocks.clone(),
                },
                holder,
                cancel: cancel.clone(),
            };
            match prefill.prefill(request, self.reply_tx.clone()) {
                Ok(()) => {
                    let incoming = IncomingTransfer::new(a.request_id, &self.kv_shape, &adm.blocks);
                    self.remote
                        .start(Instant::now(), adm.seq_id, incoming, cancel);
                }
                Err(e) => {
                    tracing::info!(request_id = %a.request_id, "prefill worker {} refused: {e}; prefilling locally", prefill.node_id());
                    self.engine.fail_remote_prefill(adm.seq_id);
                    self.kicked = true;
                }
            }
        }
    }

    fn record_admissions(&mut self) {
        let local = self
            .engine
            .last_admitted()
            .iter()
            .map(|a| (a.seq_id, a.num_cached_tokens));
        let remote = self
            .engine
            .last_remote_admitted()
            .iter()
            .map(|a| (a.seq_id, a.num_cached_tokens));
        let admitted: Vec<(SeqId, usize)> = local.chain(remote).collect();
        for (seq_id, cached) in admitted {
            let Some(a) = self.active.get_mut(&seq_id) else {
                continue;
            };
            if !std::mem::replace(&mut a.in_queue, false) {
                continue;
            }
            self.shared.queue.give_back();
            self.metrics
                .queue_seconds
                .record(a.enqueued_at.elapsed().as_secs_f64());
            self.metrics
                .prefix_queried_tokens
                .increment(u64::from(a.prompt_tokens));
            self.metrics.prefix_hit_tokens.increment(cached as u64);
        }
    }

    /// Streams one engine output; ends the request on `finish`.
    fn emit(&mut self, out: SeqOutput) {
        let Some(a) = self.active.get_mut(&out.seq_id) else {
            return;
        };
        if let Some(cached) = out.cached_tokens {
            a.cached_tokens = cached as u32;
        }
        let mut delivered = true;
        if let Some(s) = out.sampled {
            a.completion_tokens += 1;
            let event = TokenEvent {
                token: s.token,
                text: out.text,
                logprob: s.logprob,
                top_logprobs: s.top_logprobs,
            };
            delivered = a.events.send(GenerateEvent::Token(event)).is_ok();
        }
        if let Some(reason) = out.finish {
            let usage = Usage {
                prompt_tokens: a.prompt_tokens,
                completion_tokens: a.completion_tokens,
                // A migrated request's cache hits may reach into its generated tokens.
                cached_tokens: a.cached_tokens.min(a.prompt_tokens),
            };
            let _ = a.events.send(GenerateEvent::Finished {
                reason,
                text: String::new(),
                usage,
            });
            // The engine has already freed the sequence.
            self.forget(out.seq_id);
        } else if !delivered {
            self.remove(out.seq_id);
        }
    }

    /// Ends a request with an error.
    fn fail(&mut self, seq_id: SeqId, e: WorkerError) {
        if let Some(a) = self.active.get(&seq_id) {
            let _ = a.events.send(GenerateEvent::Error(e));
        }
        self.remove(seq_id);
    }

    /// Cancels a request: frees its blocks and stops its transfer.
    fn remove(&mut self, seq_id: SeqId) {
        self.engine.abort(seq_id);
        self.forget(seq_id);
    }

    fn forget(&mut self, seq_id: SeqId) {
        if let Some(a) = self.active.remove(&seq_id) {
            self.by_request.remove(&a.request_id);
            if a.in_queue {
                self.shared.queue.give_back();
            }
            if let Some(cancel) = self.remote.remove(seq_id) {
                cancel.cancel();
            }
        }
    }

    fn publish_load(&mut self) {
        let pulling = self.pulls.len();
        self.publisher
            .publish(&mut self.engine, pulling, &self.shared.load);
    }
}

impl<R: ModelRunner> Gather for Loop<R> {
    /// Blocks until a message or a chunk arrives, or `deadline` passes.
    fn wait(&mut self, deadline: Option<Instant>) {
        let mut sel = Select::new();
        if !self.inbox_closed {
            sel.recv(&self.inbox);
        }
        if !self.kv_closed {
            sel.recv(&self.kv_rx);
        }
        sel.recv(&self.reply_rx);
        sel.recv(self.pulls.replies());
        kvmesh_worker::engine_thread::ready_until(&mut sel, deadline);
    }

    /// Takes everything that has arrived: prefill and export replies first, then KV (so a
    /// reply's chunks, sent before it, are all here), then new requests. False on `Stop`.
    fn receive(&mut self) -> bool {
        for ended in self.pulls.on_replies(&mut self.engine) {
            self.pull_ended(ended);
        }
        for _ in 0..self.reply_rx.len() {
            let Ok(reply) = self.reply_rx.try_recv() else {
                break;
            };
            self.on_reply(reply);
        }
        for _ in 0..self.kv_rx.len().max(1) {
            match self.kv_rx.try_recv() {
                Ok(chunk) => self.on_chunk(chunk),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.kv_closed = true;
                    break;
                }
            }
        }
        loop {
            match self.inbox.try_recv() {
                Ok(Inbox::Generate(s)) => self.accept(*s),
                Ok(Inbox::Export(job)) => job.serve(
                    &self.engine,
                    &self.outbox,
                    self.config.export_timeout,
                    self.metrics.kv_exported_blocks.clone(),
                ),
                Ok(Inbox::Wake) => {}
                Ok(Inbox::Stop) => return false,
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.inbox_closed = true;
                    break;
                }
            }
        }
        true
    }
}
