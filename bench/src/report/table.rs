//! The report as terminal tables: one row per load level, throughput and latency first, then
//! SLO attainment and goodput.

use crate::slo::{Attainment, Goodput, Judge, Objective, Summary};

use super::mesh::NodeStats;
use super::BenchReport;

/// Columns of text, the first `left` of them left-aligned and the rest right-aligned (numbers).
pub(crate) struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
    left: usize,
}

impl Table {
    pub(crate) fn new(headers: Vec<String>, left: usize) -> Table {
        Table {
            headers,
            rows: Vec::new(),
            left,
        }
    }

    pub(crate) fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub(crate) fn render(&self) -> String {
        let columns = self.headers.len();
        let width = |i: usize| {
            self.rows
                .iter()
                .filter_map(|r| r.get(i))
                .chain([&self.headers[i]])
                .map(|c| c.chars().count())
                .max()
                .unwrap_or(0)
        };
        let widths: Vec<usize> = (0..columns).map(width).collect();
        let line = |cells: &[String]| {
            let mut out = String::new();
            for (i, w) in widths.iter().enumerate() {
                let cell = cells.get(i).map_or("", String::as_str);
                if i > 0 {
                    out.push_str("  ");
                }
                if i < self.left {
                    out.push_str(&format!("{cell:<w$}"));
                } else {
                    out.push_str(&format!("{cell:>w$}"));
                }
            }
            out.trim_end().to_owned() + "\n"
        };
        let mut out = line(&self.headers);
        let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
        out.push_str(&line(&rule));
        for r in &self.rows {
            out.push_str(&line(r));
        }
        out
    }
}

/// Seconds as milliseconds with one decimal; `-` for none.
pub(crate) fn ms(s: Option<f64>) -> String {
    s.map_or("-".into(), |s| format!("{:.1}", s * 1e3))
}

/// A rate with two decimals.
pub(crate) fn rate(r: f64) -> String {
    format!("{r:.2}")
}

/// `95.0% [93.1, 96.4]`: the share and its Wilson interval, in percent; `-` with nothing
/// completed.
pub(crate) fn attainment(a: &Attainment) -> String {
    match (a.share, a.interval) {
        (Some(share), Some(i)) => format!(
            "{:.1}% [{:.1}, {:.1}]",
            share * 100.0,
            i.low * 100.0,
            i.high * 100.0
        ),
        (Some(share), None) => format!("{:.1}%", share * 100.0),
        _ => "-".into(),
    }
}

/// `3.20 [2.91, 3.42]`: goodput and the bounds carried over from the attainment interval.
pub(crate) fn goodput(g: &Goodput) -> String {
    match (g.low, g.high) {
        (Some(low), Some(high)) => format!("{:.2} [{low:.2}, {high:.2}]", g.rate),
        _ => rate(g.rate),
    }
}

/// The mesh's statistics, where the points carry them (a simulated run): per point and role,
/// how busy and how full the nodes were, then what moved and what the prefix caches served.
fn render_mesh(report: &BenchReport) -> String {
    let headers = [
        "point",
        "role",
        "nodes",
        "died",
        "requests",
        "busy mean",
        "busy max",
        "KV mean",
        "KV peak",
        "preempted",
    ];
    let mut nodes = Table::new(headers.iter().map(|h| h.to_string()).collect(), 2);
    let mut traffic = Table::new(
        [
            "point",
            "KV moved",
            "remote prefills",
            "migrations",
            "prefix hits: device",
            "host",
            "disk",
        ]
        .iter()
        .map(|h| h.to_string())
        .collect(),
        1,
    );
    for p in &report.points {
        let Some(mesh) = &p.mesh else { continue };
        for role in ["decode", "prefill"] {
            let of_role: Vec<&NodeStats> = mesh.nodes.iter().filter(|n| n.role == role).collect();
            if of_role.is_empty() {
                continue;
            }
            let mean = |f: fn(&NodeStats) -> f64| {
                of_role.iter().map(|n| f(n)).sum::<f64>() / of_role.len() as f64
            };
            let max = |f: fn(&NodeStats) -> f64| of_role.iter().map(|n| f(n)).fold(0.0, f64::max);
            nodes.row(vec![
                p.label.clone(),
                role.to_string(),
                of_role.len().to_string(),
                of_role
                    .iter()
                    .filter(|n| n.died_at_s.is_some())
                    .count()
                    .to_string(),
                of_role.iter().map(|n| n.requests).sum::<u64>().to_string(),
                percent(mean(|n| n.utilization)),
                percent(max(|n| n.utilization)),
                percent(mean(|n| n.kv_usage_mean)),
                percent(max(|n| n.kv_usage_peak)),
                of_role
                    .iter()
                    .map(|n| n.preemptions)
                    .sum::<u64>()
                    .to_string(),
            ]);
        }
        let hits = &mesh.prefix_cache;
        let share = |r: Option<f64>| r.map_or("-".into(), percent);
        traffic.row(vec![
            p.label.clone(),
            bytes(mesh.kv_bytes_transferred),
            mesh.remote_prefills.to_string(),
            mesh.migrations.to_string(),
            share(hits.device_rate),
            share(hits.host_rate),
            share(hits.disk_rate),
        ]);
    }
    if traffic.rows.is_empty() {
        return String::new();
    }
    format!(
        "\nnodes (busy: share of the run with a step in flight; KV: share of blocks in use)\n{}\nmesh (prefix hits: share of the tokens looked up at admissions)\n{}",
        nodes.render(),
        traffic.render()
    )
}

fn percent(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

/// A byte count in the largest unit that keeps it at least 1.
fn bytes(n: u64) -> String {
    let units = ["B", "KB", "MB", "GB", "TB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < units.len() {
        value /= 1000.0;
        unit += 1;
    }
    match unit {
        0 => format!("{n} B"),
        _ => format!("{value:.1} {}", units[unit]),
    }
}

fn pick(s: &Option<Summary>, f: fn(&Summary) -> f64) -> Option<f64> {
    s.as_ref().map(f)
}

/// The report's tables: throughput and latency per point, then attainment per objective and
/// for all of them with their 95% Wilson intervals, and goodput; then the search's result and
/// any generator warning.
pub fn render_table(report: &BenchReport) -> String {
    let headers = [
        "point",
        "load",
        "ok",
        "shed",
        "failed",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "TPOT p50",
        "E2E p50",
        "E2E p99",
    ];
    let mut latency = Table::new(headers.iter().map(|h| h.to_string()).collect(), 2);
    for p in &report.points {
        let r = &p.slo;
        latency.row(vec![
            p.label.clone(),
            p.load.clone(),
            r.ok.to_string(),
            r.shed.to_string(),
            r.failed.to_string(),
            rate(r.request_throughput),
            format!("{:.1}", r.output_token_throughput),
            ms(pick(&r.ttft, |s| s.p50)),
            ms(pick(&r.ttft, |s| s.p99)),
            ms(pick(&r.itl, |s| s.p50)),
            ms(pick(&r.itl, |s| s.p99)),
            ms(pick(&r.tpot, |s| s.p50)),
            ms(pick(&r.e2e, |s| s.p50)),
            ms(pick(&r.e2e, |s| s.p99)),
        ]);
    }
    let targets = report.targets_s();
    let mut slo_headers = vec!["point".to_string()];
    slo_headers.extend(
        targets
            .iter()
            .map(|(o, t)| format!("{o} <= {}", ms(Some(*t)) + " ms")),
    );
    // ITL's objective is judged on each request's longest gap; the share of all gaps
    // within it (the pooled percentile) beside it.
    let itl = targets.iter().find(|(o, _)| *o == Objective::Itl);
    slo_headers.extend(itl.map(|(_, t)| format!("gaps <= {} ms", ms(Some(*t)))));
    slo_headers.extend(["all".to_string(), "goodput req/s".to_string()]);
    let mut slo = Table::new(slo_headers, 1);
    for p in &report.points {
        let mut row = vec![p.label.clone()];
        row.extend(targets.iter().map(|(objective, _)| {
            p.slo
                .objectives
                .iter()
                .find(|o| o.objective == *objective)
                .map_or("-".into(), |o| attainment(&o.attainment))
        }));
        if itl.is_some() {
            let gaps = p.slo.objectives.iter().find_map(|o| o.gaps.as_ref());
            row.push(gaps.map_or("-".into(), attainment));
        }
        row.push(attainment(&p.slo.all));
        row.push(goodput(&p.slo.goodput));
        slo.row(row);
    }
    let mut out = format!(
        "{} ({}) at {} · workload {} · seed {}\n\nthroughput and latency (latencies in ms; ITL pools every gap)\n",
        report.target.model.as_deref().unwrap_or("default model"),
        report.target.api,
        report.target.url,
        report.workload,
        report.seed,
    );
    out.push_str(&latency.render());
    out.push_str(&format!(
        "\nSLO {} (attainment over completed requests, 95% Wilson interval)\n",
        report.slo
    ));
    out.push_str(&slo.render());
    out.push_str(&render_mesh(report));
    if let Some(m) = &report.max_goodput {
        let judged = match m.judge {
            Judge::PerRequest => "",
            Judge::Percentiles => ", judged by percentiles: every completed request",
        };
        out.push_str(&format!(
            "\nmax goodput: {} req/s at {} ({}{judged})\n",
            goodput(&m.goodput),
            m.load,
            m.label
        ));
    }
    for w in report.warnings() {
        out.push_str(&format!("\n{w}\n"));
    }
    out
}
