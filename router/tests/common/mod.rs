//! Shared by the router's integration tests: a tiny byte-level tokenizer with a ChatML
//! template, a scripted test double of the `Backend` seam, and HTTP helpers that drive the
//! axum app in-process.

#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use kvmesh_common::{FinishReason, GenerateEvent, GenerateRequest, TokenEvent, Usage, WorkerError};
use kvmesh_prompt::tokenizer::Tokenizer;
use kvmesh_router::{Backend, Router, RouterConfig};
use serde_json::{json, Value};
use tokio::sync::{mpsc, Notify};
use tower::ServiceExt;

pub const MODEL: &str = "test-model";
pub const ENDOFTEXT: u32 = 256;
pub const IM_START: u32 = 257;
pub const IM_END: u32 = 258;

const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// GPT-2's byte -> printable char table.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff);
    if printable(b) {
        char::from(b)
    } else {
        let shifted = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(256 + shifted).unwrap()
    }
}

/// A byte-level BPE tokenizer without merges: token `b` is byte `b` (so ASCII text has one
/// token per character), plus `<|endoftext|>` (256), `<|im_start|>` (257), `<|im_end|>`
/// (258, EOS), and a ChatML template.
pub fn tokenizer() -> Arc<Tokenizer> {
    tokenizer_with(&[])
}

/// [`tokenizer`] with more special tokens, numbered from 259 (e.g. fill-in-the-middle ones).
pub fn tokenizer_with(extra: &[&str]) -> Arc<Tokenizer> {
    let specials: Vec<(&str, u32)> = [
        ("<|endoftext|>", 256),
        ("<|im_start|>", 257),
        ("<|im_end|>", 258),
    ]
    .into_iter()
    .chain(extra.iter().zip(259..).map(|(t, id)| (*t, id)))
    .collect();
    let vocab: serde_json::Map<String, Value> = (0..=255u8)
        .map(|b| (byte_char(b).to_string(), json!(b)))
        .chain(specials.iter().map(|&(t, id)| (t.to_string(), json!(id))))
        .collect();
    let added: Vec<Value> = specials
        .into_iter()
        .map(|(t, id)| {
            json!({"id": id, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []}
    });
    let bytes = serde_json::to_vec(&json).unwrap();
    Arc::new(
        Tokenizer::from_hf_json(&bytes, None, Some(IM_END), Some(CHATML.to_string()))
            .expect("test tokenizer"),
    )
}

/// One step of a scripted backend stream.
#[derive(Clone, Debug)]
pub enum Step {
    Send(GenerateEvent),
    Sleep(Duration),
    /// Sends a token every `every` until the receiver is dropped (at most `max` tokens),
    /// then a `Finished`.
    TokensUntilClosed {
        every: Duration,
        max: usize,
    },
    /// Waits until the test calls `notify_one` (a permit stored earlier counts).
    WaitFor(Arc<Notify>),
    /// Panics inside `generate` (in the handler's future).
    Panic,
}

pub type Script = Box<dyn Fn(&GenerateRequest) -> Result<Vec<Step>, WorkerError> + Send + Sync>;

/// A deterministic test double of the `Backend` seam: replays a script per request,
/// records requests, and observes when the router drops a receiver.
pub struct ScriptedBackend {
    script: Mutex<Script>,
    pub requests: Mutex<Vec<GenerateRequest>>,
    pub ready: AtomicBool,
    cancel: Arc<CancelSignal>,
}

/// Counts streams whose receiver was dropped before the script ended.
#[derive(Default)]
struct CancelSignal {
    count: AtomicUsize,
    notify: Notify,
}

impl CancelSignal {
    fn mark(&self) {
        self.count.fetch_add(1, Ordering::SeqCst);
        self.notify.notify_waiters();
    }
}

impl ScriptedBackend {
    pub fn new(script: Script) -> Arc<Self> {
        Arc::new(ScriptedBackend {
            script: Mutex::new(script),
            requests: Mutex::new(Vec::new()),
            ready: AtomicBool::new(true),
            cancel: Arc::default(),
        })
    }

    /// Every request answers `text` (one token per byte) and finishes with `reason`.
    pub fn replying(text: &'static str, reason: FinishReason) -> Arc<Self> {
        Self::new(Box::new(move |req| Ok(reply(req, text, reason))))
    }

    pub fn set_script(&self, script: Script) {
        *self.script.lock().unwrap() = script;
    }

    pub fn requests(&self) -> Vec<GenerateRequest> {
        self.requests.lock().unwrap().clone()
    }

    /// How many streams saw their receiver dropped early.
    pub fn cancelled(&self) -> usize {
        self.cancel.count.load(Ordering::SeqCst)
    }

    /// Waits (bounded) until `n` streams' receivers were dropped early.
    pub async fn wait_cancelled(&self, n: usize, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.cancel.notify.notified();
            if self.cancelled() >= n {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.cancelled() >= n;
            }
        }
    }
}

/// A token event for `text` (one byte of ASCII) with logprobs.
pub fn token(byte: u8) -> GenerateEvent {
    GenerateEvent::Token(TokenEvent {
        token: u32::from(byte),
        text: char::from(byte).to_string(),
        logprob: Some(-0.25),
        top_logprobs: vec![(u32::from(byte), -0.25), (u32::from(b'z'), -2.0)],
    })
}

/// `text` one token per byte, then `Finished`.
pub fn reply(req: &GenerateRequest, text: &str, reason: FinishReason) -> Vec<Step> {
    let mut steps: Vec<Step> = text.bytes().map(|b| Step::Send(token(b))).collect();
    steps.push(Step::Send(finished(req, text.len() as u32, reason)));
    steps
}

pub fn finished(
    req: &GenerateRequest,
    completion_tokens: u32,
    reason: FinishReason,
) -> GenerateEvent {
    GenerateEvent::Finished {
        reason,
        text: String::new(),
        usage: Usage {
            prompt_tokens: req.prompt.len() as u32,
            completion_tokens,
            cached_tokens: 3,
        },
    }
}

#[kvmesh_router::async_trait]
impl Backend for ScriptedBackend {
    async fn generate(
        &self,
        req: GenerateRequest,
    ) -> Result<mpsc::UnboundedReceiver<GenerateEvent>, WorkerError> {
        self.requests.lock().unwrap().push(req.clone());
        let steps = (self.script.lock().unwrap())(&req)?;
        if steps.iter().any(|s| matches!(s, Step::Panic)) {
            panic!("scripted panic");
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let cancel = self.cancel.clone();
        tokio::spawn(async move {
            for step in steps {
                match step {
                    Step::Send(ev) => {
                        if tx.send(ev).is_err() {
                            cancel.mark();
                            return;
                        }
                    }
                    Step::Sleep(d) => {
                        tokio::select! {
                            () = tx.closed() => {
                                cancel.mark();
                                return;
                            }
                            () = tokio::time::sleep(d) => {}
                        }
                    }
                    Step::TokensUntilClosed { every, max } => {
                        for _ in 0..max {
                            tokio::select! {
                                () = tx.closed() => {
                                    cancel.mark();
                                    return;
                                }
                                () = tokio::time::sleep(every) => {}
                            }
                            if tx.send(token(b'x')).is_err() {
                                cancel.mark();
                                return;
                            }
                        }
                        let _ = tx.send(finished(&req, max as u32, FinishReason::Length));
                    }
                    Step::WaitFor(signal) => {
                        tokio::select! {
                            () = tx.closed() => {
                                cancel.mark();
                                return;
                            }
                            () = signal.notified() => {}
                        }
                    }
                    Step::Panic => unreachable!(),
                }
            }
        });
        Ok(rx)
    }

    fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }
}

pub fn config() -> RouterConfig {
    RouterConfig {
        model_name: MODEL.into(),
        max_context: 256,
        default_max_tokens: 32,
        max_tokens_limit: 128,
        max_n: 4,
        max_body_bytes: 64 * 1024,
        ..Default::default()
    }
}

pub fn router_with(backend: &Arc<ScriptedBackend>, config: RouterConfig) -> Router {
    Router::new(config, backend.clone(), tokenizer()).expect("valid config")
}

pub fn router(backend: &Arc<ScriptedBackend>) -> Router {
    router_with(backend, config())
}

/// A router with room for long system text (tools' descriptions): this test tokenizer
/// has a token per byte.
pub fn roomy_router(backend: &Arc<ScriptedBackend>) -> Router {
    let config = RouterConfig {
        max_context: 8192,
        ..config()
    };
    router_with(backend, config)
}

/// A response, read whole.
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    /// The `data:` payloads of an SSE body, in order.
    pub fn sse_data(&self) -> Vec<String> {
        let text = std::str::from_utf8(&self.body).unwrap();
        text.split("\n\n")
            .filter_map(|event| {
                event
                    .lines()
                    .find_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
                    .map(str::to_string)
            })
            .collect()
    }

    /// The SSE JSON payloads (all but `[DONE]`), asserting the stream ends with `[DONE]`.
    pub fn sse_json(&self) -> Vec<Value> {
        let data = self.sse_data();
        assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
        data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }
}

pub async fn send(app: &axum::Router, req: Request<Body>) -> Reply {
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let body = resp
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes()
        .to_vec();
    Reply {
        status,
        headers,
        body,
    }
}

pub fn post_request(path: &str, body: impl Into<Body>) -> Request<Body> {
    Request::post(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body.into())
        .unwrap()
}

pub async fn post(app: &axum::Router, path: &str, body: Value) -> Reply {
    send(app, post_request(path, body.to_string())).await
}

pub async fn get(app: &axum::Router, path: &str) -> Reply {
    send(app, Request::get(path).body(Body::empty()).unwrap()).await
}

/// A chat body with one user message.
pub fn chat_body(content: &str) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": content}]})
}

/// Asserts an OpenAI error body and status; returns the `error` object.
pub fn assert_error(reply: &Reply, status: u16) -> Value {
    assert_eq!(
        reply.status.as_u16(),
        status,
        "body: {}",
        String::from_utf8_lossy(&reply.body)
    );
    let body = reply.json();
    let err = body["error"].clone();
    assert!(err["message"].is_string(), "{body}");
    assert!(err["type"].is_string(), "{body}");
    assert!(
        err.get("param").is_some() && err.get("code").is_some(),
        "{body}"
    );
    err
}
