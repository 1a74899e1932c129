//! The real SmolLM2-135M on `--device` against the CPU: the golden prompts (the ones
//! `engine/tests/forward_golden.rs` checks against llama.cpp), first-step top-5 ids.

use anyhow::{Context, Result};
use kvmesh_common::BlockId;
use kvmesh_engine::device::Device;
use kvmesh_engine::llama_runner::{LlamaRunner, RunnerOptions};
use kvmesh_engine::runner::{ModelRunner, SeqChunk, StepInput};
use kvmesh_engine::Loaded;
use serde_json::{json, Value};

const GOLDEN: &str = include_str!("../../../data/golden/smollm2_golden.json");
const BLOCK: usize = 16;
/// Logit gap under which two candidates count as tied (as in forward_golden.rs): a swap at
/// the top-5 boundary between such a pair is rounding, not a wrong forward pass.
const NEAR_TIE: f32 = 0.1;

/// The `k` best ids, best first.
fn top_k(logits: &[f32], k: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    ids.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    ids.truncate(k);
    ids
}

fn first_step_logits(runner: &mut LlamaRunner, prompt: &[u32]) -> Result<Vec<f32>> {
    let blocks = prompt.len().div_ceil(BLOCK);
    let step = StepInput {
        chunks: vec![SeqChunk {
            seq_id: 0,
            tokens: prompt.to_vec().into(),
            start_pos: 0,
            block_table: (0..blocks as u32).map(BlockId).collect(),
            want_logits: true,
        }],
    };
    let mut out = runner.execute(&step)?;
    Ok(out.logits.remove(0).1)
}

/// Whether `got` holds `want`'s top-5 (top-1 exact), allowing a swap at the boundary where
/// `want`'s 5th and 6th logits are within [`NEAR_TIE`].
fn same_top5(want_logits: &[f32], got: &[u32]) -> bool {
    let want = top_k(want_logits, 6);
    if got.first() != want.first() {
        return false;
    }
    let boundary_tie = want_logits[want[4] as usize] - want_logits[want[5] as usize] < NEAR_TIE;
    want[..5].iter().all(|id| got.contains(id))
        || (boundary_tie && want[..4].iter().all(|id| got.contains(id)) && got.contains(&want[5]))
}

pub fn check(
    loaded: &Loaded,
    device: Device,
    reference_gemv: bool,
    failures: &mut Vec<String>,
) -> Result<Value> {
    let golden: Value = serde_json::from_str(GOLDEN).context("the golden file is JSON")?;
    let cases = golden["generation"]
        .as_array()
        .context("golden generation cases")?;
    let longest = cases
        .iter()
        .filter_map(|c| c["prompt_ids"].as_array().map(Vec::len))
        .max()
        .unwrap_or(0);
    let blocks = longest.div_ceil(BLOCK).max(1);
    let mut cpu = LlamaRunner::new(loaded.model.clone(), blocks, BLOCK);
    let options = RunnerOptions {
        reference_gemv,
        ..RunnerOptions::default()
    };
    let mut dev = LlamaRunner::with_options(device, options, loaded.model.clone(), blocks, BLOCK)?;
    let mut results = Vec::new();
    let mut all = true;
    for case in cases {
        let text = case["prompt"].as_str().context("golden prompt")?;
        let prompt = loaded.tokenizer.encode(text, true)?;
        let want = first_step_logits(&mut cpu, &prompt).context("the CPU reference run")?;
        let got = first_step_logits(&mut dev, &prompt)?;
        let (cpu_top5, dev_top5) = (top_k(&want, 5), top_k(&got, 5));
        let llama_cpp_top1 = case["first_step_top5_ids"][0].as_u64();
        let pass = same_top5(&want, &dev_top5);
        all &= pass;
        results.push(json!({
            "prompt": text,
            "cpu_top5": cpu_top5,
            "device_top5": dev_top5,
            "llama_cpp_top1": llama_cpp_top1,
            "pass": pass,
        }));
    }
    if !all {
        failures.push(format!(
            "golden: {device} top-5 differs from the CPU's on a golden prompt"
        ));
    }
    Ok(json!({"ran": true, "prompts": results, "pass": all}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top5_allows_a_swap_only_at_a_near_tie_boundary() {
        // Ids 0..6 with logits 10, 9, 8, 7, 6.00, 5.95: the 5th and 6th are tied.
        let tied = [10.0, 9.0, 8.0, 7.0, 6.0, 5.95, 1.0];
        assert!(same_top5(&tied, &[0, 1, 2, 3, 4]));
        assert!(same_top5(&tied, &[0, 1, 2, 3, 5]));
        assert!(!same_top5(&tied, &[1, 0, 2, 3, 4]), "top-1 must be exact");
        let clear = [10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 1.0];
        assert!(!same_top5(&clear, &[0, 1, 2, 3, 5]));
        assert!(
            same_top5(&clear, &[0, 2, 1, 4, 3]),
            "a set, after the top-1"
        );
    }
}
