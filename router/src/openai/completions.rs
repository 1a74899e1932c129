//! `POST /v1/completions` (the legacy text completions API).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::Response;
use axum::Extension;
use kvmesh_common::{FinishReason, TokenEvent, TokenId, Usage};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::params::{self, PromptInfo, SamplingFields};
use super::types::{
    finish_reason, to_json, ChoiceOutput, Meta, StopParam, StreamOptions, UsageBody,
};
use super::{check_model, name_ignored, respond, structured, unix_now, Format, Prepared};
use crate::error::ApiError;
use crate::generation::Job;
use crate::json::{parse_body, FieldPolicy, Parsed};
use crate::metrics::Outcome;
use crate::request_id::RequestContext;
use crate::server::AppState;
use crate::sse::Chunk;

/// What happens to the OpenAI fields `CompletionRequest` does not read (docs/api.md).
const POLICY: FieldPolicy = FieldPolicy {
    ignored: &[("user", "end users are not tracked")],
    unsupported: &[],
};

/// The request body (fields it does not read: [`POLICY`]).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CompletionRequest {
    model: Option<String>,
    /// A string, an array of token ids, or an array holding one of those.
    prompt: Value,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<i64>,
    n: Option<i64>,
    /// Only 1 (or `n`) is supported.
    best_of: Option<i64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    seed: Option<i64>,
    stop: Option<StopParam>,
    stop_token_ids: Option<Vec<i64>>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
    logit_bias: Option<BTreeMap<String, f32>>,
    ignore_eos: Option<bool>,
    min_tokens: Option<i64>,
    /// Number of top logprobs per token.
    logprobs: Option<i64>,
    /// Prepend the prompt text to the completion.
    echo: Option<bool>,
    /// Text after the completion: a fill-in-the-middle prompt, for models that have one.
    suffix: Option<String>,
    response_format: Option<Value>,
}

/// A completion prompt.
#[derive(Debug, PartialEq)]
enum PromptIn {
    Text(String),
    Tokens(Vec<TokenId>),
}

fn prompt_in(value: Value, vocab_size: usize) -> Result<PromptIn, ApiError> {
    let bad = || {
        ApiError::invalid(
            "prompt",
            "`prompt` must be a string, an array of token ids, or an array holding one of those",
        )
    };
    let ids = |items: &[Value]| -> Result<Vec<TokenId>, ApiError> {
        items
            .iter()
            .map(|v| {
                let id = v.as_u64().ok_or_else(bad)?;
                u32::try_from(id)
                    .ok()
                    .filter(|&id| (id as usize) < vocab_size)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "prompt",
                            format!(
                                "token id {id} is outside the vocabulary of {vocab_size} tokens"
                            ),
                        )
                    })
            })
            .collect()
    };
    let batched = || {
        ApiError::unsupported(
            "prompt",
            "batched prompts are not supported: send one prompt per request",
        )
    };
    match value {
        Value::String(s) => Ok(PromptIn::Text(s)),
        Value::Array(items) => match items.first() {
            None => Err(ApiError::invalid("prompt", "`prompt` must not be empty")),
            Some(Value::Number(_)) => Ok(PromptIn::Tokens(ids(&items)?)),
            Some(Value::String(_)) | Some(Value::Array(_)) if items.len() > 1 => Err(batched()),
            Some(Value::String(s)) => Ok(PromptIn::Text(s.clone())),
            Some(Value::Array(inner)) => Ok(PromptIn::Tokens(ids(inner)?)),
            Some(_) => Err(bad()),
        },
        _ => Err(bad()),
    }
}

/// The handler.
pub(crate) async fn handle(
    State(state): State<Arc<AppState>>,
    Extension(ctx): Extension<RequestContext>,
    Extension(outcome): Extension<Outcome>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let Parsed {
        request: req,
        ignored,
    } = parse_body::<CompletionRequest>(
        body,
        state.config.max_body_bytes,
        &POLICY,
        state.config.strict_params,
    )?;
    check_model(&state, req.model.as_deref())?;
    let constraint = structured::constraint(req.response_format, &state.prompts)?;
    if req.best_of.is_some_and(|b| b != 1 && Some(b) != req.n) {
        return Err(ApiError::unsupported(
            "best_of",
            "`best_of` is not supported (use `n`)",
        ));
    }
    let logprobs = req
        .logprobs
        .map(|k| u32::try_from(k).map_err(|_| ApiError::invalid("logprobs", "must be in [0, 20]")))
        .transpose()?;
    let echo = req.echo.unwrap_or(false);
    if echo && logprobs.is_some() {
        return Err(ApiError::unsupported(
            "echo",
            "`echo` with `logprobs` needs prompt logprobs, which are not supported",
        ));
    }
    let tokenizer = state.prompts.tokenizer();
    let prompt = match prompt_in(req.prompt, tokenizer.vocab_size())? {
        PromptIn::Text(text) => state.prompts.text(&text)?,
        PromptIn::Tokens(ids) => ids,
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "`prompt` must not be empty"));
    }
    // Echo shows the prompt as given, without the fill-in-the-middle markup.
    let echoed = echo.then(|| tokenizer.decode(&prompt, false));
    let prompt = match req.suffix {
        Some(suffix) => state.prompts.fill_in_middle(prompt, &suffix)?,
        None => prompt,
    };
    let fields = SamplingFields {
        n: req.n,
        max_tokens: req.max_tokens.map(|m| (m, "max_tokens")),
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        min_p: req.min_p,
        seed: req.seed,
        stop: req.stop,
        stop_token_ids: req.stop_token_ids,
        presence_penalty: req.presence_penalty,
        frequency_penalty: req.frequency_penalty,
        repetition_penalty: req.repetition_penalty,
        logit_bias: req.logit_bias,
        ignore_eos: req.ignore_eos,
        min_tokens: req.min_tokens,
        logprobs,
        constraint,
    };
    let info = PromptInfo {
        tokens: prompt.len(),
        param: "prompt",
    };
    let (params, n) = params::build(fields, &info, &state.config, tokenizer.vocab_size())?;
    let stream = req.stream.unwrap_or(false);
    let include_usage = stream
        && req
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
    let format = CompletionFormat {
        meta: Meta {
            id: format!("cmpl-{:016x}", ctx.id.0),
            created: unix_now(),
            model: state.config.model_name.clone(),
            tokenizer: state.prompts.tokenizer_arc(),
            include_usage,
        },
        logprobs: logprobs.is_some(),
        echo: echoed,
        offsets: vec![0; n],
    };
    let job = Job {
        id: ctx.id,
        prompt,
        params,
        n,
    };
    let prepared = Prepared {
        job,
        format,
        stream,
    };
    let response = respond(&state, &ctx, outcome, prepared).await?;
    Ok(name_ignored(response, &ignored))
}

#[derive(Serialize)]
struct Completion<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<Choice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Option<UsageBody>>,
}

#[derive(Serialize)]
struct Choice<'a> {
    index: usize,
    text: &'a str,
    logprobs: Option<Logprobs>,
    finish_reason: Option<&'static str>,
}

/// `logprobs` of a completion choice (the legacy format).
#[derive(Default, Serialize)]
struct Logprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<f32>,
    top_logprobs: Vec<BTreeMap<String, f32>>,
    text_offset: Vec<usize>,
}

pub(crate) struct CompletionFormat {
    meta: Meta,
    logprobs: bool,
    /// The prompt text, with `echo`.
    echo: Option<String>,
    /// Per choice: character offset of the next token's text (`text_offset`).
    offsets: Vec<usize>,
}

impl CompletionFormat {
    /// Appends token `t` to `lp`, advancing `offset` by its text.
    fn push_token(&self, lp: &mut Logprobs, t: &TokenEvent, offset: &mut usize) {
        let (text, _) = self.meta.token_text(t.token);
        lp.text_offset.push(*offset);
        *offset += text.chars().count();
        lp.tokens.push(text);
        lp.token_logprobs.push(t.logprob.unwrap_or(f32::NAN));
        lp.top_logprobs.push(
            t.top_logprobs
                .iter()
                .map(|&(id, logprob)| (self.meta.token_text(id).0, logprob))
                .collect(),
        );
    }

    fn echo_chars(&self) -> usize {
        self.echo.as_deref().map_or(0, |e| e.chars().count())
    }

    fn chunk_json(&self, choices: Vec<Choice<'_>>, usage: Option<Option<UsageBody>>) -> String {
        to_json(&Completion {
            id: &self.meta.id,
            object: "text_completion",
            created: self.meta.created,
            model: &self.meta.model,
            choices,
            usage,
        })
    }
}

impl Format for CompletionFormat {
    fn opening_chunks(&mut self, choices: usize) -> Vec<Chunk> {
        let Some(echo) = self.echo.as_deref() else {
            return Vec::new();
        };
        let start = self.echo_chars();
        self.offsets.iter_mut().for_each(|o| *o = start);
        (0..choices)
            .map(|index| {
                let choice = Choice {
                    index,
                    text: echo,
                    logprobs: None,
                    finish_reason: None,
                };
                Chunk::from(self.chunk_json(vec![choice], self.meta.chunk_usage()))
            })
            .collect()
    }

    fn chunk(
        &mut self,
        index: usize,
        text: &str,
        token: Option<&TokenEvent>,
        finish: Option<FinishReason>,
    ) -> Vec<Chunk> {
        let logprobs = match token.filter(|_| self.logprobs) {
            Some(t) => {
                let mut lp = Logprobs::default();
                let mut offset = self.offsets.get(index).copied().unwrap_or(0);
                self.push_token(&mut lp, t, &mut offset);
                if let Some(o) = self.offsets.get_mut(index) {
                    *o = offset;
                }
                Some(lp)
            }
            None => None,
        };
        let choice = Choice {
            index,
            text,
            logprobs,
            finish_reason: finish.map(finish_reason),
        };
        let json = self.chunk_json(vec![choice], self.meta.chunk_usage());
        vec![json.into()]
    }

    fn closing_chunks(&mut self, usage: &Usage) -> Vec<Chunk> {
        if !self.meta.include_usage {
            return Vec::new();
        }
        let json = self.chunk_json(Vec::new(), Some(Some(usage.into())));
        vec![json.into()]
    }

    fn complete(&mut self, choices: Vec<ChoiceOutput>, usage: &Usage) -> String {
        let texts: Vec<String> = choices
            .iter()
            .map(|c| format!("{}{}", self.echo.as_deref().unwrap_or(""), c.text))
            .collect();
        let out = choices
            .iter()
            .zip(&texts)
            .enumerate()
            .map(|(index, (c, text))| Choice {
                index,
                text,
                logprobs: self.logprobs.then(|| {
                    let mut lp = Logprobs::default();
                    let mut offset = self.echo_chars();
                    for t in &c.tokens {
                        self.push_token(&mut lp, t, &mut offset);
                    }
                    lp
                }),
                finish_reason: c.finish.map(finish_reason),
            })
            .collect();
        let body = Completion {
            id: &self.meta.id,
            object: "text_completion",
            created: self.meta.created,
            model: &self.meta.model,
            choices: out,
            usage: Some(Some(usage.into())),
        };
        to_json(&body)
    }

    fn logprobs(&self) -> bool {
        self.logprobs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prompt_shapes() {
        assert_eq!(
            prompt_in(json!("hi"), 10).unwrap(),
            PromptIn::Text("hi".into())
        );
        assert_eq!(
            prompt_in(json!(["hi"]), 10).unwrap(),
            PromptIn::Text("hi".into())
        );
        assert_eq!(
            prompt_in(json!([1, 2]), 10).unwrap(),
            PromptIn::Tokens(vec![1, 2])
        );
        assert_eq!(
            prompt_in(json!([[3]]), 10).unwrap(),
            PromptIn::Tokens(vec![3])
        );
        for bad in [
            json!([]),
            json!(3),
            json!([1, "a"]),
            json!([10]),
            json!([-1]),
            json!({}),
        ] {
            assert_eq!(
                prompt_in(bad.clone(), 10).unwrap_err().param(),
                Some("prompt"),
                "{bad}"
            );
        }
        assert!(matches!(
            prompt_in(json!(["a", "b"]), 10),
            Err(ApiError::UnsupportedParameter { .. })
        ));
    }
}
