//! Overload protection over HTTP: admission control (the TTFT target and the bound on
//! requests in flight) and per-API-key rate limits answer 429 with `Retry-After` and an
//! OpenAI error body, count the refusals by reason, and let requests in again once the
//! load is gone.

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Request};
use common::*;
use kvmesh_common::{FinishReason, GenerateRequest};
use kvmesh_router::RouterConfig;
use serde_json::{json, Value};
use tokio::sync::{mpsc, Notify};

/// A completion body whose prompt is `tokens` bytes (one token each with the test
/// tokenizer), starting with `tag`.
fn completion(tag: &str, tokens: usize) -> Value {
    assert!(tag.len() <= tokens);
    let prompt = format!("{tag}{}", "x".repeat(tokens - tag.len()));
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 4})
}

fn starts_with(req: &GenerateRequest, tag: &str) -> bool {
    req.prompt
        .iter()
        .map(|&t| t as u8)
        .take(tag.len())
        .eq(tag.bytes())
}

/// A backend that answers "ok" at once, except: prompts starting with `slow` after 100 ms,
/// and prompts starting with `hold` only once `release` is notified. Every request is
/// announced on the returned channel when it reaches the backend.
fn backend(release: Arc<Notify>) -> (Arc<ScriptedBackend>, mpsc::UnboundedReceiver<()>) {
    let (arrived_tx, arrived) = mpsc::unbounded_channel();
    let backend = ScriptedBackend::new(Box::new(move |req| {
        let _ = arrived_tx.send(());
        let mut steps = Vec::new();
        if starts_with(req, "slow") {
            steps.push(Step::Sleep(Duration::from_millis(100)));
        }
        if starts_with(req, "hold") {
            steps.push(Step::WaitFor(release.clone()));
        }
        steps.extend(reply(req, "ok", FinishReason::Stop));
        Ok(steps)
    }));
    (backend, arrived)
}

fn assert_429(reply: &Reply, code: &str) -> u64 {
    let err = assert_error(reply, 429);
    assert_eq!(err["type"], "rate_limit_error");
    assert_eq!(err["code"], code);
    let retry: u64 = reply
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .unwrap();
    assert!(retry >= 1);
    retry
}

/// The value of `kvmesh_router_rejected_requests_total{reason="<reason>"}` (0 if absent).
async fn rejected(app: &axum::Router, reason: &str) -> f64 {
    let text = String::from_utf8(get(app, "/metrics").await.body).unwrap();
    let prefix = format!("kvmesh_router_rejected_requests_total{{reason=\"{reason}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0.0, |v| v.parse().unwrap())
}

#[tokio::test]
async fn a_request_that_would_break_the_ttft_target_is_refused_until_the_queue_drains() {
    let release = Arc::new(Notify::new());
    let (backend, mut arrived) = backend(release.clone());
    let config = RouterConfig {
        ttft_target: Duration::from_millis(200),
        ..config()
    };
    let app = router_with(&backend, config).app();

    // Calibration: 100 tokens took (at least) 100 ms, so about 1 ms per queued token.
    let r = post(&app, "/v1/completions", completion("slow", 100)).await;
    assert_eq!(r.status, 200);
    arrived.recv().await.unwrap();

    // 100 tokens wait for their first token...
    let held = {
        let app = app.clone();
        tokio::spawn(async move { post(&app, "/v1/completions", completion("hold", 100)).await })
    };
    arrived.recv().await.unwrap();
    // ...so 150 more would see about 250 ms: refused, told to come back in a second.
    let before = rejected(&app, "queue_delay").await;
    let refused = post(&app, "/v1/completions", completion("big", 150)).await;
    assert_eq!(assert_429(&refused, "overloaded"), 1);
    let message = assert_error(&refused, 429)["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(message.contains("target"), "{message}");
    assert!(rejected(&app, "queue_delay").await > before);
    // The refused request never reached the backend; a small one still fits the target.
    let small = post(&app, "/v1/completions", completion("s", 1)).await;
    assert_eq!(
        small.status,
        200,
        "{}",
        String::from_utf8_lossy(&small.body)
    );
    arrived.recv().await.unwrap();

    // Once the queue is empty the big one is admitted.
    release.notify_one();
    assert_eq!(held.await.unwrap().status, 200);
    let r = post(&app, "/v1/completions", completion("big", 150)).await;
    assert_eq!(r.status, 200);
    assert_eq!(backend.requests().len(), 4);
}

#[tokio::test]
async fn requests_in_flight_are_bounded() {
    let release = Arc::new(Notify::new());
    let (backend, mut arrived) = backend(release.clone());
    let config = RouterConfig {
        ttft_target: Duration::ZERO,
        max_in_flight: 2,
        ..config()
    };
    let app = router_with(&backend, config).app();
    let held: Vec<_> = (0..2)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { post(&app, "/v1/completions", completion("hold", 8)).await })
        })
        .collect();
    for _ in 0..2 {
        arrived.recv().await.unwrap();
    }
    let before = rejected(&app, "in_flight").await;
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let body = if path == "/v1/completions" {
            completion("x", 8)
        } else {
            chat_body("Hi")
        };
        let r = post(&app, path, body).await;
        assert_429(&r, "overloaded");
        let err = assert_error(&r, 429);
        assert!(
            err["message"].as_str().unwrap().contains("2 requests"),
            "{err}"
        );
    }
    assert_eq!(rejected(&app, "in_flight").await, before + 2.0);
    assert_eq!(backend.requests().len(), 2);
    // When full, requests are refused before their body is even parsed (shedding load
    // must cost little), so a bad one gets the 429 too.
    let bad = post(&app, "/v1/completions", json!({"prompt": "x", "n": 0})).await;
    assert_429(&bad, "overloaded");

    // One finishes: one slot is free again.
    release.notify_one();
    let done = futures::future::select_all(held).await;
    assert_eq!(done.0.unwrap().status, 200);
    let r = post(&app, "/v1/completions", completion("x", 8)).await;
    assert_eq!(r.status, 200);
    release.notify_one();
    for h in done.2 {
        assert_eq!(h.await.unwrap().status, 200);
    }
}

fn with_key(path: &str, key: &str, body: Value) -> Request<Body> {
    Request::post(path)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::AUTHORIZATION, format!("Bearer {key}"))
        .body(Body::from(body.to_string()))
        .unwrap()
}

#[tokio::test]
async fn each_api_key_has_its_own_rate_limit() {
    let backend = ScriptedBackend::replying("ok", FinishReason::Stop);
    let config = RouterConfig {
        api_keys: vec!["key-one".into(), "key-two".into()],
        rate_limit_per_second: 0.01,
        rate_limit_burst: 2,
        ..config()
    };
    let app = router_with(&backend, config).app();
    let before = rejected(&app, "rate_limit").await;
    for _ in 0..2 {
        let r = send(
            &app,
            with_key("/v1/chat/completions", "key-one", chat_body("Hi")),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    // The burst is spent; at 0.01/s the next token comes in 100 s.
    let r = send(
        &app,
        with_key("/v1/completions", "key-one", completion("x", 4)),
    )
    .await;
    assert_eq!(assert_429(&r, "rate_limit_exceeded"), 100);
    // (Other tests in this binary may add their own rate-limit refusals meanwhile.)
    assert!(rejected(&app, "rate_limit").await > before);
    // Another key is not affected, listing models is not limited, and a wrong key is still
    // a 401 (auth comes first).
    let r = send(
        &app,
        with_key("/v1/chat/completions", "key-two", chat_body("Hi")),
    )
    .await;
    assert_eq!(r.status, 200);
    let models = Request::get("/v1/models")
        .header(header::AUTHORIZATION, "Bearer key-one")
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&app, models).await.status, 200);
    let r = send(
        &app,
        with_key("/v1/completions", "key-three", completion("x", 4)),
    )
    .await;
    assert_error(&r, 401);
    assert_eq!(backend.requests().len(), 3);
}

#[tokio::test]
async fn without_keys_everyone_shares_one_rate_limit() {
    let backend = ScriptedBackend::replying("ok", FinishReason::Stop);
    let config = RouterConfig {
        rate_limit_per_second: 0.5,
        rate_limit_burst: 1,
        ..config()
    };
    let app = router_with(&backend, config).app();
    assert_eq!(
        post(&app, "/v1/chat/completions", chat_body("Hi"))
            .await
            .status,
        200
    );
    let r = post(&app, "/v1/chat/completions", chat_body("Hi")).await;
    assert_eq!(assert_429(&r, "rate_limit_exceeded"), 2);
}

#[tokio::test]
async fn a_burst_of_300_requests_queues_under_the_default_cap() {
    let release = Arc::new(Notify::new());
    let (backend, mut arrived) = backend(release.clone());
    let config = RouterConfig {
        ttft_target: Duration::ZERO,
        ..config()
    };
    assert!(
        config.max_in_flight >= 300,
        "the default cap refuses a burst"
    );
    let app = router_with(&backend, config).app();
    let burst: Vec<_> = (0..300)
        .map(|_| {
            let app = app.clone();
            tokio::spawn(async move { post(&app, "/v1/completions", completion("x", 8)).await })
        })
        .collect();
    // Every one reaches the backend while all are held: none was refused.
    for _ in 0..300 {
        arrived.recv().await.unwrap();
    }
    assert_eq!(rejected(&app, "in_flight").await, 0.0);
    for _ in 0..300 {
        release.notify_one();
    }
    for r in burst {
        assert_eq!(r.await.unwrap().status, 200);
    }
}
