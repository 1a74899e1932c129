//! Quiet decode steps: steps in which every running sequence decodes one token and nothing
//! else changes (no admission, no block allocated or filled, no sequence reaching the context
//! limit). A driver that only prices steps (a simulator) can run many of them in one call
//! instead of one `schedule` and `update_from_output` round each, with the same result.

use super::Scheduler;
use crate::runner::SeqId;
use kvmesh_common::TokenId;

impl Scheduler {
    /// How many steps from now are quiet: each running sequence decodes one token, none waits
    /// to be admitted, no step allocates or fills a KV block (so the pool, its prefix cache
    /// and its events stay as they are) and no sequence fills the context. 0 while a step is
    /// in flight or when the next step is not quiet. Finishing on a stop condition is the
    /// driver's: it runs no further than its sequences' next stop.
    pub fn quiet_decode_steps(&self) -> usize {
        let busy = self.in_flight.is_some() || !self.waiting.is_empty();
        if busy
            || self.running.is_empty()
            || self.running.len() > self.config.max_num_batched_tokens
        {
            return 0;
        }
        let bs = self.config.block_size;
        let max_len = self.max_seq_len();
        let mut quiet = usize::MAX;
        for id in &self.running {
            let seq = &self.seqs[id];
            if seq.num_uncomputed() != 1 {
                return 0;
            }
            // The next step computes position `c`: a new block once `c` reaches the blocks
            // held, a full block to register once `c + 1` is a multiple of the block size,
            // the context full once the appended token makes `c + 2` tokens.
            let c = seq.num_computed;
            let room = (seq.blocks.len() * bs).saturating_sub(c);
            let to_fill = bs - 1 - c % bs;
            let to_context = max_len.saturating_sub(c + 2);
            quiet = quiet.min(room).min(to_fill).min(to_context);
        }
        quiet
    }

    /// Runs `steps` quiet steps at once, as `steps` rounds of `schedule` and
    /// `update_from_output` would: every running sequence gets `steps` tokens, each chosen by
    /// `sample` from the sequence's last token and its length before it (a simulated model's
    /// token follows from those alone). Sequences are independent, so each draws its tokens in
    /// turn, the last kept at hand rather than read back.
    ///
    /// # Panics
    /// If fewer than `steps` steps are quiet ([`Scheduler::quiet_decode_steps`]).
    pub fn advance_decode(
        &mut self,
        steps: usize,
        mut sample: impl FnMut(SeqId, TokenId, usize) -> TokenId,
    ) {
        if steps == 0 {
            return;
        }
        assert!(
            steps <= self.quiet_decode_steps(),
            "advance_decode({steps}) past the quiet steps"
        );
        let caching = self.config.enable_prefix_caching;
        for &id in &self.running {
            let seq = self.seqs.get_mut(&id).expect("running sequences exist");
            let mut last = *seq
                .output
                .last()
                .or(seq.prompt.last())
                .expect("prompts are never empty");
            let start = seq.len();
            seq.output.extend((start..start + steps).map(|len| {
                last = sample(id, last, len);
                last
            }));
            seq.num_computed += steps;
            // Once for all its new tokens: the draws do not read the hashes.
            if caching {
                seq.extend_hashes(&self.config.hasher);
            }
        }
        self.next_step_id += steps as u64;
    }
}

#[cfg(test)]
mod tests {
    use crate::scheduler::{Scheduler, SchedulerConfig, SequenceTokens};
    use kvmesh_common::{BlockHasher, ModelFingerprint, TokenId};

    fn config() -> SchedulerConfig {
        SchedulerConfig {
            block_size: 4,
            num_blocks: 32,
            max_num_batched_tokens: 64,
            max_num_seqs: 8,
            max_model_len: 40,
            enable_prefix_caching: true,
            host_tier_blocks: 0,
            disk_tier_blocks: 0,
            hasher: BlockHasher::new(ModelFingerprint(1), 4),
        }
    }

    /// A token that depends on the sequence so far, as a model's would.
    fn next(t: SequenceTokens<'_>) -> TokenId {
        let last = t.output.last().or(t.prompt.last()).copied().unwrap_or(0);
        next_after(last, t.prompt.len() + t.output.len())
    }

    fn next_after(last: TokenId, len: usize) -> TokenId {
        (last * 7 + len as TokenId) % 1000
    }

    /// One step planned and absorbed, every sequence sampled with `next`.
    fn step(s: &mut Scheduler) {
        let out = s.schedule();
        let sampled: Vec<_> = out
            .step
            .chunks
            .iter()
            .filter(|c| c.want_logits)
            .map(|c| (c.seq_id, next(s.sequence_tokens(c.seq_id).unwrap())))
            .collect();
        let outcome = s.update_from_output(out, &sampled).unwrap();
        assert!(outcome.context_full.is_empty());
    }

    /// Two sequences prefilled, then decoding.
    fn decoding() -> Scheduler {
        let mut s = Scheduler::new(config());
        s.set_record_kv_events(true);
        s.add_sequence(1, (1..=6).collect::<Vec<_>>()).unwrap();
        s.add_sequence(2, (1..=9).collect::<Vec<_>>()).unwrap();
        step(&mut s);
        s
    }

    #[test]
    fn quiet_steps_stop_before_a_block_is_allocated_or_filled() {
        let mut s = decoding();
        // Seq 1: 7 tokens, 6 computed, 2 blocks: position 6 is quiet, 7 fills block 1.
        // Seq 2: 10 tokens, 9 computed, 3 blocks: positions 9 and 10 are quiet.
        assert_eq!(s.quiet_decode_steps(), 1);
        step(&mut s);
        assert_eq!(s.quiet_decode_steps(), 0, "seq 1 fills its block next");
        step(&mut s);
        assert_eq!(s.quiet_decode_steps(), 0, "seq 1 needs a new block next");
        step(&mut s);
        // Seq 1: 8 computed of 3 blocks; seq 2: 12 computed of 3 blocks, so none to spare.
        assert_eq!(s.quiet_decode_steps(), 0);
    }

    #[test]
    fn nothing_is_quiet_while_a_sequence_waits() {
        let mut s = decoding();
        assert_eq!(s.quiet_decode_steps(), 1);
        s.add_sequence(3, vec![1, 2]).unwrap();
        assert_eq!(s.quiet_decode_steps(), 0, "the next step admits it");
    }

    #[test]
    fn advancing_matches_stepping_one_by_one() {
        let (mut stepped, mut advanced) = (decoding(), decoding());
        let mut advanced_steps = 0;
        for _ in 0..3 {
            // Step both past the block boundaries, then run the quiet steps at once.
            while advanced.quiet_decode_steps() == 0 {
                step(&mut stepped);
                step(&mut advanced);
            }
            assert_eq!(stepped.drain_kv_events(), advanced.drain_kv_events());
            let quiet = advanced.quiet_decode_steps();
            for _ in 0..quiet {
                step(&mut stepped);
            }
            advanced.advance_decode(quiet, |_, last, len| next_after(last, len));
            advanced_steps += quiet;
            assert!(
                stepped.drain_kv_events().is_empty(),
                "quiet steps publish nothing"
            );
            for id in [1, 2] {
                let (a, b) = (stepped.sequence_tokens(id), advanced.sequence_tokens(id));
                assert_eq!(a.unwrap().output, b.unwrap().output);
            }
            assert_eq!(stepped.pool().num_used(), advanced.pool().num_used());
        }
        // What comes after is the same step, with the same events.
        let (a, b) = (stepped.schedule(), advanced.schedule());
        assert_eq!(a.step, b.step);
        assert_eq!(stepped.drain_kv_events(), advanced.drain_kv_events());
        assert!(
            advanced_steps >= 3,
            "{advanced_steps} steps advanced at once"
        );
    }

    #[test]
    #[should_panic(expected = "past the quiet steps")]
    fn advancing_past_a_boundary_is_refused() {
        let mut s = decoding();
        s.advance_decode(2, |_, last, len| next_after(last, len));
    }
}
