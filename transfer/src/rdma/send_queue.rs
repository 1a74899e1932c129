//! What one queue pair has posted on its send queue: the KV write and the credits (ring
//! space handed back to the peer), never more than the queue's depth. No verbs here.
//!
//! Each credit is a zero-length SEND_WITH_IMM carrying the bytes freed, and each consumes
//! one of the peer's posted receives. Before, every consumed message posted its own credit
//! at once: a burst of small messages could post more than the send queue holds, the post
//! failed, and the space it carried was lost to the sender for good. Here the bytes owed
//! accumulate and go out in as few credits as the queue has room for: one slot is kept for
//! the write (there is one staging buffer, so at most one write), the others carry credits,
//! and a credit that cannot go now goes with the next one.

/// A link's send queue. `depth` is the queue pair's `max_send_wr`, at least 2.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SendQueue {
    depth: u32,
    write: bool,
    credits: u32,
    /// Bytes consumed and not yet sent back.
    owed: u64,
}

impl SendQueue {
    pub fn new(depth: u32) -> Self {
        assert!(
            depth >= 2,
            "a send queue needs room for a write and a credit"
        );
        SendQueue {
            depth,
            write: false,
            credits: 0,
            owed: 0,
        }
    }

    /// Work requests posted and not yet completed.
    pub fn outstanding(&self) -> u32 {
        u32::from(self.write) + self.credits
    }

    #[cfg(test)]
    pub fn depth(&self) -> u32 {
        self.depth
    }

    #[cfg(test)]
    pub fn write_in_flight(&self) -> bool {
        self.write
    }

    #[cfg(test)]
    pub fn credits_in_flight(&self) -> u32 {
        self.credits
    }

    #[cfg(test)]
    pub fn owed(&self) -> u64 {
        self.owed
    }

    /// Whether a write may be posted (the slot kept for it is free).
    pub fn can_write(&self) -> bool {
        !self.write
    }

    pub fn start_write(&mut self) {
        debug_assert!(self.can_write());
        self.write = true;
    }

    pub fn write_done(&mut self) {
        self.write = false;
    }

    /// `bytes` of the ring were consumed: they are owed to the peer.
    pub fn owe(&mut self, bytes: u64) {
        self.owed += bytes;
    }

    /// The next credit to post, if anything is owed and a slot is free: the bytes it
    /// carries (all that is owed, up to what an immediate holds). `keepalive` posts one
    /// even when nothing is owed (zero bytes), to find out whether the peer is still there.
    pub fn next_credit(&mut self, keepalive: bool) -> Option<u32> {
        if (self.owed == 0 && !keepalive) || self.credits + 1 >= self.depth {
            return None;
        }
        let bytes = self.owed.min(u64::from(u32::MAX));
        self.owed -= bytes;
        self.credits += 1;
        Some(bytes as u32)
    }

    pub fn credit_done(&mut self) {
        debug_assert!(self.credits > 0);
        self.credits = self.credits.saturating_sub(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_burst_of_credits_coalesces_within_the_depth() {
        let mut q = SendQueue::new(3);
        for _ in 0..1000 {
            q.owe(7);
            // Nothing completes meanwhile: at most depth - 1 credits go out.
            let _ = q.next_credit(false);
        }
        assert_eq!(q.credits_in_flight(), 2);
        assert_eq!(q.owed(), 7000 - 2 * 7);
        q.credit_done();
        // Everything still owed goes out in one.
        assert_eq!(q.next_credit(false), Some(7000 - 14));
        assert_eq!(q.owed(), 0);
        assert!(q.can_write());
    }

    #[derive(Clone, Debug)]
    enum Op {
        Owe(u64),
        Post,
        Keepalive,
        CreditDone,
        Write,
        WriteDone,
    }

    proptest! {
        /// Whatever the order of consumption, posts and completions: the queue never holds
        /// more than its depth, a write always finds its slot once the last one completed,
        /// and every byte owed is sent back exactly once.
        #[test]
        fn credits_never_exceed_the_depth_and_none_are_lost(
            depth in 2u32..8,
            ops in proptest::collection::vec(prop_oneof![
                (0u64..1 << 33).prop_map(Op::Owe),
                Just(Op::Post),
                Just(Op::Keepalive),
                Just(Op::CreditDone),
                Just(Op::Write),
                Just(Op::WriteDone),
            ], 1..300),
        ) {
            let mut q = SendQueue::new(depth);
            let (mut owed, mut sent) = (0u128, 0u128);
            for op in ops {
                match op {
                    Op::Owe(b) => { q.owe(b); owed += u128::from(b); }
                    Op::Post => if let Some(b) = q.next_credit(false) { sent += u128::from(b); },
                    Op::Keepalive => if let Some(b) = q.next_credit(true) { sent += u128::from(b); },
                    Op::CreditDone => if q.credits_in_flight() > 0 { q.credit_done() },
                    Op::Write => {
                        prop_assert_eq!(q.can_write(), !q.write_in_flight());
                        if q.can_write() { q.start_write() }
                    }
                    Op::WriteDone => q.write_done(),
                }
                prop_assert!(q.outstanding() <= depth);
                prop_assert!(q.credits_in_flight() < depth);
                prop_assert_eq!(owed, sent + u128::from(q.owed()));
            }
            // Drain: every byte owed goes back.
            loop {
                while q.credits_in_flight() > 0 { q.credit_done() }
                match q.next_credit(false) {
                    Some(b) => sent += u128::from(b),
                    None => break,
                }
            }
            prop_assert_eq!(owed, sent);
        }
    }
}
