//! Weight formats (GGML block layouts, byte-exact with ggml) and the [`QMatrix`] that holds a
//! weight matrix in one of them.

mod dequant;
mod panel;

pub(crate) use dequant::dequantize_blocks;
pub(crate) use panel::{panel_block_bytes, PanelBlock, PANEL_ROWS};

use panel::{uses_panels, Panels};
use std::sync::OnceLock;

/// Storage format of a weight matrix. Quantized formats are GGML block layouts, byte-exact with
/// `ggml-common.h` (little-endian):
///
/// | format | elems/block | bytes/block | layout |
/// |--------|-------------|-------------|--------|
/// | F32    | 1   | 4   | `f32` |
/// | F16    | 1   | 2   | `f16` |
/// | BF16   | 1   | 2   | `bf16` |
/// | Q8_0   | 32  | 34  | `f16 d; i8 qs[32]` — `y = d*q` |
/// | Q4_0   | 32  | 18  | `f16 d; u8 qs[16]` — `y[j] = d*((qs[j]&15)-8)`, `y[j+16] = d*((qs[j]>>4)-8)` |
/// | Q4_1   | 32  | 20  | `f16 d; f16 m; u8 qs[16]` — `y[j] = d*(qs[j]&15)+m`, `y[j+16] = d*(qs[j]>>4)+m` |
/// | Q4_K   | 256 | 144 | `f16 d; f16 dmin; u8 scales[12]; u8 qs[128]` |
/// | Q6_K   | 256 | 210 | `u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d` |
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum WeightFormat {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q4_K,
    Q6_K,
}

impl WeightFormat {
    /// Elements per block: 1 for float types, 32 for Q8_0/Q4_0/Q4_1, 256 for K-quants.
    pub fn block_elems(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q8_0 | Self::Q4_0 | Self::Q4_1 => 32,
            Self::Q4_K | Self::Q6_K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q8_0 => 34,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q4_K => 144,
            Self::Q6_K => 210,
        }
    }

    /// Bytes of one row of `cols` elements; an error if `cols` is not a whole number of blocks.
    pub fn row_bytes(self, cols: usize) -> Result<usize, QuantError> {
        if !cols.is_multiple_of(self.block_elems()) {
            return Err(QuantError::ColsNotBlockMultiple { format: self, cols });
        }
        (cols / self.block_elems())
            .checked_mul(self.block_bytes())
            .ok_or(QuantError::SizeOverflow)
    }
}

/// Why a [`QMatrix`] could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("{cols} columns is not a multiple of the {format:?} block size")]
    ColsNotBlockMultiple { format: WeightFormat, cols: usize },
    #[error("matrix data is {actual} bytes, expected {expected}")]
    DataLength { expected: usize, actual: usize },
    #[error("matrix size overflows usize")]
    SizeOverflow,
    #[error("concat_rows needs at least one part")]
    ConcatEmpty,
    #[error("concat_rows: part has format {found:?}, expected {expected:?}")]
    ConcatFormat {
        expected: WeightFormat,
        found: WeightFormat,
    },
    #[error("concat_rows: part has {found} columns, expected {expected}")]
    ConcatCols { expected: usize, found: usize },
}

/// A weight matrix `[rows = output features, cols = input features]`, row-major, each row a run
/// of GGML blocks of `format`.
///
/// Q4_0, Q4_1 and Q8_0 matrices are repacked at construction into a SIMD-friendly panel layout
/// of the same size (see `quant/panel.rs`); [`QMatrix::data`] rebuilds the ggml bytes on first
/// use. Other formats are kept as given.
pub struct QMatrix {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    row_bytes: usize,
    storage: Storage,
    /// ggml bytes of a panel-stored matrix, built by `data()` when someone asks.
    ggml: OnceLock<Vec<u8>>,
}

#[derive(Clone, PartialEq, Eq)]
enum Storage {
    Ggml(Vec<u8>),
    Panels(Panels),
}

impl Clone for QMatrix {
    fn clone(&self) -> Self {
        Self {
            format: self.format,
            rows: self.rows,
            cols: self.cols,
            row_bytes: self.row_bytes,
            storage: self.storage.clone(),
            ggml: OnceLock::new(),
        }
    }
}

impl PartialEq for QMatrix {
    fn eq(&self, o: &Self) -> bool {
        (self.format, self.rows, self.cols) == (o.format, o.rows, o.cols)
            && self.storage == o.storage
    }
}

impl Eq for QMatrix {}

impl std::fmt::Debug for QMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QMatrix")
            .field("format", &self.format)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish_non_exhaustive()
    }
}

impl QMatrix {
    /// Wraps ggml bytes; checks that `data` holds exactly `rows` rows of `cols` elements.
    pub fn new(
        format: WeightFormat,
        rows: usize,
        cols: usize,
        data: Vec<u8>,
    ) -> Result<Self, QuantError> {
        let row_bytes = format.row_bytes(cols)?;
        let expected = row_bytes
            .checked_mul(rows)
            .ok_or(QuantError::SizeOverflow)?;
        if data.len() != expected {
            return Err(QuantError::DataLength {
                expected,
                actual: data.len(),
            });
        }
        let storage = if uses_panels(format) {
            Storage::Panels(Panels::pack(format, rows, cols, &data))
        } else {
            Storage::Ggml(data)
        };
        Ok(Self {
            format,
            rows,
            cols,
            row_bytes,
            storage,
            ggml: OnceLock::new(),
        })
    }

    /// An F32 matrix from row-major values. Panics if `data.len() != rows * cols`.
    pub fn from_f32(rows: usize, cols: usize, data: &[f32]) -> QMatrix {
        assert_eq!(data.len(), rows * cols, "from_f32: data is not rows*cols");
        Self {
            format: WeightFormat::F32,
            rows,
            cols,
            row_bytes: cols * 4,
            storage: Storage::Ggml(bytemuck::cast_slice(data).to_vec()),
            ggml: OnceLock::new(),
        }
    }

    /// The matrix in ggml layout, `rows * row_bytes()` bytes. For panel-stored formats this
    /// is rebuilt (and kept) on the first call.
    pub fn data(&self) -> &[u8] {
        match &self.storage {
            Storage::Ggml(d) => d,
            Storage::Panels(_) => self.ggml.get_or_init(|| {
                let mut out = vec![0u8; self.rows * self.row_bytes];
                self.write_ggml(&mut out);
                out
            }),
        }
    }

    /// Bytes per row in ggml layout.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Writes all rows in ggml layout into `out` (`rows * row_bytes` long).
    fn write_ggml(&self, out: &mut [u8]) {
        match &self.storage {
            Storage::Ggml(d) => out.copy_from_slice(d),
            Storage::Panels(p) => {
                for (r, row) in out.chunks_exact_mut(self.row_bytes.max(1)).enumerate() {
                    p.row_ggml(r, row);
                }
            }
        }
    }

    /// Row `row` in ggml layout, for formats stored as given (not Q4_0/Q4_1/Q8_0).
    pub(crate) fn ggml_row(&self, row: usize) -> &[u8] {
        match &self.storage {
            Storage::Ggml(d) => &d[row * self.row_bytes..(row + 1) * self.row_bytes],
            Storage::Panels(_) => unreachable!("ggml_row on a panel-stored matrix"),
        }
    }

    /// Panel `p` (rows `16p..16p+16`) of a Q4_0/Q4_1/Q8_0 matrix: `cols / 32` panel blocks.
    pub(crate) fn panel(&self, p: usize) -> &[u8] {
        match &self.storage {
            Storage::Panels(pn) => pn.panel(p),
            Storage::Ggml(_) => unreachable!("panel on a ggml-stored matrix"),
        }
    }

    /// Dequantizes one row into `out[..cols]` exactly as ggml's `dequantize_row_*` does.
    /// Panics if `row >= rows` or `out.len() < cols`.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(
            row < self.rows,
            "dequantize_row: row {row} >= {}",
            self.rows
        );
        match &self.storage {
            Storage::Ggml(_) => {
                dequantize_blocks(self.format, self.ggml_row(row), &mut out[..self.cols])
            }
            Storage::Panels(p) => {
                let mut buf = vec![0u8; self.row_bytes];
                p.row_ggml(row, &mut buf);
                dequantize_blocks(self.format, &buf, &mut out[..self.cols]);
            }
        }
    }

    /// Stacks matrices of the same format and column count (e.g. q|k|v, gate|up) into one.
    pub fn concat_rows(parts: &[QMatrix]) -> Result<QMatrix, QuantError> {
        let first = parts.first().ok_or(QuantError::ConcatEmpty)?;
        let mut rows = 0usize;
        for p in parts {
            if p.format != first.format {
                return Err(QuantError::ConcatFormat {
                    expected: first.format,
                    found: p.format,
                });
            }
            if p.cols != first.cols {
                return Err(QuantError::ConcatCols {
                    expected: first.cols,
                    found: p.cols,
                });
            }
            rows = rows.checked_add(p.rows).ok_or(QuantError::SizeOverflow)?;
        }
        let mut data = vec![0u8; rows * first.row_bytes];
        let mut at = 0;
        for p in parts {
            let len = p.rows * p.row_bytes;
            p.write_ggml(&mut data[at..at + len]);
            at += len;
        }
        QMatrix::new(first.format, rows, first.cols, data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_match_ggml() {
        use WeightFormat::*;
        let table = [
            (F32, 1, 4),
            (F16, 1, 2),
            (BF16, 1, 2),
            (Q8_0, 32, 34),
            (Q4_0, 32, 18),
            (Q4_1, 32, 20),
            (Q4_K, 256, 144),
            (Q6_K, 256, 210),
        ];
        for (f, e, b) in table {
            assert_eq!((f.block_elems(), f.block_bytes()), (e, b), "{f:?}");
        }
        assert_eq!(Q4_1.row_bytes(576), Ok(18 * 20));
        assert_eq!(
            Q4_1.row_bytes(40),
            Err(QuantError::ColsNotBlockMultiple {
                format: Q4_1,
                cols: 40
            })
        );
    }

    #[test]
    fn new_checks_length() {
        let err = QMatrix::new(WeightFormat::Q8_0, 2, 32, vec![0; 67]).unwrap_err();
        assert_eq!(
            err,
            QuantError::DataLength {
                expected: 68,
                actual: 67
            }
        );
        assert!(QMatrix::new(WeightFormat::Q8_0, 2, 32, vec![0; 68]).is_ok());
        assert!(QMatrix::new(WeightFormat::Q8_0, 0, 32, vec![]).is_ok());
    }

    #[test]
    fn concat_rows_stacks_and_checks() {
        let a = QMatrix::from_f32(1, 2, &[1.0, 2.0]);
        let b = QMatrix::from_f32(2, 2, &[3.0, 4.0, 5.0, 6.0]);
        let c = QMatrix::concat_rows(&[a.clone(), b]).unwrap();
        assert_eq!((c.rows, c.cols), (3, 2));
        let mut row = [0.0; 2];
        c.dequantize_row(2, &mut row);
        assert_eq!(row, [5.0, 6.0]);
        let d = QMatrix::from_f32(1, 3, &[0.0; 3]);
        assert_eq!(
            QMatrix::concat_rows(&[a.clone(), d]),
            Err(QuantError::ConcatCols {
                expected: 2,
                found: 3
            })
        );
        let q = QMatrix::new(WeightFormat::Q8_0, 1, 32, vec![0; 34]).unwrap();
        assert!(matches!(
            QMatrix::concat_rows(&[q, a]),
            Err(QuantError::ConcatFormat { .. })
        ));
        assert_eq!(QMatrix::concat_rows(&[]), Err(QuantError::ConcatEmpty));
    }
}
