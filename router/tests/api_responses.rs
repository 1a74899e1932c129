//! `POST /v1/responses` against a scripted backend: the response object, the named and
//! numbered event stream (order, sequence numbers, item ids, text = the deltas joined),
//! `instructions` and `input` items as the prompt, `text.format` as the job's constraint,
//! `max_output_tokens` -> incomplete, refused and ignored fields, and errors mid-stream.

mod common;

use common::*;
use kvmesh_common::{Constraint, FinishReason, GenerateEvent, WorkerError};
use kvmesh_router::RouterConfig;
use serde_json::{json, Value};

const PATH: &str = "/v1/responses";

fn body(input: Value) -> Value {
    json!({"model": MODEL, "input": input})
}

fn with(patch: Value) -> Value {
    let mut b = body(json!("Hi"));
    for (k, v) in patch.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

/// The prompt the backend got, as text (special tokens included).
fn prompt_text(backend: &ScriptedBackend) -> String {
    let requests = backend.requests();
    assert_eq!(requests.len(), 1);
    tokenizer().decode(&requests[0].prompt, false)
}

fn turn(role: &str, content: &str) -> String {
    format!("<|im_start|>{role}\n{content}<|im_end|>\n")
}

const DEFAULT_SYSTEM: &str = "<|im_start|>system\nYou are helpful.<|im_end|>\n";
const ASSISTANT: &str = "<|im_start|>assistant\n";

/// The events of a Responses stream: each `event:` name with its JSON data. Asserts the
/// name is the data's `type` and that no `[DONE]` follows.
fn events(reply: &Reply) -> Vec<(String, Value)> {
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert!(reply
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let text = std::str::from_utf8(&reply.body).unwrap();
    let mut out = Vec::new();
    for block in text.split("\n\n").filter(|b| !b.trim().is_empty()) {
        // Keep-alive comments aside, each event is `event: <type>` then `data: <json>`.
        let lines: Vec<&str> = block.lines().filter(|l| !l.starts_with(':')).collect();
        if lines.is_empty() {
            continue;
        }
        let (name, data) = match lines[..] {
            [event, data] => (
                event.strip_prefix("event: ").map(str::to_string),
                data.strip_prefix("data: "),
            ),
            _ => (None, None),
        };
        let (Some(name), Some(data)) = (name, data) else {
            panic!("not an `event:` + `data:` event: {block:?}");
        };
        assert_ne!(data, "[DONE]");
        let value: Value = serde_json::from_str(data).unwrap();
        assert_eq!(value["type"], name.as_str(), "{block}");
        out.push((name, value));
    }
    out
}

fn types(events: &[(String, Value)]) -> Vec<&str> {
    events.iter().map(|(n, _)| n.as_str()).collect()
}

/// `output_text` of a response object: its messages' text parts joined.
fn output_text(response: &Value) -> String {
    response["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|item| item["type"] == "message")
        .flat_map(|item| item["content"].as_array().unwrap().iter())
        .filter(|part| part["type"] == "output_text")
        .map(|part| part["text"].as_str().unwrap())
        .collect()
}

#[tokio::test]
async fn non_streaming_response_object_and_prompt() {
    let backend = ScriptedBackend::replying("Hello", FinishReason::Stop);
    let app = router(&backend).app();
    let reply = post(&app, PATH, with(json!({"instructions": "Be brief."}))).await;
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert_eq!(reply.header("content-type"), Some("application/json"));
    assert_eq!(reply.header("x-kvmesh-ignored-params"), None);
    let v = reply.json();
    let id = v["id"].as_str().unwrap();
    assert!(id.starts_with("resp_") && id.len() > 5, "{v}");
    assert_eq!(v["object"], "response");
    assert_eq!(v["status"], "completed");
    assert!(v["created_at"].as_u64().unwrap() > 1_600_000_000);
    assert!(v["completed_at"].as_u64().unwrap() >= v["created_at"].as_u64().unwrap());
    assert!(v["error"].is_null() && v.get("error").is_some());
    assert!(v["incomplete_details"].is_null() && v.get("incomplete_details").is_some());
    assert_eq!(v["model"], MODEL);
    assert_eq!(v["instructions"], "Be brief.");
    assert!(v["max_output_tokens"].is_null());
    assert_eq!(v["temperature"], 1.0);
    assert_eq!(v["top_p"], 1.0);
    assert_eq!(v["text"], json!({"format": {"type": "text"}}));
    assert_eq!(v["tools"], json!([]));
    assert_eq!(v["tool_choice"], "auto");
    assert_eq!(v["parallel_tool_calls"], true);
    assert_eq!(v["store"], false);
    let output = v["output"].as_array().unwrap();
    assert_eq!(output.len(), 1, "{v}");
    let message = &output[0];
    assert!(message["id"].as_str().unwrap().starts_with("msg_"), "{v}");
    assert_eq!(message["type"], "message");
    assert_eq!(message["status"], "completed");
    assert_eq!(message["role"], "assistant");
    assert_eq!(
        message["content"],
        json!([{"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}])
    );
    let input_tokens = backend.requests()[0].prompt.len() as u64;
    assert_eq!(
        v["usage"],
        json!({"input_tokens": input_tokens,
               "input_tokens_details": {"cached_tokens": 3, "cache_write_tokens": 0},
               "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
               "total_tokens": input_tokens + 5})
    );
    // `instructions` is the system message, before the input.
    assert_eq!(
        prompt_text(&backend),
        format!(
            "{}{}{ASSISTANT}",
            turn("system", "Be brief."),
            turn("user", "Hi")
        )
    );
    // OpenAI's sampling defaults; the configured default budget.
    let params = &backend.requests()[0].params;
    assert_eq!(
        (params.temperature, params.top_p, params.max_tokens),
        (1.0, 1.0, 32)
    );
    assert_eq!(params.constraint, None);
}

#[tokio::test]
async fn stream_events_in_order_numbered_with_consistent_ids() {
    let backend = ScriptedBackend::replying("Hey", FinishReason::Stop);
    let app = router(&backend).app();
    let events = events(&post(&app, PATH, with(json!({"stream": true}))).await);
    assert_eq!(
        types(&events),
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    for (i, (_, e)) in events.iter().enumerate() {
        assert_eq!(e["sequence_number"], i as u64, "{e}");
    }
    let event = |name: &str| &events.iter().find(|(n, _)| n == name).unwrap().1;
    // The lifecycle events carry the same response, in progress then completed.
    let created = &event("response.created")["response"];
    let completed = &event("response.completed")["response"];
    assert!(created["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!(created["id"], completed["id"]);
    assert_eq!(
        event("response.in_progress")["response"]["id"],
        created["id"]
    );
    assert_eq!(created["status"], "in_progress");
    assert_eq!(created["output"], json!([]));
    assert!(created["usage"].is_null());
    assert_eq!(completed["status"], "completed");

    // One message item; every event about it names it the same way.
    let added = event("response.output_item.added");
    let item_id = added["item"]["id"].as_str().unwrap().to_string();
    assert!(item_id.starts_with("msg_"));
    assert_eq!(added["output_index"], 0);
    assert_eq!(
        added["item"],
        json!({"id": item_id, "type": "message", "status": "in_progress", "role": "assistant",
               "content": []})
    );
    for (name, e) in &events[3..10] {
        if name != "response.output_item.done" {
            assert_eq!(e["item_id"], item_id.as_str(), "{e}");
            assert_eq!(e["content_index"], 0, "{e}");
        }
        assert_eq!(e["output_index"], 0, "{e}");
    }
    assert_eq!(
        event("response.content_part.added")["part"],
        json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
    );
    // The text is the deltas joined, everywhere it is repeated.
    let deltas: String = events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, e)| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, "Hey");
    assert_eq!(event("response.output_text.done")["text"], "Hey");
    assert_eq!(event("response.content_part.done")["part"]["text"], "Hey");
    let done = &event("response.output_item.done")["item"];
    assert_eq!(done["id"], item_id.as_str());
    assert_eq!(done["status"], "completed");
    assert_eq!(output_text(&json!({"output": [done]})), "Hey");
    assert_eq!(completed["output"], json!([done]));
    assert_eq!(completed["usage"]["output_tokens"], 3);

    // The same request without streaming: the object `response.completed` carried.
    let whole = post(&app, PATH, with(json!({}))).await.json();
    let strip = |r: &Value| {
        let mut r = r.clone();
        for key in ["id", "created_at", "completed_at"] {
            r.as_object_mut().unwrap().remove(key);
        }
        r["output"][0].as_object_mut().unwrap().remove("id");
        r
    };
    assert_eq!(strip(&whole), strip(completed));
}

#[tokio::test]
async fn max_output_tokens_cut_is_incomplete() {
    let backend = ScriptedBackend::replying("abcd", FinishReason::Length);
    let app = router(&backend).app();
    let v = post(&app, PATH, with(json!({"max_output_tokens": 4})))
        .await
        .json();
    assert_eq!(backend.requests()[0].params.max_tokens, 4);
    assert_eq!(v["status"], "incomplete");
    assert_eq!(
        v["incomplete_details"],
        json!({"reason": "max_output_tokens"})
    );
    assert!(v["completed_at"].is_null());
    assert_eq!(v["max_output_tokens"], 4);
    assert_eq!(v["output"][0]["status"], "incomplete");
    assert_eq!(output_text(&v), "abcd");

    let events = events(
        &post(
            &app,
            PATH,
            with(json!({"max_output_tokens": 4, "stream": true})),
        )
        .await,
    );
    let (last, response) = events.last().unwrap();
    assert_eq!(last, "response.incomplete");
    assert_eq!(response["response"]["status"], "incomplete");
    assert_eq!(
        response["response"]["incomplete_details"]["reason"],
        "max_output_tokens"
    );
    let done = events
        .iter()
        .find(|(n, _)| n == "response.output_item.done")
        .unwrap();
    assert_eq!(done.1["item"]["status"], "incomplete");
    assert!(!types(&events).contains(&"response.completed"));
}

#[tokio::test]
async fn an_empty_answer_is_one_empty_message() {
    let backend = ScriptedBackend::replying("", FinishReason::Stop);
    let app = router(&backend).app();
    let v = post(&app, PATH, with(json!({}))).await.json();
    assert_eq!(v["output"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v["output"][0]["content"][0]["text"], "");
    let events = events(&post(&app, PATH, with(json!({"stream": true}))).await);
    assert_eq!(
        types(&events),
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
}

#[tokio::test]
async fn input_items_become_the_conversation() {
    let backend = ScriptedBackend::replying("ok", FinishReason::Stop);
    let app = router(&backend).app();
    // As a client sends a conversation: easy messages, typed ones, content parts, and an
    // earlier response's output item given back as it came.
    let input = json!([
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Capital of"},
            {"type": "input_text", "text": "France?"}
        ]},
        {"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Paris.", "annotations": [], "logprobs": []}]},
        {"role": "user", "content": "And Spain?"}
    ]);
    let reply = post(
        &app,
        PATH,
        json!({"model": MODEL, "input": input, "instructions": "Be brief."}),
    )
    .await;
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert_eq!(
        prompt_text(&backend),
        [
            turn("system", "Be brief."),
            turn("system", "Answer in French."),
            turn("user", "Capital of\nFrance?"),
            turn("assistant", "Paris."),
            turn("user", "And Spain?"),
            ASSISTANT.to_string(),
        ]
        .concat()
    );

    // A plain string with no instructions: one user turn under the template's default.
    let backend = ScriptedBackend::replying("ok", FinishReason::Stop);
    let app = router(&backend).app();
    assert_eq!(post(&app, PATH, body(json!("Hi"))).await.status, 200);
    assert_eq!(
        prompt_text(&backend),
        format!("{DEFAULT_SYSTEM}{}{ASSISTANT}", turn("user", "Hi"))
    );
}

#[tokio::test]
async fn bad_input_names_the_field() {
    let backend = ScriptedBackend::replying("ok", FinishReason::Stop);
    let app = router(&backend).app();
    let cases = [
        (json!({"model": MODEL}), "input", "invalid_value"),
        (body(json!([])), "input", "invalid_value"),
        (body(json!(7)), "input", "invalid_value"),
        (
            body(json!([{"role": "robot", "content": "x"}])),
            "input[0].role",
            "invalid_value",
        ),
        (
            body(json!([{"role": "user"}])),
            "input[0].content",
            "invalid_value",
        ),
        (
            body(json!(["Hi", {"role": "user", "content": "x", "colour": 1}])),
            "input[0]",
            "invalid_value",
        ),
        (
            body(json!([{"role": "user", "content": "x", "colour": 1}])),
            "input[0].colour",
            "unknown_parameter",
        ),
        (
            body(json!([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])),
            "input[0].content[0].type",
            "unsupported_parameter",
        ),
        (
            body(
                json!([{"role": "user", "content": "x"}, {"type": "item_reference", "id": "msg_1"}]),
            ),
            "input[1].type",
            "unsupported_parameter",
        ),
        (
            body(json!([{"type": "reasoning", "summary": []}])),
            "input[0].type",
            "unsupported_parameter",
        ),
        (with(json!({"model": "other"})), "model", "model_not_found"),
        (
            with(json!({"max_output_tokens": 0})),
            "max_output_tokens",
            "invalid_value",
        ),
        (
            with(json!({"temperature": 9})),
            "temperature",
            "invalid_value",
        ),
        (
            with(json!({"text": {"format": {"type": "text"}, "x": 1}})),
            "text.x",
            "unknown_parameter",
        ),
    ];
    expect_400s(&app, &cases).await;
    assert!(backend.requests().is_empty());
    // A prompt beyond the context names `input`.
    let reply = post(&app, PATH, body(json!("x".repeat(300)))).await;
    let error = assert_error(&reply, 400);
    assert_eq!(error["code"], "context_length_exceeded");
    assert_eq!(error["param"], "input");
}

#[tokio::test]
async fn text_format_is_the_jobs_constraint() {
    let backend = ScriptedBackend::replying("{}", FinishReason::Stop);
    let app = router(&backend).app();
    let schema =
        json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
    let format = json!({"type": "json_schema", "name": "thing", "schema": schema, "strict": true});
    let reply = post(&app, PATH, with(json!({"text": {"format": format}}))).await;
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert_eq!(
        backend.requests()[0].params.constraint,
        Some(Constraint::JsonSchema {
            schema: schema.clone()
        })
    );
    assert_eq!(reply.json()["text"], json!({"format": format}));

    let backend = ScriptedBackend::replying("{}", FinishReason::Stop);
    let app = router(&backend).app();
    for (format, constraint) in [
        (json!({"type": "json_object"}), Some(Constraint::JsonObject)),
        (json!({"type": "text"}), None),
        (
            json!({"type": "regex", "pattern": "[0-9]+"}),
            Some(Constraint::Regex {
                pattern: "[0-9]+".into(),
            }),
        ),
    ] {
        let reply = post(&app, PATH, with(json!({"text": {"format": format}}))).await;
        assert_eq!(reply.status, 200);
        assert_eq!(
            backend.requests().last().unwrap().params.constraint,
            constraint
        );
    }

    // Formats that do not compile or do not parse: a 400 naming `text.format`, nothing queued.
    let backend = ScriptedBackend::replying("{}", FinishReason::Stop);
    let app = router(&backend).app();
    for (format, says) in [
        (
            json!({"type": "json_schema", "name": "x", "schema": {"type": "no-such-type"}}),
            "text.format",
        ),
        (
            json!({"type": "json_schema", "name": "x"}),
            "`text.format.schema` is required",
        ),
        // Chat's nested shape is not the Responses one.
        (
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}),
            "json_schema",
        ),
        (json!({"type": "yaml"}), "yaml"),
        (json!({"type": "regex", "pattern": "("}), "text.format"),
    ] {
        let reply = post(&app, PATH, with(json!({"text": {"format": format}}))).await;
        let error = assert_error(&reply, 400);
        assert_eq!(error["param"], "text.format", "{format}: {error}");
        assert_eq!(error["code"], "invalid_value", "{format}: {error}");
        let message = error["message"].as_str().unwrap();
        assert!(message.contains(says), "{format}: {message}");
    }
    assert!(backend.requests().is_empty());
}

#[tokio::test]
async fn stateful_and_missing_features_are_refused() {
    let backend = ScriptedBackend::replying("ok", FinishReason::Stop);
    let app = router(&backend).app();
    for (patch, param) in [
        (
            json!({"previous_response_id": "resp_1"}),
            "previous_response_id",
        ),
        (json!({"conversation": "conv_1"}), "conversation"),
        (json!({"background": true}), "background"),
        (json!({"prompt": {"id": "pmpt_1"}}), "prompt"),
        (json!({"include": ["file_search_call.results"]}), "include"),
        (json!({"top_logprobs": 2}), "top_logprobs"),
        (json!({"truncation": "auto"}), "truncation"),
        (
            json!({"context_management": [{"type": "compaction"}]}),
            "context_management",
        ),
    ] {
        let reply = post(&app, PATH, with(patch.clone())).await;
        let error = assert_error(&reply, 400);
        assert_eq!(error["code"], "unsupported_parameter", "{patch}: {error}");
        assert_eq!(error["param"], param, "{patch}: {error}");
    }
    assert!(backend.requests().is_empty());
    // The values that match what this server does are fine, and `null` is absent.
    for patch in [
        json!({"background": false}),
        json!({"include": []}),
        json!({"truncation": "disabled"}),
        json!({"previous_response_id": null}),
    ] {
        let reply = post(&app, PATH, with(patch.clone())).await;
        assert_eq!(reply.status, 200, "{patch}");
        assert_eq!(reply.header("x-kvmesh-ignored-params"), None, "{patch}");
    }
}

#[tokio::test]
async fn fields_that_do_not_apply_are_ignored_and_named() {
    let backend = ScriptedBackend::replying("ok", FinishReason::Stop);
    let app = router(&backend).app();
    let patch = json!({
        "store": true, "metadata": {"k": "v"}, "user": "u", "reasoning": {"effort": "low"},
        "service_tier": "auto", "text": {"format": {"type": "text"}, "verbosity": "low"},
        "x_vendor": 1,
    });
    let reply = post(&app, PATH, with(patch.clone())).await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.header("x-kvmesh-ignored-params"),
        Some("store, metadata, service_tier, reasoning, user, x_vendor, text.verbosity")
    );
    // Streaming names them too.
    let mut streamed = with(patch.clone());
    streamed["stream"] = json!(true);
    let reply = post(&app, PATH, streamed).await;
    assert!(reply
        .header("x-kvmesh-ignored-params")
        .unwrap()
        .contains("store"));

    // With strict params an unknown field is refused; the OpenAI ones stay accepted.
    let strict = router_with(
        &backend,
        RouterConfig {
            strict_params: true,
            ..config()
        },
    )
    .app();
    let error = assert_error(&post(&strict, PATH, with(patch)).await, 400);
    assert_eq!(error["code"], "unknown_parameter");
    assert_eq!(error["param"], "x_vendor");
    let reply = post(&strict, PATH, with(json!({"store": false}))).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-kvmesh-ignored-params"), Some("store"));
}

#[tokio::test]
async fn kvmesh_sampling_extensions_reach_the_job() {
    let backend = ScriptedBackend::replying("ok", FinishReason::Stop);
    let app = router(&backend).app();
    let patch = json!({"temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                       "seed": 7, "stop": ["\n\n"], "max_output_tokens": 9});
    let v = post(&app, PATH, with(patch)).await.json();
    let p = &backend.requests()[0].params;
    assert_eq!(
        (p.temperature, p.top_p, p.top_k, p.min_p),
        (0.5, 0.9, 20, 0.05)
    );
    assert_eq!((p.seed, p.max_tokens), (Some(7), 9));
    assert_eq!(p.stop, ["\n\n"]);
    assert_eq!(
        (v["temperature"].clone(), v["top_p"].clone()),
        (json!(0.5), json!(0.9))
    );
}

#[tokio::test]
async fn error_mid_stream_is_a_numbered_error_event_and_the_end() {
    let backend = ScriptedBackend::new(Box::new(|_| {
        Ok(vec![
            Step::Send(token(b'a')),
            Step::Send(GenerateEvent::Error(WorkerError::Internal(
                "gpu fell off".into(),
            ))),
        ])
    }));
    let app = router(&backend).app();
    let events = events(&post(&app, PATH, with(json!({"stream": true}))).await);
    assert_eq!(
        types(&events),
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "error",
        ]
    );
    let (_, error) = events.last().unwrap();
    assert_eq!(error["sequence_number"], 5);
    assert_eq!(error["code"], "internal_error");
    assert!(error["param"].is_null());
    assert!(error["message"].as_str().unwrap().contains("gpu fell off"));

    // Without streaming: a plain 500.
    let reply = post(&app, PATH, with(json!({}))).await;
    assert_eq!(assert_error(&reply, 500)["code"], "internal_error");
}

#[tokio::test]
async fn the_route_is_counted_and_documented() {
    let backend = ScriptedBackend::replying("ok", FinishReason::Stop);
    let app = router(&backend).app();
    assert_eq!(post(&app, PATH, with(json!({}))).await.status, 200);
    let metrics = String::from_utf8(get(&app, "/metrics").await.body).unwrap();
    assert!(
        metrics.contains(r#"kvmesh_router_requests_total{endpoint="responses",status="200"}"#),
        "{metrics}"
    );
    let doc = get(&app, "/openapi.json").await.json();
    let op = &doc["paths"][PATH]["post"];
    assert!(op.is_object(), "POST {PATH} is not in the OpenAPI document");
    let schema = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        .as_str()
        .unwrap();
    let schema = doc.pointer(schema.strip_prefix('#').unwrap()).unwrap();
    assert!(schema["properties"]["input"].is_object(), "{schema}");
}

// ---- function tools ------------------------------------------------------------------

const CALL: &str = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": [1, 2]}}\n</tool_call>";
const ARGS: &str = "{\"city\": \"Paris\", \"days\": [1, 2]}";
const TIME_CALL: &str = "<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>";

fn tools_app(backend: &std::sync::Arc<ScriptedBackend>) -> axum::Router {
    roomy_router(backend).app()
}

fn weather_tool() -> Value {
    json!({
        "type": "function",
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "array", "items": {"type": "integer"}}},
            "required": ["city"]
        },
        "strict": true
    })
}

fn tools_body(extra: Value) -> Value {
    let mut b = with(json!({
        "input": "Weather in Paris?",
        "tools": [weather_tool(), {"type": "function", "name": "time"}],
    }));
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

fn leak(text: String) -> &'static str {
    Box::leak(text.into_boxed_str())
}

/// A response's output items without their ids (which differ per request).
fn without_ids(output: &Value) -> Value {
    let mut output = output.clone();
    for item in output.as_array_mut().unwrap() {
        let item = item.as_object_mut().unwrap();
        item.remove("id");
        item.remove("call_id");
    }
    output
}

#[tokio::test]
async fn calls_are_function_call_items_after_the_message() {
    let text = leak(format!("Checking.\n{CALL}\n{TIME_CALL}"));
    let backend = ScriptedBackend::replying(text, FinishReason::Stop);
    let app = tools_app(&backend);
    let reply = post(&app, PATH, tools_body(json!({}))).await;
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    let v = reply.json();
    assert_eq!(v["status"], "completed");
    let output = v["output"].as_array().unwrap();
    assert_eq!(output.len(), 3, "{v}");
    assert_eq!(output[0]["type"], "message");
    // The whitespace that lays out the calls is not the message's.
    assert_eq!(output_text(&v), "Checking.");
    let ids: Vec<&str> = output.iter().map(|i| i["id"].as_str().unwrap()).collect();
    assert!(
        ids[1].starts_with("fc_") && ids[2].starts_with("fc_"),
        "{ids:?}"
    );
    assert_eq!(
        without_ids(&json!(output[1..])),
        json!([
            {"type": "function_call", "name": "get_weather", "arguments": ARGS, "status": "completed"},
            {"type": "function_call", "name": "time", "arguments": "{}", "status": "completed"},
        ])
    );
    let call_ids: Vec<&str> = output[1..]
        .iter()
        .map(|i| i["call_id"].as_str().unwrap())
        .collect();
    assert!(call_ids.iter().all(|c| c.starts_with("call_")));
    assert_ne!(call_ids[0], call_ids[1]);
    assert_ne!(ids[0], ids[1]);
    // Echoed as sent; the model saw the tools first in its system turn; `auto` constrains
    // nothing.
    assert_eq!(
        v["tools"],
        json!([weather_tool(), {"type": "function", "name": "time"}])
    );
    assert_eq!(v["tool_choice"], "auto");
    let prompt = prompt_text(&backend);
    assert!(
        prompt.starts_with("<|im_start|>system\n# Tools"),
        "{prompt}"
    );
    assert!(
        prompt.contains("\"name\":\"get_weather\",\"description\":\"Current weather in a city\"")
    );
    assert!(prompt.ends_with(&format!("{}{ASSISTANT}", turn("user", "Weather in Paris?"))));
    assert_eq!(backend.requests()[0].params.constraint, None);

    // Streamed: the same items, each call's arguments piece by piece.
    let events = events(&post(&app, PATH, tools_body(json!({"stream": true}))).await);
    for (i, (_, e)) in events.iter().enumerate() {
        assert_eq!(e["sequence_number"], i as u64, "{e}");
    }
    let kinds: Vec<&str> = types(&events)
        .into_iter()
        .filter(|t| !t.ends_with(".delta"))
        .collect();
    assert_eq!(
        kinds,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    let completed = &events.last().unwrap().1["response"];
    assert_eq!(without_ids(&completed["output"]), without_ids(&v["output"]));
    for (index, item) in completed["output"].as_array().unwrap().iter().enumerate() {
        let of_item = |kind: &str| -> Vec<&Value> {
            events
                .iter()
                .filter(|(n, e)| n == kind && e["output_index"] == index)
                .map(|(_, e)| e)
                .collect()
        };
        let added = of_item("response.output_item.added");
        let done = of_item("response.output_item.done");
        assert_eq!((added.len(), done.len()), (1, 1), "item {index}");
        assert_eq!(done[0]["item"], *item);
        assert_eq!(added[0]["item"]["id"], item["id"]);
        assert_eq!(added[0]["item"]["status"], "in_progress");
        if item["type"] != "function_call" {
            continue;
        }
        assert_eq!(added[0]["item"]["call_id"], item["call_id"]);
        assert_eq!(added[0]["item"]["name"], item["name"]);
        assert_eq!(added[0]["item"]["arguments"], "");
        let deltas = of_item("response.function_call_arguments.delta");
        assert!(deltas.iter().all(|d| d["item_id"] == item["id"]));
        let joined: String = deltas
            .iter()
            .map(|d| d["delta"].as_str().unwrap())
            .collect();
        assert_eq!(joined, item["arguments"].as_str().unwrap());
        let args_done = of_item("response.function_call_arguments.done");
        assert_eq!(args_done[0]["arguments"], item["arguments"]);
        assert_eq!(args_done[0]["item_id"], item["id"]);
    }
    // Arguments come as they are generated (a token per byte here), not at the end.
    let first_call_deltas = events
        .iter()
        .filter(|(n, e)| n == "response.function_call_arguments.delta" && e["output_index"] == 1)
        .count();
    assert!(first_call_deltas > 10, "{first_call_deltas}");
}

#[tokio::test]
async fn with_tools_text_stays_text_and_a_lone_call_has_no_message() {
    // No call: the text exactly as written, whitespace included.
    let backend = ScriptedBackend::replying("It is <b>sunny</b>. \n", FinishReason::Stop);
    let app = tools_app(&backend);
    let v = post(&app, PATH, tools_body(json!({}))).await.json();
    assert_eq!(v["output"].as_array().unwrap().len(), 1);
    assert_eq!(output_text(&v), "It is <b>sunny</b>. \n");
    let streamed = events(&post(&app, PATH, tools_body(json!({"stream": true}))).await);
    let deltas: String = streamed
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, e)| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, "It is <b>sunny</b>. \n");

    // Only a call: no message. Text after a call is a message of its own.
    for (text, types) in [
        (CALL.to_string(), vec!["function_call"]),
        (format!("{CALL}\n\nDone."), vec!["function_call", "message"]),
    ] {
        let backend = ScriptedBackend::replying(leak(text.clone()), FinishReason::Stop);
        let app = tools_app(&backend);
        for stream in [false, true] {
            let reply = post(&app, PATH, tools_body(json!({"stream": stream}))).await;
            let v = if stream {
                events(&reply).last().unwrap().1["response"].clone()
            } else {
                reply.json()
            };
            let got: Vec<&str> = v["output"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i["type"].as_str().unwrap())
                .collect();
            assert_eq!(got, types, "{text:?} stream={stream}");
            assert_eq!(v["output"][0]["arguments"], ARGS);
            let expected = if types.len() == 2 { "Done." } else { "" };
            assert_eq!(output_text(&v), expected);
        }
    }
}

#[tokio::test]
async fn a_call_cut_by_max_output_tokens_is_incomplete() {
    let backend = ScriptedBackend::replying(&CALL[..40], FinishReason::Length);
    let v = post(&tools_app(&backend), PATH, tools_body(json!({})))
        .await
        .json();
    assert_eq!(v["status"], "incomplete");
    assert_eq!(v["output"][0]["type"], "function_call");
    assert_eq!(v["output"][0]["status"], "incomplete");
    assert_eq!(v["output"][0]["name"], "get_weather");
}

#[tokio::test]
async fn required_and_named_calls_are_constrained() {
    let backend = ScriptedBackend::replying(CALL, FinishReason::Stop);
    let app = tools_app(&backend);
    let grammar = |i: usize| match &backend.requests()[i].params.constraint {
        Some(Constraint::Grammar { lark }) => lark.clone(),
        other => panic!("expected a grammar, got {other:?}"),
    };
    let reply = post(&app, PATH, tools_body(json!({"tool_choice": "required"}))).await;
    assert_eq!(reply.status, 200);
    let lark = grammar(0);
    assert!(
        lark.contains("get_weather") && lark.contains("\"time\""),
        "{lark}"
    );
    assert_eq!(reply.json()["tool_choice"], "required");

    let named =
        json!({"tool_choice": {"type": "function", "name": "time"}, "parallel_tool_calls": false});
    let reply = post(&app, PATH, tools_body(named)).await;
    assert_eq!(reply.status, 200);
    let lark = grammar(1);
    assert!(lark.starts_with("start: call\n"), "{lark}");
    assert!(
        lark.contains("\"time\"") && !lark.contains("get_weather"),
        "{lark}"
    );
    let v = reply.json();
    assert_eq!(
        v["tool_choice"],
        json!({"type": "function", "name": "time"})
    );
    assert_eq!(v["parallel_tool_calls"], false);

    // `none`: the tools are not shown, nothing is constrained, and the text stays text.
    let reply = post(&app, PATH, tools_body(json!({"tool_choice": "none"}))).await;
    assert_eq!(reply.status, 200);
    assert!(!prompt_of(&backend, 2).contains("# Tools"));
    assert_eq!(backend.requests()[2].params.constraint, None);
    assert_eq!(output_text(&reply.json()), CALL);
}

fn prompt_of(backend: &ScriptedBackend, i: usize) -> String {
    tokenizer().decode(&backend.requests()[i].prompt, false)
}

#[tokio::test]
async fn calls_and_outputs_go_back_into_the_conversation() {
    let backend = ScriptedBackend::replying("12 C in Paris.", FinishReason::Stop);
    let app = tools_app(&backend);
    // As the SDK sends an earlier answer back: its output items, then the results.
    let input = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": "{\"city\": \"Paris\"}", "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "12 C"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "noon"}]},
        // A call with no message before it makes its own assistant turn.
        {"type": "function_call", "call_id": "call_3", "name": "time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_3", "output": "one"},
    ]);
    let reply = post(&app, PATH, tools_body(json!({"input": input}))).await;
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert_eq!(output_text(&reply.json()), "12 C in Paris.");
    let expected = [
        turn("user", "Weather in Paris?"),
        turn(
            "assistant",
            "Checking.\n<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\":\"time\",\"arguments\":{}}\n</tool_call>",
        ),
        turn(
            "user",
            "<tool_response>\n12 C\n</tool_response>\n<tool_response>\nnoon\n</tool_response>",
        ),
        turn(
            "assistant",
            "<tool_call>\n{\"name\":\"time\",\"arguments\":{}}\n</tool_call>",
        ),
        turn("user", "<tool_response>\none\n</tool_response>"),
        ASSISTANT.to_string(),
    ]
    .concat();
    let prompt = prompt_text(&backend);
    assert!(prompt.ends_with(&expected), "{prompt}");
}

#[tokio::test]
async fn bad_tool_requests_name_the_field() {
    let backend = ScriptedBackend::replying("x", FinishReason::Stop);
    let app = tools_app(&backend);
    let cases = [
        (
            tools_body(json!({"tools": [{"type": "web_search"}]})),
            "tools[0].type",
            "unsupported_parameter",
        ),
        (
            tools_body(json!({"tools": [{"type": "function", "name": "has space"}]})),
            "tools[0].name",
            "invalid_value",
        ),
        (
            tools_body(json!({"tool_choice": {"type": "function", "name": "nope"}})),
            "tool_choice",
            "invalid_value",
        ),
        (
            tools_body(
                json!({"tool_choice": "required", "text": {"format": {"type": "json_object"}}}),
            ),
            "text.format",
            "invalid_value",
        ),
        (
            tools_body(json!({"max_tool_calls": 2})),
            "max_tool_calls",
            "unsupported_parameter",
        ),
        (
            body(
                json!([{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c", "name": "f"}]),
            ),
            "input[1].arguments",
            "invalid_value",
        ),
        (
            body(json!([{"type": "function_call_output", "call_id": "c",
                         "output": [{"type": "input_image", "image_url": "x"}]}])),
            "input[0].output[0].type",
            "unsupported_parameter",
        ),
        (
            body(
                json!([{"type": "function_call_output", "call_id": "c", "output": "x", "extra": 1}]),
            ),
            "input[0].extra",
            "unknown_parameter",
        ),
    ];
    expect_400s(&app, &cases).await;
    assert!(backend.requests().is_empty());
}

/// Sends each request; each gets a 400 naming `param` with `code`.
async fn expect_400s(app: &axum::Router, cases: &[(Value, &str, &str)]) {
    for (request, param, code) in cases {
        let reply = post(app, PATH, request.clone()).await;
        let error = assert_error(&reply, 400);
        assert_eq!(error["param"], *param, "{request}: {error}");
        assert_eq!(error["code"], *code, "{request}: {error}");
    }
}
