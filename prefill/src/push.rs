//! Which blocks of a prompt to push after each step: the bookkeeping of one outgoing
//! transfer, without I/O.

use kvmesh_common::BlockId;
use kvmesh_engine::runner::SeqChunk;
use std::ops::Range;

/// Tracks how far one prompt's KV has been pushed. A block is pushed once, as soon as it is
/// full (or, for the prompt's last block, as soon as the prompt is computed); blocks the
/// prefill worker served from its own prefix cache go out with the first step. Blocks the
/// destination has cached are never sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvPush {
    block_size: usize,
    prompt_len: usize,
    /// Index (in the prompt) of the first block to send: the destination has those before.
    first_block: usize,
    /// Destination blocks for prompt blocks `first_block..`.
    dest: Vec<BlockId>,
    /// Prompt blocks before this index are sent.
    sent: usize,
}

impl KvPush {
    /// Checks that `dest` holds exactly the blocks after `cached_prefix_len` (a whole number of
    /// blocks, less than the prompt).
    pub fn new(
        block_size: usize,
        prompt_len: usize,
        cached_prefix_len: usize,
        dest: Vec<BlockId>,
    ) -> Result<Self, String> {
        if block_size == 0 || !cached_prefix_len.is_multiple_of(block_size) {
            return Err(format!(
                "cached_prefix_len {cached_prefix_len} is not a whole number of {block_size}-token blocks"
            ));
        }
        if cached_prefix_len >= prompt_len {
            return Err(format!(
                "cached_prefix_len {cached_prefix_len} leaves nothing of the {prompt_len}-token prompt to send"
            ));
        }
        let first_block = cached_prefix_len / block_size;
        let needed = prompt_len.div_ceil(block_size) - first_block;
        if dest.len() != needed {
            return Err(format!(
                "{} destination blocks for the {needed} blocks after the cached prefix",
                dest.len()
            ));
        }
        Ok(KvPush {
            block_size,
            prompt_len,
            first_block,
            dest,
            sent: first_block,
        })
    }

    /// Prompt blocks whose KV exists once `chunk` is computed and that are not sent yet.
    pub fn pending(&self, chunk: &SeqChunk) -> Range<usize> {
        let end = chunk.start_pos + chunk.tokens.len();
        let upto = if end >= self.prompt_len {
            self.prompt_len.div_ceil(self.block_size)
        } else {
            end / self.block_size
        };
        self.sent..upto.max(self.sent)
    }

    /// Source blocks (from the chunk's block table) and destination blocks of `blocks`.
    pub fn addresses(
        &self,
        chunk: &SeqChunk,
        blocks: Range<usize>,
    ) -> (Vec<BlockId>, Vec<BlockId>) {
        let src = chunk.block_table[blocks.clone()].to_vec();
        let dst =
            self.dest[blocks.start - self.first_block..blocks.end - self.first_block].to_vec();
        (src, dst)
    }

    /// Records `blocks` as sent (in every layer).
    pub fn mark_sent(&mut self, blocks: Range<usize>) {
        self.sent = self.sent.max(blocks.end);
    }

    /// Whether every block after the destination's cached prefix is sent.
    pub fn is_done(&self) -> bool {
        self.sent == self.prompt_len.div_ceil(self.block_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(start_pos: usize, len: usize, table: u32) -> SeqChunk {
        SeqChunk {
            seq_id: 1,
            tokens: vec![0; len].into(),
            start_pos,
            block_table: (100..100 + table).map(BlockId).collect(),
            want_logits: false,
        }
    }

    #[test]
    fn blocks_go_out_as_they_fill_and_the_tail_at_the_end() {
        // 10 tokens in blocks of 4: blocks 0, 1 full, block 2 partial. Destination has block 0.
        let mut p = KvPush::new(4, 10, 4, vec![BlockId(7), BlockId(8)]).unwrap();
        let c = chunk(0, 6, 2); // positions 0..6: block 0 full (cached there), block 1 partial
        assert_eq!(p.pending(&c), 1..1);
        let c = chunk(6, 4, 3); // the rest: blocks 1 and 2
        let r = p.pending(&c);
        assert_eq!(r, 1..3);
        assert_eq!(
            p.addresses(&c, r.clone()),
            (
                vec![BlockId(101), BlockId(102)],
                vec![BlockId(7), BlockId(8)]
            )
        );
        p.mark_sent(r);
        assert!(p.is_done());
    }

    #[test]
    fn locally_cached_blocks_go_out_with_the_first_step() {
        // The prefill worker had 8 tokens cached, so its first chunk starts at 8; the
        // destination has nothing, so blocks 0 and 1 must be sent too.
        let p = KvPush::new(4, 9, 0, vec![BlockId(1), BlockId(2), BlockId(3)]).unwrap();
        assert_eq!(p.pending(&chunk(8, 1, 3)), 0..3);
    }

    #[test]
    fn inconsistent_destinations_are_rejected() {
        assert!(KvPush::new(4, 10, 3, vec![BlockId(0); 3]).is_err());
        assert!(KvPush::new(4, 8, 8, vec![]).is_err());
        assert!(KvPush::new(4, 10, 4, vec![BlockId(0); 3]).is_err());
    }
}
