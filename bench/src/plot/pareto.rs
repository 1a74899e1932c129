//! `kvmesh tune`'s trade-off chart: each measured configuration's goodput against its TTFT
//! p99, the Pareto front (the configurations no other beats on both) marked and joined.

use std::path::{Path, PathBuf};

use super::{write_figures, Figure, Legend, LineStyle, Panel, PlotError, PlotFormat, Series};

/// One measured configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct TradeOff {
    /// The legend's name for it (front points only; the rest share one entry).
    pub label: String,
    /// Requests per second within the SLO.
    pub goodput: f64,
    pub ttft_p99_ms: f64,
    /// Whether no other configuration is at least as good on both and better on one.
    pub on_front: bool,
}

/// The chart: every front point its own series (so the legend names it), the dominated
/// ones one grey series, and a dashed line along the front by TTFT.
pub fn pareto_figure(points: &[TradeOff], slo: &str) -> Figure {
    let mut front: Vec<&TradeOff> = points.iter().filter(|p| p.on_front).collect();
    front.sort_by(|a, b| a.ttft_p99_ms.total_cmp(&b.ttft_p99_ms));
    let mut series = vec![Series {
        name: String::new(),
        points: front.iter().map(|p| (p.ttft_p99_ms, p.goodput)).collect(),
        color: 0,
        style: LineStyle::Dashed,
    }];
    series.extend(front.iter().enumerate().map(|(i, p)| Series {
        name: p.label.clone(),
        points: vec![(p.ttft_p99_ms, p.goodput)],
        // 7 is black, kept for the dominated points.
        color: i % 7,
        style: LineStyle::Points,
    }));
    let dominated: Vec<(f64, f64)> = points
        .iter()
        .filter(|p| !p.on_front)
        .map(|p| (p.ttft_p99_ms, p.goodput))
        .collect();
    if !dominated.is_empty() {
        series.push(Series {
            name: format!("dominated ({})", dominated.len()),
            points: dominated,
            color: 7,
            style: LineStyle::Points,
        });
    }
    Figure {
        name: "pareto".into(),
        title: format!("Goodput vs TTFT p99 per configuration · SLO {slo}"),
        grid: (1, 1),
        panels: vec![Panel {
            caption: "Max goodput and its TTFT p99; the Pareto front joined".into(),
            x_label: "TTFT p99 (ms)".into(),
            y_label: "goodput (requests per second)".into(),
            series,
            h_rules: Vec::new(),
            v_rules: Vec::new(),
            x_range: None,
            y_max: None,
            legend: Legend::LowerRight,
        }],
    }
}

/// Draws [`pareto_figure`] into `dir` as `pareto.<format>`; the files written.
pub fn write_pareto(
    dir: &Path,
    points: &[TradeOff],
    slo: &str,
    formats: &[PlotFormat],
    size: (u32, u32),
) -> Result<Vec<PathBuf>, PlotError> {
    write_figures(dir, &[pareto_figure(points, slo)], formats, size)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(label: &str, goodput: f64, ttft_p99_ms: f64, on_front: bool) -> TradeOff {
        TradeOff {
            label: label.into(),
            goodput,
            ttft_p99_ms,
            on_front,
        }
    }

    #[test]
    fn the_front_is_named_and_joined_by_ttft() {
        let points = [
            t("#0 fast", 2.0, 100.0, true),
            t("#1 slow", 1.0, 300.0, false),
            t("#2 big", 4.0, 250.0, true),
        ];
        let f = pareto_figure(&points, "ttft=1s");
        let s = &f.panels[0].series;
        assert_eq!(s.len(), 4);
        assert_eq!(s[0].points, [(100.0, 2.0), (250.0, 4.0)]);
        assert_eq!(s[0].style, LineStyle::Dashed);
        assert_eq!(
            (s[1].name.as_str(), s[2].name.as_str()),
            ("#0 fast", "#2 big")
        );
        assert_eq!(s[3].name, "dominated (1)");
        assert_eq!(s[3].points, [(300.0, 1.0)]);
        assert!(f.title.contains("ttft=1s"));
    }

    #[test]
    fn writes_a_parsable_svg() {
        let dir = tempfile::tempdir().unwrap();
        let points = [t("#0 a", 2.0, 100.0, true), t("#1 b", 1.0, 300.0, false)];
        let files = write_pareto(
            dir.path(),
            &points,
            "ttft=1s",
            &[PlotFormat::Svg, PlotFormat::Png],
            (640, 400),
        )
        .unwrap();
        assert_eq!(files.len(), 2);
        let svg = std::fs::read_to_string(&files[0]).unwrap();
        let doc = roxmltree::Document::parse(&svg).unwrap();
        let texts: String = doc
            .descendants()
            .filter(|n| n.is_text())
            .filter_map(|n| n.text())
            .collect();
        assert!(
            texts.contains("#0 a") && texts.contains("dominated (1)"),
            "{texts}"
        );
        assert!(doc.descendants().any(|n| n.has_tag_name("circle")));
        assert!(std::fs::read(&files[1]).unwrap().starts_with(b"\x89PNG"));
    }
}
