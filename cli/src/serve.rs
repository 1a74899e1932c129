//! `kvmesh serve`: the whole mesh in one process — the HTTP router, prefill workers and decode
//! workers, joined by the in-process transport and the in-memory kvstore.

pub mod autoscale;
mod config;
mod in_process;
mod mesh;

use crate::admission_args::AdmissionArgs;
use crate::config::{env_vars, ConfigArgs};
use crate::model_args;
use anyhow::{Context, Result};
use clap::Args;
pub use config::ServeConfig;
use in_process::LocalWorkers;
use kvmesh_common::kv_tier::KvEventSink;
use kvmesh_kvstore::InMemoryPrefixIndex;
use kvmesh_router::routing::Routing;
use kvmesh_router::{MeshBackend, MeshBackendConfig, Router};
use mesh::LocalMesh;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;

/// The flags of `kvmesh serve`, layered over its TOML (`ServeConfig`).
#[derive(Args, Debug, Serialize)]
pub struct ServeArgs {
    /// Model file (.gguf) or HF checkpoint directory; defaults to the cached SmolLM2, fetched
    /// when missing.
    #[arg(long, env = env_vars::MODEL)]
    pub model: Option<PathBuf>,
    /// Address of the OpenAI-compatible HTTP API.
    #[arg(long, env = env_vars::LISTEN)]
    pub listen: Option<std::net::SocketAddr>,
    /// Prefill workers (0: the decode workers prefill everything).
    #[arg(long, env = env_vars::PREFILL_WORKERS)]
    pub prefill_workers: Option<usize>,
    /// Decode workers (at least 1).
    #[arg(long, env = env_vars::DECODE_WORKERS)]
    pub decode_workers: Option<usize>,
    /// Compute threads of each worker (default: all cores).
    #[arg(long, env = env_vars::THREADS)]
    pub threads: Option<usize>,
    /// Where every worker's engine computes: `cpu` (default), `cuda` or `cuda:N` (a build
    /// with the `cuda` feature and a CUDA device; otherwise serve does not start, and says why).
    #[arg(long, env = env_vars::DEVICE)]
    pub device: Option<kvmesh_engine::device::Device>,
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
    #[command(flatten)]
    #[serde(flatten)]
    pub autoscale: autoscale::config::AutoscaleArgs,
    #[command(flatten)]
    #[serde(skip)]
    pub config: ConfigArgs,
}

pub fn run(config: &ServeConfig) -> Result<()> {
    model_args::init_threads(config.threads)?;
    let path = kvmesh_prompt::model_fetch::ensure_model(config.model.as_deref())
        .context("locating the model")?;
    let loaded = model_args::load(&path)?;

    // The workers announce what they cache straight into the router's prefix index.
    let index = Arc::new(InMemoryPrefixIndex::new());
    let mut mesh_config = config.mesh_config();
    let sink: Arc<dyn KvEventSink> = index.clone();
    mesh_config.decode.kv_events = Some(sink.clone());
    mesh_config.prefill.kv_events = Some(sink);
    let planner = config.autoscale.planner()?;
    if let Some(planner) = &planner {
        autoscale::fit_workers(&mut mesh_config, planner);
    }
    let mesh = Arc::new(LocalMesh::start(&loaded, &mesh_config).context("starting the workers")?);
    tracing::info!(
        prefill_workers = mesh_config.prefill_workers,
        decode_workers = mesh_config.decode_workers,
        kv_blocks_per_worker = mesh_config.decode_engine.num_blocks,
        "workers started"
    );
    let routing = Routing::new(
        config.routing.build(),
        config.disaggregation(),
        index.clone(),
        loaded.fingerprint,
    );
    let workers = LocalWorkers::of(&mesh);
    let discovery = Arc::new(workers.discovery(&mesh_config, loaded.fingerprint));
    let backend = Arc::new(MeshBackend::with_connector(
        workers,
        discovery.clone(),
        MeshBackendConfig::default(),
        routing,
    ));
    let mut router_config = config.router.clone();
    router_config.max_context = router_config
        .max_context
        .min(loaded.model.config.max_context);
    let router = Router::new(router_config, backend.clone(), loaded.tokenizer.clone())
        .map_err(|e| anyhow::anyhow!("invalid router config: {e}"))?;

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(config.router.listen)
            .await
            .with_context(|| format!("binding {}", config.router.listen))?;
        let autoscaler = planner.map(|planner| {
            autoscale::Autoscaler::start(
                planner,
                config.autoscale.observe_every,
                discovery.clone(),
                autoscale::InProcessActuator {
                    mesh: mesh.clone(),
                    index: index.clone(),
                },
            )
        });
        tracing::info!(
            address = %listener.local_addr()?,
            model = %config.router.model_name,
            "serving the OpenAI API"
        );
        let served = router
            .serve(listener, shutdown_signal())
            .await
            .context("HTTP server");
        // The planner stops first, finishing the move under way: nothing moves while the
        // workers drain.
        if let Some(autoscaler) = autoscaler {
            autoscaler.stop().await;
        }
        served
    })?;
    tracing::info!("HTTP server stopped; draining workers");
    backend.drain();
    mesh.shutdown();
    tracing::info!("stopped");
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => tracing::info!("SIGINT: shutting down"),
        _ = term => tracing::info!("SIGTERM: shutting down"),
    }
}
