//! `kvmesh router`: the OpenAI-compatible HTTP API in front of the mesh that etcd describes.

use super::config::RouterNodeConfig;
use super::{runtime, MeshArgs};
use crate::admission_args::AdmissionArgs;
use crate::config::{env_vars, ConfigArgs};
use crate::model_args::{self, ModelArgs};
use anyhow::{Context, Result};
use clap::Args;
use humantime_serde::re::humantime;
use kvmesh_kvstore::{Discovery, EtcdPrefixIndex};
use kvmesh_router::policy::RoutingConfig;
use kvmesh_router::routing::Routing;
use kvmesh_router::{MeshBackendConfig, RemoteBackend, RemoteConfig, Router, StreamIdleConfig};
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;

/// The flags of `kvmesh router`, layered over its TOML (`RouterNodeConfig`).
#[derive(Args, Debug, Serialize)]
pub struct RouterArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub mesh: MeshArgs,
    /// The model's tokenizer and chat template are read from here.
    #[command(flatten)]
    #[serde(flatten)]
    pub model: ModelArgs,
    /// Comma-separated API keys; requests must send one as a bearer token.
    #[arg(
        long,
        env = env_vars::API_KEYS,
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_keys: Option<Vec<String>>,
    #[command(flatten)]
    #[serde(flatten)]
    pub admission: AdmissionArgs,
    /// How to pick nodes: kv_aware (default), least_loaded, round_robin, random, power_of_two.
    #[arg(long, env = env_vars::ROUTING_POLICY)]
    pub routing_policy: Option<RoutingConfig>,
    /// Prompts whose uncached part (on the chosen decode node) is shorter than this are
    /// prefilled there, without a prefill node.
    #[arg(long, env = env_vars::LOCAL_PREFILL_MAX_TOKENS)]
    pub local_prefill_max_tokens: Option<usize>,
    /// Name a node to pull cached prefix blocks from when it holds at least this many more
    /// of the prompt than the chosen decode node (0: never pull).
    #[arg(long, env = env_vars::PULL_MIN_BLOCKS)]
    pub pull_min_blocks: Option<usize>,
    /// How many times a request whose decode node fails mid-stream may move to another one
    /// (0: never; the client gets an error instead).
    #[arg(long, env = env_vars::MAX_MIGRATIONS)]
    pub max_migrations: Option<usize>,
    /// The least silence after a token that makes a decode node's stream count as hung
    /// (then it migrates); the bound grows to 20 of the node's step times when those are
    /// longer (e.g. 2s, 500ms).
    #[arg(long, env = env_vars::STREAM_IDLE_TIMEOUT, value_parser = humantime::parse_duration)]
    #[serde(with = "humantime_serde")]
    pub stream_idle_timeout: Option<Duration>,
    #[command(flatten)]
    #[serde(skip)]
    pub config: ConfigArgs,
}

pub fn run(args: &RouterNodeConfig) -> Result<()> {
    let path = model_args::prepare(args.model.as_deref(), args.threads)?;
    // Text metadata only: the router tokenizes, it never runs the model.
    let model = model_args::read_text(&path)?;
    let mut config = args.router.clone();
    config.max_context = config.max_context.min(model.max_context);
    config
        .validate()
        .map_err(|e| anyhow::anyhow!("invalid router config: {e}"))?;
    let listen = args.mesh.listen()?;
    let tls = args.mesh.cluster_tls()?;
    let node_id = args.mesh.node_id(tls.as_ref())?;
    runtime()?.block_on(async {
        let discovery = args.mesh.connect().await?;
        let discovery: Arc<dyn Discovery> = Arc::new(discovery);
        let index = EtcdPrefixIndex::connect(args.mesh.etcd_config())
            .await
            .context("watching the prefix index in etcd")?;
        // Prompts are hashed with the block size the nodes announce.
        let routing = Routing::new(
            args.routing.build(),
            args.disaggregation.clone(),
            Arc::new(index.clone()),
            model.fingerprint,
        );
        tracing::info!(policy = routing.policy_name(), "routing");
        super::metrics::export_index_stats(index, node_id);
        let backend = Arc::new(RemoteBackend::new(
            discovery,
            RemoteConfig {
                tls,
                mesh: MeshBackendConfig {
                    max_migrations: args.max_migrations,
                    stream_idle: StreamIdleConfig {
                        min: args.stream_idle_timeout,
                        ..StreamIdleConfig::default()
                    },
                    ..MeshBackendConfig::default()
                },
                ..RemoteConfig::default()
            },
            routing,
        ));
        let router = Router::new(config, backend.clone(), Arc::new(model.tokenizer))
            .map_err(|e| anyhow::anyhow!("invalid router config: {e}"))?;
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("binding {listen}"))?;
        tracing::info!(address = %listener.local_addr()?, "router serving the OpenAI API");
        router
            .serve(listener, crate::serve::shutdown_signal())
            .await
            .context("HTTP server")
    })?;
    tracing::info!("stopped");
    Ok(())
}
