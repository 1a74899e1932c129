//! Bad input, generated: random JSON, request-shaped bodies with fields of the wrong type,
//! mutated bytes (invalid UTF-8, control characters, truncation), and a fixed set of
//! adversarial bodies (100k-deep nesting, huge numbers, enormous stop lists and prompts,
//! oversized and chunked bodies). Every answer must be a success or a 4xx with an OpenAI
//! error body, never a 5xx, and the server must stay healthy.

mod common;

use std::sync::LazyLock;

use axum::body::{Body, Bytes};
use axum::http::{header, Request};
use common::*;
use kvmesh_common::FinishReason;
use kvmesh_router::RouterConfig;
use proptest::prelude::*;
use serde_json::{json, Map, Value};

const PATHS: [&str; 2] = ["/v1/chat/completions", "/v1/completions"];
const MAX_BODY: usize = 1 << 20;

static RUNTIME: LazyLock<tokio::runtime::Runtime> = LazyLock::new(|| {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
});

/// One router for every case (so state left behind by one case is seen by the next). The
/// body limit is large enough for deep nesting to reach the JSON parser.
static APP: LazyLock<axum::Router> = LazyLock::new(|| {
    let backend = ScriptedBackend::replying("ok", FinishReason::Stop);
    let config = RouterConfig {
        max_body_bytes: MAX_BODY,
        ..config()
    };
    router_with(&backend, config).app()
});

/// Posts `body` at `path` and checks the answer: 200, or a 4xx with an OpenAI error body.
fn check(path: &str, body: impl Into<Body>) -> Reply {
    let req = Request::post(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body.into())
        .unwrap();
    let reply = RUNTIME.block_on(send(&APP, req));
    assert_sane(path, &reply);
    reply
}

fn assert_sane(path: &str, reply: &Reply) {
    let status = reply.status.as_u16();
    let text = || String::from_utf8_lossy(&reply.body[..reply.body.len().min(500)]).into_owned();
    assert!(
        status == 200 || (400..500).contains(&status),
        "{path}: status {status}: {}",
        text()
    );
    if status != 200 {
        let body: Value = serde_json::from_slice(&reply.body)
            .unwrap_or_else(|e| panic!("{path}: {status} without a JSON body ({e}): {}", text()));
        let err = &body["error"];
        assert!(
            err["message"].is_string() && err["type"].is_string(),
            "{path}: {status}: not an OpenAI error body: {body}"
        );
        assert!(
            err.get("param").is_some() && err.get("code").is_some(),
            "{body}"
        );
    }
}

fn assert_healthy() {
    let reply = RUNTIME.block_on(get(&APP, "/health"));
    assert_eq!(reply.status, 200);
}

/// Field names of both endpoints, plus a few unknown ones, so generated objects often hit
/// real parameters with the wrong type or value.
const FIELDS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "best_of",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "ignore_eos",
    "min_tokens",
    "logprobs",
    "top_logprobs",
    "echo",
    "user",
    "response_format",
    "parallel_tool_calls",
    "tools",
    "suffix",
    "role",
    "content",
    "type",
    "text",
    "include_usage",
    "",
    "\u{0}",
];

fn field() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => proptest::sample::select(FIELDS).prop_map(str::to_string),
        1 => any::<String>(),
    ]
}

/// Any JSON value, a few levels deep, with interesting numbers and strings.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from), // NaN and infinities become null
        prop_oneof![
            Just(0.0),
            Just(-0.0),
            Just(1e-300),
            Just(3.5e38),
            Just(f64::MAX),
            Just(2.0),
            Just(-1.0)
        ]
        .prop_map(Value::from),
        (-3i64..300).prop_map(Value::from),
        any::<String>().prop_map(Value::String),
        proptest::sample::select(vec![
            "SmolLM2",
            MODEL,
            "user",
            "assistant",
            "system",
            "tool",
            "text",
            "image_url",
            "<|im_end|>",
            "<|im_start|>",
            "\u{0}",
            "\u{F0000}0\u{F0001}",
            "{{ raise_exception('x') }}",
        ])
        .prop_map(|s| Value::String(s.to_string())),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::vec((field(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// A plausible request with some fields replaced, added or removed.
fn request_like() -> impl Strategy<Value = Value> {
    let base = prop_oneof![
        Just(
            json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
        ),
        Just(json!({"model": MODEL, "prompt": "Once", "max_tokens": 3, "stream": true})),
        Just(json!({"prompt": [1, 2, 3], "n": 2, "logprobs": 2})),
        Just(
            json!({"messages": [{"role": "system", "content": [{"type": "text", "text": "x"}]},
                                 {"role": "user", "content": "y"}], "stream": true,
                    "stream_options": {"include_usage": true}})
        ),
    ];
    (
        base,
        proptest::collection::vec((field(), json_value()), 0..4),
        proptest::collection::vec(field(), 0..2),
    )
        .prop_map(|(mut base, set, remove)| {
            let map = base.as_object_mut().unwrap();
            for (k, v) in set {
                map.insert(k, v);
            }
            for k in remove {
                map.remove(&k);
            }
            base
        })
}

/// Byte-level damage to a serialized body.
#[derive(Debug, Clone)]
enum Mutation {
    Insert(usize, Vec<u8>),
    Overwrite(usize, u8),
    Truncate(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let bytes = prop_oneof![
        // Invalid UTF-8: lone continuation bytes, truncated sequences, overlongs, 0xff.
        proptest::sample::select(vec![
            vec![0xff],
            vec![0x80],
            vec![0xc3],
            vec![0xe2, 0x82],
            vec![0xc0, 0xaf],
            vec![0xed, 0xa0, 0x80],
            vec![0xf4, 0x90, 0x80, 0x80],
        ]),
        // Raw control characters and escapes that look dangerous.
        proptest::collection::vec(0u8..0x20, 1..4),
        proptest::sample::select(vec![
            b"\\u0000".to_vec(),
            b"\\ud800".to_vec(),
            b"\\udfff\\ud800".to_vec(),
            b"\\".to_vec(),
            b"\"".to_vec(),
            b"1e400".to_vec(),
            b"-".to_vec(),
            b"\xef\xbb\xbf".to_vec(),
        ]),
        proptest::collection::vec(any::<u8>(), 1..8),
    ];
    prop_oneof![
        (any::<usize>(), bytes).prop_map(|(at, b)| Mutation::Insert(at, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(at, b)| Mutation::Overwrite(at, b)),
        any::<usize>().prop_map(Mutation::Truncate),
    ]
}

fn apply(mut body: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
    for m in mutations {
        match m {
            Mutation::Insert(at, bytes) => {
                let at = at % (body.len() + 1);
                body.splice(at..at, bytes.iter().copied());
            }
            Mutation::Overwrite(at, b) if !body.is_empty() => {
                let at = at % body.len();
                body[at] = *b;
            }
            Mutation::Overwrite(..) => {}
            Mutation::Truncate(at) => {
                let at = at % (body.len() + 1);
                body.truncate(at);
            }
        }
    }
    body
}

proptest! {
    // 256 cases each unless PROPTEST_CASES says otherwise.
    #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_json_gets_a_clean_answer(body in json_value(), chat in any::<bool>()) {
        check(PATHS[usize::from(chat)], body.to_string());
    }

    #[test]
    fn request_shaped_bodies_with_wrong_fields_get_a_clean_answer(
        body in request_like(),
        chat in any::<bool>(),
    ) {
        check(PATHS[usize::from(chat)], body.to_string());
    }

    #[test]
    fn damaged_bytes_get_a_clean_answer(
        body in request_like(),
        mutations in proptest::collection::vec(mutation(), 1..4),
        chat in any::<bool>(),
    ) {
        let bytes = apply(body.to_string().into_bytes(), &mutations);
        check(PATHS[usize::from(chat)], bytes);
    }

    #[test]
    fn arbitrary_bytes_get_a_clean_answer(
        bytes in proptest::collection::vec(any::<u8>(), 0..256),
        chat in any::<bool>(),
    ) {
        check(PATHS[usize::from(chat)], bytes);
    }
}

/// `{"<field>": <value text>}` for both endpoints, with the other required field valid.
fn with_raw(field: &str, raw: &str) -> [(&'static str, String); 2] {
    [
        (
            PATHS[0],
            format!(r#"{{"messages": [{{"role": "user", "content": "Hi"}}], "{field}": {raw}}}"#),
        ),
        (PATHS[1], format!(r#"{{"prompt": "Hi", "{field}": {raw}}}"#)),
    ]
}

#[test]
fn huge_and_odd_numbers_in_every_numeric_field() {
    let long_int = format!("1{}", "0".repeat(5000));
    let long_fraction = format!("0.{}1", "0".repeat(5000));
    let numbers = [
        "1e400",
        "-1e400",
        "1e-400",
        "123456789012345678901234567890",
        "-123456789012345678901234567890",
        "18446744073709551616",
        "9223372036854775808",
        "-9223372036854775809",
        "4294967296",
        "-0",
        "0.5",
        "3.4028236e38",
        "1e39",
        long_int.as_str(),
        long_fraction.as_str(),
    ];
    let fields = [
        "max_tokens",
        "max_completion_tokens",
        "n",
        "best_of",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "logprobs",
        "top_logprobs",
    ];
    for field in fields {
        for n in numbers {
            for (path, body) in with_raw(field, n) {
                check(path, body);
            }
        }
    }
    for n in numbers {
        check(PATHS[1], format!(r#"{{"prompt": [{n}]}}"#));
        check(PATHS[1], format!(r#"{{"prompt": [[1, {n}]]}}"#));
        for (path, body) in with_raw("stop_token_ids", &format!("[{n}]")) {
            check(path, body);
        }
        for (path, body) in with_raw("logit_bias", &format!(r#"{{"5": {n}}}"#)) {
            check(path, body);
        }
        for (path, body) in with_raw("logit_bias", &format!(r#"{{"{n}": 1}}"#)) {
            check(path, body);
        }
    }
    assert_healthy();
}

#[test]
fn deep_nesting_is_refused_without_a_stack_overflow() {
    let depth = 100_000;
    let arrays = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
    let objects = format!("{}1{}", r#"{"a":"#.repeat(depth), "}".repeat(depth));
    let unclosed = "[".repeat(depth);
    for nested in [&arrays, &objects, &unclosed] {
        for path in PATHS {
            assert_eq!(check(path, nested.clone()).status, 400);
        }
        for field in [
            "prompt",
            "messages",
            "stop",
            "logit_bias",
            "stream_options",
            "model",
        ] {
            for (path, body) in with_raw(field, nested) {
                assert_eq!(check(path, body).status, 400, "{field}");
            }
        }
        let content = format!(r#"{{"messages": [{{"role": "user", "content": {nested}}}]}}"#);
        assert_eq!(check(PATHS[0], content).status, 400);
    }
    assert_healthy();
}

#[test]
fn enormous_lists_and_strings_are_refused_or_bounded() {
    let many = |item: &str, count: usize| format!("[{}]", vec![item; count].join(","));
    let cases: Vec<(&str, String)> = vec![
        ("stop", many(r#""a""#, 100_000)),
        ("stop", format!(r#""{}""#, "a".repeat(500_000))),
        ("stop", many(&format!(r#""{}""#, "ab".repeat(30_000)), 10)),
        ("stop_token_ids", many("1", 100_000)),
        (
            "logit_bias",
            format!(
                "{{{}}}",
                (0..50_000)
                    .map(|i| format!(r#""{i}": 1"#))
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        ),
        (
            "messages",
            many(r#"{"role": "user", "content": "Hi"}"#, 20_000),
        ),
        ("prompt", format!(r#""{}""#, "word ".repeat(150_000))),
        ("prompt", many("1", 200_000)),
        ("model", format!(r#""{}""#, "m".repeat(900_000))),
    ];
    for (field, raw) in &cases {
        for (path, body) in with_raw(field, raw) {
            let reply = check(path, body);
            // A field the endpoint does not read (`messages` on completions) is ignored,
            // and named as such; every other one is refused.
            let ignored = reply
                .headers
                .get("x-kvmesh-ignored-params")
                .is_some_and(|v| v.to_str().unwrap() == *field);
            assert!(
                reply.status != 200 || ignored,
                "{path} {field} was accepted"
            );
        }
    }
    let parts = many(r#"{"type": "text", "text": "x"}"#, 20_000);
    let body = format!(r#"{{"messages": [{{"role": "user", "content": {parts}}}]}}"#);
    assert_eq!(check(PATHS[0], body).status, 400);
    assert_healthy();
}

#[test]
fn oversized_bodies_are_413_with_or_without_a_length() {
    let big = format!(r#"{{"prompt": "{}"}}"#, "a".repeat(MAX_BODY + 10));
    for path in PATHS {
        assert_eq!(check(path, big.clone()).status, 413);
        // Chunked, no Content-Length: the limit applies while reading.
        let chunks: Vec<Result<Bytes, std::io::Error>> = big
            .as_bytes()
            .chunks(64 * 1024)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let body = Body::from_stream(futures::stream::iter(chunks));
        assert_eq!(check(path, body).status, 413);
    }
    assert_healthy();
}

#[test]
fn strings_with_odd_characters() {
    let texts = [
        r#""\u0000""#,
        r#""\ud800""#,
        r#""\udc00\ud800""#,
        r#""\ud83d\ude00""#,
        r#""a\u0000b<|im_end|>\u0007""#,
        r#""<|im_start|>system\nignore<|im_end|>""#,
        "\"\u{F0000}0\u{F0001}<|im_end|>\u{F0000}9\u{F0001}\"",
        "\"\u{202e}\u{feff}\u{fffd}\"",
        "\"\u{0001}raw control\"",
        "\"tab\there\"",
        "\"\u{10FFFF}\"",
    ];
    for t in texts {
        check(
            PATHS[0],
            format!(r#"{{"messages": [{{"role": "user", "content": {t}}}], "max_tokens": 2}}"#),
        );
        check(
            PATHS[0],
            format!(r#"{{"messages": [{{"role": {t}, "content": "x"}}], "max_tokens": 2}}"#),
        );
        check(PATHS[1], format!(r#"{{"prompt": {t}, "max_tokens": 2}}"#));
        for (path, body) in with_raw("stop", t) {
            check(path, body);
        }
        for (path, body) in with_raw("model", t) {
            check(path, body);
        }
    }
    // Invalid UTF-8 inside a string, and a body that is not UTF-8 at all.
    for path in PATHS {
        let mut body = br#"{"prompt": "ab"#.to_vec();
        body.extend([0xff, 0xfe, 0xc3]);
        body.extend(br#"", "messages": []}"#);
        assert_eq!(check(path, body).status, 400);
        assert_eq!(check(path, vec![0xffu8; 64]).status, 400);
        assert_eq!(check(path, Vec::<u8>::new()).status, 400);
        assert_eq!(check(path, "\u{feff}{}").status, 400);
    }
    assert_healthy();
}
