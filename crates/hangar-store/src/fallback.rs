//! The fallback source: weight files in a directory or object store.
//!
//! Read through the `object_store` crate, so a local directory
//! (`/srv/weights` or `file:///srv/weights`) and, with the crate's cloud
//! features, `s3://…` behave alike. An artifact is looked for in
//! `<prefix>/<id with ':' as '-'>/` and, when the caller resolved a key,
//! in `<prefix>/<name>/<tag>/`, among the files directly inside: every
//! `*.safetensors` is one part of a safetensors artifact, and any other
//! file (a GGUF) is a whole-file artifact by itself, under the file name
//! it was imported with (that name is part of its index, so of its id).
//! When the caller knows the artifact's index (the store kept it when the
//! disk budget dropped the bytes), exactly the files it names are used;
//! otherwise the candidates are tried in this order: all the safetensors
//! files, each other file alone, then everything together. Stray files
//! (a README, `config.json`) are thus ignored. Only headers and the
//! needed byte ranges are fetched. A candidate is accepted only if its
//! canonical index hashes to the id, and the loader verifies the data root
//! before anything is confirmed.

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

    /// Finds `id` under its id directory or its key's directory. `known`
    /// is its index when the caller has it: then only the files it names
    /// are read. Not finding it is a [`StoreError::Source`] naming every
    /// directory looked in.
    pub async fn locate(
        &self,
        id: &ArtifactId,
        key: Option<&StoreKey>,
        known: Option<&CanonicalIndex>,
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
        for dir in &dirs {
            match self.try_dir(dir, id, known).await {
                Ok(Some(a)) => return Ok(a),
                Ok(None) => why.push(format!("nothing in {dir}/")),
                Err(e) => why.push(format!("{dir}/: {e}")),
            }
        }
        Err(self.err(why.join(", ")))
    }

    /// The source as configured (`/srv/weights`, `file:///srv/weights`).
    pub fn label(&self) -> &str {
        &self.label
    }

    fn err(&self, reason: String) -> StoreError {
        StoreError::Source { source_name: format!("fallback {}", self.label), reason }
    }

    /// The artifact `id` among the files directly in `dir`: `None` when
    /// the directory holds no file.
    async fn try_dir(
        &self,
        dir: &ObjPath,
        id: &ArtifactId,
        known: Option<&CanonicalIndex>,
    ) -> Result<Option<FallbackArtifact>, StoreError> {
        let ArtifactId::Full { index: want, .. } = id else { return Ok(None) };
        let listing = match self.store.list_with_delimiter(Some(dir)).await {
            Ok(l) => l,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(self.err(e.to_string())),
        };
        let mut objects = listing.objects;
        if objects.is_empty() {
            return Ok(None);
        }
        objects.sort_by(|a, b| a.location.cmp(&b.location));
        let mut files = Vec::with_capacity(objects.len());
        for o in &objects {
            files.push(self.part(o).await?);
        }
        let candidates = candidates(&files, known);
        for chosen in &candidates {
            let tensors = chosen
                .iter()
                .enumerate()
                .flat_map(|(at, &f)| {
                    files[f]
                        .tensors
                        .iter()
                        .map(move |(spec, loc)| (spec.clone(), TensorLocation { file: at, ..*loc }))
                })
                .collect();
            // A set that does not even merge (a tensor twice) is not it.
            let Ok((index, locations)) = format::merge(tensors) else { continue };
            if &index.digest() == want {
                return Ok(Some(FallbackArtifact {
                    store: self.store.clone(),
                    label: self.label.clone(),
                    files: chosen.iter().map(|&f| objects[f].location.clone()).collect(),
                    index,
                    locations,
                }));
            }
        }
        let names: Vec<&str> = files.iter().map(|f| f.name.as_str()).collect();
        Err(self.err(format!("{dir}/ holds different tensors than {id} ({})", names.join(", "))))
    }

    /// What one file contributes: a safetensors file's tensors (from its
    /// header), or the file whole.
    async fn part(&self, o: &object_store::ObjectMeta) -> Result<Part, StoreError> {
        let name = o.location.filename().unwrap_or_default().to_owned();
        if !name.ends_with(".safetensors") {
            let (spec, loc) = format::whole_file(&name, 0, o.size);
            return Ok(Part { name, safetensors: false, tensors: vec![(spec, loc)] });
        }
        let path = o.location.to_string();
        if o.size < 8 {
            return Err(format::FormatError::Truncated { file: path, len: o.size }.into());
        }
        let first8 = self.store.get_range(&o.location, 0..8).await.map_err(|e| self.err(e.to_string()))?;
        let n = format::header_len(&path, &first8, o.size)?;
        let header =
            self.store.get_range(&o.location, 8..8 + n).await.map_err(|e| self.err(e.to_string()))?;
        let tensors = format::parse_header(&path, 0, &header, o.size)?;
        Ok(Part { name, safetensors: true, tensors })
    }
}

/// One file of a fallback directory as a possible part of an artifact.
#[derive(Debug)]
struct Part {
    /// Its file name.
    name: String,
    safetensors: bool,
    /// Its tensors, located in it (file number 0, renumbered per candidate).
    tensors: Vec<(crate::index::TensorSpec, TensorLocation)>,
}

/// The sets of files (indices into `files`) that may form the artifact, in
/// the order to try them. With its index known: the files all of whose
/// tensors it names. Otherwise: every safetensors file, each other file
/// alone, then all files.
fn candidates(files: &[Part], known: Option<&CanonicalIndex>) -> Vec<Vec<usize>> {
    let all: Vec<usize> = (0..files.len()).collect();
    if let Some(index) = known {
        let named = |p: &Part| p.tensors.iter().all(|(spec, _)| index.tensor(&spec.name).is_some());
        return vec![all.into_iter().filter(|&f| named(&files[f])).collect()];
    }
    let safetensors: Vec<usize> = all.iter().copied().filter(|&f| files[f].safetensors).collect();
    let mut out = Vec::new();
    if !safetensors.is_empty() {
        out.push(safetensors);
    }
    out.extend(all.iter().filter(|&&f| !files[f].safetensors).map(|&f| vec![f]));
    if out.len() > 1 {
        out.push(all);
    }
    out
}

impl FallbackArtifact {
    /// The source it was found in, as configured.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Fills canonical bytes from chunk `from_chunk` to the end into `dst`
    /// (the whole artifact's memory, zeroed), with range requests.
    pub async fn fill(&self, dst: &mut [u8], from_chunk: usize) -> Result<(), StoreError> {
        let start = from_chunk as u64 * CHUNK_SIZE;
        self.fill_range(&mut dst[start as usize..], start).await
    }

    /// Fills `dst` (zeroed) with the canonical bytes `start..start +
    /// dst.len()`, with range requests; padding is left as it is.
    pub async fn fill_range(&self, dst: &mut [u8], start: u64) -> Result<(), StoreError> {
        let end = start + dst.len() as u64;
        let mut runs = Vec::new();
        self.index.for_each_run(start, end, |t, toff, at, len| runs.push((t, toff, at, len)));
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
                let d = (at - start + done) as usize;
                dst[d..d + n as usize].copy_from_slice(&bytes);
                done += n;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

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
        let found = rt.block_on(fb.locate(&id, Some(&key), None)).unwrap();
        let mut mem = vec![0u8; found.index.data_len as usize];
        rt.block_on(found.fill(&mut mem, 1)).unwrap();
        assert_eq!(mem[CHUNK_SIZE as usize..], want[CHUNK_SIZE as usize..], "filled from chunk 1 on");
        assert!(mem[..CHUNK_SIZE as usize].iter().all(|&b| b == 0), "chunk 0 left alone");

        let other: StoreKey = "org/m:v9".parse().unwrap();
        let err = rt.block_on(fb.locate(&id, Some(&other), None)).unwrap_err().to_string();
        assert!(err.contains("nothing in") && err.contains("org/m/v9/"), "names where it looked: {err}");
        let wrong = ArtifactId::Full { index: [0; 32], data: [0; 32] };
        let err = rt.block_on(fb.locate(&wrong, Some(&key), None)).unwrap_err();
        assert!(err.to_string().contains("different tensors"), "{err}");
    }

    /// A whole file among strays (a README, a safetensors file of another
    /// model) is found with and without its index known.
    #[test]
    fn a_whole_file_is_found_among_other_files_by_its_name_and_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let kdir = dir.path().join("fb/org/g/v1");
        std::fs::create_dir_all(&kdir).unwrap();
        let mut gguf = vec![0u8; (CHUNK_SIZE + 4097) as usize];
        crate::synth::fill_random(&mut gguf, 5);
        std::fs::write(kdir.join("model.gguf"), &gguf).unwrap();
        std::fs::write(kdir.join("README.md"), b"a model card").unwrap();
        write_files(&kdir, &model(1 << 16, 1, 3), 1).unwrap();
        let src: PathBuf = dir.path().join("model.gguf");
        std::fs::write(&src, &gguf).unwrap();
        let store = BlobStore::open(dir.path().join("root")).unwrap();
        let id = store.import_files(&[src], &[]).unwrap().id;
        let index = store.known_index(&id).unwrap().unwrap();

        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let fb = Fallback::open(&dir.path().join("fb").display().to_string()).unwrap();
        let key: StoreKey = "org/g:v1".parse().unwrap();
        for known in [None, Some(&index)] {
            let found = rt.block_on(fb.locate(&id, Some(&key), known)).unwrap();
            assert_eq!(found.index, index);
            let mut mem = vec![0u8; index.data_len as usize];
            rt.block_on(found.fill(&mut mem, 0)).unwrap();
            assert_eq!(mem, gguf, "the file's bytes, unchanged");
        }
        // Under another name it is other content.
        std::fs::rename(kdir.join("model.gguf"), kdir.join("renamed.gguf")).unwrap();
        let err = rt.block_on(fb.locate(&id, Some(&key), Some(&index))).unwrap_err().to_string();
        assert!(err.contains("different tensors") && err.contains("renamed.gguf"), "{err}");
    }
}
