//! The local blob store: verified artifacts on disk under one root.
//!
//! ```text
//! <root>/artifacts/<id>/index.json   canonical index (its BLAKE3 is the id's first half)
//! <root>/artifacts/<id>/chunks       BLAKE3 of every 1 MiB chunk (root = id's second half)
//! <root>/artifacts/<id>/data         canonical data layout, padding zero (absent: bytes dropped)
//! <root>/artifacts/<id>/used         empty; its mtime is when the artifact was last used
//! <root>/keys.json                   {"name:tag": "hg1:…"}, rewritten atomically under keys.lock
//! <root>/adapters.json               {"BASE:ADAPTER": {"id", "bytes"}}, likewise (crate::adapters)
//! <root>/tmp/                        staging; an artifact appears by one rename of its directory
//! ```
//!
//! Invariants: an `artifacts/<id>` directory appears complete (staged in
//! `tmp/` and renamed) and is removed whole by renaming it back out first;
//! the one later change is [`BlobStore::drop_data`] (the disk budget),
//! which unlinks `data` alone. The artifact is then *known but not on
//! disk*: its names, index and chunk list stay, so its keys still resolve,
//! `ls` still lists it, and a fetch or import of the same content puts the
//! bytes back ([`Registration::commit`]). Keys are only ever changed by
//! imports, [`BlobStore::set_key`] and [`BlobStore::remove`] (adapters'
//! names by [`crate::adapters`]' import and remove, and by
//! [`BlobStore::remove`] of their artifact), never by the disk budget.
//! Directory names come only from parsed ids, never from user text; every
//! byte read back is checked against its chunk hash
//! ([`StoredArtifact::read_chunk`]) and a mismatch is an error, never data.
//!
//! Data is not fsynced at commit: a blob torn by a crash fails verification
//! on first read and is reported as corrupt (re-import it).

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use memmap2::{Mmap, MmapMut};

use crate::chunks::{self, chunk_count, chunk_range};
use crate::error::{io_err, StoreError};
use crate::format::{self, TensorLocation};
use crate::id::{ArtifactId, Digest, IdOrKey, StoreKey};
use crate::index::{CanonicalIndex, TensorSpec};
use crate::preflight::ServingPolicy;

thread_local! {
    /// One chunk of canonical data being assembled by an import thread.
    static CHUNK_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// An open blob store.
#[derive(Debug, Clone)]
pub struct BlobStore {
    root: PathBuf,
}

/// What a commit or import did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CommitReport {
    /// The artifact's id.
    pub id: ArtifactId,
    /// True when the store already held this content (nothing was written).
    pub existed: bool,
    /// Canonical data bytes.
    pub bytes: u64,
    /// Number of tensors.
    pub tensors: usize,
}

/// One line of `hangar store ls`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ArtifactSummary {
    /// Id.
    pub id: ArtifactId,
    /// Canonical data bytes.
    pub bytes: u64,
    /// Number of tensors.
    pub tensors: usize,
    /// Keys pointing at it.
    pub keys: Vec<StoreKey>,
    /// Whether its bytes are on disk; `false` when the disk budget dropped
    /// them (the next load fetches them again from a peer or the fallback).
    pub on_disk: bool,
    /// What it is: a LoRA adapter carries the adapter binding
    /// ([`crate::adapters`]), a model directory the directory manifest
    /// ([`crate::directory`]); anything else is `model` weights.
    pub kind: ArtifactKind,
    /// The adapter name pointing at it, for an adapter that has one (a
    /// name moved to newer content leaves the older artifact without).
    pub adapter: Option<hangar_core::AdapterRef>,
}

/// What an artifact holds, as `hangar store ls` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ArtifactKind {
    /// Model weights: safetensors tensors, or a whole file such as a GGUF.
    Model,
    /// A LoRA adapter directory bound to its base model
    /// ([`crate::adapters`]).
    Adapter,
    /// A model directory (`config.json`, tokenizer files, safetensors
    /// shards) kept as one directory artifact ([`crate::directory`]),
    /// handed to an engine as the directory it was.
    ModelDir,
}

impl ArtifactKind {
    /// The kind of the artifact whose canonical index is `index`.
    pub fn of(index: &CanonicalIndex) -> Self {
        match (crate::adapters::carries_binding(index), crate::directory::carries_manifest(index)) {
            (true, _) => ArtifactKind::Adapter,
            (false, true) => ArtifactKind::ModelDir,
            (false, false) => ArtifactKind::Model,
        }
    }

    /// `model`, `adapter` or `model-dir`.
    pub fn as_str(self) -> &'static str {
        match self {
            ArtifactKind::Model => "model",
            ArtifactKind::Adapter => "adapter",
            ArtifactKind::ModelDir => "model-dir",
        }
    }
}

impl BlobStore {
    /// Opens (creating if needed) the store under `root`.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self, StoreError> {
        let root = root.into();
        for d in [root.join("artifacts"), root.join("tmp")] {
            fs::create_dir_all(&d).map_err(io_err(&d))?;
        }
        Ok(BlobStore { root })
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn artifact_dir(&self, id: &ArtifactId) -> PathBuf {
        self.root.join("artifacts").join(id.file_name())
    }

    fn staging_dir(&self) -> Result<PathBuf, StoreError> {
        let tmp = self.root.join("tmp");
        let dir = tempdir_in(&tmp)?;
        Ok(dir)
    }

    /// Whether the store holds `id`'s bytes (without verifying them).
    pub fn contains(&self, id: &ArtifactId) -> bool {
        matches!(id, ArtifactId::Full { .. }) && self.artifact_dir(id).join("data").is_file()
    }

    /// Whether the store knows `id`: it holds its index, with or without
    /// its bytes (see [`BlobStore::drop_data`]).
    pub fn knows(&self, id: &ArtifactId) -> bool {
        matches!(id, ArtifactId::Full { .. }) && self.artifact_dir(id).join("index.json").is_file()
    }

    /// The canonical index of a known artifact, checked against its id
    /// (whether or not its bytes are on disk); `None` if it is not known.
    pub fn known_index(&self, id: &ArtifactId) -> Result<Option<CanonicalIndex>, StoreError> {
        let ArtifactId::Full { index: want, .. } = id else { return Ok(None) };
        let path = self.artifact_dir(id).join("index.json");
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err(&path)(e)),
        };
        let corrupt = |reason: String| StoreError::Corrupt { what: id.to_string(), reason };
        if blake3::hash(&bytes).as_bytes() != want {
            return Err(corrupt("index.json does not hash to the id".into()));
        }
        CanonicalIndex::from_bytes(&bytes).map(Some).map_err(|e| corrupt(e.to_string()))
    }

    /// Drops `id`'s bytes from disk and keeps everything else: its keys,
    /// index and chunk list (32 bytes per MiB). What the disk budget does:
    /// the artifact stays known, its keys still resolve, and the next load
    /// fetches the bytes again. One `unlink`, so a reader that already
    /// opened the data keeps reading it. Returns whether there were bytes
    /// to drop.
    pub fn drop_data(&self, id: &ArtifactId) -> Result<bool, StoreError> {
        if !self.contains(id) {
            return Ok(false);
        }
        let dir = self.artifact_dir(id);
        let data = dir.join("data");
        match fs::remove_file(&data) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(io_err(&data)(e)),
        }
        // Last use belongs to the bytes: restored bytes start afresh.
        let _ = fs::remove_file(dir.join("used"));
        Ok(true)
    }

    /// Brings the bytes on disk under `budget` by dropping the data of
    /// artifacts outside `referenced`, least recently used first
    /// ([`crate::disk_budget::over_budget`]); keys are never touched.
    /// Returns the artifacts whose bytes were dropped.
    pub fn enforce_disk_budget(
        &self,
        budget: u64,
        referenced: &std::collections::HashSet<ArtifactId>,
    ) -> Result<Vec<ArtifactId>, StoreError> {
        let entries: Vec<crate::disk_budget::DiskEntry> = self
            .usage()?
            .into_iter()
            .map(|(id, bytes, last_used_ms)| crate::disk_budget::DiskEntry {
                id,
                bytes,
                last_used_ms,
                referenced: referenced.contains(&id),
            })
            .collect();
        let doomed = crate::disk_budget::over_budget(&entries, budget);
        for id in &doomed {
            self.drop_data(id)?;
        }
        Ok(doomed)
    }

    /// Starts a streaming registration of tensors described by `specs`.
    pub fn register(&self, specs: Vec<TensorSpec>) -> Result<Registration, StoreError> {
        let index = CanonicalIndex::build(specs)?;
        Registration::new(self, index)
    }

    /// Imports files as one artifact and points `keys` at it: safetensors
    /// files tensor by tensor, any other file whole (one `file:NAME` tensor,
    /// [`format::FILE_TENSOR_PREFIX`]).
    ///
    /// The canonical data is assembled chunk by chunk on all cores: each
    /// thread `pread`s the tensor bytes of a chunk from the sources into a
    /// chunk buffer, hashes it while it is hot in cache and `pwrite`s it to
    /// the staged blob (no page faults on either side: faulting in a fresh
    /// ext4 file page by page cost more than the copy). Importing content
    /// the store already holds writes nothing and reports `existed`. On
    /// error nothing is visible.
    pub fn import_files(&self, files: &[PathBuf], keys: &[StoreKey]) -> Result<CommitReport, StoreError> {
        self.import_files_with(files, keys, &ServingPolicy::default())
    }

    /// [`BlobStore::import_files`] under a serving `policy`: the artifact
    /// passes the serving preflight ([`crate::preflight`]) before anything
    /// becomes visible — a strict policy also refuses one without a manifest.
    pub fn import_files_with(
        &self,
        files: &[PathBuf],
        keys: &[StoreKey],
        policy: &ServingPolicy,
    ) -> Result<CommitReport, StoreError> {
        let members: Vec<Member<'_>> = files
            .iter()
            .map(|path| match format::is_safetensors(path) {
                true => Member::Tensors(path),
                false => Member::Whole {
                    path,
                    name: path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
                },
            })
            .collect();
        self.import_members(&members, keys, policy)
    }

    /// Imports `members` as one artifact (see [`BlobStore::import_files`],
    /// which this generalizes to whole files under a name of the caller's
    /// choosing and to bytes held in memory).
    pub(crate) fn import_members(
        &self,
        members: &[Member<'_>],
        keys: &[StoreKey],
        policy: &ServingPolicy,
    ) -> Result<CommitReport, StoreError> {
        /// A member ready to be read from: an open file, or bytes.
        enum Opened<'a> {
            File(File, &'a Path),
            Bytes(&'a [u8]),
        }
        let mut opened = Vec::with_capacity(members.len());
        let mut tensors = Vec::new();
        for (i, member) in members.iter().enumerate() {
            let (path, whole_name) = match member {
                Member::Bytes { name, data } => {
                    tensors.push(format::whole_file(name, i, data.len() as u64));
                    opened.push(Opened::Bytes(data));
                    continue;
                }
                Member::Tensors(path) => (*path, None),
                Member::Whole { path, name } => (*path, Some(name.as_str())),
            };
            let file = File::open(path).map_err(io_err(path))?;
            let len = file.metadata().map_err(io_err(path))?.len();
            match whole_name {
                None => {
                    let header = read_header(&file, path, len)?;
                    tensors.extend(format::parse_header(&path.display().to_string(), i, &header, len)?);
                }
                Some(name) => tensors.push(format::whole_file(name, i, len)),
            }
            // Whole files are read front to back: ask for a larger readahead
            // window so cold files stream at the disk's speed. Advisory only.
            let _ = rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::Sequential);
            opened.push(Opened::File(file, path));
        }
        let (index, locations) = format::merge(tensors)?;
        let mut reg = Registration::new(self, index)?;
        reg.fill_parallel(|run, dst| {
            let loc: &TensorLocation = &locations[run.tensor];
            let at = loc.start + run.tensor_offset;
            match &opened[loc.file] {
                Opened::File(file, path) => file.read_exact_at(dst, at).map_err(io_err(path)),
                Opened::Bytes(bytes) => {
                    dst.copy_from_slice(&bytes[at as usize..at as usize + dst.len()]);
                    Ok(())
                }
            }
        })?;
        reg.commit_with(keys, policy)
    }

    /// Reads `keys.json`.
    pub fn keys(&self) -> Result<BTreeMap<StoreKey, ArtifactId>, StoreError> {
        let path = self.root.join("keys.json");
        match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| StoreError::Corrupt { what: path.display().to_string(), reason: e.to_string() }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(BTreeMap::new()),
            Err(e) => Err(io_err(&path)(e)),
        }
    }

    /// Runs `f` holding the exclusive `flock` on the store's names — the
    /// keys (`keys.json`) and the adapters' names (`adapters.json`) — so
    /// that a read-modify-write of either is never interleaved with
    /// another process's.
    pub(crate) fn with_names_locked<T>(&self, f: impl FnOnce() -> T) -> Result<T, StoreError> {
        let lock_path = self.root.join("keys.lock");
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io_err(&lock_path))?;
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive)
            .map_err(|e| io_err(&lock_path)(e.into()))?;
        Ok(f())
    }

    /// Replaces `<root>/<file_name>` by `bytes` atomically (written under
    /// `tmp/` and renamed). Call it holding [`Self::with_names_locked`].
    pub(crate) fn write_atomically(&self, file_name: &str, bytes: &[u8]) -> Result<(), StoreError> {
        let tmp = self.root.join("tmp").join(format!("{file_name}.{}", std::process::id()));
        fs::write(&tmp, bytes).map_err(io_err(&tmp))?;
        let path = self.root.join(file_name);
        fs::rename(&tmp, &path).map_err(io_err(&path))
    }

    /// Read-modify-writes `keys.json` under the names lock, atomically.
    fn update_keys<T>(
        &self,
        f: impl FnOnce(&mut BTreeMap<StoreKey, ArtifactId>) -> T,
    ) -> Result<T, StoreError> {
        self.with_names_locked(|| {
            let mut keys = self.keys()?;
            let out = f(&mut keys);
            self.write_atomically("keys.json", &serde_json::to_vec_pretty(&keys).expect("keys serialize"))?;
            Ok(out)
        })?
    }

    /// Points `key` at `id` (replacing what it pointed at).
    pub fn set_key(&self, key: &StoreKey, id: &ArtifactId) -> Result<(), StoreError> {
        self.update_keys(|k| k.insert(key.clone(), *id)).map(drop)
    }

    /// Resolves an id or key to an id whose bytes the store holds; a
    /// known artifact whose bytes were dropped is [`StoreError::NotOnDisk`].
    pub fn resolve(&self, what: &IdOrKey) -> Result<ArtifactId, StoreError> {
        let (id, key) = match what {
            IdOrKey::Id(id) => (*id, None),
            IdOrKey::Key(k) => {
                (*self.keys()?.get(k).ok_or_else(|| StoreError::UnknownKey(k.clone()))?, Some(k.clone()))
            }
        };
        if !self.contains(&id) {
            return Err(match self.knows(&id) {
                true => StoreError::NotOnDisk { id, key },
                false => StoreError::UnknownArtifact(id),
            });
        }
        Ok(id)
    }

    /// Opens a stored artifact, verifying its index and chunk list against its id.
    pub fn open_artifact(&self, id: &ArtifactId) -> Result<StoredArtifact, StoreError> {
        let (ArtifactId::Full { index: want_index, data: want_root }, true) = (id, self.contains(id)) else {
            return Err(StoreError::UnknownArtifact(*id));
        };
        let dir = self.artifact_dir(id);
        let corrupt = |reason: String| StoreError::Corrupt { what: id.to_string(), reason };
        let index_bytes = read_file(&dir.join("index.json"))?;
        if blake3::hash(&index_bytes).as_bytes() != want_index {
            return Err(corrupt("index.json does not hash to the id".into()));
        }
        let index = CanonicalIndex::from_bytes(&index_bytes).map_err(|e| corrupt(e.to_string()))?;
        let chunk_hashes = chunks::decode(&read_file(&dir.join("chunks"))?)
            .filter(|c| c.len() == chunk_count(index.data_len))
            .ok_or_else(|| corrupt("chunk list has the wrong length".into()))?;
        if &chunks::data_root(index.data_len, &chunk_hashes) != want_root {
            return Err(corrupt("chunk list does not hash to the id".into()));
        }
        let data_path = dir.join("data");
        let data = File::open(&data_path).map_err(io_err(&data_path))?;
        let len = data.metadata().map_err(io_err(&data_path))?.len();
        if len != index.data_len {
            return Err(corrupt(format!("data is {len} bytes, index says {}", index.data_len)));
        }
        Ok(StoredArtifact { id: *id, index, chunk_hashes, data, data_path })
    }

    /// The ids of the artifacts under `artifacts/`, known or on disk
    /// (entries whose names are not ids are not artifacts and are skipped).
    fn stored_ids(&self) -> Result<Vec<ArtifactId>, StoreError> {
        let dir = self.root.join("artifacts");
        let mut out = Vec::new();
        for entry in fs::read_dir(&dir).map_err(io_err(&dir))? {
            let entry = entry.map_err(io_err(&dir))?;
            if let Some(id) = entry.file_name().to_str().and_then(|n| n.replace('-', ":").parse().ok()) {
                out.push(id);
            }
        }
        Ok(out)
    }

    /// Records that `id` was used now (imported, loaded): the disk
    /// budget removes the least recently used first.
    pub fn mark_used(&self, id: &ArtifactId) -> Result<(), StoreError> {
        let path = self.artifact_dir(id).join("used");
        let file =
            File::options().create(true).truncate(false).write(true).open(&path).map_err(io_err(&path))?;
        file.set_modified(std::time::SystemTime::now()).map_err(io_err(&path))
    }

    /// Every artifact whose bytes are on disk: its bytes there and when it
    /// was last used (ms since the epoch; never marked: when it was
    /// stored). Known artifacts without their bytes are not listed.
    pub fn usage(&self) -> Result<Vec<(ArtifactId, u64, u64)>, StoreError> {
        let mut out = Vec::new();
        for id in self.stored_ids()? {
            if !self.contains(&id) {
                continue;
            }
            let path = self.artifact_dir(&id);
            let bytes = ["index.json", "chunks", "data"]
                .iter()
                .filter_map(|f| fs::metadata(path.join(f)).ok())
                .map(|m| m.len())
                .sum();
            let used = fs::metadata(path.join("used")).or_else(|_| fs::metadata(path.join("index.json")));
            let when = used.and_then(|m| m.modified()).map_err(io_err(&path))?;
            let ms = when.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
            out.push((id, bytes, ms));
        }
        Ok(out)
    }

    /// Every known artifact with its keys and whether its bytes are on
    /// disk, sorted by id.
    pub fn list(&self) -> Result<Vec<ArtifactSummary>, StoreError> {
        let keys = self.keys()?;
        let names = crate::adapters::read_names(self)?;
        let mut out = Vec::new();
        for id in self.stored_ids()? {
            let (index, on_disk) = match self.contains(&id) {
                true => (self.open_artifact(&id)?.index, true),
                false => match self.known_index(&id)? {
                    Some(index) => (index, false),
                    // Removed since it was listed.
                    None => continue,
                },
            };
            out.push(ArtifactSummary {
                id,
                bytes: index.data_len,
                tensors: index.tensors.len(),
                keys: keys.iter().filter(|(_, v)| **v == id).map(|(k, _)| k.clone()).collect(),
                on_disk,
                kind: ArtifactKind::of(&index),
                adapter: names.iter().find(|(_, r)| r.id == id).map(|(a, _)| a.clone()),
            });
        }
        out.sort_by_key(|a| a.id);
        Ok(out)
    }

    /// Removes a key, or an artifact and every name pointing at it (keys
    /// and an adapter's name). Removing the last name of an artifact — no
    /// key, no adapter name left — removes the artifact too (known or on
    /// disk). Returns the artifacts removed.
    pub fn remove(&self, what: &IdOrKey) -> Result<Vec<ArtifactId>, StoreError> {
        let doomed = self.with_names_locked(|| -> Result<Option<ArtifactId>, StoreError> {
            let mut keys = self.keys()?;
            let mut names = crate::adapters::read_names(self)?;
            let before = names.len();
            let doomed = match what {
                IdOrKey::Id(id) => {
                    keys.retain(|_, v| v != id);
                    names.retain(|_, r| r.id != *id);
                    Some(*id)
                }
                IdOrKey::Key(k) => {
                    let id = keys.remove(k).ok_or_else(|| StoreError::UnknownKey(k.clone()))?;
                    let named = keys.values().any(|v| *v == id) || names.values().any(|r| r.id == id);
                    (!named).then_some(id)
                }
            };
            self.write_atomically("keys.json", &serde_json::to_vec_pretty(&keys).expect("keys serialize"))?;
            if names.len() != before {
                crate::adapters::write_names(self, &names)?;
            }
            Ok(doomed)
        })??;
        let Some(id) = doomed else { return Ok(vec![]) };
        match (self.discard(&id)?, what) {
            (false, IdOrKey::Id(_)) => Err(StoreError::UnknownArtifact(id)),
            (false, IdOrKey::Key(_)) => Ok(vec![]),
            (true, _) => Ok(vec![id]),
        }
    }

    /// Removes the artifact `id`'s directory, atomically (renamed out
    /// first); its names are the caller's business. Returns whether the
    /// store knew it.
    pub(crate) fn discard(&self, id: &ArtifactId) -> Result<bool, StoreError> {
        if !self.knows(id) {
            return Ok(false);
        }
        let grave = self.staging_dir()?;
        let from = self.artifact_dir(id);
        fs::rename(&from, grave.join("x")).map_err(io_err(&from))?;
        fs::remove_dir_all(&grave).map_err(io_err(&grave))?;
        Ok(true)
    }
}

/// The JSON header of the safetensors `file` at `path`, of `len` bytes
/// (the bytes after the length prefix, checked against the file's length).
pub(crate) fn read_header(file: &File, path: &Path, len: u64) -> Result<Vec<u8>, StoreError> {
    let name = path.display().to_string();
    let mut first8 = [0u8; 8];
    if len < 8 {
        return Err(format::FormatError::Truncated { file: name, len }.into());
    }
    file.read_exact_at(&mut first8, 0).map_err(io_err(path))?;
    let mut header = vec![0u8; format::header_len(&name, &first8, len)? as usize];
    file.read_exact_at(&mut header, 8).map_err(io_err(path))?;
    Ok(header)
}

fn read_file(path: &Path) -> Result<Vec<u8>, StoreError> {
    let mut buf = Vec::new();
    File::open(path).and_then(|mut f| f.read_to_end(&mut buf)).map_err(io_err(path))?;
    Ok(buf)
}

/// Creates a fresh uniquely named directory under `parent`.
fn tempdir_in(parent: &Path) -> Result<PathBuf, StoreError> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    loop {
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let dir = parent.join(format!("{}.{n}", std::process::id()));
        match fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(io_err(&dir)(e)),
        }
    }
}

/// A stored artifact opened for reading; its index and chunk list are verified.
#[derive(Debug)]
pub struct StoredArtifact {
    /// Id.
    pub id: ArtifactId,
    /// Verified canonical index.
    pub index: CanonicalIndex,
    /// Verified chunk hashes.
    pub chunk_hashes: Vec<Digest>,
    data: File,
    data_path: PathBuf,
}

impl StoredArtifact {
    /// Checks that `bytes` are chunk `i`.
    pub fn verify_chunk(&self, i: usize, bytes: &[u8]) -> Result<(), StoreError> {
        if chunks::hash_chunk(bytes) != self.chunk_hashes[i] {
            return Err(StoreError::HashMismatch { id: self.id, chunk: i });
        }
        Ok(())
    }

    /// Reads chunk `i` into `dst` (exactly the chunk's length) and verifies it.
    pub fn read_chunk(&self, i: usize, dst: &mut [u8]) -> Result<(), StoreError> {
        let (start, _) = chunk_range(i, self.index.data_len);
        self.data.read_exact_at(dst, start).map_err(io_err(&self.data_path))?;
        self.verify_chunk(i, dst)
    }

    /// Tells the kernel the whole blob is about to be read front to back,
    /// so it reads ahead in larger windows. Advisory only.
    pub fn advise_sequential(&self) {
        let _ = rustix::fs::fadvise(&self.data, 0, None, rustix::fs::Advice::Sequential);
    }

    /// Maps the data read-only, unverified: check each chunk with
    /// [`Self::verify_chunk`] before using it.
    pub fn map_unverified(&self) -> Result<Mmap, StoreError> {
        // SAFETY: blobs are never modified in place (only renamed away).
        unsafe { Mmap::map(&self.data) }.map_err(io_err(&self.data_path))
    }

    /// Maps the data read-only and verifies every chunk on all cores; the
    /// first mismatch is returned and the map is not.
    pub fn map_verified(&self) -> Result<Mmap, StoreError> {
        let map = self.map_unverified()?;
        chunks::for_each_chunk_parallel(self.chunk_hashes.len(), |i| {
            let (a, b) = chunk_range(i, self.index.data_len);
            self.verify_chunk(i, &map[a as usize..b as usize])
        })?;
        Ok(map)
    }
}

/// One part of an import ([`BlobStore::import_members`]).
#[derive(Debug, Clone)]
pub(crate) enum Member<'a> {
    /// A safetensors file, imported tensor by tensor.
    Tensors(&'a Path),
    /// A file imported whole, as the tensor `file:<name>`.
    Whole {
        /// Where it is read from.
        path: &'a Path,
        /// The file name it is kept under.
        name: String,
    },
    /// Bytes imported whole, as the tensor `file:<name>`.
    Bytes {
        /// The file name they are kept under.
        name: &'a str,
        /// The bytes.
        data: &'a [u8],
    },
}

/// One run of tensor bytes inside a chunk being filled.
#[derive(Debug, Clone, Copy)]
pub struct Run {
    /// Index of the tensor in the canonical index.
    pub tensor: usize,
    /// Offset inside the tensor.
    pub tensor_offset: u64,
    /// Length.
    pub len: u64,
}

/// A streaming registration: `begin` ([`BlobStore::register`]), `feed`,
/// then `commit` or `abort`.
///
/// The data is staged in a file under `tmp/`; dropping a registration
/// without committing removes it, so a failed or abandoned producer leaves
/// nothing visible. Bytes are written through a map of the staged file.
#[derive(Debug)]
pub struct Registration {
    store: BlobStore,
    index: CanonicalIndex,
    dir: PathBuf,
    file: File,
    path: PathBuf,
    map: Option<MmapMut>,
    /// Bytes fed so far per tensor (feeds append).
    fed: Vec<u64>,
    hashes: Option<Vec<Digest>>,
}

impl Registration {
    fn new(store: &BlobStore, index: CanonicalIndex) -> Result<Self, StoreError> {
        if index.data_len == 0 {
            return Err(crate::index::IndexError::Empty.into());
        }
        let dir = store.staging_dir()?;
        let path = dir.join("data");
        let file =
            File::options().read(true).write(true).create_new(true).open(&path).map_err(io_err(&path))?;
        file.set_len(index.data_len).map_err(io_err(&path))?;
        let fed = vec![0; index.tensors.len()];
        Ok(Registration { store: store.clone(), index, dir, file, path, map: None, fed, hashes: None })
    }

    fn map_mut(&mut self) -> Result<&mut MmapMut, StoreError> {
        if self.map.is_none() {
            // SAFETY: the file is ours (fresh name in our staging directory)
            // and is only written through this registration until commit.
            let map = unsafe { MmapMut::map_mut(&self.file) }.map_err(io_err(&self.path))?;
            self.map = Some(map);
        }
        Ok(self.map.as_mut().expect("just created"))
    }

    /// The canonical index being registered.
    pub fn index(&self) -> &CanonicalIndex {
        &self.index
    }

    /// Appends `bytes` to tensor `name`. Tensors may be fed in any order and
    /// interleaved; the bytes of one tensor arrive in order.
    pub fn feed(&mut self, name: &str, bytes: &[u8]) -> Result<(), StoreError> {
        let i = self
            .index
            .tensors
            .binary_search_by(|t| t.name.as_bytes().cmp(name.as_bytes()))
            .map_err(|_| StoreError::UnknownTensor(name.to_owned()))?;
        let t = &self.index.tensors[i];
        let end = self.fed[i] + bytes.len() as u64;
        if end > t.len {
            return Err(StoreError::Overfeed { tensor: name.to_owned(), len: t.len, got: end });
        }
        let at = (t.offset + self.fed[i]) as usize;
        self.map_mut()?[at..at + bytes.len()].copy_from_slice(bytes);
        self.fed[i] = end;
        self.hashes = None;
        Ok(())
    }

    /// Assembles and hashes every chunk on all cores and `pwrite`s it to the
    /// staged file: `copy(run, dst)` writes the tensor bytes of `run` into
    /// a chunk buffer whose padding stays zero. Measured on ext4 in this VM,
    /// writing through a map of the fresh file faulted its pages in one by
    /// one and was about half as fast; `O_DIRECT` writes were disk-bound and
    /// slower still (1.3 GB/s against 2.9 GB/s from the page cache).
    fn fill_parallel(
        &mut self,
        copy: impl Fn(Run, &mut [u8]) -> Result<(), StoreError> + Sync,
    ) -> Result<(), StoreError> {
        let n = chunk_count(self.index.data_len);
        let hashes: Vec<std::sync::Mutex<Digest>> = (0..n).map(|_| std::sync::Mutex::new([0; 32])).collect();
        let (index, file, path) = (&self.index, &self.file, &self.path);
        chunks::for_each_chunk_parallel(n, |i| -> Result<(), StoreError> {
            let (base, end) = chunk_range(i, index.data_len);
            CHUNK_BUF.with_borrow_mut(|buf| {
                // Padding between tensors is zero in the canonical layout.
                buf.clear();
                buf.resize((end - base) as usize, 0);
                let mut result = Ok(());
                index.for_each_run(base, end, |tensor, tensor_offset, at, len| {
                    if result.is_ok() {
                        let d = &mut buf[(at - base) as usize..(at - base + len) as usize];
                        result = copy(Run { tensor, tensor_offset, len }, d);
                    }
                });
                result?;
                *hashes[i].lock().expect("not poisoned") = chunks::hash_chunk(buf);
                file.write_all_at(buf, base).map_err(io_err(path))
            })
        })?;
        self.fed = self.index.tensors.iter().map(|t| t.len).collect();
        self.hashes = Some(hashes.into_iter().map(|h| h.into_inner().expect("not poisoned")).collect());
        Ok(())
    }

    /// Verifies every tensor was fed completely, hashes, and makes the
    /// artifact visible (or reports that it `existed`); then points `keys` at it.
    /// A known artifact whose bytes the disk budget dropped gets them back
    /// (one rename of the staged data into its directory), reported as new.
    ///
    /// On error the staged data is removed and nothing becomes visible.
    pub fn commit(self, keys: &[StoreKey]) -> Result<CommitReport, StoreError> {
        self.commit_with(keys, &ServingPolicy::default())
    }

    /// [`Registration::commit`] under a serving `policy`: after hashing and
    /// before anything becomes visible (or `existed` is reported), the
    /// artifact passes the serving preflight ([`crate::preflight::check`]);
    /// a refusal is [`StoreError::Preflight`] and removes the staged data.
    pub fn commit_with(
        mut self,
        keys: &[StoreKey],
        policy: &ServingPolicy,
    ) -> Result<CommitReport, StoreError> {
        if let Some((t, fed)) = self.index.tensors.iter().zip(&self.fed).find(|(t, f)| **f != t.len) {
            return Err(StoreError::Incomplete { tensor: t.name.clone(), len: t.len, got: *fed });
        }
        let hashes = match self.hashes.take() {
            Some(h) => h,
            None => chunks::hash_chunks(self.map_mut()?),
        };
        let id = ArtifactId::Full {
            index: self.index.digest(),
            data: chunks::data_root(self.index.data_len, &hashes),
        };
        let manifest = match crate::preflight::manifest_range(&id, &self.index)? {
            Some((a, b)) => {
                let mut buf = vec![0u8; (b - a) as usize];
                self.file.read_exact_at(&mut buf, a).map_err(io_err(&self.path))?;
                Some(buf)
            }
            None => None,
        };
        crate::preflight::check(&id, &self.index, manifest.as_deref(), policy)?;
        let report = CommitReport {
            id,
            existed: self.store.contains(&id),
            bytes: self.index.data_len,
            tensors: self.index.tensors.len(),
        };
        let mut report = report;
        if !report.existed {
            for (name, bytes) in [("index.json", self.index.to_bytes()), ("chunks", chunks::encode(&hashes))]
            {
                let p = self.dir.join(name);
                File::create(&p).and_then(|mut f| f.write_all(&bytes)).map_err(io_err(&p))?;
            }
            let to = self.store.artifact_dir(&id);
            match fs::rename(&self.dir, &to) {
                Ok(()) => {}
                // Known without its bytes: restore them. The directory's
                // index and chunk list are this content's (same id).
                Err(e)
                    if e.raw_os_error() == Some(rustix::io::Errno::NOTEMPTY.raw_os_error())
                        && !self.store.contains(&id) =>
                {
                    let data = to.join("data");
                    fs::rename(&self.path, &data).map_err(io_err(&data))?;
                    self.store.mark_used(&id)?;
                }
                // Another importer committed the same content first.
                Err(e) if e.raw_os_error() == Some(rustix::io::Errno::NOTEMPTY.raw_os_error()) => {
                    report.existed = true;
                }
                Err(e) => return Err(io_err(&to)(e)),
            }
        }
        for k in keys {
            self.store.set_key(k, &id)?;
        }
        Ok(report)
    }

    /// Abandons the registration, removing the staged data.
    pub fn abort(self) {}
}

impl Drop for Registration {
    fn drop(&mut self) {
        // After a successful commit the directory was renamed away and this is a no-op.
        let _ = fs::remove_dir_all(&self.dir);
    }
}
