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
use super::tools::{self, CallParser, Found, PastCall, Tools};
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
    ],
    unsupported: &[
        (
            "functions",
            "the deprecated `functions` are not supported: use `tools`",
        ),
        (
            "function_call",
            "the deprecated `function_call` is not supported: use `tool_choice`",
        ),
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
    tools: Option<Value>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct MessageIn {
    role: String,
    content: Option<Value>,
    /// Accepted and ignored (templates get role and content).
    #[allow(dead_code)]
    name: Option<String>,
    /// An assistant turn's calls.
    tool_calls: Option<Vec<ToolCallIn>>,
    /// A tool result's call (results are given back in the order of the calls).
    #[allow(dead_code)]
    tool_call_id: Option<String>,
}

/// A call in an assistant message the client sends back.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ToolCallIn {
    #[allow(dead_code)]
    id: Option<String>,
    #[allow(dead_code)]
    r#type: Option<String>,
    function: FunctionCallIn,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FunctionCallIn {
    name: String,
    arguments: String,
}

/// Messages as the chat template takes them: roles checked, content parts joined, tool
/// calls and results written in the format the model calls tools in ([`tools`]).
pub(crate) fn messages(messages: Vec<MessageIn>) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must contain at least one message",
        ));
    }
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len());
    let mut after_result = false;
    for (i, m) in messages.into_iter().enumerate() {
        let role = match m.role.as_str() {
            "system" | "user" | "assistant" | "tool" => m.role,
            // OpenAI's newer name for system instructions.
            "developer" => "system".to_string(),
            "function" => {
                return Err(ApiError::unsupported(
                    format!("messages[{i}].role"),
                    "the deprecated `function` messages are not supported: use `tool`",
                ))
            }
            other => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].role"),
                    format!(
                    "unknown role {other:?}: expected system, developer, user, assistant or tool"
                ),
                ))
            }
        };
        if m.tool_calls.is_some() && role != "assistant" {
            return Err(ApiError::invalid(
                format!("messages[{i}].tool_calls"),
                "only assistant messages carry `tool_calls`",
            ));
        }
        let content = content_text(i, &role, m.content, m.tool_calls.is_some())?;
        if role == "tool" {
            tools::push_result(&mut out, &content, after_result);
            after_result = true;
            continue;
        }
        after_result = false;
        let content = match m.tool_calls {
            Some(calls) => {
                let calls: Vec<PastCall> = calls
                    .into_iter()
                    .map(|c| PastCall {
                        name: c.function.name,
                        arguments: c.function.arguments,
                    })
                    .collect();
                tools::assistant_text(&content, &calls)
            }
            None => content,
        };
        out.push(ChatMessage::new(role, content));
    }
    Ok(out)
}

/// `content`: a string, or an array of `{"type": "text", "text": ...}` parts (joined with
/// newlines); `null` only for assistant messages.
fn content_text(
    i: usize,
    role: &str,
    content: Option<Value>,
    has_calls: bool,
) -> Result<String, ApiError> {
    let param = format!("messages[{i}].content");
    match content::text(&param, content, &["text"])? {
        Some(text) => Ok(text),
        None if role == "assistant" || has_calls => Ok(String::new()),
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
    let tools = Tools::parse(
        tools::Api::Chat,
        req.tools,
        req.tool_choice,
        req.parallel_tool_calls,
        &state.prompts,
    )?;
    let constraint = tools::constraint(constraint, tools.as_ref(), "response_format")?;
    let mut messages = messages(req.messages)?;
    if let Some(tools) = &tools {
        messages = tools.show(messages);
    }
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
        calls: tools.map(|_| Vec::new()),
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
    content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<ToolCallOut>,
}

/// A call in a response: whole, or in a stream the pieces that add up to it.
#[derive(Debug, Default, Serialize)]
struct ToolCallOut {
    /// Streamed pieces say which call they belong to.
    #[serde(skip_serializing_if = "Option::is_none")]
    index: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    r#type: Option<&'static str>,
    function: FunctionOut,
}

#[derive(Debug, Default, Serialize)]
struct FunctionOut {
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    arguments: String,
}

#[derive(Serialize)]
struct ChatChunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<ChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Option<UsageBody>>,
}

#[derive(Serialize)]
struct ChunkChoice {
    index: usize,
    delta: Delta,
    logprobs: Option<Logprobs>,
    finish_reason: Option<&'static str>,
}

#[derive(Default, Serialize)]
struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<ToolCallOut>,
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
    /// With tools: each choice's parser of the model's calls.
    calls: Option<Vec<CallParser>>,
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

    fn chunk_json(&self, choices: Vec<ChunkChoice>, usage: Option<Option<UsageBody>>) -> String {
        to_json(&ChatChunk {
            id: &self.meta.id,
            object: "chat.completion.chunk",
            created: self.meta.created,
            model: &self.meta.model,
            choices,
            usage,
        })
    }

    /// Call `index` of choice `choice`'s id.
    fn call_id(&self, choice: usize, index: usize) -> String {
        let request = self.meta.id.trim_start_matches("chatcmpl-");
        format!("call_{request}_{choice}_{index}")
    }

    /// What choice `choice`'s next text adds to a delta: content, and calls begun or
    /// continued. Without tools, the text as it is.
    fn delta(&mut self, choice: usize, text: &str, end: bool) -> (Delta, bool) {
        let Some(parsers) = &mut self.calls else {
            let content = (!text.is_empty() || !end).then(|| text.to_string());
            return (
                Delta {
                    content,
                    ..Delta::default()
                },
                false,
            );
        };
        if parsers.len() <= choice {
            parsers.resize_with(choice + 1, CallParser::default);
        }
        let parser = &mut parsers[choice];
        let mut found = parser.push(text);
        if end {
            found.extend(parser.finish());
        }
        let called = parser.found_calls();
        let mut delta = Delta::default();
        for f in found {
            match f {
                Found::Text(t) => delta.content.get_or_insert_with(String::new).push_str(&t),
                Found::CallStart { index, name } => delta.tool_calls.push(ToolCallOut {
                    index: Some(index),
                    id: Some(self.call_id(choice, index)),
                    r#type: Some("function"),
                    function: FunctionOut {
                        name: Some(name),
                        arguments: String::new(),
                    },
                }),
                Found::Arguments { index, piece } => match delta.tool_calls.last_mut() {
                    Some(call) if call.index == Some(index) => {
                        call.function.arguments.push_str(&piece)
                    }
                    _ => delta.tool_calls.push(ToolCallOut {
                        index: Some(index),
                        function: FunctionOut {
                            name: None,
                            arguments: piece,
                        },
                        ..ToolCallOut::default()
                    }),
                },
            }
        }
        (delta, called)
    }
}

/// OpenAI's `finish_reason` of a choice that may have called tools.
fn finish_with_calls(reason: FinishReason, called: bool) -> &'static str {
    match reason {
        FinishReason::Stop if called => "tool_calls",
        reason => finish_reason(reason),
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
                        content: Some(String::new()),
                        ..Delta::default()
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
        let (delta, called) = self.delta(index, text, finish.is_some());
        let empty = delta.content.is_none() && delta.tool_calls.is_empty();
        if empty && logprobs.is_none() && finish.is_none() {
            return Vec::new();
        }
        let choice = ChunkChoice {
            index,
            delta,
            logprobs,
            finish_reason: finish.map(|f| finish_with_calls(f, called)),
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
            .map(|(index, c)| {
                let logprobs = self.logprobs.then(|| Logprobs {
                    content: c.tokens.iter().map(|t| self.token_logprob(t)).collect(),
                });
                let (message, called) = self.message(index, c.text);
                Choice {
                    index,
                    logprobs,
                    message,
                    finish_reason: c.finish.map(|f| finish_with_calls(f, called)),
                }
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

impl ChatFormat {
    /// A whole choice's message: with tools, its calls apart from its content.
    fn message(&mut self, choice: usize, text: String) -> (MessageOut, bool) {
        if self.calls.is_none() {
            let message = MessageOut {
                role: "assistant",
                content: Some(text),
                tool_calls: Vec::new(),
            };
            return (message, false);
        }
        let (delta, called) = self.delta(choice, &text, true);
        let tool_calls: Vec<ToolCallOut> = delta
            .tool_calls
            .into_iter()
            .map(|c| ToolCallOut { index: None, ..c })
            .collect();
        let content = delta.content.unwrap_or_default();
        let content = match (called, content.trim()) {
            (true, "") => None,
            (true, trimmed) => Some(trimmed.to_string()),
            (false, _) => Some(content),
        };
        let message = MessageOut {
            role: "assistant",
            content,
            tool_calls,
        };
        (message, called)
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
            tool_calls: None,
            tool_call_id: None,
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
                tool_calls: None,
                tool_call_id: None,
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
            err(msg("function", Value::from("x"))),
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
                name: None,
                tool_calls: None,
                tool_call_id: None,
            })
            .param(),
            Some("messages[0].content")
        );
    }
}
