//! `POST /v1/responses`: OpenAI's Responses API, stateless.
//!
//! `input` (a string, or items: messages, function calls and their outputs) and
//! `instructions` become a chat prompt; the answer is a response object whose `output` holds
//! an assistant message and, with function `tools`, the calls the model made ([`tools`] shows
//! the tools to the model and parses its calls, as for chat). Nothing is stored, so the
//! fields that refer to stored state (`previous_response_id`, `conversation`, `background`,
//! stored prompts) are refused; `store` and the other fields that do not apply are ignored
//! and named in the `x-kvmesh-ignored-params` header, as for chat.
//!
//! Streaming sends OpenAI's named, numbered events: `response.created`,
//! `response.in_progress`, then per output item `response.output_item.added`, its content
//! (a message: `response.content_part.added`, `response.output_text.delta`...,
//! `response.output_text.done`, `response.content_part.done`; a call:
//! `response.function_call_arguments.delta`..., `response.function_call_arguments.done`) and
//! `response.output_item.done`, and last `response.completed` (`response.incomplete` when
//! `max_output_tokens` cut the answer). The non-streaming body is the object
//! `response.completed` carries.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::Response;
use axum::Extension;
use kvmesh_common::{FinishReason, RequestId, TokenEvent, Usage};
use kvmesh_prompt::chat_template::ChatMessage;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::params::{self, PromptInfo, SamplingFields};
use super::tools::{self, CallParser, Found, PastCall, Tools};
use super::types::{to_json, ChoiceOutput, StopParam};
use super::{check_model, content, name_ignored, respond, structured, unix_now, Format, Prepared};
use crate::error::ApiError;
use crate::generation::Job;
use crate::json::{parse_body, parse_value, FieldPolicy, Parsed};
use crate::metrics::Outcome;
use crate::request_id::RequestContext;
use crate::server::AppState;
use crate::sse::{Chunk, Framing};

/// What happens to the OpenAI fields `ResponsesRequest` does not read (docs/api.md).
const POLICY: FieldPolicy = FieldPolicy {
    ignored: &[
        ("store", "responses are not stored"),
        ("metadata", "responses are not stored"),
        ("service_tier", "there is one service tier"),
        ("reasoning", "the model does not reason before answering"),
        ("user", "end users are not tracked"),
        ("safety_identifier", "end users are not tracked"),
        ("prompt_cache_key", "prefix caching is automatic"),
        ("prompt_cache_retention", "prefix caching is automatic"),
        ("stream_options", "stream events are not obfuscated"),
    ],
    unsupported: &[
        (
            "previous_response_id",
            "responses are not stored: send the whole conversation in `input`",
        ),
        (
            "conversation",
            "conversations are not stored: send the whole conversation in `input`",
        ),
        ("prompt", "stored prompt templates are not supported"),
        (
            "top_logprobs",
            "this endpoint returns no logprobs (chat completions do)",
        ),
        (
            "max_tool_calls",
            "calls are not counted across a response (`parallel_tool_calls: false` allows one)",
        ),
        (
            "context_management",
            "context compaction is not supported: send the conversation as it should be read",
        ),
    ],
};

/// The request body (fields it does not read: [`POLICY`]).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResponsesRequest {
    model: Option<String>,
    /// A string (one user message) or an array of input items.
    input: Value,
    /// A system message before `input`.
    instructions: Option<String>,
    stream: Option<bool>,
    max_output_tokens: Option<i64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    seed: Option<i64>,
    stop: Option<StopParam>,
    text: Option<TextConfig>,
    /// Only `"disabled"` (a prompt too long is a 400).
    truncation: Option<String>,
    /// Only `false`.
    background: Option<bool>,
    /// Only empty: every includable is something this server does not produce.
    include: Option<Vec<String>>,
    /// Function tools (`{"type": "function", "name", "description", "parameters"}`).
    tools: Option<Value>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
}

/// `text`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct TextConfig {
    /// `{"type": "text" | "json_object" | "json_schema", ...}`, and kvmesh's formats.
    format: Option<Value>,
    /// Ignored (named in the header): the model has no verbosity setting.
    verbosity: Option<String>,
}

/// A message input item (`type` is `"message"` or left out).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MessageItem {
    #[allow(dead_code)]
    r#type: Option<String>,
    role: String,
    content: Option<Value>,
    /// An earlier response's output item given back as input carries these; not read.
    #[allow(dead_code)]
    id: Option<String>,
    #[allow(dead_code)]
    status: Option<String>,
    #[allow(dead_code)]
    phase: Option<String>,
}

/// A `function_call` input item: a call an earlier answer made.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FunctionCallItem {
    #[allow(dead_code)]
    r#type: String,
    name: String,
    arguments: String,
    /// Results are given back in the order of the calls; ids are not read.
    #[allow(dead_code)]
    call_id: String,
    #[allow(dead_code)]
    id: Option<String>,
    #[allow(dead_code)]
    status: Option<String>,
    /// What the SDK's `responses.parse` adds to the calls it returns, sent back with them.
    #[allow(dead_code)]
    parsed_arguments: Option<Value>,
}

/// A `function_call_output` input item: a call's result.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FunctionCallOutputItem {
    #[allow(dead_code)]
    r#type: String,
    #[allow(dead_code)]
    call_id: String,
    /// A string, or text parts.
    output: Value,
    #[allow(dead_code)]
    id: Option<String>,
    #[allow(dead_code)]
    status: Option<String>,
}

/// The part types whose `text` a message's content (or a call's output) contributes.
const TEXT_PARTS: &[&str] = &["input_text", "output_text"];

/// `instructions` and `input` as the chat template takes them. Calls join the assistant
/// turn they follow (an answer's message and calls come back as a message item and call
/// items) and results go into user turns, in the format the model calls tools in
/// ([`tools`]).
fn conversation(instructions: Option<String>, input: Value) -> Result<Vec<ChatMessage>, ApiError> {
    let mut conversation = Conversation::default();
    if let Some(text) = instructions {
        conversation.push(ChatMessage::new("system", text));
    }
    match input {
        Value::String(text) => conversation.push(ChatMessage::new("user", text)),
        Value::Array(items) if items.is_empty() => {
            return Err(ApiError::invalid("input", "`input` must not be empty"))
        }
        Value::Array(items) => {
            for (i, item) in items.into_iter().enumerate() {
                conversation.item(i, item)?;
            }
        }
        _ => {
            return Err(ApiError::invalid(
                "input",
                "`input` must be a string or an array of input items",
            ))
        }
    }
    Ok(conversation.messages)
}

/// The messages so far, and what the last item was.
#[derive(Default)]
struct Conversation {
    messages: Vec<ChatMessage>,
    /// The last item was an assistant message or a call: a call joins that turn.
    after_assistant: bool,
    /// The last item was a result: a result joins that turn.
    after_result: bool,
}

impl Conversation {
    fn push(&mut self, message: ChatMessage) {
        self.after_assistant = message.role == "assistant";
        self.after_result = false;
        self.messages.push(message);
    }

    /// Input item `i`.
    fn item(&mut self, i: usize, item: Value) -> Result<(), ApiError> {
        let at = format!("input[{i}]");
        match item.get("type").and_then(Value::as_str) {
            None | Some("message") => self.push(message(&at, parse_value(item, &at)?)?),
            Some("function_call") => {
                let call: FunctionCallItem = parse_value(item, &at)?;
                let call = PastCall {
                    name: call.name,
                    arguments: call.arguments,
                };
                match self.messages.last_mut() {
                    Some(turn) if self.after_assistant => {
                        turn.content = tools::assistant_text(&turn.content, &[call]);
                    }
                    _ => self.push(ChatMessage::new(
                        "assistant",
                        tools::assistant_text("", &[call]),
                    )),
                }
            }
            Some("function_call_output") => {
                let result: FunctionCallOutputItem = parse_value(item, &at)?;
                let param = format!("{at}.output");
                let output = content::text(&param, Some(result.output), TEXT_PARTS)?
                    .ok_or_else(|| ApiError::invalid(param, "`output` is required"))?;
                tools::push_result(&mut self.messages, &output, self.after_result);
                self.after_assistant = false;
                self.after_result = true;
            }
            Some(other) => {
                return Err(ApiError::unsupported(
                    format!("{at}.type"),
                    format!(
                        "input items of type {other:?} are not supported (only messages, \
                         function calls and function call outputs)"
                    ),
                ))
            }
        }
        Ok(())
    }
}

/// A message item at `at`.
fn message(at: &str, m: MessageItem) -> Result<ChatMessage, ApiError> {
    let role = match m.role.as_str() {
        "system" | "user" | "assistant" => m.role,
        // OpenAI's newer name for system instructions.
        "developer" => "system".to_string(),
        other => {
            return Err(ApiError::invalid(
                format!("{at}.role"),
                format!("unknown role {other:?}: expected system, developer, user or assistant"),
            ))
        }
    };
    let param = format!("{at}.content");
    let text = content::text(&param, m.content, TEXT_PARTS)?
        .ok_or_else(|| ApiError::invalid(param, "`content` is required"))?;
    Ok(ChatMessage::new(role, text))
}

/// The fields that only some values of are supported.
fn refuse_unsupported_values(req: &ResponsesRequest) -> Result<(), ApiError> {
    if req.background == Some(true) {
        return Err(ApiError::unsupported(
            "background",
            "background responses are not supported: responses are not stored",
        ));
    }
    if let Some(first) = req.include.iter().flatten().next() {
        return Err(ApiError::unsupported(
            "include",
            format!("`include` is not supported: this server does not produce {first:?}"),
        ));
    }
    match req.truncation.as_deref() {
        None | Some("disabled") => Ok(()),
        Some("auto") => Err(ApiError::unsupported(
            "truncation",
            "`truncation: \"auto\"` is not supported: a prompt longer than the context is \
             refused, never cut",
        )),
        Some(other) => Err(ApiError::invalid(
            "truncation",
            format!("unknown truncation {other:?}: expected \"disabled\" or \"auto\""),
        )),
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
        mut ignored,
    } = parse_body::<ResponsesRequest>(
        body,
        state.config.max_body_bytes,
        &POLICY,
        state.config.strict_params,
    )?;
    check_model(&state, req.model.as_deref())?;
    refuse_unsupported_values(&req)?;
    let text = req.text.unwrap_or_default();
    if text.verbosity.is_some() {
        ignored.push("text.verbosity".to_string());
    }
    let text_format = text.format.unwrap_or_else(|| json!({"type": "text"}));
    let constraint = structured::text_format_constraint(Some(text_format.clone()), &state.prompts)?;
    // Echoed as sent, as OpenAI does.
    let tools_sent = req.tools.clone().unwrap_or_else(|| json!([]));
    let tool_choice_sent = req.tool_choice.clone().unwrap_or_else(|| json!("auto"));
    let tools = Tools::parse(
        tools::Api::Responses,
        req.tools,
        req.tool_choice,
        req.parallel_tool_calls,
        &state.prompts,
    )?;
    let constraint = tools::constraint(constraint, tools.as_ref(), "text.format")?;
    let mut messages = conversation(req.instructions.clone(), req.input)?;
    if let Some(tools) = &tools {
        messages = tools.show(messages);
    }
    let prompt = state.prompts.chat(&messages).map_err(|e| match e {
        // The prompt is `input` here.
        ApiError::InvalidParameter { param, message } if param.as_deref() == Some("messages") => {
            ApiError::InvalidParameter {
                param: Some("input".into()),
                message,
            }
        }
        e => e,
    })?;
    let fields = SamplingFields {
        max_tokens: req.max_output_tokens.map(|m| (m, "max_output_tokens")),
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        min_p: req.min_p,
        seed: req.seed,
        stop: req.stop,
        constraint,
        ..SamplingFields::default()
    };
    let info = PromptInfo {
        tokens: prompt.len(),
        param: "input",
    };
    let vocab_size = state.prompts.tokenizer().vocab_size();
    let (params, n) = params::build(fields, &info, &state.config, vocab_size)?;
    let head = Head {
        id: format!("resp_{:016x}", ctx.id.0),
        request: ctx.id,
        created_at: unix_now(),
        model: state.config.model_name.clone(),
        instructions: req.instructions,
        max_output_tokens: req.max_output_tokens,
        temperature: params.temperature,
        top_p: params.top_p,
        text: json!({ "format": text_format }),
        tools: tools_sent,
        tool_choice: tool_choice_sent,
        parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
    };
    let job = Job {
        id: ctx.id,
        prompt,
        params,
        n,
    };
    let prepared = Prepared {
        job,
        format: ResponsesFormat::new(head, tools.is_some()),
        stream: req.stream.unwrap_or(false),
    };
    let response = respond(&state, &ctx, outcome, prepared).await?;
    Ok(name_ignored(response, &ignored))
}

/// What every response object of one request repeats.
struct Head {
    /// `resp_…`.
    id: String,
    /// Output item ids derive from it.
    request: RequestId,
    /// Unix seconds.
    created_at: u64,
    model: String,
    /// Echoed as the client sent them.
    instructions: Option<String>,
    max_output_tokens: Option<i64>,
    /// Echoed as used.
    temperature: f32,
    top_p: f32,
    /// `{"format": ...}`.
    text: Value,
    tools: Value,
    tool_choice: Value,
    parallel_tool_calls: bool,
}

/// One item of a response's `output`.
#[derive(Debug)]
enum Item {
    Message {
        id: String,
        text: String,
    },
    Call {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
    },
}

/// The response object, in every event that carries it and as the non-streaming body.
#[derive(Serialize)]
struct ResponseObject<'a> {
    id: &'a str,
    object: &'static str,
    created_at: u64,
    status: &'static str,
    completed_at: Option<u64>,
    error: Option<Value>,
    incomplete_details: Option<IncompleteDetails>,
    instructions: Option<&'a str>,
    max_output_tokens: Option<i64>,
    model: &'a str,
    output: Vec<ItemOut<'a>>,
    parallel_tool_calls: bool,
    previous_response_id: Option<&'a str>,
    reasoning: Value,
    store: bool,
    temperature: f32,
    text: &'a Value,
    tool_choice: &'a Value,
    tools: &'a Value,
    top_p: f32,
    truncation: &'static str,
    usage: Option<UsageOut>,
    metadata: Value,
}

#[derive(Serialize)]
struct IncompleteDetails {
    reason: &'static str,
}

/// An output item as the client sees it.
#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ItemOut<'a> {
    Message {
        id: &'a str,
        status: &'static str,
        role: &'static str,
        content: Vec<TextPart<'a>>,
    },
    FunctionCall {
        id: &'a str,
        call_id: &'a str,
        name: &'a str,
        arguments: &'a str,
        status: &'static str,
    },
}

/// An `output_text` content part.
#[derive(Serialize)]
struct TextPart<'a> {
    r#type: &'static str,
    text: &'a str,
    annotations: [Value; 0],
    logprobs: [Value; 0],
}

impl<'a> TextPart<'a> {
    fn new(text: &'a str) -> Self {
        TextPart {
            r#type: "output_text",
            text,
            annotations: [],
            logprobs: [],
        }
    }
}

/// `usage` of a response.
#[derive(Serialize)]
struct UsageOut {
    input_tokens: u32,
    input_tokens_details: InputTokensDetails,
    output_tokens: u32,
    output_tokens_details: OutputTokensDetails,
    total_tokens: u32,
}

#[derive(Serialize)]
struct InputTokensDetails {
    cached_tokens: u32,
    cache_write_tokens: u32,
}

#[derive(Serialize)]
struct OutputTokensDetails {
    reasoning_tokens: u32,
}

impl From<&Usage> for UsageOut {
    fn from(u: &Usage) -> Self {
        UsageOut {
            input_tokens: u.prompt_tokens,
            input_tokens_details: InputTokensDetails {
                cached_tokens: u.cached_tokens,
                cache_write_tokens: 0,
            },
            output_tokens: u.completion_tokens,
            output_tokens_details: OutputTokensDetails {
                reasoning_tokens: 0,
            },
            total_tokens: u.prompt_tokens + u.completion_tokens,
        }
    }
}

/// A streamed event: its type and number, then its own fields.
#[derive(Serialize)]
struct Event<T> {
    r#type: &'static str,
    sequence_number: u64,
    #[serde(flatten)]
    body: T,
}

/// `response.output_text.delta`'s fields (one event per token).
#[derive(Serialize)]
struct TextDelta<'a> {
    item_id: &'a str,
    output_index: usize,
    content_index: usize,
    delta: &'a str,
    logprobs: [Value; 0],
}

/// `response.function_call_arguments.delta`'s fields.
#[derive(Serialize)]
struct ArgumentsDelta<'a> {
    item_id: &'a str,
    output_index: usize,
    delta: &'a str,
}

/// Builds the response's output items from the model's text, as events while streaming.
/// The non-streaming body goes through the same steps (its events are dropped), so both
/// give the same output.
pub(crate) struct ResponsesFormat {
    head: Head,
    /// With tools: splits the text into the message and calls.
    calls: Option<CallParser>,
    /// With tools: trailing whitespace of the text so far, given to the message only if text
    /// follows (whitespace around calls lays them out).
    held: String,
    output: Vec<Item>,
    /// Whether the last item of `output` is still being written.
    open: bool,
    /// The next event's `sequence_number`.
    sequence: u64,
    finish: Option<FinishReason>,
}

impl ResponsesFormat {
    fn new(head: Head, tools: bool) -> Self {
        ResponsesFormat {
            head,
            calls: tools.then(CallParser::default),
            held: String::new(),
            output: Vec::new(),
            open: false,
            sequence: 0,
            finish: None,
        }
    }

    fn event<T: Serialize>(&mut self, out: &mut Vec<Chunk>, kind: &'static str, body: T) {
        let event = Event {
            r#type: kind,
            sequence_number: self.sequence,
            body,
        };
        out.push(Chunk::named(kind, to_json(&event)));
        self.sequence += 1;
    }

    fn item_id(&self, prefix: &str, index: usize) -> String {
        format!("{prefix}_{:016x}{index:08x}", self.head.request.0)
    }

    /// The status of items that are done: cut by the token limit, or complete.
    fn done_status(&self) -> &'static str {
        match self.finish {
            Some(FinishReason::Length) => "incomplete",
            _ => "completed",
        }
    }

    fn item_out(&self, index: usize) -> ItemOut<'_> {
        let open = self.open && index + 1 == self.output.len();
        let status = if open {
            "in_progress"
        } else {
            self.done_status()
        };
        match &self.output[index] {
            Item::Message { id, text } => ItemOut::Message {
                id,
                status,
                role: "assistant",
                // An item just added has no part yet.
                content: if open && text.is_empty() {
                    Vec::new()
                } else {
                    vec![TextPart::new(text)]
                },
            },
            Item::Call {
                id,
                call_id,
                name,
                arguments,
            } => ItemOut::FunctionCall {
                id,
                call_id,
                name,
                arguments,
                status,
            },
        }
    }

    fn has_calls(&self) -> bool {
        self.output.iter().any(|i| matches!(i, Item::Call { .. }))
    }

    /// The model's next `text` (`end`: its last), into the message, or with tools through
    /// the call parser.
    fn take(&mut self, text: &str, end: bool, out: &mut Vec<Chunk>) {
        let Some(parser) = &mut self.calls else {
            if !text.is_empty() {
                self.text(text, out);
            }
            return;
        };
        let mut found = parser.push(text);
        if end {
            found.extend(parser.finish());
        }
        for piece in found {
            match piece {
                Found::Text(text) => self.text_around_calls(&text, out),
                Found::CallStart { name, .. } => self.start_call(name, out),
                Found::Arguments { piece, .. } => self.arguments(&piece, out),
            }
        }
        if end {
            // Whitespace after the last call lays it out; an answer without calls keeps it.
            let held = std::mem::take(&mut self.held);
            if !held.is_empty() && !self.has_calls() {
                self.text(&held, out);
            }
        }
    }

    /// With tools: `text` for the message, less the whitespace that only lays out calls
    /// (before a call, after one).
    fn text_around_calls(&mut self, text: &str, out: &mut Vec<Chunk>) {
        self.held.push_str(text);
        let body = self.held.trim_end().len();
        if body == 0 {
            return;
        }
        let piece: String = self.held.drain(..body).collect();
        let message_open = self.open && matches!(self.output.last(), Some(Item::Message { .. }));
        let piece = if !message_open && self.has_calls() {
            piece.trim_start()
        } else {
            &piece
        };
        self.text(piece, out);
    }

    /// A call begins: its item, with no arguments yet.
    fn start_call(&mut self, name: String, out: &mut Vec<Chunk>) {
        self.held.clear();
        self.close(out);
        let index = self.output.len();
        self.output.push(Item::Call {
            id: self.item_id("fc", index),
            call_id: self.item_id("call", index),
            name,
            arguments: String::new(),
        });
        self.open = true;
        let item = json!({"output_index": index, "item": self.item_out(index)});
        self.event(out, "response.output_item.added", item);
    }

    /// The next piece of the open call's arguments.
    fn arguments(&mut self, piece: &str, out: &mut Vec<Chunk>) {
        let index = self.output.len() - 1;
        let Some(Item::Call { id, arguments, .. }) = self.output.last_mut() else {
            return;
        };
        arguments.push_str(piece);
        let id = id.clone();
        let delta = ArgumentsDelta {
            item_id: &id,
            output_index: index,
            delta: piece,
        };
        self.event(out, "response.function_call_arguments.delta", delta);
    }

    /// `text` for the answer's message (opened first if the last item is not it; `""` only
    /// opens it).
    fn text(&mut self, text: &str, out: &mut Vec<Chunk>) {
        if !matches!(self.output.last(), Some(Item::Message { .. }) if self.open) {
            self.close(out);
            let index = self.output.len();
            let id = self.item_id("msg", index);
            self.output.push(Item::Message {
                id: id.clone(),
                text: String::new(),
            });
            self.open = true;
            let item = json!({"output_index": index, "item": self.item_out(index)});
            self.event(out, "response.output_item.added", item);
            let part = json!({
                "item_id": id, "output_index": index, "content_index": 0,
                "part": TextPart::new(""),
            });
            self.event(out, "response.content_part.added", part);
        }
        if text.is_empty() {
            return;
        }
        let index = self.output.len() - 1;
        let Some(Item::Message { id, text: all }) = self.output.last_mut() else {
            return;
        };
        all.push_str(text);
        let id = id.clone();
        let delta = TextDelta {
            item_id: &id,
            output_index: index,
            content_index: 0,
            delta: text,
            logprobs: [],
        };
        self.event(out, "response.output_text.delta", delta);
    }

    /// Ends the item being written, if any.
    fn close(&mut self, out: &mut Vec<Chunk>) {
        if !self.open {
            return;
        }
        self.open = false;
        let index = self.output.len() - 1;
        match &self.output[index] {
            Item::Message { id, text } => {
                let (id, text) = (id.clone(), text.clone());
                let done = json!({
                    "item_id": id, "output_index": index, "content_index": 0,
                    "text": text, "logprobs": [],
                });
                self.event(out, "response.output_text.done", done);
                let part = json!({
                    "item_id": id, "output_index": index, "content_index": 0,
                    "part": TextPart::new(&text),
                });
                self.event(out, "response.content_part.done", part);
            }
            Item::Call { id, arguments, .. } => {
                let done = json!({"item_id": id, "output_index": index, "arguments": arguments});
                self.event(out, "response.function_call_arguments.done", done);
            }
        }
        let item = json!({"output_index": index, "item": self.item_out(index)});
        self.event(out, "response.output_item.done", item);
    }

    /// The end of the answer: the last item closed, and an empty message if there was none.
    fn end(&mut self, reason: FinishReason, out: &mut Vec<Chunk>) {
        self.finish = Some(reason);
        if self.output.is_empty() {
            self.text("", out);
        }
        self.close(out);
    }

    fn response(&self, usage: Option<&Usage>) -> ResponseObject<'_> {
        let (status, incomplete_details, completed_at) = match self.finish {
            None => ("in_progress", None, None),
            Some(FinishReason::Length) => (
                "incomplete",
                Some(IncompleteDetails {
                    reason: "max_output_tokens",
                }),
                None,
            ),
            Some(_) => ("completed", None, Some(unix_now())),
        };
        ResponseObject {
            id: &self.head.id,
            object: "response",
            created_at: self.head.created_at,
            status,
            completed_at,
            error: None,
            incomplete_details,
            instructions: self.head.instructions.as_deref(),
            max_output_tokens: self.head.max_output_tokens,
            model: &self.head.model,
            output: (0..self.output.len()).map(|i| self.item_out(i)).collect(),
            parallel_tool_calls: self.head.parallel_tool_calls,
            previous_response_id: None,
            reasoning: json!({"effort": null, "summary": null}),
            store: false,
            temperature: self.head.temperature,
            text: &self.head.text,
            tool_choice: &self.head.tool_choice,
            tools: &self.head.tools,
            top_p: self.head.top_p,
            truncation: "disabled",
            usage: usage.map(UsageOut::from),
            metadata: json!({}),
        }
    }
}

impl Format for ResponsesFormat {
    const FRAMING: Framing = Framing::Named;

    fn opening_chunks(&mut self, _choices: usize) -> Vec<Chunk> {
        let mut out = Vec::new();
        for kind in ["response.created", "response.in_progress"] {
            let body = json!({ "response": self.response(None) });
            self.event(&mut out, kind, body);
        }
        out
    }

    fn chunk(
        &mut self,
        _index: usize,
        text: &str,
        _token: Option<&TokenEvent>,
        finish: Option<FinishReason>,
    ) -> Vec<Chunk> {
        let mut out = Vec::new();
        self.take(text, finish.is_some(), &mut out);
        if let Some(reason) = finish {
            self.end(reason, &mut out);
        }
        out
    }

    fn closing_chunks(&mut self, usage: &Usage) -> Vec<Chunk> {
        let kind = match self.finish {
            Some(FinishReason::Length) => "response.incomplete",
            _ => "response.completed",
        };
        let body = json!({ "response": self.response(Some(usage)) });
        let mut out = Vec::new();
        self.event(&mut out, kind, body);
        out
    }

    fn complete(&mut self, choices: Vec<ChoiceOutput>, usage: &Usage) -> String {
        let mut events = Vec::new();
        if let Some(choice) = choices.into_iter().next() {
            self.take(&choice.text, true, &mut events);
            self.end(choice.finish.unwrap_or(FinishReason::Stop), &mut events);
        }
        to_json(&self.response(Some(usage)))
    }

    fn logprobs(&self) -> bool {
        false
    }
}
