//! `kvmesh bench serve`, `compare` and `plot` against a real `kvmesh serve` and the real
//! model, with tiny runs: the files a run writes (every documented report field, one CSV line
//! per request, SVG plots naming their series), a sweep's points, admission control's 429s
//! counted shed, the comparison of two reports, and bad input refused with its message.

mod cluster;

use cluster::{await_health, free_addr, Node};
use serde_json::Value;
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A tiny workload: 8-token prompts, 4 tokens out.
const WORKLOAD: &str = "synthetic:input=8,output=4";

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("bench_serve")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `kvmesh serve` with `args` on a free port, healthy.
fn serve(args: &[&str], logs: &Path) -> (Node, SocketAddr) {
    let addr = free_addr("127.0.0.1");
    let mut all = vec!["serve", "--threads", "1", "--listen"];
    let listen = addr.to_string();
    all.push(&listen);
    all.extend_from_slice(args);
    let node = Node::spawn(
        all.into_iter().map(String::from).collect(),
        logs.join("serve.log"),
    );
    await_health(addr, &[&node]);
    (node, addr)
}

fn kvmesh(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args(args)
        .env("KVMESH_LOG", "warn")
        .env_remove("KVMESH_API_KEY")
        .output()
        .expect("kvmesh runs")
}

/// `kvmesh bench serve` against `addr` with `args`, writing into `out`; panics unless it
/// succeeds.
fn bench(addr: SocketAddr, out: &Path, args: &[&str]) -> Output {
    let url = format!("http://{addr}");
    let out_arg = out.display().to_string();
    let mut all = vec![
        "bench",
        "serve",
        "--url",
        &url,
        "--workload",
        WORKLOAD,
        "--max-tokens",
        "4",
        "--no-progress",
        "--out",
        &out_arg,
    ];
    all.extend_from_slice(args);
    let output = kvmesh(&all);
    assert!(
        output.status.success(),
        "bench serve failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn report(out: &Path) -> Value {
    let text = std::fs::read_to_string(out.join("report.json")).expect("report.json");
    serde_json::from_str(&text).expect("report.json is JSON")
}

/// The fields docs/bench-report.md lists for `section`, but those it says are omitted when
/// absent (the mesh statistics only a simulated run has).
fn documented(section: &str) -> BTreeSet<String> {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/bench-report.md"
    ))
    .expect("docs/bench-report.md");
    let heading = format!("### `{section}`");
    doc.lines()
        .skip_while(|l| *l != heading)
        .skip(1)
        .take_while(|l| !l.starts_with('#'))
        .filter(|l| !l.contains("omitted when absent"))
        .filter_map(|l| {
            l.strip_prefix("| `")?
                .split_once('`')
                .map(|(f, _)| f.into())
        })
        .collect()
}

fn keys(value: &Value) -> BTreeSet<String> {
    value
        .as_object()
        .expect("an object")
        .keys()
        .cloned()
        .collect()
}

/// The non-empty text nodes of an SVG, which must parse as XML.
fn svg_texts(path: &Path) -> BTreeSet<String> {
    let svg = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let doc = roxmltree::Document::parse(&svg).expect("the SVG is well-formed XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    doc.descendants()
        .filter_map(|n| n.text())
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty())
        .collect()
}

fn csv_rows(out: &Path) -> Vec<String> {
    let csv = std::fs::read_to_string(out.join("requests.csv")).expect("requests.csv");
    let mut lines = csv.lines().map(String::from);
    let header = lines.next().expect("a header");
    assert!(header.starts_with("point,item,sent_s,"), "{header}");
    lines.collect()
}

#[test]
fn runs_write_reports_csv_and_plots_sweeps_give_points_and_reports_compare() {
    let dir = scratch("runs");
    let (_serve, addr) = serve(&[], &dir);

    // One point: the files.
    let one = dir.join("one");
    let output = bench(
        addr,
        &one,
        &[
            "--load",
            "concurrency:2",
            "--requests",
            "4",
            "--plots",
            "svg",
        ],
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("concurrency:2") && stdout.contains("TTFT p50"),
        "{stdout}"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("report.json"),
        "says where the files went: {stderr}"
    );
    let r = report(&one);
    assert_eq!(keys(&r), documented("BenchReport"));
    let points = r["points"].as_array().unwrap();
    assert_eq!(points.len(), 1);
    assert_eq!(keys(&points[0]), documented("Point"));
    assert_eq!(keys(&points[0]["slo"]), documented("SloReport"));
    assert_eq!(points[0]["label"], "concurrency:2");
    assert_eq!(points[0]["slo"]["requests"], 4);
    assert_eq!(points[0]["slo"]["ok"], 4, "{}", points[0]["slo"]);
    assert_eq!(r["slo"], "ttft=2s,itl=100ms");
    assert_eq!(r["workload"], WORKLOAD);
    let rows = csv_rows(&one);
    assert_eq!(rows.len(), 4);
    assert!(
        rows.iter().all(|r| r.starts_with("concurrency:2,")),
        "{rows:?}"
    );
    assert!(!one.join("cdf.png").exists(), "--plots svg draws no PNG");
    let latency = svg_texts(&one.join("latency_vs_load.svg"));
    for name in ["p50", "p90", "p99", "TTFT", "latency (ms)"] {
        assert!(latency.contains(name), "no `{name}` in {latency:?}");
    }
    assert!(
        latency.iter().any(|t| t.starts_with("SLO ttft")),
        "{latency:?}"
    );
    let goodput = svg_texts(&one.join("goodput_vs_load.svg"));
    assert!(
        goodput.contains("goodput") && goodput.contains("completed req/s"),
        "{goodput:?}"
    );
    assert!(svg_texts(&one.join("cdf.svg")).contains("concurrency:2"));
    let timeline = std::fs::read_dir(&one)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("timeline_01_")
        })
        .expect("a timeline plot");
    let timeline = svg_texts(&timeline);
    for name in ["offered (sent/s)", "completed/s", "in flight", "TTFT p50"] {
        assert!(timeline.contains(name), "no `{name}` in {timeline:?}");
    }

    // A sweep: one point per load, --json on stdout.
    let two = dir.join("two");
    let output = bench(
        addr,
        &two,
        &[
            "--sweep",
            "concurrency=1,2",
            "--requests",
            "3",
            "--plots",
            "none",
            "--json",
        ],
    );
    let printed: Value = serde_json::from_slice(&output.stdout).expect("--json prints the report");
    assert_eq!(printed, report(&two));
    let labels: Vec<&str> = printed["points"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["label"].as_str().unwrap())
        .collect();
    assert_eq!(labels, ["concurrency:1", "concurrency:2"]);
    assert_eq!(csv_rows(&two).len(), 6);
    assert!(!two.join("cdf.svg").exists(), "--plots none draws nothing");

    // The two compared: the shared point matched, ratios B/A.
    let a = one.join("report.json").display().to_string();
    let b = two.join("report.json").display().to_string();
    let output = kvmesh(&["bench", "compare", &a, &b]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(text.contains("point concurrency:2"), "{text}");
    assert!(
        text.contains("B/A") && text.contains("only in B: concurrency:1"),
        "{text}"
    );

    // The plots redrawn from the report alone.
    let redrawn = dir.join("redrawn");
    let output = kvmesh(&[
        "bench",
        "plot",
        &a,
        "--out",
        &redrawn.display().to_string(),
        "--plots",
        "svg",
    ]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(
        std::fs::read(redrawn.join("cdf.svg")).unwrap(),
        std::fs::read(one.join("cdf.svg")).unwrap()
    );
}

#[test]
fn admission_control_429s_count_as_shed_not_failed() {
    let dir = scratch("admission");
    // One request admitted at a time; the rest of a concurrency of 4 is refused with 429.
    let (_serve, addr) = serve(&["--max-in-flight", "1"], &dir);
    let out = dir.join("out");
    bench(
        addr,
        &out,
        &[
            "--load",
            "concurrency:4",
            "--requests",
            "16",
            "--plots",
            "none",
        ],
    );
    let r = report(&out);
    let slo = &r["points"][0]["slo"];
    assert_eq!(slo["requests"], 16);
    assert!(slo["shed"].as_u64().unwrap() > 0, "{slo}");
    assert_eq!(slo["failed"], 0, "{slo}");
    assert!(slo["ok"].as_u64().unwrap() > 0, "{slo}");
    assert_eq!(slo["errors"], serde_json::json!({}));
}

#[test]
fn bad_input_exits_nonzero_with_its_message() {
    let dir = scratch("bad");
    let fail = |args: &[&str], message: &str| {
        let output = kvmesh(args);
        assert!(!output.status.success(), "{args:?} succeeded");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains(message),
            "{args:?}: no `{message}` in {stderr}"
        );
    };
    let url = "http://127.0.0.1:9";
    fail(
        &["bench", "serve", "--url", url, "--load", "concurrency:zero"],
        "load shape: `zero`: the concurrency must be a whole number",
    );
    fail(
        &["bench", "serve", "--url", url, "--slo", "ttft=fast"],
        "bad duration",
    );
    fail(
        &[
            "bench",
            "serve",
            "--url",
            url,
            "--sweep",
            "concurrency=1",
            "--load",
            "concurrency:2",
        ],
        "cannot be used with",
    );
    let missing = dir.join("missing.jsonl").display().to_string();
    fail(
        &[
            "bench",
            "serve",
            "--url",
            url,
            "--workload",
            &format!("jsonl:{missing}"),
        ],
        &format!("opening {missing}"),
    );
    fail(&["bench", "compare", &missing, &missing], "reading");
    let not_a_report = dir.join("not_a_report.json");
    std::fs::write(&not_a_report, r#"{"points": []}"#).unwrap();
    let not_a_report = not_a_report.display().to_string();
    fail(
        &["bench", "compare", &not_a_report, &not_a_report],
        "not a kvmesh bench report",
    );
}
