//! The typed configuration of `kvmesh serve`: defaults < TOML file < `KVMESH_*` env < flags
//! (layered by [`crate::config`]).

use super::autoscale::config::{self as autoscale, AutoscaleConfig};
use super::mesh::LocalMeshConfig as MeshConfig;
use super::ServeArgs;
use crate::admission_args;
use crate::config::{ConfigArgs, Invalid, Layered};
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
    /// The planner in this process (`--autoscale`).
    pub autoscale: AutoscaleConfig,
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
            autoscale: AutoscaleConfig::default(),
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

impl Layered for ServeConfig {
    const ROLE: &'static str = "serve";
    const KEYS: &'static [&'static [(&'static str, &'static str)]] = &[
        admission_args::ROUTER_KEYS,
        &[("listen", "router.listen"), ("device", "engine.device")],
        autoscale::KEYS,
    ];
    const MACHINE_DEFAULTS: &'static [(&'static str, &'static str)] =
        &[("prefill_workers", "1 with 8 or more cores, else 0")];
    const UNSET_KEYS: &'static [&'static str] = &["engine.max_model_len"];
    type Args = ServeArgs;

    fn config_args(args: &ServeArgs) -> &ConfigArgs {
        &args.config
    }

    fn finish(&mut self) -> Result<(), Invalid> {
        if self.decode_workers == 0 {
            return Err(Invalid::new("decode_workers", "must be at least 1"));
        }
        if self.threads == Some(0) {
            return Err(Invalid::new("threads", "must be at least 1"));
        }
        if self.max_queued_requests == 0 {
            return Err(Invalid::new("max_queued_requests", "must be at least 1"));
        }
        self.autoscale
            .planner()
            .map_err(|e| Invalid::new("autoscale", format!("{e:#}")))?;
        self.router.api_keys.retain(|k| !k.is_empty());
        self.router
            .validate()
            .map_err(|e| Invalid::new(format!("router.{}", e.field), e.reason))?;
        self.routing
            .validate()
            .map_err(|e| Invalid::new(e.field, e.reason))
    }

    /// API keys masked.
    fn redacted(&self) -> Self {
        let mut shown = self.clone();
        admission_args::redact_api_keys(&mut shown.router);
        shown
    }
}

impl ServeConfig {
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

    #[test]
    fn serve_layers_defaults_file_env_and_flags_in_order() {
        use crate::config::testing::{env, toml_file};
        let file = toml_file(
            "decode_workers = 3\nmax_queued_requests = 5\n[router]\nmax_in_flight = 7\n\
             [engine]\nnum_blocks = 99\n",
        );
        let path = file.path().to_str().unwrap();
        let vars = env(&[
            ("KVMESH_CONFIG", path),
            ("KVMESH_DECODE_WORKERS", "4"),
            ("KVMESH_MAX_IN_FLIGHT", "8"),
        ]);
        let c: ServeConfig = crate::config::parse(&["--decode-workers", "5"], &vars).unwrap();
        assert_eq!(c.decode_workers, 5, "a flag beats env and file");
        assert_eq!(c.router.max_in_flight, 8, "env beats the file");
        assert_eq!(c.max_queued_requests, 5, "the file beats the default");
        assert_eq!(c.engine.num_blocks, 99);
        assert_eq!(c.router.max_n, RouterConfig::default().max_n, "default");
        let printed = toml_file(&toml::to_string_pretty(&c).unwrap());
        let args = ["--config", printed.path().to_str().unwrap()];
        assert_eq!(
            crate::config::parse::<ServeConfig>(&args, &env(&[])).unwrap(),
            c
        );
    }

    #[test]
    fn autoscale_flags_set_the_autoscale_table_and_a_bad_planner_setting_is_refused() {
        use crate::config::testing::env;
        use crate::planner::PolicyArg;
        let args = [
            "--autoscale",
            "--planner-policy",
            "slo",
            "--slo",
            "ttft=1s",
            "--observe-every",
            "500ms",
        ];
        let c: ServeConfig = crate::config::parse(&args, &env(&[])).unwrap();
        assert!(c.autoscale.enabled);
        assert_eq!(c.autoscale.policy, Some(PolicyArg::Slo));
        assert_eq!(c.autoscale.observe_every, Duration::from_millis(500));
        let planner = c.autoscale.planner().unwrap().expect("enabled");
        assert_eq!(planner.policy, kvmesh_planner::Policy::Slo);
        assert_eq!(planner.slo.ttft, Duration::from_secs(1));
        assert!(ServeConfig::default()
            .autoscale
            .planner()
            .unwrap()
            .is_none());

        let bad =
            crate::config::parse::<ServeConfig>(&["--autoscale", "--slo", "ttft=fast"], &env(&[]))
                .unwrap_err();
        assert!(bad.to_string().contains("autoscale"), "{bad}");
        assert!(bad.to_string().contains("not a duration"), "{bad}");
    }
}
