//! A bounded GGUF v2/v3 parser over a memory map.
//!
//! Layout: magic "GGUF", u32 version, u64 tensor count, u64 metadata count, the metadata
//! (key, type, value), the tensor infos (name, dims, ggml type, offset), then the tensor
//! data section at the next multiple of `general.alignment`. Every count and length read
//! from the file is checked against the bytes left before anything is allocated.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use super::types::{GgmlType, GgufValue};
use crate::error::ModelFileError;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most 4 dimensions.
const MAX_DIMS: u32 = 4;
/// The spec allows arrays of arrays; nothing real nests deeper than one level.
const MAX_ARRAY_DEPTH: usize = 2;

/// One tensor's entry in the tensor table.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the contiguous (input/column) dimension.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub offset: u64,
    /// Bytes of data.
    pub size: u64,
}

/// A parsed GGUF file; tensor data stays in the memory map.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, GgufValue>,
    pub tensors: Vec<GgufTensorInfo>,
    pub alignment: u64,
    /// Start of the tensor data section.
    pub data_offset: u64,
    mmap: Arc<Mmap>,
    by_name: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, ModelFileError> {
        let io = |source| ModelFileError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len < 4 {
            return Err(ModelFileError::Truncated {
                path: path.to_path_buf(),
                what: "the GGUF header".into(),
                offset: 0,
                needed: 24,
                file_size: len,
            });
        }
        // SAFETY: the map is read-only; like every mmap-based loader we rely on nobody
        // truncating or rewriting the model file while it is loaded.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(path, Arc::new(mmap))
    }

    fn parse(path: &Path, mmap: Arc<Mmap>) -> Result<Self, ModelFileError> {
        let mut r = Cursor {
            buf: &mmap[..],
            pos: 0,
            path,
        };
        let magic = r.bytes(4, "the magic bytes")?;
        if magic != MAGIC {
            return Err(ModelFileError::BadMagic {
                path: path.to_path_buf(),
                magic: magic.to_vec(),
            });
        }
        let version = r.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(ModelFileError::UnsupportedVersion {
                path: path.to_path_buf(),
                version,
            });
        }
        let n_tensors = r.u64("the tensor count")?;
        let n_kv = r.u64("the metadata count")?;
        // A metadata entry takes at least 8 (key length) + 4 (type) + 1 bytes.
        r.check_count(n_kv, 13, "metadata count")?;

        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = r.string(&format!("metadata key #{i}"))?;
            let type_id = r.u32(&format!("the type of metadata `{key}`"))?;
            let value = r.value(&key, type_id, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(ModelFileError::DuplicateKey {
                    path: path.to_path_buf(),
                    key,
                });
            }
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(GgufValue::U32(a)) => u64::from(*a),
            Some(_) => {
                return Err(ModelFileError::WrongMetadataType {
                    path: path.to_path_buf(),
                    key: "general.alignment".into(),
                    expected: "a u32",
                })
            }
        };
        if !alignment.is_power_of_two() {
            return Err(ModelFileError::BadAlignment {
                path: path.to_path_buf(),
                alignment,
            });
        }

        // A tensor info takes at least 8 (name length) + 4 (n_dims) + 4 (type) + 8 bytes.
        r.check_count(n_tensors, 24, "tensor count")?;
        let mut raw = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = r.string(&format!("tensor info #{i}"))?;
            let what = format!("tensor info `{name}`");
            let n_dims = r.u32(&what)?;
            if n_dims > MAX_DIMS {
                return Err(bad_tensor(
                    path,
                    &name,
                    format!("{n_dims} dimensions (max 4)"),
                ));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64(&what)?);
            }
            let type_id = r.u32(&what)?;
            let rel_offset = r.u64(&what)?;
            raw.push((name, dims, type_id, rel_offset));
        }

        let file_size = mmap.len() as u64;
        let data_offset = (r.pos as u64).next_multiple_of(alignment);
        let mut tensors = Vec::with_capacity(raw.len());
        let mut by_name = HashMap::with_capacity(raw.len());
        for (name, dims, type_id, rel_offset) in raw {
            let ggml_type =
                GgmlType::from_id(type_id).ok_or_else(|| ModelFileError::UnknownTensorType {
                    path: path.to_path_buf(),
                    tensor: name.clone(),
                    type_id,
                })?;
            let size =
                tensor_size(&dims, ggml_type).map_err(|reason| bad_tensor(path, &name, reason))?;
            if !rel_offset.is_multiple_of(alignment) {
                return Err(bad_tensor(
                    path,
                    &name,
                    format!(
                        "data offset {rel_offset} is not a multiple of the alignment {alignment}"
                    ),
                ));
            }
            let start = data_offset.checked_add(rel_offset);
            let end = start.and_then(|s| s.checked_add(size));
            match (start, end) {
                (Some(start), Some(end)) if end <= file_size => {
                    if by_name.insert(name.clone(), tensors.len()).is_some() {
                        return Err(ModelFileError::DuplicateTensor {
                            path: path.to_path_buf(),
                            name,
                        });
                    }
                    tensors.push(GgufTensorInfo {
                        name,
                        dims,
                        ggml_type,
                        offset: start,
                        size,
                    });
                }
                _ => {
                    return Err(ModelFileError::TensorOutOfBounds {
                        path: path.to_path_buf(),
                        tensor: name,
                        start: data_offset.saturating_add(rel_offset),
                        end: data_offset.saturating_add(rel_offset).saturating_add(size),
                        file_size,
                    })
                }
            }
        }

        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            alignment,
            data_offset,
            mmap,
            by_name,
        })
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw (possibly quantized) bytes of one tensor, borrowed from the map.
    pub fn tensor_bytes(&self, name: &str) -> Option<&[u8]> {
        // In bounds: checked against the file size in `parse`.
        self.tensor(name)
            .map(|t| &self.mmap[t.offset as usize..(t.offset + t.size) as usize])
    }

    /// The map of the whole file, which weights borrow their data from.
    pub fn mmap(&self) -> &Arc<Mmap> {
        &self.mmap
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// A value that has the right type but cannot be used.
    pub fn bad_value(&self, key: &str, reason: String) -> ModelFileError {
        ModelFileError::BadConfigValue {
            path: self.path.clone(),
            key: key.into(),
            reason,
        }
    }

    fn missing(&self, key: &str) -> ModelFileError {
        ModelFileError::MissingMetadata {
            path: self.path.clone(),
            key: key.into(),
        }
    }

    fn wrong(&self, key: &str, expected: &'static str) -> ModelFileError {
        ModelFileError::WrongMetadataType {
            path: self.path.clone(),
            key: key.into(),
            expected,
        }
    }

    /// A present key must hold a string; `Ok(None)` when absent.
    pub fn str_opt(&self, key: &str) -> Result<Option<&str>, ModelFileError> {
        self.get(key)
            .map(|v| v.as_str().ok_or_else(|| self.wrong(key, "a string")))
            .transpose()
    }

    pub fn str_req(&self, key: &str) -> Result<&str, ModelFileError> {
        self.str_opt(key)?.ok_or_else(|| self.missing(key))
    }

    /// Any non-negative integer type.
    pub fn u64_opt(&self, key: &str) -> Result<Option<u64>, ModelFileError> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| self.wrong(key, "a non-negative integer"))
            })
            .transpose()
    }

    pub fn u64_req(&self, key: &str) -> Result<u64, ModelFileError> {
        self.u64_opt(key)?.ok_or_else(|| self.missing(key))
    }

    /// A count or size: a present key must hold an integer in 1..=u32::MAX.
    pub fn positive_opt(&self, key: &str) -> Result<Option<usize>, ModelFileError> {
        self.u64_opt(key)?
            .map(|v| match usize::try_from(v) {
                Ok(v) if v > 0 && v <= u32::MAX as usize => Ok(v),
                _ => Err(self.bad_value(key, format!("{v} is out of range"))),
            })
            .transpose()
    }

    pub fn positive_req(&self, key: &str) -> Result<usize, ModelFileError> {
        self.positive_opt(key)?.ok_or_else(|| self.missing(key))
    }

    /// Any numeric type.
    pub fn f64_opt(&self, key: &str) -> Result<Option<f64>, ModelFileError> {
        self.get(key)
            .map(|v| v.as_f64().ok_or_else(|| self.wrong(key, "a number")))
            .transpose()
    }

    pub fn bool_opt(&self, key: &str) -> Result<Option<bool>, ModelFileError> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| self.wrong(key, "a bool")))
            .transpose()
    }

    /// An array (absent: `Ok(None)`).
    pub fn array_opt(&self, key: &str) -> Result<Option<&[GgufValue]>, ModelFileError> {
        self.get(key)
            .map(|v| v.as_array().ok_or_else(|| self.wrong(key, "an array")))
            .transpose()
    }
}

fn bad_tensor(path: &Path, name: &str, reason: String) -> ModelFileError {
    ModelFileError::BadTensorInfo {
        path: path.to_path_buf(),
        tensor: name.into(),
        reason,
    }
}

/// Bytes of a tensor of `dims` (ggml order) stored as `ty`, with overflow checks.
fn tensor_size(dims: &[u64], ty: GgmlType) -> Result<u64, String> {
    let (block_elems, block_bytes) = ty.block();
    let ne0 = dims.first().copied().unwrap_or(1);
    if !ne0.is_multiple_of(block_elems) {
        return Err(format!(
            "row length {ne0} is not a multiple of the {} block size {block_elems}",
            ty.name()
        ));
    }
    let overflow = || format!("shape {dims:?} overflows");
    let row = (ne0 / block_elems)
        .checked_mul(block_bytes)
        .ok_or_else(overflow)?;
    dims.iter()
        .skip(1)
        .try_fold(row, |acc, &d| acc.checked_mul(d))
        .filter(|&s| s <= i64::MAX as u64)
        .ok_or_else(overflow)
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn bytes(&mut self, n: u64, what: &str) -> Result<&'a [u8], ModelFileError> {
        if n > self.remaining() {
            return Err(ModelFileError::Truncated {
                path: self.path.to_path_buf(),
                what: what.into(),
                offset: self.pos as u64,
                needed: n,
                file_size: self.buf.len() as u64,
            });
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], ModelFileError> {
        Ok(self
            .bytes(N as u64, what)?
            .try_into()
            .expect("length checked"))
    }

    fn u32(&mut self, what: &str) -> Result<u32, ModelFileError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, ModelFileError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Rejects `count` items of at least `min_size` bytes each that cannot fit.
    fn check_count(&self, count: u64, min_size: u64, what: &str) -> Result<(), ModelFileError> {
        if count.saturating_mul(min_size) > self.remaining() {
            return Err(ModelFileError::CountTooLarge {
                path: self.path.to_path_buf(),
                what: what.into(),
                count,
                remaining: self.remaining(),
            });
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String, ModelFileError> {
        let len = self.u64(what)?;
        let bytes = self.bytes(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| ModelFileError::InvalidUtf8 {
            path: self.path.to_path_buf(),
            what: what.into(),
        })
    }

    fn value(
        &mut self,
        key: &str,
        type_id: u32,
        depth: usize,
    ) -> Result<GgufValue, ModelFileError> {
        let what = format!("metadata `{key}`");
        Ok(match type_id {
            0 => GgufValue::U8(self.array::<1>(&what)?[0]),
            1 => GgufValue::I8(self.array::<1>(&what)?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(&what)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(&what)?)),
            4 => GgufValue::U32(u32::from_le_bytes(self.array(&what)?)),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(&what)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(&what)?)),
            7 => GgufValue::Bool(self.array::<1>(&what)?[0] != 0),
            8 => GgufValue::String(self.string(&what)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(ModelFileError::NestingTooDeep {
                        path: self.path.to_path_buf(),
                        key: key.into(),
                        max: MAX_ARRAY_DEPTH,
                    });
                }
                let elem_type = self.u32(&what)?;
                let count = self.u64(&what)?;
                let min_size = match elem_type {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    _ => {
                        return Err(ModelFileError::UnknownValueType {
                            path: self.path.to_path_buf(),
                            key: key.into(),
                            type_id: elem_type,
                        })
                    }
                };
                self.check_count(count, min_size, &what)?;
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(key, elem_type, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(u64::from_le_bytes(self.array(&what)?)),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(&what)?)),
            _ => {
                return Err(ModelFileError::UnknownValueType {
                    path: self.path.to_path_buf(),
                    key: key.into(),
                    type_id,
                })
            }
        })
    }
}
