//! The receiving half: accept connections and streams, decode each stream, and hand its
//! verified chunks to the queue of the node its preamble names.

use super::error_code;
use crate::chunk::KvChunk;
use crate::codec::{CodecLimits, FrameDecoder};
use crossbeam_channel::{Sender, TrySendError};
use kvmesh_common::NodeId;
use quinn::{Endpoint, Incoming, ReadError, RecvStream};
use std::collections::HashMap;
use std::sync::{Arc, RwLock};

/// Largest piece taken from quinn at a time; the decoder copies it straight into the
/// payload being assembled.
const READ_MAX: usize = 1 << 20;

pub(super) struct Inbound {
    pub limits: CodecLimits,
    pub nodes: RwLock<HashMap<NodeId, Sender<KvChunk>>>,
}

impl Inbound {
    /// The queue of `node` if it is bound now.
    fn queue(&self, node: NodeId) -> Option<Sender<KvChunk>> {
        self.nodes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&node)
            .cloned()
    }
}

pub(super) async fn accept_loop(endpoint: Endpoint, inbound: Arc<Inbound>) {
    while let Some(incoming) = endpoint.accept().await {
        tokio::spawn(connection(incoming, inbound.clone()));
    }
}

async fn connection(incoming: Incoming, inbound: Arc<Inbound>) {
    let remote = incoming.remote_address();
    let conn = match incoming.await {
        Ok(conn) => conn,
        Err(e) => {
            tracing::warn!(%remote, error = %e, "KV transfer handshake failed");
            return;
        }
    };
    loop {
        match conn.accept_uni().await {
            Ok(stream) => {
                tokio::spawn(read_stream(stream, inbound.clone()));
            }
            Err(e) => {
                tracing::debug!(%remote, error = %e, "KV transfer connection closed");
                return;
            }
        }
    }
}

/// Decodes one transfer stream. A stream for an unbound node, or one that fails to decode,
/// is stopped with an error code (the sender's next write fails); the chunks it delivered
/// before stay delivered, and the receiver, missing the rest, times out and recomputes.
async fn read_stream(mut stream: RecvStream, inbound: Arc<Inbound>) {
    let mut decoder = FrameDecoder::new(inbound.limits);
    let mut node = None;
    loop {
        match stream.read_chunk(READ_MAX, true).await {
            Ok(Some(piece)) => decoder.push(&piece.bytes),
            Ok(None) => {
                if let Err(e) = decoder.finish() {
                    tracing::warn!(preamble = ?decoder.preamble(), error = %e, "KV transfer stream ended mid-frame");
                }
                return;
            }
            Err(ReadError::Reset(code)) => {
                tracing::debug!(preamble = ?decoder.preamble(), %code, "KV transfer stream reset by its sender");
                return;
            }
            Err(e) => {
                tracing::debug!(preamble = ?decoder.preamble(), error = %e, "KV transfer stream lost");
                return;
            }
        }
        loop {
            let next = decoder.next_chunk();
            if node.is_none() {
                if let Some(p) = decoder.preamble() {
                    if inbound.queue(p.dest).is_none() {
                        tracing::warn!(node = %p.dest, request = %p.request, "KV transfer for a node not bound here; refusing it");
                        let _ = stream.stop(error_code::UNKNOWN_NODE);
                        return;
                    }
                    node = Some(p.dest);
                }
            }
            match next {
                Ok(Some(chunk)) => {
                    let dest = node.expect("a chunk follows its preamble");
                    if !deliver(&inbound, dest, chunk).await {
                        tracing::warn!(node = %dest, "KV transfer for a node no longer bound; refusing it");
                        let _ = stream.stop(error_code::UNKNOWN_NODE);
                        return;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(preamble = ?decoder.preamble(), error = %e, "malformed KV transfer stream; refusing it");
                    let _ = stream.stop(error_code::MALFORMED);
                    return;
                }
            }
        }
    }
}

/// Queues `chunk` for `node`, waiting while the queue is full: meanwhile this stream is not
/// read, so QUIC flow control holds its sender back. False if the node is not bound.
async fn deliver(inbound: &Inbound, node: NodeId, chunk: KvChunk) -> bool {
    let Some(queue) = inbound.queue(node) else {
        return false;
    };
    match queue.try_send(chunk) {
        Ok(()) => true,
        Err(TrySendError::Disconnected(_)) => false,
        Err(TrySendError::Full(chunk)) => tokio::task::spawn_blocking(move || queue.send(chunk))
            .await
            .is_ok_and(|sent| sent.is_ok()),
    }
}
