//! How a step's query rows split into the tiles `paged_attention_tiled` computes (see
//! attention.cu): runs of one sequence's consecutive rows, at most [`ATTN_TILE_ROWS`] each.

/// Query rows per tile (`TILE_ROWS` in attention.cu).
pub const ATTN_TILE_ROWS: usize = 32;

/// The tiles of a step whose sequences have `rows` query rows each, in row order: each tile's
/// first row, then the total (`tiles[t]..tiles[t + 1]` are tile `t`'s rows).
pub fn attention_tiles(rows: impl IntoIterator<Item = usize>) -> Vec<i32> {
    let mut tiles = Vec::new();
    let mut at = 0;
    for n in rows {
        tiles.extend((at..at + n).step_by(ATTN_TILE_ROWS).map(|r| r as i32));
        at += n;
    }
    tiles.push(at as i32);
    tiles
}

/// Whether tiles pay: the tiled kernel reads each K/V chunk once per tile where the per-row
/// kernel reads it once per row, but gives a one-row tile a quarter of the threads the
/// per-row kernel gives it (one warp of four). Decode steps keep the per-row kernel.
pub fn tiles_pay(n_rows: usize, tiles: &[i32]) -> bool {
    let n_tiles = tiles.len().saturating_sub(1);
    n_tiles > 0 && n_rows >= 2 * n_tiles
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_split_each_sequence_at_the_tile_size_and_never_across_sequences() {
        // A 70-row prefill, a decode row, a 32-row chunk, an empty sequence.
        let tiles = attention_tiles([70, 1, 32, 0]);
        assert_eq!(tiles, [0, 32, 64, 70, 71, 103]);
        for w in tiles.windows(2) {
            assert!(w[1] > w[0] && (w[1] - w[0]) as usize <= ATTN_TILE_ROWS);
        }
        assert_eq!(attention_tiles([]), [0]);
        assert!(tiles_pay(103, &tiles));
        // Eight decode rows: eight one-row tiles.
        let decode = attention_tiles([1; 8]);
        assert!(!tiles_pay(8, &decode));
        assert!(!tiles_pay(0, &attention_tiles([])));
    }
}
