//! What a replay measured, summarized.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::Serialize;

use crate::load::Run;
use crate::slo::{Class, RequestOutcome};
use crate::stats::{percentile, sorted};

/// The client's view of a replay. Times are in seconds; a percentile is `null` when no
/// request completed.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReplayReport {
    /// Requests sent.
    pub requests: usize,
    /// Requests whose stream ended with `[DONE]`.
    pub completed: usize,
    /// Failed requests by cause: an HTTP status (`http_429`), or `connect`, `http`,
    /// `timeout`, `stream_error` (an error event mid-stream), `bad_event`, `truncated`.
    pub errors: BTreeMap<String, usize>,
    /// The first message seen for each cause in `errors`.
    pub error_examples: BTreeMap<String, String>,
    /// Requests that found `max_concurrency` requests in flight and waited.
    pub waited_for_concurrency: usize,
    /// Follow-up turns that were due before the turn they follow had ended, and waited.
    pub held_for_previous_turn: usize,
    /// How late the latest request left its schedule (the sender's own lag).
    pub max_send_lateness_s: f64,
    /// Summed over completed requests that reported usage.
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub output_tokens: u64,
    /// `cached_tokens / prompt_tokens`: the prefix-cache hit rate the router reported.
    pub prefix_hit_rate: f64,
    /// The trace's best case: the fraction of prompt blocks seen in an earlier request.
    pub ideal_hit_rate: f64,
    pub ttft_p50_s: Option<f64>,
    pub ttft_p90_s: Option<f64>,
    pub ttft_p99_s: Option<f64>,
    pub ttft_mean_s: Option<f64>,
    /// The TTFT median of the requests served mostly (at least half their prompt) from the
    /// prefix cache, and of the others, with their counts: a policy's median over all
    /// requests falls in one group or the other as its share of hits crosses one half.
    pub ttft_p50_hits_s: Option<f64>,
    pub hits: usize,
    pub ttft_p50_misses_s: Option<f64>,
    pub misses: usize,
    pub e2e_p50_s: Option<f64>,
    pub e2e_p99_s: Option<f64>,
    /// Output tokens of completed requests per second of the run.
    pub output_tokens_per_s: f64,
    /// Completed requests per second of the run.
    pub request_rate: f64,
    /// The schedule's rate: (requests - 1) / (last send time - first send time).
    pub offered_rate: f64,
    /// From the first send to the end of the last request.
    pub duration_s: f64,
    /// Every request, in the order it was sent (for `--requests-csv`; not in the JSON
    /// summary).
    #[serde(skip)]
    pub per_request: Vec<RequestOutcome>,
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// The report of `run`, whose requests' blocks allow `ideal_hit_rate` and whose schedule
/// spans `offered_span` from its first send to its last.
pub(crate) fn summarize(run: Run, ideal_hit_rate: f64, offered_span: Duration) -> ReplayReport {
    let mut errors = BTreeMap::new();
    let (mut prompt_tokens, mut cached_tokens, mut output_tokens) = (0, 0, 0);
    let (mut ttfts, mut e2es) = (Vec::new(), Vec::new());
    let (mut hit_ttfts, mut miss_ttfts) = (Vec::new(), Vec::new());
    for o in &run.outcomes {
        if o.class() != Class::Ok {
            let kind = o.error.clone().unwrap_or_else(|| "unknown".into());
            *errors.entry(kind).or_insert(0) += 1;
            continue;
        }
        let usage = o
            .prompt_tokens
            .map(|p| (p, o.cached_tokens.unwrap_or(0).min(p)));
        ttfts.extend(o.ttft.map(|t| t.as_secs_f64()));
        if let (Some(t), Some((prompt, cached))) = (o.ttft, usage) {
            let group = if 2 * cached >= prompt && prompt > 0 {
                &mut hit_ttfts
            } else {
                &mut miss_ttfts
            };
            group.push(t.as_secs_f64());
        }
        e2es.extend(o.e2e.map(|t| t.as_secs_f64()));
        output_tokens += o.output_tokens;
        if let Some((prompt, cached)) = usage {
            prompt_tokens += prompt;
            cached_tokens += cached;
        }
    }
    let completed = e2es.len();
    let duration = run.duration.as_secs_f64();
    let ttft_mean_s = (!ttfts.is_empty()).then(|| ttfts.iter().sum::<f64>() / ttfts.len() as f64);
    let (hits, misses) = (hit_ttfts.len(), miss_ttfts.len());
    let (ttfts, e2es) = (sorted(ttfts), sorted(e2es));
    let mut error_examples = run.error_examples;
    error_examples.retain(|kind, _| errors.contains_key(kind));
    ReplayReport {
        requests: run.outcomes.len(),
        completed,
        errors,
        error_examples,
        waited_for_concurrency: run.waited,
        held_for_previous_turn: run.held,
        max_send_lateness_s: run.max_lateness.as_secs_f64(),
        prompt_tokens,
        cached_tokens,
        output_tokens,
        prefix_hit_rate: ratio(cached_tokens as f64, prompt_tokens as f64),
        ideal_hit_rate,
        ttft_p50_s: percentile(&ttfts, 50.0),
        ttft_p90_s: percentile(&ttfts, 90.0),
        ttft_p99_s: percentile(&ttfts, 99.0),
        ttft_mean_s,
        ttft_p50_hits_s: percentile(&sorted(hit_ttfts), 50.0),
        hits,
        ttft_p50_misses_s: percentile(&sorted(miss_ttfts), 50.0),
        misses,
        e2e_p50_s: percentile(&e2es, 50.0),
        e2e_p99_s: percentile(&e2es, 99.0),
        output_tokens_per_s: ratio(output_tokens as f64, duration),
        request_rate: ratio(completed as f64, duration),
        offered_rate: ratio(
            run.outcomes.len().saturating_sub(1) as f64,
            offered_span.as_secs_f64(),
        ),
        duration_s: duration,
        per_request: run.outcomes,
    }
}

/// Milliseconds, or `-` for no value.
fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |s| format!("{:.1} ms", s * 1000.0))
}

impl ReplayReport {
    /// Failed requests, all causes together.
    pub fn failed(&self) -> usize {
        self.errors.values().sum()
    }
}

/// A two-column table for people.
impl fmt::Display for ReplayReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rows: Vec<(&str, String)> = vec![
            (
                "requests",
                format!(
                    "{} sent, {} completed, {} failed",
                    self.requests,
                    self.completed,
                    self.failed()
                ),
            ),
            (
                "rate",
                format!(
                    "{:.2} req/s offered, {:.2} req/s completed",
                    self.offered_rate, self.request_rate
                ),
            ),
            ("duration", format!("{:.2} s", self.duration_s)),
            (
                "TTFT p50 / p90 / p99",
                format!(
                    "{} / {} / {}",
                    ms(self.ttft_p50_s),
                    ms(self.ttft_p90_s),
                    ms(self.ttft_p99_s)
                ),
            ),
            ("TTFT mean", ms(self.ttft_mean_s)),
            (
                "TTFT p50, hits / misses",
                format!(
                    "{} ({}) / {} ({}); a hit: half the prompt or more cached",
                    ms(self.ttft_p50_hits_s),
                    self.hits,
                    ms(self.ttft_p50_misses_s),
                    self.misses
                ),
            ),
            (
                "end-to-end p50 / p99",
                format!("{} / {}", ms(self.e2e_p50_s), ms(self.e2e_p99_s)),
            ),
            (
                "output",
                format!(
                    "{} tokens, {:.1} tok/s",
                    self.output_tokens, self.output_tokens_per_s
                ),
            ),
            (
                "prefix hit rate",
                format!(
                    "{:.1}% ({} of {} prompt tokens cached; trace ideal {:.1}%)",
                    self.prefix_hit_rate * 100.0,
                    self.cached_tokens,
                    self.prompt_tokens,
                    self.ideal_hit_rate * 100.0
                ),
            ),
            (
                "waited for the concurrency cap",
                self.waited_for_concurrency.to_string(),
            ),
            (
                "held for the previous turn",
                self.held_for_previous_turn.to_string(),
            ),
            (
                "max send lateness",
                format!("{:.1} ms", self.max_send_lateness_s * 1000.0),
            ),
        ];
        let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        for (key, value) in rows {
            writeln!(f, "{key:<width$}  {value}")?;
        }
        for (cause, count) in &self.errors {
            let example = self.error_examples.get(cause).map_or("", String::as_str);
            let example: String = example.chars().take(120).collect();
            writeln!(
                f,
                "{:<width$}  {count}  {example}",
                format!("error {cause}")
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    fn ok(ttft_ms: u64, e2e_ms: u64, out: u64, usage: Option<(u64, u64)>) -> RequestOutcome {
        RequestOutcome {
            ended: MS(e2e_ms),
            status: Some(200),
            ttft: Some(MS(ttft_ms)),
            e2e: Some(MS(e2e_ms)),
            output_tokens: out,
            prompt_tokens: usage.map(|u| u.0),
            cached_tokens: usage.map(|u| u.1),
            ..RequestOutcome::default()
        }
    }

    fn shed(item: usize, sent_ms: u64) -> RequestOutcome {
        RequestOutcome {
            item,
            sent: MS(sent_ms),
            ended: MS(sent_ms + 5),
            status: Some(429),
            error: Some("http_429".into()),
            ..RequestOutcome::default()
        }
    }

    #[test]
    fn summarizes_successes_and_failures() {
        let run = Run {
            outcomes: vec![
                ok(100, 1000, 10, Some((100, 50))),
                ok(300, 2000, 30, Some((100, 0))),
                ok(200, 500, 20, None),
                shed(3, 3),
                shed(4, 5),
            ],
            duration: MS(2000),
            max_lateness: MS(1),
            waited: 1,
            held: 1,
            error_examples: BTreeMap::from([
                ("http_429".to_string(), "busy".to_string()),
                (
                    "timeout".to_string(),
                    "not in this run's errors".to_string(),
                ),
            ]),
            ..Run::default()
        };
        let r = summarize(run, 0.25, Duration::from_secs(2));
        assert_eq!((r.requests, r.completed, r.failed()), (5, 3, 2));
        assert_eq!(r.errors, BTreeMap::from([("http_429".to_string(), 2)]));
        assert_eq!(
            r.error_examples,
            BTreeMap::from([("http_429".to_string(), "busy".to_string())])
        );
        assert_eq!(r.waited_for_concurrency, 1);
        assert_eq!(r.held_for_previous_turn, 1);
        assert_eq!(r.max_send_lateness_s, 0.001);
        assert_eq!(
            (r.prompt_tokens, r.cached_tokens, r.output_tokens),
            (200, 50, 60)
        );
        assert_eq!(r.prefix_hit_rate, 0.25);
        assert_eq!(r.ttft_p50_s, Some(0.2));
        assert!((r.ttft_mean_s.unwrap() - 0.2).abs() < 1e-12);
        // Half of the first prompt was cached (a hit), none of the second; the third
        // reported no usage and counts in neither group.
        assert_eq!((r.ttft_p50_hits_s, r.hits), (Some(0.1), 1));
        assert_eq!((r.ttft_p50_misses_s, r.misses), (Some(0.3), 1));
        assert_eq!(r.e2e_p50_s, Some(1.0));
        assert_eq!(r.duration_s, 2.0);
        assert_eq!(r.output_tokens_per_s, 30.0);
        assert_eq!(r.request_rate, 1.5);
        assert_eq!(r.offered_rate, 2.0);
        let table = r.to_string();
        assert!(table.contains("25.0% (50 of 200"), "{table}");
        assert!(table.contains("error http_429 "), "{table}");
        assert!(table.contains(" 2  busy"), "{table}");
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["errors"]["http_429"], 2);
        assert!(json.get("per_request").is_none());
        // Every request, failures too.
        assert_eq!(r.per_request.len(), 5);
        assert_eq!(r.per_request[4].item, 4);
    }

    #[test]
    fn nothing_completed() {
        let r = summarize(Run::default(), 0.0, Duration::ZERO);
        assert_eq!(r.ttft_p99_s, None);
        assert_eq!(
            (r.prefix_hit_rate, r.request_rate, r.offered_rate),
            (0.0, 0.0, 0.0)
        );
        assert!(r.to_string().contains("TTFT p50 / p90 / p99"));
    }
}
