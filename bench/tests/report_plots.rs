//! Plots of a bench report: SVG that parses as XML with the series and SLO lines named, PNG
//! of the size asked.

use std::collections::BTreeSet;
use std::time::Duration;

use kvmesh_bench::arrivals::LoadShape;
use kvmesh_bench::plot::{figures, write_plots, PlotError, PlotFormat, DEFAULT_SIZE};
use kvmesh_bench::report::{BenchReport, MaxGoodput, Point, TargetInfo};
use kvmesh_bench::slo::{Judge, RequestOutcome, SloSpec};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// `n` completed requests sent every `every` ms, TTFT growing with the load.
fn run(n: u64, every: u64, ttft: u64) -> Vec<RequestOutcome> {
    (0..n)
        .map(|i| {
            let gaps = vec![ms(20 + i % 7); 10];
            let e2e = ms(ttft + i % 50) + gaps.iter().sum::<Duration>();
            RequestOutcome {
                item: i as usize,
                sent: ms(i * every),
                ended: ms(i * every) + e2e,
                status: Some(if i % 13 == 5 { 429 } else { 200 }),
                error: (i % 13 == 5).then(|| "429".into()),
                ttft: Some(ms(ttft + i % 50)),
                e2e: Some(e2e),
                output_tokens: 11,
                gaps,
                ..RequestOutcome::default()
            }
        })
        .collect()
}

fn report() -> BenchReport {
    let slo: SloSpec = "ttft=300ms,itl=25ms".parse().unwrap();
    let target = TargetInfo {
        url: "http://127.0.0.1:8000".into(),
        api: "chat".into(),
        model: None,
    };
    let mut r = BenchReport::new(target, "synthetic", 1, &slo);
    for (rate, ttft) in [(2u64, 100), (4, 250), (8, 600)] {
        let shape: LoadShape = format!("poisson:rate={rate}").parse().unwrap();
        let outcomes = run(40, 1000 / rate, ttft);
        let duration = outcomes.iter().map(|o| o.ended).max().unwrap();
        r.points.push(Point::new(
            format!("rate {rate}"),
            &shape,
            &slo,
            &outcomes,
            duration,
        ));
    }
    r.max_goodput = Some(MaxGoodput::of(&r.points[1], Judge::PerRequest));
    r
}

/// Every text node of an SVG, parsed as XML.
fn svg_texts(svg: &str) -> (roxmltree::Document<'_>, BTreeSet<String>) {
    let doc = roxmltree::Document::parse(svg).expect("the SVG is well-formed XML");
    let texts = doc
        .descendants()
        .filter(|n| n.is_text())
        .filter_map(|n| n.text())
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty())
        .collect();
    (doc, texts)
}

#[test]
fn figures_hold_the_series_and_slo_lines() {
    let figs = figures(&report());
    let names: Vec<&str> = figs.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "latency_vs_load",
            "cdf",
            "goodput_vs_load",
            "timeline_01_rate-2",
            "timeline_02_rate-4",
            "timeline_03_rate-8"
        ]
    );
    let latency = &figs[0];
    let ttft = &latency.panels[0];
    assert_eq!(ttft.x_label, "offered load (req/s)");
    assert_eq!(ttft.y_label, "latency (ms)");
    let p50 = ttft.series.iter().find(|s| s.name == "p50").unwrap();
    // One point per load level, at its rate, TTFT in ms (the median of 100 + i % 50 ms over
    // the 37 completed requests).
    assert_eq!(
        p50.points.iter().map(|p| p.0).collect::<Vec<_>>(),
        [2.0, 4.0, 8.0]
    );
    assert!(
        p50.points[0].1 > 100.0 && p50.points[0].1 < 150.0,
        "{:?}",
        p50.points
    );
    assert_eq!(ttft.h_rules.len(), 1);
    assert_eq!(
        (ttft.h_rules[0].name.as_str(), ttft.h_rules[0].at),
        ("SLO ttft ≤ 300 ms", 300.0)
    );
    assert_eq!(latency.panels[1].h_rules[0].at, 25.0);
    let cdf = &figs[1];
    assert_eq!(cdf.panels[0].series.len(), 3);
    assert_eq!(cdf.panels[0].series[0].points.len(), 101);
    assert_eq!(cdf.panels[0].series[0].points[100].1, 1.0);
    assert!(cdf.panels[2].v_rules.is_empty(), "no e2e objective");
    let goodput = &figs[2].panels[0];
    assert!(goodput
        .series
        .iter()
        .any(|s| s.name == "goodput, 95% Wilson bounds"));
    assert!(goodput.h_rules[0].name.starts_with("max goodput"));
    let timeline = &figs[3];
    assert_eq!(timeline.panels.len(), 4);
    // Every panel spans the whole run, so the panels line up in time.
    let span = report().points[0].timeline.bins.len() as f64 * report().points[0].timeline.bin_s;
    assert!(timeline
        .panels
        .iter()
        .all(|p| p.x_range == Some((0.0, span))));
    let offered = &timeline.panels[0].series[0];
    assert_eq!(offered.name, "offered (sent/s)");
    assert_eq!(
        offered.points.iter().map(|p| p.1).sum::<f64>() * report().points[0].timeline.bin_s,
        40.0,
        "every send counted once"
    );
}

#[test]
fn svg_plots_parse_and_name_their_series() {
    let dir = tempfile::tempdir().unwrap();
    let files = write_plots(dir.path(), &report(), &[PlotFormat::Svg], (900, 600)).unwrap();
    assert_eq!(files.len(), 6);
    let latency = std::fs::read_to_string(dir.path().join("latency_vs_load.svg")).unwrap();
    let (doc, texts) = svg_texts(&latency);
    let root = doc.root_element();
    assert_eq!(root.tag_name().name(), "svg");
    assert_eq!(
        (root.attribute("width"), root.attribute("height")),
        (Some("900"), Some("600"))
    );
    for name in [
        "p50",
        "p90",
        "p99",
        "SLO ttft ≤ 300 ms",
        "SLO itl ≤ 25 ms",
        "TTFT",
    ] {
        assert!(texts.contains(name), "no `{name}` in {texts:?}");
    }
    assert!(texts.contains("offered load (req/s)") && texts.contains("latency (ms)"));
    // The SLO lines are drawn in their red, dashed (many segments).
    let red = doc
        .descendants()
        .filter(|n| n.attribute("stroke") == Some("#C80000"))
        .count();
    assert!(red > 4, "{red} red elements");
    // Each series is a line: at least the three percentiles per panel.
    let lines = doc
        .descendants()
        .filter(|n| n.has_tag_name("polyline"))
        .count();
    assert!(lines >= 6, "{lines} polylines");

    let timeline = std::fs::read_to_string(dir.path().join("timeline_02_rate-4.svg")).unwrap();
    let (_, texts) = svg_texts(&timeline);
    for name in [
        "offered (sent/s)",
        "completed/s",
        "shape's rate",
        "in flight",
        "TTFT p99",
        "shed (429)/s",
        "time since the run's start (s)",
    ] {
        assert!(texts.contains(name), "no `{name}` in {texts:?}");
    }
    let cdf = std::fs::read_to_string(dir.path().join("cdf.svg")).unwrap();
    let (_, texts) = svg_texts(&cdf);
    assert!(
        ["rate 2", "rate 4", "rate 8", "share of requests"]
            .iter()
            .all(|t| texts.contains(*t)),
        "{texts:?}"
    );
    let goodput = std::fs::read_to_string(dir.path().join("goodput_vs_load.svg")).unwrap();
    let (_, texts) = svg_texts(&goodput);
    assert!(
        texts.contains("goodput") && texts.contains("requests per second"),
        "{texts:?}"
    );
}

#[test]
fn png_plots_have_the_signature_and_size_asked() {
    let dir = tempfile::tempdir().unwrap();
    let files = write_plots(
        &dir.path().join("plots"),
        &report(),
        &[PlotFormat::Png, PlotFormat::Svg],
        (640, 480),
    )
    .unwrap();
    assert_eq!(files.len(), 12);
    let pngs: Vec<_> = files
        .iter()
        .filter(|p| p.extension().unwrap() == "png")
        .collect();
    assert_eq!(pngs.len(), 6);
    for png in pngs {
        let bytes = std::fs::read(png).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{png:?}");
        // The first chunk is IHDR: width and height, big-endian.
        assert_eq!(&bytes[12..16], b"IHDR");
        let w = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
        let h = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
        assert_eq!((w, h), (640, 480), "{png:?}");
        assert!(
            bytes.len() > 5_000,
            "{png:?} holds a drawing, not a blank page"
        );
    }
    // Decoded: the SLO rule is drawn in its red, and text and axes in black.
    let png = std::fs::File::open(dir.path().join("plots/latency_vs_load.png")).unwrap();
    let mut reader = png::Decoder::new(std::io::BufReader::new(png))
        .read_info()
        .unwrap();
    let mut rgb = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut rgb).unwrap();
    assert_eq!(
        (info.width, info.height, info.color_type),
        (640, 480, png::ColorType::Rgb)
    );
    let pixels: Vec<&[u8]> = rgb.chunks(3).collect();
    let count = |c: [u8; 3]| pixels.iter().filter(|p| **p == c).count();
    assert!(count([200, 0, 0]) > 100, "SLO red: {}", count([200, 0, 0]));
    assert!(count([0, 0, 0]) > 100, "black: {}", count([0, 0, 0]));
    assert!(count([255, 255, 255]) > pixels.len() / 2, "a white page");
    assert_eq!(DEFAULT_SIZE, (1280, 800));
}

#[test]
fn bad_sizes_and_formats_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let e = write_plots(dir.path(), &report(), &[PlotFormat::Svg], (10, 600)).unwrap_err();
    assert!(matches!(e, PlotError::Size(10, 600)), "{e}");
    assert_eq!("PNG".parse::<PlotFormat>(), Ok(PlotFormat::Png));
    assert_eq!(
        "jpeg".parse::<PlotFormat>().unwrap_err(),
        "unknown plot format `jpeg`: expected svg or png"
    );
    // A report with no points still draws its (empty) figures.
    let empty = BenchReport::new(report().target, "w", 0, &"ttft=1s".parse().unwrap());
    let files = write_plots(dir.path(), &empty, &[PlotFormat::Svg], (400, 300)).unwrap();
    assert_eq!(files.len(), 3);
}
