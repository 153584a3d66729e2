//! The canonical index: one data layout per set of tensors.
//!
//! Whatever files the tensors came from, an artifact's data is laid out the
//! same way: tensors sorted by name (bytewise), each starting at a multiple of
//! [`ALIGNMENT`], the gaps ("padding") explicit and zero. The index lists
//! name, dtype, shape, offset and length of every tensor; its JSON encoding is
//! canonical (fixed field order, no whitespace), so hashing it gives the first
//! half of the artifact id.

use safetensors::Dtype;
use serde::{Deserialize, Serialize};

use crate::id::Digest;

/// Every tensor starts at a multiple of this many bytes in the canonical layout.
pub const ALIGNMENT: u64 = 64;

/// Version of the canonical index format; part of the hashed bytes.
pub const INDEX_VERSION: u32 = 1;

/// A tensor as a producer describes it: name, dtype, shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSpec {
    /// Tensor name (any UTF-8; unique within an artifact).
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape, row-major (C order).
    pub shape: Vec<u64>,
}

/// Why a set of tensors or an index is not acceptable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IndexError {
    /// Two tensors share a name.
    #[error("tensor `{0}` appears more than once")]
    DuplicateTensor(String),
    /// The tensor's byte size overflows or is not a whole number of bytes.
    #[error("tensor `{name}` with shape {shape:?} and dtype {dtype} has no whole byte size")]
    BadSize {
        /// Tensor name.
        name: String,
        /// Its shape.
        shape: Vec<u64>,
        /// Its dtype.
        dtype: Dtype,
    },
    /// The artifact has no tensors.
    #[error("an artifact needs at least one tensor")]
    Empty,
    /// Stored index bytes are not valid JSON of the expected shape.
    #[error("index is not valid: {0}")]
    Malformed(String),
    /// Stored index bytes parse but are not the canonical encoding of their content.
    #[error("index is not in canonical form")]
    NotCanonical,
}

/// One tensor's place in the canonical layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexEntry {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<u64>,
    /// Byte offset in the canonical data.
    pub offset: u64,
    /// Byte length.
    pub len: u64,
}

/// The canonical index of an artifact (or of a view).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CanonicalIndex {
    /// [`INDEX_VERSION`].
    pub version: u32,
    /// [`ALIGNMENT`].
    pub alignment: u64,
    /// Total length of the canonical data, padding included.
    pub data_len: u64,
    /// Tensors sorted by name.
    pub tensors: Vec<IndexEntry>,
}

/// Byte size of a tensor, or `None` if it overflows or is not whole bytes.
pub fn tensor_bytes(dtype: Dtype, shape: &[u64]) -> Option<u64> {
    let elems = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
    let bits = elems.checked_mul(dtype.bitsize() as u64)?;
    (bits % 8 == 0).then_some(bits / 8)
}

fn align_up(x: u64) -> u64 {
    x.div_ceil(ALIGNMENT) * ALIGNMENT
}

impl CanonicalIndex {
    /// Lays out `specs` canonically. Order of `specs` does not matter.
    pub fn build(mut specs: Vec<TensorSpec>) -> Result<Self, IndexError> {
        if specs.is_empty() {
            return Err(IndexError::Empty);
        }
        specs.sort_by(|a, b| a.name.as_bytes().cmp(b.name.as_bytes()));
        if let Some(w) = specs.windows(2).find(|w| w[0].name == w[1].name) {
            return Err(IndexError::DuplicateTensor(w[0].name.clone()));
        }
        let mut offset = 0u64;
        let mut tensors = Vec::with_capacity(specs.len());
        for s in specs {
            let len = tensor_bytes(s.dtype, &s.shape).ok_or_else(|| IndexError::BadSize {
                name: s.name.clone(),
                shape: s.shape.clone(),
                dtype: s.dtype,
            })?;
            offset = align_up(offset);
            tensors.push(IndexEntry { name: s.name, dtype: s.dtype, shape: s.shape, offset, len });
            offset += len;
        }
        Ok(CanonicalIndex { version: INDEX_VERSION, alignment: ALIGNMENT, data_len: offset, tensors })
    }

    /// The canonical bytes that are hashed into the id.
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("index serializes")
    }

    /// BLAKE3 of [`Self::to_bytes`].
    pub fn digest(&self) -> Digest {
        *blake3::hash(&self.to_bytes()).as_bytes()
    }

    /// Parses stored index bytes and checks they are canonical: the layout is
    /// what [`Self::build`] gives for the same tensors and the encoding is byte
    /// for byte the canonical one. View indexes (built by
    /// [`crate::view::ViewPlan`]) follow the same rules.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, IndexError> {
        let idx: CanonicalIndex =
            serde_json::from_slice(bytes).map_err(|e| IndexError::Malformed(e.to_string()))?;
        let rebuilt = CanonicalIndex::build(
            idx.tensors
                .iter()
                .map(|t| TensorSpec { name: t.name.clone(), dtype: t.dtype, shape: t.shape.clone() })
                .collect(),
        )?;
        if rebuilt != idx || rebuilt.to_bytes() != bytes {
            return Err(IndexError::NotCanonical);
        }
        Ok(idx)
    }

    /// The file name, if the artifact is one whole file imported as it was
    /// (a GGUF, say): its bytes are then the canonical data from offset 0,
    /// and the shared memory can be opened as that file.
    pub fn whole_file(&self) -> Option<&str> {
        match self.tensors.as_slice() {
            [only] => only.name.strip_prefix(crate::format::FILE_TENSOR_PREFIX),
            _ => None,
        }
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&IndexEntry> {
        self.tensors
            .binary_search_by(|t| t.name.as_bytes().cmp(name.as_bytes()))
            .ok()
            .map(|i| &self.tensors[i])
    }

    /// Calls `f(tensor_index, tensor_byte_offset, canonical_offset, len)` for
    /// every tensor byte run inside the canonical range `start..end`, in order.
    /// Bytes of the range not covered by a call are padding (zero).
    pub fn for_each_run(&self, start: u64, end: u64, mut f: impl FnMut(usize, u64, u64, u64)) {
        let first = self.tensors.partition_point(|t| t.offset + t.len <= start);
        for (i, t) in self.tensors.iter().enumerate().skip(first) {
            if t.offset >= end {
                break;
            }
            let a = start.max(t.offset);
            let b = end.min(t.offset + t.len);
            if a < b {
                f(i, a - t.offset, a, b - a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, dtype: Dtype, shape: &[u64]) -> TensorSpec {
        TensorSpec { name: name.into(), dtype, shape: shape.to_vec() }
    }

    #[test]
    fn layout_is_sorted_aligned_and_order_independent() {
        let a = CanonicalIndex::build(vec![spec("b", Dtype::F32, &[3]), spec("a", Dtype::U8, &[5])]).unwrap();
        let b = CanonicalIndex::build(vec![spec("a", Dtype::U8, &[5]), spec("b", Dtype::F32, &[3])]).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.tensors[0].offset, 0);
        assert_eq!(a.tensors[1].offset, 64);
        assert_eq!(a.data_len, 76);
        assert_eq!(CanonicalIndex::from_bytes(&a.to_bytes()).unwrap(), a);
    }

    #[test]
    fn rejects_duplicates_sub_byte_sizes_and_non_canonical_bytes() {
        let dup = CanonicalIndex::build(vec![spec("a", Dtype::U8, &[1]), spec("a", Dtype::U8, &[1])]);
        assert_eq!(dup.unwrap_err(), IndexError::DuplicateTensor("a".into()));
        assert!(matches!(
            CanonicalIndex::build(vec![spec("x", Dtype::F4, &[3])]),
            Err(IndexError::BadSize { .. })
        ));
        let idx = CanonicalIndex::build(vec![spec("a", Dtype::U8, &[1])]).unwrap();
        let pretty = serde_json::to_vec_pretty(&idx).unwrap();
        assert_eq!(CanonicalIndex::from_bytes(&pretty).unwrap_err(), IndexError::NotCanonical);
        assert!(matches!(CanonicalIndex::from_bytes(b"{"), Err(IndexError::Malformed(_))));
    }

    #[test]
    fn runs_cover_tensor_bytes_and_skip_padding() {
        let idx =
            CanonicalIndex::build(vec![spec("a", Dtype::U8, &[10]), spec("b", Dtype::U8, &[10])]).unwrap();
        let mut runs = vec![];
        idx.for_each_run(5, 70, |i, toff, coff, len| runs.push((i, toff, coff, len)));
        assert_eq!(runs, vec![(0, 5, 5, 5), (1, 0, 64, 6)]);
    }
}
