//! Pulls: a node sends the KV of prefix blocks it has cached to a node that wants them,
//! instead of that node recomputing them. The node that wants them (a decode or a prefill
//! worker, see [`crate::Puller`]) reserves blocks and sends an [`ExportRequest`]; the holder (a prefill or a decode worker, in this
//! process or across the network through `KvCache.Export`) reads the longest leading run of
//! the asked-for blocks it holds, in its pool or a tier below, between two of its engine
//! steps, and pushes it through the KV transport, one chunk per layer, from a sender thread
//! ([`crate::KvOutbox`]: a slow puller never holds up the holder's engine); then it replies.

use crate::outbox::KvOutbox;
use crate::request::KvDestination;
use crossbeam_channel::Sender;
use kvmesh_common::{NodeId, RequestId, SequenceHash};
use kvmesh_engine::llm_engine::LlmEngine;
use kvmesh_engine::runner::ModelRunner;
use kvmesh_transfer::{BlockShape, KvChunk, Transport, TransportError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Puller -> holder: push the KV of `hashes` (sequence hashes, in prompt order) into
/// `destination.blocks` (one per hash).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportRequest {
    /// Names the transfer in every chunk; the puller picks a fresh one per pull.
    pub transfer_id: RequestId,
    pub hashes: Vec<SequenceHash>,
    pub destination: KvDestination,
}

/// The holder sent the first `blocks` asked-for blocks (every layer); the rest it lacks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExportDone {
    pub blocks: usize,
    pub bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ExportError {
    #[error("invalid export request: {0}")]
    InvalidRequest(String),
    #[error("none of the blocks is cached here")]
    NotHeld,
    #[error("the worker is stopped")]
    Unavailable,
    #[error("KV transfer failed: {0}")]
    Transfer(#[from] TransportError),
    #[error("reading cached KV: {0}")]
    Engine(String),
    /// The call to a remote holder failed (unreachable, reset, timed out).
    #[error("export call failed: {0}")]
    Rpc(String),
}

/// Holder -> puller: how one export ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportReply {
    pub transfer_id: RequestId,
    pub result: Result<ExportDone, ExportError>,
}

/// A node that can push cached KV, as a puller sees it: in this process (a worker handle) or
/// across the network ([`crate::RemoteExporter`]).
pub trait KvExporter: Send + Sync + std::fmt::Debug {
    fn node_id(&self) -> NodeId;

    /// Queues `request`; its reply arrives on `reply` (exactly one, also when the holder stops
    /// or the connection fails). Never blocks. An error here means no reply will come.
    fn export(&self, request: ExportRequest, reply: Sender<ExportReply>)
        -> Result<(), ExportError>;
}

/// How pullers hold a node to pull from.
pub type ExportSource = Arc<dyn KvExporter>;

/// An export queued at a worker thread, with where its reply goes.
#[derive(Debug)]
pub struct ExportJob {
    pub request: ExportRequest,
    pub reply: Sender<ExportReply>,
}

impl ExportJob {
    /// Queues an export on a worker's `inbox`, as the message `wrap` makes of it.
    pub fn queue<M>(
        inbox: &Sender<M>,
        wrap: fn(Box<ExportJob>) -> M,
        request: ExportRequest,
        reply: Sender<ExportReply>,
    ) -> Result<(), ExportError> {
        inbox
            .try_send(wrap(Box::new(ExportJob { request, reply })))
            .map_err(|_| ExportError::Unavailable)
    }

    /// Serves the export: reads its KV out of `engine` here, between two engine steps, and
    /// hands the sending and the reply to `outbox`, so a slow puller never holds up the
    /// engine thread. `exported` counts the blocks of each export that completes.
    pub fn serve<R: ModelRunner>(
        self,
        engine: &LlmEngine<R>,
        outbox: &KvOutbox,
        send_timeout: Duration,
        exported: metrics::Counter,
    ) {
        match read_export(engine, &self.request) {
            Err(e) => self.answer(Err(e)),
            Ok(read) => {
                let dest = self.request.destination.node;
                outbox.hand_over(
                    dest,
                    Box::new(move |transport| {
                        let result = read.send(transport, send_timeout);
                        if let Ok(done) = &result {
                            exported.increment(done.blocks as u64);
                        }
                        self.answer(result);
                    }),
                );
            }
        }
    }

    /// Answers an export that reached a stopping worker.
    pub fn refuse(self) {
        self.answer(Err(ExportError::Unavailable));
    }

    fn answer(self, result: Result<ExportDone, ExportError>) {
        // A puller that went away needs no answer.
        let _ = self.reply.send(ExportReply {
            transfer_id: self.request.transfer_id,
            result,
        });
    }
}

/// An export's KV, read out of the engine and sealed, ready to send.
pub struct ReadExport {
    transfer_id: RequestId,
    dest: NodeId,
    chunks: Vec<KvChunk>,
    blocks: usize,
    bytes: u64,
}

/// Reads the KV an export asks for out of `engine` (on the engine thread: a copy).
pub fn read_export<R: ModelRunner>(
    engine: &LlmEngine<R>,
    request: &ExportRequest,
) -> Result<ReadExport, ExportError> {
    let ExportRequest {
        transfer_id,
        hashes,
        destination,
    } = request;
    if hashes.is_empty() || hashes.len() != destination.blocks.len() {
        return Err(ExportError::InvalidRequest(format!(
            "{} hashes for {} destination blocks",
            hashes.len(),
            destination.blocks.len()
        )));
    }
    let kv = engine
        .export_prefix(hashes)
        .map_err(|e| ExportError::Engine(e.to_string()))?;
    if kv.blocks == 0 {
        return Err(ExportError::NotHeld);
    }
    let shape = engine.runner().kv_shape();
    let block_shape = BlockShape {
        num_kv_heads: shape.num_kv_heads as u32,
        block_size: shape.block_size as u32,
        head_dim: shape.head_dim as u32,
    };
    let dest = &destination.blocks[..kv.blocks];
    let mut bytes = 0;
    let chunks = kv
        .layers
        .into_iter()
        .enumerate()
        .map(|(layer, payload)| {
            bytes += payload.len() as u64;
            KvChunk::seal(
                *transfer_id,
                layer..layer + 1,
                dest.to_vec(),
                block_shape,
                payload,
            )
            .expect("the payload matches its header by construction")
        })
        .collect();
    Ok(ReadExport {
        transfer_id: *transfer_id,
        dest: destination.node,
        chunks,
        blocks: kv.blocks,
        bytes,
    })
}

impl ReadExport {
    /// Sends the chunks in layer order, each waiting at most `send_timeout` for room.
    pub fn send(
        self,
        transport: &dyn Transport,
        send_timeout: Duration,
    ) -> Result<ExportDone, ExportError> {
        let dest = self.dest;
        let result = self
            .chunks
            .into_iter()
            .try_for_each(|chunk| transport.send(dest, chunk, Instant::now() + send_timeout));
        transport.end_transfer(dest, self.transfer_id);
        result?;
        Ok(ExportDone {
            blocks: self.blocks,
            bytes: self.bytes,
        })
    }
}
