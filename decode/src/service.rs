//! The decode node's gRPC service (`kvmesh.v1.Decode`) over a local [`DecodeHandle`].

use crate::handle::DecodeHandle;
use futures::{Stream, StreamExt};
use kvmesh_common::grpc::KvHolder;
use kvmesh_common::grpc::{self, pb};
use kvmesh_common::tls::ClusterTls;
use kvmesh_common::NodeId;
use kvmesh_transfer::NetworkTransport;
use kvmesh_worker::{
    DestinationAddresses, HolderDirectory, KvPull, PrefillClient, PrefillTarget, RemotePrefill,
};
use std::collections::{HashMap, HashSet};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Request, Response, Status};

/// Connections to the prefill nodes the router names, and to the nodes it names to pull
/// cached KV from, made on first use and kept.
pub struct PrefillDirectory {
    /// Where this node receives KV and serves pulls (told to every prefill node).
    addresses: DestinationAddresses,
    /// The cluster identity presented to prefill nodes (`None`: plaintext gRPC).
    tls: Option<ClusterTls>,
    connect_timeout: Duration,
    clients: Mutex<HashMap<NodeId, (String, RemotePrefill)>>,
    holders: HolderDirectory,
    /// This node and its transport, when it has RDMA to offer prefill nodes.
    rdma: Option<(NodeId, Arc<NetworkTransport>)>,
}

impl PrefillDirectory {
    /// `addresses`: where this node receives KV and serves pulls. Calls to other nodes go
    /// over mutual TLS when `tls` is given.
    pub fn new(
        addresses: DestinationAddresses,
        tls: Option<ClusterTls>,
        connect_timeout: Duration,
    ) -> Self {
        PrefillDirectory {
            holders: HolderDirectory::new(addresses.transfer.clone(), tls.clone(), connect_timeout),
            addresses,
            tls,
            connect_timeout,
            clients: Mutex::new(HashMap::new()),
            rdma: None,
        }
    }

    /// Swaps RDMA details with each prefill node that offers RDMA before its first use, so
    /// that it pushes `node`'s KV over RDMA (when `transport` has RDMA; else QUIC as before).
    pub fn with_rdma(mut self, node: NodeId, transport: Arc<NetworkTransport>) -> Self {
        self.rdma = transport.offers_rdma().then_some((node, transport));
        self
    }

    /// Connects RDMA with `client`'s node when an exchange is due: never tried, or the last
    /// exchange or link failed and its backoff has passed (the transport keeps that record);
    /// not when either side lacks RDMA or KV already comes over it.
    async fn rdma_exchange(&self, client: &RemotePrefill) -> Result<(), String> {
        let Some((me, transport)) = self.rdma.clone() else {
            return Ok(());
        };
        let peer = client.node_id();
        if !client.offers_rdma() || !transport.rdma_exchange_due(peer) {
            return Ok(());
        }
        // Verbs calls block in the device driver.
        let t = transport.clone();
        let mine = tokio::task::spawn_blocking(move || t.rdma_prepare(peer))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        let theirs = client
            .rdma_connect(me, &mine)
            .await
            .map_err(|e| e.to_string())?;
        tokio::task::spawn_blocking(move || transport.rdma_connect(peer, theirs))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        tracing::info!(node = %peer, "KV from this prefill node comes over RDMA");
        Ok(())
    }

    /// The RDMA exchange with `client`'s node if one is due. A failed one costs nothing but
    /// the speed: KV comes over QUIC (a prefill node whose RDMA writes fail resends them over
    /// QUIC), and the transport schedules the next try.
    async fn try_rdma(&self, client: &RemotePrefill) {
        if let Err(e) = self.rdma_exchange(client).await {
            tracing::warn!(node = %client.node_id(), "RDMA exchange failed: {e}; KV comes over QUIC");
        }
    }

    /// The prefill node `target` names, or `None` (prefill locally) when it cannot be
    /// reached.
    pub async fn get(&self, target: &grpc::PrefillNode) -> Option<PrefillTarget> {
        let known = self.lock().get(&target.node_id).cloned();
        if let Some((address, client)) = known {
            if address == target.address {
                // A link that failed earlier is tried again once its backoff has passed.
                self.try_rdma(&client).await;
                return Some(std::sync::Arc::new(client));
            }
        }
        let connected = RemotePrefill::connect(
            &target.address,
            self.tls.as_ref(),
            self.addresses.clone(),
            self.connect_timeout,
        )
        .await;
        match connected {
            Ok(client) if client.node_id_matches(target.node_id) => {
                self.try_rdma(&client).await;
                self.lock()
                    .insert(target.node_id, (target.address.clone(), client.clone()));
                Some(std::sync::Arc::new(client))
            }
            Ok(_) => {
                tracing::warn!(node = %target.node_id, address = %target.address,
                    "another node answers at this address; prefilling locally");
                None
            }
            Err(e) => {
                tracing::warn!(node = %target.node_id, "{e}; prefilling locally");
                None
            }
        }
    }

    /// Where to pull the cached prefix `holder` has (the connection is made on first use);
    /// `None` when its address is unusable (then the prefix is recomputed).
    pub fn pull_source(&self, holder: &KvHolder) -> Option<KvPull> {
        let source = self.holders.source(holder.node_id, &holder.address)?;
        Some(KvPull {
            source,
            blocks: holder.blocks,
        })
    }

    /// Forgets the connections to nodes not in `alive` (they left the mesh).
    pub fn retain(&self, alive: &HashSet<NodeId>) {
        self.lock().retain(|id, _| alive.contains(id));
        self.holders.retain(alive);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<NodeId, (String, RemotePrefill)>> {
        lock(&self.clients)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub struct DecodeService {
    handle: DecodeHandle,
    prefill: std::sync::Arc<PrefillDirectory>,
    accepted: AtomicU64,
}

impl DecodeService {
    pub fn new(handle: DecodeHandle, prefill: std::sync::Arc<PrefillDirectory>) -> Self {
        DecodeService {
            handle,
            prefill,
            accepted: AtomicU64::new(0),
        }
    }

    pub fn into_server(self) -> pb::decode_server::DecodeServer<Self> {
        pb::decode_server::DecodeServer::new(self)
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateEvent, Status>> + Send>>;

/// The events until the call's deadline; then `DEADLINE_EXCEEDED`, and the receiver is
/// dropped, which cancels the request here and, through its cancel token, on the prefill node.
fn until_deadline(
    mut events: crate::EventReceiver,
    deadline: tokio::time::Instant,
) -> impl Stream<Item = Result<pb::GenerateEvent, Status>> + Send {
    async_stream::stream! {
        let expired = tokio::time::sleep_until(deadline);
        tokio::pin!(expired);
        loop {
            tokio::select! {
                event = events.recv() => match event {
                    Some(e) => yield Ok(pb::GenerateEvent::from(&e)),
                    None => break,
                },
                () = &mut expired => {
                    yield Err(Status::deadline_exceeded("the request's deadline passed"));
                    break;
                }
            }
        }
    }
}

#[tonic::async_trait]
impl pb::decode_server::Decode for DecodeService {
    type GenerateStream = EventStream;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let timeout = grpc::timeout_of(request.metadata());
        let (request, placement) = grpc::generate_request_from_pb(request.into_inner())?;
        let prefill = match &placement.prefill {
            Some(t) => self.prefill.get(t).await,
            None => None,
        };
        let pull = placement
            .pull
            .as_ref()
            .and_then(|h| self.prefill.pull_source(h));
        // Dropping the stream (the router cancelled or went away) drops the receiver, which
        // the worker takes as a cancellation.
        let events = self.handle.generate_pulling(request, prefill, pull)?;
        self.accepted.fetch_add(1, Ordering::Relaxed);
        let stream: EventStream = match timeout {
            None => Box::pin(
                UnboundedReceiverStream::new(events).map(|e| Ok(pb::GenerateEvent::from(&e))),
            ),
            Some(t) => Box::pin(until_deadline(events, tokio::time::Instant::now() + t)),
        };
        Ok(Response::new(stream))
    }

    async fn health(
        &self,
        _request: Request<pb::HealthRequest>,
    ) -> Result<Response<pb::HealthReply>, Status> {
        let h = &self.handle;
        let mut reply = grpc::health_reply(
            h.node_id(),
            !h.is_draining(),
            h.load(),
            self.accepted.load(Ordering::Relaxed),
        );
        reply.role = pb::NodeRole::Decode as i32;
        Ok(Response::new(reply))
    }

    async fn drain(
        &self,
        _request: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::DrainReply>, Status> {
        self.handle.drain();
        Ok(Response::new(pb::DrainReply {}))
    }
}
