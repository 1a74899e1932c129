//! `kvmesh profile` on the real model: `--quick` writes a profile the simulator loads, and bad
//! flags are refused before anything is measured. No timing thresholds: machines are noisy.

use kvmesh_engine::runner::{SeqChunk, StepInput};
use kvmesh_sim::timing::{StepShape, TimingProfile};
use std::process::{Command, Output};

fn kvmesh(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .arg("profile")
        .args(args)
        .env("KVMESH_LOG", "warn")
        .env_remove("KVMESH_THREADS")
        .output()
        .expect("kvmesh runs")
}

fn shape(chunks: &[(usize, usize)]) -> StepShape {
    StepShape::of(&StepInput {
        chunks: chunks
            .iter()
            .map(|&(start_pos, n)| SeqChunk {
                seq_id: 0,
                tokens: vec![1000; n].into(),
                start_pos,
                block_table: Default::default(),
                want_logits: true,
            })
            .collect(),
    })
}

#[test]
fn quick_profile_writes_a_profile_the_simulator_loads() {
    let model = kvmesh_prompt::model_fetch::fetched_model().unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("nested/cpu.json");
    let run = kvmesh(&[
        "--quick",
        "--repeats",
        "1",
        "--model",
        model.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(stdout.contains("measured ms"), "{stdout}");
    assert!(
        stdout.contains("prefill 64 after 128 + decode 4 at 256"),
        "{stdout}"
    );
    assert!(stdout.contains("fit: R²"), "{stdout}");

    let profile = TimingProfile::load(&out).unwrap();
    assert!(
        profile.name.starts_with("cpu-smollm2-135m-instruct-q4_1-") && profile.name.ends_with('t'),
        "{}",
        profile.name
    );
    for part in [
        "kvmesh ",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "threads",
        "R²",
    ] {
        assert!(profile.source.contains(part), "{}", profile.source);
    }
    for (term, c) in TimingProfile::TERMS.iter().zip(profile.coefficients()) {
        assert!(c.is_finite() && c >= 0.0, "{term} = {c}");
    }
    assert!(profile.step_overhead_us > 0.0, "{profile:?}");
    let prefill = profile.step_time(&shape(&[(0, 256)]));
    let decode = profile.step_time(&shape(&[(127, 1)]));
    assert!(prefill > decode, "{prefill:?} <= {decode:?}: {profile:?}");
}

#[test]
fn bad_flags_are_refused_before_measuring() {
    for (args, says) in [
        (&["--repeats", "0"][..], "--repeats"),
        (&["--threads", "0"][..], "--threads must be at least 1"),
        (&["--name", "../elsewhere"][..], "--name must be"),
        (&["--name", ""][..], "--name must be"),
        (&["--grid", "big"][..], "--grid"),
    ] {
        let run = kvmesh(args);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(!run.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}
