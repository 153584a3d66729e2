//! Writing an artifact back out (`hangar store get`): a whole-file artifact
//! as the file it was imported from, a directory artifact (a model
//! directory, an adapter) as the directory it was imported from
//! ([`crate::directory`], [`crate::adapters`]), any other as a safetensors
//! file.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorInfo;

use crate::error::{io_err, StoreError};
use crate::index::{CanonicalIndex, IndexEntry};

/// Writes the artifact `index` whose canonical bytes are `data` into `dir`:
/// a whole file ([`CanonicalIndex::whole_file`]) under its own name, an
/// adapter or a model directory as its directory's files
/// ([`crate::adapters::write_files`], [`crate::directory::write_files`],
/// answering `dir`), any other artifact as `model.safetensors`
/// ([`write_safetensors`]). A file name that is not a plain name (a path,
/// `..`) is written as safetensors, never outside `dir`.
pub fn write_artifact(index: &CanonicalIndex, data: &[u8], dir: &Path) -> Result<PathBuf, StoreError> {
    if crate::adapters::carries_binding(index) {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        crate::adapters::write_files(index, data, dir, crate::directory::Durability::Synced)?;
        return Ok(dir.to_owned());
    }
    if crate::directory::carries_manifest(index) {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        crate::directory::write_files(index, data, dir, crate::directory::Durability::Synced)?;
        return Ok(dir.to_owned());
    }
    let Some(name) = index.whole_file().filter(|n| is_plain_file_name(n)) else {
        return write_safetensors(index, data, dir);
    };
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let path = dir.join(name);
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, &data[..index.data_len as usize]).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io_err(&tmp)(e)
    })?;
    std::fs::rename(&tmp, &path).map_err(io_err(&path))?;
    Ok(path)
}

/// Whether `name` is one plain file name — not empty, `.`, `..`, nor a
/// path — so that `dir.join(name)` stays directly inside `dir`.
pub fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty() && Path::new(name).file_name() == Some(name.as_ref())
}

/// Writes the tensors of `index` whose canonical bytes are `data` to
/// `<dir>/model.safetensors`. The file is written under a temporary name and
/// renamed, so a failed export leaves no partial file.
pub fn write_safetensors(index: &CanonicalIndex, data: &[u8], dir: &Path) -> Result<PathBuf, StoreError> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let path = dir.join("model.safetensors");
    let tmp = dir.join(format!(".model.safetensors.{}.tmp", std::process::id()));
    if let Err(e) = SafetensorsLayout::new(&index.tensors, BTreeMap::new()).write_file(data, &tmp) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, &path).map_err(io_err(&path))?;
    Ok(path)
}

/// A safetensors file of some tensors of an artifact, laid out as the
/// `safetensors` crate lays out what it serializes: tensors by descending
/// dtype, then by name, packed one after another; the header's JSON padded
/// with spaces to a multiple of 8 bytes. Unlike the crate's writer, the
/// header is the same bytes every time (`__metadata__` in key order), so
/// [`Self::file_len`] is known before anything is written.
#[derive(Debug, Clone)]
pub struct SafetensorsLayout<'a> {
    /// The length prefix and the padded JSON header.
    header: Vec<u8>,
    /// The tensors in the order their bytes follow the header.
    order: Vec<&'a IndexEntry>,
}

impl<'a> SafetensorsLayout<'a> {
    /// Lays out `tensors` with the header's `__metadata__` (omitted when
    /// empty).
    pub fn new(
        tensors: impl IntoIterator<Item = &'a IndexEntry>,
        metadata: BTreeMap<String, String>,
    ) -> Self {
        let mut order: Vec<&IndexEntry> = tensors.into_iter().collect();
        order.sort_by(|l, r| r.dtype.cmp(&l.dtype).then(l.name.cmp(&r.name)));
        let mut offset = 0usize;
        let infos: Vec<(&str, TensorInfo)> = order
            .iter()
            .map(|t| {
                let info = TensorInfo {
                    dtype: t.dtype,
                    shape: t.shape.iter().map(|&d| d as usize).collect(),
                    data_offsets: (offset, offset + t.len as usize),
                };
                offset += t.len as usize;
                (t.name.as_str(), info)
            })
            .collect();
        let mut json = serde_json::to_vec(&Header { metadata: &metadata, tensors: &infos })
            .expect("a header serializes");
        json.resize(json.len().next_multiple_of(8), b' ');
        let mut header = (json.len() as u64).to_le_bytes().to_vec();
        header.extend_from_slice(&json);
        SafetensorsLayout { header, order }
    }

    /// The file's length in bytes: header and tensors.
    pub fn file_len(&self) -> u64 {
        self.header.len() as u64 + self.order.iter().map(|t| t.len).sum::<u64>()
    }

    /// Writes the file's bytes to `out`, the tensors' bytes taken from the
    /// artifact's canonical `data`.
    pub fn write_to(&self, data: &[u8], out: &mut impl Write) -> std::io::Result<()> {
        out.write_all(&self.header)?;
        for t in &self.order {
            out.write_all(&data[t.offset as usize..(t.offset + t.len) as usize])?;
        }
        Ok(())
    }

    /// Writes the file to `path` (created or truncated) and returns it,
    /// written but not synced.
    pub fn write_file(&self, data: &[u8], path: &Path) -> Result<File, StoreError> {
        let mut out = BufWriter::with_capacity(1 << 20, File::create(path).map_err(io_err(path))?);
        self.write_to(data, &mut out).map_err(io_err(path))?;
        out.into_inner().map_err(|e| io_err(path)(e.into_error()))
    }
}

/// A safetensors header: `__metadata__` if any, then the tensors in the
/// order of their bytes.
struct Header<'h> {
    metadata: &'h BTreeMap<String, String>,
    tensors: &'h [(&'h str, TensorInfo)],
}

impl serde::Serialize for Header<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let with_metadata = !self.metadata.is_empty();
        let mut map = s.serialize_map(Some(self.tensors.len() + usize::from(with_metadata)))?;
        if with_metadata {
            map.serialize_entry("__metadata__", self.metadata)?;
        }
        for (name, info) in self.tensors {
            map.serialize_entry(name, info)?;
        }
        map.end()
    }
}
