//! What each plot shows, as data: built from the report alone.

use crate::report::{BenchReport, Cdf, LoadAxis, Point};
use crate::slo::{Objective, Summary};

use super::{Figure, Legend, LineStyle, Panel, Rule, Series};

/// Every figure of a report: latency against load, CDFs, goodput against load, and each
/// point's timeline.
pub fn figures(report: &BenchReport) -> Vec<Figure> {
    let mut out = vec![
        latency_vs_load(report),
        cdfs(report),
        goodput_vs_load(report),
    ];
    out.extend(
        report
            .points
            .iter()
            .enumerate()
            .map(|(i, p)| timeline(report, i, p)),
    );
    out
}

/// Each point's x on a load axis: the load levels where every point has one on the same axis,
/// else the points' numbers.
fn load_axis(report: &BenchReport) -> (String, Vec<f64>) {
    let levels: Option<Vec<_>> = report.points.iter().map(|p| p.level).collect();
    match levels {
        Some(levels) if !levels.is_empty() && levels.iter().all(|l| l.axis == levels[0].axis) => (
            levels[0].axis.label().into(),
            levels.iter().map(|l| l.value).collect(),
        ),
        _ => (
            "load level (point number)".into(),
            (1..=report.points.len()).map(|i| i as f64).collect(),
        ),
    }
}

fn target_ms(report: &BenchReport, objective: Objective) -> Option<f64> {
    report
        .targets_s()
        .into_iter()
        .find(|(o, _)| *o == objective)
        .map(|(_, t)| t * 1e3)
}

fn slo_rule(report: &BenchReport, objective: Objective) -> Option<Rule> {
    target_ms(report, objective).map(|at| Rule {
        name: format!("SLO {objective} ≤ {at} ms"),
        at,
    })
}

/// p50, p90, p99 of a summary against load, in ms.
fn percentile_series(
    report: &BenchReport,
    xs: &[f64],
    summary: fn(&Point) -> &Option<Summary>,
) -> Vec<Series> {
    type Quantile = (&'static str, fn(&Summary) -> f64);
    let quantiles: [Quantile; 3] = [("p50", |s| s.p50), ("p90", |s| s.p90), ("p99", |s| s.p99)];
    quantiles
        .iter()
        .enumerate()
        .map(|(color, (name, q))| Series {
            name: (*name).into(),
            points: report
                .points
                .iter()
                .zip(xs)
                .filter_map(|(p, &x)| summary(p).as_ref().map(|s| (x, q(s) * 1e3)))
                .collect(),
            color,
            style: LineStyle::Marked,
        })
        .collect()
}

fn latency_vs_load(report: &BenchReport) -> Figure {
    let (x_label, xs) = load_axis(report);
    let panel = |caption: &str, summary: fn(&Point) -> &Option<Summary>, rules: Vec<Rule>| Panel {
        caption: caption.into(),
        x_label: x_label.clone(),
        y_label: "latency (ms)".into(),
        series: percentile_series(report, &xs, summary),
        h_rules: rules,
        v_rules: Vec::new(),
        x_range: None,
        y_max: None,
        legend: Legend::UpperLeft,
    };
    let ttft_rules = slo_rule(report, Objective::Ttft).into_iter().collect();
    // The ITL objective judges each request's longest gap, TPOT its mean: both bound the gaps.
    let itl_rules = [Objective::Itl, Objective::Tpot]
        .into_iter()
        .filter_map(|o| slo_rule(report, o))
        .collect();
    Figure {
        name: "latency_vs_load".into(),
        title: format!("Latency vs load · {}", report.workload),
        grid: (1, 2),
        panels: vec![
            panel("TTFT", |p| &p.slo.ttft, ttft_rules),
            panel("ITL (every gap between tokens)", |p| &p.slo.itl, itl_rules),
        ],
    }
}

fn cdfs(report: &BenchReport) -> Figure {
    let panel = |caption: &str, cdf: fn(&Point) -> &Option<Cdf>, objective: Objective| Panel {
        caption: caption.into(),
        x_label: "latency (ms)".into(),
        y_label: "share of requests".into(),
        series: report
            .points
            .iter()
            .enumerate()
            .filter_map(|(color, p)| {
                cdf(p).as_ref().map(|c| Series {
                    name: p.label.clone(),
                    points: c.points().map(|(v, share)| (v * 1e3, share)).collect(),
                    color,
                    style: LineStyle::Plain,
                })
            })
            .collect(),
        h_rules: Vec::new(),
        v_rules: slo_rule(report, objective).into_iter().collect(),
        x_range: None,
        y_max: Some(1.0),
        legend: Legend::LowerRight,
    };
    Figure {
        name: "cdf".into(),
        title: format!("Latency distributions · {}", report.workload),
        grid: (1, 3),
        panels: vec![
            panel("TTFT", |p| &p.cdf.ttft, Objective::Ttft),
            panel("ITL (every gap)", |p| &p.cdf.itl, Objective::Itl),
            panel("E2E", |p| &p.cdf.e2e, Objective::E2e),
        ],
    }
}

fn goodput_vs_load(report: &BenchReport) -> Figure {
    let (x_label, xs) = load_axis(report);
    let line = |name: &str, color, style, f: &dyn Fn(&Point) -> Option<f64>| Series {
        name: name.into(),
        points: report
            .points
            .iter()
            .zip(&xs)
            .filter_map(|(p, &x)| f(p).map(|y| (x, y)))
            .collect(),
        color,
        style,
    };
    let mut series = vec![
        line("goodput", 0, LineStyle::Marked, &|p| {
            Some(p.slo.goodput.rate)
        }),
        line("goodput, 95% Wilson bounds", 0, LineStyle::Dashed, &|p| {
            p.slo.goodput.low
        }),
        line("", 0, LineStyle::Dashed, &|p| p.slo.goodput.high),
        line("completed req/s", 1, LineStyle::Marked, &|p| {
            Some(p.slo.request_throughput)
        }),
    ];
    // The offered rate itself, where the x axis is one: the line a server keeping up follows.
    if report.points.first().and_then(|p| p.level).map(|l| l.axis) == Some(LoadAxis::Rate)
        && x_label == LoadAxis::Rate.label()
    {
        series.push(Series {
            name: "offered req/s".into(),
            points: xs.iter().map(|&x| (x, x)).collect(),
            color: 7,
            style: LineStyle::Dashed,
        });
    }
    let h_rules = report
        .max_goodput
        .iter()
        .map(|m| Rule {
            name: format!("max goodput {:.2} req/s ({})", m.goodput.rate, m.label),
            at: m.goodput.rate,
        })
        .collect();
    Figure {
        name: "goodput_vs_load".into(),
        title: format!("Goodput vs load · SLO {}", report.slo),
        grid: (1, 1),
        panels: vec![Panel {
            caption: "Requests meeting every objective, per second".into(),
            x_label,
            y_label: "requests per second".into(),
            series,
            h_rules,
            v_rules: Vec::new(),
            x_range: None,
            y_max: None,
            legend: Legend::UpperLeft,
        }],
    }
}

/// A file name's safe form of a label.
fn slug(label: &str) -> String {
    let s: String = label
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let s = s.trim_matches('-');
    s.chars().take(40).collect()
}

fn timeline(report: &BenchReport, index: usize, point: &Point) -> Figure {
    let t = &point.timeline;
    let mid = |i: usize| (i as f64 + 0.5) * t.bin_s;
    let per_bin =
        |name: &str, color, style, f: &dyn Fn(&crate::report::Bin) -> Option<f64>| Series {
            name: name.into(),
            points: t
                .bins
                .iter()
                .enumerate()
                .filter_map(|(i, b)| f(b).map(|y| (mid(i), y)))
                .collect(),
            color,
            style,
        };
    let panel = |caption: &str, y_label: &str, series: Vec<Series>, h_rules: Vec<Rule>| Panel {
        caption: caption.into(),
        x_label: "time since the run's start (s)".into(),
        y_label: y_label.into(),
        series,
        h_rules,
        v_rules: Vec::new(),
        x_range: Some((0.0, t.bins.len() as f64 * t.bin_s)),
        y_max: None,
        legend: Legend::UpperRight,
    };
    let mut offered = vec![
        per_bin("offered (sent/s)", 0, LineStyle::Plain, &|b| {
            Some(t.per_s(b.sent))
        }),
        per_bin("completed/s", 1, LineStyle::Plain, &|b| {
            Some(t.per_s(b.completed))
        }),
    ];
    if t.bins.iter().any(|b| b.shape_rate.is_some()) {
        offered.push(per_bin("shape's rate", 7, LineStyle::Dashed, &|b| {
            b.shape_rate
        }));
    }
    let figure_name = match slug(&point.label) {
        s if s.is_empty() => format!("timeline_{:02}", index + 1),
        s => format!("timeline_{:02}_{s}", index + 1),
    };
    Figure {
        name: figure_name,
        title: format!("Timeline · {} ({})", point.label, point.load),
        grid: (4, 1),
        panels: vec![
            panel(
                "Offered and completed",
                "requests per second",
                offered,
                Vec::new(),
            ),
            panel(
                "In flight",
                "requests (mean over the bin)",
                vec![per_bin("in flight", 2, LineStyle::Plain, &|b| {
                    Some(b.in_flight)
                })],
                Vec::new(),
            ),
            panel(
                "TTFT of the requests sent in each bin",
                "TTFT (ms)",
                vec![
                    per_bin("TTFT p50", 0, LineStyle::Plain, &|b| {
                        b.ttft_p50_s.map(|s| s * 1e3)
                    }),
                    per_bin("TTFT p99", 3, LineStyle::Plain, &|b| {
                        b.ttft_p99_s.map(|s| s * 1e3)
                    }),
                ],
                slo_rule(report, Objective::Ttft).into_iter().collect(),
            ),
            panel(
                "Shed (HTTP 429) and failed",
                "requests per second",
                vec![
                    per_bin("shed (429)/s", 4, LineStyle::Plain, &|b| {
                        Some(t.per_s(b.shed))
                    }),
                    per_bin("failed/s", 3, LineStyle::Plain, &|b| {
                        Some(t.per_s(b.failed))
                    }),
                ],
                Vec::new(),
            ),
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slugs_are_safe_file_names() {
        assert_eq!(slug("poisson:rate=4"), "poisson-rate-4");
        assert_eq!(slug("../x"), "x");
        assert_eq!(slug("é"), "");
    }
}
