//! Faults injected into a run at instants of virtual time ([`MeshConfig::faults`]): a node
//! dies, or links between prefill and decode nodes slow down.
//!
//! A node that dies stops at once: its step in flight never completes, its KV is gone and the
//! router forgets what it published (the prefix index drops its blocks, as when a node's
//! lease expires) and routes nothing more to it. What happens to its requests is the real
//! mesh's answer (see [`crate::mesh`]): a decode node's requests migrate, a prefill node's
//! decode nodes prefill locally. The router learns of the death at once; the lease's expiry
//! delay (during which the real router retries a refusing node elsewhere) is not modelled.
//!
//! [`MeshConfig::faults`]: crate::mesh::MeshConfig::faults

use crate::link::LinkModel;
use kvmesh_common::NodeId;
use std::collections::BTreeMap;
use std::time::Duration;

/// Something that goes wrong at `at`, from the run's start.
#[derive(Clone, Debug, PartialEq)]
pub struct Fault {
    pub at: Duration,
    pub kind: FaultKind,
}

#[derive(Clone, Debug, PartialEq)]
pub enum FaultKind {
    /// The node (decode nodes are `0..nodes`, prefill nodes follow) stops for good. A second
    /// death of the same node does nothing.
    NodeDies(NodeId),
    /// Prefill→decode links move KV `factor` times slower (bandwidth divided by `factor`,
    /// latency unchanged) for transfers queued from `at` on: every link, or only the one
    /// from `between.0` (a prefill node) to `between.1` (a decode node). It replaces the
    /// factor the links it names had before (1 restores them).
    LinkSlows {
        factor: f64,
        between: Option<(NodeId, NodeId)>,
    },
}

impl Fault {
    pub fn node_dies(at: Duration, node: u64) -> Fault {
        Fault {
            at,
            kind: FaultKind::NodeDies(NodeId(node)),
        }
    }

    /// Every prefill→decode link slows by `factor` from `at`.
    pub fn links_slow(at: Duration, factor: f64) -> Fault {
        Fault {
            at,
            kind: FaultKind::LinkSlows {
                factor,
                between: None,
            },
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FaultError {
    #[error("fault names node {}, which the mesh does not have", .0 .0)]
    UnknownNode(NodeId),
    #[error("no link from prefill node {} to decode node {}", prefill.0, decode.0)]
    NotALink { prefill: NodeId, decode: NodeId },
    #[error("a link's slow-down factor must be positive and finite, not {0}")]
    BadFactor(f64),
}

/// Checks `faults` against a mesh of `decode` decode nodes and `prefill` prefill nodes.
pub fn validate(faults: &[Fault], decode: usize, prefill: usize) -> Result<(), FaultError> {
    let total = (decode + prefill) as u64;
    for f in faults {
        match &f.kind {
            FaultKind::NodeDies(n) if n.0 >= total => return Err(FaultError::UnknownNode(*n)),
            FaultKind::NodeDies(_) => {}
            FaultKind::LinkSlows { factor, between } => {
                if !(factor.is_finite() && *factor > 0.0) {
                    return Err(FaultError::BadFactor(*factor));
                }
                if let Some((p, d)) = between {
                    let is_prefill = (decode as u64..total).contains(&p.0);
                    if !is_prefill || d.0 >= decode as u64 {
                        return Err(FaultError::NotALink {
                            prefill: *p,
                            decode: *d,
                        });
                    }
                }
            }
        }
    }
    Ok(())
}

/// The slow-down each prefill→decode link is under.
#[derive(Clone, Debug, Default)]
pub struct LinkFactors {
    /// Every link's, where set.
    all: Option<f64>,
    /// One link's, over `all`.
    pairs: BTreeMap<(usize, usize), f64>,
}

impl LinkFactors {
    /// Applies a [`FaultKind::LinkSlows`].
    pub fn set(&mut self, factor: f64, between: Option<(usize, usize)>) {
        match between {
            None => {
                self.all = Some(factor);
                self.pairs.clear();
            }
            Some(pair) => {
                self.pairs.insert(pair, factor);
            }
        }
    }

    /// `base` as the link from prefill node `p` to decode node `d` now is.
    pub fn model(&self, base: LinkModel, p: usize, d: usize) -> LinkModel {
        let factor = self.pairs.get(&(p, d)).copied().or(self.all).unwrap_or(1.0);
        LinkModel {
            latency: base.latency,
            bytes_per_s: base.bytes_per_s / factor,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pair_overrides_every_link_until_every_link_is_set_again() {
        let base = LinkModel {
            latency: Duration::from_micros(3),
            bytes_per_s: 1e9,
        };
        let mut f = LinkFactors::default();
        assert_eq!(f.model(base, 4, 0), base);
        f.set(4.0, None);
        f.set(2.0, Some((4, 1)));
        assert_eq!(f.model(base, 4, 0).bytes_per_s, 2.5e8);
        assert_eq!(f.model(base, 4, 1).bytes_per_s, 5e8);
        assert_eq!(f.model(base, 4, 1).latency, base.latency);
        f.set(1.0, None);
        assert_eq!(f.model(base, 4, 1), base);
    }

    #[test]
    fn faults_must_name_what_the_mesh_has() {
        let ms = Duration::from_millis;
        assert!(validate(&[Fault::node_dies(ms(1), 5)], 4, 2).is_ok());
        assert!(matches!(
            validate(&[Fault::node_dies(ms(1), 6)], 4, 2),
            Err(FaultError::UnknownNode(NodeId(6)))
        ));
        assert!(matches!(
            validate(&[Fault::links_slow(ms(1), 0.0)], 4, 2),
            Err(FaultError::BadFactor(_))
        ));
        let pair = |p, d| Fault {
            at: ms(1),
            kind: FaultKind::LinkSlows {
                factor: 2.0,
                between: Some((NodeId(p), NodeId(d))),
            },
        };
        assert!(validate(&[pair(4, 3)], 4, 2).is_ok());
        assert!(matches!(
            validate(&[pair(3, 4)], 4, 2),
            Err(FaultError::NotALink { .. })
        ));
    }
}
