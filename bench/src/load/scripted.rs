//! A scripted OpenAI-compatible server: `/v1/completions` and `/v1/chat/completions` answer
//! every request with exactly `max_tokens` tokens, the first `ttft` after the request arrives
//! and each next one `itl` after the last, with a usage chunk; every k-th request can be
//! answered with an error status instead (429, to see shedding counted).
//!
//! This is a product feature, not a test double: it benchmarks the load generator itself
//! (`kvmesh bench scripted-server`, then `kvmesh bench serve --url` against it). With zero
//! delays it shows the most the generator can offer; with a script it shows how exactly the
//! generator measures (every TTFT and gap it reports should be the script's, a little above,
//! never below). It does not tokenize: a text prompt counts one token per whitespace-separated
//! word.

use std::convert::Infallible;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::Router;
use bytes::Bytes;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};

/// `max_tokens` above this is refused (a non-streamed answer is built in memory).
const MAX_TOKENS: u32 = 1 << 20;

/// What the server does with each request.
#[derive(Clone, Debug, PartialEq)]
pub struct Script {
    /// From a request's arrival to its first token.
    pub ttft: Duration,
    /// From one token to the next (each gap at least this: the waits are relative, so a late
    /// token delays the rest rather than bunching them).
    pub itl: Duration,
    /// Answer some requests with an error status instead.
    pub inject: Option<Injection>,
    /// The `model` the server reports.
    pub model: String,
}

impl Default for Script {
    fn default() -> Self {
        Script {
            ttft: Duration::ZERO,
            itl: Duration::ZERO,
            inject: None,
            model: "scripted".into(),
        }
    }
}

/// Every `every`-th request (the `every`-th, `2·every`-th, ...) is answered with `status`
/// and an OpenAI-style error body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Injection {
    pub every: NonZeroU64,
    pub status: StatusCode,
}

struct Server {
    script: Script,
    /// The model name as a JSON string.
    model_json: String,
    requests: AtomicU64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Api {
    Completions,
    Chat,
}

#[derive(Deserialize)]
struct Request {
    #[serde(default)]
    prompt: Value,
    #[serde(default)]
    messages: Vec<Message>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    content: Value,
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// The server's routes (the two APIs, `/v1/models` and `/health`).
pub fn router(script: Script) -> Router {
    let server = Arc::new(Server {
        model_json: Value::from(script.model.as_str()).to_string(),
        script,
        requests: AtomicU64::new(0),
    });
    Router::new()
        .route(
            "/v1/completions",
            post(|s: State<Arc<Server>>, body: Bytes| answer(s, Api::Completions, body)),
        )
        .route(
            "/v1/chat/completions",
            post(|s: State<Arc<Server>>, body: Bytes| answer(s, Api::Chat, body)),
        )
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .with_state(server)
}

/// Serves [`router`] on `listener` until the task is dropped or the listener fails.
pub async fn serve(listener: tokio::net::TcpListener, script: Script) -> std::io::Result<()> {
    // Each token goes out as it is written, not held back for the last one's ACK.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, router(script)).await
}

async fn models(State(server): State<Arc<Server>>) -> Response {
    let body = json!({"object": "list", "data": [{"id": server.script.model, "object": "model", "owned_by": "kvmesh"}]});
    json_response(StatusCode::OK, body.to_string())
}

fn json_response(status: StatusCode, body: String) -> Response {
    let mut response = (status, body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

fn error(status: StatusCode, message: &str) -> Response {
    let body = json!({"error": {"message": message, "type": status.canonical_reason().unwrap_or("error"), "param": null, "code": status.as_u16()}});
    let mut response = json_response(status, body.to_string());
    if status == StatusCode::TOO_MANY_REQUESTS {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    response
}

/// Tokens in a text (one per whitespace-separated word).
fn words(text: &str) -> u64 {
    text.split_whitespace().count() as u64
}

/// Prompt tokens: token ids counted, text by words (a list of prompts summed).
fn prompt_tokens(api: Api, request: &Request) -> u64 {
    fn of(v: &Value) -> u64 {
        match v {
            Value::String(s) => words(s),
            Value::Number(_) => 1,
            Value::Array(items) => items.iter().map(of).sum(),
            // Chat content parts: `{"type": "text", "text": ...}`.
            Value::Object(part) => part.get("text").map_or(0, of),
            _ => 0,
        }
    }
    match api {
        Api::Completions => of(&request.prompt),
        Api::Chat => request.messages.iter().map(|m| of(&m.content)).sum(),
    }
}

async fn answer(State(server): State<Arc<Server>>, api: Api, body: Bytes) -> Response {
    let arrived = tokio::time::Instant::now();
    let n = server.requests.fetch_add(1, Ordering::Relaxed) + 1;
    if let Some(inject) = server.script.inject {
        if n.is_multiple_of(inject.every.get()) {
            return error(inject.status, "scripted refusal");
        }
    }
    let request: Request = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, &format!("bad request body: {e}")),
    };
    if api == Api::Chat && request.messages.is_empty() {
        return error(StatusCode::BAD_REQUEST, "no messages");
    }
    let tokens = request
        .max_tokens
        .or(request.max_completion_tokens)
        .unwrap_or(16);
    if tokens > MAX_TOKENS {
        return error(
            StatusCode::BAD_REQUEST,
            &format!("max_tokens above {MAX_TOKENS}"),
        );
    }
    let prompt = prompt_tokens(api, &request);
    let answer = Answer {
        server: server.clone(),
        api,
        id: n,
        tokens,
        prompt,
    };
    if !request.stream {
        let script = &server.script;
        let total = script.ttft + script.itl * tokens.saturating_sub(1);
        tokio::time::sleep_until(arrived + total).await;
        return json_response(StatusCode::OK, answer.whole());
    }
    let usage = request.stream_options.is_some_and(|o| o.include_usage);
    let mut response = Response::new(Body::from_stream(answer.stream(arrived, usage)));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// One request's answer.
struct Answer {
    server: Arc<Server>,
    api: Api,
    id: u64,
    tokens: u32,
    prompt: u64,
}

/// Where a streamed answer is.
struct Streaming {
    answer: Answer,
    /// The next token to send.
    next: u32,
    /// When the last token was sent.
    last: Option<tokio::time::Instant>,
    done: bool,
}

/// The text of every token.
const TOKEN: &str = " tok";

impl Answer {
    fn usage(&self) -> String {
        format!(
            r#"{{"prompt_tokens":{},"completion_tokens":{},"total_tokens":{},"prompt_tokens_details":{{"cached_tokens":0}}}}"#,
            self.prompt,
            self.tokens,
            self.prompt + u64::from(self.tokens)
        )
    }

    /// One SSE event: a chunk with `choice` (a JSON object) and `usage` (JSON).
    fn chunk(&self, choices: &str, usage: &str) -> Bytes {
        let object = match self.api {
            Api::Completions => "text_completion",
            Api::Chat => "chat.completion.chunk",
        };
        Bytes::from(format!(
            r#"data: {{"id":"cmpl-{}","object":"{object}","created":0,"model":{},"choices":[{choices}],"usage":{usage}}}

"#,
            self.id, self.server.model_json
        ))
    }

    /// The chunk of token `i` (the last one says why the answer ended).
    fn token(&self, i: u32) -> Bytes {
        let finish = if i + 1 == self.tokens {
            r#""length""#
        } else {
            "null"
        };
        let choice = match self.api {
            Api::Completions => format!(
                r#"{{"index":0,"text":"{TOKEN}","logprobs":null,"finish_reason":{finish}}}"#
            ),
            Api::Chat => format!(
                r#"{{"index":0,"delta":{{"content":"{TOKEN}"}},"logprobs":null,"finish_reason":{finish}}}"#
            ),
        };
        self.chunk(&choice, "null")
    }

    /// The events of a streamed answer: for chat a role-only delta at once (as servers send
    /// it), then the tokens on the script, then usage (if asked) and `[DONE]`.
    fn stream(
        self,
        arrived: tokio::time::Instant,
        usage: bool,
    ) -> impl futures::Stream<Item = Result<Bytes, Infallible>> + Send {
        let role = (self.api == Api::Chat).then(|| {
            self.chunk(
                r#"{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}"#,
                "null",
            )
        });
        let (ttft, itl) = (self.server.script.ttft, self.server.script.itl);
        let tokens = futures::stream::unfold(
            Streaming {
                answer: self,
                next: 0,
                last: None,
                done: false,
            },
            move |mut s| async move {
                if s.done {
                    return None;
                }
                if s.next == s.answer.tokens {
                    let mut tail = String::new();
                    if usage {
                        let chunk = s.answer.chunk("", &s.answer.usage());
                        tail.push_str(&String::from_utf8_lossy(&chunk));
                    }
                    tail.push_str("data: [DONE]\n\n");
                    s.done = true;
                    return Some((Ok(Bytes::from(tail)), s));
                }
                let due = match s.last {
                    None => arrived + ttft,
                    Some(last) => last + itl,
                };
                if due > tokio::time::Instant::now() {
                    tokio::time::sleep_until(due).await;
                }
                s.last = Some(tokio::time::Instant::now());
                let chunk = s.answer.token(s.next);
                s.next += 1;
                Some((Ok(chunk), s))
            },
        );
        futures::stream::iter(role.map(Ok)).chain(tokens)
    }

    /// A non-streamed answer, usage included.
    fn whole(&self) -> String {
        let text = TOKEN.repeat(self.tokens as usize);
        let choice = match self.api {
            Api::Completions => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length"})
            }
            Api::Chat => {
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"})
            }
        };
        let object = match self.api {
            Api::Completions => "text_completion",
            Api::Chat => "chat.completion",
        };
        format!(
            r#"{{"id":"cmpl-{}","object":"{object}","created":0,"model":{},"choices":[{choice}],"usage":{}}}"#,
            self.id,
            self.server.model_json,
            self.usage()
        )
    }
}
