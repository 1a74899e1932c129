//! `POST /v1/chat/completions`.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::Response;
use axum::Extension;
use kvmesh_common::{FinishReason, TokenEvent, Usage};
use kvmesh_prompt::chat_template::ChatMessage;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::params::{self, PromptInfo, SamplingFields};
use super::types::{
    finish_reason, to_json, ChoiceOutput, Meta, StopParam, StreamOptions, UsageBody,
};
use super::{check_model, content, name_ignored, respond, structured, unix_now, Format, Prepared};
use crate::error::ApiError;
use crate::generation::Job;
use crate::json::{parse_body, FieldPolicy, Parsed};
use crate::metrics::Outcome;
use crate::request_id::RequestContext;
use crate::server::AppState;
use crate::sse::Chunk;

/// What happens to the OpenAI fields `ChatRequest` does not read (docs/api.md).
const POLICY: FieldPolicy = FieldPolicy {
    ignored: &[
        ("store", "responses are not stored"),
        ("metadata", "responses are not stored"),
        ("service_tier", "there is one service tier"),
        (
            "reasoning_effort",
            "the model does not reason before answering",
        ),
        ("verbosity", "the model has no verbosity setting"),
        ("user", "end users are not tracked"),
        ("safety_identifier", "end users are not tracked"),
        ("prompt_cache_key", "prefix caching is automatic"),
        ("parallel_tool_calls", "there are no tool calls"),
    ],
    unsupported: &[
        ("tools", "this server has no tool calling"),
        ("tool_choice", "this server has no tool calling"),
        ("functions", "this server has no function calling"),
        ("function_call", "this server has no function calling"),
        ("audio", "this server generates text only"),
        ("prediction", "predicted outputs are not implemented"),
        ("web_search_options", "this server does not search the web"),
    ],
};

/// The request body (fields it does not read: [`POLICY`]).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatRequest {
    model: Option<String>,
    messages: Vec<MessageIn>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<i64>,
    /// Wins over `max_tokens` when both are given.
    max_completion_tokens: Option<i64>,
    n: Option<i64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    seed: Option<i64>,
    stop: Option<StopParam>,
    stop_token_ids: Option<Vec<i64>>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
    logit_bias: Option<BTreeMap<String, f32>>,
    ignore_eos: Option<bool>,
    min_tokens: Option<i64>,
    logprobs: Option<bool>,
    top_logprobs: Option<i64>,
    response_format: Option<Value>,
    /// Only `["text"]`.
    modalities: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct MessageIn {
    role: String,
    content: Option<Value>,
    /// Accepted and ignored (templates get role and content).
    #[allow(dead_code)]
    name: Option<String>,
}

/// Messages as the chat template takes them: roles checked, content parts joined.
pub(crate) fn messages(messages: Vec<MessageIn>) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must contain at least one message",
        ));
    }
    messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            let role = match m.role.as_str() {
                "system" | "user" | "assistant" => m.role,
                // OpenAI's newer name for system instructions.
                "developer" => "system".to_string(),
                "tool" | "function" => {
                    return Err(ApiError::unsupported(
                        format!("messages[{i}].role"),
                        format!("`{}` messages are not supported (no tool calling)", m.role),
                    ))
                }
                other => {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].role"),
                        format!(
                            "unknown role {other:?}: expected system, developer, user or assistant"
                        ),
                    ))
                }
            };
            let content = content_text(i, &role, m.content)?;
            Ok(ChatMessage::new(role, content))
        })
        .collect()
}

/// `content`: a string, or an array of `{"type": "text", "text": ...}` parts (joined with
/// newlines); `null` only for assistant messages.
fn content_text(i: usize, role: &str, content: Option<Value>) -> Result<String, ApiError> {
    let param = format!("messages[{i}].content");
    match content::text(&param, content, &["text"])? {
        Some(text) => Ok(text),
        None if role == "assistant" => Ok(String::new()),
        None => Err(ApiError::invalid(param, "`content` is required")),
    }
}

/// The handler.
pub(crate) async fn handle(
    State(state): State<Arc<AppState>>,
    Extension(ctx): Extension<RequestContext>,
    Extension(outcome): Extension<Outcome>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let Parsed {
        request: req,
        ignored,
    } = parse_body::<ChatRequest>(
        body,
        state.config.max_body_bytes,
        &POLICY,
        state.config.strict_params,
    )?;
    check_model(&state, req.model.as_deref())?;
    let constraint = structured::constraint(req.response_format, &state.prompts)?;
    if req.modalities.iter().flatten().any(|m| m != "text") {
        return Err(ApiError::unsupported(
            "modalities",
            "this server generates text only: `modalities` may only be [\"text\"]",
        ));
    }
    let logprobs = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (false, None) => None,
        (false, Some(_)) => {
            return Err(ApiError::invalid(
                "top_logprobs",
                "`top_logprobs` needs `logprobs: true`",
            ))
        }
        (true, k) => Some(
            u32::try_from(k.unwrap_or(0))
                .map_err(|_| ApiError::invalid("top_logprobs", "must be in [0, 20]"))?,
        ),
    };
    let messages = messages(req.messages)?;
    let prompt = state.prompts.chat(&messages)?;
    let fields = SamplingFields {
        n: req.n,
        max_tokens: req
            .max_completion_tokens
            .map(|m| (m, "max_completion_tokens"))
            .or(req.max_tokens.map(|m| (m, "max_tokens"))),
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        min_p: req.min_p,
        seed: req.seed,
        stop: req.stop,
        stop_token_ids: req.stop_token_ids,
        presence_penalty: req.presence_penalty,
        frequency_penalty: req.frequency_penalty,
        repetition_penalty: req.repetition_penalty,
        logit_bias: req.logit_bias,
        ignore_eos: req.ignore_eos,
        min_tokens: req.min_tokens,
        logprobs,
        constraint,
    };
    let info = PromptInfo {
        tokens: prompt.len(),
        param: "messages",
    };
    let tokenizer = state.prompts.tokenizer();
    let (params, n) = params::build(fields, &info, &state.config, tokenizer.vocab_size())?;
    let stream = req.stream.unwrap_or(false);
    let include_usage = stream
        && req
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
    let format = ChatFormat {
        meta: Meta {
            id: format!("chatcmpl-{:016x}", ctx.id.0),
            created: unix_now(),
            model: state.config.model_name.clone(),
            tokenizer: state.prompts.tokenizer_arc(),
            include_usage,
        },
        logprobs: logprobs.is_some(),
    };
    let job = Job {
        id: ctx.id,
        prompt,
        params,
        n,
    };
    let prepared = Prepared {
        job,
        format,
        stream,
    };
    let response = respond(&state, &ctx, outcome, prepared).await?;
    Ok(name_ignored(response, &ignored))
}

#[derive(Serialize)]
struct ChatCompletion<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<Choice>,
    usage: UsageBody,
}

#[derive(Serialize)]
struct Choice {
    index: usize,
    message: MessageOut,
    logprobs: Option<Logprobs>,
    finish_reason: Option<&'static str>,
}

#[derive(Serialize)]
struct MessageOut {
    role: &'static str,
    content: String,
}

#[derive(Serialize)]
struct ChatChunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<ChunkChoice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Option<UsageBody>>,
}

#[derive(Serialize)]
struct ChunkChoice<'a> {
    index: usize,
    delta: Delta<'a>,
    logprobs: Option<Logprobs>,
    finish_reason: Option<&'static str>,
}

#[derive(Serialize)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
}

/// `logprobs` of a chat choice.
#[derive(Serialize)]
struct Logprobs {
    content: Vec<TokenLogprob>,
}

#[derive(Serialize)]
struct TokenLogprob {
    token: String,
    logprob: f32,
    bytes: Vec<u8>,
    top_logprobs: Vec<TopLogprob>,
}

#[derive(Serialize)]
struct TopLogprob {
    token: String,
    logprob: f32,
    bytes: Vec<u8>,
}

pub(crate) struct ChatFormat {
    meta: Meta,
    logprobs: bool,
}

impl ChatFormat {
    fn token_logprob(&self, t: &TokenEvent) -> TokenLogprob {
        let (token, bytes) = self.meta.token_text(t.token);
        TokenLogprob {
            token,
            logprob: t.logprob.unwrap_or(f32::NAN),
            bytes,
            top_logprobs: t
                .top_logprobs
                .iter()
                .map(|&(id, logprob)| {
                    let (token, bytes) = self.meta.token_text(id);
                    TopLogprob {
                        token,
                        logprob,
                        bytes,
                    }
                })
                .collect(),
        }
    }

    fn chunk_json(
        &self,
        choices: Vec<ChunkChoice<'_>>,
        usage: Option<Option<UsageBody>>,
    ) -> String {
        to_json(&ChatChunk {
            id: &self.meta.id,
            object: "chat.completion.chunk",
            created: self.meta.created,
            model: &self.meta.model,
            choices,
            usage,
        })
    }
}

impl Format for ChatFormat {
    fn opening_chunks(&mut self, choices: usize) -> Vec<Chunk> {
        (0..choices)
            .map(|index| {
                let choice = ChunkChoice {
                    index,
                    delta: Delta {
                        role: Some("assistant"),
                        content: Some(""),
                    },
                    logprobs: None,
                    finish_reason: None,
                };
                Chunk::from(self.chunk_json(vec![choice], self.meta.chunk_usage()))
            })
            .collect()
    }

    fn chunk(
        &mut self,
        index: usize,
        text: &str,
        token: Option<&TokenEvent>,
        finish: Option<FinishReason>,
    ) -> Vec<Chunk> {
        let logprobs = token.filter(|_| self.logprobs).map(|t| Logprobs {
            content: vec![self.token_logprob(t)],
        });
        let choice = ChunkChoice {
            index,
            delta: Delta {
                role: None,
                content: (!text.is_empty() || finish.is_none()).then_some(text),
            },
            logprobs,
            finish_reason: finish.map(finish_reason),
        };
        let json = self.chunk_json(vec![choice], self.meta.chunk_usage());
        vec![json.into()]
    }

    fn closing_chunks(&mut self, usage: &Usage) -> Vec<Chunk> {
        if !self.meta.include_usage {
            return Vec::new();
        }
        let json = self.chunk_json(Vec::new(), Some(Some(usage.into())));
        vec![json.into()]
    }

    fn complete(&mut self, choices: Vec<ChoiceOutput>, usage: &Usage) -> String {
        let choices = choices
            .into_iter()
            .enumerate()
            .map(|(index, c)| Choice {
                index,
                logprobs: self.logprobs.then(|| Logprobs {
                    content: c.tokens.iter().map(|t| self.token_logprob(t)).collect(),
                }),
                message: MessageOut {
                    role: "assistant",
                    content: c.text,
                },
                finish_reason: c.finish.map(finish_reason),
            })
            .collect();
        to_json(&ChatCompletion {
            id: &self.meta.id,
            object: "chat.completion",
            created: self.meta.created,
            model: &self.meta.model,
            choices,
            usage: usage.into(),
        })
    }

    fn logprobs(&self) -> bool {
        self.logprobs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: Value) -> MessageIn {
        MessageIn {
            role: role.into(),
            content: Some(content),
            name: None,
        }
    }

    #[test]
    fn content_parts_roles_and_errors() {
        let out = messages(vec![
            msg("developer", Value::from("be brief")),
            msg(
                "user",
                serde_json::json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]),
            ),
            MessageIn {
                role: "assistant".into(),
                content: None,
                name: None,
            },
        ])
        .unwrap();
        assert_eq!(out[0], ChatMessage::new("system", "be brief"));
        assert_eq!(out[1], ChatMessage::new("user", "a\nb"));
        assert_eq!(out[2], ChatMessage::new("assistant", ""));

        let err = |m: MessageIn| messages(vec![m]).unwrap_err();
        assert_eq!(messages(vec![]).unwrap_err().param(), Some("messages"));
        assert_eq!(
            err(msg("robot", Value::from("x"))).param(),
            Some("messages[0].role")
        );
        assert!(matches!(
            err(msg("tool", Value::from("x"))),
            ApiError::UnsupportedParameter { .. }
        ));
        assert_eq!(
            err(msg(
                "user",
                serde_json::json!([{"type": "image_url", "image_url": {}}])
            ))
            .param(),
            Some("messages[0].content[0].type")
        );
        assert_eq!(
            err(msg("user", Value::from(3))).param(),
            Some("messages[0].content")
        );
        assert_eq!(
            err(MessageIn {
                role: "user".into(),
                content: None,
                name: None
            })
            .param(),
            Some("messages[0].content")
        );
    }
}
