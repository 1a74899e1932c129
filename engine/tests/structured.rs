//! Structured outputs on the real model: a constrained sequence's text is in the
//! constraint's language whatever the model prefers (greedy and sampled), it ends when the
//! language does, and a resumed (migrated) sequence replays its grammar state to continue
//! exactly as the uninterrupted run did.
//!
//! Forced tokens (fast-forward): they follow the drawn token in the same step, so a schema
//! with long fixed keys takes far fewer steps; each is an output of its own (stop
//! conditions, `max_tokens`, text), a migration may cut a forced run anywhere, and a remote
//! prefill hands over to a decode engine that forces them as a local run does. Masks computed
//! while the model runs give the tokens that masks computed after it give.

mod common;

use common::model;
use kvmesh_common::{Constraint, FinishReason, SamplingParams, TokenId};
use kvmesh_engine::engine_config::EngineConfig;
use kvmesh_engine::llama_runner::LlamaRunner;
use kvmesh_engine::llm_engine::{EngineError, LlmEngine, SeqOutput};
use kvmesh_engine::runner::{KvSource, ModelRunner};
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

/// One request's run: every output in order, with the step that produced it.
struct Outcome {
    outputs: Vec<(usize, SeqOutput)>,
    /// Steps that computed tokens.
    steps: usize,
}

impl Outcome {
    fn tokens(&self) -> Vec<TokenId> {
        self.outputs
            .iter()
            .map(|(_, o)| o.sampled.as_ref().expect("a token").token)
            .collect()
    }

    fn texts(&self) -> Vec<String> {
        self.outputs.iter().map(|(_, o)| o.text.clone()).collect()
    }

    fn text(&self) -> String {
        self.texts().concat()
    }

    fn reason(&self) -> FinishReason {
        self.outputs.last().unwrap().1.finish.expect("finished")
    }

    /// The index of each output that follows a drawn one in the same step (a forced token).
    fn forced(&self) -> Vec<usize> {
        (1..self.outputs.len())
            .filter(|&i| self.outputs[i].0 == self.outputs[i - 1].0)
            .collect()
    }
}

fn engine(fast_forward: bool, mask_overlap: bool, config: EngineConfig) -> LlmEngine<LlamaRunner> {
    let mut e = common::engine(EngineConfig {
        grammar_fast_forward: fast_forward,
        ..config
    });
    e.set_mask_overlap(mask_overlap);
    e
}

/// Runs one request alone on a 64-block engine, from its start or resumed after `generated`.
fn generate(
    prompt: &[TokenId],
    generated: &[TokenId],
    params: &SamplingParams,
    fast_forward: bool,
) -> Outcome {
    let mut e = engine(
        fast_forward,
        true,
        EngineConfig {
            num_blocks: 64,
            ..EngineConfig::default()
        },
    );
    if generated.is_empty() {
        e.add_request(0, prompt.to_vec(), params.clone(), 0)
    } else {
        e.resume_request(0, prompt.to_vec(), generated.to_vec(), params.clone(), 0)
    }
    .expect("accepted");
    let mut outcome = Outcome {
        outputs: Vec::new(),
        steps: 0,
    };
    loop {
        let outputs = e.step().expect("step");
        if e.last_step_tokens() > 0 {
            outcome.steps += 1;
        }
        for out in outputs {
            let done = out.finish.is_some();
            outcome.outputs.push((outcome.steps, out));
            if done {
                assert!(!e.has_work());
                // The engine's own totals (exported as metrics) say the same.
                assert_eq!(e.steps_run(), outcome.steps as u64);
                assert_eq!(e.tokens_generated(), outcome.outputs.len() as u64);
                return outcome;
            }
        }
    }
}

/// A record whose keys are long and fixed: most of its text is forced.
fn account_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "customer_full_legal_name": {"type": "string", "maxLength": 24},
            "customer_primary_email_address": {"type": "string", "maxLength": 24},
            "preferred_contact_method_for_notifications": {"enum": ["email", "phone", "post"]},
            "account_balance_in_euro_cents": {"type": "integer", "minimum": 0, "maximum": 100000}
        },
        "required": [
            "customer_full_legal_name",
            "customer_primary_email_address",
            "preferred_contact_method_for_notifications",
            "account_balance_in_euro_cents"
        ],
        "additionalProperties": false
    })
}

fn check_account(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    let o = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {text}"));
    assert_eq!(o.len(), 4, "{text}");
    for key in ["customer_full_legal_name", "customer_primary_email_address"] {
        assert!(
            o[key].as_str().is_some_and(|s| s.chars().count() <= 24),
            "{text}"
        );
    }
    assert!(
        ["email", "phone", "post"].contains(
            &o["preferred_contact_method_for_notifications"]
                .as_str()
                .unwrap()
        ),
        "{text}"
    );
    assert!(
        o["account_balance_in_euro_cents"]
            .as_i64()
            .is_some_and(|c| (0..=100_000).contains(&c)),
        "{text}"
    );
}

fn account_params(max_tokens: u32) -> SamplingParams {
    SamplingParams {
        constraint: Some(Constraint::JsonSchema {
            schema: account_schema(),
        }),
        ..SamplingParams::greedy(max_tokens)
    }
}

fn account_prompt() -> Vec<TokenId> {
    prompt("A customer account record in JSON:\n")
}

#[test]
fn forced_tokens_cut_the_steps_of_a_schema_with_long_keys() {
    let p = account_prompt();
    let params = account_params(200);
    let with = generate(&p, &[], &params, true);
    let without = generate(&p, &[], &params, false);
    for run in [&with, &without] {
        check_account(&run.text());
        assert_eq!(run.reason(), FinishReason::Stop, "{}", run.text());
        // Every token is delivered once, in order: the texts are the tokens' text.
        assert_eq!(model().1.decode(&run.tokens(), true), run.text());
    }
    // Without forcing, one token per step; with it, the keys come several to a step.
    assert!(without.forced().is_empty());
    assert_eq!(without.steps, without.outputs.len());
    let forced = with.forced().len();
    assert_eq!(with.steps + forced, with.outputs.len());
    assert!(
        forced >= 20,
        "{forced} forced tokens of {}",
        with.outputs.len()
    );
    assert!(
        with.steps * 3 <= without.steps * 2,
        "{} steps with forced tokens, {} without",
        with.steps,
        without.steps
    );
    // No log-probabilities were asked for, so a forced token has none either.
    for i in with.forced() {
        assert_eq!(with.outputs[i].1.sampled.as_ref().unwrap().logprob, None);
    }
}

#[test]
fn seeded_runs_with_forced_tokens_follow_the_schema() {
    let p = account_prompt();
    for seed in 0..4 {
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            logprobs: Some(2),
            ..account_params(200)
        };
        let run = generate(&p, &[], &params, true);
        check_account(&run.text());
        assert!(!run.forced().is_empty());
        for i in run.forced() {
            let s = run.outputs[i].1.sampled.as_ref().unwrap();
            assert_eq!(
                (s.logprob, &s.top_logprobs[..]),
                (Some(0.0), &[(s.token, 0.0)][..])
            );
        }
        // The same seed gives the same answer.
        assert_eq!(generate(&p, &[], &params, true).tokens(), run.tokens());
    }
}

#[test]
fn max_tokens_and_stop_strings_cut_inside_a_forced_run() {
    let p = account_prompt();
    let full = generate(&p, &[], &account_params(200), true);
    let tokens = full.tokens();
    // A step that forced at least two tokens after its drawn one: cut after the first.
    let forced = full.forced();
    let cut = *forced
        .iter()
        .find(|&&i| forced.contains(&(i + 1)))
        .expect("a forced run of two or more tokens")
        + 1;
    let short = generate(&p, &[], &account_params(cut as u32), true);
    assert_eq!(short.tokens(), tokens[..cut]);
    assert_eq!(short.reason(), FinishReason::Length);
    assert_eq!(short.text(), model().1.decode(&tokens[..cut], true));

    // A stop string inside a forced key: the text ends before it.
    let params = SamplingParams {
        stop: vec!["_email_".into()],
        ..account_params(200)
    };
    let stopped = generate(&p, &[], &params, true);
    let text = full.text();
    let at = text.find("_email_").expect("the key");
    assert_eq!(stopped.text(), text[..at]);
    assert_eq!(stopped.reason(), FinishReason::Stop);
    assert!(stopped.outputs.len() < tokens.len());
    assert_eq!(stopped.tokens(), tokens[..stopped.outputs.len()]);
}

#[test]
fn a_resumed_request_continues_across_a_forced_run() {
    let p = account_prompt();
    let greedy = account_params(200);
    let seeded = SamplingParams {
        temperature: 0.8,
        seed: Some(5),
        ..account_params(200)
    };
    for params in [greedy, seeded] {
        let full = generate(&p, &[], &params, true);
        let (tokens, texts) = (full.tokens(), full.texts());
        let forced = full.forced();
        let run_start = forced[0]; // the first forced token of a run
        let run_end = (run_start..).find(|i| !forced.contains(i)).unwrap();
        assert!(run_end - run_start >= 2, "a run of two or more");
        // Before the run (after its drawn token), inside it, at its end, past a few runs.
        for cut in [run_start, run_start + 1, run_end, forced[forced.len() / 2]] {
            let rest = generate(&p, &tokens[..cut], &params, true);
            assert_eq!(rest.tokens(), tokens[cut..], "tokens after a cut at {cut}");
            assert_eq!(rest.text(), texts[cut..].concat(), "text after {cut}");
            assert_eq!(rest.reason(), full.reason());
        }
    }
}

#[test]
fn masks_computed_while_the_model_runs_match_masks_computed_after() {
    // Constrained and free sequences together, prompts chunked by a small budget (chunks that
    // draw nothing) and a pool small enough to preempt.
    let p = account_prompt();
    let requests: Vec<(Vec<TokenId>, SamplingParams)> = vec![
        (p.clone(), account_params(120)),
        (
            prompt("Describe a person in JSON with their name, age and city:\n"),
            SamplingParams {
                constraint: Some(Constraint::JsonSchema {
                    schema: person_schema(),
                }),
                ..SamplingParams::greedy(120)
            },
        ),
        (
            prompt("A JSON object about a cat:\n"),
            SamplingParams {
                constraint: Some(Constraint::JsonObject),
                ..SamplingParams::greedy(60)
            },
        ),
        (
            prompt("Once upon a time"),
            SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(100)
            },
        ),
    ];
    let run = |overlap: bool| {
        let mut e = engine(
            true,
            overlap,
            EngineConfig {
                num_blocks: 10,
                max_num_batched_tokens: 8,
                ..EngineConfig::default()
            },
        );
        for (id, (prompt, params)) in requests.iter().enumerate() {
            e.add_request(id as u64, prompt.clone(), params.clone(), 0)
                .unwrap();
        }
        let mut tokens = vec![Vec::new(); requests.len()];
        let mut reasons = vec![None; requests.len()];
        while e.has_work() {
            for out in e.step().expect("step") {
                tokens[out.seq_id as usize].push(out.sampled.unwrap().token);
                reasons[out.seq_id as usize] = out.finish;
            }
        }
        (tokens, reasons, e.scheduler().num_preemptions())
    };
    let (after, after_reasons, preemptions) = run(false);
    let (during, during_reasons, _) = run(true);
    assert!(preemptions > 0, "the pool never ran short");
    assert_eq!(during, after);
    assert_eq!(during_reasons, after_reasons);
    check_account(&model().1.decode(&during[0], true));
    check_person(&model().1.decode(&during[1], true));
}

#[test]
fn a_remote_prefill_hands_over_to_forced_tokens_as_a_local_run_does() {
    let p = account_prompt();
    let params = account_params(200);
    let local = generate(&p, &[], &params, true);

    // The prefill engine draws the first token under the schema and ends there.
    let mut prefill = engine(true, true, EngineConfig::default());
    prefill
        .add_prefill_request(0, p.clone(), params.clone())
        .unwrap();
    let blocks = p.len().div_ceil(16);
    let layers = prefill.runner().kv_shape().num_layers;
    let mut kv = vec![Vec::new(); layers];
    let first = prefill
        .step_observed(&mut |layer, step, src: &dyn KvSource| {
            let table = &step.chunks[0].block_table[..blocks];
            src.read_kv_blocks(layer, table, &mut kv[layer]).unwrap();
        })
        .unwrap();
    assert_eq!(first.len(), 1, "a prefill-only sequence forces nothing");
    let first = first[0].sampled.clone().unwrap();
    assert_eq!(first.token, local.tokens()[0]);

    // The decode engine takes the KV, then the first token and the tokens it forces.
    let mut decode = engine(true, true, EngineConfig::default());
    decode
        .add_remote_request(0, p.clone(), params.clone(), 0)
        .unwrap();
    assert!(decode.step().unwrap().is_empty());
    let admitted = decode.last_remote_admitted()[0].blocks.clone();
    assert_eq!(admitted.len(), blocks);
    decode
        .write_kv_blocks(0..layers, &admitted, &kv.concat())
        .unwrap();
    let mut outputs = decode.complete_remote_prefill(0, first, 0).unwrap();
    let handed_over = outputs.len();
    while decode.has_work() {
        outputs.extend(decode.step().unwrap());
    }
    let tokens: Vec<TokenId> = outputs
        .iter()
        .map(|o| o.sampled.as_ref().unwrap().token)
        .collect();
    let text: String = outputs.iter().map(|o| o.text.as_str()).collect();
    assert_eq!(tokens, local.tokens());
    assert_eq!(text, local.text());
    // The local run forced as many tokens after its first.
    let local_first_step = local.outputs.iter().filter(|(s, _)| *s == 1).count();
    assert_eq!(handed_over, local_first_step);
}
