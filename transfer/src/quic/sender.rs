//! The sending half: one cached connection per peer address, one unidirectional stream per
//! (destination node, request) carrying that request's frames.

use super::error_code;
use crate::chunk::KvChunk;
use crate::codec::{CodecLimits, FrameEncoder};
use crate::transport::TransportError;
use bytes::Bytes;
use kvmesh_common::{NodeId, RequestId};
use quinn::{ClientConfig, Connection, Endpoint, SendStream, WriteError};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

type StreamKey = (NodeId, RequestId);

/// A transfer's stream; the async mutex serialises concurrent sends of one request.
struct Slot {
    state: tokio::sync::Mutex<SlotState>,
    last_used: Mutex<Instant>,
}

struct SlotState {
    encoder: FrameEncoder,
    stream: Option<SendStream>,
}

pub(super) struct Outbound {
    endpoint: Endpoint,
    server_name: String,
    /// Client configs for loopback peers (large first datagrams) and for the rest.
    loopback_client: ClientConfig,
    remote_client: ClientConfig,
    limits: CodecLimits,
    peers: RwLock<HashMap<NodeId, SocketAddr>>,
    conns: Mutex<HashMap<SocketAddr, Arc<tokio::sync::Mutex<Option<Connection>>>>>,
    streams: Mutex<HashMap<StreamKey, Arc<Slot>>>,
}

impl Outbound {
    pub fn new(
        endpoint: Endpoint,
        server_name: String,
        loopback_client: ClientConfig,
        remote_client: ClientConfig,
        limits: CodecLimits,
    ) -> Self {
        Outbound {
            endpoint,
            server_name,
            loopback_client,
            remote_client,
            limits,
            peers: RwLock::default(),
            conns: Mutex::default(),
            streams: Mutex::default(),
        }
    }

    pub fn add_peer(&self, node: NodeId, addr: SocketAddr) {
        write(&self.peers).insert(node, addr);
    }

    pub fn remove_peer(&self, node: NodeId) {
        write(&self.peers).remove(&node);
    }

    pub async fn send(
        &self,
        dest: NodeId,
        chunk: KvChunk,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let key = (dest, chunk.header.request_id);
        let slot = self.slot(key);
        let result = tokio::time::timeout_at(deadline.into(), self.write(&slot, dest, chunk)).await;
        match result {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                self.discard(key, &slot, e.clone()).await;
                Err(e)
            }
            Err(_elapsed) => {
                // The write was cut short, maybe mid-frame: the stream cannot carry more.
                self.discard(key, &slot, TransportError::Timeout(dest))
                    .await;
                Err(TransportError::Timeout(dest))
            }
        }
    }

    /// Forgets the transfer's stream at once (a later send opens a new one) and finishes it:
    /// queued bytes still go out, then the peer sees its end.
    pub fn end(&self, key: StreamKey) -> impl std::future::Future<Output = ()> + Send + 'static {
        let slot = lock(&self.streams).remove(&key);
        async move {
            if let Some(slot) = slot {
                if let Some(mut s) = slot.state.lock().await.stream.take() {
                    let _ = s.finish();
                }
            }
        }
    }

    /// Ends the transfers idle for `idle` or longer; returns how many.
    pub async fn end_idle(&self, idle: Duration) -> usize {
        let now = Instant::now();
        let stale: Vec<StreamKey> = lock(&self.streams)
            .iter()
            .filter(|(_, slot)| now.duration_since(*lock(&slot.last_used)) >= idle)
            .map(|(k, _)| *k)
            .collect();
        for key in &stale {
            tracing::debug!(node = %key.0, request = %key.1, "finishing an idle KV transfer stream");
            self.end(*key).await;
        }
        stale.len()
    }

    pub fn open_streams(&self) -> usize {
        lock(&self.streams).len()
    }

    fn slot(&self, key: StreamKey) -> Arc<Slot> {
        let mut streams = lock(&self.streams);
        let slot = streams.entry(key).or_insert_with(|| {
            Arc::new(Slot {
                state: tokio::sync::Mutex::new(SlotState {
                    encoder: FrameEncoder::with_limits(key.0, key.1, self.limits),
                    stream: None,
                }),
                last_used: Mutex::new(Instant::now()),
            })
        });
        *lock(&slot.last_used) = Instant::now();
        slot.clone()
    }

    async fn write(&self, slot: &Slot, dest: NodeId, chunk: KvChunk) -> Result<(), TransportError> {
        let mut state = slot.state.lock().await;
        let mut head = Vec::new();
        // Encode first: a chunk the codec refuses must not open a stream.
        let mut encoder = state.encoder.clone();
        encoder
            .encode_head(&chunk, &mut head)
            .map_err(TransportError::Invalid)?;
        if state.stream.is_none() {
            let conn = self.connection(dest).await?;
            let stream = conn.open_uni().await.map_err(|e| conn_error(dest, e))?;
            state.stream = Some(stream);
        }
        state.encoder = encoder;
        let stream = state.stream.as_mut().expect("opened above");
        let mut bufs = [Bytes::from(head), Bytes::from(chunk.payload)];
        stream
            .write_all_chunks(&mut bufs)
            .await
            .map_err(|e| write_error(dest, e))?;
        *lock(&slot.last_used) = Instant::now();
        Ok(())
    }

    /// Drops a failed transfer's stream. A reset tells the receiver to discard the partial
    /// frame; frames still queued here are lost with it, so the transfer as a whole failed.
    async fn discard(&self, key: StreamKey, slot: &Arc<Slot>, why: TransportError) {
        {
            let mut streams = lock(&self.streams);
            if streams.get(&key).is_some_and(|s| Arc::ptr_eq(s, slot)) {
                streams.remove(&key);
            }
        }
        if let Some(mut s) = slot.state.lock().await.stream.take() {
            let _ = s.reset(error_code::SENDER_ABORTED);
        }
        tracing::debug!(node = %key.0, request = %key.1, error = %why, "KV transfer stream abandoned");
    }

    /// The cached connection to `dest`'s address, (re)connecting when there is none or it
    /// closed. One connect at a time per address.
    async fn connection(&self, dest: NodeId) -> Result<Connection, TransportError> {
        let addr = read(&self.peers)
            .get(&dest)
            .copied()
            .ok_or(TransportError::Unreachable(dest))?;
        let cell = lock(&self.conns).entry(addr).or_default().clone();
        let mut cached = cell.lock().await;
        if let Some(conn) = cached.as_ref() {
            if conn.close_reason().is_none() {
                return Ok(conn.clone());
            }
        }
        let config = if addr.ip().is_loopback() {
            self.loopback_client.clone()
        } else {
            self.remote_client.clone()
        };
        let conn = self
            .endpoint
            .connect_with(config, addr, &self.server_name)
            .map_err(|e| conn_error(dest, e))?
            .await
            .map_err(|e| {
                tracing::warn!(node = %dest, %addr, error = %e, "KV transfer connection failed");
                conn_error(dest, e)
            })?;
        *cached = Some(conn.clone());
        Ok(conn)
    }
}

fn conn_error(node: NodeId, e: impl std::fmt::Display) -> TransportError {
    TransportError::Connection {
        node,
        reason: e.to_string(),
    }
}

fn write_error(node: NodeId, e: WriteError) -> TransportError {
    match e {
        WriteError::Stopped(code) if code == error_code::UNKNOWN_NODE => {
            TransportError::Unreachable(node)
        }
        WriteError::Stopped(code) => TransportError::Refused {
            node,
            code: code.into_inner(),
        },
        other => conn_error(node, other),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn read<T>(m: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|e| e.into_inner())
}

fn write<T>(m: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|e| e.into_inner())
}
