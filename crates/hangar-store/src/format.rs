//! Reading safetensors files into the canonical layout.
//!
//! A safetensors file is `u64 LE header length ‖ JSON header ‖ data`. The
//! header is parsed here rather than by `safetensors::SafeTensors` because the
//! fallback source reads files through `object_store` range requests and never
//! holds a whole file; the `safetensors` crate still supplies the dtype and
//! tensor-info types, and writes files for `hangar store get`.
//!
//! Every check names the file and, where there is one, the tensor.

use std::collections::HashMap;

use safetensors::tensor::TensorInfo;
use safetensors::Dtype;

use crate::index::{tensor_bytes, CanonicalIndex, IndexError, TensorSpec};

/// Headers larger than this are refused (the safetensors limit).
pub const MAX_HEADER: u64 = 100_000_000;

/// Tensor names starting with this are whole files: a file that is not
/// safetensors (a llama.cpp GGUF, say) is imported as one `U8` tensor
/// `file:<its name>` holding its bytes unchanged, so an engine can open the
/// artifact as the file it was. Safetensors tensors may not use the prefix.
pub const FILE_TENSOR_PREFIX: &str = "file:";

/// Whether `path` is read as safetensors (its name ends in `.safetensors`);
/// any other file is imported whole ([`whole_file`]).
pub fn is_safetensors(path: &std::path::Path) -> bool {
    path.extension().is_some_and(|e| e == "safetensors")
}

/// The tensor that holds the whole file `file_name` of `len` bytes, read
/// from file number `file_idx` of an import.
pub fn whole_file(file_name: &str, file_idx: usize, len: u64) -> (TensorSpec, TensorLocation) {
    (
        TensorSpec { name: format!("{FILE_TENSOR_PREFIX}{file_name}"), dtype: Dtype::U8, shape: vec![len] },
        TensorLocation { file: file_idx, start: 0 },
    )
}

/// Why a safetensors file cannot be imported.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FormatError {
    /// The file is shorter than the 8-byte header length.
    #[error("{file}: truncated: {len} bytes, shorter than the 8-byte header length")]
    Truncated {
        /// File name.
        file: String,
        /// Its length.
        len: u64,
    },
    /// The header length says more bytes than the file has.
    #[error("{file}: header says it is {header} bytes but the file has only {len} bytes after the length")]
    HeaderBeyondFile {
        /// File name.
        file: String,
        /// Declared header length.
        header: u64,
        /// Bytes available after the length prefix.
        len: u64,
    },
    /// The header length exceeds [`MAX_HEADER`].
    #[error("{file}: header of {header} bytes exceeds the {MAX_HEADER}-byte limit")]
    HeaderTooLarge {
        /// File name.
        file: String,
        /// Declared header length.
        header: u64,
    },
    /// The header is not a JSON object of tensor entries.
    #[error("{file}: malformed header: {reason}")]
    MalformedHeader {
        /// File name.
        file: String,
        /// What the parser said.
        reason: String,
    },
    /// A tensor has a dtype safetensors does not define.
    #[error("{file}: tensor `{tensor}` has unknown dtype `{dtype}`")]
    UnknownDtype {
        /// File name.
        file: String,
        /// Tensor name.
        tensor: String,
        /// The dtype as written.
        dtype: String,
    },
    /// A tensor's data offsets disagree with its shape or lie outside the file.
    #[error("{file}: tensor `{tensor}`: {reason}")]
    BadTensor {
        /// File name.
        file: String,
        /// Tensor name.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// The tensors' data does not tile the data section exactly: bytes
    /// no tensor holds, or tensors whose bytes overlap. The safetensors
    /// format forbids both; a file with either could not be written back
    /// byte for byte from its tensors.
    #[error("{file}: {reason}")]
    NotContiguous {
        /// File name.
        file: String,
        /// Where the hole or the overlap is.
        reason: String,
    },
    /// Tensors across files do not form a valid artifact (e.g. a duplicate name).
    #[error("{0}")]
    Index(#[from] IndexError),
}

/// Where a tensor's bytes live in a set of source files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorLocation {
    /// Index of the file in the set.
    pub file: usize,
    /// Absolute byte offset of the tensor data in that file.
    pub start: u64,
}

/// Reads the header length from the first 8 bytes of a file of `file_len` bytes.
pub fn header_len(file: &str, first8: &[u8], file_len: u64) -> Result<u64, FormatError> {
    let Ok(first8) = <[u8; 8]>::try_from(first8) else {
        return Err(FormatError::Truncated { file: file.into(), len: file_len });
    };
    let header = u64::from_le_bytes(first8);
    if header > MAX_HEADER {
        return Err(FormatError::HeaderTooLarge { file: file.into(), header });
    }
    if header > file_len - 8 {
        return Err(FormatError::HeaderBeyondFile { file: file.into(), header, len: file_len - 8 });
    }
    Ok(header)
}

/// Parses a header (the JSON bytes after the length) of file number
/// `file_idx` of `file_len` bytes into tensor specs and their locations.
pub fn parse_header(
    file: &str,
    file_idx: usize,
    header: &[u8],
    file_len: u64,
) -> Result<Vec<(TensorSpec, TensorLocation)>, FormatError> {
    let malformed = |reason: String| FormatError::MalformedHeader { file: file.into(), reason };
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(header).map_err(|e| malformed(e.to_string()))?;
    let data_start = 8 + header.len() as u64;
    let mut out = Vec::with_capacity(map.len());
    for (name, value) in map {
        if name == "__metadata__" {
            continue;
        }
        if let Some(dtype) = value.get("dtype").and_then(|d| d.as_str()) {
            if serde_json::from_value::<Dtype>(dtype.into()).is_err() {
                return Err(FormatError::UnknownDtype {
                    file: file.into(),
                    tensor: name,
                    dtype: dtype.into(),
                });
            }
        }
        let info: TensorInfo =
            serde_json::from_value(value).map_err(|e| malformed(format!("tensor `{name}`: {e}")))?;
        let bad = |reason: String| FormatError::BadTensor { file: file.into(), tensor: name.clone(), reason };
        if name.starts_with(FILE_TENSOR_PREFIX) {
            return Err(bad(format!(
                "names starting with `{FILE_TENSOR_PREFIX}` are reserved for whole files"
            )));
        }
        let shape: Vec<u64> = info.shape.iter().map(|&d| d as u64).collect();
        let (s, e) = (info.data_offsets.0 as u64, info.data_offsets.1 as u64);
        let want = tensor_bytes(info.dtype, &shape)
            .ok_or_else(|| bad(format!("shape {shape:?} of {} has no whole byte size", info.dtype)))?;
        if e < s || e - s != want {
            return Err(bad(format!(
                "data_offsets [{s}, {e}) hold {} bytes, shape needs {want}",
                e.wrapping_sub(s)
            )));
        }
        if data_start + e > file_len {
            return Err(bad(format!(
                "data ends at byte {} but the file has {file_len} bytes (truncated?)",
                data_start + e
            )));
        }
        out.push((
            TensorSpec { name: name.clone(), dtype: info.dtype, shape },
            TensorLocation { file: file_idx, start: data_start + s },
        ));
    }
    Ok(out)
}

/// Checks that the tensors of one safetensors file (as [`parse_header`]
/// gives them), whose header is `header_len` bytes and the file
/// `file_len`, hold every byte of its data section exactly once: the
/// safetensors format's rule that the data has no holes, which makes the
/// file its header followed by its tensors' bytes in offset order.
pub fn check_contiguous(
    file: &str,
    header_len: u64,
    file_len: u64,
    tensors: &[(TensorSpec, TensorLocation)],
) -> Result<(), FormatError> {
    let mut spans: Vec<(u64, u64, &str)> = tensors
        .iter()
        .map(|(spec, loc)| {
            let len = tensor_bytes(spec.dtype, &spec.shape).expect("parse_header checked the size");
            (loc.start, loc.start + len, spec.name.as_str())
        })
        .collect();
    spans.sort_unstable();
    let not = |reason: String| FormatError::NotContiguous { file: file.into(), reason };
    let mut at = 8 + header_len;
    let mut before = None;
    for (start, end, name) in spans {
        if start > at {
            return Err(not(format!("bytes {at}..{start} before tensor `{name}` belong to no tensor")));
        }
        if start < at {
            let other = before.unwrap_or("the header");
            return Err(not(format!(
                "tensor `{name}` at byte {start} overlaps `{other}`, which ends at {at}"
            )));
        }
        (at, before) = (end, Some(name));
    }
    if at != file_len {
        return Err(not(format!("bytes {at}..{file_len} after the last tensor belong to no tensor")));
    }
    Ok(())
}

/// The `__metadata__` of a header (the JSON bytes after the length) of
/// `file`: string keys to string values, empty when the header has none.
/// The canonical index keeps tensors only; what needs the metadata (an
/// adapter's, restored on export) keeps it itself.
pub fn header_metadata(
    file: &str,
    header: &[u8],
) -> Result<std::collections::BTreeMap<String, String>, FormatError> {
    #[derive(serde::Deserialize)]
    struct Only {
        #[serde(rename = "__metadata__", default)]
        metadata: Option<std::collections::BTreeMap<String, String>>,
    }
    let only: Only = serde_json::from_slice(header).map_err(|e| FormatError::MalformedHeader {
        file: file.into(),
        reason: format!("__metadata__: {e}"),
    })?;
    Ok(only.metadata.unwrap_or_default())
}

/// Merges the tensors of several files into one canonical index, returning
/// each index entry's location (same order as `index.tensors`).
pub fn merge(
    tensors: Vec<(TensorSpec, TensorLocation)>,
) -> Result<(CanonicalIndex, Vec<TensorLocation>), FormatError> {
    let mut locations: HashMap<String, TensorLocation> = HashMap::with_capacity(tensors.len());
    let mut specs = Vec::with_capacity(tensors.len());
    for (spec, loc) in tensors {
        if locations.insert(spec.name.clone(), loc).is_some() {
            return Err(IndexError::DuplicateTensor(spec.name).into());
        }
        specs.push(spec);
    }
    let index = CanonicalIndex::build(specs)?;
    let locs =
        index.tensors.iter().map(|t| locations.remove(&t.name).expect("every tensor located")).collect();
    Ok((index, locs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_checks_name_the_file() {
        assert!(matches!(header_len("f", &[1, 2], 2), Err(FormatError::Truncated { .. })));
        let e = header_len("w.safetensors", &1000u64.to_le_bytes(), 100).unwrap_err();
        assert!(e.to_string().contains("w.safetensors"), "{e}");
        assert!(matches!(e, FormatError::HeaderBeyondFile { header: 1000, len: 92, .. }));
        assert!(matches!(
            header_len("f", &u64::MAX.to_le_bytes(), 100),
            Err(FormatError::HeaderTooLarge { .. })
        ));
    }

    #[test]
    fn header_entries_are_validated() {
        let parse = |h: &str, len| parse_header("f", 0, h.as_bytes(), len);
        let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"x":"y"}}"#;
        let ok = parse(h, 8 + h.len() as u64 + 8).unwrap();
        assert_eq!(ok.len(), 1);
        assert_eq!(ok[0].1.start, 8 + h.len() as u64);
        assert!(matches!(parse(h, 8 + h.len() as u64 + 4), Err(FormatError::BadTensor { .. })));
        let unknown = r#"{"a":{"dtype":"F12","shape":[2],"data_offsets":[0,8]}}"#;
        assert!(matches!(parse(unknown, 1000), Err(FormatError::UnknownDtype { .. })));
        let wrong = r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
        assert!(matches!(parse(wrong, 1000), Err(FormatError::BadTensor { .. })));
        assert!(matches!(parse("[1,2]", 1000), Err(FormatError::MalformedHeader { .. })));
        assert!(matches!(parse("{\"a\":", 1000), Err(FormatError::MalformedHeader { .. })));
    }

    #[test]
    fn tensors_must_tile_the_data_section() {
        let check = |h: &str, data: u64| {
            let len = 8 + h.len() as u64 + data;
            let t = parse_header("w.safetensors", 0, h.as_bytes(), len).unwrap();
            check_contiguous("w.safetensors", h.len() as u64, len, &t)
        };
        let two = r#"{"b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]},"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#;
        check(two, 8).unwrap();
        let empty = r#"{"z":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#;
        check(empty, 4).unwrap();
        let e = check(two, 12).unwrap_err().to_string();
        assert!(e.contains("w.safetensors") && e.contains("after the last tensor"), "{e}");
        let hole = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#;
        let e = check(hole, 6).unwrap_err().to_string();
        assert!(e.contains("before tensor `a`"), "{e}");
        let overlap = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#;
        let e = check(overlap, 6).unwrap_err().to_string();
        assert!(e.contains("`b`") && e.contains("overlaps `a`"), "{e}");
    }
}
