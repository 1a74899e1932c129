//! `kvmesh prefill`: a prefill node. Computes prompts it is asked for over gRPC and pushes
//! their KV to the decode node that asked: over RDMA where both have it, else QUIC. Decode
//! nodes may also pull prefixes it has cached (`KvCache`).

use super::engine_args::EngineArgs;
use super::{kv_event_sink, run_node, runtime, KvPublisherSlot, MeshArgs};
use crate::model_args::{self, ModelArgs};
use anyhow::{Context, Result};
use clap::Args;
use kvmesh_common::{NodeInfo, NodeRole};
use kvmesh_prefill::{KvCacheService, LearnPeer, PrefillConfig, PrefillService, PrefillWorker};
use kvmesh_transfer::Transport;
use std::net::SocketAddr;
use std::sync::Arc;

#[derive(Args, Debug)]
pub struct PrefillArgs {
    #[command(flatten)]
    pub mesh: MeshArgs,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

pub fn run(args: &PrefillArgs) -> Result<()> {
    let path = args.model.prepare()?;
    let loaded = model_args::load(&path)?;
    let node_id = args.mesh.node_id();
    let engine = args
        .engine
        .config()
        .llama_engine(&loaded)
        .context("building the engine")?;
    // Sends only: any UDP port on the listen address.
    let quic_listen = SocketAddr::new(args.mesh.listen.ip(), 0);
    let tls = args.mesh.cluster_tls()?;
    let network = Arc::new(args.mesh.kv_transport(quic_listen, tls.as_ref())?);
    let transport: Arc<dyn Transport> = network.clone();
    let kv_events = KvPublisherSlot::default();
    let config = PrefillConfig {
        kv_events: Some(kv_event_sink(&kv_events)),
        ..PrefillConfig::new(node_id)
    };
    let worker =
        PrefillWorker::spawn(config, engine, transport).context("starting the prefill worker")?;
    let handle = worker.handle();
    let learn: LearnPeer = {
        let network = network.clone();
        Arc::new(move |node, addr| network.add_peer(node, addr))
    };
    let kv_cache = KvCacheService::new(Arc::new(handle.clone()), learn.clone());
    let service =
        PrefillService::new(handle.clone(), loaded.fingerprint.0, learn).with_rdma(network);
    let info = NodeInfo {
        node_id,
        role: NodeRole::Prefill,
        address: args.mesh.advertise().to_string(),
        transfer_address: String::new(),
        model_fingerprint: loaded.fingerprint.0,
        kv_blocks_total: handle.load().kv_blocks_total,
    };
    runtime()?.block_on(async {
        let discovery = args.mesh.connect().await?;
        let routes =
            tonic::service::Routes::new(service.into_server()).add_service(kv_cache.into_server());
        run_node(
            &args.mesh,
            tls.as_ref(),
            &discovery,
            routes,
            info,
            &kv_events,
            worker,
        )
        .await
    })?;
    tracing::info!("stopped");
    Ok(())
}
