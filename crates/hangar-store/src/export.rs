//! Writing an artifact back out (`hangar store get`): a whole-file artifact
//! as the file it was imported from, any other as a safetensors file.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use safetensors::tensor::View;
use safetensors::Dtype;

use crate::error::{io_err, StoreError};
use crate::index::{CanonicalIndex, IndexEntry};

struct Borrowed<'a> {
    entry: &'a IndexEntry,
    shape: Vec<usize>,
    data: &'a [u8],
}

impl View for Borrowed<'_> {
    fn dtype(&self) -> Dtype {
        self.entry.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Writes the artifact `index` whose canonical bytes are `data` into `dir`:
/// a whole file ([`CanonicalIndex::whole_file`]) under its own name, any
/// other artifact as `model.safetensors` ([`write_safetensors`]). A file
/// name that is not a plain name (a path, `..`) is written as safetensors,
/// never outside `dir`.
pub fn write_artifact(index: &CanonicalIndex, data: &[u8], dir: &Path) -> Result<PathBuf, StoreError> {
    let plain = |name: &&str| !name.is_empty() && Path::new(name).file_name() == Some(name.as_ref());
    let Some(name) = index.whole_file().filter(plain) else {
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

/// Writes the tensors of `index` whose canonical bytes are `data` to
/// `<dir>/model.safetensors`. The file is written under a temporary name and
/// renamed, so a failed export leaves no partial file.
pub fn write_safetensors(index: &CanonicalIndex, data: &[u8], dir: &Path) -> Result<PathBuf, StoreError> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let views = index.tensors.iter().map(|t| {
        let data = &data[t.offset as usize..(t.offset + t.len) as usize];
        (t.name.as_str(), Borrowed { entry: t, shape: t.shape.iter().map(|&d| d as usize).collect(), data })
    });
    let path = dir.join("model.safetensors");
    let tmp = dir.join(format!(".model.safetensors.{}.tmp", std::process::id()));
    safetensors::serialize_to_file(views, None, &tmp).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        StoreError::Source { source_name: tmp.display().to_string(), reason: e.to_string() }
    })?;
    std::fs::rename(&tmp, &path).map_err(io_err(&path))?;
    Ok(path)
}
