//! Decode nodes' runs of quiet steps in the mesh ([`crate::node`]): a run is caught up to the
//! event being handled before anything touches its node, each of its steps sorting where its
//! own event would have (its end, the end of the step before, the run's sequence number), and
//! its tokens reach their clients with their own times.

use super::{Event, Mesh};
use crate::events::EventKey;
use crate::node::RunTokens;
use std::time::Duration;

impl Mesh<'_> {
    /// Brings node `n` to now before anything touches it: the quiet steps of its run that
    /// would have ended before the event being handled are applied (their tokens delivered)
    /// and the next is put in flight, its event sorting as its own would have.
    pub(super) fn touch(&mut self, n: usize) {
        let Some((started, ends)) = self.nodes[n].run() else {
            return;
        };
        let now = self.queue.current();
        let seq = self.run_seq[n];
        let end = |i: usize| Duration::from_nanos(ends[i]);
        let key = |i: usize| EventKey {
            at: end(i),
            pushed: i.checked_sub(1).map_or(started, end),
            seq,
        };
        let applied = (0..ends.len()).take_while(|&i| key(i) < now).count();
        let (next, last) = (key(applied), key(ends.len() - 1));
        let tokens = self.nodes[n].catch_up(applied);
        self.deliver(&tokens);
        // The run's event stands for its last step; any other takes its place.
        if next != last {
            self.queue.cancel(last);
            self.step_event[n] += 1;
            self.queue
                .push_keyed(next, Event::StepDone(n, self.step_event[n]));
        }
    }

    /// Every node brought to now ([`Mesh::touch`]).
    pub(super) fn touch_all(&mut self) {
        for n in 0..self.nodes.len() {
            self.touch(n);
        }
    }

    /// The tokens of quiet steps reach their clients.
    pub(super) fn deliver(&mut self, tokens: &RunTokens) {
        for &seq in &tokens.seqs {
            let i = seq as usize;
            let Some(live) = self.live[i].as_mut() else {
                continue;
            };
            match self.scaler.as_mut() {
                None => live.tokens.extend_nanos(&tokens.end_nanos),
                Some(s) => {
                    for &t in &tokens.end_nanos {
                        let t = Duration::from_nanos(t);
                        s.token(live.tokens.last(), self.sent[i], t);
                        live.tokens.push(t);
                    }
                }
            }
        }
    }
}
