//! One streamed completion over plain HTTP/1.1: a fresh connection per request (loopback
//! connects cost microseconds, and no pool can serialize requests behind each other).

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HOST};
use http::{Request, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use serde::de::IgnoredAny;
use serde::Deserialize;
use tokio::net::TcpStream;

use super::sse::SseReader;
use super::ReplayError;

/// How much of an error response's body is kept for the report.
const MAX_ERROR_BODY_BYTES: usize = 4096;

/// Where completions go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Endpoint {
    /// `host:port` to connect to.
    addr: String,
    /// The `Host` header.
    host: String,
    /// `/v1/completions`, under any path prefix of the base URL.
    path: String,
}

impl Endpoint {
    /// `base_url` is the router's root (`http://127.0.0.1:8000`), or its `/v1`.
    pub(crate) fn parse(base_url: &str) -> Result<Endpoint, ReplayError> {
        let bad = |reason: &str| ReplayError::BadUrl {
            url: base_url.to_owned(),
            reason: reason.to_owned(),
        };
        let uri: Uri = base_url.parse().map_err(|_| bad("not a URL"))?;
        if uri.scheme_str() != Some("http") {
            return Err(bad("only plain http:// URLs are supported"));
        }
        let authority = uri.authority().ok_or_else(|| bad("no host"))?;
        let port = authority.port_u16().unwrap_or(80);
        let prefix = uri.path().trim_end_matches('/');
        let prefix = prefix.strip_suffix("/v1").unwrap_or(prefix);
        Ok(Endpoint {
            addr: format!("{}:{port}", authority.host()),
            host: authority.as_str().to_owned(),
            path: format!("{prefix}/v1/completions"),
        })
    }
}

/// What one successful request measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Measured {
    /// From the send to the first chunk with a choice (none if no chunk had one).
    pub(crate) ttft: Option<Duration>,
    pub(crate) e2e: Duration,
    /// From the final usage chunk; without one, the number of chunks with a choice.
    pub(crate) output_tokens: u64,
    /// `(prompt_tokens, cached_tokens)` from the usage chunk.
    pub(crate) usage: Option<(u64, u64)>,
}

/// Why a request failed: `label` groups failures in the report (an HTTP status such as
/// `429`, or `connect`, `http`, `timeout`, `stream_error`, `bad_event`, `truncated`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Failure {
    pub(crate) label: String,
    pub(crate) message: String,
}

impl Failure {
    pub(crate) fn new(label: impl Into<String>, message: impl ToString) -> Failure {
        Failure {
            label: label.into(),
            message: message.to_string(),
        }
    }
}

/// The parts of a streamed chunk that matter here.
#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<IgnoredAny>,
    usage: Option<UsageBody>,
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct UsageBody {
    prompt_tokens: u64,
    completion_tokens: u64,
    #[serde(default)]
    prompt_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Deserialize)]
struct PromptTokensDetails {
    #[serde(default)]
    cached_tokens: u64,
}

/// Posts `body` (a streaming completion request) and reads the stream to its end.
pub(crate) async fn send(
    endpoint: &Endpoint,
    api_key: Option<&str>,
    body: Bytes,
) -> Result<Measured, Failure> {
    let start = Instant::now();
    let stream = TcpStream::connect(&endpoint.addr)
        .await
        .map_err(|e| Failure::new("connect", format!("{}: {e}", endpoint.addr)))?;
    stream.set_nodelay(true).ok();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| Failure::new("http", e))?;
    // Drives the connection; it ends when the response is read and `sender` dropped.
    tokio::spawn(conn);
    let mut request = Request::post(endpoint.path.as_str())
        .header(HOST, endpoint.host.as_str())
        .header(CONTENT_TYPE, "application/json")
        .header(ACCEPT, "text/event-stream");
    if let Some(key) = api_key {
        request = request.header(AUTHORIZATION, format!("Bearer {key}"));
    }
    let request = request
        .body(Full::new(body))
        .map_err(|e| Failure::new("http", e))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| Failure::new("http", e))?;
    let status = response.status();
    let mut body = response.into_body();
    if !status.is_success() {
        let text = match Limited::new(body, MAX_ERROR_BODY_BYTES).collect().await {
            Ok(b) => String::from_utf8_lossy(&b.to_bytes()).into_owned(),
            Err(_) => String::new(),
        };
        return Err(Failure::new(status.as_str(), text));
    }

    let mut reader = SseReader::default();
    let mut events = Vec::new();
    let mut measured = Measured::default();
    let mut choice_chunks = 0;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| Failure::new("http", e))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        reader
            .push(&data, &mut events)
            .map_err(|e| Failure::new("bad_event", e))?;
        for event in events.drain(..) {
            if event == "[DONE]" {
                measured.e2e = start.elapsed();
                if measured.output_tokens == 0 {
                    measured.output_tokens = choice_chunks;
                }
                return Ok(measured);
            }
            let chunk: Chunk = serde_json::from_str(&event)
                .map_err(|e| Failure::new("bad_event", format!("{e}: {event}")))?;
            if let Some(error) = chunk.error {
                return Err(Failure::new("stream_error", error));
            }
            if !chunk.choices.is_empty() {
                measured.ttft.get_or_insert_with(|| start.elapsed());
                choice_chunks += 1;
            }
            if let Some(u) = chunk.usage {
                let cached = u.prompt_tokens_details.map_or(0, |d| d.cached_tokens);
                measured.usage = Some((u.prompt_tokens, cached));
                measured.output_tokens = u.completion_tokens;
            }
        }
    }
    Err(Failure::new(
        "truncated",
        "the stream ended without data: [DONE]",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_from_base_urls() {
        let e = Endpoint::parse("http://127.0.0.1:8000").unwrap();
        assert_eq!(e.addr, "127.0.0.1:8000");
        assert_eq!(e.host, "127.0.0.1:8000");
        assert_eq!(e.path, "/v1/completions");
        for url in ["http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1/"] {
            assert_eq!(Endpoint::parse(url).unwrap(), e, "{url}");
        }
        let e = Endpoint::parse("http://localhost/mesh/v1").unwrap();
        assert_eq!(e.addr, "localhost:80");
        assert_eq!(e.path, "/mesh/v1/completions");
        for bad in [
            "https://127.0.0.1",
            "127.0.0.1:8000",
            "http://",
            "not a url",
        ] {
            assert!(
                matches!(Endpoint::parse(bad), Err(ReplayError::BadUrl { .. })),
                "{bad}"
            );
        }
    }
}
