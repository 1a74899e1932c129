//! The router's configuration: one typed struct, serde with `deny_unknown_fields`,
//! validated by [`RouterConfig::validate`] (which [`crate::Router::new`] calls).

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How the HTTP gateway listens, authenticates and bounds requests.
///
/// Durations are written as humantime strings in TOML/JSON (`"15s"`, `"500ms"`).
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    /// Address to listen on (default `127.0.0.1:8000`). `Router::serve` takes a bound
    /// listener; the caller binds this address.
    pub listen: SocketAddr,
    /// The model name served: `/v1/models` lists it and requests must name it (or omit
    /// `model`).
    pub model_name: String,
    /// Accepted bearer tokens (`Authorization: Bearer <key>`); empty = no auth. Only their
    /// SHA-256 digests are kept by the running router, and `Debug` redacts them.
    pub api_keys: Vec<String>,
    /// Largest accepted request body; larger bodies get 413.
    pub max_body_bytes: usize,
    /// The model's context window: prompt tokens + `max_tokens` must fit in it.
    pub max_context: usize,
    /// `max_tokens` when the request has none (capped by what is left of the context).
    pub default_max_tokens: u32,
    /// Largest `max_tokens` a request may ask for.
    pub max_tokens_limit: u32,
    /// Largest `n` (choices per request).
    pub max_n: u32,
    /// Most `stop` strings a request may give.
    pub max_stop_sequences: usize,
    /// Longest `stop` string, in bytes (stop matching runs on every generated token).
    pub max_stop_bytes: usize,
    /// Most entries in `logit_bias` (and in `stop_token_ids`).
    pub max_logit_bias: usize,
    /// Interval of SSE keep-alive comments while a stream is idle (lets proxies and the
    /// server notice dead clients during long prefills).
    #[serde(with = "humantime_serde")]
    pub sse_keep_alive: Duration,
    /// `Retry-After` sent with 429 (backend overloaded) and 503 (unavailable).
    #[serde(with = "humantime_serde")]
    pub retry_after: Duration,
    /// After the shutdown signal, how long `serve` waits for in-flight requests.
    #[serde(with = "humantime_serde")]
    pub shutdown_timeout: Duration,
    /// Admission control: a request is refused (429) when its estimated time to first token
    /// (the queue ahead of it at the backend's measured rate) exceeds this; `0s` (the
    /// default) disables the check. Set it to the deployment's TTFT objective: no default
    /// fits every machine (a 2-core CPU mesh can take seconds for one long prompt).
    #[serde(with = "humantime_serde")]
    pub ttft_target: Duration,
    /// Most completion requests admitted and not yet finished; more get 429. The default
    /// (4096) queues a gateway's bursts rather than refusing them: a waiting request holds
    /// its prompt (at most `max_context` tokens, 4 bytes each) and a few kilobytes of state,
    /// so 4096 of them at the 8192-token context take at most about 200 MB. Refusing on
    /// latency is `ttft_target`'s job.
    pub max_in_flight: usize,
    /// Requests per second allowed per API key (one budget for all when auth is off); `0`
    /// disables rate limiting. Excess gets 429.
    pub rate_limit_per_second: f64,
    /// Requests a key may send at once above its rate (the token bucket's size).
    pub rate_limit_burst: u32,
    /// Refuse request fields this server does not know (400 `unknown_parameter`) instead of
    /// ignoring them and naming them in the `x-kvmesh-ignored-params` response header.
    pub strict_params: bool,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            listen: SocketAddr::from((Ipv4Addr::LOCALHOST, 8000)),
            model_name: "SmolLM2-135M-Instruct".into(),
            api_keys: Vec::new(),
            max_body_bytes: 4 << 20,
            max_context: 8192,
            default_max_tokens: 512,
            max_tokens_limit: 4096,
            max_n: 8,
            max_stop_sequences: 16,
            max_stop_bytes: 512,
            max_logit_bias: 300,
            sse_keep_alive: Duration::from_secs(15),
            retry_after: Duration::from_secs(1),
            shutdown_timeout: Duration::from_secs(30),
            ttft_target: Duration::ZERO,
            max_in_flight: 4096,
            rate_limit_per_second: 0.0,
            rate_limit_burst: 10,
            strict_params: false,
        }
    }
}

impl std::fmt::Debug for RouterConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterConfig")
            .field("listen", &self.listen)
            .field("model_name", &self.model_name)
            .field(
                "api_keys",
                &format_args!("[{} redacted]", self.api_keys.len()),
            )
            .field("max_body_bytes", &self.max_body_bytes)
            .field("max_context", &self.max_context)
            .field("default_max_tokens", &self.default_max_tokens)
            .field("max_tokens_limit", &self.max_tokens_limit)
            .field("max_n", &self.max_n)
            .field("max_stop_sequences", &self.max_stop_sequences)
            .field("max_stop_bytes", &self.max_stop_bytes)
            .field("max_logit_bias", &self.max_logit_bias)
            .field("sse_keep_alive", &self.sse_keep_alive)
            .field("retry_after", &self.retry_after)
            .field("shutdown_timeout", &self.shutdown_timeout)
            .field("ttft_target", &self.ttft_target)
            .field("max_in_flight", &self.max_in_flight)
            .field("rate_limit_per_second", &self.rate_limit_per_second)
            .field("rate_limit_burst", &self.rate_limit_burst)
            .field("strict_params", &self.strict_params)
            .finish()
    }
}

/// A configuration value that cannot work.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid router config `{field}`: {reason}")]
pub struct ConfigError {
    pub field: &'static str,
    pub reason: &'static str,
}

impl RouterConfig {
    /// Checks every field; `Router::new` refuses a config that fails.
    pub fn validate(&self) -> Result<(), ConfigError> {
        fn check(ok: bool, field: &'static str, reason: &'static str) -> Result<(), ConfigError> {
            if ok {
                Ok(())
            } else {
                Err(ConfigError { field, reason })
            }
        }
        check(
            !self.model_name.is_empty(),
            "model_name",
            "must not be empty",
        )?;
        check(
            self.api_keys.iter().all(|k| !k.is_empty()),
            "api_keys",
            "keys must not be empty",
        )?;
        check(
            self.max_body_bytes > 0,
            "max_body_bytes",
            "must be positive",
        )?;
        check(self.max_context >= 2, "max_context", "must be at least 2")?;
        check(
            self.default_max_tokens >= 1,
            "default_max_tokens",
            "must be at least 1",
        )?;
        check(
            self.max_tokens_limit >= 1,
            "max_tokens_limit",
            "must be at least 1",
        )?;
        check(self.max_n >= 1, "max_n", "must be at least 1")?;
        check(
            self.max_stop_bytes >= 1,
            "max_stop_bytes",
            "must be at least 1",
        )?;
        check(
            !self.sse_keep_alive.is_zero(),
            "sse_keep_alive",
            "must be positive",
        )?;
        check(
            self.max_in_flight >= 1,
            "max_in_flight",
            "must be at least 1",
        )?;
        check(
            self.rate_limit_per_second.is_finite() && self.rate_limit_per_second >= 0.0,
            "rate_limit_per_second",
            "must be a number >= 0 (0 disables rate limiting)",
        )?;
        check(
            self.rate_limit_burst >= 1,
            "rate_limit_burst",
            "must be at least 1",
        )?;
        Ok(())
    }

    /// `Retry-After` in whole seconds (at least 1).
    pub(crate) fn retry_after_secs(&self) -> u64 {
        self.retry_after.as_secs_f64().ceil().max(1.0) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_round_trip() {
        let c = RouterConfig::default();
        c.validate().unwrap();
        let json = serde_json::to_string(&c).unwrap();
        assert!(json.contains("\"sse_keep_alive\":\"15s\""), "{json}");
        let back: RouterConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn unknown_fields_and_bad_values_are_rejected() {
        assert!(serde_json::from_str::<RouterConfig>(r#"{"listen_port": 1}"#).is_err());
        let c: RouterConfig = serde_json::from_str(r#"{"max_n": 0}"#).unwrap();
        assert_eq!(c.validate().unwrap_err().field, "max_n");
        for (json, field) in [
            (r#"{"max_in_flight": 0}"#, "max_in_flight"),
            (r#"{"rate_limit_per_second": -1}"#, "rate_limit_per_second"),
            (r#"{"rate_limit_burst": 0}"#, "rate_limit_burst"),
        ] {
            let c: RouterConfig = serde_json::from_str(json).unwrap();
            assert_eq!(c.validate().unwrap_err().field, field, "{json}");
        }
        // A zero target disables the delay check; it is valid.
        let c: RouterConfig = serde_json::from_str(r#"{"ttft_target": "0s"}"#).unwrap();
        assert_eq!(c.ttft_target, Duration::ZERO);
        c.validate().unwrap();
    }

    #[test]
    fn debug_redacts_api_keys() {
        let c = RouterConfig {
            api_keys: vec!["sk-secret".into()],
            ..Default::default()
        };
        let s = format!("{c:?}");
        assert!(!s.contains("sk-secret") && s.contains("1 redacted"), "{s}");
        // Every field is shown (the Debug impl is written by hand).
        let fields = serde_json::to_value(&c).unwrap();
        for name in fields.as_object().unwrap().keys() {
            assert!(s.contains(&format!("{name}:")), "{name} missing from {s}");
        }
    }
}
