//! A candidate as the TOML its roles read with `--config`: `kvmesh serve`'s one file, or one
//! file each for `kvmesh router`, `prefill` and `decode`. Each file holds only the keys tune
//! chose (the rest keep their defaults), built from the roles' own config types so a key or
//! a value's form cannot drift from what the loader reads.

use super::space::{Candidate, Topology};
use crate::config::{set_key, value_at};
use crate::node::config::{DecodeNodeConfig, PrefillNodeConfig, RouterNodeConfig};
use crate::serve::ServeConfig;
use serde::Serialize;

/// The keys each role's file sets.
const SERVE_KEYS: &[&str] = &[
    "prefill_workers",
    "decode_workers",
    "local_prefill_max_tokens",
    "engine.max_num_batched_tokens",
    "engine.max_step_time",
    "routing",
    "router.ttft_target",
];
const ROUTER_KEYS: &[&str] = &[
    "disaggregation.local_prefill_max_tokens",
    "routing",
    "router.ttft_target",
];
const PREFILL_KEYS: &[&str] = &["engine.max_num_batched_tokens", "engine.max_step_time"];
const DECODE_KEYS: &[&str] = &[
    "local_prefill_max_tokens",
    "engine.max_num_batched_tokens",
    "engine.max_step_time",
];

/// The files of one candidate.
#[derive(Clone, Debug, PartialEq)]
pub enum Rendered {
    /// For `kvmesh serve --config`.
    Serve { serve: String },
    /// For `kvmesh router --config` (one), `kvmesh prefill --config` (`prefill_nodes` of
    /// them) and `kvmesh decode --config` (`decode_nodes`); each node still takes its own
    /// `--etcd` and `--listen`.
    Mesh {
        prefill_nodes: usize,
        decode_nodes: usize,
        router: String,
        prefill: String,
        decode: String,
    },
}

/// `kvmesh serve`'s configuration for a [`Topology::Serve`] candidate (the serve defaults
/// with the candidate's settings); `None` for a mesh.
pub fn serve_config(c: &Candidate) -> Option<ServeConfig> {
    let Topology::Serve {
        prefill_workers,
        decode_workers,
    } = c.topology
    else {
        return None;
    };
    let mut config = ServeConfig {
        prefill_workers,
        decode_workers,
        local_prefill_max_tokens: c.local_prefill_max_tokens,
        routing: c.routing.clone(),
        ..ServeConfig::default()
    };
    c.set_engine(&mut config.engine);
    config.router.ttft_target = c.ttft_target;
    Some(config)
}

/// The router's configuration for a mesh candidate.
pub fn router_config(c: &Candidate) -> RouterNodeConfig {
    let mut config = RouterNodeConfig {
        routing: c.routing.clone(),
        ..RouterNodeConfig::default()
    };
    // In step with the decode nodes' own threshold, as `kvmesh serve` keeps them.
    config.disaggregation.local_prefill_max_tokens = c.local_prefill_max_tokens;
    config.router.ttft_target = c.ttft_target;
    config
}

/// A prefill node's configuration for a mesh candidate.
pub fn prefill_config(c: &Candidate) -> PrefillNodeConfig {
    let mut config = PrefillNodeConfig::default();
    c.set_engine(&mut config.engine);
    config
}

/// A decode node's configuration for a mesh candidate.
pub fn decode_config(c: &Candidate) -> DecodeNodeConfig {
    let mut config = DecodeNodeConfig {
        local_prefill_max_tokens: c.local_prefill_max_tokens,
        ..DecodeNodeConfig::default()
    };
    c.set_engine(&mut config.engine);
    config
}

/// The candidate's files, each opening with `header` as comment lines (what was measured,
/// for whoever finds the file later) and the role it is for.
pub fn render(c: &Candidate, header: &str) -> Result<Rendered, toml::ser::Error> {
    let comment = |role: &str, nodes: Option<usize>| {
        let mut text: String = header.lines().map(|l| format!("# {l}\n")).collect();
        text.push_str(&format!("# kvmesh tune: {c}\n# for `{role} --config`"));
        if let Some(n) = nodes {
            text.push_str(&format!(" ({n} node{})", if n == 1 { "" } else { "s" }));
        }
        text + "\n\n"
    };
    if let Some(serve) = serve_config(c) {
        return Ok(Rendered::Serve {
            serve: comment("kvmesh serve", None) + &sparse(&serve, SERVE_KEYS)?,
        });
    }
    let (prefill_nodes, decode_nodes) = c.topology.engines();
    Ok(Rendered::Mesh {
        prefill_nodes,
        decode_nodes,
        router: comment("kvmesh router", None) + &sparse(&router_config(c), ROUTER_KEYS)?,
        prefill: comment("kvmesh prefill", Some(prefill_nodes))
            + &sparse(&prefill_config(c), PREFILL_KEYS)?,
        decode: comment("kvmesh decode", Some(decode_nodes))
            + &sparse(&decode_config(c), DECODE_KEYS)?,
    })
}

/// `config` as TOML with only `keys` (dotted) kept.
fn sparse<C: Serialize>(config: &C, keys: &[&str]) -> Result<String, toml::ser::Error> {
    let full = toml::Table::try_from(config)?;
    let mut out = toml::Table::new();
    for key in keys {
        if let Some(value) = value_at(&full, key) {
            set_key(&mut out, key, value.clone());
        }
    }
    toml::to_string_pretty(&out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::testing::toml_file;
    use crate::config::{self, EnvMap, Layered};
    use kvmesh_router::policy::RoutingConfig;
    use std::time::Duration;

    fn candidate(topology: Topology) -> Candidate {
        Candidate {
            topology,
            max_num_batched_tokens: 512,
            max_step_time: Duration::from_millis(60),
            local_prefill_max_tokens: 1024,
            routing: RoutingConfig::LeastLoaded {},
            ttft_target: Duration::from_millis(1500),
        }
    }

    /// `text` read back by the role's own loader, as `kvmesh <role> --config FILE` would.
    fn load<C: Layered>(text: &str) -> C {
        let file = toml_file(text);
        let path = file.path().to_str().unwrap();
        config::parse::<C>(&["--config", path], &EnvMap::new()).unwrap()
    }

    #[test]
    fn a_serve_candidate_reads_back_as_its_settings() {
        let c = candidate(Topology::Serve {
            prefill_workers: 1,
            decode_workers: 2,
        });
        let Rendered::Serve { serve } = render(&c, "best of 3\nat 2.5 req/s").unwrap() else {
            panic!("a serve candidate renders one file");
        };
        assert!(serve.starts_with("# best of 3\n# at 2.5 req/s\n# kvmesh tune: serve 1p+2d"));
        let read: ServeConfig = load(&serve);
        assert_eq!(read, serve_config(&c).unwrap());
        assert_eq!((read.prefill_workers, read.decode_workers), (1, 2));
        assert_eq!(read.engine.max_num_batched_tokens, 512);
        assert_eq!(read.engine.max_step_time, Some(Duration::from_millis(60)));
        assert_eq!(read.local_prefill_max_tokens, 1024);
        assert_eq!(read.disaggregation().local_prefill_max_tokens, 1024);
        assert_eq!(read.routing, RoutingConfig::LeastLoaded {});
        assert_eq!(read.router.ttft_target, Duration::from_millis(1500));
        // Only the chosen keys: everything else is left to the defaults.
        assert!(
            !serve.contains("num_blocks") && !serve.contains("max_n ="),
            "{serve}"
        );
        assert!(serve.contains("ttft_target = \"1s 500ms\""), "{serve}");
    }

    #[test]
    fn a_mesh_candidate_reads_back_in_every_role() {
        let c = candidate(Topology::Mesh {
            prefill_nodes: 1,
            decode_nodes: 3,
        });
        let Rendered::Mesh {
            prefill_nodes,
            decode_nodes,
            router,
            prefill,
            decode,
        } = render(&c, "").unwrap()
        else {
            panic!("a mesh candidate renders one file per role");
        };
        assert_eq!((prefill_nodes, decode_nodes), (1, 3));
        let r: RouterNodeConfig = load(&router);
        assert_eq!(r, router_config(&c));
        assert_eq!(r.routing, RoutingConfig::LeastLoaded {});
        assert_eq!(r.disaggregation.local_prefill_max_tokens, 1024);
        assert_eq!(r.router.ttft_target, Duration::from_millis(1500));
        let p: PrefillNodeConfig = load(&prefill);
        assert_eq!(p, prefill_config(&c));
        assert_eq!(p.engine.max_num_batched_tokens, 512);
        assert_eq!(p.engine.max_step_time, Some(Duration::from_millis(60)));
        let d: DecodeNodeConfig = load(&decode);
        assert_eq!(d, decode_config(&c));
        assert_eq!(
            (d.local_prefill_max_tokens, d.engine.max_num_batched_tokens),
            (1024, 512)
        );
        assert!(
            decode.contains("# for `kvmesh decode --config` (3 nodes)"),
            "{decode}"
        );
        assert!(!prefill.contains("routing"), "{prefill}");
        assert_eq!(d.engine.max_step_time, Some(Duration::from_millis(60)));
        // No target: the key is left out and the engines keep the token budget alone.
        let Rendered::Mesh { decode, .. } = render(
            &Candidate {
                max_step_time: Duration::ZERO,
                ..c
            },
            "",
        )
        .unwrap() else {
            panic!("a mesh");
        };
        assert!(!decode.contains("max_step_time"), "{decode}");
        assert_eq!(load::<DecodeNodeConfig>(&decode).engine.max_step_time, None);
    }

    #[test]
    fn kv_aware_routing_keeps_its_knobs() {
        let c = Candidate {
            routing: RoutingConfig::default(),
            ..candidate(Topology::Mesh {
                prefill_nodes: 2,
                decode_nodes: 2,
            })
        };
        let Rendered::Mesh { router, .. } = render(&c, "").unwrap() else {
            panic!("a mesh candidate");
        };
        assert!(router.contains("policy = \"kv_aware\""), "{router}");
        assert_eq!(
            load::<RouterNodeConfig>(&router).routing,
            RoutingConfig::default()
        );
    }
}
