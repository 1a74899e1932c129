//! A sans-IO meter of one streamed response: fed each SSE event's data with the time since
//! the request was sent, it measures TTFT, every inter-token gap, the end-to-end time and the
//! token counts, and says how the stream failed if it did. No clock, no socket: the client
//! reads the bytes and the time, this judges them, so every timing rule is tested exactly.
//!
//! A chunk *carries output* when one of its choices has non-empty `text` (completions) or
//! `delta.content` / `delta.reasoning_content` (chat): a chat stream's first, role-only delta
//! is no token, and neither is the final usage chunk (no choices).

use std::borrow::Cow;
use std::time::Duration;

use serde::Deserialize;

use super::sse::SseReader;

/// Why a request did not complete: `kind` groups failures in a report (`http_<status>`,
/// `connect`, `http`, `timeout`, `stream_error`, `bad_event`, `truncated`, `panic`);
/// `message` says what happened, for the first example of each kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub kind: String,
    pub message: String,
}

impl Failure {
    pub fn new(kind: impl Into<String>, message: impl ToString) -> Failure {
        Failure {
            kind: kind.into(),
            message: message.to_string(),
        }
    }
}

/// What one stream measured, times from the send.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metered {
    /// To the first chunk carrying output.
    pub ttft: Option<Duration>,
    /// Between consecutive chunks carrying output, in order.
    pub gaps: Vec<Duration>,
    /// To `data: [DONE]`; `None` for a stream that did not get there.
    pub e2e: Option<Duration>,
    /// From the usage chunk, where the server sent one.
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    /// The usage chunk's `completion_tokens`, else the number of chunks carrying output.
    pub output_tokens: u64,
    /// Why the stream failed (an error event, a malformed event, no `[DONE]`).
    pub failure: Option<Failure>,
}

/// Measures one stream; see the module's docs.
#[derive(Debug, Default)]
pub struct StreamMeter {
    sse: SseReader,
    events: Vec<String>,
    ttft: Option<Duration>,
    last_token: Option<Duration>,
    gaps: Vec<Duration>,
    token_chunks: u64,
    prompt_tokens: Option<u64>,
    cached_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    /// Set once: `Ok(e2e)` at `[DONE]`, or the failure.
    end: Option<Result<Duration, Failure>>,
}

/// The parts of a streamed chunk that matter here; text is borrowed where it has no escapes.
#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(default, borrow)]
    choices: Vec<Choice<'a>>,
    #[serde(default)]
    usage: Option<Usage>,
    /// OpenAI's `{"error": {...}}`.
    #[serde(default)]
    error: Option<serde_json::Value>,
    /// vLLM's older `{"object": "error", "message": ...}`.
    #[serde(default, borrow)]
    object: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    message: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    delta: Option<Delta<'a>>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    reasoning_content: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Deserialize)]
struct PromptTokensDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

fn non_empty(s: &Option<Cow<'_, str>>) -> bool {
    s.as_deref().is_some_and(|s| !s.is_empty())
}

impl Choice<'_> {
    fn carries_output(&self) -> bool {
        non_empty(&self.text)
            || self
                .delta
                .as_ref()
                .is_some_and(|d| non_empty(&d.content) || non_empty(&d.reasoning_content))
    }
}

impl StreamMeter {
    /// Whether the stream has ended (with `[DONE]` or a failure); later input is ignored.
    pub fn ended(&self) -> bool {
        self.end.is_some()
    }

    /// Feeds bytes of the response body that arrived `now` after the send; returns
    /// [`Self::ended`].
    pub fn feed(&mut self, now: Duration, bytes: &[u8]) -> bool {
        if self.ended() {
            return true;
        }
        let mut events = std::mem::take(&mut self.events);
        if let Err(e) = self.sse.push(bytes, &mut events) {
            self.end = Some(Err(Failure::new("bad_event", e)));
        }
        for data in events.drain(..) {
            if self.event(now, &data) {
                break;
            }
        }
        events.clear();
        self.events = events;
        self.ended()
    }

    /// Feeds one event's data that arrived `now` after the send; returns [`Self::ended`].
    pub fn event(&mut self, now: Duration, data: &str) -> bool {
        if self.ended() {
            return true;
        }
        if data == "[DONE]" {
            self.end = Some(Ok(now));
            return true;
        }
        let chunk: Chunk = match serde_json::from_str(data) {
            Ok(c) => c,
            Err(e) => return self.fail(Failure::new("bad_event", format!("{e}: {data}"))),
        };
        if let Some(error) = chunk.error {
            return self.fail(Failure::new("stream_error", error));
        }
        if chunk.object.as_deref() == Some("error") {
            let message = chunk.message.as_deref().unwrap_or(data);
            return self.fail(Failure::new("stream_error", message));
        }
        if chunk.choices.iter().any(Choice::carries_output) {
            self.ttft.get_or_insert(now);
            if let Some(last) = self.last_token {
                self.gaps.push(now.saturating_sub(last));
            }
            self.last_token = Some(now);
            self.token_chunks += 1;
        }
        if let Some(u) = chunk.usage {
            self.prompt_tokens = u.prompt_tokens.or(self.prompt_tokens);
            self.completion_tokens = u.completion_tokens.or(self.completion_tokens);
            let cached = u.prompt_tokens_details.and_then(|d| d.cached_tokens);
            self.cached_tokens = cached.or(self.cached_tokens);
        }
        false
    }

    fn fail(&mut self, failure: Failure) -> bool {
        self.end = Some(Err(failure));
        true
    }

    /// What the stream measured; a stream that ended without `[DONE]` or a failure is
    /// `truncated`.
    pub fn finish(self) -> Metered {
        let (e2e, failure) = match self.end {
            Some(Ok(e2e)) => (Some(e2e), None),
            Some(Err(f)) => (None, Some(f)),
            None => (
                None,
                Some(Failure::new(
                    "truncated",
                    "the stream ended without data: [DONE]",
                )),
            ),
        };
        Metered {
            ttft: self.ttft,
            gaps: self.gaps,
            e2e,
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
            output_tokens: self.completion_tokens.unwrap_or(self.token_chunks),
            failure,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    fn text(t: &str) -> String {
        serde_json::json!({"object": "text_completion", "choices": [{"index": 0, "text": t, "finish_reason": null}]})
            .to_string()
    }

    fn delta(delta: serde_json::Value) -> String {
        serde_json::json!({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]})
            .to_string()
    }

    fn usage(prompt: u64, completion: u64, cached: u64) -> String {
        serde_json::json!({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}})
        .to_string()
    }

    /// Feeds `(ms, data)` events in order.
    fn meter(events: &[(u64, String)]) -> Metered {
        let mut m = StreamMeter::default();
        for (ms, data) in events {
            m.event(MS(*ms), data);
        }
        m.finish()
    }

    #[test]
    fn completions_timings_to_the_millisecond() {
        let m = meter(&[
            (120, text("Hello")),
            (135, text(" world")),
            (135, text("")), // no output: neither a token nor a gap
            (170, text("!")),
            (171, usage(42, 3, 16)),
            (172, "[DONE]".into()),
        ]);
        assert_eq!(m.ttft, Some(MS(120)));
        assert_eq!(m.gaps, [MS(15), MS(35)]);
        assert_eq!(m.e2e, Some(MS(172)));
        assert_eq!(
            (m.prompt_tokens, m.cached_tokens, m.output_tokens),
            (Some(42), Some(16), 3)
        );
        assert_eq!(m.failure, None);
    }

    #[test]
    fn a_role_only_chat_delta_is_not_a_token() {
        let m = meter(&[
            (
                5,
                delta(serde_json::json!({"role": "assistant", "content": ""})),
            ),
            (8, delta(serde_json::json!({"role": "assistant"}))),
            (40, delta(serde_json::json!({"content": "Hi"}))),
            (52, delta(serde_json::json!({"reasoning_content": "hmm"}))),
            (60, delta(serde_json::json!({"content": "!"}))),
            (61, "[DONE]".into()),
        ]);
        assert_eq!(m.ttft, Some(MS(40)));
        assert_eq!(m.gaps, [MS(12), MS(8)]);
        assert_eq!(m.e2e, Some(MS(61)));
        // No usage: the chunks carrying output are counted.
        assert_eq!((m.prompt_tokens, m.output_tokens), (None, 3));
    }

    #[test]
    fn usage_counts_tokens_over_chunks() {
        // Two tokens in one chunk: the server's count wins.
        let m = meter(&[
            (10, text("ab")),
            (11, usage(7, 2, 0)),
            (12, "[DONE]".into()),
        ]);
        assert_eq!((m.output_tokens, m.cached_tokens), (2, Some(0)));
        let no_details = serde_json::json!({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}});
        let m = meter(&[(1, no_details.to_string()), (2, "[DONE]".into())]);
        assert_eq!((m.prompt_tokens, m.cached_tokens), (Some(3), None));
    }

    #[test]
    fn errors_in_the_stream() {
        let openai = serde_json::json!({"error": {"message": "node lost", "code": 500}});
        let m = meter(&[
            (10, text("a")),
            (20, openai.to_string()),
            (30, text("b")),
            (40, "[DONE]".into()),
        ]);
        let failure = m.failure.unwrap();
        assert_eq!(failure.kind, "stream_error");
        assert!(failure.message.contains("node lost"), "{failure:?}");
        // What came before the error is kept; nothing after it counts.
        assert_eq!((m.ttft, m.e2e, m.output_tokens), (Some(MS(10)), None, 1));

        let vllm = r#"{"object":"error","message":"out of blocks","type":"BadRequestError"}"#;
        let m = meter(&[(10, vllm.into())]);
        assert_eq!(
            m.failure,
            Some(Failure::new("stream_error", "out of blocks"))
        );

        let m = meter(&[(10, "{not json".into())]);
        assert_eq!(m.failure.unwrap().kind, "bad_event");

        let m = meter(&[(10, text("a")), (20, text("b"))]);
        assert_eq!(m.failure.unwrap().kind, "truncated");
        assert_eq!((m.ttft, m.gaps, m.e2e), (Some(MS(10)), vec![MS(10)], None));
    }

    #[test]
    fn bytes_split_anywhere_give_the_same_events() {
        let body = format!(
            "data: {}\n\n: keep-alive\n\ndata: {}\r\n\r\ndata: [DONE]\n\n",
            text("x"),
            text("y")
        );
        // Split inside the second event, before the blank line that ends it.
        let (a, b) = body.as_bytes().split_at(body.find("\r\n").unwrap());
        let mut m = StreamMeter::default();
        assert!(!m.feed(MS(50), a));
        assert!(m.feed(MS(80), b));
        assert!(
            m.feed(MS(90), b"data: {\"error\": 1}\n\n"),
            "ignored once ended"
        );
        let m = m.finish();
        assert_eq!(m.ttft, Some(MS(50)));
        assert_eq!(m.e2e, Some(MS(80)));
        assert_eq!(m.failure, None);
        assert_eq!(m.gaps, [MS(30)]);

        let mut m = StreamMeter::default();
        assert!(m.feed(MS(1), b"data: \xff\n\n"));
        assert_eq!(m.finish().failure.unwrap().kind, "bad_event");
    }
}
