//! The request-field tables of docs/api.md (chat, completions, Responses), row by row: each
//! field sent alone on top of a minimal request gets the outcome the table documents
//! (supported: answered, not named as ignored; ignored: answered and named in
//! `x-kvmesh-ignored-params`; refused: a 400 `unsupported_parameter` naming it). Then unknown
//! fields, lenient and strict.

mod common;

use common::*;
use kvmesh_common::FinishReason;
use kvmesh_router::RouterConfig;
use serde_json::{json, Value};

const HEADER: &str = "x-kvmesh-ignored-params";

/// (endpoint, field, outcome, example patch) for every row of docs/api.md's tables.
fn rows() -> Vec<(&'static str, String, String, Value)> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/api.md"))
        .expect("docs/api.md");
    let mut endpoint = None;
    let mut rows = Vec::new();
    for line in doc.lines() {
        if line.starts_with("### Chat completions") {
            endpoint = Some("/v1/chat/completions");
        } else if line.starts_with("### Completions") {
            endpoint = Some("/v1/completions");
        } else if line.starts_with("## Responses API") {
            endpoint = Some("/v1/responses");
        }
        let cells: Vec<&str> = line.split(" | ").collect();
        let (Some(endpoint), true) = (endpoint, line.starts_with("| `") && cells.len() >= 4) else {
            continue;
        };
        let unquote = |s: &str| {
            s.trim_matches(|c| c == '`' || c == '|' || c == ' ')
                .to_string()
        };
        let example: Value = serde_json::from_str(&unquote(cells[2]))
            .unwrap_or_else(|e| panic!("docs/api.md: bad example in {line:?}: {e}"));
        rows.push((endpoint, unquote(cells[0]), unquote(cells[1]), example));
    }
    rows
}

fn body(endpoint: &str, patch: &Value) -> Value {
    let mut body = match endpoint {
        "/v1/chat/completions" => chat_body("Hi"),
        "/v1/responses" => json!({"model": MODEL, "input": "Hi"}),
        _ => json!({"model": MODEL, "prompt": "Hi"}),
    };
    for (k, v) in patch.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn ignored(reply: &Reply) -> Vec<String> {
    reply
        .headers
        .get(HEADER)
        .map(|v| v.to_str().unwrap().split(", ").map(String::from).collect())
        .unwrap_or_default()
}

#[tokio::test]
async fn every_documented_field_sent_alone_has_its_documented_outcome() {
    let backend = ScriptedBackend::replying("ok", FinishReason::Stop);
    let app = roomy_router(&backend).app();
    let rows = rows();
    assert!(
        rows.len() > 50,
        "docs/api.md lists only {} fields",
        rows.len()
    );
    let mut wrong = Vec::new();
    for (endpoint, field, outcome, example) in &rows {
        let reply = post(&app, endpoint, body(endpoint, example)).await;
        let named = ignored(&reply).contains(field);
        let ok = match outcome.as_str() {
            "supported" => reply.status == 200 && !named,
            "ignored" => reply.status == 200 && named,
            "refused" => {
                let error = &reply.json()["error"];
                reply.status == 400
                    && error["code"] == "unsupported_parameter"
                    && error["param"] == field.as_str()
            }
            other => panic!("docs/api.md: {field}: unknown outcome {other:?}"),
        };
        if !ok {
            wrong.push(format!(
                "{endpoint} {field} ({outcome}): {} {:?} {}",
                reply.status,
                ignored(&reply),
                String::from_utf8_lossy(&reply.body)
                    .chars()
                    .take(300)
                    .collect::<String>()
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[tokio::test]
async fn unknown_fields_are_named_or_with_strict_params_refused() {
    let backend = ScriptedBackend::replying("ok", FinishReason::Stop);
    let lenient = router(&backend).app();
    let patch = json!({"x_vendor_flag": true, "store": true, "prompt": "chat has none"});
    let reply = post(
        &lenient,
        "/v1/chat/completions",
        body("/v1/chat/completions", &patch),
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        ignored(&reply),
        ["store", "x_vendor_flag", "prompt"],
        "body order"
    );

    let strict = router_with(
        &backend,
        RouterConfig {
            strict_params: true,
            ..config()
        },
    )
    .app();
    let reply = post(
        &strict,
        "/v1/chat/completions",
        body("/v1/chat/completions", &patch),
    )
    .await;
    assert_eq!(reply.status, 400);
    let error = &reply.json()["error"];
    assert_eq!(error["code"], "unknown_parameter");
    assert_eq!(error["param"], "x_vendor_flag");
    // A field OpenAI defines but that does not apply stays accepted under strict.
    let reply = post(
        &strict,
        "/v1/chat/completions",
        body("/v1/chat/completions", &json!({"store": false})),
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(ignored(&reply), ["store"]);
}
