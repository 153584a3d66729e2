//! Writing an artifact back out as a safetensors file (`hangar store get`).

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
