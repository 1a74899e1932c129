//! The repacked ("panel") layout of Q4_0, Q4_1 and Q8_0 matrices, built once at construction.
//!
//! Rows are grouped in panels of 16 (the last one padded with zero rows). For each 32-column
//! block, a panel stores the 16 rows' quants transposed so that one aligned 64-byte load gives
//! 4 consecutive bytes of every row — exactly the operand of `vpdpbusd` with one lane per
//! output row — followed by the 16 row scales:
//!
//! | format | per panel block (bytes) |
//! |--------|-------------------------|
//! | Q4_0   | `qs[g][row][4]` g = 0..4 (256) · `d[16]` f16 (32) |
//! | Q4_1   | `qs[g][row][4]` g = 0..4 (256) · `d[16]` f16 (32) · `m[16]` f16 (32) |
//! | Q8_0   | `(qs ^ 0x80)[g][row][4]` g = 0..8 (512) · `d[16]` f16 (32) |
//!
//! `qs[g]` for Q4 is dword `g` of the ggml nibble array (columns `4g..4g+4` in the low
//! nibbles, `16+4g..` in the high ones); Q8_0 bytes are stored biased to unsigned. The size is
//! exactly ggml's (16 rows x block bytes), apart from the last panel's padding rows, so decode
//! streams no extra bytes.

use super::WeightFormat;
use bytemuck::{Pod, Zeroable};

/// Rows per panel.
pub(crate) const PANEL_ROWS: usize = 16;

#[derive(Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// A matrix in panel layout.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Panels {
    lines: Vec<Line>,
    format: WeightFormat,
    /// Blocks per row.
    nb: usize,
}

/// Whether `f` is stored in panel layout.
pub(crate) fn uses_panels(f: WeightFormat) -> bool {
    matches!(
        f,
        WeightFormat::Q4_0 | WeightFormat::Q4_1 | WeightFormat::Q8_0
    )
}

/// Bytes of one 16-row panel block.
#[inline(always)]
pub(crate) fn panel_block_bytes(f: WeightFormat) -> usize {
    match f {
        WeightFormat::Q4_0 => 288,
        WeightFormat::Q4_1 => 320,
        WeightFormat::Q8_0 => 544,
        _ => unreachable!("{f:?} is not stored in panels"),
    }
}

/// (offset of the quant dwords, number of dwords per row, offset of d, offset of m).
#[inline(always)]
fn layout(f: WeightFormat) -> (usize, usize, usize, usize) {
    match f {
        WeightFormat::Q4_0 | WeightFormat::Q4_1 => (0, 4, 256, 288),
        _ => (0, 8, 512, 0),
    }
}

/// (offset of d, offset of m, offset of qs, qs bytes) within a ggml block.
fn ggml_layout(f: WeightFormat) -> (usize, usize, usize, usize) {
    match f {
        WeightFormat::Q4_0 => (0, 0, 2, 16),
        WeightFormat::Q4_1 => (0, 2, 4, 16),
        _ => (0, 0, 2, 32),
    }
}

impl Panels {
    /// Repacks `rows` rows of ggml blocks (`ggml.len() == rows * row_bytes`).
    pub(crate) fn pack(f: WeightFormat, rows: usize, cols: usize, ggml: &[u8]) -> Panels {
        let nb = cols / 32;
        let pbb = panel_block_bytes(f);
        let panels = rows.div_ceil(PANEL_ROWS);
        let mut lines = vec![Line([0; 64]); (panels * nb * pbb).div_ceil(64)];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut lines);
        let bb = f.block_bytes();
        let (q_off, dwords, d_off, m_off) = layout(f);
        let (gd, gm, gq, _) = ggml_layout(f);
        for r in 0..rows {
            let (p, i) = (r / PANEL_ROWS, r % PANEL_ROWS);
            for b in 0..nb {
                let src = &ggml[(r * nb + b) * bb..][..bb];
                let dst = &mut bytes[(p * nb + b) * pbb..][..pbb];
                for g in 0..dwords {
                    for k in 0..4 {
                        let v = src[gq + 4 * g + k];
                        dst[q_off + 64 * g + 4 * i + k] =
                            if f == WeightFormat::Q8_0 { v ^ 0x80 } else { v };
                    }
                }
                dst[d_off + 2 * i..][..2].copy_from_slice(&src[gd..gd + 2]);
                if f == WeightFormat::Q4_1 {
                    dst[m_off + 2 * i..][..2].copy_from_slice(&src[gm..gm + 2]);
                }
            }
        }
        Panels {
            lines,
            format: f,
            nb,
        }
    }

    /// The `nb` blocks of panel `p` (rows `16p..16p+16`).
    pub(crate) fn panel(&self, p: usize) -> &[u8] {
        let pbb = panel_block_bytes(self.format);
        &bytemuck::cast_slice(&self.lines)[p * self.nb * pbb..(p + 1) * self.nb * pbb]
    }

    /// Writes row `r` back in ggml layout into `out` (`row_bytes` long).
    pub(crate) fn row_ggml(&self, r: usize, out: &mut [u8]) {
        let f = self.format;
        let bb = f.block_bytes();
        let panel = self.panel(r / PANEL_ROWS);
        let i = r % PANEL_ROWS;
        let pbb = panel_block_bytes(f);
        let (q_off, dwords, d_off, m_off) = layout(f);
        let (gd, gm, gq, _) = ggml_layout(f);
        for b in 0..self.nb {
            let src = &panel[b * pbb..][..pbb];
            let dst = &mut out[b * bb..][..bb];
            for g in 0..dwords {
                for k in 0..4 {
                    let v = src[q_off + 64 * g + 4 * i + k];
                    dst[gq + 4 * g + k] = if f == WeightFormat::Q8_0 { v ^ 0x80 } else { v };
                }
            }
            dst[gd..gd + 2].copy_from_slice(&src[d_off + 2 * i..][..2]);
            if f == WeightFormat::Q4_1 {
                dst[gm..gm + 2].copy_from_slice(&src[m_off + 2 * i..][..2]);
            }
        }
    }
}

/// Reads one row's block `b` from a panel: `(d, m or 0, quant byte j)` accessors for the
/// portable kernel. `j` indexes the ggml `qs` array (16 nibble bytes or 32 signed bytes).
pub(crate) struct PanelBlock<'a> {
    block: &'a [u8],
    lane: usize,
    format: WeightFormat,
}

impl<'a> PanelBlock<'a> {
    #[inline(always)]
    pub(crate) fn new(f: WeightFormat, panel: &'a [u8], lane: usize, b: usize) -> Self {
        let pbb = panel_block_bytes(f);
        PanelBlock {
            block: &panel[b * pbb..(b + 1) * pbb],
            lane,
            format: f,
        }
    }

    #[inline(always)]
    fn f16_at(&self, off: usize) -> f32 {
        let o = off + 2 * self.lane;
        half::f16::from_le_bytes([self.block[o], self.block[o + 1]]).to_f32()
    }

    #[inline(always)]
    pub(crate) fn d(&self) -> f32 {
        self.f16_at(layout(self.format).2)
    }

    #[inline(always)]
    pub(crate) fn m(&self) -> f32 {
        self.f16_at(layout(self.format).3)
    }

    /// ggml `qs[j]` (Q8_0: as stored by ggml, i.e. unbiased).
    #[inline(always)]
    pub(crate) fn q(&self, j: usize) -> u8 {
        let v = self.block[64 * (j / 4) + 4 * self.lane + j % 4];
        if self.format == WeightFormat::Q8_0 {
            v ^ 0x80
        } else {
            v
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_roundtrips() {
        for f in [WeightFormat::Q4_0, WeightFormat::Q4_1, WeightFormat::Q8_0] {
            let (rows, cols) = (21, 96);
            let rb = f.row_bytes(cols).unwrap();
            let ggml: Vec<u8> = (0..rows * rb).map(|i| (i * 31 % 251) as u8).collect();
            let p = Panels::pack(f, rows, cols, &ggml);
            assert_eq!(p.lines.len(), (2 * 3 * panel_block_bytes(f)).div_ceil(64));
            let mut row = vec![0u8; rb];
            for r in 0..rows {
                p.row_ggml(r, &mut row);
                assert_eq!(row, &ggml[r * rb..(r + 1) * rb], "{f:?} row {r}");
                let blk = PanelBlock::new(f, p.panel(r / 16), r % 16, 2);
                let g = &ggml[r * rb + 2 * f.block_bytes()..];
                let (gd, gm, gq, nq) = ggml_layout(f);
                assert_eq!(
                    blk.d().to_bits(),
                    half::f16::from_le_bytes([g[gd], g[gd + 1]])
                        .to_f32()
                        .to_bits()
                );
                if f == WeightFormat::Q4_1 {
                    assert_eq!(
                        blk.m(),
                        half::f16::from_le_bytes([g[gm], g[gm + 1]]).to_f32()
                    );
                }
                for j in 0..nq {
                    assert_eq!(blk.q(j), g[gq + j]);
                }
            }
        }
    }
}
