//! Requests as CSV, one line each (`--requests-csv`): the one definition of its columns.
//! Times from the run's start in seconds, latencies in milliseconds; a missing value is an
//! empty field.

use std::fmt::Write;
use std::time::Duration;

use crate::slo::{Objective, RequestOutcome};

/// The columns after the label's.
const COLUMNS: &str = "item,sent_s,ended_s,status,error,ttft_ms,e2e_ms,tpot_ms,max_itl_ms,gaps,\
prompt_tokens,cached_tokens,output_tokens";

/// The header line (no newline), its first column named `label` (a policy, a run).
pub fn header(label: &str) -> String {
    format!("{},{COLUMNS}", field(label))
}

/// One line (no newline) for `outcome`, its first field `label`.
pub fn row(label: &str, o: &RequestOutcome) -> String {
    fn ms(d: Option<Duration>) -> Option<String> {
        d.map(|d| format!("{:.3}", d.as_secs_f64() * 1e3))
    }
    fn opt<T: ToString>(v: Option<T>) -> String {
        v.map_or_else(String::new, |v| v.to_string())
    }
    let mut line = field(label).into_owned();
    // Error kinds are fixed words and `http_<status>`: nothing to quote.
    let _ = write!(
        line,
        ",{},{:.6},{:.6},{},{},{},{},{},{},{},{},{},{}",
        o.item,
        o.sent.as_secs_f64(),
        o.ended.as_secs_f64(),
        opt(o.status),
        o.error.as_deref().unwrap_or(""),
        opt(ms(o.ttft)),
        opt(ms(o.e2e)),
        opt(o.tpot_s().map(|s| format!("{:.3}", s * 1e3))),
        opt(o
            .statistic_s(Objective::Itl)
            .map(|s| format!("{:.3}", s * 1e3))),
        o.gaps.len(),
        opt(o.prompt_tokens),
        opt(o.cached_tokens),
        o.output_tokens,
    );
    line
}

/// `s` as one CSV field: quoted when it holds a comma, a quote or a line break.
fn field(s: &str) -> std::borrow::Cow<'_, str> {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\"")).into()
    } else {
        s.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn rows_match_the_header() {
        let done = RequestOutcome {
            item: 3,
            sent: MS(1500),
            ended: MS(1750),
            status: Some(200),
            ttft: Some(MS(50)),
            gaps: vec![MS(100), MS(100)],
            e2e: Some(MS(250)),
            prompt_tokens: Some(12),
            cached_tokens: Some(4),
            output_tokens: 3,
            ..RequestOutcome::default()
        };
        assert_eq!(
            row("kv_aware", &done),
            "kv_aware,3,1.500000,1.750000,200,,50.000,250.000,100.000,100.000,2,12,4,3"
        );
        let shed = RequestOutcome {
            item: 4,
            sent: MS(2),
            ended: MS(3),
            status: Some(429),
            error: Some("http_429".into()),
            ..RequestOutcome::default()
        };
        assert_eq!(
            row("a,\"b\"", &shed),
            "\"a,\"\"b\"\"\",4,0.002000,0.003000,429,http_429,,,,,0,,,0"
        );
        assert_eq!(
            header("policy"),
            "policy,item,sent_s,ended_s,status,error,ttft_ms,e2e_ms,tpot_ms,max_itl_ms,gaps,\
prompt_tokens,cached_tokens,output_tokens"
        );
        let columns = header("policy").split(',').count();
        assert_eq!(row("p", &done).split(',').count(), columns);
        assert_eq!(row("p", &shed).split(',').count(), columns);
    }
}
