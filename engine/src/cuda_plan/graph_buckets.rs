//! Decode steps as CUDA graphs: a graph is captured once per batch-size bucket (powers of
//! two up to [`MAX_GRAPH_BATCH`]) over fixed device buffers, and replayed for every decode
//! step of a batch that rounds up to it. The step's real rows fill the buffers first; the
//! rest are padding rows that write their KV into a spare block no sequence owns and whose
//! logits are never read.

use crate::runner::SeqChunk;

/// The largest decode batch replayed as a graph; larger ones run eagerly.
pub const MAX_GRAPH_BATCH: usize = 256;

/// The bucket of a decode batch of `batch` rows: the next power of two, or `None` (run
/// eagerly) when empty or above `max`.
pub fn bucket_for(batch: usize, max: usize) -> Option<usize> {
    (batch > 0 && batch <= max).then(|| batch.next_power_of_two().min(max.next_power_of_two()))
}

/// Whether a step is a pure decode step a graph can replay: every chunk one token that asks
/// for logits.
pub fn is_decode_step(chunks: &[SeqChunk]) -> bool {
    !chunks.is_empty() && chunks.iter().all(|c| c.tokens.len() == 1 && c.want_logits)
}

/// The host side of a decode graph's fixed inputs for one step: `bucket` rows, each row's
/// block table padded to `table_width` entries at `row * table_width`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeInputs {
    pub tokens: Vec<i32>,
    pub positions: Vec<i32>,
    /// Cache slot of each row's KV (block * block_size + offset).
    pub slots: Vec<i32>,
    /// Offset of each row's block table in `tables`.
    pub row_table: Vec<i32>,
    pub tables: Vec<i32>,
}

impl DecodeInputs {
    /// The inputs of a decode step of `chunks` in a graph of `bucket` rows; padding rows
    /// attend to and write `spare_block` only. `None` when the chunks do not fit (more rows
    /// than the bucket, a block table wider than `table_width`).
    pub fn pad(
        chunks: &[SeqChunk],
        bucket: usize,
        table_width: usize,
        block_size: usize,
        spare_block: u32,
    ) -> Option<DecodeInputs> {
        if chunks.len() > bucket || !is_decode_step(chunks) {
            return None;
        }
        let spare = spare_block as i32;
        let mut inputs = DecodeInputs {
            tokens: vec![0; bucket],
            positions: vec![0; bucket],
            slots: vec![spare * block_size as i32; bucket],
            row_table: (0..bucket).map(|r| (r * table_width) as i32).collect(),
            tables: vec![spare; bucket * table_width],
        };
        for (r, c) in chunks.iter().enumerate() {
            if c.block_table.len() > table_width {
                return None;
            }
            let pos = c.start_pos;
            let block = c.block_table.get(pos / block_size)?;
            inputs.tokens[r] = c.tokens[0] as i32;
            inputs.positions[r] = pos as i32;
            inputs.slots[r] = (block.0 as usize * block_size + pos % block_size) as i32;
            let row = &mut inputs.tables[r * table_width..][..c.block_table.len()];
            for (t, b) in row.iter_mut().zip(c.block_table.iter()) {
                *t = b.0 as i32;
            }
        }
        Some(inputs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_common::BlockId;

    fn decode(seq: u64, token: u32, pos: usize, blocks: &[u32]) -> SeqChunk {
        SeqChunk {
            seq_id: seq,
            tokens: vec![token].into(),
            start_pos: pos,
            block_table: blocks.iter().map(|&b| BlockId(b)).collect(),
            want_logits: true,
        }
    }

    #[test]
    fn batches_round_up_to_a_power_of_two_within_the_largest() {
        assert_eq!(bucket_for(0, 256), None);
        assert_eq!(bucket_for(1, 256), Some(1));
        assert_eq!(bucket_for(3, 256), Some(4));
        assert_eq!(bucket_for(32, 256), Some(32));
        assert_eq!(bucket_for(33, 256), Some(64));
        assert_eq!(bucket_for(256, 256), Some(256));
        assert_eq!(bucket_for(257, 256), None);
        // A largest size that is not a power of two still bounds the buckets.
        assert_eq!(bucket_for(100, 100), Some(128));
        assert_eq!(bucket_for(101, 100), None);
    }

    #[test]
    fn only_one_token_chunks_that_ask_logits_are_decode_steps() {
        assert!(is_decode_step(&[decode(1, 5, 3, &[0])]));
        assert!(!is_decode_step(&[]));
        let mut prefill = decode(1, 5, 0, &[0]);
        prefill.tokens = vec![5, 6].into();
        assert!(!is_decode_step(&[decode(2, 1, 1, &[1]), prefill]));
        let mut silent = decode(1, 5, 3, &[0]);
        silent.want_logits = false;
        assert!(!is_decode_step(&[silent]));
    }

    #[test]
    fn real_rows_come_first_and_padding_rows_touch_only_the_spare_block() {
        // Block size 4: sequence 1 at position 5 (block 7, offset 1), sequence 2 at 0.
        let chunks = [decode(1, 11, 5, &[3, 7]), decode(2, 22, 0, &[9])];
        let inputs = DecodeInputs::pad(&chunks, 4, 3, 4, 99).unwrap();
        assert_eq!(inputs.tokens, [11, 22, 0, 0]);
        assert_eq!(inputs.positions, [5, 0, 0, 0]);
        assert_eq!(inputs.slots, [7 * 4 + 1, 9 * 4, 99 * 4, 99 * 4]);
        assert_eq!(inputs.row_table, [0, 3, 6, 9]);
        assert_eq!(inputs.tables, [3, 7, 99, 9, 99, 99, 99, 99, 99, 99, 99, 99]);
    }

    #[test]
    fn steps_that_do_not_fit_the_graph_are_refused() {
        let chunks = [decode(1, 1, 0, &[0]), decode(2, 1, 0, &[1])];
        assert_eq!(
            DecodeInputs::pad(&chunks, 1, 4, 16, 9),
            None,
            "too many rows"
        );
        let wide = [decode(1, 1, 40, &[0, 1, 2])];
        assert_eq!(
            DecodeInputs::pad(&wide, 1, 2, 16, 9),
            None,
            "table too wide"
        );
        let short = [decode(1, 1, 40, &[0])];
        assert_eq!(
            DecodeInputs::pad(&short, 1, 4, 16, 9),
            None,
            "position past its table"
        );
    }
}
