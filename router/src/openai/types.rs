//! OpenAI wire types shared by chat and completions: request fragments (`stop`,
//! `stream_options`) and response pieces (usage, logprobs, finish reasons).

use std::sync::Arc;

use kvmesh_common::{FinishReason, TokenEvent, TokenId, Usage};
use kvmesh_prompt::tokenizer::Tokenizer;
use serde::{Deserialize, Serialize};

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum StopParam {
    One(String),
    Many(Vec<String>),
}

impl StopParam {
    pub(crate) fn into_vec(self) -> Vec<String> {
        match self {
            StopParam::One(s) => vec![s],
            StopParam::Many(v) => v,
        }
    }
}

/// `stream_options` (only read when `stream` is true).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct StreamOptions {
    /// A final chunk with `usage` and no choices, before `[DONE]`.
    pub(crate) include_usage: Option<bool>,
}

/// `usage` of a response.
#[derive(Debug, Serialize)]
pub(crate) struct UsageBody {
    prompt_tokens: u32,
    completion_tokens: u32,
    total_tokens: u32,
    prompt_tokens_details: PromptTokensDetails,
}

#[derive(Debug, Serialize)]
struct PromptTokensDetails {
    cached_tokens: u32,
}

impl From<&Usage> for UsageBody {
    fn from(u: &Usage) -> Self {
        UsageBody {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: u.cached_tokens,
            },
        }
    }
}

/// OpenAI's `finish_reason`.
pub(crate) fn finish_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        // Never reaches a client: a cancelled generation is reported as an error.
        FinishReason::Cancelled => "abort",
    }
}

/// What every response and chunk of one request shares.
pub(crate) struct Meta {
    /// `chatcmpl-…` / `cmpl-…`.
    pub(crate) id: String,
    /// Unix seconds.
    pub(crate) created: u64,
    pub(crate) model: String,
    pub(crate) tokenizer: Arc<Tokenizer>,
    /// Streaming with `stream_options.include_usage`: chunks carry `"usage": null`.
    pub(crate) include_usage: bool,
}

impl Meta {
    /// The text and bytes of token `id` (bytes of a partial UTF-8 character show as U+FFFD
    /// in the text).
    pub(crate) fn token_text(&self, id: TokenId) -> (String, Vec<u8>) {
        let bytes = self.tokenizer.token_bytes(id).unwrap_or_default().to_vec();
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    }

    /// `usage` of a chunk: absent, or `null` when a usage chunk will follow.
    pub(crate) fn chunk_usage(&self) -> Option<Option<UsageBody>> {
        self.include_usage.then_some(None)
    }
}

/// One finished choice of a non-streaming response.
#[derive(Debug, Default)]
pub(crate) struct ChoiceOutput {
    pub(crate) text: String,
    /// The generated tokens, kept only when logprobs were asked for.
    pub(crate) tokens: Vec<TokenEvent>,
    pub(crate) finish: Option<FinishReason>,
}

/// Serializes a response value; these types always serialize.
pub(crate) fn to_json<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_else(|e| {
        tracing::error!(error = %e, "serializing a response");
        String::from("{}")
    })
}
