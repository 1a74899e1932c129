//! Whole workloads through `Scheduler` + `MockRunner` under a virtual clock: the loop a real
//! engine runs, minus I/O. Greedy decoding of the mock's deterministic logits makes every
//! sequence's output a pure function of its prompt, so outputs can be compared across runs.

use kvmesh_common::{BlockHasher, ModelFingerprint, TokenId};
use kvmesh_engine::mock_runner::{CostModel, MockRunner};
use kvmesh_engine::runner::{KvShape, ModelRunner, SeqId};
use kvmesh_engine::scheduler::{Admission, Scheduler, SchedulerConfig, SchedulerOutput};
use std::collections::HashMap;
use std::time::Duration;

const VOCAB: usize = 1_000;

fn config(block_size: usize, num_blocks: usize, budget: usize) -> SchedulerConfig {
    SchedulerConfig {
        block_size,
        num_blocks,
        max_num_batched_tokens: budget,
        max_num_seqs: 64,
        max_model_len: 4_096,
        enable_prefix_caching: true,
        host_tier_blocks: 0,
        disk_tier_blocks: 0,
        hasher: BlockHasher::new(ModelFingerprint(42), block_size),
    }
}

fn cost() -> CostModel {
    CostModel {
        decode_step_base: Duration::from_millis(5),
        prefill_per_token: Duration::from_micros(100),
        decode_per_seq: Duration::from_micros(200),
        per_context_token: Duration::from_micros(1),
    }
}

fn prompt(seed: u32, len: usize) -> Vec<TokenId> {
    (0..len as u32)
        .map(|i| (seed * 7919 + i * 31) % VOCAB as u32)
        .collect()
}

/// What one step did, for assertions.
struct StepReport {
    chunk_lens: Vec<(SeqId, usize)>,
    admitted: Vec<Admission>,
    preempted: Vec<SeqId>,
    duration: Duration,
}

/// The engine loop: schedule, execute, sample greedily, update, finish at `max_tokens`.
struct Sim {
    sched: Scheduler,
    runner: MockRunner,
    now: Duration,
    max_tokens: HashMap<SeqId, usize>,
    /// Outputs of finished sequences.
    done: HashMap<SeqId, Vec<TokenId>>,
    first_token_at: HashMap<SeqId, Duration>,
}

impl Sim {
    fn new(config: SchedulerConfig) -> Self {
        let shape = KvShape {
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 16,
            block_size: config.block_size,
            num_blocks: config.num_blocks,
        };
        Sim {
            runner: MockRunner::new(shape, VOCAB, config.max_model_len, cost()),
            sched: Scheduler::new(config),
            now: Duration::ZERO,
            max_tokens: HashMap::new(),
            done: HashMap::new(),
            first_token_at: HashMap::new(),
        }
    }

    fn add(&mut self, id: SeqId, prompt: Vec<TokenId>, max_tokens: usize) {
        self.sched.add_sequence(id, prompt).unwrap();
        self.max_tokens.insert(id, max_tokens);
    }

    fn step(&mut self) -> StepReport {
        let out: SchedulerOutput = self.sched.schedule();
        let result = self.runner.execute(&out.step).expect("valid step");
        self.now += self.runner.last_step_time();
        let report = StepReport {
            chunk_lens: out
                .step
                .chunks
                .iter()
                .map(|c| (c.seq_id, c.tokens.len()))
                .collect(),
            admitted: out.admitted.clone(),
            preempted: out.preempted.clone(),
            duration: self.runner.last_step_time(),
        };
        let sampled: Vec<(SeqId, TokenId)> = result
            .logits
            .iter()
            .map(|(id, logits)| (*id, argmax(logits)))
            .collect();
        let outcome = self.sched.update_from_output(out, &sampled).unwrap();
        assert!(outcome.context_full.is_empty());
        for (id, _) in sampled {
            self.first_token_at.entry(id).or_insert(self.now);
            let output = self.sched.sequence_tokens(id).unwrap().output.to_vec();
            if output.len() >= self.max_tokens[&id] {
                assert!(self.sched.finish(id));
                self.done.insert(id, output);
            }
        }
        report
    }

    fn run(&mut self, max_steps: usize) -> Vec<StepReport> {
        let mut reports = Vec::new();
        while self.sched.has_work() {
            assert!(reports.len() < max_steps, "no progress");
            reports.push(self.step());
        }
        reports
    }
}

fn argmax(logits: &[f32]) -> TokenId {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as TokenId
}

/// What greedy decoding of the mock model yields for `prompt`, computed without a scheduler.
fn expected_output(prompt: &[TokenId], max_tokens: usize) -> Vec<TokenId> {
    let mut tokens = prompt.to_vec();
    for _ in 0..max_tokens {
        let pos = tokens.len() - 1;
        tokens.push(MockRunner::favoured_token(tokens[pos], pos, VOCAB));
    }
    tokens.split_off(prompt.len())
}

#[test]
fn chunked_prefill_respects_the_budget() {
    let mut sim = Sim::new(config(4, 64, 16));
    sim.add(1, prompt(1, 50), 3);
    let reports = sim.run(20);

    let lens: Vec<usize> = reports.iter().map(|r| r.chunk_lens[0].1).collect();
    assert_eq!(lens, vec![16, 16, 16, 2, 1, 1]);
    // The first token comes after the four prefill chunks, at their modelled cost.
    let prefill: Duration = reports[..4].iter().map(|r| r.duration).sum();
    assert_eq!(sim.first_token_at[&1], prefill);
    assert_eq!(sim.done[&1], expected_output(&prompt(1, 50), 3));
    assert_eq!(sim.now, sim.runner.total_time());
}

#[test]
fn decodes_share_the_budget_with_a_long_prefill() {
    let mut sim = Sim::new(config(4, 64, 16));
    sim.add(1, prompt(1, 4), 10);
    sim.step(); // prefill of 1, first token
    sim.add(2, prompt(2, 40), 2);
    let r = sim.step();
    // Running decodes go first; the newcomer's prefill takes what is left.
    assert_eq!(r.chunk_lens, vec![(1, 1), (2, 15)]);
    for r in sim.run(20) {
        assert!(r.chunk_lens.iter().map(|c| c.1).sum::<usize>() <= 16);
    }
    assert_eq!(sim.done[&2], expected_output(&prompt(2, 40), 2));
}

#[test]
fn many_sequences_decode_in_one_step() {
    let mut sim = Sim::new(config(4, 128, 256));
    for id in 0..8 {
        sim.add(id, prompt(id as u32, 6), 4);
    }
    let prefill = sim.step();
    assert_eq!(prefill.chunk_lens.len(), 8);
    let decode = sim.step();
    assert_eq!(decode.chunk_lens.len(), 8);
    assert!(decode.chunk_lens.iter().all(|&(_, n)| n == 1));

    // Batching amortises the per-step base cost: 8 decodes cost far less than 8 steps.
    let mut alone = Sim::new(config(4, 128, 256));
    alone.add(0, prompt(0, 6), 4);
    alone.step();
    let single = alone.step().duration;
    assert!(
        decode.duration < single * 2,
        "{:?} vs {single:?}",
        decode.duration
    );

    sim.run(20);
    for id in 0..8 {
        assert_eq!(sim.done[&id], expected_output(&prompt(id as u32, 6), 4));
    }
}

#[test]
fn preempted_sequences_recompute_and_finish_with_the_same_tokens() {
    // Four sequences grow to 5 blocks each; only 10 blocks exist.
    let mut sim = Sim::new(config(4, 10, 64));
    for id in 0..4 {
        sim.add(id, prompt(id as u32, 8), 12);
    }
    let reports = sim.run(200);
    assert!(sim.sched.num_preemptions() > 0);
    let preempted: Vec<SeqId> = reports.iter().flat_map(|r| r.preempted.clone()).collect();
    assert!(!preempted.is_empty());
    // A preempted sequence comes back as a resume, not as a new request.
    let resumed: Vec<SeqId> = reports
        .iter()
        .flat_map(|r| r.admitted.iter().filter(|a| a.resumed).map(|a| a.seq_id))
        .collect();
    assert!(preempted.iter().all(|id| resumed.contains(id)));

    for id in 0..4 {
        assert_eq!(
            sim.done[&id],
            expected_output(&prompt(id as u32, 8), 12),
            "seq {id}"
        );
    }
    assert_eq!(sim.sched.pool().num_used(), 0);
}

#[test]
fn cancellation_frees_every_block() {
    let mut sim = Sim::new(config(4, 32, 8));
    sim.add(1, prompt(1, 30), 10);
    sim.step();
    assert!(sim.sched.pool().num_used() > 0);
    assert!(sim.sched.finish(1)); // mid-prefill
    assert_eq!(sim.sched.pool().num_used(), 0);

    sim.add(2, prompt(2, 6), 10);
    for _ in 0..4 {
        sim.step();
    }
    assert_eq!(sim.sched.sequence_tokens(2).unwrap().output.len(), 4);
    assert!(sim.sched.finish(2)); // mid-decode
    assert_eq!(sim.sched.pool().num_used(), 0);
    assert!(!sim.sched.has_work());
    // Their computed full blocks stay behind as prefix hits.
    assert!(sim.sched.pool().num_cached() > 0);

    // A waiting sequence holds nothing and cancels cleanly too.
    sim.add(3, prompt(3, 6), 10);
    assert!(sim.sched.finish(3));
    assert_eq!(sim.sched.num_waiting(), 0);
}

#[test]
fn an_identical_prompt_hits_the_prefix_cache() {
    let mut sim = Sim::new(config(16, 32, 512));
    let p = prompt(9, 40);
    sim.add(1, p.clone(), 2);
    let first = sim.step();
    assert_eq!(first.admitted[0].num_cached_tokens, 0);
    sim.run(10);

    // Two full blocks of 16 are cached; the rest is computed.
    sim.add(2, p.clone(), 2);
    let second = sim.step();
    assert_eq!(second.admitted[0].num_cached_tokens, 32);
    assert_eq!(second.chunk_lens, vec![(2, 8)]);
    sim.run(10);
    assert_eq!(sim.done[&1], sim.done[&2]);

    // A prompt of exactly two blocks must still compute its last token: one block is reused.
    let exact = prompt(9, 32);
    sim.add(3, exact, 2);
    let third = sim.step();
    assert_eq!(third.admitted[0].num_cached_tokens, 16);
    assert_eq!(third.chunk_lens, vec![(3, 16)]);
    sim.run(10);
}

#[test]
fn running_sequences_share_cached_blocks() {
    let mut sim = Sim::new(config(4, 64, 512));
    let p = prompt(5, 20);
    sim.add(1, p.clone(), 8);
    sim.step();
    sim.add(2, p.clone(), 8);
    let r = sim.step();
    assert_eq!(r.admitted[0].num_cached_tokens, 16);
    // Seq 1 holds 6 blocks (21 tokens); seq 2 shares its first 4 and owns 1 more.
    assert_eq!(sim.sched.pool().num_used(), 7);
    sim.run(20);
    assert_eq!(sim.done[&1], sim.done[&2]);
    assert_eq!(sim.sched.pool().num_used(), 0);
}

mod random_workloads {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    struct Request {
        prompt_seed: u32,
        prompt_len: usize,
        max_tokens: usize,
        arrive_at_step: usize,
        cancel_after_steps: Option<usize>,
    }

    fn request() -> impl Strategy<Value = Request> {
        (
            0u32..4,
            1usize..40,
            1usize..12,
            0usize..20,
            proptest::option::of(0usize..15),
        )
            .prop_map(
                |(prompt_seed, prompt_len, max_tokens, arrive_at_step, cancel_after_steps)| {
                    Request {
                        prompt_seed,
                        prompt_len,
                        max_tokens,
                        arrive_at_step,
                        cancel_after_steps,
                    }
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Whatever arrives, is cancelled or preempted: budgets hold, every block table is
        /// valid (the mock runner checks), every finished output is the greedy one, and no
        /// block leaks.
        #[test]
        fn invariants_hold(
            block_size in 1usize..6,
            num_blocks in 12usize..40,
            budget in 1usize..48,
            max_num_seqs in 1usize..6,
            caching in any::<bool>(),
            requests in proptest::collection::vec(request(), 1..10),
        ) {
            let mut cfg = config(block_size, num_blocks, budget);
            cfg.max_num_seqs = max_num_seqs;
            cfg.enable_prefix_caching = caching;
            let capacity = num_blocks * block_size;
            let mut sim = Sim::new(cfg);
            let mut finished = 0;
            let mut cancelled = Vec::new();
            let mut added_at = HashMap::new();
            for step in 0..2_000 {
                for (id, r) in requests.iter().enumerate() {
                    if r.arrive_at_step == step && r.prompt_len <= capacity {
                        sim.add(id as SeqId, prompt(r.prompt_seed, r.prompt_len), r.max_tokens);
                        added_at.insert(id as SeqId, step);
                    }
                    if let (Some(c), Some(&t)) = (r.cancel_after_steps, added_at.get(&(id as SeqId))) {
                        if t + c == step && sim.sched.finish(id as SeqId) {
                            cancelled.push(id as SeqId);
                        }
                    }
                }
                if !sim.sched.has_work() && step > 20 {
                    break;
                }
                let out = sim.sched.schedule();
                prop_assert!(out.step.num_tokens() <= budget);
                prop_assert!(out.step.chunks.len() <= max_num_seqs);
                let result = sim.runner.execute(&out.step).expect("valid block tables");
                let sampled: Vec<(SeqId, TokenId)> =
                    result.logits.iter().map(|(id, l)| (*id, argmax(l))).collect();
                let outcome = sim.sched.update_from_output(out, &sampled).unwrap();
                for (id, _) in sampled {
                    if outcome.context_full.contains(&id) {
                        finished += 1;
                        continue;
                    }
                    let output = sim.sched.sequence_tokens(id).unwrap().output.to_vec();
                    let r = &requests[id as usize];
                    if output.len() >= r.max_tokens {
                        prop_assert_eq!(
                            &output,
                            &expected_output(&prompt(r.prompt_seed, r.prompt_len), r.max_tokens)
                        );
                        sim.sched.finish(id);
                        finished += 1;
                    }
                }
                let pool = sim.sched.pool();
                prop_assert_eq!(pool.num_free() + pool.num_used(), num_blocks);
            }
            prop_assert!(!sim.sched.has_work(), "all work drains");
            prop_assert_eq!(finished + cancelled.len(), added_at.len());
            prop_assert_eq!(sim.sched.pool().num_used(), 0);
        }
    }
}
