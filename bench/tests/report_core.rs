//! The bench report's pure core: timelines on scripted outcomes, the JSON against its
//! documentation, the table and the comparison.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use kvmesh_bench::arrivals::LoadShape;
use kvmesh_bench::cpu::GeneratorUse;
use kvmesh_bench::report::{
    bin_width, compare, render_table, BenchReport, LoadAxis, MaxGoodput, MeshStats, NodeStats,
    Point, PrefixCacheStats, ReportError, TargetInfo, Timeline,
};
use kvmesh_bench::slo::{Judge, RequestOutcome, SloSpec, SCHEMA_VERSION};
use serde_json::Value;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A completed request: sent at `sent`, first token after `ttft`, then `gaps` between tokens.
fn done(sent: u64, ttft: u64, gaps: &[u64]) -> RequestOutcome {
    let gaps: Vec<Duration> = gaps.iter().copied().map(ms).collect();
    let e2e = ms(ttft) + gaps.iter().sum::<Duration>();
    RequestOutcome {
        sent: ms(sent),
        ended: ms(sent) + e2e,
        status: Some(200),
        ttft: Some(ms(ttft)),
        e2e: Some(e2e),
        output_tokens: gaps.len() as u64 + 1,
        prompt_tokens: Some(100),
        cached_tokens: Some(40),
        gaps,
        ..RequestOutcome::default()
    }
}

fn refused(sent: u64, ended: u64, status: Option<u16>, error: &str) -> RequestOutcome {
    RequestOutcome {
        sent: ms(sent),
        ended: ms(ended),
        status,
        error: Some(error.into()),
        ..RequestOutcome::default()
    }
}

#[test]
fn timeline_bins_are_exact_on_a_scripted_run() {
    // Times in quarters of a second, so every sum is exact in binary.
    let outcomes = [
        done(0, 250, &[1250]),                 // 0 → 1.5 s
        done(500, 125, &[125]),                // 0.5 → 0.75 s
        refused(1000, 1000, Some(429), "429"), // shed at once
        refused(1500, 2500, None, "timeout"),  // failed, 1.5 → 2.5 s
        done(2000, 500, &[500]),               // 2 → 3 s, the run's end
    ];
    let shape: LoadShape = "steps:2@1s,4@1s".parse().unwrap();
    let t = Timeline::with_bin(&shape, &outcomes, ms(3000), ms(1000));
    assert_eq!(t.bin_s, 1.0);
    let col = |f: fn(&kvmesh_bench::report::Bin) -> usize| t.bins.iter().map(f).collect::<Vec<_>>();
    assert_eq!(
        t.bins.iter().map(|b| b.start_s).collect::<Vec<_>>(),
        [0.0, 1.0, 2.0]
    );
    assert_eq!(col(|b| b.sent), [2, 2, 1]);
    // A request ending exactly at the run's end falls in the last bin.
    assert_eq!(col(|b| b.completed), [1, 1, 1]);
    assert_eq!(col(|b| b.shed), [0, 1, 0]);
    assert_eq!(col(|b| b.failed), [0, 0, 1]);
    // Bin 0: all of the first, a quarter of the second; bin 1: half of the first and half of
    // the failed one (the shed one was never in flight); bin 2: half of it and the last.
    assert_eq!(
        t.bins.iter().map(|b| b.in_flight).collect::<Vec<_>>(),
        [1.25, 1.0, 1.5]
    );
    // TTFT of completed requests by the bin they were *sent* in.
    assert_eq!(t.bins[0].ttft_p50_s, Some(0.1875));
    assert_eq!(t.bins[0].ttft_p99_s, Some(0.125 + 0.125 * 0.99));
    assert_eq!((t.bins[1].ttft_p50_s, t.bins[1].ttft_p99_s), (None, None));
    assert_eq!(
        (t.bins[2].ttft_p50_s, t.bins[2].ttft_p99_s),
        (Some(0.5), Some(0.5))
    );
    // The steps' rates, then 0 past the profile (the last send opens bin 2).
    assert_eq!(
        t.bins.iter().map(|b| b.shape_rate).collect::<Vec<_>>(),
        [Some(2.0), Some(4.0), Some(0.0)]
    );
    assert_eq!(t.per_s(t.bins[0].sent), 2.0);

    // Half-second bins: the offered rate per second doubles per count.
    let half = Timeline::with_bin(&shape, &outcomes, ms(3000), ms(500));
    assert_eq!(half.bins.len(), 6);
    assert_eq!(
        half.bins.iter().map(|b| b.sent).collect::<Vec<_>>(),
        [1, 1, 1, 1, 1, 0]
    );
    assert_eq!(half.per_s(half.bins[0].sent), 2.0);
    assert_eq!(half.bins[5].shape_rate, None, "after the last send");

    // A closed loop has no rate of its own; an empty run still has one bin.
    let closed: LoadShape = "concurrency:2".parse().unwrap();
    let c = Timeline::with_bin(&closed, &outcomes, ms(3000), ms(1000));
    assert!(c.bins.iter().all(|b| b.shape_rate.is_none()));
    let empty = Timeline::new(&closed, &[], Duration::ZERO);
    assert_eq!(empty.bins.len(), 1);
    assert_eq!(empty.bins[0].sent, 0);
}

#[test]
fn bin_widths_are_round_and_about_sixty_to_a_run() {
    let s = Duration::from_secs;
    assert_eq!(bin_width(s(60), 10_000), s(1));
    assert_eq!(bin_width(s(100), 10_000), s(2));
    assert_eq!(bin_width(s(300), 10_000), s(5));
    assert_eq!(bin_width(s(600), 10_000), s(10));
    assert_eq!(bin_width(s(1), 10_000), ms(20));
    assert_eq!(bin_width(Duration::ZERO, 10_000), ms(1));
    // Few requests: at least 4 to a bin on average (40 in 10 s: 10 bins of 1 s).
    assert_eq!(bin_width(s(10), 40), s(1));
    assert_eq!(bin_width(s(10), 0), s(10));
    // Timeline::new picks it from the run's span, the last end included.
    let shape: LoadShape = "poisson:rate=1".parse().unwrap();
    let outcomes: Vec<_> = (0..300)
        .map(|i| done(i * 100, 100, &[59_900 - i * 100]))
        .collect();
    let t = Timeline::new(&shape, &outcomes, Duration::from_secs(30));
    assert_eq!((t.bin_s, t.bins.len()), (1.0, 60));
    assert_eq!(t.bins.iter().map(|b| b.sent).sum::<usize>(), 300);
}

fn slo() -> SloSpec {
    "ttft=500ms,itl=50ms,e2e=1s".parse().unwrap()
}

/// The scripted run of the SLO core's test: 5 completed (2 meet every objective), 2 shed,
/// 2 failed.
fn scripted() -> Vec<RequestOutcome> {
    vec![
        done(0, 200, &[20, 30, 40]),
        done(100, 500, &[50, 50]),
        done(200, 600, &[10]),
        done(300, 100, &[20, 80]),
        done(400, 400, &[40; 20]),
        refused(500, 510, Some(429), "429"),
        refused(600, 610, Some(429), "429"),
        refused(700, 1700, None, "timeout"),
        refused(800, 900, Some(500), "http_500"),
    ]
}

fn target() -> TargetInfo {
    TargetInfo {
        url: "http://127.0.0.1:8000".into(),
        api: "completions".into(),
        model: Some("smollm2".into()),
    }
}

/// A simulated mesh of one decode node and one prefill node, the prefill node dead.
fn mesh() -> MeshStats {
    let node = |id: u64, role: &str, died_at_s| NodeStats {
        id,
        role: role.into(),
        requests: 9,
        steps: 40,
        utilization: 0.5,
        kv_usage_mean: 0.25,
        kv_usage_peak: 0.75,
        kv_blocks: 64,
        preemptions: 1,
        died_at_s,
    };
    MeshStats {
        nodes: vec![node(0, "decode", None), node(1, "prefill", Some(0.5))],
        kv_bytes_transferred: 1 << 20,
        remote_prefills: 3,
        migrations: 0,
        prefix_cache: PrefixCacheStats::new(1000, 400, 100, 0),
    }
}

/// A two-point sweep with every optional part present (the mesh on the second point only).
fn sweep() -> BenchReport {
    let slo = slo();
    let mut r = BenchReport::new(target(), "synthetic:in=128,out=32", 7, &slo);
    r.generator = Some(GeneratorUse::new(ms(1500), ms(5000), 2));
    let low: LoadShape = "poisson:rate=2".parse().unwrap();
    let high: LoadShape = "concurrency:8".parse().unwrap();
    r.points.push(
        Point::new("low", &low, &slo, &scripted(), ms(2000))
            .with_generator(Some(GeneratorUse::new(ms(900), ms(1000), 2))),
    );
    r.points
        .push(Point::new("high", &high, &slo, &scripted()[..5], ms(1000)).with_mesh(Some(mesh())));
    r.max_goodput = Some(MaxGoodput::of(&r.points[1], Judge::PerRequest));
    r
}

#[test]
fn points_take_their_level_from_the_shape() {
    let r = sweep();
    let low = r.points[0].level.unwrap();
    assert_eq!((low.axis, low.value), (LoadAxis::Rate, 2.0));
    let high = r.points[1].level.unwrap();
    assert_eq!((high.axis, high.value), (LoadAxis::Concurrency, 8.0));
    let steps: LoadShape = "steps:2@1s,4@3s".parse().unwrap();
    let p = Point::new("s", &steps, &slo(), &[], ms(4000));
    assert_eq!(
        p.level.unwrap().value,
        3.5,
        "the mean rate over the profile"
    );
    assert_eq!(p.load, "steps:2@1s,4@3s");
    let trace: LoadShape = "trace:speedup=2".parse().unwrap();
    assert_eq!(Point::new("t", &trace, &slo(), &[], ms(1)).level, None);
    assert_eq!(r.points[0].cdf.ttft.as_ref().unwrap().quantiles.len(), 101);
    assert_eq!(r.points[0].cdf.itl.as_ref().unwrap().count, 28);
    assert_eq!(r.points[0].cdf.e2e.as_ref().unwrap().quantiles[100], 1.2);
}

#[test]
fn json_round_trips_exactly() {
    let r = sweep();
    let json = r.to_json();
    let back = BenchReport::from_json(&json).unwrap();
    assert_eq!(back, r);
    assert_eq!(back.to_json(), json);
    assert_eq!(r.schema_version, SCHEMA_VERSION);
    assert_eq!(r.kvmesh_version, env!("CARGO_PKG_VERSION"));
}

#[test]
fn json_of_another_version_or_shape_is_refused_by_name() {
    let mut v: Value = serde_json::from_str(&sweep().to_json()).unwrap();
    v["schema_version"] = Value::from(SCHEMA_VERSION + 1);
    let e = BenchReport::from_json(&v.to_string()).unwrap_err();
    assert!(
        matches!(e, ReportError::Version { found, expected } if found == u64::from(SCHEMA_VERSION) + 1 && expected == SCHEMA_VERSION)
    );
    assert!(e.to_string().contains("schema version 2"), "{e}");
    let e = BenchReport::from_json("{\"points\": []}").unwrap_err();
    assert!(matches!(e, ReportError::NoVersion), "{e}");
    let e = BenchReport::from_json("not json").unwrap_err();
    assert!(
        e.to_string().starts_with("not a kvmesh bench report"),
        "{e}"
    );
    v["schema_version"] = Value::from(SCHEMA_VERSION);
    v["points"][0]["slo"]["ok"] = Value::from("five");
    assert!(matches!(
        BenchReport::from_json(&v.to_string()),
        Err(ReportError::Json(_))
    ));
}

/// What a documented field holds: an object of a section, a list of them, a map (`object`:
/// keys of its own), or a scalar.
#[derive(Debug)]
enum Holds {
    Section(String),
    List(String),
    Map,
    Scalar,
}

/// A documented field: what it holds, and whether the JSON may leave it out (its type says
/// "omitted when absent").
#[derive(Debug)]
struct Field {
    holds: Holds,
    optional: bool,
}

type Docs = BTreeMap<String, BTreeMap<String, Field>>;

/// The docs' sections: object name → field → what it holds.
fn documented() -> Docs {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/bench-report.md"
    ))
    .expect("docs/bench-report.md");
    let sections: BTreeSet<String> = doc
        .lines()
        .filter_map(|l| l.strip_prefix("### `")?.strip_suffix('`').map(String::from))
        .collect();
    let mut out: Docs = BTreeMap::new();
    let mut current = None;
    for line in doc.lines() {
        if let Some(name) = line.strip_prefix("### `").and_then(|l| l.strip_suffix('`')) {
            current = Some(name.to_owned());
            continue;
        }
        if line.starts_with("## ") {
            current = None;
        }
        let (Some(section), Some(row)) = (&current, line.strip_prefix("| `")) else {
            continue;
        };
        let (field, rest) = row.split_once("` |").expect("a field row");
        let ty = rest.split('|').next().unwrap().trim();
        let section_named = sections.iter().find(|s| ty.contains(&format!("`{s}`")));
        let holds = match section_named {
            Some(s) if ty.starts_with('[') => Holds::List(s.clone()),
            Some(s) => Holds::Section(s.clone()),
            None if ty == "object" => Holds::Map,
            None => Holds::Scalar,
        };
        let optional = ty.contains("omitted when absent");
        out.entry(section.clone())
            .or_default()
            .insert(field.into(), Field { holds, optional });
    }
    out
}

/// Checks `value`, an object of the documented `section`, both ways, and recurses.
fn check(docs: &Docs, section: &str, value: &Value, path: &str, seen: &mut BTreeSet<String>) {
    seen.insert(section.to_owned());
    let fields = &docs[section];
    let object = value
        .as_object()
        .unwrap_or_else(|| panic!("{path}: not an object"));
    for key in object.keys() {
        assert!(
            fields.contains_key(key),
            "{path}.{key} is not documented under {section}"
        );
    }
    for (field, Field { holds, optional }) in fields {
        let Some(v) = object.get(field) else {
            assert!(
                *optional,
                "{path}.{field} is documented but not in the JSON"
            );
            continue;
        };
        match holds {
            Holds::List(inner) => {
                let items = v
                    .as_array()
                    .unwrap_or_else(|| panic!("{path}.{field}: not a list"));
                for (i, item) in items.iter().enumerate() {
                    check(docs, inner, item, &format!("{path}.{field}[{i}]"), seen);
                }
            }
            Holds::Section(inner) if !v.is_null() => {
                check(docs, inner, v, &format!("{path}.{field}"), seen)
            }
            Holds::Map => assert!(v.is_object(), "{path}.{field}: not an object"),
            _ => {
                let numbers = v.as_array().is_some_and(|a| a.iter().all(Value::is_number));
                assert!(
                    !v.is_object() && (!v.is_array() || numbers),
                    "{path}.{field} holds objects the docs give no section"
                );
            }
        }
    }
}

#[test]
fn every_documented_field_is_in_the_json_and_no_other() {
    let docs = documented();
    assert!(docs.len() >= 15, "{:?}", docs.keys());
    let json: Value = serde_json::from_str(&sweep().to_json()).unwrap();
    let mut seen = BTreeSet::new();
    check(&docs, "BenchReport", &json, "report", &mut seen);
    // The sweep holds every object at least once, so every section was checked.
    let all: BTreeSet<String> = docs.keys().cloned().collect();
    assert_eq!(seen, all);
}

/// The row of `table` whose first cell is `first`, split into cells of two spaces or more.
fn row<'a>(table: &'a str, first: &str) -> Vec<&'a str> {
    table
        .lines()
        .find(|l| l.split("  ").next() == Some(first))
        .unwrap_or_else(|| panic!("no row {first} in\n{table}"))
        .split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect()
}

#[test]
fn the_table_shows_the_numbers() {
    let t = render_table(&sweep());
    assert!(
        t.contains("smollm2 (completions) at http://127.0.0.1:8000"),
        "{t}"
    );
    let header = row(&t, "point");
    assert_eq!(
        header,
        [
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
            "E2E p99"
        ]
    );
    // The first "low" row is the latency table's: 5 ok, 2 shed, 2 failed in 2 s; TTFT p50
    // 400 ms, TPOT p50 40 ms, E2E p50 600 ms.
    let low = row(&t, "low");
    assert_eq!(
        &low[..7],
        ["low", "poisson:rate=2", "5", "2", "2", "2.50", "16.5"]
    );
    assert_eq!(low[7], "400.0");
    assert_eq!(low[11], "40.0");
    assert_eq!(low[12], "600.0");
    let high = row(&t, "high");
    assert_eq!(&high[..6], ["high", "concurrency:8", "5", "0", "0", "5.00"]);
    // The SLO table: headers per objective, attainment with its Wilson interval, goodput.
    assert!(
        t.contains("ttft <= 500.0 ms") && t.contains("itl <= 50.0 ms"),
        "{t}"
    );
    let slo_low = t
        .lines()
        .filter(|l| l.starts_with("low "))
        .nth(1)
        .expect("the SLO table's row");
    // 4 of 5 meet TTFT: 80.0% [37.6, 96.4]; 2 of 5 meet all: 40.0% [11.8, 76.9]; goodput 1.00.
    assert!(slo_low.contains("80.0% [37.6, 96.4]"), "{slo_low}");
    assert!(slo_low.contains("40.0% [11.8, 76.9]"), "{slo_low}");
    assert!(slo_low.contains("1.00 [0.29, 1.92]"), "{slo_low}");
    assert!(
        t.contains("max goodput: 2.00 [0.59, 3.85] req/s at concurrency:8 (high)"),
        "{t}"
    );
    // The first point's generator was busy: 0.9 of a core.
    assert!(
        t.contains("low: warning: the load generator used 0.90 cores"),
        "{t}"
    );
    // Columns line up: every latency-table row as long as its header.
    let lines: Vec<&str> = t.lines().collect();
    let h = lines.iter().position(|l| l.starts_with("point  ")).unwrap();
    assert!(lines[h + 1].chars().all(|c| c == '-' || c == ' '));
    assert_eq!(lines[h + 2].find("poisson"), lines[h].find("load"));
}

#[test]
fn the_mesh_tables_show_a_simulated_points_nodes_and_traffic() {
    let t = render_table(&sweep());
    let cells = |l: &str| -> Vec<String> {
        l.split("  ")
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .map(String::from)
            .collect()
    };
    let high: Vec<Vec<String>> = t
        .lines()
        .filter(|l| l.starts_with("high "))
        .map(cells)
        .collect();
    // Latency, SLO, then decode and prefill nodes, then the traffic.
    assert_eq!(high.len(), 5, "{t}");
    let node = |role: &str, died: &str| {
        [
            "high", role, "1", died, "9", "50.0%", "50.0%", "25.0%", "75.0%", "1",
        ]
        .map(String::from)
    };
    assert_eq!(high[2], node("decode", "0"));
    assert_eq!(high[3], node("prefill", "1"));
    assert_eq!(
        high[4],
        ["high", "1.0 MB", "3", "0", "40.0%", "10.0%", "0.0%"].map(String::from)
    );
    // A point without a mesh (a real run) gets no mesh tables.
    let mut real = sweep();
    real.points[1].mesh = None;
    assert!(!render_table(&real).contains("remote prefills"));
}

#[test]
fn compare_sets_metrics_side_by_side_with_exact_ratios() {
    let a = sweep();
    let mut b = sweep();
    // B: the same requests in half the time (twice the throughput), every TTFT doubled.
    let slo = slo();
    let mut faster = scripted();
    for o in &mut faster {
        if let Some(t) = o.ttft.as_mut() {
            *t *= 2;
        }
    }
    let low: LoadShape = "poisson:rate=2".parse().unwrap();
    b.points[0] = Point::new("low", &low, &slo, &faster, ms(1000));
    b.points.remove(1);
    let extra: LoadShape = "poisson:rate=9".parse().unwrap();
    b.points
        .push(Point::new("extra", &extra, &slo, &[], ms(1000)));
    let c = compare(&a, &b).unwrap();
    let cells = |name: &str| row(&c, name);
    assert_eq!(cells("req/s"), ["req/s", "2.50", "5.00", "2.000", "B"]);
    assert_eq!(
        cells("out tok/s"),
        ["out tok/s", "16.5", "33.0", "2.000", "B"]
    );
    assert_eq!(
        cells("TTFT p50 ms"),
        ["TTFT p50 ms", "400.0", "800.0", "2.000", "A"]
    );
    assert_eq!(
        cells("ITL p50 ms"),
        ["ITL p50 ms", "40.0", "40.0", "1.000", "="]
    );
    assert_eq!(cells("shed"), ["shed", "2", "2", "1.000", "="]);
    // Doubled TTFTs: 2 of 5 (200 → 400 ms, 100 → 200 ms) still meet 500 ms.
    assert_eq!(
        cells("ttft met %"),
        ["ttft met %", "80.0", "40.0", "0.500", "A"]
    );
    assert!(c.contains("point low (poisson:rate=2)"), "{c}");
    assert!(c.contains("only in A: high (concurrency:8)"), "{c}");
    assert!(c.contains("only in B: extra (poisson:rate=9)"), "{c}");
    assert!(!c.contains("SLOs differ"));

    // A point matched by load when the labels differ.
    let mut relabelled = sweep();
    relabelled.points[1].label = "8 in flight".into();
    let c = compare(&a, &relabelled).unwrap();
    assert!(
        c.contains("point high (concurrency:8)") && !c.contains("only in"),
        "{c}"
    );

    let mut other = sweep();
    other.schema_version = SCHEMA_VERSION + 1;
    let e = compare(&a, &other).unwrap_err();
    assert!(matches!(e, ReportError::Mismatch { .. }));
    assert_eq!(
        e.to_string(),
        format!(
            "reports of different schema versions ({} and {}) cannot be compared",
            SCHEMA_VERSION,
            SCHEMA_VERSION + 1
        )
    );
    let mut other_slo = sweep();
    other_slo.slo = "ttft=1s".into();
    assert!(compare(&a, &other_slo).unwrap().contains("the SLOs differ"));
}
