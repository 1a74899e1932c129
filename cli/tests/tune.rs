//! `kvmesh tune` end to end: real deployments (an in-process `serve` with and without a
//! prefill worker, a 1+1 mesh) measured on the real model with tiny probes, and the plan,
//! the flags' errors.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn kvmesh() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvmesh"));
    cmd.env_remove("KVMESH_CONFIG")
        .env_remove("KVMESH_DECODE_WORKERS")
        .env("KVMESH_LOG", "warn");
    cmd
}

fn run(args: &[&str]) -> Output {
    kvmesh().args(args).output().expect("kvmesh runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A space of three: serve without and with a prefill worker, and a 1+1 mesh.
const SMALL_SPACE: &[&str] = &[
    "--nodes",
    "2",
    "--topologies",
    "serve:0+1,serve:1+1,mesh:1+1",
    "--step-budgets",
    "128",
    "--step-times",
    "off",
    "--local-prefill",
    "0",
    "--policies",
    "kv_aware",
    "--ttft-targets",
    "off",
];

const BUDGET: Duration = Duration::from_secs(75);

#[test]
fn tune_measures_every_candidate_and_writes_a_config_that_serves() {
    let out = tempfile::tempdir().unwrap();
    let out_dir = out.path().to_str().unwrap();
    let mut args = vec!["tune"];
    args.extend_from_slice(SMALL_SPACE);
    args.extend([
        "--budget",
        "75s",
        "--min-probe",
        "2s",
        "--probes",
        "4",
        "--max-concurrency",
        "8",
        "--max-tokens",
        "4",
        "--workload",
        "synthetic:input=16,output=4",
        "--slo",
        "ttft=5s",
        "--out",
        out_dir,
    ]);
    let started = Instant::now();
    let output = run(&args);
    let took = started.elapsed();
    let stdout = text(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        text(&output.stderr)
    );
    // The schedule gives each measurement its share of what is left; one start-up's
    // overrun is the slack.
    assert!(took < BUDGET + Duration::from_secs(20), "took {took:?}");

    // Every candidate has a measured row (none failed) in the table.
    let table: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.contains("goodput/s"))
        .skip(1)
        .take_while(|l| l.starts_with('#'))
        .collect();
    for (i, kind) in ["serve 0p+1d", "serve 1p+1d", "mesh 1:1"]
        .iter()
        .enumerate()
    {
        let rows: Vec<&&str> = table
            .iter()
            .filter(|l| l.starts_with(&format!("#{i} ")))
            .collect();
        assert!(!rows.is_empty(), "#{i} unmeasured:\n{stdout}");
        for row in rows {
            assert!(row.contains(kind) && !row.contains("failed"), "{row}");
        }
    }
    // The mesh ran from its rendered per-role files.
    let mesh = out.path().join("candidates/2-rung0");
    for file in ["router.toml", "prefill.toml", "decode.toml"] {
        assert!(mesh.join(file).is_file(), "{file} missing");
    }
    assert!(stdout.contains("best: #"), "{stdout}");

    check_best(&out.path().join("best"), &stdout);
    check_pareto(&out.path().join("pareto.svg"));
    assert!(std::fs::read(out.path().join("pareto.png"))
        .unwrap()
        .starts_with(b"\x89PNG"));
}

/// The best configuration's files load in their roles; a serve one also serves.
fn check_best(best: &Path, stdout: &str) {
    let serve = best.join("serve.toml");
    let roles: Vec<(&str, std::path::PathBuf)> = if serve.is_file() {
        vec![("serve", serve.clone())]
    } else {
        ["router", "prefill", "decode"]
            .iter()
            .map(|r| (*r, best.join(format!("{r}.toml"))))
            .collect()
    };
    for (role, file) in &roles {
        let toml = std::fs::read_to_string(file).unwrap();
        assert!(stdout.contains(&toml), "the printed best lacks {role}.toml");
        assert!(toml.starts_with("# kvmesh tune: best of 3"), "{toml}");
        let output = run(&[role, "--config", file.to_str().unwrap(), "--print-config"]);
        assert!(
            output.status.success(),
            "{role} rejects its file: {}",
            text(&output.stderr)
        );
        if *role != "router" {
            assert!(
                text(&output.stdout).contains("max_num_batched_tokens = 128"),
                "{}",
                text(&output.stdout)
            );
        }
    }
    if serve.is_file() {
        let addr = free_addr();
        let mut child = kvmesh()
            .args(["serve", "--config", serve.to_str().unwrap()])
            .args(["--listen", &addr.to_string(), "--threads", "1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut healthy = false;
        while Instant::now() < deadline {
            if get_status(addr, "/health") == Some(200) {
                healthy = true;
                break;
            }
            assert!(child.try_wait().unwrap().is_none(), "serve exited");
            // A process start-up with no push signal to await; bounded by the deadline.
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = child.kill();
        let _ = child.wait();
        assert!(healthy, "the best configuration did not serve");
    }
}

fn check_pareto(svg: &Path) {
    let svg = std::fs::read_to_string(svg).unwrap();
    let doc = roxmltree::Document::parse(&svg).expect("the Pareto SVG is well-formed XML");
    let texts: String = doc
        .descendants()
        .filter(|n| n.is_text())
        .filter_map(|n| n.text())
        .collect();
    assert!(texts.contains("TTFT p99 (ms)"), "{texts}");
    assert!(texts.contains("Goodput vs TTFT p99"), "{texts}");
    // One mark per candidate with a TTFT.
    let circles = doc
        .descendants()
        .filter(|n| n.has_tag_name("circle"))
        .count();
    assert_eq!(circles, 3, "{texts}");
}

fn free_addr() -> SocketAddr {
    kvmesh_common::net::free_addr("127.0.0.1").unwrap()
}

fn get_status(addr: SocketAddr, path: &str) -> Option<u16> {
    let mut s = TcpStream::connect(addr).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut r = String::new();
    s.read_to_string(&mut r).ok()?;
    r.split(' ').nth(1)?.parse().ok()
}

#[test]
fn a_dry_run_prints_the_plan_and_starts_nothing() {
    let out = tempfile::tempdir().unwrap();
    let out_dir = out.path().join("never");
    let mut args = vec!["tune"];
    args.extend_from_slice(SMALL_SPACE);
    let out_arg = out_dir.to_str().unwrap();
    args.extend([
        "--budget",
        "70s",
        "--min-probe",
        "1s",
        "--dry-run",
        "--out",
        out_arg,
    ]);
    let output = run(&args);
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert!(stdout.starts_with("3 candidates:\n"), "{stdout}");
    assert!(
        stdout.contains("#2   mesh 1:1, step 128 tokens"),
        "{stdout}"
    );
    // 3 then 2 candidates: 7 units of 10 s.
    assert!(stdout.contains("rung 0: 3 candidates x 10s"), "{stdout}");
    assert!(stdout.contains("rung 1: 2 candidates x 20s"), "{stdout}");
    assert!(!out_dir.exists(), "a dry run wrote {}", out_dir.display());

    // The default space on 4 nodes, sampled to what 20 minutes afford, seeded.
    let a = run(&["tune", "--dry-run", "--seed", "3"]);
    let b = run(&["tune", "--dry-run", "--seed", "3"]);
    assert!(a.status.success());
    assert_eq!(a.stdout, b.stdout, "the same seed, the same plan");
    assert!(text(&a.stdout).contains("mesh 2:2"), "{}", text(&a.stdout));
}

#[test]
fn bad_flags_say_what_is_wrong() {
    let cases: &[(&[&str], &str)] = &[
        (&["--topologies", "mesh:0+2"], "a mesh needs a prefill node"),
        (
            &["--topologies", "grid:1+1"],
            "expected serve:P+D or mesh:P+D",
        ),
        (
            &["--nodes", "2", "--topologies", "mesh:2+2"],
            "needs 4 nodes",
        ),
        (&["--budget", "5s"], "affords no measurement"),
        (&["--budget", "soon"], "--budget"),
        (&["--candidates", "0"], "--candidates must be at least 1"),
        (&["--slo", "latency=1s"], "--slo"),
        (&["--workload", "nonsense:x"], "--workload"),
        (&["--ttft-targets", "later"], "or `off`"),
        (&["--step-budgets", "0"], "at least 1 token"),
        (&["--probes", "1"], "--probes must be at least 3"),
    ];
    for (flags, message) in cases {
        let mut args = vec!["tune", "--dry-run"];
        args.extend_from_slice(flags);
        let output = run(&args);
        let stderr = text(&output.stderr);
        assert!(!output.status.success(), "{flags:?} was accepted");
        assert!(stderr.contains(message), "{flags:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{flags:?}: {stderr}");
    }
}
