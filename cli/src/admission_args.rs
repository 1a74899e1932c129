//! Admission-control and rate-limit flags, shared by `kvmesh serve` and `kvmesh router`; each
//! one given overrides the matching `RouterConfig` field.

use clap::Args;
use humantime_serde::re::humantime;
use kvmesh_router::RouterConfig;
use std::time::Duration;

#[derive(Args, Clone, Debug, Default)]
pub struct AdmissionArgs {
    /// Refuse a request (429 + Retry-After) when its estimated time to first token exceeds
    /// this (e.g. 800ms, 5s; 0s disables the check) [default: 0s].
    #[arg(long, env = "KVMESH_TTFT_TARGET", value_parser = humantime::parse_duration)]
    pub ttft_target: Option<Duration>,
    /// Most completion requests admitted and unfinished at once; more get 429 [default: 256].
    #[arg(long, env = "KVMESH_MAX_IN_FLIGHT")]
    pub max_in_flight: Option<usize>,
    /// Requests per second per API key (all requests share one budget without keys); 0 = no
    /// limit [default: 0].
    #[arg(long, env = "KVMESH_RATE_LIMIT")]
    pub rate_limit: Option<f64>,
    /// Requests a key may send at once above its rate [default: 10].
    #[arg(long, env = "KVMESH_RATE_LIMIT_BURST")]
    pub rate_limit_burst: Option<u32>,
}

impl AdmissionArgs {
    pub fn apply(&self, config: &mut RouterConfig) {
        if let Some(t) = self.ttft_target {
            config.ttft_target = t;
        }
        if let Some(n) = self.max_in_flight {
            config.max_in_flight = n;
        }
        if let Some(r) = self.rate_limit {
            config.rate_limit_per_second = r;
        }
        if let Some(b) = self.rate_limit_burst {
            config.rate_limit_burst = b;
        }
    }
}
