//! The forward pass against llama.cpp's golden outputs for SmolLM2-135M-Instruct Q4_1:
//! prompt ids, first-step top-5 (as a set, top-1 exact) and the first 8 greedy tokens; and
//! batch invariance (a sequence's greedy tokens do not depend on what it is batched with).
//!
//! Our kernels reproduce ggml's arithmetic (f16-rounded activation scales, f16 K·Q and
//! probabilities), and layer outputs match llama.cpp's bit for bit until an ulp-level
//! difference in a summation order flips a rounding; a handful of near-ties remain, handled
//! explicitly below.

mod common;

use common::{golden, model};
use kvmesh_common::BlockId;
use kvmesh_engine::llama_runner::LlamaRunner;
use kvmesh_engine::runner::{BlockTable, ChunkTokens, ModelRunner, SeqChunk, StepInput};

const BLOCK: usize = 16;

fn top_k(logits: &[f32], k: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    ids.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    ids.truncate(k);
    ids
}

/// Greedy generation of several sequences batched together in every step.
/// Returns per sequence the first-step logits and the generated tokens.
fn greedy_batch(prompts: &[Vec<u32>], new_tokens: usize) -> Vec<(Vec<f32>, Vec<u32>)> {
    let (m, _) = model();
    let per_seq = (prompts.iter().map(Vec::len).max().unwrap() + new_tokens).div_ceil(BLOCK);
    let mut runner = LlamaRunner::new(m.clone(), per_seq * prompts.len(), BLOCK);
    let mut chunks: Vec<SeqChunk> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| SeqChunk {
            seq_id: i as u64,
            tokens: p.clone().into(),
            start_pos: 0,
            block_table: (i * per_seq..(i + 1) * per_seq)
                .map(|b| BlockId(b as u32))
                .collect(),
            want_logits: true,
        })
        .collect();
    let mut results: Vec<(Vec<f32>, Vec<u32>)> = vec![(Vec::new(), Vec::new()); prompts.len()];
    for step in 0..new_tokens {
        let out = runner
            .execute(&StepInput {
                chunks: chunks.clone(),
            })
            .expect("step runs");
        for ((chunk, (seq, logits)), result) in chunks.iter_mut().zip(out.logits).zip(&mut results)
        {
            assert_eq!(seq, chunk.seq_id);
            let next = top_k(&logits, 1)[0];
            if step == 0 {
                result.0 = logits;
            }
            result.1.push(next);
            chunk.start_pos += chunk.tokens.len();
            chunk.tokens = ChunkTokens::one(next);
        }
    }
    results
}

/// Logit gap under which two candidates count as tied. llama.cpp builds for different CPUs
/// disagree on such ties among themselves (its native AVX-512 build here picks differently
/// from the golden run at the very places this tolerance covers), so demanding our pick on
/// them would test rounding luck, not the forward pass.
const NEAR_TIE: f32 = 0.1;

fn ids(v: &serde_json::Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

#[test]
fn golden_prompts_match_llama_cpp() {
    let (_, tokenizer) = model();
    let mut ties = Vec::new();
    for case in golden()["generation"].as_array().unwrap() {
        let prompt = case["prompt"].as_str().unwrap();
        let prompt_ids = tokenizer.encode(prompt, true).unwrap();
        assert_eq!(
            prompt_ids,
            ids(&case["prompt_ids"]),
            "prompt ids of {prompt:?}"
        );

        // First step: top-1 exact; the top-5 set equal except where llama.cpp's own 5th
        // place is a near-tie with what follows it; logits close to llama.cpp's.
        let (logits, greedy) = greedy_batch(std::slice::from_ref(&prompt_ids), 8).remove(0);
        let want_top5 = ids(&case["first_step_top5_ids"]);
        let want_logits: Vec<f32> =
            serde_json::from_value(case["first_step_top5_logits"].clone()).unwrap();
        let got_top5 = top_k(&logits, 5);
        assert_eq!(got_top5[0], want_top5[0], "top-1 of {prompt:?}");
        let cut = want_logits[4];
        // llama.cpp's native build here is itself up to 0.42 away from the golden logits
        // (token 260 after "The capital of France is": 15.22 vs 14.80).
        for (&id, &want) in want_top5.iter().zip(&want_logits) {
            let got = logits[id as usize];
            assert!(
                (got - want).abs() < 0.75,
                "{prompt:?}: logit of {id} is {got}, llama.cpp {want}"
            );
            if !got_top5.contains(&id) {
                assert!(
                    want - cut < NEAR_TIE,
                    "{prompt:?}: {id} missing from our top-5 {got_top5:?}"
                );
                ties.push(format!("{prompt:?}: top-5 boundary {id}"));
            }
        }

        // Greedy: teacher-forced on llama.cpp's tokens, each is our argmax or a near-tie.
        let want_greedy = &ids(&case["greedy_ids"])[..8];
        let mut forced = prompt_ids.clone();
        forced.extend(&want_greedy[..7]);
        let step_logits = logits_at_each_position(&forced, prompt_ids.len() - 1);
        let mut exact = true;
        for (i, (l, &want)) in step_logits.iter().zip(want_greedy).enumerate() {
            let ours = top_k(l, 1)[0];
            if ours != want {
                let gap = l[ours as usize] - l[want as usize];
                assert!(
                    gap < NEAR_TIE,
                    "{prompt:?}: greedy token {i}: ours {ours}, llama.cpp {want}, gap {gap}"
                );
                ties.push(format!(
                    "{prompt:?}: greedy token {i} ({ours} vs {want}, gap {gap:.3})"
                ));
                exact = false;
            }
        }
        // Free-running greedy equals llama.cpp's wherever no tie intervened.
        if exact {
            assert_eq!(greedy, want_greedy, "first 8 greedy tokens of {prompt:?}");
        }
    }
    eprintln!("near-ties tolerated: {ties:#?}");
    assert!(
        ties.len() <= 3,
        "too many near-ties to be rounding: {ties:#?}"
    );
}

/// Logits after each prefix `tokens[..=p]` for `p >= from`, in one prefill.
fn logits_at_each_position(tokens: &[u32], from: usize) -> Vec<Vec<f32>> {
    let (m, _) = model();
    let blocks = tokens.len().div_ceil(BLOCK);
    let mut runner = LlamaRunner::new(m.clone(), blocks, BLOCK);
    let table: BlockTable = (0..blocks as u32).map(BlockId).collect();
    // The prefix up to `from` in one chunk, then one token per step (each step asks logits).
    let mut out = Vec::new();
    let mut start = 0;
    for end in from + 1..=tokens.len() {
        let step = StepInput {
            chunks: vec![SeqChunk {
                seq_id: 0,
                tokens: tokens[start..end].to_vec().into(),
                start_pos: start,
                block_table: table.clone(),
                want_logits: true,
            }],
        };
        out.push(runner.execute(&step).expect("step runs").logits.remove(0).1);
        start = end;
    }
    out
}

#[test]
fn batch_of_16_matches_each_alone() {
    let (_, tokenizer) = model();
    let texts = [
        "Once upon a time",
        "The capital of France is",
        "def fibonacci(n):",
        "The three primary colors are",
        "In 1969, astronauts",
        "Water boils at",
        "My favourite recipe for pancakes starts with",
        "The quick brown fox",
        "To be or not to be,",
        "Rust is a programming language that",
        "The mitochondria is",
        "Dear diary, today",
        "1, 2, 3, 4,",
        "Photosynthesis converts",
        "A haiku about autumn:",
        "The largest ocean on Earth is the",
    ];
    let prompts: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| tokenizer.encode(t, true).unwrap())
        .collect();
    let batched = greedy_batch(&prompts, 12);
    for (prompt, (_, tokens)) in prompts.iter().zip(&batched) {
        let alone = greedy_batch(std::slice::from_ref(prompt), 12).remove(0).1;
        assert_eq!(tokens, &alone, "batched vs alone for prompt {prompt:?}");
    }
}
