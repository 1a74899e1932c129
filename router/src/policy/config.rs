//! Which routing policy, with its knobs: a tagged serde enum (`policy = "kv_aware"` in
//! TOML), a plain name for a CLI flag, and `build` to make the policy.

use super::{KvAware, LeastLoaded, PowerOfTwo, Random, RoundRobin, RoutingPolicy, Tier};
use crate::ConfigError;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The routing policy and its settings. Defaults to [`RoutingConfig::KvAware`] with
/// [`KvAwareConfig::default`].
///
/// Knob-less policies are empty struct variants (`LeastLoaded {}`): serde ignores extra
/// fields after the tag of a unit variant, and a misspelt knob must be an error.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "policy", rename_all = "snake_case", deny_unknown_fields)]
pub enum RoutingConfig {
    /// Overlap credit against load, with an imbalance guard.
    KvAware(KvAwareConfig),
    /// Fewest requests ahead.
    LeastLoaded {},
    /// Each node in turn.
    RoundRobin {},
    /// Uniformly at random.
    Random {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        seed: Option<u64>,
    },
    /// The less loaded of two random nodes.
    PowerOfTwo {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        seed: Option<u64>,
    },
}

/// The knobs of [`KvAware`]; see its module for the cost formula.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvAwareConfig {
    /// Cost of prefilling the whole prompt (scaled by the share left after credit).
    pub prefill_weight: f64,
    /// Cost of one request ahead (running, waiting or in flight) on a node.
    pub load_weight: f64,
    /// Credit per cached block in the device pool, `0.0..=1.0`.
    pub device_credit: f64,
    /// Credit per cached block in host memory (it must be copied back first).
    pub host_credit: f64,
    /// Credit per cached block on disk (read, then copied).
    pub disk_credit: f64,
    /// Nodes loaded beyond `min_load * imbalance_ratio + imbalance_slack` are passed over,
    /// however much of the prompt they hold. At least 1.
    pub imbalance_ratio: f64,
    /// See `imbalance_ratio`: the absolute headroom, in requests.
    pub imbalance_slack: usize,
    /// Seeds the tie-breaking generator (tests); none = from the OS.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
}

impl Default for KvAwareConfig {
    fn default() -> Self {
        KvAwareConfig {
            // A full hit is worth 10 requests of queue.
            prefill_weight: 1.0,
            load_weight: 0.1,
            device_credit: 1.0,
            host_credit: 0.8,
            disk_credit: 0.5,
            imbalance_ratio: 1.5,
            imbalance_slack: 4,
            seed: None,
        }
    }
}

impl KvAwareConfig {
    /// The share of a block's prefill that a cached copy in `tier` saves.
    pub fn credit(&self, tier: Tier) -> f64 {
        match tier {
            Tier::Device => self.device_credit,
            Tier::Host => self.host_credit,
            Tier::Disk => self.disk_credit,
        }
    }
}

impl Default for RoutingConfig {
    fn default() -> Self {
        RoutingConfig::KvAware(KvAwareConfig::default())
    }
}

impl RoutingConfig {
    /// Every policy name [`FromStr`] accepts, e.g. for a CLI flag's help.
    pub const NAMES: [&'static str; 5] = [
        "kv_aware",
        "least_loaded",
        "round_robin",
        "random",
        "power_of_two",
    ];

    /// The policy's name, as in the `policy` tag.
    pub fn name(&self) -> &'static str {
        match self {
            RoutingConfig::KvAware(_) => "kv_aware",
            RoutingConfig::LeastLoaded {} => "least_loaded",
            RoutingConfig::RoundRobin {} => "round_robin",
            RoutingConfig::Random { .. } => "random",
            RoutingConfig::PowerOfTwo { .. } => "power_of_two",
        }
    }

    /// Checks the knobs; call at config load (a policy built from an invalid config still
    /// answers, but not sensibly).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let RoutingConfig::KvAware(c) = self else {
            return Ok(());
        };
        let invalid = |field, reason| Err(ConfigError { field, reason });
        for (field, w) in [
            ("routing.prefill_weight", c.prefill_weight),
            ("routing.load_weight", c.load_weight),
        ] {
            if !(w.is_finite() && w >= 0.0) {
                return invalid(field, "must be a finite number >= 0");
            }
        }
        for (field, credit) in [
            ("routing.device_credit", c.device_credit),
            ("routing.host_credit", c.host_credit),
            ("routing.disk_credit", c.disk_credit),
        ] {
            if !(0.0..=1.0).contains(&credit) {
                return invalid(field, "must be between 0 and 1");
            }
        }
        if !(c.imbalance_ratio.is_finite() && c.imbalance_ratio >= 1.0) {
            return invalid("routing.imbalance_ratio", "must be a finite number >= 1");
        }
        Ok(())
    }

    /// The policy this config describes, with fresh state (counter, generator).
    pub fn build(&self) -> Box<dyn RoutingPolicy> {
        match self {
            RoutingConfig::KvAware(c) => Box::new(KvAware::new(c.clone())),
            RoutingConfig::LeastLoaded {} => Box::new(LeastLoaded),
            RoutingConfig::RoundRobin {} => Box::new(RoundRobin::new()),
            RoutingConfig::Random { seed } => Box::new(Random::new(*seed)),
            RoutingConfig::PowerOfTwo { seed } => Box::new(PowerOfTwo::new(*seed)),
        }
    }
}

/// A policy name that is not one of [`RoutingConfig::NAMES`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown routing policy `{0}` (expected one of: kv_aware, least_loaded, round_robin, random, power_of_two)")]
pub struct UnknownPolicy(pub String);

/// A policy by name with default settings (`--routing-policy power_of_two`); `-` may stand
/// for `_`.
impl FromStr for RoutingConfig {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s.replace('-', "_").as_str() {
            "kv_aware" => RoutingConfig::default(),
            "least_loaded" => RoutingConfig::LeastLoaded {},
            "round_robin" => RoutingConfig::RoundRobin {},
            "random" => RoutingConfig::Random { seed: None },
            "power_of_two" => RoutingConfig::PowerOfTwo { seed: None },
            _ => return Err(UnknownPolicy(s.to_owned())),
        })
    }
}

impl fmt::Display for RoutingConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_build_and_round_trip() {
        for name in RoutingConfig::NAMES {
            let c: RoutingConfig = name.parse().unwrap();
            assert_eq!(c.name(), name);
            assert_eq!(c.to_string(), name);
            assert_eq!(c.build().name(), name);
            c.validate().unwrap();
            let json = serde_json::to_string(&c).unwrap();
            assert_eq!(serde_json::from_str::<RoutingConfig>(&json).unwrap(), c);
        }
        assert_eq!(
            "power-of-two".parse::<RoutingConfig>().unwrap().name(),
            "power_of_two"
        );
        let err = "fastest".parse::<RoutingConfig>().unwrap_err();
        assert!(err.to_string().contains("least_loaded"), "{err}");
        assert_eq!(RoutingConfig::default().name(), "kv_aware");
    }

    #[test]
    fn tagged_with_defaults_for_missing_knobs() {
        let c: RoutingConfig =
            serde_json::from_str(r#"{"policy": "kv_aware", "host_credit": 0.5, "seed": 3}"#)
                .unwrap();
        assert_eq!(
            c,
            RoutingConfig::KvAware(KvAwareConfig {
                host_credit: 0.5,
                seed: Some(3),
                ..KvAwareConfig::default()
            })
        );
        let c: RoutingConfig = serde_json::from_str(r#"{"policy": "random"}"#).unwrap();
        assert_eq!(c, RoutingConfig::Random { seed: None });
        let c: RoutingConfig =
            serde_json::from_str(r#"{"policy": "power_of_two", "seed": 9}"#).unwrap();
        assert_eq!(c, RoutingConfig::PowerOfTwo { seed: Some(9) });
    }

    #[test]
    fn unknown_policies_fields_and_bad_values_are_rejected() {
        for bad in [
            r#"{"policy": "fastest"}"#,
            r#"{"policy": "kv_aware", "host_credits": 0.5}"#,
            r#"{"policy": "least_loaded", "seed": 1}"#,
            r#"{"policy": "random", "ratio": 1}"#,
            r#"{"host_credit": 0.5}"#,
        ] {
            assert!(serde_json::from_str::<RoutingConfig>(bad).is_err(), "{bad}");
        }
        let check = |json: &str| {
            serde_json::from_str::<RoutingConfig>(json)
                .unwrap()
                .validate()
                .unwrap_err()
                .field
        };
        assert_eq!(
            check(r#"{"policy": "kv_aware", "disk_credit": 1.5}"#),
            "routing.disk_credit"
        );
        assert_eq!(
            check(r#"{"policy": "kv_aware", "load_weight": -1}"#),
            "routing.load_weight"
        );
        assert_eq!(
            check(r#"{"policy": "kv_aware", "imbalance_ratio": 0.5}"#),
            "routing.imbalance_ratio"
        );
    }
}
