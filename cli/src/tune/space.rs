//! The candidates `kvmesh tune` measures: every combination of a few values of the settings
//! that move goodput most, with the combinations that cannot differ folded together.

use kvmesh_router::policy::RoutingConfig;
use rand::rngs::StdRng;
use rand::SeedableRng;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// How the engines are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Topology {
    /// `kvmesh serve`: the whole mesh in one process on one node (`prefill_workers`,
    /// `decode_workers`).
    Serve {
        prefill_workers: usize,
        decode_workers: usize,
    },
    /// `kvmesh router` with this many `kvmesh prefill` and `kvmesh decode` nodes.
    Mesh {
        prefill_nodes: usize,
        decode_nodes: usize,
    },
}

impl Topology {
    /// The prefill and decode engines.
    pub fn engines(&self) -> (usize, usize) {
        match *self {
            Topology::Serve {
                prefill_workers,
                decode_workers,
            } => (prefill_workers, decode_workers),
            Topology::Mesh {
                prefill_nodes,
                decode_nodes,
            } => (prefill_nodes, decode_nodes),
        }
    }

    /// Every prefill:decode split of `nodes` engine nodes with at least one of each
    /// (4 nodes: 1:3, 2:2, 3:1).
    pub fn mesh_splits(nodes: usize) -> Vec<Topology> {
        (1..nodes)
            .map(|prefill_nodes| Topology::Mesh {
                prefill_nodes,
                decode_nodes: nodes - prefill_nodes,
            })
            .collect()
    }
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Topology::Serve {
                prefill_workers,
                decode_workers,
            } => write!(f, "serve {prefill_workers}p+{decode_workers}d"),
            Topology::Mesh {
                prefill_nodes,
                decode_nodes,
            } => write!(f, "mesh {prefill_nodes}:{decode_nodes}"),
        }
    }
}

impl FromStr for Topology {
    type Err = String;

    /// `serve:P+D` (an in-process `kvmesh serve` with P prefill and D decode workers) or
    /// `mesh:P+D` (P prefill and D decode nodes behind a router).
    fn from_str(s: &str) -> Result<Topology, String> {
        let bad = || format!("`{s}`: expected serve:P+D or mesh:P+D (e.g. serve:0+1, mesh:1+3)");
        let (kind, counts) = s.trim().split_once(':').ok_or_else(bad)?;
        let (p, d) = counts.split_once('+').ok_or_else(bad)?;
        let p: usize = p.trim().parse().map_err(|_| bad())?;
        let d: usize = d.trim().parse().map_err(|_| bad())?;
        if d == 0 {
            return Err(format!("`{s}`: at least one decode engine is needed"));
        }
        match kind.trim() {
            "serve" => Ok(Topology::Serve {
                prefill_workers: p,
                decode_workers: d,
            }),
            "mesh" if p == 0 => Err(format!(
                "`{s}`: a mesh needs a prefill node (serve:0+D prefills on the decode engines)"
            )),
            "mesh" => Ok(Topology::Mesh {
                prefill_nodes: p,
                decode_nodes: d,
            }),
            _ => Err(bad()),
        }
    }
}

/// One configuration to measure. The names are the TOML keys they set.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    pub topology: Topology,
    /// `engine.max_num_batched_tokens` of every engine: the token budget of one step.
    pub max_num_batched_tokens: usize,
    /// `engine.max_step_time` of every engine: the step-time target that sizes prefill
    /// chunks; zero leaves it unset.
    pub max_step_time: Duration,
    /// `local_prefill_max_tokens` (and the router's `disaggregation.local_prefill_max_tokens`,
    /// kept in step): prompts with fewer uncached tokens prefill on the decode engine.
    pub local_prefill_max_tokens: usize,
    /// `routing`: how the router picks an engine.
    pub routing: RoutingConfig,
    /// `router.ttft_target`: admission control's TTFT target; zero disables it.
    pub ttft_target: Duration,
}

impl Candidate {
    /// What a user gets on `nodes` nodes without tuning: an even split (the larger half
    /// decoding) with every other setting at its default (the in-process `serve` on one node).
    /// Always measured beside the sample, so the tuned result is judged against it in the same
    /// run.
    pub fn baseline(nodes: usize) -> Candidate {
        let decode = crate::node::config::DecodeNodeConfig::default();
        let topology = match nodes {
            0 | 1 => Topology::Serve {
                prefill_workers: 0,
                decode_workers: 1,
            },
            n => Topology::Mesh {
                prefill_nodes: n / 2,
                decode_nodes: n - n / 2,
            },
        };
        Candidate {
            topology,
            max_num_batched_tokens: kvmesh_engine::engine_config::EngineConfig::default()
                .max_num_batched_tokens,
            max_step_time: Duration::ZERO,
            local_prefill_max_tokens: decode.local_prefill_max_tokens,
            routing: RoutingConfig::default(),
            ttft_target: kvmesh_router::RouterConfig::default().ttft_target,
        }
    }
}

impl Candidate {
    /// Sets the engine keys this candidate chooses.
    pub fn set_engine(&self, engine: &mut kvmesh_engine::engine_config::EngineConfig) {
        engine.max_num_batched_tokens = self.max_num_batched_tokens;
        engine.max_step_time = (!self.max_step_time.is_zero()).then_some(self.max_step_time);
    }
}

impl fmt::Display for Candidate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}, step {} tokens",
            self.topology, self.max_num_batched_tokens
        )?;
        if !self.max_step_time.is_zero() {
            write!(f, " within {:?}", self.max_step_time)?;
        }
        write!(
            f,
            ", local-prefill threshold {}, {}, ttft target ",
            self.local_prefill_max_tokens, self.routing
        )?;
        if self.ttft_target.is_zero() {
            f.write_str("off")
        } else {
            write!(f, "{:?}", self.ttft_target)
        }
    }
}

/// The values tried for each setting; the candidates are their product.
#[derive(Clone, Debug, PartialEq)]
pub struct SearchSpace {
    pub topologies: Vec<Topology>,
    pub step_budgets: Vec<usize>,
    /// Zero: no step-time target.
    pub step_times: Vec<Duration>,
    pub local_prefill_thresholds: Vec<usize>,
    pub policies: Vec<RoutingConfig>,
    pub ttft_targets: Vec<Duration>,
}

impl SearchSpace {
    /// The default space for a budget of `nodes` engine nodes (the router apart): the
    /// in-process `serve` on one node (one worker; two that each prefill their own prompts;
    /// a prefill and a decode worker), and every mesh split of the nodes. The other lists
    /// bracket each default (256-token steps, the CPU engine's; a 256-token local-prefill
    /// threshold; KV-aware routing; admission off).
    pub fn for_nodes(nodes: usize) -> SearchSpace {
        let mut topologies = vec![
            Topology::Serve {
                prefill_workers: 0,
                decode_workers: 1,
            },
            Topology::Serve {
                prefill_workers: 0,
                decode_workers: 2,
            },
            Topology::Serve {
                prefill_workers: 1,
                decode_workers: 1,
            },
        ];
        topologies.extend(Topology::mesh_splits(nodes));
        SearchSpace {
            topologies,
            step_budgets: vec![128, 256, 512],
            step_times: vec![Duration::ZERO],
            local_prefill_thresholds: vec![0, 256, 1024],
            policies: vec![RoutingConfig::default(), RoutingConfig::LeastLoaded {}],
            ttft_targets: vec![Duration::ZERO, Duration::from_secs(2)],
        }
    }

    /// Every combination, in list order, with settings that cannot matter for a topology
    /// held at their first value so that equal configurations are measured once: the
    /// local-prefill threshold without prefill engines (everything prefills locally), and
    /// the routing policy with one engine of each kind (there is no choice to make).
    pub fn candidates(&self) -> Vec<Candidate> {
        let mut out: Vec<Candidate> = Vec::new();
        for &topology in &self.topologies {
            let (prefills, decodes) = topology.engines();
            let thresholds = if prefills == 0 {
                &self.local_prefill_thresholds[..self.local_prefill_thresholds.len().min(1)]
            } else {
                &self.local_prefill_thresholds[..]
            };
            let policies = if prefills <= 1 && decodes <= 1 {
                &self.policies[..self.policies.len().min(1)]
            } else {
                &self.policies[..]
            };
            let steps = self
                .step_budgets
                .iter()
                .flat_map(|&b| self.step_times.iter().map(move |&t| (b, t)));
            for (step, step_time) in steps {
                for &threshold in thresholds {
                    for routing in policies {
                        for &ttft_target in &self.ttft_targets {
                            let c = Candidate {
                                topology,
                                max_num_batched_tokens: step,
                                max_step_time: step_time,
                                local_prefill_max_tokens: threshold,
                                routing: routing.clone(),
                                ttft_target,
                            };
                            if !out.contains(&c) {
                                out.push(c);
                            }
                        }
                    }
                }
            }
        }
        out
    }
}

/// `n` of `candidates` drawn at random from `seed` (all of them when `n` is no smaller),
/// in their original order: for a space larger than the time budget affords
/// ([`super::halving::affordable`]).
pub fn sample(candidates: Vec<Candidate>, n: usize, seed: u64) -> Vec<Candidate> {
    if n >= candidates.len() {
        return candidates;
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let mut keep = rand::seq::index::sample(&mut rng, candidates.len(), n).into_vec();
    keep.sort_unstable();
    let mut keep = keep.into_iter().peekable();
    candidates
        .into_iter()
        .enumerate()
        .filter_map(|(i, c)| {
            (keep.peek() == Some(&i)).then(|| {
                keep.next();
                c
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_budget_splits_every_way() {
        let splits: Vec<String> = Topology::mesh_splits(4)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(splits, ["mesh 1:3", "mesh 2:2", "mesh 3:1"]);
        assert!(Topology::mesh_splits(1).is_empty());
        let space = SearchSpace::for_nodes(4);
        assert_eq!(space.topologies.len(), 6);
        assert_eq!(space.topologies[0].to_string(), "serve 0p+1d");
    }

    #[test]
    fn topologies_parse_and_bad_ones_say_why() {
        assert_eq!(
            "serve:1+2".parse::<Topology>(),
            Ok(Topology::Serve {
                prefill_workers: 1,
                decode_workers: 2
            })
        );
        assert_eq!(
            " mesh:1+3 ".parse::<Topology>(),
            Ok(Topology::Mesh {
                prefill_nodes: 1,
                decode_nodes: 3
            })
        );
        for bad in ["mesh:1:3", "serve", "pool:1+1", "serve:x+1"] {
            let e = bad.parse::<Topology>().unwrap_err();
            assert!(e.contains("expected serve:P+D"), "{bad}: {e}");
        }
        assert!("mesh:0+2"
            .parse::<Topology>()
            .unwrap_err()
            .contains("prefill node"));
        assert!("serve:1+0"
            .parse::<Topology>()
            .unwrap_err()
            .contains("decode"));
    }

    #[test]
    fn candidates_fold_settings_that_cannot_matter() {
        let space = SearchSpace::for_nodes(4);
        let all = space.candidates();
        let count = |t: Topology| all.iter().filter(|c| c.topology == t).count();
        // No prefill worker: 3 steps × 2 targets (threshold and policy moot).
        assert_eq!(
            count(Topology::Serve {
                prefill_workers: 0,
                decode_workers: 1
            }),
            6
        );
        // Two workers prefilling locally: 3 steps × 2 policies × 2 targets (threshold moot).
        assert_eq!(
            count(Topology::Serve {
                prefill_workers: 0,
                decode_workers: 2
            }),
            12
        );
        // One of each: 3 steps × 3 thresholds × 2 targets (policy moot).
        assert_eq!(
            count(Topology::Serve {
                prefill_workers: 1,
                decode_workers: 1
            }),
            18
        );
        // A mesh split: everything varies.
        for split in Topology::mesh_splits(4) {
            assert_eq!(count(split), 3 * 3 * 2 * 2, "{split}");
        }
        assert_eq!(all.len(), 6 + 12 + 18 + 3 * 36);
        for (i, c) in all.iter().enumerate() {
            assert!(!all[..i].contains(c), "{c} twice");
        }
        // The first candidate is every setting's first value.
        assert_eq!(
            all[0].to_string(),
            "serve 0p+1d, step 128 tokens, local-prefill threshold 0, kv_aware, ttft target off"
        );
        let with_target = &all[1];
        assert_eq!(with_target.ttft_target, Duration::from_secs(2));
        assert!(with_target.to_string().ends_with("ttft target 2s"));
    }

    #[test]
    fn step_times_multiply_the_step_budgets() {
        let mut space = SearchSpace::for_nodes(1);
        space.topologies.truncate(1);
        space.step_times = vec![Duration::ZERO, Duration::from_millis(60)];
        let all = space.candidates();
        // 3 step budgets × 2 step times × 2 ttft targets.
        assert_eq!(all.len(), 12);
        let timed: Vec<_> = all.iter().filter(|c| !c.max_step_time.is_zero()).collect();
        assert_eq!(timed.len(), 6);
        assert!(
            timed[0]
                .to_string()
                .contains("step 128 tokens within 60ms,"),
            "{}",
            timed[0]
        );
        let mut engine = kvmesh_engine::engine_config::EngineConfig::default();
        timed[0].set_engine(&mut engine);
        assert_eq!(engine.max_step_time, Some(Duration::from_millis(60)));
        all[0].set_engine(&mut engine);
        assert_eq!(engine.max_step_time, None);
    }

    #[test]
    fn a_sample_is_seeded_ordered_and_distinct() {
        let all = SearchSpace::for_nodes(4).candidates();
        let a = sample(all.clone(), 10, 7);
        assert_eq!(a.len(), 10);
        assert_eq!(
            a,
            sample(all.clone(), 10, 7),
            "the same seed, the same sample"
        );
        assert_ne!(a, sample(all.clone(), 10, 8));
        let positions: Vec<usize> = a
            .iter()
            .map(|c| all.iter().position(|x| x == c).unwrap())
            .collect();
        assert!(positions.windows(2).all(|w| w[0] < w[1]), "{positions:?}");
        assert_eq!(sample(all.clone(), 1000, 7), all);
    }
}
