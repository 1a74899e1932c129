//! What a replay measured, summarized.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::Serialize;

use super::client::{Failure, Measured};
use crate::stats::{percentile, sorted};

/// One request's fate.
#[derive(Debug)]
pub(crate) struct Outcome {
    /// Its place in the schedule (0 = sent first).
    pub(crate) index: usize,
    /// When it was sent (after its previous turn ended), from the start of the replay.
    pub(crate) sent: Duration,
    /// It was due before the previous turn of its conversation had ended, and waited.
    pub(crate) held: bool,
    /// It found the concurrency cap full.
    pub(crate) waited: bool,
    /// When it ended, from the start of the replay.
    pub(crate) finished: Duration,
    pub(crate) result: Result<Measured, Failure>,
}

/// The client's view of a replay. Times are in seconds; a percentile is `null` when no
/// request completed.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReplayReport {
    /// Requests sent.
    pub requests: usize,
    /// Requests whose stream ended with `[DONE]`.
    pub completed: usize,
    /// Failed requests by cause: an HTTP status (`"429"`), or `connect`, `http`,
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
    /// From the start to the end of the last request.
    pub duration_s: f64,
    /// Every request, in schedule order (for `--requests-csv`; not in the JSON summary).
    #[serde(skip)]
    pub per_request: Vec<RequestRecord>,
}

/// One request as the client saw it; times in seconds.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestRecord {
    pub index: usize,
    /// When it was sent, from the start of the replay.
    pub sent_s: f64,
    /// `(prompt_tokens, cached_tokens)` as the router reported them.
    pub usage: Option<(u64, u64)>,
    pub ttft_s: Option<f64>,
    /// End to end, for a completed request.
    pub e2e_s: Option<f64>,
    pub output_tokens: u64,
    /// The failure's label (`429`, `timeout`, ...) for one that did not complete.
    pub error: Option<String>,
}

impl RequestRecord {
    pub const CSV_HEADER: &'static str =
        "index,sent_s,prompt_tokens,cached_tokens,ttft_s,e2e_s,output_tokens,error";

    fn from_outcome(o: &Outcome) -> RequestRecord {
        let (m, error) = match &o.result {
            Ok(m) => (m.clone(), None),
            Err(f) => (Measured::default(), Some(f.label.clone())),
        };
        RequestRecord {
            index: o.index,
            sent_s: o.sent.as_secs_f64(),
            usage: m.usage,
            ttft_s: m.ttft.map(|t| t.as_secs_f64()),
            e2e_s: error.is_none().then_some(m.e2e.as_secs_f64()),
            output_tokens: m.output_tokens,
            error,
        }
    }

    /// One line matching [`Self::CSV_HEADER`]; a missing value is an empty field.
    pub fn csv_row(&self) -> String {
        fn opt<T: ToString>(v: Option<T>) -> String {
            v.map_or_else(String::new, |v| v.to_string())
        }
        // Labels are HTTP statuses or fixed words: nothing to quote.
        format!(
            "{},{:.3},{},{},{},{},{},{}",
            self.index,
            self.sent_s,
            opt(self.usage.map(|u| u.0)),
            opt(self.usage.map(|u| u.1)),
            opt(self.ttft_s.map(|t| format!("{t:.4}"))),
            opt(self.e2e_s.map(|t| format!("{t:.4}"))),
            self.output_tokens,
            self.error.as_deref().unwrap_or(""),
        )
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

pub(crate) fn summarize(
    outcomes: &[Outcome],
    ideal_hit_rate: f64,
    offered_span: Duration,
    max_lateness: Duration,
) -> ReplayReport {
    let mut errors = BTreeMap::new();
    let mut error_examples = BTreeMap::new();
    let (mut prompt_tokens, mut cached_tokens, mut output_tokens) = (0, 0, 0);
    let (mut ttfts, mut e2es) = (Vec::new(), Vec::new());
    let (mut hit_ttfts, mut miss_ttfts) = (Vec::new(), Vec::new());
    for o in outcomes {
        match &o.result {
            Ok(m) => {
                ttfts.extend(m.ttft.map(|t| t.as_secs_f64()));
                if let (Some(t), Some((prompt, cached))) = (m.ttft, m.usage) {
                    let group = if 2 * cached >= prompt && prompt > 0 {
                        &mut hit_ttfts
                    } else {
                        &mut miss_ttfts
                    };
                    group.push(t.as_secs_f64());
                }
                e2es.push(m.e2e.as_secs_f64());
                output_tokens += m.output_tokens;
                if let Some((prompt, cached)) = m.usage {
                    prompt_tokens += prompt;
                    cached_tokens += cached.min(prompt);
                }
            }
            Err(f) => {
                *errors.entry(f.label.clone()).or_insert(0) += 1;
                error_examples
                    .entry(f.label.clone())
                    .or_insert_with(|| f.message.clone());
            }
        }
    }
    let completed = e2es.len();
    let duration = outcomes
        .iter()
        .map(|o| o.finished)
        .max()
        .unwrap_or_default()
        .as_secs_f64();
    let ttft_mean_s = (!ttfts.is_empty()).then(|| ttfts.iter().sum::<f64>() / ttfts.len() as f64);
    let (hits, misses) = (hit_ttfts.len(), miss_ttfts.len());
    let (ttfts, e2es) = (sorted(ttfts), sorted(e2es));
    let mut per_request: Vec<RequestRecord> =
        outcomes.iter().map(RequestRecord::from_outcome).collect();
    per_request.sort_by_key(|r| r.index);
    ReplayReport {
        requests: outcomes.len(),
        completed,
        errors,
        error_examples,
        waited_for_concurrency: outcomes.iter().filter(|o| o.waited).count(),
        held_for_previous_turn: outcomes.iter().filter(|o| o.held).count(),
        max_send_lateness_s: max_lateness.as_secs_f64(),
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
            outcomes.len().saturating_sub(1) as f64,
            offered_span.as_secs_f64(),
        ),
        duration_s: duration,
        per_request,
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

    fn ok(ttft_ms: u64, e2e_ms: u64, out: u64, usage: Option<(u64, u64)>) -> Outcome {
        Outcome {
            index: 0,
            sent: Duration::ZERO,
            held: false,
            waited: false,
            finished: Duration::from_millis(e2e_ms),
            result: Ok(Measured {
                ttft: Some(Duration::from_millis(ttft_ms)),
                e2e: Duration::from_millis(e2e_ms),
                output_tokens: out,
                usage,
            }),
        }
    }

    #[test]
    fn summarizes_successes_and_failures() {
        let outcomes = vec![
            ok(100, 1000, 10, Some((100, 50))),
            ok(300, 2000, 30, Some((100, 0))),
            ok(200, 500, 20, None),
            Outcome {
                index: 4,
                sent: Duration::from_millis(5),
                held: true,
                waited: true,
                finished: Duration::from_millis(10),
                result: Err(Failure::new("429", "busy")),
            },
            Outcome {
                index: 3,
                sent: Duration::from_millis(3),
                held: false,
                waited: false,
                finished: Duration::from_millis(20),
                result: Err(Failure::new("429", "still busy")),
            },
        ];
        let r = summarize(&outcomes, 0.25, Duration::from_secs(2), Duration::ZERO);
        assert_eq!((r.requests, r.completed, r.failed()), (5, 3, 2));
        assert_eq!(r.errors, BTreeMap::from([("429".to_string(), 2)]));
        assert_eq!(r.error_examples["429"], "busy");
        assert_eq!(r.waited_for_concurrency, 1);
        assert_eq!(r.held_for_previous_turn, 1);
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
        assert!(table.contains("error 429"), "{table}");
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["errors"]["429"], 2);
        assert!(json.get("per_request").is_none());
        // Every request, failures too, in schedule order.
        let rows: Vec<String> = r.per_request.iter().map(RequestRecord::csv_row).collect();
        assert_eq!(rows.len(), 5);
        assert!(
            rows[0].starts_with("0,0.000,100,50,0.1000,1.0000,10,"),
            "{rows:?}"
        );
        assert_eq!(rows[3], "3,0.003,,,,,0,429");
        assert_eq!(rows[4], "4,0.005,,,,,0,429");
        let header_fields = RequestRecord::CSV_HEADER.split(',').count();
        assert!(rows.iter().all(|r| r.split(',').count() == header_fields));
    }

    #[test]
    fn nothing_completed() {
        let r = summarize(&[], 0.0, Duration::ZERO, Duration::ZERO);
        assert_eq!(r.ttft_p99_s, None);
        assert_eq!(
            (r.prefix_hit_rate, r.request_rate, r.offered_rate),
            (0.0, 0.0, 0.0)
        );
        assert!(r.to_string().contains("TTFT p50 / p90 / p99"));
    }
}
