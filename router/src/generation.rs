//! One completion request against the backend: fan out `n` backend requests, then merge
//! their event streams into [`Update`]s with token metrics and usage accounting.
//!
//! A [`Generation`] owns the receivers and nothing else does (no spawned task): dropping it
//! (the response body went away, or the handler future was dropped) cancels every choice.

use futures::stream::{self, BoxStream, SelectAll, StreamExt};
use kvmesh_common::{
    FinishReason, GenerateEvent, GenerateRequest, RequestId, SamplingParams, TokenEvent, TokenId,
    Usage, WorkerError,
};
use tokio::sync::{mpsc, watch};

use crate::admission::Ticket;
use crate::backend::Backend;
use crate::error::ApiError;
use crate::metrics::{metrics, TokenTimer};

/// What the client asked for, ready for the backend.
pub(crate) struct Job {
    pub(crate) id: RequestId,
    pub(crate) prompt: Vec<TokenId>,
    pub(crate) params: SamplingParams,
    pub(crate) n: usize,
}

/// The id and seed of choice `index`: choice 0 keeps the request's own, the others get
/// distinct ones derived from them (so `n` choices with a seed are reproducible, yet differ).
fn choice_request(job: &Job, index: usize) -> GenerateRequest {
    let mix = |x: u64| xxhash_rust::xxh3::xxh3_64_with_seed(&(index as u64).to_le_bytes(), x);
    let mut params = job.params.clone();
    let mut id = job.id;
    if index > 0 {
        id = RequestId(mix(job.id.0));
        params.seed = params.seed.map(mix);
    }
    GenerateRequest {
        request_id: id,
        prompt: job.prompt.clone(),
        params,
        resume: Vec::new(),
    }
}

/// Starts all choices; if any fails to start, the started ones are dropped (cancelled).
/// `abort` turning true (shutdown timed out) ends the generation with a 503. The admission
/// `ticket` learns of the first token and is released when the generation is dropped.
pub(crate) async fn start(
    backend: &dyn Backend,
    job: Job,
    ticket: Ticket,
    started: std::time::Instant,
    retry_after_secs: u64,
    abort: watch::Receiver<bool>,
) -> Result<Generation, ApiError> {
    let requests: Vec<_> = (0..job.n).map(|i| choice_request(&job, i)).collect();
    let receivers =
        futures::future::try_join_all(requests.into_iter().map(|r| backend.generate(r)))
            .await
            .map_err(|e| {
                if matches!(e, WorkerError::Overloaded(_)) {
                    metrics().rejected("backend_overloaded");
                }
                ApiError::from_worker(e, retry_after_secs)
            })?;
    metrics().prompt_tokens.increment(job.prompt.len() as u64);
    Ok(Generation::new(
        receivers,
        ticket,
        job.prompt.len(),
        started,
        retry_after_secs,
        abort,
    ))
}

/// One step of a generation.
#[derive(Debug)]
pub(crate) enum Update {
    Token {
        index: usize,
        token: TokenEvent,
    },
    /// Choice `index` ended; `text` is what the backend held back until now.
    Finished {
        index: usize,
        reason: FinishReason,
        text: String,
    },
}

/// The merged event streams of all choices of one request.
pub(crate) struct Generation {
    events: SelectAll<BoxStream<'static, (usize, Option<GenerateEvent>)>>,
    finished: Vec<bool>,
    remaining: usize,
    timer: TokenTimer,
    ticket: Ticket,
    prompt_tokens: usize,
    completion_tokens: Vec<u32>,
    cached_tokens: u32,
    retry_after_secs: u64,
    abort: watch::Receiver<bool>,
}

/// Events of one choice, `None` once if the channel closes before a final event; the
/// receiver is dropped right after the final event.
fn choice_events(
    index: usize,
    rx: mpsc::UnboundedReceiver<GenerateEvent>,
) -> BoxStream<'static, (usize, Option<GenerateEvent>)> {
    stream::unfold(Some(rx), move |rx| async move {
        let mut rx = rx?;
        match rx.recv().await {
            Some(ev @ GenerateEvent::Token(_)) => Some(((index, Some(ev)), Some(rx))),
            Some(ev) => Some(((index, Some(ev)), None)),
            None => Some(((index, None), None)),
        }
    })
    .boxed()
}

impl Generation {
    fn new(
        receivers: Vec<mpsc::UnboundedReceiver<GenerateEvent>>,
        ticket: Ticket,
        prompt_tokens: usize,
        started: std::time::Instant,
        retry_after_secs: u64,
        abort: watch::Receiver<bool>,
    ) -> Self {
        let n = receivers.len();
        Generation {
            events: stream::select_all(
                receivers
                    .into_iter()
                    .enumerate()
                    .map(|(i, rx)| choice_events(i, rx)),
            ),
            finished: vec![false; n],
            remaining: n,
            timer: TokenTimer::new(started, n),
            ticket,
            prompt_tokens,
            completion_tokens: vec![0; n],
            cached_tokens: 0,
            retry_after_secs,
            abort,
        }
    }

    pub(crate) fn choices(&self) -> usize {
        self.finished.len()
    }

    /// The next update; `None` once every choice finished. After an `Err` the generation
    /// is over (drop it to cancel the other choices).
    pub(crate) async fn next(&mut self) -> Option<Result<Update, ApiError>> {
        while self.remaining > 0 {
            let aborted = async {
                let signalled = self.abort.wait_for(|&abort| abort).await.is_ok();
                if !signalled {
                    // The router is gone; nobody can abort any more.
                    std::future::pending::<()>().await;
                }
            };
            let (index, event) = tokio::select! {
                item = self.events.next() => item?,
                () = aborted => {
                    self.remaining = 0;
                    return Some(Err(ApiError::Unavailable {
                        message: "the server is shutting down".into(),
                        retry_after_secs: self.retry_after_secs,
                    }));
                }
            };
            match event {
                Some(GenerateEvent::Token(token)) => {
                    self.timer.token(index);
                    self.ticket.first_token();
                    self.completion_tokens[index] += 1;
                    return Some(Ok(Update::Token { index, token }));
                }
                Some(GenerateEvent::Finished {
                    reason,
                    text,
                    usage,
                }) => {
                    self.remaining -= 1;
                    self.finished[index] = true;
                    self.completion_tokens[index] =
                        self.completion_tokens[index].max(usage.completion_tokens);
                    let cached = usage.cached_tokens.min(self.prompt_tokens as u32);
                    if cached > self.cached_tokens {
                        metrics()
                            .prompt_cached_tokens
                            .increment(u64::from(cached - self.cached_tokens));
                        self.cached_tokens = cached;
                    }
                    if reason == FinishReason::Cancelled {
                        self.remaining = 0;
                        return Some(Err(ApiError::Unavailable {
                            message: "the request was aborted by the backend".into(),
                            retry_after_secs: self.retry_after_secs,
                        }));
                    }
                    return Some(Ok(Update::Finished {
                        index,
                        reason,
                        text,
                    }));
                }
                Some(GenerateEvent::Error(e)) => {
                    self.remaining = 0;
                    return Some(Err(ApiError::from_worker(e, self.retry_after_secs)));
                }
                None if self.finished[index] => continue,
                None => {
                    self.remaining = 0;
                    return Some(Err(ApiError::Internal(
                        "the backend closed the stream before the request finished".into(),
                    )));
                }
            }
        }
        None
    }

    /// Token counts so far: the prompt once, completions summed over choices.
    pub(crate) fn usage(&self) -> Usage {
        let prompt_tokens = self.prompt_tokens as u32;
        Usage {
            prompt_tokens,
            completion_tokens: self.completion_tokens.iter().sum(),
            cached_tokens: self.cached_tokens,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_get_distinct_ids_and_seeds() {
        let job = Job {
            id: RequestId(7),
            prompt: vec![1],
            params: SamplingParams {
                seed: Some(42),
                ..Default::default()
            },
            n: 3,
        };
        let reqs: Vec<_> = (0..3).map(|i| choice_request(&job, i)).collect();
        assert_eq!(reqs[0].request_id, RequestId(7));
        assert_eq!(reqs[0].params.seed, Some(42));
        assert_ne!(reqs[1].request_id, reqs[2].request_id);
        assert_ne!(reqs[1].params.seed, reqs[2].params.seed);
        assert_ne!(reqs[1].params.seed, Some(42));
        // Deterministic.
        assert_eq!(choice_request(&job, 2), reqs[2]);
        let unseeded = Job {
            params: SamplingParams::default(),
            ..job
        };
        assert_eq!(choice_request(&unseeded, 1).params.seed, None);
    }
}
