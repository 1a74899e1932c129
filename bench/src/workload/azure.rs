//! The Azure LLM inference trace 2023 (conversation part): a CSV of
//! `TIMESTAMP,ContextTokens,GeneratedTokens`, one request a line, timestamps like
//! `2023-11-16 18:15:46.6805900` (UTC, to 100 ns).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::time::Duration;

use super::text::PromptMaker;
use super::{line_error, open, scaled, WorkItem, WorkloadError, WorkloadOptions};
use crate::trace::{read_bounded_line, MAX_LINE_BYTES};

/// The conversation trace bundled with the repository, built into the binary like
/// [`crate::trace::BUNDLED_TRACE`].
pub const BUNDLED_AZURE_TRACE: &str = include_str!("../../../data/traces/azure_llm_conv_2023.csv");

/// Where the bundled trace lives in the repository (its source and licence: `data/README.md`).
pub const BUNDLED_AZURE_TRACE_PATH: &str = "data/traces/azure_llm_conv_2023.csv";

/// One request of the trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AzureRecord {
    /// Nanoseconds since 1970-01-01 00:00 (only differences matter).
    pub timestamp_ns: u64,
    pub context_tokens: u64,
    pub generated_tokens: u64,
}

/// Parses the CSV (its header names the columns, in any order); errors name `file` and the
/// 1-based line. Blank lines are skipped.
pub fn parse_azure<R: BufRead>(
    mut reader: R,
    file: &str,
) -> Result<Vec<AzureRecord>, WorkloadError> {
    let malformed = |line, message: String| WorkloadError::Malformed {
        file: file.to_owned(),
        line,
        message,
    };
    let mut buf = Vec::new();
    let mut records = Vec::new();
    let mut columns: Option<[usize; 3]> = None;
    let mut line = 0;
    loop {
        line += 1;
        if !read_bounded_line(&mut reader, &mut buf, MAX_LINE_BYTES)
            .map_err(|e| line_error(file, line, e))?
        {
            break;
        }
        let text = std::str::from_utf8(&buf)
            .map_err(|_| malformed(line, "not UTF-8".into()))?
            .trim();
        if text.is_empty() {
            continue;
        }
        let fields: Vec<&str> = text.split(',').map(str::trim).collect();
        let Some(cols) = columns else {
            let find = |name: &str| {
                fields.iter().position(|f| *f == name).ok_or_else(|| {
                    malformed(
                        line,
                        format!("the header lacks {name} (expected TIMESTAMP,ContextTokens,GeneratedTokens)"),
                    )
                })
            };
            columns = Some([
                find("TIMESTAMP")?,
                find("ContextTokens")?,
                find("GeneratedTokens")?,
            ]);
            continue;
        };
        let field = |i: usize| {
            fields
                .get(cols[i])
                .copied()
                .ok_or_else(|| malformed(line, format!("expected {} fields", fields.len().max(3))))
        };
        let timestamp_ns = parse_timestamp(field(0)?).ok_or_else(|| {
            malformed(line, format!("bad timestamp `{}`", field(0).unwrap_or("")))
        })?;
        let count = |i: usize, name: &str| -> Result<u64, WorkloadError> {
            let v = field(i)?;
            match v.parse::<u64>() {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(malformed(
                    line,
                    format!("{name} `{v}` must be a whole number, at least 1"),
                )),
            }
        };
        records.push(AzureRecord {
            timestamp_ns,
            context_tokens: count(1, "ContextTokens")?,
            generated_tokens: count(2, "GeneratedTokens")?,
        });
    }
    Ok(records)
}

/// The bundled trace's records.
pub(super) fn bundled_azure() -> Result<Vec<AzureRecord>, WorkloadError> {
    parse_azure(BUNDLED_AZURE_TRACE.as_bytes(), BUNDLED_AZURE_TRACE_PATH)
}

/// `azure[:PATH]` requests: the first `opts.requests` in arrival order, `at` from the first.
pub(super) fn items(
    path: Option<&Path>,
    scale: f64,
    opts: &WorkloadOptions,
) -> Result<Vec<WorkItem>, WorkloadError> {
    let mut records = match path {
        None => bundled_azure()?,
        Some(p) => parse_azure(BufReader::new(open(p)?), &p.display().to_string())?,
    };
    // Stable, so ties keep the file's order.
    records.sort_by_key(|r| r.timestamp_ns);
    records.truncate(opts.requests);
    let first = records.first().map_or(0, |r| r.timestamp_ns);
    let mut maker = PromptMaker::new(opts.api, opts.seed, opts.token_ids.clone(), None);
    Ok(records
        .iter()
        .map(|r| WorkItem {
            prompt: maker.make(scaled(r.context_tokens, scale)),
            max_tokens: opts.cap_output(scaled(r.generated_tokens, scale)),
            at: Some(Duration::from_nanos(r.timestamp_ns - first)),
            previous_turn: None,
            hash_ids: Vec::new(),
        })
        .collect())
}

/// `YYYY-MM-DD HH:MM:SS[.fraction]` (or with a `T`) to nanoseconds since 1970.
fn parse_timestamp(s: &str) -> Option<u64> {
    let (date, time) = s.split_once([' ', 'T'])?;
    let mut d = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    if !(1..=12).contains(&m) || !(1..=31).contains(&day) {
        return None;
    }
    let (hms, fraction) = time.split_once('.').unwrap_or((time, ""));
    let mut t = hms.splitn(3, ':').map(|p| p.parse::<u64>().ok());
    let (h, min, sec) = (t.next()??, t.next()??, t.next()??);
    if h > 23 || min > 59 || sec > 60 || fraction.len() > 9 {
        return None;
    }
    let nanos = if fraction.is_empty() {
        0
    } else {
        if !fraction.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        fraction.parse::<u64>().ok()? * 10u64.pow(9 - fraction.len() as u32)
    };
    let days = u64::try_from(days_from_civil(y, m, day)).ok()?;
    Some(((days * 86_400 + h * 3600 + min * 60 + sec) * 1_000_000_000) + nanos)
}

/// Days from 1970-01-01 to a proleptic Gregorian date (eras of 400 years, March-based years so
/// the leap day falls last).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let year_of_era = y - era * 400;
    let month_from_march = (m + 9) % 12;
    let day_of_year = (153 * month_from_march + 2) / 5 + d - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_parse_to_nanoseconds() {
        assert_eq!(parse_timestamp("1970-01-01 00:00:00"), Some(0));
        assert_eq!(
            parse_timestamp("1970-01-02 00:00:01.5"),
            Some(86_401_500_000_000)
        );
        let a = parse_timestamp("2023-11-16 23:59:59.9999999").unwrap();
        let b = parse_timestamp("2023-11-17 00:00:00.0000000").unwrap();
        assert_eq!(b - a, 100);
        // 2024 is a leap year: Feb 28 to Mar 1 is two days.
        let feb = parse_timestamp("2024-02-28 00:00:00").unwrap();
        let mar = parse_timestamp("2024-03-01 00:00:00").unwrap();
        assert_eq!(mar - feb, 2 * 86_400 * 1_000_000_000);
        assert_eq!(
            parse_timestamp("2023-11-16 18:15:46.6805900").unwrap() / 1_000_000_000,
            1_700_158_546
        );
        for bad in [
            "",
            "2023-11-16",
            "2023-13-01 00:00:00",
            "2023-11-16 25:00:00",
            "x y",
        ] {
            assert_eq!(parse_timestamp(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_bundled_trace_parses() {
        let records = bundled_azure().unwrap();
        assert_eq!(records.len(), 19_366);
        assert_eq!(records[0].context_tokens, 374);
        assert_eq!(records[0].generated_tokens, 44);
    }

    #[test]
    fn bad_rows_are_named() {
        let csv = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6,10,5\n\n2023-11-16 18:15:47,0,5\n";
        let err = parse_azure(csv.as_bytes(), "t.csv")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("t.csv line 4: ContextTokens `0`"), "{err}");
        let err = parse_azure("a,b\n".as_bytes(), "t.csv")
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 1: the header lacks TIMESTAMP"), "{err}");
        let csv = "GeneratedTokens,TIMESTAMP,ContextTokens\n7,2023-11-16 18:15:46,3\n";
        let r = parse_azure(csv.as_bytes(), "t.csv").unwrap();
        assert_eq!((r[0].context_tokens, r[0].generated_tokens), (3, 7));
    }
}
