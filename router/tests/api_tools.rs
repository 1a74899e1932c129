//! Tool calling on `/v1/chat/completions`: tools shown to the model, required calls
//! constrained, the model's `<tool_call>` output parsed into `tool_calls` (whole and
//! streamed), and calls and results sent back in the conversation.

mod common;

use std::sync::Arc;

use common::*;
use kvmesh_common::{Constraint, FinishReason, GenerateRequest};
use serde_json::{json, Value};

const CALL: &str = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": [1, 2]}}\n</tool_call>";
const ARGS: &str = "{\"city\": \"Paris\", \"days\": [1, 2]}";

fn app(backend: &Arc<ScriptedBackend>) -> axum::Router {
    roomy_router(backend).app()
}

fn weather_tool() -> Value {
    json!({
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "array", "items": {"type": "integer"}}},
                "required": ["city"]
            }
        }
    })
}

fn time_tool() -> Value {
    json!({"type": "function", "function": {"name": "time"}})
}

fn body(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [weather_tool(), time_tool()],
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn prompt_text(req: &GenerateRequest) -> String {
    tokenizer().decode(&req.prompt, false)
}

#[tokio::test]
async fn a_call_in_the_output_is_returned_as_tool_calls() {
    let backend = ScriptedBackend::replying(CALL, FinishReason::Stop);
    let reply = post(&app(&backend), "/v1/chat/completions", body(json!({}))).await;
    assert_eq!(reply.status, 200, "{}", reply.json());
    let v = reply.json();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    let message = &choice["message"];
    assert_eq!(message["role"], "assistant");
    assert!(message["content"].is_null(), "{message}");
    let calls = message["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(calls[0]["function"]["arguments"], ARGS);
    assert!(calls[0].get("index").is_none());

    // The model saw the tools in its system turn; `auto` constrains nothing.
    let req = &backend.requests()[0];
    let prompt = prompt_text(req);
    let system = prompt.split("<|im_end|>").next().unwrap();
    assert!(
        system.starts_with("<|im_start|>system\n# Tools"),
        "{prompt}"
    );
    assert!(
        system.contains("\"name\":\"get_weather\",\"description\":\"Current weather in a city\"")
    );
    assert!(
        system.contains("\"name\":\"time\",\"parameters\":{\"type\":\"object\",\"properties\":{}}")
    );
    assert!(
        prompt.ends_with("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    );
    assert_eq!(req.params.constraint, None);
}

/// The streamed deltas of one choice: content, and each call's (id, name, arguments).
fn streamed(chunks: &[Value]) -> (String, Vec<(String, String, String)>, Vec<String>) {
    let mut content = String::new();
    let mut calls: Vec<(String, String, String)> = Vec::new();
    let mut finish = Vec::new();
    for chunk in chunks {
        let choice = &chunk["choices"][0];
        if let Some(reason) = choice["finish_reason"].as_str() {
            finish.push(reason.to_string());
        }
        let delta = &choice["delta"];
        if let Some(text) = delta["content"].as_str() {
            content.push_str(text);
        }
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let index = call["index"]
                .as_u64()
                .expect("streamed calls have an index") as usize;
            if index == calls.len() {
                // A call's first delta names it.
                calls.push((
                    call["id"].as_str().unwrap().to_string(),
                    call["function"]["name"].as_str().unwrap().to_string(),
                    String::new(),
                ));
                assert_eq!(call["type"], "function");
            } else {
                assert!(call.get("id").is_none() && call["function"].get("name").is_none());
            }
            calls[index]
                .2
                .push_str(call["function"]["arguments"].as_str().unwrap());
        }
    }
    (content, calls, finish)
}

#[tokio::test]
async fn calls_stream_as_deltas_that_add_up_to_the_whole_answer() {
    let text = format!(
        "Checking.\n{CALL}\n<tool_call>\n{{\"name\": \"time\", \"arguments\": {{}}}}\n</tool_call>"
    );
    let text: &'static str = Box::leak(text.into_boxed_str());
    let backend = ScriptedBackend::replying(text, FinishReason::Stop);
    let app = app(&backend);
    let reply = post(&app, "/v1/chat/completions", body(json!({"stream": true}))).await;
    assert_eq!(reply.status, 200);
    let chunks = reply.sse_json();
    let (content, calls, finish) = streamed(&chunks);
    assert_eq!(content, "Checking.\n");
    assert_eq!(finish, vec!["tool_calls"]);
    assert_eq!(calls.len(), 2);
    assert_eq!(
        (calls[0].1.as_str(), calls[0].2.as_str()),
        ("get_weather", ARGS)
    );
    assert_eq!((calls[1].1.as_str(), calls[1].2.as_str()), ("time", "{}"));
    assert_ne!(calls[0].0, calls[1].0);
    // Arguments come as they are generated (a token per byte here), not at the end.
    let pieces = chunks
        .iter()
        .filter(|c| c["choices"][0]["delta"]["tool_calls"][0]["index"] == 0)
        .count();
    assert!(pieces > 10, "{pieces} deltas for the first call");

    // The same answer, not streamed.
    let whole = post(&app, "/v1/chat/completions", body(json!({})))
        .await
        .json();
    let message = &whole["choices"][0]["message"];
    assert_eq!(message["content"], "Checking.");
    let ids: Vec<&str> = message["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), 2);
    assert_eq!(message["tool_calls"][1]["function"]["arguments"], "{}");
}

#[tokio::test]
async fn text_answers_with_tools_stay_text() {
    let backend = ScriptedBackend::replying("It is <b>sunny</b>.", FinishReason::Stop);
    let app = app(&backend);
    let v = post(&app, "/v1/chat/completions", body(json!({})))
        .await
        .json();
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        v["choices"][0]["message"],
        json!({"role": "assistant", "content": "It is <b>sunny</b>."})
    );
    let reply = post(
        &app,
        "/v1/chat/completions",
        body(json!({"stream": true, "n": 2})),
    )
    .await;
    let chunks = reply.sse_json();
    for index in [0, 1] {
        let mine: Vec<Value> = chunks
            .iter()
            .filter(|c| c["choices"][0]["index"] == index)
            .cloned()
            .collect();
        let (content, calls, finish) = streamed(&mine);
        assert_eq!(content, "It is <b>sunny</b>.");
        assert!(calls.is_empty());
        assert_eq!(finish, vec!["stop"]);
    }
}

#[tokio::test]
async fn required_and_named_calls_are_constrained() {
    let backend = ScriptedBackend::replying(CALL, FinishReason::Stop);
    let app = app(&backend);
    let grammar = |i: usize| match &backend.requests()[i].params.constraint {
        Some(Constraint::Grammar { lark }) => lark.clone(),
        other => panic!("expected a grammar, got {other:?}"),
    };

    let reply = post(
        &app,
        "/v1/chat/completions",
        body(json!({"tool_choice": "required"})),
    )
    .await;
    assert_eq!(reply.status, 200);
    let lark = grammar(0);
    assert!(
        lark.contains("get_weather") && lark.contains("\"time\""),
        "{lark}"
    );

    let named = json!({"tool_choice": {"type": "function", "function": {"name": "time"}}, "parallel_tool_calls": false});
    let reply = post(&app, "/v1/chat/completions", body(named)).await;
    assert_eq!(reply.status, 200);
    let lark = grammar(1);
    assert!(lark.starts_with("start: call\n"), "{lark}");
    assert!(
        lark.contains("\"time\"") && !lark.contains("get_weather"),
        "{lark}"
    );

    // `none`: the tools are not shown and nothing is constrained.
    let reply = post(
        &app,
        "/v1/chat/completions",
        body(json!({"tool_choice": "none"})),
    )
    .await;
    assert_eq!(reply.status, 200);
    let req = &backend.requests()[2];
    assert!(!prompt_text(req).contains("# Tools"));
    assert_eq!(req.params.constraint, None);
    assert_eq!(reply.header("x-kvmesh-ignored-params"), None);
}

#[tokio::test]
async fn calls_and_results_go_back_into_the_conversation() {
    let backend = ScriptedBackend::replying("12 C in Paris.", FinishReason::Stop);
    let body = json!({
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": "{}"}}
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
            {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "noon"}]}
        ],
        "tools": [weather_tool(), time_tool()],
    });
    let reply = post(&app(&backend), "/v1/chat/completions", body).await;
    assert_eq!(reply.status, 200, "{}", reply.json());
    assert_eq!(
        reply.json()["choices"][0]["message"]["content"],
        "12 C in Paris."
    );
    let prompt = prompt_text(&backend.requests()[0]);
    let expected = "<|im_start|>assistant\n<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\":\"time\",\"arguments\":{}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n12 C\n</tool_response>\n<tool_response>\nnoon\n</tool_response><|im_end|>\n<|im_start|>assistant\n";
    assert!(prompt.ends_with(expected), "{prompt}");
}

#[tokio::test]
async fn bad_tool_requests_get_clear_errors() {
    let backend = ScriptedBackend::replying("x", FinishReason::Stop);
    let app = app(&backend);
    let cases = [
        (
            body(json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}})),
            "tool_choice",
        ),
        (body(json!({"tool_choice": "sometimes"})), "tool_choice"),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "has space"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "tools": [weather_tool(), weather_tool()]}),
            "tools[1]",
        ),
        (
            body(json!({"tool_choice": "required", "response_format": {"type": "json_object"}})),
            "response_format",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
                   "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}}]}),
            "tools",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}),
            "messages[0].tool_calls",
        ),
    ];
    for (body, param) in cases {
        let reply = post(&app, "/v1/chat/completions", body.clone()).await;
        let err = assert_error(&reply, 400);
        assert_eq!(err["param"], param, "{body}: {err}");
    }
    let reply = post(
        &app,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search"}]}),
    )
    .await;
    let err = assert_error(&reply, 400);
    assert_eq!(err["code"], "unsupported_parameter");
    assert_eq!(err["param"], "tools[0].type");
    assert!(
        backend.requests().is_empty(),
        "no bad request reached the backend"
    );
}
