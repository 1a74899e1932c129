//! `kvmesh router`: the OpenAI-compatible HTTP API in front of the mesh that etcd describes.

use super::{runtime, MeshArgs};
use crate::model_args::{self, ModelArgs};
use anyhow::{Context, Result};
use clap::Args;
use kvmesh_kvstore::Discovery;
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
}

pub fn run(args: &RouterArgs) -> Result<()> {
    let path = args.model.prepare()?;
    let loaded = model_args::load(&path)?;
    let mut config = RouterConfig {
        listen: args.mesh.listen,
        ..RouterConfig::default()
    };
    config.max_context = config.max_context.min(loaded.model.config.max_context);
    if let Some(keys) = &args.api_keys {
        config.api_keys = keys.iter().filter(|k| !k.is_empty()).cloned().collect();
    }
    runtime()?.block_on(async {
        let discovery = args.mesh.connect().await?;
        let discovery: Arc<dyn Discovery> = Arc::new(discovery);
        let backend = Arc::new(RemoteBackend::new(discovery, RemoteConfig::default()));
        let router = Router::new(config, backend.clone(), loaded.tokenizer.clone())
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
