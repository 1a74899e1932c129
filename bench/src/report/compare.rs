//! `kvmesh bench compare A.json B.json`: two reports' points side by side, each metric with the
//! ratio B/A and which side is better.

use crate::slo::{SloReport, Summary};

use super::table::Table;
use super::{BenchReport, Point, ReportError};

/// Which way a metric improves.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Better {
    Higher,
    Lower,
}

/// Reads a metric's value from a point's report.
type Read = Box<dyn Fn(&SloReport) -> Option<f64>>;

/// One metric of a point: its name, its unit's scale for display, and which way is better.
struct Metric {
    name: String,
    better: Better,
    /// Displayed value = value × scale (seconds to ms, shares to %).
    scale: f64,
    decimals: usize,
    value: Read,
}

fn metric(
    name: &str,
    better: Better,
    scale: f64,
    decimals: usize,
    value: impl Fn(&SloReport) -> Option<f64> + 'static,
) -> Metric {
    Metric {
        name: name.into(),
        better,
        scale,
        decimals,
        value: Box::new(value),
    }
}

fn latency(name: &str, pick: fn(&SloReport) -> &Option<Summary>, q: fn(&Summary) -> f64) -> Metric {
    metric(&format!("{name} ms"), Better::Lower, 1e3, 1, move |r| {
        pick(r).as_ref().map(q)
    })
}

/// The metrics compared, for the objectives of `a`'s point.
fn metrics(a: &Point) -> Vec<Metric> {
    let mut m = vec![
        metric("req/s", Better::Higher, 1.0, 2, |r| {
            Some(r.request_throughput)
        }),
        metric("out tok/s", Better::Higher, 1.0, 1, |r| {
            Some(r.output_token_throughput)
        }),
        latency("TTFT p50", |r| &r.ttft, |s| s.p50),
        latency("TTFT p99", |r| &r.ttft, |s| s.p99),
        latency("ITL p50", |r| &r.itl, |s| s.p50),
        latency("ITL p99", |r| &r.itl, |s| s.p99),
        latency("TPOT p50", |r| &r.tpot, |s| s.p50),
        latency("E2E p50", |r| &r.e2e, |s| s.p50),
        latency("E2E p99", |r| &r.e2e, |s| s.p99),
    ];
    for o in &a.slo.objectives {
        let objective = o.objective;
        m.push(metric(
            &format!("{objective} met %"),
            Better::Higher,
            100.0,
            1,
            move |r| {
                r.objectives
                    .iter()
                    .find(|x| x.objective == objective)
                    .and_then(|x| x.attainment.share)
            },
        ));
    }
    m.extend([
        metric("all met %", Better::Higher, 100.0, 1, |r| r.all.share),
        metric("goodput req/s", Better::Higher, 1.0, 2, |r| {
            Some(r.goodput.rate)
        }),
        metric("shed", Better::Lower, 1.0, 0, |r| Some(r.shed as f64)),
        metric("failed", Better::Lower, 1.0, 0, |r| Some(r.failed as f64)),
    ]);
    m
}

/// B's point matching `a`: the same label, else the same load.
fn matching<'b>(a: &Point, b: &'b BenchReport) -> Option<&'b Point> {
    b.points
        .iter()
        .find(|p| p.label == a.label)
        .or_else(|| b.points.iter().find(|p| p.load == a.load))
}

/// `B/A` with three decimals; `-` where either is missing or A is 0 (and B is not).
fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if a == b => "1.000".into(),
        (Some(a), Some(b)) if a != 0.0 => format!("{:.3}", b / a),
        _ => "-".into(),
    }
}

fn better(m: &Metric, a: Option<f64>, b: Option<f64>) -> &'static str {
    let (Some(a), Some(b)) = (a, b) else {
        return "";
    };
    match (b.partial_cmp(&a), m.better) {
        (Some(std::cmp::Ordering::Equal), _) | (None, _) => "=",
        (Some(std::cmp::Ordering::Greater), Better::Higher)
        | (Some(std::cmp::Ordering::Less), Better::Lower) => "B",
        _ => "A",
    }
}

/// The two reports side by side, point by point (matched by label, else by load), each metric
/// with the ratio B/A and the better side (`A`, `B` or `=`); points found in one report only
/// are listed. Reports of different schema versions are refused.
pub fn compare(a: &BenchReport, b: &BenchReport) -> Result<String, ReportError> {
    if a.schema_version != b.schema_version {
        return Err(ReportError::Mismatch {
            a: a.schema_version,
            b: b.schema_version,
        });
    }
    let side = |r: &BenchReport| {
        format!(
            "kvmesh {} · {} {} · workload {} · seed {} · SLO {}",
            r.kvmesh_version,
            r.target.url,
            r.target.model.as_deref().unwrap_or("default model"),
            r.workload,
            r.seed,
            r.slo
        )
    };
    let mut out = format!("A: {}\nB: {}\n", side(a), side(b));
    if a.slo != b.slo {
        out.push_str(
            "note: the SLOs differ, so attainment and goodput judge different objectives\n",
        );
    }
    for pa in &a.points {
        let Some(pb) = matching(pa, b) else {
            continue;
        };
        let title = if pa.load == pb.load {
            format!("{} ({})", pa.label, pa.load)
        } else {
            format!("{} ({} vs {})", pa.label, pa.load, pb.load)
        };
        out.push_str(&format!("\npoint {title}\n"));
        let mut t = Table::new(
            ["metric", "A", "B", "B/A", "better"]
                .map(String::from)
                .to_vec(),
            1,
        );
        for m in metrics(pa) {
            let (va, vb) = ((m.value)(&pa.slo), (m.value)(&pb.slo));
            let show = |v: Option<f64>| {
                v.map_or("-".into(), |v| format!("{:.*}", m.decimals, v * m.scale))
            };
            t.row(vec![
                m.name.clone(),
                show(va),
                show(vb),
                ratio(va, vb),
                better(&m, va, vb).into(),
            ]);
        }
        out.push_str(&t.render());
    }
    let only = |x: &BenchReport, y: &BenchReport| -> Vec<String> {
        x.points
            .iter()
            .filter(|p| matching(p, y).is_none())
            .map(|p| format!("{} ({})", p.label, p.load))
            .collect()
    };
    for (name, list) in [("A", only(a, b)), ("B", only(b, a))] {
        if !list.is_empty() {
            out.push_str(&format!("\nonly in {name}: {}\n", list.join(", ")));
        }
    }
    Ok(out)
}
