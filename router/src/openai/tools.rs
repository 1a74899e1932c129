//! Tool (function) calling, for chat completions and the Responses API.
//!
//! The model is told about the tools in a system message and calls them in the format Hermes
//! and Qwen models are trained on: one `<tool_call>` block per call holding
//! `{"name": ..., "arguments": {...}}`. Assistant turns that called tools and the tools'
//! results go back into the conversation in the same format (results as `<tool_response>`
//! blocks in a user turn), so any chat template with system, user and assistant roles works.
//!
//! `tool_choice: "required"` or a named function is enforced with a grammar: the answer is
//! one (or, with `parallel_tool_calls`, several) calls whose arguments follow each function's
//! JSON schema. With `auto` the model decides; its output is parsed, and a block that does not
//! parse as a call stays text. [`CallParser`] does that parsing as the text streams.

use kvmesh_common::Constraint;
use kvmesh_prompt::chat_template::ChatMessage;
use kvmesh_prompt::grammar::json_layout;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::prompt::Prompts;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// A function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Tool {
    pub(crate) name: String,
    pub(crate) description: Option<String>,
    /// A JSON schema of the arguments object.
    pub(crate) parameters: Value,
}

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum ToolChoice {
    /// No call: the tools are not shown to the model.
    None,
    /// The model decides.
    Auto,
    /// At least one call, enforced.
    Required,
    /// A call of this function, enforced.
    Named(String),
}

/// The tools of one request and how they may be used.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Tools {
    pub(crate) tools: Vec<Tool>,
    pub(crate) choice: ToolChoice,
    /// Whether one answer may hold several calls.
    pub(crate) parallel: bool,
}

/// A function definition as the client sends it: chat nests it under `function`, the
/// Responses API has its fields at the top.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FunctionIn {
    name: String,
    description: Option<String>,
    parameters: Option<Value>,
    /// Always enforced when a call is required; `auto` calls are parsed as written.
    #[allow(dead_code)]
    strict: Option<bool>,
}

/// Where a request's tool fields live, for error messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Api {
    /// `tools[i].function.name`, `tool_choice.function.name`.
    Chat,
    /// `tools[i].name`, `tool_choice.name`.
    Responses,
}

impl Tools {
    /// Reads `tools`, `tool_choice` and `parallel_tool_calls` (`None`: no tools, or
    /// `tool_choice: "none"` with none given). Checks names, schemas and that a required
    /// call's grammar compiles.
    pub(crate) fn parse(
        api: Api,
        tools: Option<Value>,
        choice: Option<Value>,
        parallel: Option<bool>,
        prompts: &Prompts,
    ) -> Result<Option<Tools>, ApiError> {
        let tools = match tools {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items
                .into_iter()
                .enumerate()
                .map(|(i, item)| tool(api, i, item))
                .collect::<Result<Vec<_>, _>>()?,
            Some(_) => return Err(ApiError::invalid("tools", "`tools` must be an array")),
        };
        for (i, t) in tools.iter().enumerate() {
            if tools[..i].iter().any(|u| u.name == t.name) {
                return Err(ApiError::invalid(
                    format!("tools[{i}]"),
                    format!("two tools are named {:?}", t.name),
                ));
            }
        }
        let default = if tools.is_empty() {
            ToolChoice::None
        } else {
            ToolChoice::Auto
        };
        let choice = match choice {
            None | Some(Value::Null) => default,
            Some(v) => tool_choice(api, v)?,
        };
        match &choice {
            ToolChoice::None => return Ok(None),
            ToolChoice::Auto | ToolChoice::Required if tools.is_empty() => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "`tool_choice` needs `tools` to choose from",
                ))
            }
            ToolChoice::Named(name) if !tools.iter().any(|t| &t.name == name) => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` names {name:?}, which is not in `tools`"),
                ))
            }
            _ => {}
        }
        let tools = Tools {
            tools,
            choice,
            parallel: parallel.unwrap_or(true),
        };
        if let Some(constraint) = tools.constraint() {
            prompts.check_constraint(&constraint).map_err(|e| {
                ApiError::invalid("tools", format!("a tool's `parameters` schema: {e}"))
            })?;
        }
        Ok(Some(tools))
    }

    /// The system text that shows the model its tools and the call format.
    pub(crate) fn system_text(&self) -> String {
        let mut text = String::from(
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
             You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
        );
        for t in &self.tools {
            let mut function = json!({"name": t.name});
            if let Some(d) = &t.description {
                function["description"] = Value::from(d.as_str());
            }
            function["parameters"] = t.parameters.clone();
            text.push('\n');
            text.push_str(&json!({"type": "function", "function": function}).to_string());
        }
        text.push_str(
            "\n</tools>\n\nFor each function call, return a json object with function name and \
             arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
             {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
        );
        text
    }

    /// `messages` with the tools shown in the system message (added first if there is none).
    pub(crate) fn show(&self, mut messages: Vec<ChatMessage>) -> Vec<ChatMessage> {
        let text = self.system_text();
        match messages.first_mut() {
            Some(first) if first.role == "system" => {
                first.content = format!("{}\n\n{text}", first.content);
            }
            _ => messages.insert(0, ChatMessage::new("system", text)),
        }
        messages
    }

    /// The grammar of an answer that must call a tool (`required` or a named function).
    pub(crate) fn constraint(&self) -> Option<Constraint> {
        let callable: Vec<&Tool> = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Required => self.tools.iter().collect(),
            ToolChoice::Named(name) => self.tools.iter().filter(|t| &t.name == name).collect(),
        };
        let mut lark = if self.parallel {
            String::from("start: call (\"\\n\" call)*\n")
        } else {
            String::from("start: call\n")
        };
        let alternatives: Vec<String> = (0..callable.len()).map(|i| format!("f{i}")).collect();
        lark.push_str(&format!(
            "call: {} \"\\n\" ({}) \"\\n\" {}\n",
            lark_literal(OPEN),
            alternatives.join(" | "),
            lark_literal(CLOSE)
        ));
        for (i, t) in callable.iter().enumerate() {
            let schema = json_layout(json!({
                "type": "object",
                "properties": {
                    "name": {"const": t.name},
                    "arguments": t.parameters,
                },
                "required": ["name", "arguments"],
                "additionalProperties": false,
            }));
            lark.push_str(&format!("f{i}: %json {schema}\n"));
        }
        Some(Constraint::Grammar { lark })
    }
}

fn tool(api: Api, i: usize, item: Value) -> Result<Tool, ApiError> {
    let param = format!("tools[{i}]");
    let kind = item.get("type").and_then(Value::as_str);
    if kind != Some("function") {
        return Err(ApiError::unsupported(
            format!("{param}.type"),
            format!(
                "tools of type {} are not supported (only \"function\")",
                kind.map_or("(none)".to_string(), |k| format!("{k:?}"))
            ),
        ));
    }
    let (function, at) = match api {
        Api::Chat => {
            #[derive(Deserialize)]
            #[serde(deny_unknown_fields)]
            struct ChatTool {
                #[allow(dead_code)]
                r#type: String,
                function: FunctionIn,
            }
            let t: ChatTool = serde_json::from_value(item)
                .map_err(|e| ApiError::invalid(param.clone(), format!("invalid tool: {e}")))?;
            (t.function, format!("{param}.function"))
        }
        Api::Responses => {
            let mut item = item;
            if let Some(map) = item.as_object_mut() {
                map.remove("type");
            }
            let f: FunctionIn = serde_json::from_value(item)
                .map_err(|e| ApiError::invalid(param.clone(), format!("invalid tool: {e}")))?;
            (f, param)
        }
    };
    check_name(&format!("{at}.name"), &function.name)?;
    let parameters = match function.parameters {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p,
        Some(_) => {
            return Err(ApiError::invalid(
                format!("{at}.parameters"),
                "`parameters` must be a JSON schema object",
            ))
        }
    };
    Ok(Tool {
        name: function.name,
        description: function.description,
        parameters,
    })
}

/// OpenAI's rule for function names.
fn check_name(param: &str, name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(
            param,
            format!("function names are 1 to 64 of a-z, A-Z, 0-9, _ and -; got {name:?}"),
        ))
    }
}

fn tool_choice(api: Api, value: Value) -> Result<ToolChoice, ApiError> {
    let bad = || {
        ApiError::invalid(
            "tool_choice",
            match api {
                Api::Chat => {
                    "`tool_choice` must be \"none\", \"auto\", \"required\" or \
                              {\"type\": \"function\", \"function\": {\"name\": ...}}"
                }
                Api::Responses => {
                    "`tool_choice` must be \"none\", \"auto\", \"required\" or \
                                   {\"type\": \"function\", \"name\": ...}"
                }
            },
        )
    };
    match &value {
        Value::String(s) => match s.as_str() {
            "none" => Ok(ToolChoice::None),
            "auto" => Ok(ToolChoice::Auto),
            "required" => Ok(ToolChoice::Required),
            _ => Err(bad()),
        },
        Value::Object(map) => {
            match map.get("type").and_then(Value::as_str) {
                Some("function") => {}
                Some(other) => {
                    return Err(ApiError::unsupported(
                        "tool_choice.type",
                        format!("tool choices of type {other:?} are not supported"),
                    ))
                }
                None => return Err(bad()),
            }
            let name = match api {
                Api::Chat => map.get("function").and_then(|f| f.get("name")),
                Api::Responses => map.get("name"),
            };
            name.and_then(Value::as_str)
                .map(|n| ToolChoice::Named(n.to_string()))
                .ok_or_else(bad)
        }
        _ => Err(bad()),
    }
}

/// A request's constraint: its format's (`response_format`, `text.format`: `format_param`)
/// or an enforced call's grammar, not both (a 400: the answer is the call).
pub(crate) fn constraint(
    format: Option<Constraint>,
    tools: Option<&Tools>,
    format_param: &str,
) -> Result<Option<Constraint>, ApiError> {
    match (format, tools.and_then(Tools::constraint)) {
        (Some(_), Some(_)) => Err(ApiError::invalid(
            format_param,
            format!(
                "`{format_param}` cannot be combined with a `tool_choice` that requires a call: \
                 the answer is the call"
            ),
        )),
        (format, calls) => Ok(format.or(calls)),
    }
}

/// `s` as a Lark string literal.
fn lark_literal(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

/// A call the assistant made earlier in the conversation.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PastCall {
    pub(crate) name: String,
    /// As the client sent it back (a JSON text, normally).
    pub(crate) arguments: String,
}

/// An assistant turn's text with the calls it made, in the format the model writes them.
pub(crate) fn assistant_text(content: &str, calls: &[PastCall]) -> String {
    let mut text = content.to_string();
    for call in calls {
        // Arguments that are not JSON still reach the model, as a string.
        let arguments = serde_json::from_str::<Value>(&call.arguments)
            .unwrap_or_else(|_| Value::from(call.arguments.as_str()));
        if !text.is_empty() {
            text.push('\n');
        }
        text.push_str(&format!(
            "{OPEN}\n{}\n{CLOSE}",
            json!({"name": call.name, "arguments": arguments})
        ));
    }
    text
}

/// A tool's result, as the user turn that carries it back holds it.
pub(crate) fn result_text(content: &str) -> String {
    format!("<tool_response>\n{content}\n</tool_response>")
}

/// Adds tool result `content` to `messages`: consecutive results share one user turn.
pub(crate) fn push_result(messages: &mut Vec<ChatMessage>, content: &str, merge: bool) {
    let text = result_text(content);
    match messages.last_mut() {
        Some(last) if merge && last.role == "user" => {
            last.content.push('\n');
            last.content.push_str(&text);
        }
        _ => messages.push(ChatMessage::new("user", text)),
    }
}

/// What the parser found in the model's text.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Found {
    /// Text for the answer's content.
    Text(String),
    /// Call `index` (0, 1, ... within the answer) begins.
    CallStart { index: usize, name: String },
    /// The next piece of call `index`'s arguments (a JSON text once all pieces are joined).
    Arguments { index: usize, piece: String },
}

/// Splits streamed model text into content and tool calls, each piece as early as it is
/// known: text is held back only while it could be the start of `<tool_call>`, a call's
/// name is given once its `"name"` is read, its arguments as they come (holding back what
/// could be the call's closing brace).
#[derive(Debug, Default)]
pub(crate) struct CallParser {
    /// Text not yet given out (outside a call), or the current call's text after `<tool_call>`.
    pending: String,
    inside: bool,
    /// Calls begun so far.
    calls: usize,
    /// In the current call: whether its start was given, and how much of its arguments.
    started: bool,
    args_given: usize,
    /// Right after a call: whitespace before the next call or the end is not content.
    after_call: bool,
}

impl CallParser {
    /// Whether any call was found so far.
    pub(crate) fn found_calls(&self) -> bool {
        self.calls > 0
    }

    /// Reads the next piece of model text.
    pub(crate) fn push(&mut self, text: &str) -> Vec<Found> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.inside {
                let Some(end) = self.pending.find(CLOSE) else {
                    self.stream_call(&mut out);
                    return out;
                };
                let body = self.pending[..end].to_string();
                self.pending.drain(..end + CLOSE.len());
                self.end_call(&body, &mut out);
            } else {
                if self.after_call {
                    let ws = self.pending.len() - self.pending.trim_start().len();
                    self.pending.drain(..ws);
                    if self.pending.is_empty() {
                        return out;
                    }
                    self.after_call = false;
                }
                match self.pending.find(OPEN) {
                    Some(start) => {
                        text_piece(&mut out, self.pending[..start].to_string());
                        self.pending.drain(..start + OPEN.len());
                        self.inside = true;
                        self.started = false;
                        self.args_given = 0;
                    }
                    None => {
                        let keep = partial_suffix(&self.pending, OPEN);
                        let give = self.pending.len() - keep;
                        text_piece(&mut out, self.pending[..give].to_string());
                        self.pending.drain(..give);
                        return out;
                    }
                }
            }
        }
    }

    /// The end of the text: what was held back.
    pub(crate) fn finish(&mut self) -> Vec<Found> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.pending);
        if self.inside {
            self.inside = false;
            if self.started {
                // Cut short (max_tokens): the rest of the arguments as written.
                let args = arguments_text(&rest).unwrap_or_default();
                self.give_arguments(args, &mut out);
            } else {
                text_piece(&mut out, format!("{OPEN}{rest}"));
            }
        } else {
            text_piece(&mut out, rest);
        }
        out
    }

    /// Gives the call's start and arguments as far as they are certain.
    fn stream_call(&mut self, out: &mut Vec<Found>) {
        // What may be the start of `</tool_call>` waits.
        let visible = self.pending.len() - partial_suffix(&self.pending, CLOSE);
        if !self.started {
            let Some(name) = call_name(&self.pending[..visible]) else {
                return;
            };
            self.start_call(name, out);
        }
        let body = &self.pending[..visible];
        let Some(args) = arguments_text(body) else {
            return;
        };
        // Streamed only when the arguments are an object; a string is unwrapped at the end.
        if !args.starts_with('{') {
            return;
        }
        let certain = args.len() - closing_suffix(args);
        if certain > self.args_given {
            let piece = args[self.args_given..certain].to_string();
            self.args_given = certain;
            out.push(Found::Arguments {
                index: self.calls - 1,
                piece,
            });
        }
    }

    fn start_call(&mut self, name: String, out: &mut Vec<Found>) {
        self.started = true;
        self.calls += 1;
        out.push(Found::CallStart {
            index: self.calls - 1,
            name,
        });
    }

    /// A whole `<tool_call>` body: a call if it parses (or was begun), else text.
    fn end_call(&mut self, body: &str, out: &mut Vec<Found>) {
        self.inside = false;
        self.after_call = true;
        let parsed: Option<(String, String)> = serde_json::from_str::<Value>(body.trim())
            .ok()
            .and_then(|v| {
                let name = v.get("name")?.as_str()?.to_string();
                let args = match v.get("arguments")? {
                    Value::String(s) => s.clone(),
                    _ => arguments_text(body)?.to_string(),
                };
                Some((name, args))
            });
        match parsed {
            Some((name, args)) => {
                if !self.started {
                    self.start_call(name, out);
                }
                self.give_arguments(&args, out);
            }
            None if self.started => {
                let args = arguments_text(body).unwrap_or_default().to_string();
                self.give_arguments(&args, out);
            }
            None => {
                self.after_call = false;
                text_piece(out, format!("{OPEN}{body}{CLOSE}"));
            }
        }
    }

    /// The arguments past what was given (all of them if what was given is not their start).
    fn give_arguments(&mut self, args: impl AsRef<str>, out: &mut Vec<Found>) {
        let args = args.as_ref();
        let rest = args.get(self.args_given..).unwrap_or_default();
        self.args_given = args.len();
        if !rest.is_empty() {
            out.push(Found::Arguments {
                index: self.calls - 1,
                piece: rest.to_string(),
            });
        }
    }
}

fn text_piece(out: &mut Vec<Found>, text: String) {
    if text.is_empty() {
        return;
    }
    if let Some(Found::Text(last)) = out.last_mut() {
        last.push_str(&text);
    } else {
        out.push(Found::Text(text));
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `marker`.
fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && text.ends_with(&marker[..n]))
        .unwrap_or(0)
}

/// A call body's name, once `{"name": "..."` has been read in full.
fn call_name(body: &str) -> Option<String> {
    let rest = body.trim_start().strip_prefix('{')?.trim_start();
    let rest = rest
        .strip_prefix("\"name\"")?
        .trim_start()
        .strip_prefix(':')?;
    let rest = rest.trim_start();
    let mut de = serde_json::Deserializer::from_str(rest).into_iter::<String>();
    de.next()?.ok()
}

/// The text after a call body's `"arguments":` (with the call's closing brace, if written).
fn arguments_text(body: &str) -> Option<&str> {
    let key = body.find("\"arguments\"")?;
    let rest = body[key + "\"arguments\"".len()..].trim_start();
    let rest = rest.strip_prefix(':')?.trim_start();
    // The body's own closing brace (and what follows it) is not part of the arguments.
    let trimmed = rest.trim_end();
    Some(match trimmed.strip_suffix('}') {
        Some(inner) if balanced(inner) => inner.trim_end(),
        _ => rest,
    })
}

/// Whether `text` closes every brace and bracket it opens (outside strings).
fn balanced(text: &str) -> bool {
    let mut depth = 0i64;
    let mut in_string = false;
    let mut escaped = false;
    for c in text.chars() {
        if in_string {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '{' | '[' => depth += 1,
            '}' | ']' => depth -= 1,
            _ => {}
        }
        if depth < 0 {
            return false;
        }
    }
    depth == 0 && !in_string
}

/// How much of the end of streamed arguments may still turn out to be the call's own
/// closing brace and the whitespace around it.
fn closing_suffix(args: &str) -> usize {
    let trimmed = args.trim_end();
    match trimmed.strip_suffix('}') {
        Some(inner) => args.len() - inner.trim_end().len(),
        None => args.len() - trimmed.len(),
    }
}

#[cfg(test)]
mod tests;
