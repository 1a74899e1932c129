//! `kvmesh decode`: a decode node. Takes Generate calls from routers, has the prefill node
//! they name compute the prompt (its KV arrives over QUIC on this node's port), pulls cached
//! prefixes from the node they name, decodes with continuous batching and streams tokens
//! back. Serves its own cache to other nodes' pulls (`KvCache`).

use super::config::DecodeNodeConfig;
use super::engine_args::EngineArgs;
use super::{
    forget_departed_nodes, kv_event_sink, run_node, runtime, KvPublisherSlot, MeshArgs, PullArgs,
};
use crate::config::{env_vars, ConfigArgs};
use crate::model_args::{self, ModelArgs};
use anyhow::{Context, Result};
use clap::Args;
use kvmesh_common::{NodeInfo, NodeRole};
use kvmesh_decode::{DecodeConfig, DecodeService, DecodeWorker, PrefillDirectory};
use kvmesh_transfer::Transport;
use kvmesh_worker::{DestinationAddresses, KvCacheService, LearnPeer};
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;

/// The flags of `kvmesh decode`, layered over its TOML (`DecodeNodeConfig`).
#[derive(Args, Debug, Serialize)]
pub struct DecodeArgs {
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
    /// Prompts whose uncached part is shorter than this are prefilled here.
    #[arg(long, env = env_vars::LOCAL_PREFILL_MAX_TOKENS)]
    pub local_prefill_max_tokens: Option<usize>,
    /// Let prefill nodes pull the prefix of a prompt this node holds instead of recomputing
    /// it (`false`: they recompute).
    #[arg(long, env = env_vars::PREFILL_PULLS, action = clap::ArgAction::Set)]
    pub prefill_pulls: Option<bool>,
    #[command(flatten)]
    #[serde(skip)]
    pub config: ConfigArgs,
}

pub fn run(args: &DecodeNodeConfig) -> Result<()> {
    let path = model_args::prepare(args.model.as_deref(), args.threads)?;
    let loaded = model_args::load(&path)?;
    let node_id = args.mesh.node_id();
    let engine = args
        .engine
        .llama_engine(&loaded)
        .context("building the engine")?;
    let block_size = engine.scheduler().config().block_size;
    let tls = args.mesh.cluster_tls()?;
    let network = Arc::new(args.mesh.kv_transport(args.mesh.listen()?, tls.as_ref())?);
    let transport: Arc<dyn Transport> = network.clone();
    let kv_events = KvPublisherSlot::default();
    let mut config = DecodeConfig::new(node_id);
    config.kv_events = Some(kv_event_sink(&kv_events));
    config.prefill_pulls = args.prefill_pulls;
    config.pull_timeout = args.pull_timeout;
    config.local_prefill_max_tokens = args.local_prefill_max_tokens;
    let worker =
        DecodeWorker::spawn(config, engine, transport).context("starting the decode worker")?;
    let handle = worker.handle();
    let advertise = args.mesh.advertise()?.to_string();
    let info = NodeInfo {
        node_id,
        role: NodeRole::Decode,
        address: advertise.clone(),
        transfer_address: advertise.clone(),
        model_fingerprint: loaded.fingerprint,
        block_size,
        kv_blocks_total: handle.kv_blocks_total(),
    };
    // gRPC (with KvCache) and QUIC share the advertised host:port.
    let addresses = DestinationAddresses {
        transfer: advertise.clone(),
        holder: advertise.clone(),
    };
    let peers = network.clone();
    runtime()?.block_on(async {
        let discovery = args.mesh.connect().await?;
        let prefill = Arc::new(
            PrefillDirectory::new(addresses, tls.clone(), Duration::from_secs(1))
                .with_rdma(node_id, network.clone()),
        );
        let directory = prefill.clone();
        forget_departed_nodes(&discovery, move |alive| directory.retain(alive));
        let learn: LearnPeer = Arc::new(move |node, addr| peers.add_peer(node, addr));
        let kv_cache = KvCacheService::new(Arc::new(handle.clone()), learn);
        let routes = tonic::service::Routes::new(DecodeService::new(handle, prefill).into_server())
            .add_service(kv_cache.into_server());
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
