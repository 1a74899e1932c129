//! `kvmesh gpu-check` on the CPU: the device run's hand-off check with both workers on the
//! CPU, so its plumbing (a prefill node pushing KV layer by layer over QUIC to a decode node,
//! requests through their gRPC services, greedy output and log-probabilities equal to a
//! CPU-only run, a control with the KV zeroed in flight caught) is proven where there is no GPU; and the checks that need a
//! GPU refuse a CPU device instead of reporting a pass.

use serde_json::Value;
use std::process::Command;

fn gpu_check(args: &[&str], out: &std::path::Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .arg("gpu-check")
        .args(args)
        .arg("--out")
        .arg(out)
        .env("KVMESH_LOG", "warn")
        .output()
        .expect("kvmesh runs")
}

#[test]
fn the_handoff_check_passes_with_both_nodes_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("gpu_check.json");
    // Peaked attention: the output depends on the context, so zeroed KV changes tokens
    // (rounding cannot differ between two CPU runs, so the model's chaos does not matter).
    let run = gpu_check(
        &["--device", "cpu", "--checks", "handoff", "--qk-scale", "2"],
        &out,
    );
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "gpu-check failed: {stderr}");
    let report: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(report["device"], "cpu");
    assert_eq!(report["failures"], serde_json::json!([]));
    let handoff = &report["handoff"];
    assert_eq!(handoff["pass"], true, "{handoff:#}");
    assert_eq!(handoff["transport"], "quic");
    assert!(handoff["kv_chunks_sent"].as_u64().unwrap() > 0);
    // The same KV, computed on the same kind of device: the same log-probabilities. KV zeroed
    // in flight moves them (`null`: a token or an alternative changed).
    assert_eq!(handoff["max_logprob_difference"].as_f64(), Some(0.0));
    let control = &handoff["control_zeroed_kv_max_logprob_difference"];
    assert!(control.as_f64().is_none_or(|d| d > 0.0), "{control}");
    let requests = handoff["requests"].as_array().unwrap();
    assert_eq!(requests.len(), 4);
    for r in requests {
        assert_eq!(r["equal"], true, "{r:#}");
        assert_eq!(r["tokens"].as_array().unwrap().len(), 16, "{r:#}");
        assert_eq!(r["tokens"], r["cpu_tokens"]);
    }
    // Every prompt's KV crossed: 30 layers of (prompt_len / 16, rounded up) blocks, f16 K
    // and V of 3 KV heads x 64 dims (the SmolLM2 shape).
    let blocks: u64 = requests
        .iter()
        .map(|r| r["prompt_tokens"].as_u64().unwrap().div_ceil(16))
        .sum();
    let block_bytes = 2 * 3 * 16 * 64 * 2;
    assert_eq!(
        handoff["kv_bytes_sent"].as_u64().unwrap(),
        30 * blocks * block_bytes
    );
}

#[test]
fn the_checks_that_need_a_gpu_refuse_a_cpu_device() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("gpu_check.json");
    for check in ["ops", "models", "sampling"] {
        let run = gpu_check(&["--device", "cpu", "--checks", check], &out);
        assert!(!run.status.success());
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(stderr.contains("needs a CUDA device"), "{stderr}");
    }
}
