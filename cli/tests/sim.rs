//! `kvmesh sim` end to end: the report, CSV and plots `bench serve` writes, with the mesh's
//! statistics; sweeps, max-goodput searches, faults and shared hosts from the command line;
//! the same seed giving the same files; bad input refused with its message.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("sim")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn kvmesh(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args(args)
        .env("KVMESH_LOG", "warn")
        .output()
        .expect("kvmesh runs")
}

/// `kvmesh sim` with `args` writing into `out`; panics unless it succeeds.
fn sim(out: &Path, args: &[&str]) -> Output {
    let out_arg = out.display().to_string();
    let mut all = vec!["sim", "--out", &out_arg];
    all.extend_from_slice(args);
    let output = kvmesh(&all);
    assert!(
        output.status.success(),
        "kvmesh {all:?}\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn report(out: &Path) -> Value {
    let text = std::fs::read_to_string(out.join("report.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// A small disaggregated mesh on the built-in H200 node, a Mooncake slice at its own pace.
const MESH: &[&str] = &[
    "--decode-nodes",
    "6",
    "--prefill-nodes",
    "2",
    "--workload",
    "mooncake,scale=1",
    "--load",
    "trace",
    "--requests",
    "300",
    "--seed",
    "3",
];

#[test]
fn a_run_writes_benchs_report_with_the_mesh_and_the_same_seed_the_same_files() {
    let a = scratch("run-a");
    let output = sim(&a, MESH);
    let stdout = String::from_utf8_lossy(&output.stdout);
    // The tables: bench's, then the mesh's.
    assert!(stdout.contains("TTFT p50"), "{stdout}");
    assert!(stdout.contains("remote prefills"), "{stdout}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("x real time"), "{stderr}");

    let r = report(&a);
    assert!(r["target"]["url"]
        .as_str()
        .unwrap()
        .starts_with("sim://h200-llama8b"));
    let point = &r["points"][0];
    assert_eq!(point["slo"]["requests"], 300);
    assert_eq!(point["slo"]["ok"], 300);
    let mesh = &point["mesh"];
    let nodes = mesh["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 8);
    assert_eq!(
        nodes.iter().filter(|n| n["role"] == "prefill").count(),
        2,
        "{mesh}"
    );
    assert!(mesh["remote_prefills"].as_u64().unwrap() > 0);
    assert!(mesh["kv_bytes_transferred"].as_u64().unwrap() > 0);
    // One CSV line per request, after the header.
    let csv = std::fs::read_to_string(a.join("requests.csv")).unwrap();
    assert_eq!(csv.lines().count(), 301);
    // The plots parse, and name the series a real run's plots name.
    let svg = std::fs::read_to_string(a.join("latency_vs_load.svg")).unwrap();
    let doc = roxmltree::Document::parse(&svg).expect("the SVG is well-formed XML");
    let texts: Vec<&str> = doc
        .descendants()
        .filter_map(|n| n.text())
        .map(str::trim)
        .collect();
    for series in ["TTFT", "p50", "p99", "SLO ttft ≤ 2000 ms"] {
        assert!(texts.contains(&series), "{series} not in {texts:?}");
    }

    // The same seed: the same report and requests, byte for byte.
    let b = scratch("run-b");
    sim(&b, MESH);
    for file in ["report.json", "requests.csv"] {
        assert_eq!(
            std::fs::read(a.join(file)).unwrap(),
            std::fs::read(b.join(file)).unwrap(),
            "{file}"
        );
    }
}

#[test]
fn sweeps_searches_faults_and_shared_hosts_from_the_command_line() {
    // A rate sweep over four decode nodes: one point per rate.
    let out = scratch("sweep");
    let common = [
        "--decode-nodes",
        "4",
        "--workload",
        "synthetic:input=1024,output=64",
        "--requests",
        "200",
        "--plots",
        "none",
    ];
    let mut args = common.to_vec();
    args.extend(["--sweep", "rate=5,40"]);
    sim(&out, &args);
    let r = report(&out);
    let points = r["points"].as_array().unwrap();
    assert_eq!(points.len(), 2);
    let ttft_p99 = |p: &Value| p["slo"]["ttft"]["p99"].as_f64().unwrap();
    assert!(ttft_p99(&points[1]) > ttft_p99(&points[0]), "{r}");

    // A max-goodput search finds a rate, and the report says which.
    let out = scratch("search");
    let mut args = common.to_vec();
    args.extend([
        "--max-goodput",
        "--search-axis",
        "rate",
        "--search-start",
        "2",
        "--search-max",
        "512",
        "--slo",
        "ttft=500ms,itl=50ms",
    ]);
    sim(&out, &args);
    let found = &report(&out)["max_goodput"];
    assert!(found["level"]["value"].as_f64().unwrap() >= 2.0, "{found}");

    // A decode node dies mid-run: its requests migrate, none is lost.
    let out = scratch("fault");
    let mut args = common.to_vec();
    args.extend(["--load", "poisson:rate=20", "--fault", "die:1@3s"]);
    sim(&out, &args);
    let point = &report(&out)["points"][0];
    assert_eq!(point["slo"]["ok"], 200, "{point}");
    let mesh = &point["mesh"];
    assert!(mesh["migrations"].as_u64().unwrap() > 0, "{mesh}");
    assert_eq!(mesh["nodes"][1]["died_at_s"], 3.0);

    // Four nodes on two cores are slower than four nodes with their own.
    let e2e = |args: &[&str], name: &str| {
        let out = scratch(name);
        let mut all = common.to_vec();
        all.extend(["--load", "concurrency:8"]);
        all.extend_from_slice(args);
        sim(&out, &all);
        report(&out)["points"][0]["slo"]["e2e"]["mean"]
            .as_f64()
            .unwrap()
    };
    assert!(e2e(&["--host-cores", "2"], "shared") > e2e(&[], "own"));
}

#[test]
fn text_prompts_and_conversations_are_tokenized_with_the_models_tokenizer() {
    let dir = scratch("text");
    // Ten prompts sharing a long opening: the second and later hit the prefix cache.
    let opening = "You are a careful assistant who answers questions about geography. ".repeat(8);
    let prompts: String = (0..10)
        .map(|i| format!("{{\"prompt\": \"{opening}Question {i}: which river is longest?\", \"max_tokens\": 8}}\n"))
        .collect();
    std::fs::write(dir.join("prompts.jsonl"), prompts).unwrap();
    let chats: String = (0..10)
        .map(|i| {
            format!(
                "{{\"messages\": [{{\"role\": \"system\", \"content\": \"{opening}\"}}, \
                 {{\"role\": \"user\", \"content\": \"Question {i}\"}}], \"max_tokens\": 8}}\n"
            )
        })
        .collect();
    std::fs::write(dir.join("chats.jsonl"), chats).unwrap();
    for (file, api) in [("prompts.jsonl", "completions"), ("chats.jsonl", "chat")] {
        let out = dir.join(api);
        let workload = format!("jsonl:{}", dir.join(file).display());
        sim(
            &out,
            &[
                "--decode-nodes",
                "1",
                "--api",
                api,
                "--workload",
                &workload,
                "--load",
                "concurrency:1",
                "--requests",
                "10",
                "--plots",
                "none",
            ],
        );
        let slo = &report(&out)["points"][0]["slo"];
        assert_eq!(slo["ok"], 10, "{api}: {slo}");
        // The opening is over 80 tokens (five 16-token blocks), and every request after the
        // first finds at least four of its blocks cached.
        let prompt = slo["prompt_tokens"].as_u64().unwrap();
        assert!(prompt > 10 * 80, "{api}: {slo}");
        let cached = slo["cached_tokens"].as_u64().unwrap();
        assert!(cached >= 9 * 64 && cached < prompt, "{api}: {slo}");
    }
}

#[test]
fn bad_input_exits_nonzero_with_its_message() {
    let out = scratch("bad");
    let out_arg = out.display().to_string();
    for (args, message) in [
        (
            vec!["--decode-nodes", "0"],
            "--decode-nodes must be at least 1",
        ),
        (
            vec!["--hardware", "tpu-v9"],
            "unknown timing profile `tpu-v9`",
        ),
        (vec!["--link", "rdma800"], "unknown link class `rdma800`"),
        (
            vec!["--fault", "die:99@1s"],
            "fault names node 99, which the mesh does not have",
        ),
        (vec!["--fault", "melt:1@1s"], "bad fault `melt:1@1s`"),
        (vec!["--profile", "/nonexistent.json"], "/nonexistent.json"),
        (
            vec!["--local-prefill-max-tokens", "64"],
            "--local-prefill-max-tokens needs --prefill-nodes",
        ),
        (vec!["--requests", "0"], "--requests must be at least 1"),
        (
            vec!["--workload", "jsonl:/nonexistent.jsonl"],
            "/nonexistent.jsonl",
        ),
    ] {
        let mut all = vec!["sim", "--out", &out_arg, "--plots", "none"];
        all.extend(args.iter().copied());
        let output = kvmesh(&all);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

#[test]
fn the_planner_runs_in_the_mesh_and_the_report_bills_its_nodes() {
    let out = scratch("planner");
    let config = out.join("planner.toml");
    std::fs::write(
        &config,
        r#"
        [planner]
        policy = "load"
        prefill = { min = 1, max = 4 }
        decode = { min = 1, max = 4 }
        [planner.cooldown]
        up = "5s"
        down = "10s"
        down_stable_for = "10s"
        [planner.load]
        interval = "2s"
        prefill_queue_up = 0.25
        prefill_queue_down = 0.02
        kv_usage_up = 0.05
        kv_usage_down = 0.01
        "#,
    )
    .unwrap();
    let config_arg = config.display().to_string();
    let output = sim(
        &out,
        &[
            "--decode-nodes",
            "1",
            "--prefill-nodes",
            "1",
            "--planner",
            &config_arg,
            "--startup-delay",
            "5s",
            "--workload",
            "synthetic:input=azure,output=azure",
            "--load",
            "steps:5@20s,80@40s,5@60s",
            "--plots",
            "none",
            "--seed",
            "2",
        ],
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("node-hours prefill"), "{stdout}");
    let r = report(&out);
    let point = &r["points"][0];
    assert_eq!(point["slo"]["ok"], point["slo"]["requests"]);
    let planner = &point["planner"];
    assert_eq!(planner["policy"], "load");
    let hours = |role: &str| planner["node_hours"][role].as_f64().unwrap();
    let duration_h = point["slo"]["duration_s"].as_f64().unwrap() / 3600.0;
    // At least the two nodes it starts with, for the whole run; more while the load lasted.
    assert!(hours("prefill") >= duration_h - 1e-9 && hours("decode") >= duration_h - 1e-9);
    let total = planner["node_hours_total"].as_f64().unwrap();
    assert!((total - hours("prefill") - hours("decode")).abs() < 1e-9);
    assert!(total > 2.0 * duration_h, "{planner}");
    assert!(
        planner["nodes_requested"].as_u64().unwrap() >= 1,
        "{planner}"
    );
    assert!(planner["timeline"].as_array().unwrap().len() >= 3);
    assert!(planner["reasons"]["decode"].as_object().is_some());
    let csv = std::fs::read_to_string(out.join("planner.csv")).unwrap();
    assert!(csv.starts_with("point,at_s,prefill_serving"));

    // A planner file that does not parse, or does not validate, is refused by name.
    let bad = out.join("bad.toml");
    let bad_arg = bad.display().to_string();
    let out_arg = out.display().to_string();
    for (text, message) in [
        ("polcy = \"slo\"", "unknown field `polcy`"),
        ("[decode]\nmin = 0", "Decode min must be at least 1"),
    ] {
        std::fs::write(&bad, text).unwrap();
        let output = kvmesh(&["sim", "--out", &out_arg, "--planner", &bad_arg]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success());
        assert!(
            stderr.contains(&bad_arg) && stderr.contains(message),
            "{stderr}"
        );
    }
    let output = kvmesh(&["sim", "--out", &out_arg, "--planner", "/nonexistent.toml"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("reading the planner config /nonexistent.toml"),
        "{stderr}"
    );
}
