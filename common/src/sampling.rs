//! Sampling parameters and finish reasons: what a request asks of the sampler, and why it ended.

use crate::ids::TokenId;
use serde::{Deserialize, Serialize};

/// How to pick each next token and when to stop. Defaults are OpenAI's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means disabled.
    pub top_k: u32,
    /// 1.0 means disabled.
    pub top_p: f32,
    /// 0.0 means disabled.
    pub min_p: f32,
    /// Seed for this request's random stream; `None` draws one.
    pub seed: Option<u64>,
    /// Multiplicative penalty on tokens already in prompt or output (1.0 = off; CTRL style).
    pub repetition_penalty: f32,
    /// Subtracted once per previous occurrence in the output.
    pub frequency_penalty: f32,
    /// Subtracted once if the token occurred in the output.
    pub presence_penalty: f32,
    /// Added to the logit of each listed token before sampling.
    pub logit_bias: Vec<(TokenId, f32)>,
    /// Generation stops after any of these tokens (besides EOS unless `ignore_eos`).
    pub stop_token_ids: Vec<TokenId>,
    /// Generation stops when the text ends with any of these; the stop string is not returned.
    pub stop: Vec<String>,
    pub max_tokens: u32,
    /// EOS and stop tokens are suppressed until this many tokens were generated.
    pub min_tokens: u32,
    pub ignore_eos: bool,
    /// Number of top log-probabilities to return per token (`None` = no logprobs).
    pub logprobs: Option<u32>,
    /// What the output must match (structured outputs): tokens that would break it are
    /// masked before sampling.
    pub constraint: Option<Constraint>,
}

/// A structured-output constraint: the language the generated text must belong to.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Constraint {
    /// Any JSON object.
    JsonObject,
    /// JSON valid against this JSON schema.
    JsonSchema { schema: serde_json::Value },
    /// Text matching this regular expression (Rust `regex` syntax), whole.
    Regex { pattern: String },
    /// Exactly one of these strings.
    Choice { options: Vec<String> },
    /// A context-free grammar in llguidance's Lark syntax.
    Grammar { lark: String },
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logit_bias: Vec::new(),
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            max_tokens: 16,
            min_tokens: 0,
            ignore_eos: false,
            logprobs: None,
            constraint: None,
        }
    }
}

/// A parameter outside its valid range.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("invalid sampling parameter `{param}`: {reason}")]
pub struct SamplingParamsError {
    pub param: &'static str,
    pub reason: String,
}

impl SamplingParams {
    /// Greedy decoding of at most `max_tokens` tokens.
    pub fn greedy(max_tokens: u32) -> Self {
        SamplingParams {
            temperature: 0.0,
            max_tokens,
            ..Default::default()
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// Checks every range; the router maps the error to a 400.
    pub fn validate(&self) -> Result<(), SamplingParamsError> {
        fn check(ok: bool, param: &'static str, reason: &str) -> Result<(), SamplingParamsError> {
            if ok {
                Ok(())
            } else {
                Err(SamplingParamsError {
                    param,
                    reason: reason.to_string(),
                })
            }
        }
        check(
            self.temperature.is_finite() && (0.0..=2.0).contains(&self.temperature),
            "temperature",
            "must be a number in [0, 2]",
        )?;
        check(
            self.top_p.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0,
            "top_p",
            "must be in (0, 1]",
        )?;
        check(
            self.min_p.is_finite() && (0.0..=1.0).contains(&self.min_p),
            "min_p",
            "must be in [0, 1]",
        )?;
        check(
            self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0,
            "repetition_penalty",
            "must be a positive number",
        )?;
        check(
            self.frequency_penalty.is_finite() && (-2.0..=2.0).contains(&self.frequency_penalty),
            "frequency_penalty",
            "must be in [-2, 2]",
        )?;
        check(
            self.presence_penalty.is_finite() && (-2.0..=2.0).contains(&self.presence_penalty),
            "presence_penalty",
            "must be in [-2, 2]",
        )?;
        check(
            self.logit_bias
                .iter()
                .all(|(_, b)| b.is_finite() && (-100.0..=100.0).contains(b)),
            "logit_bias",
            "biases must be in [-100, 100]",
        )?;
        check(self.max_tokens >= 1, "max_tokens", "must be at least 1")?;
        check(
            self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must not exceed max_tokens",
        )?;
        check(
            self.stop.iter().all(|s| !s.is_empty()),
            "stop",
            "stop strings must not be empty",
        )?;
        check(
            self.logprobs.is_none_or(|n| n <= 20),
            "top_logprobs",
            "must be in [0, 20]",
        )?;
        Ok(())
    }
}

/// Why a sequence stopped generating.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// `max_tokens` reached or the context is full.
    Length,
    /// The client went away or the request was aborted.
    Cancelled,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        assert!(SamplingParams::default().validate().is_ok());
        assert!(SamplingParams::greedy(8).is_greedy());
    }

    #[test]
    fn nan_and_huge_temperature_are_rejected() {
        for t in [f32::NAN, 1e9, -0.5] {
            let p = SamplingParams {
                temperature: t,
                ..Default::default()
            };
            assert_eq!(p.validate().unwrap_err().param, "temperature");
        }
    }

    #[test]
    fn zero_max_tokens_is_rejected() {
        let p = SamplingParams {
            max_tokens: 0,
            ..Default::default()
        };
        assert_eq!(p.validate().unwrap_err().param, "max_tokens");
    }
}
