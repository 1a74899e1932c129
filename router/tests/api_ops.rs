//! Operations: health and draining, metrics, request ids, cancellation when the client goes
//! away (in-process and over a real socket), and graceful shutdown.

mod common;

use std::time::Duration;

use common::*;
use http_body_util::BodyExt;
use kvmesh_common::FinishReason;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower::ServiceExt;

const WAIT: Duration = Duration::from_secs(5);

#[tokio::test]
async fn health_follows_backend_readiness_and_draining() {
    let backend = ScriptedBackend::replying("x", FinishReason::Stop);
    let router = router(&backend);
    let app = router.app();
    let reply = get(&app, "/health").await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.json(), json!({"status": "ok"}));

    router.set_draining(true);
    assert!(router.is_draining());
    let reply = get(&app, "/health").await;
    assert_eq!(reply.status, 503);
    assert_eq!(reply.json(), json!({"status": "draining"}));
    // Requests that still arrive while draining are served.
    assert_eq!(
        post(&app, "/v1/chat/completions", chat_body("Hi"))
            .await
            .status,
        200
    );
    router.set_draining(false);
    assert_eq!(get(&app, "/health").await.status, 200);

    backend
        .ready
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let reply = get(&app, "/health").await;
    assert_eq!(reply.status, 503);
    assert_eq!(reply.json(), json!({"status": "not_ready"}));
}

#[tokio::test]
async fn the_openapi_document_describes_every_route() {
    let backend = ScriptedBackend::replying("abc", FinishReason::Stop);
    let app = router(&backend).app();
    let reply = get(&app, "/openapi.json").await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("content-type"), Some("application/json"));
    let doc = reply.json();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    for (path, method) in [
        ("/v1/chat/completions", "post"),
        ("/v1/completions", "post"),
        ("/v1/models", "get"),
        ("/health", "get"),
        ("/metrics", "get"),
        ("/openapi.json", "get"),
        ("/tokenize", "post"),
        ("/detokenize", "post"),
    ] {
        assert!(doc["paths"][path][method].is_object(), "{method} {path}");
        // And the route exists: anything but 404.
        let status = if method == "get" {
            get(&app, path).await.status
        } else {
            post(&app, path, json!({})).await.status
        };
        assert_ne!(status, 404, "{method} {path}");
    }
    // Every $ref resolves inside the document.
    fn refs(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                if let Some(serde_json::Value::String(r)) = m.get("$ref") {
                    out.push(r.clone());
                }
                m.values().for_each(|v| refs(v, out));
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| refs(v, out)),
            _ => {}
        }
    }
    let mut all = Vec::new();
    refs(&doc, &mut all);
    assert!(!all.is_empty());
    for r in all {
        let pointer = r.strip_prefix('#').expect("a local $ref");
        assert!(doc.pointer(pointer).is_some(), "dangling $ref {r}");
    }
}

#[tokio::test]
async fn metrics_are_exposed_in_prometheus_text() {
    let backend = ScriptedBackend::replying("abc", FinishReason::Stop);
    let app = router(&backend).app();
    assert_eq!(
        post(&app, "/v1/chat/completions", chat_body("Hi"))
            .await
            .status,
        200
    );
    assert_eq!(
        post(
            &app,
            "/v1/completions",
            json!({"prompt": "x", "temperature": 9})
        )
        .await
        .status,
        400
    );
    let reply = get(&app, "/metrics").await;
    assert_eq!(reply.status, 200);
    assert!(reply
        .header("content-type")
        .unwrap()
        .starts_with("text/plain"));
    let text = String::from_utf8(reply.body.clone()).unwrap();
    use kvmesh_common::metrics as m;
    for name in [
        m::ROUTER_REQUESTS_TOTAL,
        m::ROUTER_TTFT_SECONDS,
        m::ROUTER_ITL_SECONDS,
        m::ROUTER_E2E_SECONDS,
        m::ROUTER_PROMPT_TOKENS_TOTAL,
        m::ROUTER_GENERATION_TOKENS_TOTAL,
        m::ROUTER_REQUESTS_IN_FLIGHT,
    ] {
        assert!(
            text.contains(&format!("# HELP {name} ")),
            "{name} missing:\n{text}"
        );
    }
    assert!(
        text.contains(r#"kvmesh_router_requests_total{endpoint="chat_completions",status="200"}"#),
        "{text}"
    );
    assert!(
        text.contains(r#"kvmesh_router_requests_total{endpoint="completions",status="400"}"#),
        "{text}"
    );
    // Shedding is exported at 0 for every reason before any request is refused.
    for reason in [
        "queue_delay",
        "in_flight",
        "rate_limit",
        "backend_overloaded",
    ] {
        assert!(
            text.contains(&format!(
                r#"kvmesh_router_rejected_requests_total{{reason="{reason}"}} 0"#
            )),
            "no {reason}:\n{text}"
        );
    }
    let count = |metric: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(metric).and_then(|v| v.trim().parse().ok()))
            .unwrap_or(0.0)
    };
    assert!(count("kvmesh_router_ttft_seconds_count") >= 1.0);
    assert!(count("kvmesh_router_inter_token_latency_seconds_count") >= 2.0);
    assert!(count("kvmesh_router_generation_tokens_total") >= 3.0);
    assert!(count("kvmesh_router_prompt_tokens_total") >= 1.0);
    // The recorder is the process's, so worker metrics recorded anywhere in it land in the
    // same output.
    metrics::counter!("kvmesh_test_recorded_elsewhere_total").increment(1);
    let reply = get(&app, "/metrics").await;
    let text = String::from_utf8(reply.body.clone()).unwrap();
    assert!(
        text.contains("kvmesh_test_recorded_elsewhere_total 1"),
        "{text}"
    );
}

#[tokio::test]
async fn request_ids_are_echoed_or_generated() {
    let backend = ScriptedBackend::replying("x", FinishReason::Stop);
    let app = router(&backend).app();
    let with_id = |id: &str| {
        let mut req = post_request("/v1/chat/completions", chat_body("Hi").to_string());
        req.headers_mut()
            .insert("x-request-id", id.parse().unwrap());
        req
    };
    let reply = send(&app, with_id("client-id-1")).await;
    assert_eq!(reply.header("x-request-id"), Some("client-id-1"));
    // The same client id twice still gives the backend two distinct request ids.
    send(&app, with_id("client-id-1")).await;
    let reqs = backend.requests();
    assert_ne!(reqs[0].request_id, reqs[1].request_id);

    let too_long = "a".repeat(129);
    let generated = send(&app, with_id(&too_long)).await;
    let id = generated.header("x-request-id").unwrap();
    assert_ne!(id, too_long);
    assert_eq!(id.len(), 16);
    assert!(id.bytes().all(|b| b.is_ascii_hexdigit()));

    let none = get(&app, "/v1/nope").await;
    assert_eq!(none.status, 404);
    assert!(none.header("x-request-id").is_some());
}

fn streaming_forever() -> std::sync::Arc<ScriptedBackend> {
    ScriptedBackend::new(Box::new(|_| {
        Ok(vec![
            Step::Send(token(b'a')),
            Step::TokensUntilClosed {
                every: Duration::from_millis(10),
                max: 2000,
            },
        ])
    }))
}

#[tokio::test]
async fn dropping_the_stream_drops_the_backend_receivers() {
    let backend = streaming_forever();
    let app = router(&backend).app();
    let mut body = chat_body("Hi");
    body["stream"] = json!(true);
    body["n"] = json!(2);
    let resp = app
        .clone()
        .oneshot(post_request("/v1/chat/completions", body.to_string()))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(first.data_ref().unwrap()).starts_with("data: "));
    assert_eq!(backend.cancelled(), 0);
    drop(body);
    assert!(
        backend.wait_cancelled(2, WAIT).await,
        "both choices cancelled"
    );

    let text = String::from_utf8(get(&app, "/metrics").await.body).unwrap();
    assert!(
        text.contains(r#"kvmesh_router_requests_total{endpoint="chat_completions",status="499"}"#),
        "{text}"
    );
}

#[tokio::test]
async fn dropping_a_non_streaming_request_cancels_it() {
    let backend = streaming_forever();
    let app = router(&backend).app();
    let fut = app.oneshot(post_request(
        "/v1/completions",
        json!({"prompt": "x"}).to_string(),
    ));
    assert!(tokio::time::timeout(Duration::from_millis(100), fut)
        .await
        .is_err());
    assert!(backend.wait_cancelled(1, WAIT).await);
}

fn raw_request(path: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Reads from `sock` until `needle` shows up (bounded).
async fn read_until(sock: &mut TcpStream, needle: &str) -> String {
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    tokio::time::timeout(WAIT, async {
        while !String::from_utf8_lossy(&seen).contains(needle) {
            let n = sock.read(&mut buf).await.unwrap();
            assert!(n > 0, "connection closed before {needle:?}");
            seen.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no {needle:?} in {}", String::from_utf8_lossy(&seen)));
    String::from_utf8_lossy(&seen).into_owned()
}

#[tokio::test]
async fn a_client_closing_its_socket_cancels_the_backend() {
    let backend = streaming_forever();
    let router = router(&backend);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(router.serve(listener, async {
        let _ = stop_rx.await;
    }));

    let mut sock = TcpStream::connect(addr).await.unwrap();
    let mut body = chat_body("Hi");
    body["stream"] = json!(true);
    sock.write_all(raw_request("/v1/chat/completions", &body.to_string()).as_bytes())
        .await
        .unwrap();
    let head = read_until(&mut sock, "data: ").await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase().contains("x-request-id: "),
        "{head}"
    );
    drop(sock);
    assert!(
        backend.wait_cancelled(1, WAIT).await,
        "backend saw the receiver dropped"
    );

    stop_tx.send(()).unwrap();
    tokio::time::timeout(WAIT, server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn graceful_shutdown_finishes_in_flight_streams() {
    let backend = ScriptedBackend::new(Box::new(|req| {
        let mut steps = vec![
            Step::Send(token(b'a')),
            Step::Sleep(Duration::from_millis(300)),
        ];
        steps.extend(reply(req, "bc", FinishReason::Stop));
        Ok(steps)
    }));
    let router = router(&backend);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(router.clone().serve(listener, async {
        let _ = stop_rx.await;
    }));

    let mut sock = TcpStream::connect(addr).await.unwrap();
    let mut body = chat_body("Hi");
    body["stream"] = json!(true);
    sock.write_all(raw_request("/v1/chat/completions", &body.to_string()).as_bytes())
        .await
        .unwrap();
    read_until(&mut sock, "data: ").await;
    stop_tx.send(()).unwrap();
    // The in-flight stream still runs to its end.
    let rest = read_until(&mut sock, "data: [DONE]").await;
    assert!(rest.contains("\"finish_reason\":\"stop\""), "{rest}");
    tokio::time::timeout(WAIT, server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(router.is_draining());
    assert_eq!(backend.cancelled(), 0);
    // No longer accepting.
    assert!(TcpStream::connect(addr).await.is_err());
}

#[tokio::test]
async fn shutdown_timeout_drops_streams_that_do_not_end() {
    let backend = streaming_forever();
    let router = router_with(
        &backend,
        kvmesh_router::RouterConfig {
            shutdown_timeout: Duration::from_millis(200),
            ..config()
        },
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(router.serve(listener, async {
        let _ = stop_rx.await;
    }));
    let mut sock = TcpStream::connect(addr).await.unwrap();
    let mut body = chat_body("Hi");
    body["stream"] = json!(true);
    sock.write_all(raw_request("/v1/chat/completions", &body.to_string()).as_bytes())
        .await
        .unwrap();
    read_until(&mut sock, "data: ").await;
    stop_tx.send(()).unwrap();
    // The client gets an error event and [DONE], not a cut connection.
    let rest = read_until(&mut sock, "data: [DONE]").await;
    assert!(rest.contains("shutting down"), "{rest}");
    tokio::time::timeout(WAIT, server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(backend.wait_cancelled(1, WAIT).await);
}
