//! `kvmesh router`: the OpenAI-compatible HTTP API in front of the mesh that etcd describes.

use super::{runtime, MeshArgs};
use crate::admission_args::AdmissionArgs;
use crate::model_args::{self, ModelArgs};
use anyhow::{Context, Result};
use clap::Args;
use kvmesh_kvstore::{Discovery, EtcdPrefixIndex};
use kvmesh_router::policy::{DisaggConfig, RoutingConfig};
use kvmesh_router::routing::Routing;
use kvmesh_router::{RemoteBackend, RemoteConfig, Router, RouterConfig};
use std::sync::Arc;

#[derive(Args, Debug)]
pub struct RouterArgs {
    #[command(flatten)]
    pub mesh: MeshArgs,
    /// The model's tokenizer and chat template are read from here.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Comma-separated API keys; requests must send one as a bearer token.
    #[arg(
        long,
        env = "KVMESH_API_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_keys: Option<Vec<String>>,
    #[command(flatten)]
    pub admission: AdmissionArgs,
    /// How to pick nodes: kv_aware (default), least_loaded, round_robin, random, power_of_two.
    #[arg(long, env = "KVMESH_ROUTING_POLICY", default_value = "kv_aware")]
    pub routing_policy: RoutingConfig,
    /// Prompts whose uncached part (on the chosen decode node) is shorter than this are
    /// prefilled there, without a prefill node.
    #[arg(long, env = "KVMESH_LOCAL_PREFILL_MAX_TOKENS", default_value_t = DisaggConfig::default().local_prefill_max_tokens)]
    pub local_prefill_max_tokens: usize,
    /// Name a node to pull cached prefix blocks from when it holds at least this many more
    /// of the prompt than the chosen decode node (0: never pull).
    #[arg(long, env = "KVMESH_PULL_MIN_BLOCKS", default_value_t = DisaggConfig::default().pull_min_blocks)]
    pub pull_min_blocks: usize,
    /// How many times a request whose decode node fails mid-stream may move to another one
    /// (0: never; the client gets an error instead).
    #[arg(long, env = "KVMESH_MAX_MIGRATIONS", default_value_t = RemoteConfig::default().max_migrations)]
    pub max_migrations: usize,
}

pub fn run(args: &RouterArgs) -> Result<()> {
    let path = args.model.prepare()?;
    // Text metadata only: the router tokenizes, it never runs the model.
    let model = model_args::read_text(&path)?;
    let mut config = RouterConfig {
        listen: args.mesh.listen,
        ..RouterConfig::default()
    };
    config.max_context = config.max_context.min(model.max_context);
    if let Some(keys) = &args.api_keys {
        config.api_keys = keys.iter().filter(|k| !k.is_empty()).cloned().collect();
    }
    args.admission.apply(&mut config);
    config
        .validate()
        .map_err(|e| anyhow::anyhow!("invalid router config: {e}"))?;
    let tls = args.mesh.cluster_tls()?;
    runtime()?.block_on(async {
        let discovery = args.mesh.connect().await?;
        let discovery: Arc<dyn Discovery> = Arc::new(discovery);
        let index = EtcdPrefixIndex::connect(args.mesh.etcd_config())
            .await
            .context("watching the prefix index in etcd")?;
        // Prompts are hashed with the block size the nodes announce.
        let routing = Routing::new(
            args.routing_policy.build(),
            DisaggConfig {
                local_prefill_max_tokens: args.local_prefill_max_tokens,
                pull_min_blocks: args.pull_min_blocks,
                ..DisaggConfig::default()
            },
            Arc::new(index.clone()),
            model.fingerprint,
        );
        tracing::info!(policy = routing.policy_name(), "routing");
        super::metrics::export_index_stats(index, args.mesh.node_id());
        let backend = Arc::new(RemoteBackend::new(
            discovery,
            RemoteConfig {
                max_migrations: args.max_migrations,
                tls,
                ..RemoteConfig::default()
            },
            routing,
        ));
        let router = Router::new(config, backend.clone(), Arc::new(model.tokenizer))
            .map_err(|e| anyhow::anyhow!("invalid router config: {e}"))?;
        let listener = tokio::net::TcpListener::bind(args.mesh.listen)
            .await
            .with_context(|| format!("binding {}", args.mesh.listen))?;
        tracing::info!(address = %listener.local_addr()?, "router serving the OpenAI API");
        router
            .serve(listener, crate::serve::shutdown_signal())
            .await
            .context("HTTP server")
    })?;
    tracing::info!("stopped");
    Ok(())
}
