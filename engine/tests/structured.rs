//! Structured outputs on the real model: a constrained sequence's text is in the
//! constraint's language whatever the model prefers (greedy and sampled), it ends when the
//! language does, and a resumed (migrated) sequence replays its grammar state to continue
//! exactly as the uninterrupted run did.

mod common;

use common::model;
use kvmesh_common::{Constraint, FinishReason, SamplingParams, TokenId};
use kvmesh_engine::engine_config::EngineConfig;
use kvmesh_engine::llm_engine::{EngineError, LlmEngine};
use serde_json::{json, Value};

fn run(
    prompt: &[TokenId],
    generated: &[TokenId],
    params: &SamplingParams,
) -> (Vec<TokenId>, String, FinishReason) {
    let (tokens, texts, reason) = common::run_alone(prompt, generated, params);
    (tokens, texts.concat(), reason)
}

fn prompt(text: &str) -> Vec<TokenId> {
    model().1.encode(text, false).expect("encodes")
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "city": {"enum": ["Paris", "London", "Tokyo"]}
        },
        "required": ["name", "age", "city"],
        "additionalProperties": false
    })
}

fn check_person(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    let o = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {text}"));
    assert_eq!(o.len(), 3, "{text}");
    assert!(
        o["name"].as_str().is_some_and(|n| n.chars().count() <= 20),
        "{text}"
    );
    assert!(
        o["age"].as_i64().is_some_and(|a| (0..=150).contains(&a)),
        "{text}"
    );
    assert!(
        ["Paris", "London", "Tokyo"].contains(&o["city"].as_str().unwrap()),
        "{text}"
    );
}

#[test]
fn greedy_and_sampled_outputs_follow_a_json_schema_and_end_with_it() {
    let p = prompt("Describe a person in JSON with their name, age and city:\n");
    let constraint = Some(Constraint::JsonSchema {
        schema: person_schema(),
    });
    let greedy = SamplingParams {
        constraint: constraint.clone(),
        ..SamplingParams::greedy(120)
    };
    let (_, text, reason) = run(&p, &[], &greedy);
    check_person(&text);
    assert_eq!(reason, FinishReason::Stop, "{text}");
    for seed in 0..4 {
        let sampled = SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            constraint: constraint.clone(),
            ..SamplingParams::greedy(120)
        };
        let (_, text, _) = run(&p, &[], &sampled);
        check_person(&text);
    }
}

#[test]
fn a_resumed_constrained_request_replays_its_grammar() {
    let p = prompt("A JSON object about a cat:\n");
    let params = SamplingParams {
        constraint: Some(Constraint::JsonObject),
        ..SamplingParams::greedy(60)
    };
    let (tokens, text, reason) = run(&p, &[], &params);
    assert!(tokens.len() >= 6, "{text:?}");
    for cut in [1, tokens.len() / 2] {
        let (rest, _, rest_reason) = run(&p, &tokens[..cut], &params);
        assert_eq!(rest, tokens[cut..], "tokens after a cut at {cut}");
        assert_eq!(rest_reason, reason);
    }
    if reason == FinishReason::Stop {
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(v.is_object(), "{text}");
    }
}

#[test]
fn a_bad_constraint_is_refused_at_admission() {
    let mut e: LlmEngine<_> = common::engine(EngineConfig::default());
    let params = SamplingParams {
        constraint: Some(Constraint::Regex {
            pattern: "(".into(),
        }),
        ..SamplingParams::greedy(4)
    };
    let err = e.add_request(0, prompt("x"), params, 0).unwrap_err();
    assert!(matches!(err, EngineError::Constraint(_)), "{err}");
}
