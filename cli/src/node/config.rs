//! The layered configuration of `kvmesh router`, `prefill` and `decode` (see [`crate::config`]):
//! what each node takes, in the TOML shape `--config` reads and `--print-config` writes.

use super::decode::DecodeArgs;
use super::prefill::PrefillArgs;
use super::router::RouterArgs;
use super::{engine_args, MESH_KEYS};
use crate::admission_args;
use crate::config::{node_id_hex, ConfigArgs, Invalid, Layered};
use kvmesh_common::NodeId;
use kvmesh_engine::engine_config::EngineConfig;
use kvmesh_router::policy::{DisaggConfig, RoutingConfig};
use kvmesh_router::{MeshBackendConfig, RouterConfig};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// How a node process takes part in the mesh (the `[mesh]` table; the flags of `MeshArgs`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MeshNodeConfig {
    /// etcd client URLs (required to run).
    pub etcd: Vec<String>,
    /// Where this node listens (required to run).
    pub listen: Option<SocketAddr>,
    pub advertise: Option<SocketAddr>,
    pub cluster: String,
    #[serde(with = "node_id_hex", skip_serializing_if = "Option::is_none")]
    pub node_id: Option<NodeId>,
    #[serde(with = "humantime_serde")]
    pub lease_ttl: Duration,
    #[serde(with = "humantime_serde")]
    pub drain_timeout: Duration,
    pub tls_ca: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub metrics_listen: Option<SocketAddr>,
}

impl Default for MeshNodeConfig {
    fn default() -> Self {
        MeshNodeConfig {
            etcd: Vec::new(),
            listen: None,
            advertise: None,
            cluster: "kvmesh".into(),
            node_id: None,
            lease_ttl: Duration::from_secs(3),
            drain_timeout: Duration::from_secs(30),
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            metrics_listen: None,
        }
    }
}

impl MeshNodeConfig {
    fn check(&self) -> Result<(), Invalid> {
        let tls = [&self.tls_ca, &self.tls_cert, &self.tls_key];
        if tls.iter().any(|p| p.is_some()) && !tls.iter().all(|p| p.is_some()) {
            return Err(Invalid::new(
                "mesh.tls_ca",
                "mesh.tls_ca, mesh.tls_cert and mesh.tls_key (--tls-ca, --tls-cert, --tls-key) \
                 must be given together",
            ));
        }
        Ok(())
    }

    fn require(&self) -> Result<(), Invalid> {
        if self.etcd.is_empty() {
            return Err(Invalid::new(
                "mesh.etcd",
                "is required: --etcd, KVMESH_ETCD or `etcd` under [mesh] in the --config file",
            ));
        }
        if self.listen.is_none() {
            return Err(Invalid::new(
                "mesh.listen",
                "is required: --listen, KVMESH_LISTEN or `listen` under [mesh] in the --config \
                 file",
            ));
        }
        Ok(())
    }
}

/// What the engine flags allowed before they became layered: a disk tier needs its
/// directory, and a step needs a token.
fn check_engine(engine: &EngineConfig) -> Result<(), Invalid> {
    if engine.disk_tier_blocks > 0 && engine.disk_tier_dir.is_none() {
        return Err(Invalid::new(
            "engine.disk_tier_dir",
            "is required when engine.disk_tier_blocks is above 0 (--kv-disk-dir)",
        ));
    }
    if engine.max_num_batched_tokens == 0 {
        return Err(Invalid::new(
            "engine.max_num_batched_tokens",
            "must be at least 1",
        ));
    }
    Ok(())
}

/// The prefill and decode nodes' default pull timeout (the workers' own).
fn default_pull_timeout() -> Duration {
    kvmesh_decode::DecodeConfig::new(NodeId(0)).pull_timeout
}

/// `kvmesh prefill`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefillNodeConfig {
    pub model: Option<PathBuf>,
    pub threads: Option<usize>,
    #[serde(with = "humantime_serde")]
    pub pull_timeout: Duration,
    pub mesh: MeshNodeConfig,
    pub engine: EngineConfig,
}

impl Default for PrefillNodeConfig {
    fn default() -> Self {
        PrefillNodeConfig {
            model: None,
            threads: None,
            pull_timeout: default_pull_timeout(),
            mesh: MeshNodeConfig::default(),
            engine: EngineConfig::default(),
        }
    }
}

/// The layering of an engine-owning node (`prefill`, `decode`): mesh and engine tables, no
/// secrets.
macro_rules! engine_node_layered {
    ($config:ty, $args:ty, $role:literal) => {
        impl Layered for $config {
            const ROLE: &'static str = $role;
            const KEYS: &'static [&'static [(&'static str, &'static str)]] =
                &[MESH_KEYS, engine_args::KEYS];
            const UNSET_KEYS: &'static [&'static str] = &["engine.max_model_len"];
            type Args = $args;

            fn config_args(args: &$args) -> &ConfigArgs {
                &args.config
            }

            fn finish(&mut self) -> Result<(), Invalid> {
                self.mesh.check()?;
                check_engine(&self.engine)
            }

            fn require(&self) -> Result<(), Invalid> {
                self.mesh.require()
            }

            fn redacted(&self) -> Self {
                self.clone()
            }
        }
    };
}

engine_node_layered!(PrefillNodeConfig, PrefillArgs, "prefill");

/// `kvmesh decode`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DecodeNodeConfig {
    pub model: Option<PathBuf>,
    pub threads: Option<usize>,
    #[serde(with = "humantime_serde")]
    pub pull_timeout: Duration,
    /// Prompts whose uncached part is shorter than this are prefilled here.
    pub local_prefill_max_tokens: usize,
    /// Let prefill nodes pull the prefix of a prompt this node holds.
    pub prefill_pulls: bool,
    pub mesh: MeshNodeConfig,
    pub engine: EngineConfig,
}

impl Default for DecodeNodeConfig {
    fn default() -> Self {
        let worker = kvmesh_decode::DecodeConfig::new(NodeId(0));
        DecodeNodeConfig {
            model: None,
            threads: None,
            pull_timeout: worker.pull_timeout,
            local_prefill_max_tokens: worker.local_prefill_max_tokens,
            prefill_pulls: worker.prefill_pulls,
            mesh: MeshNodeConfig::default(),
            engine: EngineConfig::default(),
        }
    }
}

engine_node_layered!(DecodeNodeConfig, DecodeArgs, "decode");

/// `kvmesh router`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterNodeConfig {
    /// The model whose tokenizer and chat template the router uses.
    pub model: Option<PathBuf>,
    pub threads: Option<usize>,
    /// How many times a request whose decode node fails mid-stream may move to another one.
    pub max_migrations: usize,
    /// The least silence after a token that makes a decode node's stream count as hung.
    #[serde(with = "humantime_serde")]
    pub stream_idle_timeout: Duration,
    pub mesh: MeshNodeConfig,
    /// The HTTP API; its `listen` is `mesh.listen`.
    pub router: RouterConfig,
    pub routing: RoutingConfig,
    pub disaggregation: DisaggConfig,
}

impl Default for RouterNodeConfig {
    fn default() -> Self {
        RouterNodeConfig {
            model: None,
            threads: None,
            max_migrations: MeshBackendConfig::default().max_migrations,
            stream_idle_timeout: MeshBackendConfig::default().stream_idle.min,
            mesh: MeshNodeConfig::default(),
            router: RouterConfig::default(),
            routing: RoutingConfig::default(),
            disaggregation: DisaggConfig::default(),
        }
    }
}

impl Layered for RouterNodeConfig {
    const ROLE: &'static str = "router";
    const KEYS: &'static [&'static [(&'static str, &'static str)]] = &[
        MESH_KEYS,
        admission_args::ROUTER_KEYS,
        &[
            ("routing_policy", "routing"),
            (
                "local_prefill_max_tokens",
                "disaggregation.local_prefill_max_tokens",
            ),
            ("pull_min_blocks", "disaggregation.pull_min_blocks"),
        ],
    ];
    type Args = RouterArgs;

    fn config_args(args: &RouterArgs) -> &ConfigArgs {
        &args.config
    }

    fn finish(&mut self) -> Result<(), Invalid> {
        self.mesh.check()?;
        if self.stream_idle_timeout.is_zero() {
            return Err(Invalid::new(
                "stream_idle_timeout",
                "must be positive: a zero bound would move every stream at its first gap",
            ));
        }
        let default_listen = RouterConfig::default().listen;
        if let Some(listen) = self.mesh.listen {
            if self.router.listen != default_listen && self.router.listen != listen {
                return Err(Invalid::new(
                    "router.listen",
                    "is mesh.listen for `kvmesh router`: set that instead",
                ));
            }
            self.router.listen = listen;
        }
        self.router.api_keys.retain(|k| !k.is_empty());
        self.router
            .validate()
            .map_err(|e| Invalid::new(format!("router.{}", e.field), e.reason))?;
        self.routing
            .validate()
            .map_err(|e| Invalid::new(e.field, e.reason))?;
        self.disaggregation
            .validate()
            .map_err(|e| Invalid::new(e.field, e.reason))
    }

    fn require(&self) -> Result<(), Invalid> {
        self.mesh.require()
    }

    fn redacted(&self) -> Self {
        let mut shown = self.clone();
        admission_args::redact_api_keys(&mut shown.router);
        shown
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::testing::{env, toml_file};
    use crate::config::{self, EnvMap};

    fn parse<C: Layered>(args: &[&str], vars: &[(&str, &str)]) -> anyhow::Result<C> {
        config::parse::<C>(args, &env(vars))
    }

    /// `--print-config`'s output, read back with `--config`, is the same configuration.
    fn round_trips<C: Layered + PartialEq + std::fmt::Debug>(config: &C) {
        let file = toml_file(&toml::to_string_pretty(config).unwrap());
        let path = file.path().to_str().unwrap();
        assert_eq!(&parse::<C>(&["--config", path], &[]).unwrap(), config);
    }

    #[test]
    fn prefill_layers_defaults_file_env_and_flags_in_order() {
        let file = toml_file(
            "pull_timeout = \"5s\"\nthreads = 3\n[mesh]\ncluster = \"file\"\n\
             [engine]\nnum_blocks = 10\nmax_num_seqs = 7\n",
        );
        let path = file.path().to_str().unwrap();
        let vars = [
            ("KVMESH_CONFIG", path),
            ("KVMESH_KV_BLOCKS", "20"),
            ("KVMESH_CLUSTER", "env"),
            ("KVMESH_PULL_TIMEOUT", "4s"),
        ];
        let c: PrefillNodeConfig =
            parse(&["--kv-blocks", "30", "--pull-timeout", "3s"], &vars).unwrap();
        assert_eq!(c.engine.num_blocks, 30, "a flag beats env and file");
        assert_eq!(c.pull_timeout, Duration::from_secs(3));
        assert_eq!(c.mesh.cluster, "env", "env beats the file");
        assert_eq!(c.threads, Some(3), "the file beats the default");
        assert_eq!(c.engine.max_num_seqs, 7);
        assert_eq!(c.mesh.drain_timeout, Duration::from_secs(30), "default");
        assert_eq!(c.engine.block_size, EngineConfig::default().block_size);
        round_trips(&c);
    }

    #[test]
    fn decode_layers_defaults_file_env_and_flags_in_order() {
        let file = toml_file(
            "local_prefill_max_tokens = 1\nprefill_pulls = false\n[mesh]\nlease_ttl = \"9s\"\n\
             node_id = \"ab\"\n",
        );
        let path = file.path().to_str().unwrap();
        let vars = [
            ("KVMESH_LOCAL_PREFILL_MAX_TOKENS", "2"),
            ("KVMESH_LEASE_TTL", "8s"),
        ];
        let c: DecodeNodeConfig = parse(
            &["--config", path, "--local-prefill-max-tokens", "3"],
            &vars,
        )
        .unwrap();
        assert_eq!(c.local_prefill_max_tokens, 3, "a flag beats env and file");
        assert_eq!(
            c.mesh.lease_ttl,
            Duration::from_secs(8),
            "env beats the file"
        );
        assert!(!c.prefill_pulls, "the file beats the default");
        assert_eq!(c.mesh.node_id, Some(NodeId(0xab)));
        assert_eq!(c.pull_timeout, Duration::from_secs(2), "default");
        round_trips(&c);
        let c: DecodeNodeConfig = parse(&["--prefill-pulls", "true"], &[]).unwrap();
        assert!(c.prefill_pulls);
    }

    #[test]
    fn router_layers_defaults_file_env_and_flags_in_order() {
        let file = toml_file(
            "max_migrations = 1\n[router]\nmax_in_flight = 11\nmax_n = 2\n\
             [routing]\npolicy = \"round_robin\"\n[disaggregation]\npull_min_blocks = 9\n",
        );
        let path = file.path().to_str().unwrap();
        let vars = [
            ("KVMESH_MAX_IN_FLIGHT", "12"),
            ("KVMESH_MAX_MIGRATIONS", "2"),
            ("KVMESH_ROUTING_POLICY", "random"),
            ("KVMESH_LISTEN", "127.0.0.1:7001"),
            ("KVMESH_ETCD", "http://a:2379,http://b:2379"),
        ];
        let c: RouterNodeConfig = parse(
            &[
                "--config",
                path,
                "--max-in-flight",
                "13",
                "--routing-policy",
                "least_loaded",
            ],
            &vars,
        )
        .unwrap();
        assert_eq!(c.router.max_in_flight, 13, "a flag beats env and file");
        assert_eq!(c.routing, RoutingConfig::LeastLoaded {});
        assert_eq!(c.max_migrations, 2, "env beats the file");
        assert_eq!(c.router.max_n, 2, "the file beats the default");
        assert_eq!(c.disaggregation.pull_min_blocks, 9);
        assert_eq!(
            c.disaggregation,
            DisaggConfig {
                pull_min_blocks: 9,
                ..DisaggConfig::default()
            }
        );
        assert_eq!(c.mesh.etcd, ["http://a:2379", "http://b:2379"]);
        assert_eq!(
            c.router.listen,
            "127.0.0.1:7001".parse().unwrap(),
            "the API's address"
        );
        assert_eq!(c.router.ttft_target, Duration::ZERO, "default");
        round_trips(&c);
    }

    #[test]
    fn the_step_budget_flag_sets_the_engine_budget_and_refuses_zero() {
        let c: PrefillNodeConfig = parse(&[], &[]).unwrap();
        assert_eq!(c.engine, EngineConfig::default());
        let set: PrefillNodeConfig = parse(&["--max-batched-tokens", "256"], &[]).unwrap();
        assert_eq!(set.engine.max_num_batched_tokens, 256);
        assert!(parse::<PrefillNodeConfig>(&["--max-batched-tokens", "0"], &[]).is_err());
    }

    #[test]
    fn the_pull_timeout_flag_defaults_to_what_the_workers_default_to() {
        let default = parse::<DecodeNodeConfig>(&[], &[]).unwrap().pull_timeout;
        assert_eq!(
            default,
            kvmesh_decode::DecodeConfig::new(NodeId(1)).pull_timeout
        );
        assert_eq!(
            default,
            kvmesh_prefill::PrefillConfig::new(NodeId(1)).pull_timeout
        );
        assert_eq!(
            parse::<PrefillNodeConfig>(&[], &[]).unwrap().pull_timeout,
            default
        );
        let set: PrefillNodeConfig = parse(&["--pull-timeout", "500ms"], &[]).unwrap();
        assert_eq!(set.pull_timeout, Duration::from_millis(500));
        assert!(parse::<PrefillNodeConfig>(&["--pull-timeout", "soon"], &[]).is_err());
    }

    #[test]
    fn errors_name_the_file_the_variable_or_the_flag() {
        let file = toml_file("[engine]\nnum_blokcs = 1\n");
        let path = file.path().to_str().unwrap();
        let err = parse::<DecodeNodeConfig>(&["--config", path], &[]).unwrap_err();
        let err = format!("{err:#}");
        assert!(err.contains("num_blokcs") && err.contains(path), "{err}");

        let err = parse::<DecodeNodeConfig>(&[], &[("KVMESH_KV_BLOCKS", "many")]).unwrap_err();
        assert!(err.to_string().contains("KVMESH_KV_BLOCKS"), "{err}");
        let err = parse::<DecodeNodeConfig>(&["--kv-blocks", "many"], &[]).unwrap_err();
        assert!(err.to_string().contains("--kv-blocks"), "{err}");

        // A check on the merged values names the layer that set the value.
        let err = parse::<RouterNodeConfig>(&[], &[("KVMESH_MAX_IN_FLIGHT", "0")]).unwrap_err();
        assert!(
            err.to_string().contains("router.max_in_flight")
                && err.to_string().contains("KVMESH_MAX_IN_FLIGHT"),
            "{err}"
        );
        let err = parse::<PrefillNodeConfig>(&["--tls-ca", "ca.pem"], &[]).unwrap_err();
        assert!(err.to_string().contains("--tls-ca"), "{err}");
        let err = parse::<PrefillNodeConfig>(&["--kv-disk-blocks", "4"], &[]).unwrap_err();
        assert!(err.to_string().contains("disk_tier_dir"), "{err}");
    }

    #[test]
    fn running_needs_etcd_and_listen_but_printing_does_not() {
        let none = EnvMap::new();
        let c: RouterNodeConfig = config::parse(&[], &none).unwrap();
        assert!(c.require().unwrap_err().key == "mesh.etcd");
        let c: RouterNodeConfig = config::parse(
            &["--etcd", "http://e:2379", "--listen", "127.0.0.1:1"],
            &none,
        )
        .unwrap();
        assert_eq!(c.require(), Ok(()));
        round_trips(&RouterNodeConfig::default());
        round_trips(&PrefillNodeConfig::default());
        round_trips(&DecodeNodeConfig::default());
    }

    #[test]
    fn the_router_listens_on_mesh_listen_only() {
        let file = toml_file("[router]\nlisten = \"127.0.0.1:9\"\n");
        let path = file.path().to_str().unwrap();
        let err = parse::<RouterNodeConfig>(&["--config", path, "--listen", "127.0.0.1:8"], &[])
            .unwrap_err();
        assert!(err.to_string().contains("router.listen"), "{err}");
    }
}
