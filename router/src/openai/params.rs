//! Request parameters -> `SamplingParams`: ranges, limits from the config, and the context
//! check. Fields absent (or `null`) take OpenAI's defaults.

use std::collections::BTreeMap;

use kvmesh_common::{Constraint, SamplingParams};

use super::types::StopParam;
use crate::config::RouterConfig;
use crate::error::ApiError;

/// The sampling fields chat and completions share, as the client sent them.
#[derive(Debug, Default)]
pub(crate) struct SamplingFields {
    pub(crate) n: Option<i64>,
    /// `max_tokens` or `max_completion_tokens`, and which one it was.
    pub(crate) max_tokens: Option<(i64, &'static str)>,
    pub(crate) temperature: Option<f32>,
    pub(crate) top_p: Option<f32>,
    pub(crate) top_k: Option<i64>,
    pub(crate) min_p: Option<f32>,
    pub(crate) seed: Option<i64>,
    pub(crate) stop: Option<StopParam>,
    pub(crate) stop_token_ids: Option<Vec<i64>>,
    pub(crate) presence_penalty: Option<f32>,
    pub(crate) frequency_penalty: Option<f32>,
    pub(crate) repetition_penalty: Option<f32>,
    pub(crate) logit_bias: Option<BTreeMap<String, f32>>,
    pub(crate) ignore_eos: Option<bool>,
    pub(crate) min_tokens: Option<i64>,
    /// Top logprobs per token (`Some(0)`: only the chosen token's).
    pub(crate) logprobs: Option<u32>,
    /// From `response_format` (checked already).
    pub(crate) constraint: Option<Constraint>,
}

/// The prompt, for the context check.
pub(crate) struct PromptInfo {
    pub(crate) tokens: usize,
    /// `messages` or `prompt`.
    pub(crate) param: &'static str,
}

/// Validated sampling parameters and the number of choices.
pub(crate) fn build(
    f: SamplingFields,
    prompt: &PromptInfo,
    cfg: &RouterConfig,
    vocab_size: usize,
) -> Result<(SamplingParams, usize), ApiError> {
    let defaults = SamplingParams::default();
    let n = match f.n {
        None => 1,
        Some(n) if n >= 1 && n <= i64::from(cfg.max_n) => n as usize,
        Some(_) => {
            return Err(ApiError::invalid(
                "n",
                format!("`n` must be between 1 and {}", cfg.max_n),
            ))
        }
    };
    let top_k = match f.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => u32::try_from(k).unwrap_or(u32::MAX),
        Some(_) => {
            return Err(ApiError::invalid(
                "top_k",
                "`top_k` must be -1 or 0 (disabled) or a positive integer",
            ))
        }
    };
    let token_id = |param: &'static str, id: i64| -> Result<u32, ApiError> {
        u32::try_from(id)
            .ok()
            .filter(|&id| (id as usize) < vocab_size)
            .ok_or_else(|| {
                ApiError::invalid(
                    param,
                    format!("token id {id} is outside the vocabulary of {vocab_size} tokens"),
                )
            })
    };
    let stop = f.stop.map(StopParam::into_vec).unwrap_or_default();
    if stop.len() > cfg.max_stop_sequences {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "at most {} stop sequences are allowed",
                cfg.max_stop_sequences
            ),
        ));
    }
    if stop.iter().any(|s| s.len() > cfg.max_stop_bytes) {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "stop sequences must be at most {} bytes long",
                cfg.max_stop_bytes
            ),
        ));
    }
    let stop_token_ids = f.stop_token_ids.unwrap_or_default();
    if stop_token_ids.len() > cfg.max_logit_bias {
        return Err(ApiError::invalid(
            "stop_token_ids",
            format!("at most {} stop token ids are allowed", cfg.max_logit_bias),
        ));
    }
    let stop_token_ids = stop_token_ids
        .into_iter()
        .map(|id| token_id("stop_token_ids", id))
        .collect::<Result<Vec<_>, _>>()?;
    let logit_bias = f.logit_bias.unwrap_or_default();
    if logit_bias.len() > cfg.max_logit_bias {
        return Err(ApiError::invalid(
            "logit_bias",
            format!(
                "at most {} logit_bias entries are allowed",
                cfg.max_logit_bias
            ),
        ));
    }
    let mut logit_bias = logit_bias
        .into_iter()
        .map(|(key, bias)| {
            let id = key.trim().parse::<i64>().map_err(|_| {
                ApiError::invalid(
                    "logit_bias",
                    format!("`logit_bias` keys must be token ids, got {key:?}"),
                )
            })?;
            Ok((token_id("logit_bias", id)?, bias))
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    logit_bias.sort_by_key(|&(id, _)| id);
    let min_tokens = match f.min_tokens {
        None => 0,
        Some(m) => u32::try_from(m)
            .map_err(|_| ApiError::invalid("min_tokens", "`min_tokens` must be at least 0"))?,
    };
    let max_tokens = max_tokens(f.max_tokens, prompt, cfg)?;
    let params = SamplingParams {
        temperature: f.temperature.unwrap_or(defaults.temperature),
        top_k,
        top_p: f.top_p.unwrap_or(defaults.top_p),
        min_p: f.min_p.unwrap_or(defaults.min_p),
        seed: f.seed.map(|s| s as u64),
        repetition_penalty: f.repetition_penalty.unwrap_or(defaults.repetition_penalty),
        frequency_penalty: f.frequency_penalty.unwrap_or(defaults.frequency_penalty),
        presence_penalty: f.presence_penalty.unwrap_or(defaults.presence_penalty),
        logit_bias,
        stop_token_ids,
        stop,
        max_tokens,
        min_tokens,
        ignore_eos: f.ignore_eos.unwrap_or(false),
        logprobs: f.logprobs,
        constraint: f.constraint,
    };
    params
        .validate()
        .map_err(|e| ApiError::invalid(e.param, e.reason))?;
    Ok((params, n))
}

/// The completion budget: the client's (checked against the limit and the context), or the
/// default capped by what the context has left.
fn max_tokens(
    requested: Option<(i64, &'static str)>,
    prompt: &PromptInfo,
    cfg: &RouterConfig,
) -> Result<u32, ApiError> {
    let left = cfg.max_context.saturating_sub(prompt.tokens);
    let exceeded = |param, max_tokens| ApiError::ContextLengthExceeded {
        param,
        prompt_tokens: prompt.tokens,
        max_tokens,
        max_context: cfg.max_context,
    };
    if left == 0 {
        return Err(exceeded(
            prompt.param,
            requested.map_or(1, |(m, _)| m.max(1) as usize),
        ));
    }
    match requested {
        None => Ok(cfg
            .default_max_tokens
            .min(cfg.max_tokens_limit)
            .min(u32::try_from(left).unwrap_or(u32::MAX))),
        Some((m, param)) if m < 1 => Err(ApiError::invalid(
            param,
            format!("`{param}` must be at least 1, got {m}"),
        )),
        Some((m, param)) if m > i64::from(cfg.max_tokens_limit) => Err(ApiError::invalid(
            param,
            format!(
                "`{param}` must be at most {}, got {m}",
                cfg.max_tokens_limit
            ),
        )),
        Some((m, param)) if m as usize > left => Err(exceeded(param, m as usize)),
        Some((m, _)) => Ok(m as u32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> RouterConfig {
        RouterConfig {
            max_context: 100,
            default_max_tokens: 50,
            max_tokens_limit: 80,
            ..Default::default()
        }
    }

    fn prompt(tokens: usize) -> PromptInfo {
        PromptInfo {
            tokens,
            param: "prompt",
        }
    }

    fn param_of(f: SamplingFields, p: usize) -> Option<String> {
        build(f, &prompt(p), &cfg(), 1000)
            .err()
            .map(|e| e.param().unwrap_or("").to_string())
    }

    #[test]
    fn max_tokens_defaults_and_context() {
        let c = cfg();
        assert_eq!(max_tokens(None, &prompt(10), &c).unwrap(), 50);
        assert_eq!(max_tokens(None, &prompt(90), &c).unwrap(), 10);
        assert_eq!(
            max_tokens(Some((80, "max_tokens")), &prompt(20), &c).unwrap(),
            80
        );
        assert!(matches!(
            max_tokens(Some((80, "max_tokens")), &prompt(21), &c),
            Err(ApiError::ContextLengthExceeded {
                param: "max_tokens",
                ..
            })
        ));
        assert!(matches!(
            max_tokens(None, &prompt(100), &c),
            Err(ApiError::ContextLengthExceeded {
                param: "prompt",
                ..
            })
        ));
        assert_eq!(
            max_tokens(Some((-1, "max_tokens")), &prompt(1), &c)
                .unwrap_err()
                .param(),
            Some("max_tokens")
        );
        assert_eq!(
            max_tokens(Some((81, "max_completion_tokens")), &prompt(1), &c)
                .unwrap_err()
                .param(),
            Some("max_completion_tokens")
        );
    }

    #[test]
    fn ranges_are_checked() {
        let ok = build(SamplingFields::default(), &prompt(1), &cfg(), 1000).unwrap();
        assert_eq!(ok.1, 1);
        assert_eq!(ok.0.max_tokens, 50);
        let cases: Vec<(SamplingFields, &str)> = vec![
            (
                SamplingFields {
                    n: Some(0),
                    ..Default::default()
                },
                "n",
            ),
            (
                SamplingFields {
                    temperature: Some(1e9),
                    ..Default::default()
                },
                "temperature",
            ),
            (
                SamplingFields {
                    top_k: Some(-2),
                    ..Default::default()
                },
                "top_k",
            ),
            (
                SamplingFields {
                    stop_token_ids: Some(vec![1000]),
                    ..Default::default()
                },
                "stop_token_ids",
            ),
            (
                SamplingFields {
                    logit_bias: Some([("x".to_string(), 1.0)].into()),
                    ..Default::default()
                },
                "logit_bias",
            ),
            (
                SamplingFields {
                    logit_bias: Some([("5".to_string(), 101.0)].into()),
                    ..Default::default()
                },
                "logit_bias",
            ),
            (
                SamplingFields {
                    min_tokens: Some(-1),
                    ..Default::default()
                },
                "min_tokens",
            ),
            (
                SamplingFields {
                    stop: Some(StopParam::One(String::new())),
                    ..Default::default()
                },
                "stop",
            ),
            (
                SamplingFields {
                    stop: Some(StopParam::Many(vec!["ok".into(), "x".repeat(513)])),
                    ..Default::default()
                },
                "stop",
            ),
        ];
        for (f, param) in cases {
            assert_eq!(param_of(f, 1).as_deref(), Some(param));
        }
    }

    #[test]
    fn fields_map_to_sampling_params() {
        let f = SamplingFields {
            n: Some(2),
            top_k: Some(-1),
            seed: Some(-1),
            stop: Some(StopParam::Many(vec!["a".into(), "b".into()])),
            logit_bias: Some([("7".to_string(), -5.0), ("3".to_string(), 2.0)].into()),
            logprobs: Some(2),
            ..Default::default()
        };
        let (p, n) = build(f, &prompt(1), &cfg(), 1000).unwrap();
        assert_eq!(n, 2);
        assert_eq!(p.top_k, 0);
        assert_eq!(p.seed, Some(u64::MAX));
        assert_eq!(p.stop, vec!["a", "b"]);
        assert_eq!(p.logit_bias, vec![(3, 2.0), (7, -5.0)]);
        assert_eq!(p.logprobs, Some(2));
    }
}
