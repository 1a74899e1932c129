//! Requests as CSV, one line each (`--requests-csv`): the one definition of its columns.
//! Times from the run's start in seconds, latencies in milliseconds; a missing value is an
//! empty field.

use std::fmt::Write;
use std::time::Duration;

use crate::slo::RequestOutcome;

/// The columns after the label's.
const COLUMNS: &str = "item,sent_s,ended_s,status,error,ttft_ms,e2e_ms,tpot_ms,max_itl_ms,gaps,\
prompt_tokens,cached_tokens,output_tokens";

/// The header line (no newline), its first column named `label` (a policy, a run).
pub fn header(label: &str) -> String {
    format!("{},{COLUMNS}", field(label))
}

/// Appends one line (no newline) for `o` to `out`: its first field `label`, its gaps field
/// `gaps` (the outcome's own count, or one kept without the list: a simulated request keeps
/// only its longest gap). Appending spares a file of a million lines a string a line.
pub fn push_row(out: &mut String, label: &str, o: &RequestOutcome, gaps: usize) {
    out.push_str(&field(label));
    let _ = write!(out, ",{},", o.item);
    micros(out, o.sent, Unit::Seconds);
    out.push(',');
    micros(out, o.ended, Unit::Seconds);
    out.push(',');
    if let Some(status) = o.status {
        let _ = write!(out, "{status}");
    }
    // Error kinds are fixed words and `http_<status>`: nothing to quote.
    let _ = write!(out, ",{},", o.error.as_deref().unwrap_or(""));
    let ms = |out: &mut String, d: Option<Duration>| {
        if let Some(d) = d {
            micros(out, d, Unit::Millis);
        }
        out.push(',');
    };
    ms(out, o.ttft);
    ms(out, o.e2e);
    if let Some(s) = o.tpot_s() {
        let _ = write!(out, "{:.3}", s * 1e3);
    }
    out.push(',');
    ms(out, o.longest_gap());
    let _ = write!(out, "{gaps},");
    for tokens in [o.prompt_tokens, o.cached_tokens] {
        if let Some(n) = tokens {
            let _ = write!(out, "{n}");
        }
        out.push(',');
    }
    let _ = write!(out, "{}", o.output_tokens);
}

/// Seconds or milliseconds, to the microsecond.
#[derive(Clone, Copy)]
enum Unit {
    Seconds,
    Millis,
}

/// Writes `d` as `{:.6}` writes it in seconds, or `{:.3}` in milliseconds: in whole
/// microseconds from its integer nanoseconds where the float's rounding cannot differ from
/// theirs (no tie at half a microsecond, under 2^16 s, where the float is within a
/// hundredth of a nanosecond), through the float otherwise. A simulated hour writes a
/// million lines, and formatting floats was most of their cost.
fn micros(line: &mut String, d: Duration, unit: Unit) {
    let (per_unit, digits) = match unit {
        Unit::Seconds => (1_000_000, 6),
        Unit::Millis => (1_000, 3),
    };
    let rest = d.subsec_nanos() % 1_000;
    if d.as_secs() < 1 << 16 && rest != 500 {
        let micros = d.as_secs() * 1_000_000 + u64::from(d.subsec_micros() + u32::from(rest > 500));
        let _ = write!(line, "{}.{:0digits$}", micros / per_unit, micros % per_unit);
        return;
    }
    let _ = match unit {
        Unit::Seconds => write!(line, "{:.6}", d.as_secs_f64()),
        Unit::Millis => write!(line, "{:.3}", d.as_secs_f64() * 1e3),
    };
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
    use proptest::prelude::*;

    proptest! {
        /// To the character what formatting the float writes, at and around the ties at
        /// half a microsecond and far beyond an hour.
        #[test]
        fn micros_are_written_as_the_float_formats_them(
            secs in prop_oneof![0u64..4_000, 0u64..1 << 20, Just(65_535u64), Just(65_536u64)],
            whole in 0u32..1_000_000,
            rest in prop_oneof![0u32..1_000, 499u32..=501],
        ) {
            let d = Duration::new(secs, whole * 1_000 + rest);
            let (mut s, mut ms) = (String::new(), String::new());
            micros(&mut s, d, Unit::Seconds);
            micros(&mut ms, d, Unit::Millis);
            prop_assert_eq!(s, format!("{:.6}", d.as_secs_f64()));
            prop_assert_eq!(ms, format!("{:.3}", d.as_secs_f64() * 1e3));
        }
    }

    const MS: fn(u64) -> Duration = Duration::from_millis;

    fn row(label: &str, o: &RequestOutcome) -> String {
        let mut line = String::new();
        push_row(&mut line, label, o, o.gaps.len());
        line
    }

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
