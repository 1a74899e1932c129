//! `kvmesh prefill`: a prefill node. Computes prompts it is asked for over gRPC and pushes
//! their KV to the decode node that asked: over RDMA where both have it, else QUIC. A prefix
//! the decode node holds and this node lacks is pulled from it (into this node's QUIC port)
//! when that beats recomputing it. Other nodes may pull prefixes it has cached (`KvCache`).

use super::config::PrefillNodeConfig;
use super::engine_args::EngineArgs;
use super::{
    forget_departed_nodes, kv_event_sink, run_node, runtime, KvPublisherSlot, MeshArgs, PullArgs,
};
use crate::config::ConfigArgs;
use crate::model_args::{self, ModelArgs};
use anyhow::{Context, Result};
use clap::Args;
use kvmesh_common::{NodeInfo, NodeRole};
use kvmesh_prefill::{PrefillConfig, PrefillService, PrefillWorker};
use kvmesh_transfer::Transport;
use kvmesh_worker::{HolderDirectory, KvCacheService, LearnPeer};
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;

/// The flags of `kvmesh prefill`, layered over its TOML (`PrefillNodeConfig`).
#[derive(Args, Debug, Serialize)]
pub struct PrefillArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub mesh: MeshArgs,
    #[command(flatten)]
    #[serde(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    #[serde(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    #[serde(flatten)]
    pub pulls: PullArgs,
    #[command(flatten)]
    #[serde(skip)]
    pub config: ConfigArgs,
}

pub fn run(args: &PrefillNodeConfig) -> Result<()> {
    let path = model_args::prepare(args.model.as_deref(), args.threads)?;
    let loaded = model_args::load(&path)?;
    let node_id = args.mesh.node_id();
    let engine = args
        .engine
        .llama_engine(&loaded)
        .context("building the engine")?;
    let block_size = engine.scheduler().config().block_size;
    // Pulled KV arrives on the gRPC port's number, over UDP.
    let tls = args.mesh.cluster_tls()?;
    let network = Arc::new(args.mesh.kv_transport(args.mesh.listen()?, tls.as_ref())?);
    let transport: Arc<dyn Transport> = network.clone();
    let kv_events = KvPublisherSlot::default();
    let config = PrefillConfig {
        kv_events: Some(kv_event_sink(&kv_events)),
        pull_timeout: args.pull_timeout,
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
    let advertise = args.mesh.advertise()?.to_string();
    let info = NodeInfo {
        node_id,
        role: NodeRole::Prefill,
        address: advertise.clone(),
        transfer_address: advertise.clone(),
        model_fingerprint: loaded.fingerprint,
        block_size,
        kv_blocks_total: handle.kv_blocks_total(),
    };
    runtime()?.block_on(async {
        let discovery = args.mesh.connect().await?;
        let holders = Arc::new(HolderDirectory::new(
            advertise,
            tls.clone(),
            Duration::from_secs(1),
        ));
        let directory = holders.clone();
        forget_departed_nodes(&discovery, move |alive| directory.retain(alive));
        let service = PrefillService::new(handle.clone(), loaded.fingerprint, learn)
            .with_rdma(network)
            .with_pulls(holders);
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
