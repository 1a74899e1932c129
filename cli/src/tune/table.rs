//! What `kvmesh tune` prints: the plan before it starts (candidates and the schedule) and
//! the table of measurements after.

use super::halving::{Halving, Measurement};
use super::space::Candidate;
use super::Found;
use humantime_serde::re::humantime;
use std::fmt::Write;
use std::time::Duration;

/// One measurement's outcome.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub measurement: Measurement,
    /// `None` when the deployment or the search failed (`error` says why).
    pub found: Option<Found>,
    pub error: Option<String>,
    pub took: Duration,
}

impl Row {
    pub fn measured(measurement: Measurement, found: Found, took: Duration) -> Row {
        Row {
            measurement,
            found: Some(found),
            error: None,
            took,
        }
    }

    pub fn failed(measurement: Measurement, error: String, took: Duration) -> Row {
        Row {
            measurement,
            found: None,
            error: Some(error),
            took,
        }
    }

    /// The halving score: the goodput, NaN (below everything) for a failure.
    pub fn score(&self) -> f64 {
        self.found.as_ref().map_or(f64::NAN, |f| f.goodput)
    }

    /// One line: goodput, where, TTFT p99.
    pub fn summary(&self) -> String {
        match &self.found {
            None => format!(
                "failed: {}",
                self.error.as_deref().unwrap_or("no measurement")
            ),
            Some(f) => format!(
                "goodput {}{:.3} req/s at {}, TTFT p99 {}",
                if f.proven { "" } else { "~" },
                f.goodput,
                f.concurrency.map_or(
                    "no passing concurrency (unproven: probes too short)".to_string(),
                    |c| format!("concurrency {c}")
                ),
                ms(f.ttft_p99)
            ),
        }
    }
}

fn ms(seconds: Option<f64>) -> String {
    seconds.map_or("-".to_string(), |s| format!("{:.0} ms", s * 1e3))
}

fn secs(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

/// The candidates, numbered, and the rungs of the schedule.
pub fn plan(candidates: &[Candidate], schedule: &Halving) -> String {
    let mut out = format!("{} candidates:\n", candidates.len());
    for (i, c) in candidates.iter().enumerate() {
        let _ = writeln!(out, "  #{i:<3} {c}");
    }
    out.push_str("schedule (successive halving):\n");
    let planned = schedule.planned();
    let mut total = Duration::ZERO;
    for (rung, (&n, &budget)) in schedule.rung_sizes().iter().zip(&planned).enumerate() {
        total += budget * n as u32;
        let _ = writeln!(
            out,
            "  rung {rung}: {n} candidate{} x {}",
            if n == 1 { "" } else { "s" },
            humantime::format_duration(Duration::from_secs(budget.as_secs()))
        );
    }
    let _ = write!(out, "  total {}", secs(total));
    out
}

/// Every measurement, by candidate and rung, with its goodput, TTFT p99 and time.
pub fn results(candidates: &[Candidate], rows: &[Row]) -> String {
    let mut sorted: Vec<&Row> = rows.iter().collect();
    sorted.sort_by_key(|r| (r.measurement.candidate, r.measurement.rung));
    let mut out = format!(
        "(~: no probe passed; the best goodput of probes too short to tell)\n{:<4} {:<72} {:>4} {:>10} {:>6} {:>11} {:>7} {:>7}\n",
        "#", "candidate", "rung", "goodput/s", "conc", "TTFT p99", "start", "time"
    );
    for r in sorted {
        let m = r.measurement;
        let (goodput, conc, ttft, start) = match &r.found {
            Some(f) => (
                format!("{}{:.3}", if f.proven { "" } else { "~" }, f.goodput),
                f.concurrency.map_or("-".into(), |c| c.to_string()),
                ms(f.ttft_p99),
                secs(f.startup),
            ),
            None => ("failed".into(), "-".into(), "-".into(), "-".into()),
        };
        let _ = writeln!(
            out,
            "{:<4} {:<72} {:>4} {:>10} {:>6} {:>11} {:>7} {:>7}",
            format!("#{}", m.candidate),
            candidates[m.candidate].to_string(),
            m.rung,
            goodput,
            conc,
            ttft,
            start,
            secs(r.took)
        );
    }
    out
}

/// Each measured candidate's measurement at its highest rung, by candidate.
pub fn latest_per_candidate(rows: &[Row]) -> Vec<&Row> {
    let mut latest: Vec<&Row> = Vec::new();
    for r in rows {
        match latest
            .iter_mut()
            .find(|l| l.measurement.candidate == r.measurement.candidate)
        {
            Some(l) if l.measurement.rung < r.measurement.rung => *l = r,
            Some(_) => {}
            None => latest.push(r),
        }
    }
    latest.sort_by_key(|r| r.measurement.candidate);
    latest
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tune::space::SearchSpace;

    fn row(candidate: usize, rung: usize, goodput: f64) -> Row {
        let found = Found {
            goodput,
            concurrency: Some(4),
            proven: true,
            ttft_p99: Some(0.25),
            startup: Duration::from_secs(2),
            probe: Duration::from_secs(5),
            probes: 3,
        };
        let m = Measurement {
            candidate,
            rung,
            budget: Duration::from_secs(20),
        };
        Row::measured(m, found, Duration::from_secs(21))
    }

    #[test]
    fn the_table_lists_every_measurement_by_candidate() {
        let candidates = SearchSpace::for_nodes(2).candidates();
        let mut failed = row(2, 0, 0.0);
        failed.found = None;
        failed.error = Some("decode-0 exited".into());
        let mut unproven = row(0, 0, 1.5);
        if let Some(f) = unproven.found.as_mut() {
            (f.proven, f.concurrency) = (false, None);
        }
        let rows = [row(1, 0, 2.0), unproven, failed, row(1, 1, 2.5)];
        let text = results(&candidates, &rows);
        let lines: Vec<&str> = text.lines().skip(1).collect();
        assert_eq!(lines.len(), 5, "{text}");
        assert!(lines[0].contains("goodput/s") && lines[0].contains("TTFT p99"));
        assert!(lines[1].starts_with("#0 ") && lines[1].contains("~1.500"));
        assert!(rows[1].summary().contains("unproven"));
        assert!(lines[2].starts_with("#1 ") && lines[2].contains("250 ms"));
        assert!(lines[3].starts_with("#1 ") && lines[3].contains("2.500"));
        assert!(lines[4].starts_with("#2 ") && lines[4].contains("failed"));
        assert!(rows[2].score().is_nan());
        assert!(rows[2].summary().contains("decode-0 exited"));
        let latest: Vec<(usize, usize)> = latest_per_candidate(&rows)
            .iter()
            .map(|r| (r.measurement.candidate, r.measurement.rung))
            .collect();
        assert_eq!(latest, [(0, 0), (1, 1), (2, 0)]);
    }

    #[test]
    fn the_plan_shows_each_rung() {
        let candidates = SearchSpace::for_nodes(2).candidates()[..3].to_vec();
        let schedule = Halving::new(3, Duration::from_secs(70), Duration::from_secs(3)).unwrap();
        let text = plan(&candidates, &schedule);
        assert!(
            text.starts_with("3 candidates:\n  #0   serve 0p+1d"),
            "{text}"
        );
        assert!(text.contains("rung 0: 3 candidates x 10s"), "{text}");
        assert!(text.contains("rung 1: 2 candidates x 20s"), "{text}");
        assert!(text.ends_with("total 70.0s"), "{text}");
    }
}
