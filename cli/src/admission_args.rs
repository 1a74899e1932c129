//! Admission-control, rate-limit and request-field flags, shared by `kvmesh serve` and
//! `kvmesh router`; each one sets the matching key of the `[router]` table (`RouterConfig`).

use crate::config::env_vars;
use clap::Args;
use humantime_serde::re::humantime;
use kvmesh_router::RouterConfig;
use serde::Serialize;
use std::time::Duration;

#[derive(Args, Clone, Debug, Default, Serialize)]
pub struct AdmissionArgs {
    /// Refuse a request (429 + Retry-After) when its estimated time to first token exceeds
    /// this (e.g. 800ms, 5s; 0s disables the check).
    #[arg(long, env = env_vars::TTFT_TARGET, value_parser = humantime::parse_duration)]
    #[serde(with = "humantime_serde")]
    pub ttft_target: Option<Duration>,
    /// Most completion requests admitted and unfinished at once; more get 429 (default 4096:
    /// bursts queue).
    #[arg(long, env = env_vars::MAX_IN_FLIGHT)]
    pub max_in_flight: Option<usize>,
    /// Requests per second per API key (all requests share one budget without keys); 0 = no
    /// limit.
    #[arg(long, env = env_vars::RATE_LIMIT)]
    pub rate_limit: Option<f64>,
    /// Requests a key may send at once above its rate.
    #[arg(long, env = env_vars::RATE_LIMIT_BURST)]
    pub rate_limit_burst: Option<u32>,
    /// Refuse request fields the server does not know (400 unknown_parameter) instead of
    /// ignoring them and naming them in the x-kvmesh-ignored-params header.
    #[arg(long, env = env_vars::STRICT_PARAMS, num_args = 0..=1, default_missing_value = "true")]
    pub strict_params: Option<bool>,
}

/// Where `--api-keys` and the admission flags go in the TOML.
pub const ROUTER_KEYS: &[(&str, &str)] = &[
    ("api_keys", "router.api_keys"),
    ("ttft_target", "router.ttft_target"),
    ("max_in_flight", "router.max_in_flight"),
    ("rate_limit", "router.rate_limit_per_second"),
    ("rate_limit_burst", "router.rate_limit_burst"),
    ("strict_params", "router.strict_params"),
];

/// Masks the API keys for `--print-config`.
pub fn redact_api_keys(config: &mut RouterConfig) {
    for key in &mut config.api_keys {
        *key = "<redacted>".into();
    }
}
