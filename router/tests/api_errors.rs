//! Every failure a client can see: the bad-request table, auth, routing, body limits,
//! backend refusals and failures mid-stream, each with its status and an OpenAI error body.

mod common;

use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Request};
use common::*;
use kvmesh_common::{FinishReason, GenerateEvent, WorkerError};
use serde_json::json;

#[tokio::test]
async fn bad_requests_get_400_with_the_parameter_named() {
    let backend = ScriptedBackend::replying("x", FinishReason::Stop);
    let app = router(&backend).app();
    let long_prompt = "a".repeat(300);
    let with = |patch: serde_json::Value| {
        let mut body = chat_body("Hi");
        for (k, v) in patch.as_object().unwrap() {
            body[k] = v.clone();
        }
        body.to_string()
    };
    // (endpoint, raw body, expected param, expected code)
    let chat = "/v1/chat/completions";
    let cmpl = "/v1/completions";
    let cases: Vec<(&str, String, Option<&str>, &str)> = vec![
        (
            chat,
            r#"{"model": "test-model", "messages": ["#.into(),
            None,
            "invalid_json",
        ),
        (chat, "[]".into(), None, "invalid_json"),
        (chat, "".into(), None, "invalid_json"),
        (
            chat,
            with(json!({"temperature": "hot"})),
            Some("temperature"),
            "invalid_value",
        ),
        (
            chat,
            with(json!({"messages": "hi"})),
            Some("messages"),
            "invalid_value",
        ),
        (
            chat,
            with(json!({"stream": "yes"})),
            Some("stream"),
            "invalid_value",
        ),
        (
            chat,
            with(json!({"max_tokens": -5})),
            Some("max_tokens"),
            "invalid_value",
        ),
        (
            chat,
            with(json!({"max_completion_tokens": 0})),
            Some("max_completion_tokens"),
            "invalid_value",
        ),
        (
            chat,
            with(json!({"max_tokens": 129})),
            Some("max_tokens"),
            "invalid_value",
        ),
        (
            chat,
            with(json!({"max_tokens": 1.5})),
            Some("max_tokens"),
            "invalid_value",
        ),
        (
            chat,
            r#"{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}"#.into(),
            None,
            "invalid_json",
        ),
        (
            chat,
            with(json!({"temperature": 1e9})),
            Some("temperature"),
            "invalid_value",
        ),
        (
            chat,
            with(json!({"temperature": -1})),
            Some("temperature"),
            "invalid_value",
        ),
        (
            chat,
            with(json!({"top_p": 0})),
            Some("top_p"),
            "invalid_value",
        ),
        (
            chat,
            with(json!({"top_k": -3})),
            Some("top_k"),
            "invalid_value",
        ),
        (
            chat,
            with(json!({"presence_penalty": 3})),
            Some("presence_penalty"),
            "invalid_value",
        ),
        (
            chat,
            with(json!({"logit_bias": {"abc": 1}})),
            Some("logit_bias"),
            "invalid_value",
        ),
        (
            chat,
            with(json!({"logit_bias": {"1": 500}})),
            Some("logit_bias"),
            "invalid_value",
        ),
        (
            chat,
            with(json!({"stop_token_ids": [100000]})),
            Some("stop_token_ids"),
            "invalid_value",
        ),
        (
            chat,
            with(
                json!({"stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", "q"]}),
            ),
            Some("stop"),
            "invalid_value",
        ),
        (
            chat,
            with(json!({"stop": 5})),
            Some("stop"),
            "invalid_value",
        ),
        (chat, with(json!({"n": 0})), Some("n"), "invalid_value"),
        (chat, with(json!({"n": 5})), Some("n"), "invalid_value"),
        (
            chat,
            with(json!({"top_logprobs": 2})),
            Some("top_logprobs"),
            "invalid_value",
        ),
        (
            chat,
            with(json!({"logprobs": true, "top_logprobs": 21})),
            Some("top_logprobs"),
            "invalid_value",
        ),
        (
            chat,
            with(json!({"min_tokens": 40, "max_tokens": 10})),
            Some("min_tokens"),
            "invalid_value",
        ),
        (
            chat,
            with(json!({"model": "gpt-4"})),
            Some("model"),
            "model_not_found",
        ),
        (
            chat,
            with(json!({"messages": []})),
            Some("messages"),
            "invalid_value",
        ),
        (
            chat,
            json!({"model": "test-model"}).to_string(),
            Some("messages"),
            "invalid_value",
        ),
        (
            chat,
            with(json!({"messages": [{"role": "user"}]})),
            Some("messages[0].content"),
            "invalid_value",
        ),
        (
            chat,
            with(json!({"messages": [{"role": "wizard", "content": "x"}]})),
            Some("messages[0].role"),
            "invalid_value",
        ),
        (
            chat,
            with(json!({"messages": [{"role": "user", "content": "x", "foo": 1}]})),
            Some("messages[0].foo"),
            "unknown_parameter",
        ),
        (
            chat,
            with(
                json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            ),
            Some("messages[0].content[0].type"),
            "unsupported_parameter",
        ),
        (
            chat,
            with(json!({"messages": [{"role": "user", "content": long_prompt}]})),
            Some("messages"),
            "context_length_exceeded",
        ),
        (
            chat,
            with(
                json!({"max_tokens": 100, "messages": [{"role": "user", "content": "a".repeat(150)}]}),
            ),
            Some("max_tokens"),
            "context_length_exceeded",
        ),
        (
            chat,
            with(json!({"modalities": ["text", "audio"]})),
            Some("modalities"),
            "unsupported_parameter",
        ),
        (
            chat,
            with(json!({"web_search_options": {}})),
            Some("web_search_options"),
            "unsupported_parameter",
        ),
        (
            chat,
            with(json!({"tools": [{"type": "function"}]})),
            Some("tools[0]"),
            "invalid_value",
        ),
        (
            chat,
            with(json!({"tools": [{"type": "file_search"}]})),
            Some("tools[0].type"),
            "unsupported_parameter",
        ),
        (
            chat,
            with(json!({"response_format": {"type": "yaml"}})),
            Some("response_format"),
            "invalid_value",
        ),
        (
            chat,
            with(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}}),
            ),
            Some("response_format"),
            "invalid_value",
        ),
        (
            cmpl,
            json!({"prompt": "a", "response_format": {"type": "regex", "pattern": "("}})
                .to_string(),
            Some("response_format"),
            "invalid_value",
        ),
        (
            chat,
            with(json!({"stream_options": {"include_usage": true, "x": 1}})),
            Some("stream_options.x"),
            "unknown_parameter",
        ),
        (
            cmpl,
            json!({"prompt": long_prompt}).to_string(),
            Some("prompt"),
            "context_length_exceeded",
        ),
        (
            cmpl,
            json!({"prompt": "a".repeat(200), "max_tokens": 57}).to_string(),
            Some("max_tokens"),
            "context_length_exceeded",
        ),
        (
            cmpl,
            json!({"prompt": ""}).to_string(),
            Some("prompt"),
            "invalid_value",
        ),
        (
            cmpl,
            json!({"prompt": []}).to_string(),
            Some("prompt"),
            "invalid_value",
        ),
        (
            cmpl,
            json!({"prompt": [1, 99999]}).to_string(),
            Some("prompt"),
            "invalid_value",
        ),
        (
            cmpl,
            json!({"prompt": ["a", "b"]}).to_string(),
            Some("prompt"),
            "unsupported_parameter",
        ),
        (cmpl, json!({}).to_string(), Some("prompt"), "invalid_value"),
        (
            cmpl,
            json!({"prompt": "a", "suffix": "b"}).to_string(),
            Some("suffix"),
            "unsupported_parameter",
        ),
        (
            cmpl,
            json!({"prompt": "a", "best_of": 3}).to_string(),
            Some("best_of"),
            "unsupported_parameter",
        ),
        (
            cmpl,
            json!({"prompt": "a", "logprobs": -1}).to_string(),
            Some("logprobs"),
            "invalid_value",
        ),
        (
            cmpl,
            json!({"prompt": "a", "echo": true, "logprobs": 1}).to_string(),
            Some("echo"),
            "unsupported_parameter",
        ),
        (
            cmpl,
            json!({"prompt": "a", "max_tokens": -1}).to_string(),
            Some("max_tokens"),
            "invalid_value",
        ),
    ];
    for (path, body, param, code) in cases {
        let reply = send(&app, post_request(path, body.clone())).await;
        let err = assert_error(&reply, 400);
        assert_eq!(err["type"], "invalid_request_error", "{body}");
        assert_eq!(err["param"].as_str(), param, "{body}: {err}");
        assert_eq!(err["code"], code, "{body}: {err}");
    }
    assert!(
        backend.requests().is_empty(),
        "no bad request reaches the backend"
    );
}

#[tokio::test]
async fn oversized_body_is_413() {
    let backend = ScriptedBackend::replying("x", FinishReason::Stop);
    let app = router_with(
        &backend,
        kvmesh_router::RouterConfig {
            max_body_bytes: 4 << 20,
            ..config()
        },
    )
    .app();
    let big = json!({"prompt": "a".repeat(10 << 20)}).to_string();
    let err = assert_error(&send(&app, post_request("/v1/completions", big)).await, 413);
    assert_eq!(err["code"], "request_too_large");
    // Without a Content-Length (streamed body), the limit still holds.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        (0..10).map(|_| Ok(vec![b' '; 1 << 20])).collect();
    let req = Request::post("/v1/chat/completions")
        .body(Body::from_stream(futures::stream::iter(chunks)))
        .unwrap();
    assert_error(&send(&app, req).await, 413);
}

#[tokio::test]
async fn api_keys_are_required_when_configured() {
    let backend = ScriptedBackend::replying("x", FinishReason::Stop);
    let app = router_with(
        &backend,
        kvmesh_router::RouterConfig {
            api_keys: vec!["sk-one".into(), "sk-two".into()],
            ..config()
        },
    )
    .app();
    let with_auth = |auth: Option<&str>, path: &str| {
        let mut req = post_request(path, chat_body("Hi").to_string());
        if let Some(a) = auth {
            req.headers_mut()
                .insert(header::AUTHORIZATION, a.parse().unwrap());
        }
        req
    };
    for auth in [
        None,
        Some("Bearer sk-three"),
        Some("sk-one"),
        Some("Bearer "),
    ] {
        let reply = send(&app, with_auth(auth, "/v1/chat/completions")).await;
        let err = assert_error(&reply, 401);
        assert_eq!(err["code"], "invalid_api_key");
        assert!(
            !String::from_utf8_lossy(&reply.body).contains("sk-"),
            "keys never echoed"
        );
    }
    assert_error(&get(&app, "/v1/models").await, 401);
    let ok = send(
        &app,
        with_auth(Some("Bearer sk-two"), "/v1/chat/completions"),
    )
    .await;
    assert_eq!(ok.status, 200);
    // Health and metrics stay open; unknown routes are 404, not 401.
    assert_eq!(get(&app, "/health").await.status, 200);
    assert_eq!(get(&app, "/metrics").await.status, 200);
    assert_error(&get(&app, "/v1/nope").await, 404);
}

#[tokio::test]
async fn unknown_route_is_404_and_wrong_method_405() {
    let backend = ScriptedBackend::replying("x", FinishReason::Stop);
    let app = router(&backend).app();
    let err = assert_error(&get(&app, "/v2/chat").await, 404);
    assert_eq!(err["code"], "not_found");
    assert!(err["message"].as_str().unwrap().contains("/v2/chat"));
    let err = assert_error(&get(&app, "/v1/chat/completions").await, 405);
    assert_eq!(err["code"], "method_not_allowed");
    assert_error(&post(&app, "/health", json!({})).await, 405);
}

#[tokio::test]
async fn backend_refusals_map_to_429_503_400_500() {
    let cases = [
        (WorkerError::Overloaded("queue full".into()), 429, Some("3")),
        (WorkerError::Unavailable("draining".into()), 503, Some("3")),
        (
            WorkerError::InvalidRequest("prompt too long".into()),
            400,
            None,
        ),
        (WorkerError::Internal("boom".into()), 500, None),
    ];
    for (err, status, retry_after) in cases {
        let e = err.clone();
        let backend = ScriptedBackend::new(Box::new(move |_| Err(e.clone())));
        let app = router_with(
            &backend,
            kvmesh_router::RouterConfig {
                retry_after: Duration::from_millis(2500),
                ..config()
            },
        )
        .app();
        for stream in [false, true] {
            let mut body = chat_body("Hi");
            body["stream"] = json!(stream);
            let reply = post(&app, "/v1/chat/completions", body).await;
            let body = assert_error(&reply, status);
            assert_eq!(reply.header("retry-after"), retry_after, "{err:?}");
            assert!(body["message"]
                .as_str()
                .unwrap()
                .contains(&err.to_string()[err.to_string().find(": ").unwrap() + 2..]));
        }
    }
}

#[tokio::test]
async fn error_mid_stream_is_an_error_event_then_done() {
    let backend = ScriptedBackend::new(Box::new(|_| {
        Ok(vec![
            Step::Send(token(b'a')),
            Step::Send(GenerateEvent::Error(WorkerError::Internal(
                "gpu fell off".into(),
            ))),
        ])
    }));
    let app = router(&backend).app();
    let mut body = chat_body("Hi");
    body["stream"] = json!(true);
    let reply = post(&app, "/v1/chat/completions", body.clone()).await;
    assert_eq!(reply.status, 200);
    let chunks = reply.sse_json();
    let err = &chunks.last().unwrap()["error"];
    assert_eq!(err["type"], "server_error");
    assert_eq!(err["code"], "internal_error");
    assert!(err["message"].as_str().unwrap().contains("gpu fell off"));
    assert_eq!(chunks[1]["choices"][0]["delta"]["content"], "a");

    // The same failure without streaming is a plain 500.
    body["stream"] = json!(false);
    let reply = post(&app, "/v1/chat/completions", body).await;
    assert_eq!(assert_error(&reply, 500)["code"], "internal_error");
}

#[tokio::test]
async fn stream_closed_early_or_cancelled_by_backend_is_an_error() {
    // Closed without a final event.
    let backend = ScriptedBackend::new(Box::new(|_| Ok(vec![Step::Send(token(b'a'))])));
    let app = router(&backend).app();
    let reply = post(&app, "/v1/completions", json!({"prompt": "x"})).await;
    assert!(assert_error(&reply, 500)["message"]
        .as_str()
        .unwrap()
        .contains("closed the stream"));
    let chunks = post(
        &app,
        "/v1/completions",
        json!({"prompt": "x", "stream": true}),
    )
    .await
    .sse_json();
    assert_eq!(chunks.last().unwrap()["error"]["code"], "internal_error");

    // Finished(Cancelled): the backend aborted it.
    backend.set_script(Box::new(|req| {
        Ok(common::reply(req, "a", FinishReason::Cancelled))
    }));
    assert_error(
        &post(&app, "/v1/completions", json!({"prompt": "x"})).await,
        503,
    );
}

#[tokio::test]
async fn a_panicking_handler_is_a_500_with_the_request_id() {
    let backend = ScriptedBackend::new(Box::new(|_| Ok(vec![Step::Panic])));
    let app = router(&backend).app();
    let mut req = post_request("/v1/chat/completions", chat_body("Hi").to_string());
    req.headers_mut()
        .insert("x-request-id", "panic-test".parse().unwrap());
    let reply = send(&app, req).await;
    let err = assert_error(&reply, 500);
    assert_eq!(err["type"], "server_error");
    assert_eq!(reply.header("x-request-id"), Some("panic-test"));
    // The server keeps serving.
    backend.set_script(Box::new(|req| {
        Ok(common::reply(req, "ok", FinishReason::Stop))
    }));
    assert_eq!(
        post(&app, "/v1/chat/completions", chat_body("Hi"))
            .await
            .status,
        200
    );
}
