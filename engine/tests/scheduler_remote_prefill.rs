//! Remote prefill under a virtual clock: a decode scheduler and a prefill scheduler, each on
//! a MockRunner, with a modelled transfer delay between them. The prefill side computes the
//! prompt and samples the first token; the decode side reserves blocks, waits for the KV and
//! decodes. Greedy decoding of the mock's deterministic logits makes every output a pure
//! function of its prompt, so remote, local and fallen-back requests must all agree.

use kvmesh_common::{BlockHasher, ModelFingerprint, TokenId};
use kvmesh_engine::mock_runner::{CostModel, MockRunner};
use kvmesh_engine::runner::{KvShape, ModelRunner, SeqId};
use kvmesh_engine::scheduler::{Scheduler, SchedulerConfig};
use std::collections::HashMap;
use std::time::Duration;

const VOCAB: usize = 1_000;
const TRANSFER_DELAY: Duration = Duration::from_millis(3);
const TIMEOUT: Duration = Duration::from_millis(500);

fn config(num_blocks: usize) -> SchedulerConfig {
    SchedulerConfig {
        block_size: 4,
        num_blocks,
        max_num_batched_tokens: 32,
        max_num_seqs: 16,
        max_model_len: 1_024,
        enable_prefix_caching: true,
        host_tier_blocks: 0,
        disk_tier_blocks: 0,
        hasher: BlockHasher::new(ModelFingerprint(42), 4),
    }
}

fn runner(num_blocks: usize) -> MockRunner {
    let shape = KvShape {
        num_layers: 2,
        num_kv_heads: 2,
        head_dim: 16,
        block_size: 4,
        num_blocks,
    };
    let cost = CostModel {
        decode_step_base: Duration::from_millis(5),
        prefill_per_token: Duration::from_micros(100),
        decode_per_seq: Duration::from_micros(200),
        per_context_token: Duration::from_micros(1),
    };
    MockRunner::new(shape, VOCAB, 1_024, cost)
}

fn prompt(seed: u32, len: usize) -> Vec<TokenId> {
    (0..len as u32)
        .map(|i| (seed * 7919 + i * 31) % VOCAB as u32)
        .collect()
}

fn expected_output(prompt: &[TokenId], max_tokens: usize) -> Vec<TokenId> {
    let mut tokens = prompt.to_vec();
    for _ in 0..max_tokens {
        let pos = tokens.len() - 1;
        tokens.push(MockRunner::favoured_token(tokens[pos], pos, VOCAB));
    }
    tokens.split_off(prompt.len())
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

/// What one step did: sampled tokens, and remote admissions with their cached prefix.
type StepResult = (Vec<(SeqId, TokenId)>, Vec<(SeqId, usize)>);

/// One node: a scheduler, a runner and its own clock (it is busy until `free_at`).
struct Node {
    sched: Scheduler,
    runner: MockRunner,
    free_at: Duration,
}

impl Node {
    fn new(num_blocks: usize) -> Self {
        Node {
            sched: Scheduler::new(config(num_blocks)),
            runner: runner(num_blocks),
            free_at: Duration::ZERO,
        }
    }

    /// One step starting at `now`: returns the sampled tokens and the remote admissions.
    fn step(&mut self, now: Duration) -> StepResult {
        let out = self.sched.schedule();
        let remote = out
            .remote_admitted
            .iter()
            .map(|a| (a.seq_id, a.num_cached_tokens))
            .collect();
        let result = self.runner.execute(&out.step).expect("valid step");
        self.free_at = now + self.runner.last_step_time();
        let sampled: Vec<_> = result
            .logits
            .iter()
            .map(|(id, l)| (*id, argmax(l)))
            .collect();
        let outcome = self.sched.update_from_output(out, &sampled).unwrap();
        assert!(outcome.context_full.is_empty());
        (sampled, remote)
    }
}

struct Mesh {
    now: Duration,
    decode: Node,
    prefill: Node,
    max_tokens: HashMap<SeqId, usize>,
    /// Transfers that will complete at a time: (seq, first token).
    arriving: Vec<(Duration, SeqId, TokenId)>,
    /// Remote prefills the prefill node "loses" (a dead worker): never delivered.
    lost: Vec<SeqId>,
    done: HashMap<SeqId, Vec<TokenId>>,
    first_token_at: HashMap<SeqId, Duration>,
    /// The decode node's clock for each transfer in flight: when it gives up and falls back.
    deadlines: HashMap<SeqId, Duration>,
    fell_back: Vec<SeqId>,
}

impl Mesh {
    fn new() -> Self {
        Mesh {
            now: Duration::ZERO,
            decode: Node::new(128),
            prefill: Node::new(128),
            max_tokens: HashMap::new(),
            arriving: Vec::new(),
            lost: Vec::new(),
            done: HashMap::new(),
            first_token_at: HashMap::new(),
            deadlines: HashMap::new(),
            fell_back: Vec::new(),
        }
    }

    fn add(&mut self, id: SeqId, prompt: Vec<TokenId>, max_tokens: usize, remote: bool) {
        if remote {
            self.decode.sched.add_remote_sequence(id, prompt).unwrap();
        } else {
            self.decode.sched.add_sequence(id, prompt).unwrap();
        }
        self.max_tokens.insert(id, max_tokens);
    }

    fn note_token(&mut self, id: SeqId) {
        self.first_token_at.entry(id).or_insert(self.now);
        let output = self
            .decode
            .sched
            .sequence_tokens(id)
            .unwrap()
            .output
            .to_vec();
        if output.len() >= self.max_tokens[&id] {
            assert!(self.decode.sched.finish(id));
            self.done.insert(id, output);
        }
    }

    /// Falls back every transfer past its deadline, as the decode worker does.
    fn expire_transfers(&mut self) {
        let mut expired: Vec<SeqId> = self
            .deadlines
            .iter()
            .filter(|&(_, &at)| at <= self.now)
            .map(|(&id, _)| id)
            .collect();
        expired.sort_unstable();
        for id in expired {
            self.deadlines.remove(&id);
            assert!(self.decode.sched.fail_remote_prefill(id));
            self.fell_back.push(id);
        }
    }

    fn run(&mut self, max_iterations: usize) {
        for _ in 0..max_iterations {
            if !self.decode.sched.has_work() && !self.prefill.sched.has_work() {
                return;
            }
            self.expire_transfers();
            // Arrived transfers.
            let (ready, later): (Vec<_>, Vec<_>) = self
                .arriving
                .drain(..)
                .partition(|(at, _, _)| *at <= self.now);
            self.arriving = later;
            for (_, id, token) in ready {
                self.deadlines.remove(&id);
                let outcome = self
                    .decode
                    .sched
                    .complete_remote_prefill(id, token)
                    .unwrap();
                assert!(outcome.context_full.is_empty());
                self.note_token(id);
            }
            if self.decode.free_at <= self.now {
                let (sampled, remote) = self.decode.step(self.now);
                for (id, cached) in remote {
                    self.deadlines.insert(id, self.now + TIMEOUT);
                    if self.lost.contains(&id) {
                        continue;
                    }
                    let prompt = self.decode.sched.sequence_tokens(id).unwrap().prompt;
                    assert!(cached % 4 == 0 && cached < prompt.len());
                    self.prefill
                        .sched
                        .add_sequence(id, prompt.to_vec())
                        .unwrap();
                }
                for (id, _) in sampled {
                    self.note_token(id);
                }
            }
            if self.prefill.free_at <= self.now && self.prefill.sched.has_work() {
                let (sampled, _) = self.prefill.step(self.now);
                for (id, token) in sampled {
                    // Prefill-only: the first token ends the prefill node's sequence.
                    assert!(self.prefill.sched.finish(id));
                    let at = self.prefill.free_at + TRANSFER_DELAY;
                    self.arriving.push((at, id, token));
                }
            }
            // Advance to the next event.
            let mut next = vec![self.decode.free_at, self.prefill.free_at];
            next.extend(self.arriving.iter().map(|a| a.0));
            next.extend(self.deadlines.values().copied());
            let next = next.into_iter().filter(|&t| t > self.now).min();
            self.now = next.unwrap_or(self.now + Duration::from_millis(1));
        }
        panic!("no progress");
    }
}

#[test]
fn remote_local_and_lost_prefills_all_produce_the_greedy_output() {
    let mut mesh = Mesh::new();
    let cases: Vec<(SeqId, usize, usize, bool)> = vec![
        (1, 120, 6, true),
        (2, 5, 8, false),
        (3, 64, 4, true),
        (4, 200, 3, true),
        (5, 9, 5, false),
        (6, 33, 7, true),
    ];
    for &(id, len, max, remote) in &cases {
        mesh.add(id, prompt(id as u32, len), max, remote);
    }
    mesh.lost.push(6);
    mesh.run(10_000);

    for &(id, len, max, _) in &cases {
        assert_eq!(
            mesh.done[&id],
            expected_output(&prompt(id as u32, len), max),
            "seq {id}"
        );
    }
    // The lost transfer fell back after its timeout and recomputed locally.
    assert_eq!(mesh.fell_back, vec![6]);
    assert!(mesh.first_token_at[&6] >= TIMEOUT);
    // A remote prompt's first token arrives after the prefill node's compute and the
    // transfer, without the decode node computing the prompt.
    assert!(mesh.first_token_at[&1] > TRANSFER_DELAY);
    assert_eq!(mesh.decode.sched.pool().num_used(), 0);
    assert_eq!(mesh.prefill.sched.pool().num_used(), 0);
}

#[test]
fn the_decode_node_does_not_compute_remote_prompts() {
    let mut mesh = Mesh::new();
    mesh.add(1, prompt(1, 400), 2, true);
    mesh.run(10_000);
    // 400 prompt tokens at 100us each on the prefill node; the decode node only decoded.
    assert!(mesh.prefill.runner.total_time() >= Duration::from_millis(40));
    assert!(mesh.decode.runner.total_time() < Duration::from_millis(20));
    assert_eq!(mesh.done[&1], expected_output(&prompt(1, 400), 2));
}
