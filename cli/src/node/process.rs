//! A prefill or decode node process: loads the model once, builds its engine, and runs the
//! node ([`super::lifecycle`]) in the role it starts in. Both roles' settings are set up at
//! start, so the node can switch to either.

use super::lifecycle::run_node;
use super::roles::RoleKit;
use super::{forget_departed_nodes, kv_event_sink, runtime, KvPublisherSlot};
use crate::model_args;
use crate::node::config::MeshNodeConfig;
use anyhow::{Context, Result};
use kvmesh_common::{NodeInfo, NodeRole};
use kvmesh_decode::{DecodeConfig, PrefillDirectory};
use kvmesh_engine::engine_config::EngineConfig;
use kvmesh_prefill::PrefillConfig;
use kvmesh_worker::{DestinationAddresses, HolderDirectory, LearnPeer};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// What `kvmesh prefill` and `kvmesh decode` run. The decode role's own settings are those
/// `kvmesh decode` takes; a node started as `kvmesh prefill` uses their defaults when it
/// switches to decode.
pub struct WorkerNode<'a> {
    pub role: NodeRole,
    pub mesh: &'a MeshNodeConfig,
    pub model: Option<&'a Path>,
    pub threads: Option<usize>,
    pub engine: &'a EngineConfig,
    pub pull_timeout: Duration,
    pub local_prefill_max_tokens: Option<usize>,
    pub prefill_pulls: Option<bool>,
}

/// How long a node waits to connect to a peer before giving up on it.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

pub fn run(args: WorkerNode<'_>) -> Result<()> {
    let path = model_args::prepare(args.model, args.threads)?;
    let tls = args.mesh.cluster_tls()?;
    let node_id = args.mesh.node_id(tls.as_ref())?;
    let loaded = model_args::load(&path)?;
    super::metrics::count_model_load(node_id);
    let engine = args
        .engine
        .llama_engine(&loaded)
        .context("building the engine")?;
    let block_size = engine.scheduler().config().block_size;
    let kv_blocks_total = engine.scheduler().pool().num_blocks();
    // KV (pushed prompts, pulled prefixes) arrives on the gRPC port's number, over UDP.
    let network = Arc::new(args.mesh.kv_transport(args.mesh.listen()?, tls.as_ref())?);
    let kv_events = KvPublisherSlot::default();
    let prefill = PrefillConfig {
        kv_events: Some(kv_event_sink(&kv_events)),
        pull_timeout: args.pull_timeout,
        ..PrefillConfig::new(node_id)
    };
    let mut decode = DecodeConfig::new(node_id);
    decode.kv_events = Some(kv_event_sink(&kv_events));
    decode.pull_timeout = args.pull_timeout;
    if let Some(n) = args.local_prefill_max_tokens {
        decode.local_prefill_max_tokens = n;
    }
    if let Some(p) = args.prefill_pulls {
        decode.prefill_pulls = p;
    }
    let advertise = args.mesh.advertise()?.to_string();
    let info = NodeInfo {
        node_id,
        role: args.role,
        address: advertise.clone(),
        transfer_address: advertise.clone(),
        model_fingerprint: loaded.fingerprint,
        block_size,
        kv_blocks_total,
    };
    // gRPC (with KvCache) and QUIC share the advertised host:port.
    let addresses = DestinationAddresses {
        transfer: advertise.clone(),
        holder: advertise.clone(),
    };
    runtime()?.block_on(async {
        let discovery = args.mesh.connect().await?;
        let holders = Arc::new(HolderDirectory::new(
            advertise,
            tls.clone(),
            CONNECT_TIMEOUT,
        ));
        let prefill_nodes = Arc::new(
            PrefillDirectory::new(addresses, tls.clone(), CONNECT_TIMEOUT)
                .with_rdma(node_id, network.clone()),
        );
        let (h, p) = (holders.clone(), prefill_nodes.clone());
        forget_departed_nodes(&discovery, move |alive| {
            h.retain(alive);
            p.retain(alive);
        });
        let learn: LearnPeer = {
            let network = network.clone();
            Arc::new(move |node, addr| network.add_peer(node, addr))
        };
        let kit = RoleKit {
            fingerprint: loaded.fingerprint,
            network,
            learn,
            prefill,
            decode,
            holders,
            prefill_nodes,
        };
        run_node(
            args.mesh,
            tls.as_ref(),
            &discovery,
            info,
            &kv_events,
            kit,
            engine,
        )
        .await
    })?;
    tracing::info!("stopped");
    Ok(())
}
