//! The fallback source: safetensors files in a directory or object store.
//!
//! Read through the `object_store` crate, so a local directory
//! (`/srv/weights` or `file:///srv/weights`) and, with the crate's cloud
//! features, `s3://…` behave alike. An artifact is looked for in
//! `<prefix>/<id with ':' as '-'>/` and, when the caller resolved a key,
//! in `<prefix>/<name>/<tag>/`; every `*.safetensors` directly inside is
//! one part. Only headers and the needed byte ranges are fetched. The
//! candidate is accepted only if its canonical index hashes to the id, and
//! the loader verifies the data root before anything is confirmed.

use std::sync::Arc;

use object_store::path::Path as ObjPath;
use object_store::ObjectStore;

use crate::chunks::CHUNK_SIZE;
use crate::error::StoreError;
use crate::format::{self, TensorLocation};
use crate::id::{ArtifactId, StoreKey};
use crate::index::CanonicalIndex;

/// Largest single range request.
const RANGE: u64 = 8 << 20;

/// A configured fallback source.
#[derive(Debug, Clone)]
pub struct Fallback {
    store: Arc<dyn ObjectStore>,
    prefix: ObjPath,
    label: String,
}

/// An artifact found in the fallback source.
#[derive(Debug, Clone)]
pub struct FallbackArtifact {
    store: Arc<dyn ObjectStore>,
    label: String,
    files: Vec<ObjPath>,
    /// Its canonical index (hash already checked against the id).
    pub index: CanonicalIndex,
    locations: Vec<TensorLocation>,
}

impl Fallback {
    /// Opens `spec`: a URL (`file:///dir`, or other schemes the build of
    /// `object_store` supports) or a plain directory path.
    pub fn open(spec: &str) -> Result<Self, StoreError> {
        let err = |reason: String| StoreError::Source { source_name: format!("fallback {spec}"), reason };
        let (store, prefix): (Arc<dyn ObjectStore>, ObjPath) = if spec.contains("://") {
            let url = url::Url::parse(spec).map_err(|e| err(e.to_string()))?;
            let (s, p) = object_store::parse_url(&url).map_err(|e| err(e.to_string()))?;
            (Arc::from(s), p)
        } else {
            let fs = object_store::local::LocalFileSystem::new_with_prefix(spec)
                .map_err(|e| err(e.to_string()))?;
            (Arc::new(fs), ObjPath::default())
        };
        Ok(Fallback { store, prefix, label: spec.to_owned() })
    }

    /// Finds `id` under its id directory or its key's directory.
    pub async fn locate(
        &self,
        id: &ArtifactId,
        key: Option<&StoreKey>,
    ) -> Result<FallbackArtifact, StoreError> {
        let mut dirs = vec![self.prefix.child(id.file_name())];
        if let Some(k) = key {
            let mut p = self.prefix.clone();
            for seg in k.name().as_str().split('/') {
                p = p.child(seg);
            }
            dirs.push(p.child(k.tag()));
        }
        let mut why = Vec::new();
        for dir in dirs {
            match self.try_dir(&dir, id).await {
                Ok(Some(a)) => return Ok(a),
                Ok(None) => {}
                Err(e) => why.push(format!("{dir}: {e}")),
            }
        }
        if why.is_empty() {
            Err(StoreError::UnknownArtifact(*id))
        } else {
            Err(StoreError::Source {
                source_name: format!("fallback {}", self.label),
                reason: why.join("; "),
            })
        }
    }

    async fn try_dir(&self, dir: &ObjPath, id: &ArtifactId) -> Result<Option<FallbackArtifact>, StoreError> {
        let err =
            |reason: String| StoreError::Source { source_name: format!("fallback {}", self.label), reason };
        let listing = match self.store.list_with_delimiter(Some(dir)).await {
            Ok(l) => l,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(err(e.to_string())),
        };
        let mut objects: Vec<_> =
            listing.objects.into_iter().filter(|o| o.location.as_ref().ends_with(".safetensors")).collect();
        if objects.is_empty() {
            return Ok(None);
        }
        objects.sort_by(|a, b| a.location.cmp(&b.location));
        let mut tensors = Vec::new();
        for (i, o) in objects.iter().enumerate() {
            let name = o.location.to_string();
            if o.size < 8 {
                return Err(format::FormatError::Truncated { file: name, len: o.size }.into());
            }
            let first8 = self.store.get_range(&o.location, 0..8).await.map_err(|e| err(e.to_string()))?;
            let n = format::header_len(&name, &first8, o.size)?;
            let header = self.store.get_range(&o.location, 8..8 + n).await.map_err(|e| err(e.to_string()))?;
            tensors.extend(format::parse_header(&name, i, &header, o.size)?);
        }
        let (index, locations) = format::merge(tensors)?;
        let ArtifactId::Full { index: want, .. } = id else { return Ok(None) };
        if &index.digest() != want {
            return Err(err(format!("{dir} holds different tensors than {id}")));
        }
        Ok(Some(FallbackArtifact {
            store: self.store.clone(),
            label: self.label.clone(),
            files: objects.into_iter().map(|o| o.location).collect(),
            index,
            locations,
        }))
    }
}

impl FallbackArtifact {
    /// Fills canonical bytes from chunk `from_chunk` to the end into `dst`
    /// (the whole artifact's memory, zeroed), with range requests.
    pub async fn fill(&self, dst: &mut [u8], from_chunk: usize) -> Result<(), StoreError> {
        let start = from_chunk as u64 * CHUNK_SIZE;
        let mut runs = Vec::new();
        self.index.for_each_run(start, self.index.data_len, |t, toff, at, len| runs.push((t, toff, at, len)));
        for (t, toff, at, len) in runs {
            let loc = &self.locations[t];
            let mut done = 0;
            while done < len {
                let n = RANGE.min(len - done);
                let src = loc.start + toff + done;
                let bytes = self.store.get_range(&self.files[loc.file], src..src + n).await.map_err(|e| {
                    StoreError::Source {
                        source_name: format!("fallback {}", self.label),
                        reason: e.to_string(),
                    }
                })?;
                let d = (at + done) as usize;
                dst[d..d + n as usize].copy_from_slice(&bytes);
                done += n;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{model, write_files};
    use crate::BlobStore;

    #[test]
    fn finds_by_key_through_a_file_url_and_fills_exact_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let tensors = model(2 << 20, 2, 31);
        write_files(&dir.path().join("fb/org/m/v2"), &tensors, 2).unwrap();
        let files = write_files(&dir.path().join("src"), &tensors, 1).unwrap();
        let store = BlobStore::open(dir.path().join("root")).unwrap();
        let id = store.import_files(&files, &[]).unwrap().id;
        let want = store.open_artifact(&id).unwrap().map_verified().unwrap();

        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let fb = Fallback::open(&format!("file://{}", dir.path().join("fb").display())).unwrap();
        let key: StoreKey = "org/m:v2".parse().unwrap();
        let found = rt.block_on(fb.locate(&id, Some(&key))).unwrap();
        let mut mem = vec![0u8; found.index.data_len as usize];
        rt.block_on(found.fill(&mut mem, 1)).unwrap();
        assert_eq!(mem[CHUNK_SIZE as usize..], want[CHUNK_SIZE as usize..], "filled from chunk 1 on");
        assert!(mem[..CHUNK_SIZE as usize].iter().all(|&b| b == 0), "chunk 0 left alone");

        let other: StoreKey = "org/m:v9".parse().unwrap();
        assert!(matches!(rt.block_on(fb.locate(&id, Some(&other))), Err(StoreError::UnknownArtifact(_))));
        let wrong = ArtifactId::Full { index: [0; 32], data: [0; 32] };
        let err = rt.block_on(fb.locate(&wrong, Some(&key))).unwrap_err();
        assert!(err.to_string().contains("different tensors"), "{err}");
    }
}
