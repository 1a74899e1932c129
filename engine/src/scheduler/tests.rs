//! Unit tests of the scheduler's contract: input validation and the step protocol. Whole
//! workloads run under a virtual clock in `tests/scheduler_virtual_time.rs`.

use super::*;
use kvmesh_common::kv_tier::Tier;
use kvmesh_common::ModelFingerprint;

fn config(num_blocks: usize, budget: usize) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_blocks,
        max_num_batched_tokens: budget,
        max_num_seqs: 8,
        max_model_len: 64,
        enable_prefix_caching: true,
        host_tier_blocks: 0,
        disk_tier_blocks: 0,
        hasher: BlockHasher::new(ModelFingerprint(1), 4),
    }
}

fn prompt(len: u32) -> Vec<TokenId> {
    (1..=len).collect()
}

#[test]
fn rejects_bad_prompts() {
    let mut s = Scheduler::new(config(4, 32));
    assert_eq!(s.add_sequence(1, vec![]), Err(SchedulerError::EmptyPrompt));
    assert_eq!(
        s.add_sequence(1, prompt(65)),
        Err(SchedulerError::PromptTooLong {
            len: 65,
            max_model_len: 64
        })
    );
    assert_eq!(
        s.add_sequence(1, prompt(17)),
        Err(SchedulerError::PromptExceedsPool {
            needed: 5,
            num_blocks: 4
        })
    );
    s.add_sequence(1, prompt(16)).unwrap();
    assert_eq!(
        s.add_sequence(1, prompt(3)),
        Err(SchedulerError::DuplicateSeqId(1))
    );
}

#[test]
fn rejects_bad_configs() {
    let mut c = config(4, 32);
    c.block_size = 8;
    assert!(matches!(
        c.validate(),
        Err(SchedulerError::InvalidConfig(_))
    ));
    let mut c = config(4, 32);
    c.max_num_seqs = 0;
    assert!(c.validate().is_err());
}

#[test]
#[should_panic(expected = "in flight")]
fn two_steps_cannot_be_in_flight() {
    let mut s = Scheduler::new(config(8, 32));
    s.add_sequence(1, prompt(5)).unwrap();
    let _first = s.schedule();
    let _second = s.schedule();
}

#[test]
fn sampled_tokens_must_match_the_chunks_that_returned_logits() {
    let mut s = Scheduler::new(config(8, 32));
    s.add_sequence(1, prompt(5)).unwrap();
    s.add_sequence(2, prompt(5)).unwrap();
    let out = s.schedule();
    assert_eq!(
        s.update_from_output(out, &[(1, 9)]),
        Err(SchedulerError::MissingToken(2))
    );
    let out = s.schedule();
    assert_eq!(
        s.update_from_output(out, &[(1, 9), (2, 9), (3, 9)]),
        Err(SchedulerError::UnexpectedToken(3))
    );
    let out = s.schedule();
    assert_eq!(
        s.update_from_output(out, &[(1, 9), (2, 9), (1, 8)]),
        Err(SchedulerError::DuplicateToken(1))
    );
    let out = s.schedule();
    assert_eq!(
        s.update_from_output(out, &[(2, 9), (1, 9), (2, 8)]),
        Err(SchedulerError::DuplicateToken(2))
    );
    // Failed updates applied nothing: the same prefill is planned again. Tokens may come in
    // any order.
    let out = s.schedule();
    assert_eq!(out.step.num_tokens(), 10);
    let outcome = s.update_from_output(out, &[(2, 7), (1, 9)]).unwrap();
    assert!(outcome.context_full.is_empty());
    assert_eq!(s.sequence_tokens(1).unwrap().output, &[9]);
    assert_eq!(s.sequence_tokens(2).unwrap().output, &[7]);
}

#[test]
fn a_mid_prefill_chunk_takes_no_token() {
    let mut s = Scheduler::new(config(8, 4));
    s.add_sequence(1, prompt(6)).unwrap();
    let out = s.schedule();
    assert!(!out.step.chunks[0].want_logits);
    assert_eq!(
        s.update_from_output(out, &[(1, 9)]),
        Err(SchedulerError::UnexpectedToken(1))
    );
}

#[test]
fn queued_prompt_tokens_are_the_local_prefill_left() {
    let mut s = Scheduler::new(config(16, 4));
    s.add_sequence(1, prompt(10)).unwrap();
    s.add_remote_sequence(2, prompt(8)).unwrap();
    s.add_sequence(3, prompt(5)).unwrap();
    // The remote prompt's KV comes from elsewhere: 10 + 5.
    assert_eq!(s.queued_prompt_tokens(), 15);
    let out = s.schedule();
    assert_eq!(out.step.chunks[0].tokens.len(), 4);
    let _ = s.update_from_output(out, &[]).unwrap();
    assert_eq!(s.queued_prompt_tokens(), 11);
    // Prefilled to the end, every sequence decodes: nothing is left to prefill.
    let mut steps = 0;
    while s.queued_prompt_tokens() > 0 {
        let out = s.schedule();
        let tokens: Vec<_> = out
            .step
            .chunks
            .iter()
            .filter(|c| c.want_logits)
            .map(|c| (c.seq_id, 7))
            .collect();
        let _ = s.update_from_output(out, &tokens).unwrap();
        steps += 1;
        assert!(steps < 10, "prefill never ended");
    }
    assert!(s.sequence_tokens(1).is_some_and(|t| !t.output.is_empty()));
    assert!(s.sequence_tokens(3).is_some_and(|t| !t.output.is_empty()));
    // A remote prefill that falls back to a local one queues its prompt here.
    assert!(s.fail_remote_prefill(2));
    assert_eq!(s.queued_prompt_tokens(), 8);
}

#[test]
fn an_aborted_step_is_planned_again() {
    let mut s = Scheduler::new(config(8, 32));
    s.add_sequence(1, prompt(6)).unwrap();
    let first = s.schedule();
    let step = first.step.clone();
    s.abort_step(first);
    let again = s.schedule();
    assert_eq!(again.step, step);
    assert!(again.admitted.is_empty(), "already admitted");
    let outcome = s.update_from_output(again, &[(1, 7)]).unwrap();
    assert!(outcome.context_full.is_empty());
    assert_eq!(s.pool().num_used(), 2);
}

#[test]
fn stale_output_is_rejected() {
    let mut s = Scheduler::new(config(8, 32));
    s.add_sequence(1, prompt(3)).unwrap();
    let old = s.schedule();
    let step = old.step.clone();
    s.abort_step(old);
    let current = s.schedule();
    let forged = SchedulerOutput {
        step,
        preempted: vec![],
        admitted: vec![],
        remote_admitted: vec![],
        step_id: current.step_id - 1,
        scheduled: vec![],
    };
    assert_eq!(
        s.update_from_output(forged, &[]).unwrap_err(),
        SchedulerError::StaleOutput
    );
    let outcome = s.update_from_output(current, &[(1, 1)]).unwrap();
    assert!(outcome.context_full.is_empty());
}

#[test]
fn cancel_while_in_flight_ignores_the_results() {
    let mut s = Scheduler::new(config(8, 32));
    s.add_sequence(1, prompt(5)).unwrap();
    let out = s.schedule();
    assert!(s.finish(1));
    assert_eq!(s.pool().num_used(), 0);
    // A new sequence reusing the id is not confused with the cancelled one.
    s.add_sequence(1, prompt(3)).unwrap();
    assert_eq!(
        s.update_from_output(out, &[(1, 42)]),
        Ok(StepOutcome::default())
    );
    assert_eq!(s.sequence_tokens(1).unwrap().output, &[] as &[TokenId]);
    assert_eq!(s.num_waiting(), 1);
    assert!(!s.finish(2));
}

#[test]
fn a_full_context_finishes_the_sequence() {
    let mut c = config(16, 64);
    c.max_model_len = 6;
    let mut s = Scheduler::new(c);
    s.add_sequence(1, prompt(5)).unwrap();
    let out = s.schedule();
    let outcome = s.update_from_output(out, &[(1, 7)]).unwrap();
    assert_eq!(outcome.context_full, vec![1]);
    assert!(!s.has_work());
    assert_eq!(s.pool().num_used(), 0);
}

#[test]
fn the_pool_caps_sequence_length_too() {
    // 2 blocks of 4: a sequence can never hold more than 8 tokens of KV.
    let mut s = Scheduler::new(config(2, 64));
    s.add_sequence(1, prompt(7)).unwrap();
    let out = s.schedule();
    let outcome = s.update_from_output(out, &[(1, 7)]).unwrap();
    assert_eq!(outcome.context_full, vec![1]);
}

#[test]
fn admission_respects_max_num_seqs() {
    let mut c = config(64, 1_000);
    c.max_num_seqs = 3;
    let mut s = Scheduler::new(c);
    for id in 0..5 {
        s.add_sequence(id, prompt(4)).unwrap();
    }
    let out = s.schedule();
    assert_eq!(out.step.chunks.len(), 3);
    assert_eq!((s.num_running(), s.num_waiting()), (3, 2));
    s.abort_step(out);
}

#[test]
fn full_blocks_are_announced_as_they_are_computed() {
    let mut s = Scheduler::new(config(16, 4));
    s.set_record_kv_events(true);
    s.add_sequence(1, prompt(9)).unwrap();
    let hashes = s.config().hasher.sequence_hashes(&prompt(9));
    let out = s.schedule();
    let _ = s.update_from_output(out, &[]).unwrap();
    assert_eq!(
        s.drain_kv_events(),
        vec![TieredKvEvent::stored(Tier::Device, hashes[0])]
    );
    let out = s.schedule();
    let _ = s.update_from_output(out, &[]).unwrap();
    let out = s.schedule(); // the last prompt token: no new full block
    let _ = s.update_from_output(out, &[(1, 5)]).unwrap();
    assert_eq!(
        s.drain_kv_events(),
        vec![TieredKvEvent::stored(Tier::Device, hashes[1])]
    );
}

#[test]
fn a_prompt_hashed_by_the_caller_is_cached_under_the_same_hashes() {
    // Hashes the scheduler's own hasher made are taken; another block size's are not.
    let mut own = Scheduler::new(config(16, 64));
    let mut foreign = Scheduler::new(config(16, 64));
    for s in [&mut own, &mut foreign] {
        s.set_record_kv_events(true);
    }
    let hasher = own.config().hasher;
    own.add_sequence_hashed(1, prompt(9), &PromptHashes::new(hasher, &prompt(9)))
        .unwrap();
    let other = BlockHasher::new(ModelFingerprint(1), 2);
    foreign
        .add_remote_sequence_hashed(1, prompt(9), &PromptHashes::new(other, &prompt(9)))
        .unwrap();
    assert!(foreign.fail_remote_prefill(1));
    let expected: Vec<_> = hasher
        .sequence_hashes(&prompt(9))
        .into_iter()
        .map(|h| TieredKvEvent::stored(Tier::Device, h))
        .collect();
    for s in [&mut own, &mut foreign] {
        let out = s.schedule();
        let _ = s.update_from_output(out, &[(1, 5)]).unwrap();
        assert_eq!(s.drain_kv_events(), expected);
    }
}

// ---- Remote prefill ----

#[test]
fn a_remote_prefill_holds_blocks_but_stays_out_of_the_batch() {
    let mut s = Scheduler::new(config(16, 32));
    s.add_remote_sequence(1, prompt(10)).unwrap();
    s.add_sequence(2, prompt(3)).unwrap();
    let out = s.schedule();
    assert_eq!(out.remote_admitted.len(), 1);
    let adm = &out.remote_admitted[0];
    assert_eq!(
        (adm.seq_id, adm.num_cached_tokens, adm.blocks.len()),
        (1, 0, 3)
    );
    // Only the local sequence computes.
    assert_eq!(out.step.chunks.len(), 1);
    assert_eq!(out.step.chunks[0].seq_id, 2);
    let _ = s.update_from_output(out, &[(2, 9)]).unwrap();
    assert_eq!((s.num_awaiting_kv(), s.pool().num_used()), (1, 4));
    assert!(s.is_awaiting_kv(1));

    // Still waiting: later steps leave it out.
    let out = s.schedule();
    assert!(out.step.chunks.iter().all(|c| c.seq_id != 1));
    let _ = s.update_from_output(out, &[(2, 9)]).unwrap();

    // KV arrived: it decodes its first token from the next step on.
    let outcome = s.complete_remote_prefill(1, 42).unwrap();
    assert!(outcome.context_full.is_empty());
    assert_eq!(s.sequence_tokens(1).unwrap().output, &[42]);
    let out = s.schedule();
    let chunk = out.step.chunks.iter().find(|c| c.seq_id == 1).unwrap();
    assert_eq!((chunk.start_pos, &chunk.tokens[..]), (10, &[42][..]));
    assert!(chunk.want_logits);
    s.abort_step(out);
}

#[test]
fn only_the_uncached_part_of_a_remote_prompt_is_transferred() {
    let mut s = Scheduler::new(config(16, 32));
    s.add_sequence(1, prompt(12)).unwrap();
    let out = s.schedule();
    let _ = s.update_from_output(out, &[(1, 5)]).unwrap();
    assert!(s.finish(1));
    assert_eq!(s.probe_prefix(&prompt(20)), 12);

    s.add_remote_sequence(2, prompt(20)).unwrap();
    let out = s.schedule();
    let adm = &out.remote_admitted[0];
    assert_eq!(adm.num_cached_tokens, 12);
    assert_eq!(adm.blocks.len(), 2); // positions 12..20
    s.abort_step(out);
}

#[test]
fn a_completed_remote_prompt_becomes_a_prefix_hit() {
    let mut s = Scheduler::new(config(16, 32));
    s.add_remote_sequence(1, prompt(9)).unwrap();
    let out = s.schedule();
    s.abort_step(out);
    assert_eq!(s.probe_prefix(&prompt(9)), 0, "no hits before the KV is in");
    let _ = s.complete_remote_prefill(1, 3).unwrap();
    assert_eq!(s.probe_prefix(&prompt(9)), 8);
}

#[test]
fn a_failed_transfer_releases_its_blocks_and_prefills_locally() {
    let mut s = Scheduler::new(config(16, 32));
    s.add_remote_sequence(1, prompt(10)).unwrap();
    let out = s.schedule();
    s.abort_step(out);
    assert_eq!(s.pool().num_used(), 3);
    assert!(s.fail_remote_prefill(1));
    assert_eq!(
        (s.pool().num_used(), s.num_awaiting_kv(), s.num_waiting()),
        (0, 0, 1)
    );
    assert!(!s.fail_remote_prefill(1), "no longer remote");
    assert_eq!(
        s.complete_remote_prefill(1, 3),
        Err(SchedulerError::NotAwaitingKv(1))
    );
    let out = s.schedule();
    assert_eq!(out.step.chunks[0].tokens, prompt(10));
    assert!(out.admitted[0].resumed);
    let _ = s.update_from_output(out, &[(1, 7)]).unwrap();
    assert_eq!(s.sequence_tokens(1).unwrap().output, &[7]);
}

#[test]
fn a_queued_remote_prefill_can_fall_back_before_it_has_blocks() {
    let mut s = Scheduler::new(config(16, 32));
    s.add_remote_sequence(1, prompt(6)).unwrap();
    assert!(s.fail_remote_prefill(1));
    let out = s.schedule();
    assert!(out.remote_admitted.is_empty());
    assert_eq!(out.step.chunks[0].tokens.len(), 6);
    s.abort_step(out);
}

#[test]
fn remote_prefills_wait_for_blocks_and_slots_in_arrival_order() {
    let mut c = config(4, 64);
    c.max_num_seqs = 2;
    let mut s = Scheduler::new(c);
    s.add_remote_sequence(1, prompt(12)).unwrap(); // 3 blocks
    s.add_remote_sequence(2, prompt(8)).unwrap(); // 2 blocks: not enough left
    s.add_sequence(3, prompt(2)).unwrap(); // behind 2
    let out = s.schedule();
    assert_eq!(out.remote_admitted.len(), 1);
    assert!(out.step.chunks.is_empty());
    s.abort_step(out);
    assert_eq!(s.num_waiting(), 2);

    // Finishing 1 frees its blocks; 2 and then 3 fit, and fill both slots.
    let _ = s.complete_remote_prefill(1, 5).unwrap();
    assert!(s.finish(1));
    let out = s.schedule();
    assert_eq!(out.remote_admitted[0].seq_id, 2);
    assert_eq!(out.admitted[0].seq_id, 3);
    s.abort_step(out);
    s.add_remote_sequence(4, prompt(2)).unwrap();
    let out = s.schedule();
    assert!(
        out.remote_admitted.is_empty(),
        "max_num_seqs counts awaiting sequences"
    );
    s.abort_step(out);
}

#[test]
fn finishing_a_sequence_that_awaits_kv_frees_its_blocks() {
    let mut s = Scheduler::new(config(16, 32));
    s.add_remote_sequence(1, prompt(10)).unwrap();
    let out = s.schedule();
    s.abort_step(out);
    assert!(s.finish(1));
    assert_eq!((s.pool().num_used(), s.num_awaiting_kv()), (0, 0));
    assert!(!s.has_work());
}

#[test]
fn a_first_token_that_fills_the_context_finishes_the_sequence() {
    let mut c = config(16, 64);
    c.max_model_len = 6;
    let mut s = Scheduler::new(c);
    s.add_remote_sequence(1, prompt(5)).unwrap();
    let out = s.schedule();
    s.abort_step(out);
    let outcome = s.complete_remote_prefill(1, 9).unwrap();
    assert_eq!(outcome.context_full, vec![1]);
    assert_eq!(s.pool().num_used(), 0);
}

#[test]
fn appended_tokens_are_computed_in_the_next_chunk() {
    let mut s = Scheduler::new(config(16, 64));
    s.add_sequence(1, prompt(5)).unwrap();
    let out = s.schedule();
    let _ = s.update_from_output(out, &[(1, 7)]).unwrap();
    let appended = s.append_tokens(1, &[8, 9, 10]);
    assert_eq!(
        appended,
        Appended {
            count: 3,
            context_full: false
        }
    );
    let out = s.schedule();
    let chunk = &out.step.chunks[0];
    assert_eq!(
        (chunk.start_pos, &chunk.tokens[..]),
        (5, &[7, 8, 9, 10][..])
    );
    assert!(chunk.want_logits);
    let _ = s.update_from_output(out, &[(1, 11)]).unwrap();
    assert_eq!(s.sequence_tokens(1).unwrap().output, [7, 8, 9, 10, 11]);
}

#[test]
fn appended_tokens_beyond_the_budget_take_a_chunk_without_logits_first() {
    let mut s = Scheduler::new(config(16, 2));
    s.add_sequence(1, prompt(2)).unwrap();
    let out = s.schedule();
    let _ = s.update_from_output(out, &[(1, 7)]).unwrap();
    let _ = s.append_tokens(1, &[8, 9, 10]);
    let out = s.schedule();
    assert!(!out.step.chunks[0].want_logits);
    assert_eq!(
        s.update_from_output(out, &[(1, 1)]),
        Err(SchedulerError::UnexpectedToken(1))
    );
    let out = s.schedule();
    let _ = s.update_from_output(out, &[]).unwrap();
    let out = s.schedule();
    assert_eq!(out.step.chunks[0].tokens, [9, 10]);
    assert!(out.step.chunks[0].want_logits);
    let _ = s.update_from_output(out, &[(1, 11)]).unwrap();
}

#[test]
fn appending_stops_at_the_token_that_fills_the_context() {
    let mut c = config(16, 64);
    c.max_model_len = 8;
    let mut s = Scheduler::new(c);
    s.add_sequence(1, prompt(5)).unwrap();
    let out = s.schedule();
    let _ = s.update_from_output(out, &[(1, 6)]).unwrap();
    let appended = s.append_tokens(1, &[7, 8, 9]);
    assert_eq!(
        appended,
        Appended {
            count: 2,
            context_full: true
        }
    );
    assert!(!s.has_work());
    assert_eq!(s.pool().num_used(), 0);
    assert_eq!(s.append_tokens(1, &[1]), Appended::default());
}

/// Runs `s` for `steps` steps on a machine whose step takes exactly `1 ms + 1 ms per token +
/// 10 µs per position attended`, each step's time given back to the scheduler. Returns each
/// step's (seconds, tokens of sequence `watch` before position `upto`).
fn run_timed(s: &mut Scheduler, steps: usize, watch: SeqId, upto: usize) -> Vec<(f64, usize)> {
    let cost =
        |shape: StepShape| 0.001 + 0.001 * shape.tokens as f64 + 1e-5 * shape.attended as f64;
    let mut seen = Vec::new();
    for _ in 0..steps {
        let out = s.schedule();
        let shape = StepShape::of(&out.step);
        let seconds = cost(shape);
        s.observe_step_time(shape, Duration::from_secs_f64(seconds));
        let watched = out
            .step
            .chunks
            .iter()
            .filter(|c| c.seq_id == watch && c.start_pos < upto)
            .map(|c| c.tokens.len())
            .sum();
        seen.push((seconds, watched));
        let sampled: Vec<_> = out
            .step
            .chunks
            .iter()
            .filter(|c| c.want_logits)
            .map(|c| (c.seq_id, 7))
            .collect();
        let _ = s.update_from_output(out, &sampled).unwrap();
    }
    seen
}

#[test]
fn a_step_time_target_sizes_prefill_chunks_by_their_cost() {
    let timed = |target: Option<Duration>| {
        let mut c = config(256, 64);
        c.max_model_len = 512;
        let mut s = Scheduler::new(c);
        s.set_max_step_time(target);
        // Two streams decode; the step times teach the model; then a long prompt arrives.
        s.add_sequence(1, prompt(8)).unwrap();
        s.add_sequence(2, prompt(12)).unwrap();
        run_timed(&mut s, 20, 3, 0);
        s.add_sequence(3, (1000..1300).collect::<Vec<_>>()).unwrap();
        run_timed(&mut s, 60, 3, 300)
    };

    let target = 0.03;
    let steps = timed(Some(Duration::from_secs_f64(target)));
    let chunks: Vec<usize> = steps.iter().map(|&(_, n)| n).filter(|&n| n > 0).collect();
    assert_eq!(
        chunks.iter().sum::<usize>(),
        300,
        "the prompt is prefilled: {chunks:?}"
    );
    // The decodes and the first prompts' steps taught the model what tokens and attention
    // cost: every step of the long prompt keeps to the target, and its chunks shrink as the
    // context they attend grows.
    for (i, &(seconds, n)) in steps.iter().enumerate() {
        assert!(
            seconds <= target * 1.02,
            "step {i}: {seconds} s with a chunk of {n}"
        );
    }
    let full = &chunks[..chunks.len() - 1];
    assert!(full.windows(2).all(|w| w[1] <= w[0]), "{chunks:?}");
    assert!(full.last() < full.first(), "{chunks:?}");

    // Without a target the token budget alone sizes chunks: steps far over 30 ms.
    let untimed = timed(None);
    let longest = untimed.iter().map(|&(s, _)| s).fold(0.0, f64::max);
    assert!(longest > 2.0 * target, "{longest}");
}
