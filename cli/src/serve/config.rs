//! The typed configuration of `kvmesh serve`: defaults < TOML file < `KVMESH_*` env < flags.

use super::mesh::LocalMeshConfig as MeshConfig;
use super::ServeArgs;
use anyhow::{bail, Context, Result};
use kvmesh_engine::engine_config::EngineConfig;
use kvmesh_router::policy::{DisaggConfig, RoutingConfig};
use kvmesh_router::RouterConfig;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServeConfig {
    pub model: Option<PathBuf>,
    pub threads: Option<usize>,
    pub prefill_workers: usize,
    pub decode_workers: usize,
    /// Prompts whose uncached part is shorter than this are prefilled on the decode worker.
    pub local_prefill_max_tokens: usize,
    /// Requests a worker queues before it refuses more (the router answers 429).
    pub max_queued_requests: usize,
    /// How long a remote prefill may stay silent (no KV arriving) before the decode worker
    /// prefills locally instead.
    #[serde(with = "humantime_serde")]
    pub remote_prefill_timeout: Duration,
    /// How the router picks a decode (and prefill) worker.
    pub routing: RoutingConfig,
    /// KV pool and batching of every worker.
    pub engine: EngineConfig,
    pub router: RouterConfig,
}

impl Default for ServeConfig {
    fn default() -> Self {
        let mesh = MeshConfig::default();
        ServeConfig {
            model: None,
            threads: None,
            prefill_workers: default_prefill_workers(),
            decode_workers: 1,
            local_prefill_max_tokens: mesh.decode.local_prefill_max_tokens,
            max_queued_requests: mesh.decode.max_queued_requests,
            remote_prefill_timeout: mesh.decode.remote_prefill_timeout,
            routing: RoutingConfig::default(),
            engine: EngineConfig::default(),
            router: RouterConfig::default(),
        }
    }
}

/// Disaggregation pays when prefill and decode get hardware of their own. On a small machine
/// two workers would only split the same cores between two thread pools (and add a KV copy),
/// so below 8 cores the decode worker prefills everything itself, chunked into its batches.
fn default_prefill_workers() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    usize::from(cores >= 8)
}

impl ServeConfig {
    /// Defaults, then the TOML file, then env and flags (clap already ranks flags over env).
    pub fn layered(args: &ServeArgs) -> Result<Self> {
        let mut c = match &args.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?;
                toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?
            }
            None => ServeConfig::default(),
        };
        if let Some(m) = &args.model {
            c.model = Some(m.clone());
        }
        if let Some(l) = args.listen {
            c.router.listen = l;
        }
        if let Some(n) = args.prefill_workers {
            c.prefill_workers = n;
        }
        if let Some(n) = args.decode_workers {
            c.decode_workers = n;
        }
        if let Some(n) = args.threads {
            c.threads = Some(n);
        }
        if let Some(keys) = &args.api_keys {
            c.router.api_keys = keys.iter().filter(|k| !k.is_empty()).cloned().collect();
        }
        args.admission.apply(&mut c.router);
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<()> {
        if self.decode_workers == 0 {
            bail!("decode_workers must be at least 1");
        }
        if self.threads == Some(0) {
            bail!("threads must be at least 1");
        }
        if self.max_queued_requests == 0 {
            bail!("max_queued_requests must be at least 1");
        }
        self.router
            .validate()
            .map_err(|e| anyhow::anyhow!("router: {e}"))?;
        self.routing
            .validate()
            .map_err(|e| anyhow::anyhow!("routing: {e}"))?;
        Ok(())
    }

    pub fn mesh_config(&self) -> MeshConfig {
        let mut m = MeshConfig {
            prefill_workers: self.prefill_workers,
            decode_workers: self.decode_workers,
            prefill_engine: self.engine.clone(),
            decode_engine: self.engine.clone(),
            ..MeshConfig::default()
        };
        m.decode.local_prefill_max_tokens = self.local_prefill_max_tokens;
        m.decode.max_queued_requests = self.max_queued_requests;
        m.decode.remote_prefill_timeout = self.remote_prefill_timeout;
        m.prefill.max_queued_requests = self.max_queued_requests;
        m
    }

    /// The router's disaggregation rule, in step with the decode workers' own threshold.
    pub fn disaggregation(&self) -> DisaggConfig {
        DisaggConfig {
            local_prefill_max_tokens: self.local_prefill_max_tokens,
            ..DisaggConfig::default()
        }
    }

    /// TOML of this config with API keys masked.
    pub fn to_toml_redacted(&self) -> Result<String> {
        let mut shown = self.clone();
        shown.router.api_keys = shown
            .router
            .api_keys
            .iter()
            .map(|_| "<redacted>".into())
            .collect();
        Ok(toml::to_string_pretty(&shown)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_round_trips_and_rejects_unknown_fields() {
        let c = ServeConfig::default();
        let text = toml::to_string_pretty(&c).unwrap();
        assert_eq!(toml::from_str::<ServeConfig>(&text).unwrap(), c);
        let err = toml::from_str::<ServeConfig>("decode_wokers = 2").unwrap_err();
        assert!(err.to_string().contains("decode_wokers"), "{err}");
    }
}
