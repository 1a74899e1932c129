//! The receive ring's accounting, as each side of a link keeps it. No verbs here.
//!
//! The sender writes each message into the receiver's ring at the ring's head, or at its
//! start when it would run past the end (a message never wraps); the bytes skipped at the
//! end count with the message. Both sides apply the same rule to the same message lengths,
//! so they agree on every offset without sending one. Positions are counted from the start
//! of the link and only grow; the receiver hands space back (a credit) as positions, in the
//! order the messages landed.

/// Where a message goes: its offset in the ring, and how far the head moves (its length
/// plus any bytes skipped at the end).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Placement {
    pub offset: u64,
    pub advance: u64,
}

/// Where the next message of `len` bytes goes in a ring of `ring` bytes whose head is at
/// position `head`.
pub(crate) fn place(head: u64, len: u64, ring: u64) -> Placement {
    let at = head % ring;
    if at + len <= ring {
        Placement {
            offset: at,
            advance: len,
        }
    } else {
        Placement {
            offset: 0,
            advance: ring - at + len,
        }
    }
}

/// Whether a message placed at `p` from `head` leaves every byte not yet handed back
/// (positions `freed..head`) alone. An empty ring takes any message that fits it, wherever
/// its head is (else a message longer than the head's offset could never be placed).
fn fits(head: u64, freed: u64, p: Placement, ring: u64) -> bool {
    head == freed || head + p.advance <= freed + ring
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RingError {
    #[error("a {len}-byte message cannot fit a {ring}-byte ring")]
    TooLarge { len: u64, ring: u64 },
    #[error("a {len}-byte message landed over bytes not yet handed back")]
    Overrun { len: u64 },
    #[error("the peer handed back {bytes} bytes; only {outstanding} were outstanding")]
    Overcredit { bytes: u64, outstanding: u64 },
}

/// The sender's view of the peer's ring.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SendRing {
    len: u64,
    head: u64,
    /// Position up to which the receiver has handed the space back.
    freed: u64,
}

impl SendRing {
    pub fn new(len: u64) -> Self {
        SendRing {
            len,
            head: 0,
            freed: 0,
        }
    }

    /// Bytes written (or skipped) and not yet handed back.
    pub fn outstanding(&self) -> u64 {
        self.head - self.freed
    }

    /// Where a message of `len` bytes would go now; `Ok(None)` while the ring is too full.
    pub fn try_place(&self, len: u64) -> Result<Option<Placement>, RingError> {
        if len == 0 || len > self.len {
            return Err(RingError::TooLarge {
                len,
                ring: self.len,
            });
        }
        let p = place(self.head, len, self.len);
        Ok(fits(self.head, self.freed, p, self.len).then_some(p))
    }

    /// The message placed at `p` (from `try_place`, nothing in between) is being written.
    pub fn commit(&mut self, p: Placement) {
        self.head += p.advance;
    }

    /// The receiver handed `bytes` back.
    pub fn credit(&mut self, bytes: u64) -> Result<(), RingError> {
        let outstanding = self.outstanding();
        if bytes > outstanding {
            return Err(RingError::Overcredit { bytes, outstanding });
        }
        self.freed += bytes;
        Ok(())
    }
}

/// The receiver's ring: where each message landed and how much it has consumed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RecvRing {
    len: u64,
    head: u64,
    /// Position up to which landed messages have been consumed (their chunks queued or
    /// dropped), whether or not the credit for them has gone out yet.
    consumed: u64,
}

impl RecvRing {
    pub fn new(len: u64) -> Self {
        RecvRing {
            len,
            head: 0,
            consumed: 0,
        }
    }

    /// Bytes landed and not yet consumed.
    pub fn outstanding(&self) -> u64 {
        self.head - self.consumed
    }

    /// A message of `len` bytes landed: where it is. A peer that writes over bytes not yet
    /// consumed (or past the ring) breaks the protocol.
    pub fn land(&mut self, len: u64) -> Result<Placement, RingError> {
        if len == 0 || len > self.len {
            return Err(RingError::TooLarge {
                len,
                ring: self.len,
            });
        }
        let p = place(self.head, len, self.len);
        if !fits(self.head, self.consumed, p, self.len) {
            return Err(RingError::Overrun { len });
        }
        self.head += p.advance;
        Ok(p)
    }

    /// The message that moved the head by `advance` was consumed.
    pub fn consume(&mut self, advance: u64) {
        debug_assert!(advance <= self.outstanding());
        self.consumed = (self.consumed + advance).min(self.head);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn messages_never_wrap_the_ring() {
        let p = |offset, advance| Placement { offset, advance };
        assert_eq!(place(0, 10, 100), p(0, 10));
        assert_eq!(place(90, 10, 100), p(90, 10));
        assert_eq!(place(95, 10, 100), p(0, 15));
        assert_eq!(place(205, 10, 100), p(5, 10));
    }

    #[test]
    fn an_empty_ring_takes_a_message_longer_than_the_head_offset() {
        // Before: the head at 5 and a 100-byte message needed 195 bytes free, forever.
        let mut s = SendRing::new(100);
        s.commit(s.try_place(5).unwrap().unwrap());
        s.credit(5).unwrap();
        let p = s.try_place(100).unwrap().expect("the ring is empty");
        assert_eq!(
            p,
            Placement {
                offset: 0,
                advance: 195
            }
        );
        s.commit(p);
        // Full now: nothing more until it is handed back.
        assert_eq!(s.try_place(1).unwrap(), None);
        s.credit(195).unwrap();
        assert!(s.try_place(100).unwrap().is_some());
    }

    #[test]
    fn credits_beyond_what_is_outstanding_are_refused() {
        let mut s = SendRing::new(100);
        s.commit(s.try_place(10).unwrap().unwrap());
        assert_eq!(
            s.credit(11),
            Err(RingError::Overcredit {
                bytes: 11,
                outstanding: 10
            })
        );
        s.credit(10).unwrap();
        assert_eq!(s.outstanding(), 0);
    }

    #[test]
    fn a_message_over_unconsumed_bytes_is_an_overrun() {
        let mut r = RecvRing::new(100);
        r.land(60).unwrap();
        assert_eq!(r.land(60), Err(RingError::Overrun { len: 60 }));
    }

    #[derive(Clone, Debug)]
    enum Op {
        Send(u64),
        /// The receiver consumes the oldest message it has not consumed.
        Consume,
        /// The oldest credit not yet delivered reaches the sender.
        Credit,
    }

    proptest! {
        /// A sender and a receiver driven by random sends, consumptions and credits agree
        /// on every offset, no message ever lands over bytes not yet consumed, and the
        /// sender only waits while the ring holds something.
        #[test]
        fn sender_and_receiver_agree_and_never_overlap(
            ring in 1u64..300,
            ops in proptest::collection::vec(prop_oneof![
                (1u64..300).prop_map(Op::Send),
                Just(Op::Consume),
                Just(Op::Credit),
            ], 1..200),
        ) {
            let mut s = SendRing::new(ring);
            let mut r = RecvRing::new(ring);
            // Live messages in the ring as (offset, len), and each one's advance.
            let mut live: std::collections::VecDeque<(u64, u64, u64)> = Default::default();
            let mut credits: std::collections::VecDeque<u64> = Default::default();
            for op in ops {
                match op {
                    Op::Send(len) => match s.try_place(len) {
                        Err(RingError::TooLarge { .. }) => prop_assert!(len > ring),
                        Err(e) => prop_assert!(false, "{e}"),
                        Ok(None) => prop_assert!(s.outstanding() > 0, "waits on an empty ring"),
                        Ok(Some(p)) => {
                            s.commit(p);
                            let landed = r.land(len);
                            prop_assert_eq!(landed.clone(), Ok(p));
                            prop_assert!(p.offset + len <= ring);
                            for &(o, l, _) in &live {
                                prop_assert!(p.offset + len <= o || o + l <= p.offset,
                                    "[{}, {}) overlaps live [{o}, {})", p.offset, p.offset + len, o + l);
                            }
                            live.push_back((p.offset, len, p.advance));
                        }
                    },
                    Op::Consume => {
                        if let Some((_, _, advance)) = live.pop_front() {
                            r.consume(advance);
                            credits.push_back(advance);
                        }
                    }
                    Op::Credit => {
                        if let Some(bytes) = credits.pop_front() {
                            prop_assert_eq!(s.credit(bytes), Ok(()));
                        }
                    }
                }
                prop_assert!(r.outstanding() <= s.outstanding());
            }
        }
    }
}
