//! The load generator's HTTP client: one streamed completion or chat completion over plain
//! HTTP/1.1, metered as it arrives.
//!
//! Connections are kept alive and reused: a request takes an idle connection or opens a new
//! one, never waits for a busy one, and gives its connection back once the response has been
//! read to its end. Loopback connects are cheap, but a connect, a handshake and a connection
//! task per request would be the generator's largest cost at thousands of requests a second.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, ACCEPT, AUTHORIZATION, CONTENT_TYPE, HOST};
use http::{Method, Request, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Incoming};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::meter::{Failure, StreamMeter};
use super::{Api, LoadError, Target};
use crate::workload::{Prompt, WorkItem};

/// How much of an error response's body is kept as its message.
const MAX_ERROR_BODY_BYTES: usize = 4096;

type Connection = SendRequest<Full<Bytes>>;

/// Where requests go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Endpoint {
    /// `host:port` to connect to.
    addr: String,
    /// The `Host` header.
    host: HeaderValue,
    /// `/v1/completions` or `/v1/chat/completions`, under any path prefix of the base URL.
    path: Uri,
}

impl Endpoint {
    /// `base_url` is the server's root (`http://127.0.0.1:8000`), or its `/v1`.
    pub(crate) fn parse(base_url: &str, api: Api) -> Result<Endpoint, LoadError> {
        let bad = |reason: &str| LoadError::BadUrl {
            url: base_url.to_owned(),
            reason: reason.to_owned(),
        };
        let uri: Uri = base_url.parse().map_err(|_| bad("not a URL"))?;
        if uri.scheme_str() != Some("http") {
            return Err(bad("only plain http:// URLs are supported"));
        }
        let authority = uri.authority().ok_or_else(|| bad("no host"))?;
        if authority.host().is_empty() {
            return Err(bad("no host"));
        }
        let port = authority.port_u16().unwrap_or(80);
        let prefix = uri.path().trim_end_matches('/');
        let prefix = prefix.strip_suffix("/v1").unwrap_or(prefix);
        let route = match api {
            Api::Completions => "completions",
            Api::Chat => "chat/completions",
        };
        Ok(Endpoint {
            addr: format!("{}:{port}", authority.host()),
            host: HeaderValue::from_str(authority.as_str()).map_err(|_| bad("bad host"))?,
            path: format!("{prefix}/v1/{route}")
                .parse()
                .map_err(|_| bad("bad path"))?,
        })
    }
}

/// The body of `item`'s request to `target`: streamed with usage, greedy. A prompt the API
/// cannot carry (token ids to chat, a conversation to completions) is an error, found before
/// the run starts.
pub(crate) fn request_body(
    item_index: usize,
    item: &WorkItem,
    target: &Target,
) -> Result<Bytes, LoadError> {
    let wrong = |prompt: &str| LoadError::PromptForApi {
        item: item_index,
        prompt: prompt.to_owned(),
        api: target.api,
    };
    let mut body = match (target.api, &item.prompt) {
        (Api::Completions, Prompt::Text(text)) => json!({ "prompt": text }),
        (Api::Completions, Prompt::Tokens(ids)) => json!({ "prompt": ids }),
        (Api::Completions, Prompt::Messages(_)) => return Err(wrong("a conversation")),
        (Api::Chat, Prompt::Text(text)) => {
            json!({ "messages": [{"role": "user", "content": text}] })
        }
        (Api::Chat, Prompt::Messages(messages)) => json!({ "messages": messages }),
        (Api::Chat, Prompt::Tokens(_)) => return Err(wrong("token ids")),
    };
    body["max_tokens"] = json!(item.max_tokens);
    body["temperature"] = json!(0);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    if let Some(model) = &target.model {
        body["model"] = json!(model);
    }
    if target.ignore_eos {
        body["ignore_eos"] = json!(true);
    }
    for (key, value) in &target.extra_body {
        body[key] = value.clone();
    }
    Ok(Bytes::from(body.to_string()))
}

/// One request's progress, kept outside its future so that a timeout keeps what was
/// measured before it.
#[derive(Debug, Default)]
pub(crate) struct Exchange {
    /// The response's status, once it came.
    pub(crate) status: Option<u16>,
    pub(crate) meter: StreamMeter,
    /// A failure before or outside the stream (connect, HTTP, an error status).
    pub(crate) failure: Option<Failure>,
}

/// Sends requests to one endpoint; shared by every request of a run.
#[derive(Debug)]
pub(crate) struct Client {
    endpoint: Endpoint,
    authorization: Option<HeaderValue>,
    /// Connections whose last response was read to its end.
    idle: Mutex<Vec<Connection>>,
    /// How long the rest of a body is read, after its stream has ended, to reuse its
    /// connection (the request's timeout).
    drain_within: Duration,
}

impl Client {
    pub(crate) fn new(target: &Target) -> Result<Client, LoadError> {
        let authorization = match &target.api_key {
            Some(key) => Some(
                HeaderValue::from_str(&format!("Bearer {key}"))
                    .map_err(|_| LoadError::BadApiKey)?,
            ),
            None => None,
        };
        Ok(Client {
            endpoint: Endpoint::parse(&target.url, target.api)?,
            authorization,
            idle: Mutex::new(Vec::new()),
            drain_within: target.request_timeout,
        })
    }

    fn request(&self, body: Bytes) -> Request<Full<Bytes>> {
        let mut request = Request::new(Full::new(body));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = self.endpoint.path.clone();
        let headers = request.headers_mut();
        headers.insert(HOST, self.endpoint.host.clone());
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(ACCEPT, HeaderValue::from_static("text/event-stream"));
        if let Some(auth) = &self.authorization {
            headers.insert(AUTHORIZATION, auth.clone());
        }
        request
    }

    /// An idle connection that is still open, if any.
    async fn idle_connection(&self) -> Option<Connection> {
        loop {
            let mut conn = self.idle.lock().ok()?.pop()?;
            if !conn.is_closed() && conn.ready().await.is_ok() {
                return Some(conn);
            }
        }
    }

    fn give_back(&self, conn: Connection) {
        if conn.is_closed() {
            return;
        }
        if let Ok(mut idle) = self.idle.lock() {
            idle.push(conn);
        }
    }

    async fn connect(&self) -> Result<Connection, Failure> {
        let stream = TcpStream::connect(&self.endpoint.addr)
            .await
            .map_err(|e| Failure::new("connect", format!("{}: {e}", self.endpoint.addr)))?;
        stream.set_nodelay(true).ok();
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| Failure::new("http", e))?;
        // Drives the connection; it ends when the server closes it or `sender` is dropped.
        tokio::spawn(conn);
        Ok(sender)
    }

    /// Sends `body` (sent at `sent`) and reads the stream to its end, filling `x`.
    pub(crate) async fn exchange(self: &Arc<Self>, body: Bytes, sent: Instant, x: &mut Exchange) {
        if let Err(failure) = self.exchange_inner(body, sent, x).await {
            x.failure = Some(failure);
        }
    }

    async fn exchange_inner(
        self: &Arc<Self>,
        body: Bytes,
        sent: Instant,
        x: &mut Exchange,
    ) -> Result<(), Failure> {
        let request = self.request(body);
        let (conn, response) = match self.idle_connection().await {
            Some(mut conn) => match conn.try_send_request(request).await {
                Ok(response) => (conn, response),
                // The server closed the idle connection before taking the request: send it
                // on a new one.
                Err(mut e) => match e.take_message() {
                    Some(request) => {
                        let mut conn = self.connect().await?;
                        let response = conn.send_request(request).await;
                        (conn, response.map_err(|e| Failure::new("http", e))?)
                    }
                    None => return Err(Failure::new("http", e.into_error())),
                },
            },
            None => {
                let mut conn = self.connect().await?;
                let response = conn.send_request(request).await;
                (conn, response.map_err(|e| Failure::new("http", e))?)
            }
        };
        let status = response.status();
        x.status = Some(status.as_u16());
        let mut body = response.into_body();
        if !status.is_success() {
            let text = match Limited::new(&mut body, MAX_ERROR_BODY_BYTES)
                .collect()
                .await
            {
                Ok(b) => String::from_utf8_lossy(&b.to_bytes()).into_owned(),
                Err(_) => String::new(),
            };
            if body.is_end_stream() {
                self.give_back(conn);
            }
            return Err(Failure::new(format!("http_{}", status.as_u16()), text));
        }
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| Failure::new("http", e))?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            if x.meter.feed(sent.elapsed(), &data) {
                break;
            }
        }
        // The rest of the body (the chunked encoding's end) frees the connection for reuse:
        // read it here if it is already in, else on the side, so the next request need not
        // wait for it.
        if body.is_end_stream() {
            self.give_back(conn);
        } else {
            let client = self.clone();
            tokio::spawn(async move {
                let drained = tokio::time::timeout(client.drain_within, drain(&mut body)).await;
                if matches!(drained, Ok(true)) {
                    client.give_back(conn);
                }
            });
        }
        Ok(())
    }
}

/// Reads `body` to its end; whether it ended cleanly.
async fn drain(body: &mut Incoming) -> bool {
    while let Some(frame) = body.frame().await {
        if frame.is_err() {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::Message;

    #[test]
    fn endpoints_from_base_urls() {
        let e = Endpoint::parse("http://127.0.0.1:8000", Api::Completions).unwrap();
        assert_eq!(e.addr, "127.0.0.1:8000");
        assert_eq!(e.host, "127.0.0.1:8000");
        assert_eq!(e.path, "/v1/completions");
        for url in ["http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1/"] {
            assert_eq!(Endpoint::parse(url, Api::Completions).unwrap(), e, "{url}");
        }
        let e = Endpoint::parse("http://localhost/mesh/v1", Api::Chat).unwrap();
        assert_eq!(e.addr, "localhost:80");
        assert_eq!(e.path, "/mesh/v1/chat/completions");
        for bad in [
            "https://127.0.0.1",
            "127.0.0.1:8000",
            "http://",
            "not a url",
        ] {
            assert!(
                matches!(
                    Endpoint::parse(bad, Api::Completions),
                    Err(LoadError::BadUrl { .. })
                ),
                "{bad}"
            );
        }
    }

    fn target(api: Api) -> Target {
        Target {
            url: "http://127.0.0.1:1".into(),
            api,
            model: None,
            api_key: None,
            ignore_eos: false,
            request_timeout: Duration::from_secs(1),
            extra_body: Default::default(),
        }
    }

    fn item(prompt: Prompt) -> WorkItem {
        WorkItem {
            prompt,
            max_tokens: 5,
            at: None,
            previous_turn: None,
            hash_ids: vec![],
        }
    }

    fn body(item_: &WorkItem, t: &Target) -> serde_json::Value {
        serde_json::from_slice(&request_body(0, item_, t).unwrap()).unwrap()
    }

    #[test]
    fn request_bodies() {
        let completions = target(Api::Completions);
        let b = body(&item(Prompt::Tokens(vec![3, 4])), &completions);
        assert_eq!(
            b,
            json!({"prompt": [3, 4], "max_tokens": 5, "temperature": 0, "stream": true,
                "stream_options": {"include_usage": true}})
        );
        let mut chat = Target {
            model: Some("m".into()),
            ignore_eos: true,
            ..target(Api::Chat)
        };
        let b = body(&item(Prompt::Text("hi".into())), &chat);
        assert_eq!(b["messages"], json!([{"role": "user", "content": "hi"}]));
        assert_eq!((&b["model"], &b["ignore_eos"]), (&json!("m"), &json!(true)));
        let extra = json!({"response_format": {"type": "json_object"}, "temperature": 0.7});
        let with_extra = Target {
            extra_body: extra.as_object().unwrap().clone(),
            ..chat.clone()
        };
        let b = body(&item(Prompt::Text("hi".into())), &with_extra);
        assert_eq!(b["response_format"], extra["response_format"]);
        assert_eq!(b["temperature"], json!(0.7), "the extra body wins");
        let conversation = vec![Message {
            role: "system".into(),
            content: "be brief".into(),
        }];
        let b = body(&item(Prompt::Messages(conversation)), &chat);
        assert_eq!(b["messages"][0]["role"], "system");

        let err = request_body(3, &item(Prompt::Tokens(vec![1])), &chat).unwrap_err();
        assert!(err.to_string().contains("item 3"), "{err}");
        chat.api = Api::Completions;
        let err = request_body(0, &item(Prompt::Messages(vec![])), &chat).unwrap_err();
        assert!(matches!(err, LoadError::PromptForApi { .. }), "{err}");
    }
}
