//! The simulator against the real mesh: one round of `bench/sim/agreement.sh --quick`, 60
//! requests of the Mooncake trace replayed on a real 2-prefill/2-decode mesh on this machine
//! (etcd, a router and four node processes of one compute thread each) and simulated with a
//! profile `kvmesh profile --quick` measures just before, the four nodes sharing this
//! machine's cores as the real processes do.
//!
//! Throughput must agree within 20%. TTFT p50 within a factor of 1.5: on a shared two-core
//! machine one real replay's TTFT p50 moves by about 15% from run to run (twelve replays of
//! these requests on one day: 0.60 to 0.81 s; one round's ratio 0.75 to 1.07 that day, 1.28
//! on another), so one run is held to a wider band than the script's median of three rounds
//! (docs/sim.md). The band still fails a simulator that ignores the shared cores (0.55 of
//! real that day) or a timing model gone wrong.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

const REQUESTS: u32 = 60;

fn scratch() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("sim_agreement");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

fn number(value: &Value, pointer: &str) -> f64 {
    value
        .pointer(pointer)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("no number at {pointer}: {value}"))
}

#[test]
fn the_simulator_agrees_with_the_real_mesh_on_a_slice_of_the_trace() {
    let dir = scratch();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/sim/agreement.sh");
    let output = Command::new(script)
        .args([
            "--rounds",
            "1",
            "--quick",
            "--requests",
            &REQUESTS.to_string(),
        ])
        .arg("--out")
        .arg(&dir)
        .arg("--kvmesh")
        .arg(env!("CARGO_BIN_EXE_kvmesh"))
        .env("KVMESH_LOG", "warn")
        .env_remove("KVMESH_THREADS")
        .output()
        .expect("the agreement script runs");
    assert!(
        output.status.success(),
        "bench/sim/agreement.sh\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let round = dir.join("round1");
    let real = read_json(&round.join("real.json"));
    let real = &real["kv_aware"];
    let sim = read_json(&round.join("sim.json"));
    let sim = &sim["points"][0]["slo"];

    let requests = f64::from(REQUESTS);
    assert_eq!(number(real, "/completed"), requests, "{real}");
    assert_eq!(number(sim, "/ok"), requests, "{sim}");
    // The same prompts reach the same caches: the trace's shared prefixes hit in both.
    let real_hits = number(real, "/prefix_hit_rate");
    let sim_hits = number(sim, "/cached_tokens") / number(sim, "/prompt_tokens");
    assert!(real_hits > 0.0, "{real}");
    assert!(
        (sim_hits - real_hits).abs() < 0.01,
        "prefix hits: simulated {sim_hits:.4}, real {real_hits:.4}"
    );

    let throughput = number(sim, "/request_throughput") / number(real, "/request_rate");
    assert!(
        (0.8..=1.2).contains(&throughput),
        "throughput: simulated / real = {throughput:.3}\nreal: {real}\nsimulated: {sim}"
    );
    let ttft = number(sim, "/ttft/p50") / number(real, "/ttft_p50_s");
    assert!(
        (1.0 / 1.5..=1.5).contains(&ttft),
        "TTFT p50: simulated / real = {ttft:.3}\nreal: {real}\nsimulated: {sim}"
    );
    eprintln!("simulated / real: TTFT p50 {ttft:.3}, throughput {throughput:.3}");
}
