//! `replay` against a stub of the router's `/v1/completions`: SSE chunks shaped like the
//! router's, a usage chunk with `cached_tokens`, a 429, an error event mid-stream.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use futures::StreamExt;
use kvmesh_bench::{replay, LoadError, ReplayOptions, ScaledRequest};
use serde_json::{json, Value};

/// The stub waits this long before its first chunk.
const FIRST_CHUNK_DELAY: Duration = Duration::from_millis(60);
/// `max_tokens` values that make the stub fail.
const REFUSE: u32 = 7;
const FAIL_MID_STREAM: u32 = 9;

type Seen = Arc<Mutex<Vec<Value>>>;

fn chunk(choices: Value, usage: Value) -> Event {
    Event::default().data(
        json!({
            "id": "cmpl-0000000000000001",
            "object": "text_completion",
            "created": 1,
            "model": "stub",
            "choices": choices,
            "usage": usage,
        })
        .to_string(),
    )
}

async fn completions(State(seen): State<Seen>, Json(body): Json<Value>) -> Response {
    seen.lock().unwrap().push(body.clone());
    let prompt = body["prompt"].as_array().map_or(0, Vec::len) as u64;
    let max_tokens = body["max_tokens"].as_u64().unwrap_or(1);
    let error = |message: &str| json!({"error": {"message": message, "type": "overloaded", "param": null, "code": 429}});
    if max_tokens == u64::from(REFUSE) {
        let mut r = (StatusCode::TOO_MANY_REQUESTS, Json(error("busy"))).into_response();
        r.headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        return r;
    }
    let mut events: Vec<Event> = (0..max_tokens)
        .map(|i| {
            let finish = if i + 1 == max_tokens {
                json!("length")
            } else {
                Value::Null
            };
            chunk(
                json!([{"index": 0, "text": "a", "logprobs": null, "finish_reason": finish}]),
                Value::Null,
            )
        })
        .collect();
    if max_tokens == u64::from(FAIL_MID_STREAM) {
        events.truncate(1);
        events.push(Event::default().data(error("node lost").to_string()));
    } else {
        events.push(chunk(
            json!([]),
            json!({
                "prompt_tokens": prompt,
                "completion_tokens": max_tokens,
                "total_tokens": prompt + max_tokens,
                "prompt_tokens_details": {"cached_tokens": prompt / 2},
            }),
        ));
    }
    events.push(Event::default().data("[DONE]"));
    let stream = futures::stream::iter(events.into_iter().enumerate()).then(|(i, e)| async move {
        if i == 0 {
            tokio::time::sleep(FIRST_CHUNK_DELAY).await;
        }
        Ok::<_, Infallible>(e)
    });
    Sse::new(stream).into_response()
}

/// Serves the stub on a free loopback port; returns its base URL and the bodies it saw.
async fn stub() -> (String, Seen) {
    let seen = Seen::default();
    let app = Router::new()
        .route("/v1/completions", post(completions))
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, seen)
}

fn request(at_ms: u64, prompt_len: u32, max_tokens: u32, hash_ids: &[u64]) -> ScaledRequest {
    ScaledRequest {
        at: Duration::from_millis(at_ms),
        prompt_tokens: (1000..1000 + prompt_len).collect(),
        max_tokens,
        hash_ids: hash_ids.to_vec(),
        previous_turn: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_ttft_hit_rate_and_errors() {
    let (url, seen) = stub().await;
    let requests = vec![
        request(0, 10, 3, &[1]),
        request(10, 20, 4, &[1, 2]),
        request(20, 8, REFUSE, &[3]),
        request(30, 6, FAIL_MID_STREAM, &[1]),
    ];
    let report = replay(&url, "stub", &requests, &ReplayOptions::default())
        .await
        .unwrap();

    assert_eq!((report.requests, report.completed), (4, 2), "{report:#?}");
    assert_eq!(report.errors.get("http_429"), Some(&1), "{report:#?}");
    assert_eq!(report.errors.get("stream_error"), Some(&1), "{report:#?}");
    assert_eq!(report.failed(), 2);
    assert!(report.error_examples["http_429"].contains("busy"));
    assert!(report.error_examples["stream_error"].contains("node lost"));
    // Usage of the two completed requests: 5 of 10 and 10 of 20 prompt tokens cached.
    assert_eq!((report.prompt_tokens, report.cached_tokens), (30, 15));
    assert_eq!(report.prefix_hit_rate, 0.5);
    assert_eq!(report.output_tokens, 7);
    // Blocks [1] [1 2] [3] [1]: 2 of 5 seen before.
    assert!((report.ideal_hit_rate - 0.4).abs() < 1e-12);
    let (ttft, e2e) = (report.ttft_p50_s.unwrap(), report.e2e_p99_s.unwrap());
    assert!(ttft >= FIRST_CHUNK_DELAY.as_secs_f64(), "{report:#?}");
    assert!(ttft < 5.0 && ttft <= e2e, "{report:#?}");
    assert!(report.duration_s >= 0.03 + FIRST_CHUNK_DELAY.as_secs_f64());
    assert!(report.output_tokens_per_s > 0.0 && report.request_rate > 0.0);
    assert!((report.offered_rate - 100.0).abs() < 1e-6, "{report:#?}");
    assert_eq!(report.waited_for_concurrency, 0);

    // What went over the wire: token ids, streaming with usage, greedy.
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 4);
    let first = seen
        .iter()
        .find(|b| b["max_tokens"] == 3)
        .expect("the first request");
    assert_eq!(first["prompt"], json!((1000..1010).collect::<Vec<u32>>()));
    assert_eq!(first["model"], "stub");
    assert_eq!(first["stream"], true);
    assert_eq!(first["stream_options"]["include_usage"], true);
    assert_eq!(first["temperature"], 0);
    assert_eq!(first["ignore_eos"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_concurrency_cap_holds_requests_back() {
    let (url, _) = stub().await;
    let requests: Vec<_> = (0..3).map(|i| request(0, 4, 2, &[i])).collect();
    let opts = ReplayOptions {
        max_concurrency: 1,
        ..ReplayOptions::default()
    };
    let report = replay(&url, "stub", &requests, &opts).await.unwrap();
    assert_eq!(report.completed, 3, "{report:#?}");
    assert_eq!(report.waited_for_concurrency, 2);
    // One at a time: the run lasts at least three first-chunk delays.
    assert!(report.duration_s >= 3.0 * FIRST_CHUNK_DELAY.as_secs_f64());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follow_up_is_sent_only_once_the_turn_it_follows_has_ended() {
    let (url, _) = stub().await;
    // The follow-up is due with the first turn, 60 ms before that turn's first chunk; the
    // third request belongs to no conversation.
    let mut requests = vec![
        request(0, 4, 3, &[1, 2]),
        request(0, 8, 2, &[1, 2, 3]),
        request(0, 4, 2, &[4, 5]),
    ];
    requests[1].previous_turn = Some(0);
    let report = replay(&url, "stub", &requests, &ReplayOptions::default())
        .await
        .unwrap();
    assert_eq!((report.completed, report.held_for_previous_turn), (3, 1));
    let of = |item| report.per_request.iter().find(|o| o.item == item).unwrap();
    assert!(of(1).sent >= of(0).ended, "{report:#?}");

    let open_loop = ReplayOptions {
        follow_turns: false,
        ..ReplayOptions::default()
    };
    let report = replay(&url, "stub", &requests, &open_loop).await.unwrap();
    assert_eq!((report.completed, report.held_for_previous_turn), (3, 0));
    let of = |item| report.per_request.iter().find(|o| o.item == item).unwrap();
    assert!(of(1).sent < of(0).ended, "{report:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_routers_and_bad_urls() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let requests = vec![request(0, 4, 2, &[1]), request(0, 4, 2, &[1])];
    let report = replay(&url, "stub", &requests, &ReplayOptions::default())
        .await
        .unwrap();
    assert_eq!(report.completed, 0);
    assert_eq!(report.errors.get("connect"), Some(&2), "{report:#?}");
    assert_eq!(report.ttft_p50_s, None);

    let err = replay(
        "https://127.0.0.1:1",
        "stub",
        &requests,
        &ReplayOptions::default(),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, LoadError::BadUrl { .. }), "{err}");
}
