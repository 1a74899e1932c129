//! Virtual time: `Instant::now()` once as the base, then only offsets from it.

use super::*;
use kvmesh_common::{BlockId, RequestId};
use kvmesh_engine::runner::KvShape;
use kvmesh_engine::sampler::Sampled;
use kvmesh_transfer::BlockShape;

const TIMEOUT: Duration = Duration::from_secs(5);
const MS: Duration = Duration::from_millis(1);
const SEQ: SeqId = 7;
const REQUEST: RequestId = RequestId(70);
/// The blocks reserved for the transfer.
const BLOCKS: [u32; 2] = [4, 9];

fn shape() -> KvShape {
    KvShape {
        num_layers: 2,
        num_kv_heads: 1,
        head_dim: 2,
        block_size: 2,
        num_blocks: 16,
    }
}

/// Layer `layer` of `blocks`, sealed as a prefill worker sends it.
fn chunk(layer: usize, blocks: &[u32]) -> KvChunk {
    let blocks: Vec<BlockId> = blocks.iter().map(|&b| BlockId(b)).collect();
    let s = shape();
    let block_shape = BlockShape {
        num_kv_heads: s.num_kv_heads as u32,
        block_size: s.block_size as u32,
        head_dim: s.head_dim as u32,
    };
    // K and V, f16: 2 * 2 bytes per head dimension, per position, per head.
    let len = blocks.len() * 2 * 2 * s.num_kv_heads * s.block_size * s.head_dim;
    KvChunk::seal(REQUEST, layer..layer + 1, blocks, block_shape, vec![3; len]).unwrap()
}

/// Every layer of every reserved block, one chunk each.
fn all_chunks() -> Vec<KvChunk> {
    (0..shape().num_layers)
        .flat_map(|layer| BLOCKS.iter().map(move |&b| chunk(layer, &[b])))
        .collect()
}

fn done(token: u32) -> PrefillDone {
    PrefillDone {
        first: Sampled {
            token,
            logprob: Some(-0.5),
            top_logprobs: Vec::new(),
        },
        cached_tokens: 2,
        chunks_sent: 4,
        bytes_sent: 64,
    }
}

/// A tracker with one transfer started at `t0`; returns the prefill worker's cancel token.
fn started(t0: Instant) -> (RemotePrefills, CancelToken) {
    let mut r = RemotePrefills::new(TIMEOUT);
    let blocks: Vec<BlockId> = BLOCKS.iter().map(|&b| BlockId(b)).collect();
    let incoming = IncomingTransfer::new(REQUEST, &shape(), &blocks);
    let cancel = CancelToken::new();
    r.start(t0, SEQ, incoming, cancel.clone());
    (r, cancel)
}

/// Delivers `chunk` at `now` as the driver does: checked, written, reported.
fn deliver(r: &mut RemotePrefills, now: Instant, chunk: &KvChunk) -> Option<Completion> {
    match r.on_chunk(SEQ, chunk) {
        ChunkVerdict::Write => r.written(now, SEQ, chunk),
        other => panic!("expected the chunk to be written, got {other:?}"),
    }
}

#[test]
fn chunks_arriving_out_of_order_complete_the_transfer_once_all_are_in() {
    let t0 = Instant::now();
    let (mut r, cancel) = started(t0);
    assert!(r.on_reply(t0 + MS, SEQ, Ok(done(42))).is_none());
    // Layer 1 before layer 0, the last block before the first.
    let mut chunks = all_chunks();
    chunks.reverse();
    let last = chunks.pop().unwrap();
    for (i, c) in chunks.iter().enumerate() {
        assert!(deliver(&mut r, t0 + MS * (2 + i as u32), c).is_none());
    }
    let c = deliver(&mut r, t0 + MS * 10, &last).expect("the last piece completes it");
    assert_eq!((c.seq_id, c.done.first.token), (SEQ, 42));
    assert_eq!(c.elapsed, MS * 10);
    assert!(
        !cancel.is_cancelled(),
        "a completed transfer is not cancelled"
    );
    assert_eq!(r.next_deadline(), None);
}

#[test]
fn a_reply_before_the_last_chunk_completes_only_when_it_arrives() {
    let t0 = Instant::now();
    let (mut r, _) = started(t0);
    let mut chunks = all_chunks();
    let last = chunks.pop().unwrap();
    for c in &chunks {
        assert!(deliver(&mut r, t0 + MS, c).is_none());
    }
    assert!(
        r.on_reply(t0 + MS * 2, SEQ, Ok(done(5))).is_none(),
        "a chunk is still missing"
    );
    // A chunk sent twice does not stand in for the missing one.
    assert!(deliver(&mut r, t0 + MS * 3, &chunks[0]).is_none());
    let c = deliver(&mut r, t0 + MS * 4, &last).expect("complete now");
    assert_eq!(c.done.first.token, 5);
}

#[test]
fn all_chunks_wait_for_the_reply() {
    let t0 = Instant::now();
    let (mut r, _) = started(t0);
    for c in &all_chunks() {
        assert!(deliver(&mut r, t0 + MS, c).is_none(), "no reply yet");
    }
    match r.on_reply(t0 + MS * 2, SEQ, Ok(done(8))) {
        Some(Action::Complete(c)) => assert_eq!((c.seq_id, c.done.first.token), (SEQ, 8)),
        other => panic!("expected a completion, got {other:?}"),
    }
}

#[test]
fn a_late_chunk_after_a_fallback_is_ignored_and_nothing_completes() {
    let t0 = Instant::now();
    let (mut r, cancel) = started(t0);
    let chunks = all_chunks();
    assert!(deliver(&mut r, t0 + MS, &chunks[0]).is_none());
    let fell = r.on_tick(t0 + MS + TIMEOUT);
    assert_eq!(fell.len(), 1);
    assert_eq!(fell[0].seq_id, SEQ);
    assert!(matches!(fell[0].reason, FallBackReason::TimedOut));
    fell[0].cancel.cancel();
    assert!(
        cancel.is_cancelled(),
        "the fallback hands back the worker's token"
    );
    // The rest of the KV and the reply straggle in: all of it is late.
    for c in &chunks[1..] {
        assert!(matches!(r.on_chunk(SEQ, c), ChunkVerdict::Late));
        assert!(r.written(t0 + TIMEOUT * 2, SEQ, c).is_none());
    }
    assert!(r.on_reply(t0 + TIMEOUT * 2, SEQ, Ok(done(1))).is_none());
    assert!(r.on_tick(t0 + TIMEOUT * 10).is_empty(), "it fell back once");
    assert_eq!(r.next_deadline(), None);
}

#[test]
fn a_transfer_that_stalls_falls_back_at_its_deadline() {
    let t0 = Instant::now();
    let (mut r, _) = started(t0);
    assert_eq!(r.next_deadline(), Some(t0 + TIMEOUT));
    assert!(r.on_tick(t0).is_empty());
    assert!(r.on_tick(t0 + TIMEOUT - MS).is_empty());
    let fell = r.on_tick(t0 + TIMEOUT);
    assert_eq!(fell.iter().map(|f| f.seq_id).collect::<Vec<_>>(), vec![SEQ]);
    assert_eq!(r.next_deadline(), None);
}

#[test]
fn a_transfer_that_keeps_progressing_outlives_its_first_deadline() {
    let t0 = Instant::now();
    let (mut r, _) = started(t0);
    let mut chunks = all_chunks();
    let last = chunks.pop().unwrap();
    // A chunk just before each deadline: more than two timeouts pass in all.
    let mut now = t0;
    for (i, c) in chunks.iter().enumerate() {
        now = t0 + (TIMEOUT - MS) * (i as u32 + 1);
        assert!(r.on_tick(now).is_empty());
        assert!(deliver(&mut r, now, c).is_none());
        assert_eq!(r.next_deadline(), Some(now + TIMEOUT));
    }
    assert!(now > t0 + TIMEOUT * 2);
    assert!(r.on_tick(now + TIMEOUT - MS).is_empty());
    assert!(r.on_reply(now + TIMEOUT - MS, SEQ, Ok(done(3))).is_none());
    // The reply is no progress: silence for a whole timeout after the last chunk ends it.
    let fell = r.on_tick(now + TIMEOUT);
    assert_eq!(fell.len(), 1);
    assert!(matches!(r.on_chunk(SEQ, &last), ChunkVerdict::Late));
}

#[test]
fn a_prefill_error_falls_back_and_cancels() {
    let t0 = Instant::now();
    let (mut r, cancel) = started(t0);
    assert!(deliver(&mut r, t0 + MS, &all_chunks()[0]).is_none());
    match r.on_reply(t0 + MS * 2, SEQ, Err(PrefillError::Unavailable)) {
        Some(Action::FallBack(f)) => {
            assert_eq!(f.seq_id, SEQ);
            assert!(matches!(
                f.reason,
                FallBackReason::Failed(PrefillError::Unavailable)
            ));
            f.cancel.cancel();
            assert!(cancel.is_cancelled());
        }
        other => panic!("expected a fallback, got {other:?}"),
    }
    assert_eq!(r.next_deadline(), None);
    assert!(r.on_tick(t0 + TIMEOUT * 2).is_empty());
}

#[test]
fn a_corrupt_or_foreign_chunk_falls_back_before_anything_is_written() {
    let t0 = Instant::now();
    let (mut r, _) = started(t0);
    let mut corrupt = all_chunks().remove(0);
    corrupt.payload[0] ^= 1;
    match r.on_chunk(SEQ, &corrupt) {
        ChunkVerdict::FallBack(f) => {
            assert_eq!(f.seq_id, SEQ);
            assert!(matches!(
                f.reason,
                FallBackReason::Refused(IncomingError::Corrupt(_))
            ));
        }
        other => panic!("expected a fallback, got {other:?}"),
    }
    assert!(matches!(
        r.on_chunk(SEQ, &all_chunks()[1]),
        ChunkVerdict::Late
    ));

    let (mut r, _) = started(t0);
    let unreserved = chunk(0, &[5]);
    assert!(matches!(
        r.on_chunk(SEQ, &unreserved),
        ChunkVerdict::FallBack(FallBack {
            reason: FallBackReason::Refused(IncomingError::UnexpectedBlock(BlockId(5))),
            ..
        })
    ));
}

#[test]
fn a_chunk_that_cannot_be_written_falls_back_once() {
    let t0 = Instant::now();
    let (mut r, cancel) = started(t0);
    let c = &all_chunks()[0];
    assert!(matches!(r.on_chunk(SEQ, c), ChunkVerdict::Write));
    let f = r
        .not_written(SEQ, "no such block".into())
        .expect("in flight");
    assert!(matches!(f.reason, FallBackReason::NotWritten(ref e) if e == "no such block"));
    f.cancel.cancel();
    assert!(cancel.is_cancelled());
    assert!(r.not_written(SEQ, "again".into()).is_none());
    assert!(r.written(t0 + MS, SEQ, c).is_none());
    assert_eq!(r.next_deadline(), None);
}

#[test]
fn a_removed_transfer_hands_back_its_cancel_token_and_ignores_the_rest() {
    let t0 = Instant::now();
    let (mut r, cancel) = started(t0);
    r.remove(SEQ).expect("in flight").cancel();
    assert!(cancel.is_cancelled());
    assert!(r.remove(SEQ).is_none());
    assert!(matches!(
        r.on_chunk(SEQ, &all_chunks()[0]),
        ChunkVerdict::Late
    ));
    assert!(r.on_reply(t0 + MS, SEQ, Ok(done(1))).is_none());
    assert!(r.on_tick(t0 + TIMEOUT).is_empty());
}

#[test]
fn the_next_deadline_is_the_earliest_of_all_transfers() {
    let t0 = Instant::now();
    let mut r = RemotePrefills::new(TIMEOUT);
    let blocks = [BlockId(1)];
    for (seq, at) in [(1, MS * 30), (2, MS * 10), (3, MS * 20)] {
        let incoming = IncomingTransfer::new(RequestId(seq), &shape(), &blocks);
        r.start(t0 + at, seq, incoming, CancelToken::new());
    }
    assert_eq!(r.next_deadline(), Some(t0 + MS * 10 + TIMEOUT));
    let fell: Vec<SeqId> = r
        .on_tick(t0 + MS * 20 + TIMEOUT)
        .iter()
        .map(|f| f.seq_id)
        .collect();
    assert_eq!(fell, vec![2, 3]);
    assert_eq!(r.next_deadline(), Some(t0 + MS * 30 + TIMEOUT));
}
