//! Directory artifacts: a directory of files kept as one artifact and
//! written back as the directory it was.
//!
//! Engines load directories: vLLM, SGLang and TGI a Hugging Face **model
//! directory** (`config.json`, tokenizer files, `*.safetensors` shards),
//! vLLM a LoRA adapter's PEFT directory ([`crate::adapters`], which builds
//! on this module). [`scan`] lists such a directory, refusing what an
//! engine could not load or what would escape it; the import makes it one
//! artifact of:
//!
//! - every `*.safetensors` file tensor by tensor, as the store imports any
//!   safetensors file (so its tensors are content-addressed, viewable and
//!   shared with other artifacts of the same tensors), after checking its
//!   header — length within the file, JSON, every tensor's offsets inside
//!   the data, the data tiled by the tensors with no hole nor overlap;
//! - every other file whole, under its name (`file:NAME`);
//! - the **directory manifest**, a reserved whole-file member
//!   [`MANIFEST_FILE`]: each file's name, length and BLAKE3, and for a
//!   safetensors file its header's bytes as they were.
//!
//! Writing the directory back ([`write_files`]) gives each safetensors
//! file its original header followed by its tensors' bytes in offset
//! order — the file byte for byte, padding and key order included, since
//! the tensors tile the data — and every file is hashed as it is written
//! and refused unless it hashes to what the manifest says. The manifest is
//! part of the content, so the artifact id covers the files' hashes.
//!
//! [`export`] writes a directory artifact at `under/<artifact id>/` through
//! a temporary directory renamed into place ([`publish`]): a directory at
//! that path is always complete, and of concurrent exports — threads or
//! processes — one rename wins and the others answer the same path.
//! [`prune_exports`] removes exports no longer wanted.
//!
//! A model directory ([`import_model_dir`], `hangar store import DIR`)
//! needs a `config.json` holding a JSON object, as every Hugging Face
//! model's does. It is flat, as engines read it: a subdirectory is refused
//! (copy the files an engine needs into a directory of their own).
//!
//! Every call here does blocking file I/O and hashes every byte: from
//! async code, run it on a blocking thread.
//!
//! ```
//! use hangar_store::{directory, synth, BlobStore};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let src = dir.path().join("tiny-llama");
//! synth::synth_model_dir(&src, 64, 2, 2, 7).unwrap();
//! let store = BlobStore::open(dir.path().join("store")).unwrap();
//!
//! let imported = directory::import_model_dir(&store, &src, &["tiny/llama:v1".parse().unwrap()]).unwrap();
//! let out = directory::export(&store, &imported.id, &dir.path().join("exports")).unwrap();
//! for f in &imported.files {
//!     assert_eq!(std::fs::read(out.join(f)).unwrap(), std::fs::read(src.join(f)).unwrap());
//! }
//! ```

use std::fs;
use std::io::Write;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::blob::{BlobStore, Member};
use crate::error::{io_err, StoreError};
use crate::export::is_plain_file_name;
use crate::format::{self, FILE_TENSOR_PREFIX};
use crate::id::{ArtifactId, StoreKey};
use crate::index::CanonicalIndex;
use crate::preflight::ServingPolicy;

/// The reserved member that lists a directory artifact's files.
pub const MANIFEST_FILE: &str = "__hangar_directory__.json";

/// The manifest's tensor in the canonical index ([`FILE_TENSOR_PREFIX`] +
/// [`MANIFEST_FILE`]); an artifact carrying it is a directory artifact.
pub const MANIFEST_TENSOR: &str = "file:__hangar_directory__.json";

/// File names starting with this are reserved for the store's own members
/// (the manifest, an adapter's binding); a directory may not hold one.
pub const RESERVED_PREFIX: &str = "__hangar_";

/// The file every model directory holds: the model's configuration.
pub const MODEL_CONFIG_FILE: &str = "config.json";

/// The manifest's version; part of the hashed bytes.
const MANIFEST_VERSION: u32 = 1;

/// What the manifest member says: the directory's files in name order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Manifest {
    version: u32,
    files: Vec<FileRecord>,
}

/// One file of a directory artifact, as its manifest records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRecord {
    /// Its name in the directory.
    pub name: String,
    /// Its length in bytes.
    pub bytes: u64,
    /// BLAKE3 of its bytes, hex.
    pub blake3: String,
    /// For a safetensors file, its header's JSON bytes as they were
    /// (padding included; the 8-byte length before them is their length).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
}

/// Whether the artifact of `index` is a directory artifact (carries the
/// manifest).
pub fn carries_manifest(index: &CanonicalIndex) -> bool {
    index.tensor(MANIFEST_TENSOR).is_some()
}

/// The files of the directory artifact `index` whose canonical bytes are
/// `data`, as its manifest lists them.
pub fn files(index: &CanonicalIndex, data: &[u8]) -> Result<Vec<FileRecord>, String> {
    let t = index.tensor(MANIFEST_TENSOR).ok_or_else(|| format!("carries no {MANIFEST_FILE}"))?;
    let bytes = &data[t.offset as usize..(t.offset + t.len) as usize];
    let manifest: Manifest =
        serde_json::from_slice(bytes).map_err(|e| format!("has an unreadable {MANIFEST_FILE}: {e}"))?;
    if manifest.version != MANIFEST_VERSION {
        return Err(format!("has a {MANIFEST_FILE} of version {}, not {MANIFEST_VERSION}", manifest.version));
    }
    Ok(manifest.files)
}

/// The entries of a directory to import.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scanned {
    /// `(name, path)` of each regular file (or link to one inside), by name.
    pub files: Vec<(String, PathBuf)>,
    /// Hidden entries (names starting with `.`: `.gitattributes`, the
    /// `.cache/` directory `huggingface-cli download --local-dir` leaves)
    /// left out.
    pub skipped: Vec<String>,
}

impl Scanned {
    /// The path of the file called `name`, if the directory holds one.
    pub fn find(&self, name: &str) -> Option<&Path> {
        self.files.iter().find(|(n, _)| n == name).map(|(_, p)| p.as_path())
    }
}

/// Why a directory cannot be imported as it is. Nothing was stored.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ScanError {
    /// A file-system operation failed (the directory or a file is missing,
    /// unreadable, a symbolic link is broken).
    #[error("{}: {source}", path.display())]
    Io {
        /// The path operated on.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The path is not a directory.
    #[error("{} is not a directory; give the directory that holds the files", path.display())]
    NotADirectory {
        /// The path given.
        path: PathBuf,
    },
    /// A symbolic link points outside the directory.
    #[error(
        "{} is a symbolic link to {}, outside {}; a directory is imported from the files it \
         holds: copy them in (`cp -L`, or `huggingface-cli download --local-dir`)",
        path.display(), target.display(), dir.display()
    )]
    SymlinkEscapes {
        /// The link.
        path: PathBuf,
        /// Where it resolves to.
        target: PathBuf,
        /// The directory imported.
        dir: PathBuf,
    },
    /// An entry is neither a regular file nor a directory.
    #[error("{} is a {kind}, not a regular file", path.display())]
    NotRegular {
        /// The entry.
        path: PathBuf,
        /// What it is.
        kind: &'static str,
    },
    /// A subdirectory: the directories engines load are flat.
    #[error(
        "{} is a directory; the directory imported is flat, as engines read it (config and \
         weights files, tokenizer files): put those in a directory of their own",
        path.display()
    )]
    Nested {
        /// The subdirectory.
        path: PathBuf,
    },
    /// A file under a reserved name.
    #[error("{}: the name is reserved: names starting with {RESERVED_PREFIX} are the store's own members", path.display())]
    Reserved {
        /// The file.
        path: PathBuf,
    },
    /// A file name that is not UTF-8 (names become tensor names).
    #[error("{}: the file name is not UTF-8", path.display())]
    NotUtf8 {
        /// The file.
        path: PathBuf,
    },
}

/// Lists `dir` for an import: its regular files (a symbolic link to one
/// inside `dir` under the link's name) by name, hidden entries skipped;
/// refuses a subdirectory, a special file, a link leading outside `dir`, a
/// reserved name, a name that is not UTF-8.
pub fn scan(dir: &Path) -> Result<Scanned, ScanError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| ScanError::Io { path, source }
    };
    if !fs::metadata(dir).map_err(io(dir))?.is_dir() {
        return Err(ScanError::NotADirectory { path: dir.to_owned() });
    }
    let real_dir = fs::canonicalize(dir).map_err(io(dir))?;
    let mut entries = Vec::new();
    for entry in fs::read_dir(dir).map_err(io(dir))? {
        let entry = entry.map_err(io(dir))?;
        entries.push((entry.file_name(), entry.path()));
    }
    entries.sort();
    let mut scanned = Scanned { files: Vec::new(), skipped: Vec::new() };
    for (name, path) in entries {
        let Ok(name) = name.into_string() else { return Err(ScanError::NotUtf8 { path }) };
        if name.starts_with('.') {
            scanned.skipped.push(name);
            continue;
        }
        let mut meta = fs::symlink_metadata(&path).map_err(io(&path))?;
        if meta.file_type().is_symlink() {
            let target = fs::canonicalize(&path).map_err(io(&path))?;
            if !target.starts_with(&real_dir) {
                return Err(ScanError::SymlinkEscapes { path, target, dir: dir.to_owned() });
            }
            meta = fs::metadata(&target).map_err(io(&path))?;
        }
        let kind = meta.file_type();
        if kind.is_dir() {
            return Err(ScanError::Nested { path });
        }
        if !kind.is_file() {
            let kind = match () {
                _ if kind.is_fifo() => "named pipe",
                _ if kind.is_socket() => "socket",
                _ if kind.is_block_device() => "block device",
                _ if kind.is_char_device() => "character device",
                _ => "special file",
            };
            return Err(ScanError::NotRegular { path, kind });
        }
        if name.starts_with(RESERVED_PREFIX) {
            return Err(ScanError::Reserved { path });
        }
        scanned.files.push((name, path));
    }
    Ok(scanned)
}

/// A scanned directory made ready to import: its manifest's bytes. Every
/// safetensors file's header was checked (an error names the file and
/// what is wrong) and every file hashed.
#[derive(Debug)]
pub(crate) struct Prepared<'a> {
    scanned: &'a Scanned,
    manifest: Vec<u8>,
    /// The bytes of the files, as written back.
    pub(crate) bytes: u64,
}

impl<'a> Prepared<'a> {
    /// Reads the headers of `scanned`'s safetensors files and hashes every
    /// file (files hashed in parallel, on all cores).
    pub(crate) fn new(scanned: &'a Scanned) -> Result<Self, StoreError> {
        let records = parallel_map(&scanned.files, |(name, path)| record(name, path))?;
        let bytes = records.iter().map(|r| r.bytes).sum();
        let manifest = Manifest { version: MANIFEST_VERSION, files: records };
        let manifest = serde_json::to_vec(&manifest).expect("a manifest serializes");
        Ok(Prepared { scanned, manifest, bytes })
    }

    /// The members of the import: safetensors files tensor by tensor,
    /// other files whole, and the manifest.
    pub(crate) fn members(&self) -> Vec<Member<'_>> {
        let mut members: Vec<Member<'_>> = self
            .scanned
            .files
            .iter()
            .map(|(name, path)| match is_safetensors_name(name) {
                true => Member::Tensors(path),
                false => Member::Whole { path, name: name.clone() },
            })
            .collect();
        members.push(Member::Bytes { name: MANIFEST_FILE, data: &self.manifest });
        members
    }
}

/// Whether a file called `name` is imported tensor by tensor.
fn is_safetensors_name(name: &str) -> bool {
    name.ends_with(".safetensors")
}

/// The manifest's record of the file `name` at `path`: its length and
/// hash, and for a safetensors file its header, checked.
fn record(name: &str, path: &Path) -> Result<FileRecord, StoreError> {
    let file = fs::File::open(path).map_err(io_err(path))?;
    let len = file.metadata().map_err(io_err(path))?.len();
    let header = match is_safetensors_name(name) {
        false => None,
        true => {
            let shown = path.display().to_string();
            let header = crate::blob::read_header(&file, path, len)?;
            let tensors = format::parse_header(&shown, 0, &header, len)?;
            format::check_contiguous(&shown, header.len() as u64, len, &tensors)?;
            let text = String::from_utf8(header).map_err(|e| format::FormatError::MalformedHeader {
                file: shown,
                reason: format!("not UTF-8: {e}"),
            })?;
            Some(text)
        }
    };
    let mut hasher = blake3::Hasher::new();
    if len > 0 {
        // SAFETY: read-only map of a file we only read; a file changed
        // under the import gives a hash its bytes fail on export.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err(path))?;
        hasher.update(&map);
    }
    Ok(FileRecord {
        name: name.to_owned(),
        bytes: len,
        blake3: hasher.finalize().to_hex().to_string(),
        header,
    })
}

/// `f` of every item, on up to as many threads as cores, in order.
fn parallel_map<T: Sync, R: Send>(
    items: &[T],
    f: impl Fn(&T) -> Result<R, StoreError> + Sync,
) -> Result<Vec<R>, StoreError> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(items.len()).max(1);
    let next = AtomicUsize::new(0);
    let out: Vec<Mutex<Option<Result<R, StoreError>>>> = items.iter().map(|_| Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(item) = items.get(i) else { break };
                *out[i].lock().expect("not poisoned") = Some(f(item));
            });
        }
    });
    out.into_iter().map(|r| r.into_inner().expect("not poisoned").expect("every item mapped")).collect()
}

/// Whether [`write_files`] syncs each file it writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Each file synced before the directory is published: for a
    /// directory that is trusted when found on disk after a crash (an
    /// export: [`publish`] answers a finished one as it is).
    Synced,
    /// Left to the page cache: for a directory whose writer never trusts
    /// one it did not write in this run (a fleet node's adapter and model
    /// directories, written again after a restart), where a sync would
    /// only add the disk's flush to a load (40 ms for 67 MB here).
    Cached,
}

/// Writes the files of the directory artifact `index`, whose canonical
/// bytes are `data` (verified by the caller), into the existing directory
/// `dir`, each synced if `durability` says so: whole files as they were,
/// safetensors files as their header and their tensors' bytes in offset
/// order. Each file is hashed as it is written; one whose bytes do not hash
/// to what the manifest says is an error ([`StoreError::Corrupt`]).
/// Returns the paths written, by name.
pub fn write_files(
    index: &CanonicalIndex,
    data: &[u8],
    dir: &Path,
    durability: Durability,
) -> Result<Vec<PathBuf>, StoreError> {
    let corrupt = |reason: String| StoreError::Corrupt { what: dir.display().to_string(), reason };
    let records = files(index, data).map_err(|e| corrupt(format!("the artifact {e}")))?;
    let tensor = |name: &str| -> Result<&[u8], StoreError> {
        let t = index
            .tensor(name)
            .ok_or_else(|| corrupt(format!("the artifact lists `{name}` but does not hold it")))?;
        Ok(&data[t.offset as usize..(t.offset + t.len) as usize])
    };
    let mut written = Vec::with_capacity(records.len());
    for r in &records {
        if !is_plain_file_name(&r.name) || r.name.starts_with(RESERVED_PREFIX) {
            return Err(corrupt(format!(
                "the artifact holds a file named `{}`, which a directory may not",
                r.name
            )));
        }
        let path = dir.join(&r.name);
        let file = fs::File::create(&path).map_err(io_err(&path))?;
        let mut out = HashingWriter::new(std::io::BufWriter::with_capacity(1 << 20, file));
        match &r.header {
            None => {
                out.write_all(tensor(&format!("{FILE_TENSOR_PREFIX}{}", r.name))?).map_err(io_err(&path))?
            }
            Some(header) => {
                let mut tensors = format::parse_header(&r.name, 0, header.as_bytes(), r.bytes)
                    .map_err(|e| corrupt(format!("the artifact's header of {}: {e}", r.name)))?;
                tensors.sort_by_key(|(_, loc)| loc.start);
                out.write_all(&(header.len() as u64).to_le_bytes()).map_err(io_err(&path))?;
                out.write_all(header.as_bytes()).map_err(io_err(&path))?;
                for (spec, _) in &tensors {
                    out.write_all(tensor(&spec.name)?).map_err(io_err(&path))?;
                }
            }
        }
        let (file, len, hash) = out.finish().map_err(io_err(&path))?;
        if len != r.bytes || hash.to_hex().as_str() != r.blake3 {
            return Err(corrupt(format!(
                "{} written back is {len} bytes of BLAKE3 {}, but the file imported was {} bytes of BLAKE3 {}",
                r.name,
                hash.to_hex(),
                r.bytes,
                r.blake3
            )));
        }
        if durability == Durability::Synced {
            file.sync_data().map_err(io_err(&path))?;
        }
        written.push(path);
    }
    Ok(written)
}

/// A writer that hashes and counts what goes through it.
struct HashingWriter {
    inner: std::io::BufWriter<fs::File>,
    hasher: blake3::Hasher,
    len: u64,
}

impl HashingWriter {
    fn new(inner: std::io::BufWriter<fs::File>) -> Self {
        HashingWriter { inner, hasher: blake3::Hasher::new(), len: 0 }
    }

    fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.hasher.update(bytes);
        self.len += bytes.len() as u64;
        self.inner.write_all(bytes)
    }

    /// The file, flushed; the bytes written and their hash.
    fn finish(self) -> std::io::Result<(fs::File, u64, blake3::Hash)> {
        let file = self.inner.into_inner().map_err(|e| e.into_error())?;
        Ok((file, self.len, self.hasher.finalize()))
    }
}

/// What [`import_model_dir`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ImportReport {
    /// The artifact.
    pub id: ArtifactId,
    /// The store already held it: the same files.
    pub existed: bool,
    /// The bytes of its files.
    pub bytes: u64,
    /// Tensors of its safetensors files.
    pub tensors: usize,
    /// The files imported, by name.
    pub files: Vec<String>,
    /// Hidden entries left out.
    pub skipped: Vec<String>,
}

/// Why a model directory was not imported. Nothing was stored.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImportError {
    /// The directory holds what may not be imported.
    #[error(transparent)]
    Scan(#[from] ScanError),
    /// No `config.json`.
    #[error(
        "{} has no {MODEL_CONFIG_FILE}; a model directory holds {MODEL_CONFIG_FILE}, its weights \
         (*.safetensors) and tokenizer files, as `huggingface-cli download MODEL --local-dir DIR` \
         writes them",
        dir.display()
    )]
    NoConfig {
        /// The directory.
        dir: PathBuf,
    },
    /// `config.json` is not a JSON object.
    #[error("{}: not a JSON object: {reason}", path.display())]
    ConfigNotJson {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        reason: String,
    },
    /// The store refused a file (a malformed safetensors file, named with
    /// what is wrong) or could not write the artifact.
    #[error("importing the model directory {}: {source}", dir.display())]
    Store {
        /// The directory.
        dir: PathBuf,
        /// What the store said.
        source: Box<StoreError>,
    },
}

/// Checks that the file at `path` holds a JSON object; what is wrong
/// otherwise.
pub(crate) fn json_object(path: &Path) -> Result<serde_json::Map<String, serde_json::Value>, ConfigError> {
    let bytes = fs::read(path).map_err(|source| ConfigError::Io { path: path.to_owned(), source })?;
    let not_json = |reason: String| ConfigError::NotJson { path: path.to_owned(), reason };
    match serde_json::from_slice(&bytes).map_err(|e| not_json(e.to_string()))? {
        serde_json::Value::Object(map) => Ok(map),
        other => Err(not_json(format!("found {}", json_kind(&other)))),
    }
}

/// Why a configuration file was refused ([`json_object`]).
#[derive(Debug)]
pub(crate) enum ConfigError {
    Io { path: PathBuf, source: std::io::Error },
    NotJson { path: PathBuf, reason: String },
}

/// What a JSON value is, for messages.
pub(crate) fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// Imports the model directory `dir` as one directory artifact and points
/// `keys` at it (see the module documentation).
///
/// Idempotent: the same files are the same artifact, reported `existed`.
/// Hidden entries are skipped; subdirectories, special files and symbolic
/// links leading outside `dir` are refused, and so is a malformed
/// safetensors file, by name. On error nothing is visible.
pub fn import_model_dir(
    store: &BlobStore,
    dir: &Path,
    keys: &[StoreKey],
) -> Result<ImportReport, ImportError> {
    let scanned = scan(dir)?;
    let config =
        scanned.find(MODEL_CONFIG_FILE).ok_or_else(|| ImportError::NoConfig { dir: dir.to_owned() })?;
    json_object(config).map_err(|e| match e {
        ConfigError::Io { path, source } => ImportError::Scan(ScanError::Io { path, source }),
        ConfigError::NotJson { path, reason } => ImportError::ConfigNotJson { path, reason },
    })?;
    let store_err = |source: StoreError| ImportError::Store { dir: dir.to_owned(), source: Box::new(source) };
    let prepared = Prepared::new(&scanned).map_err(store_err)?;
    let committed =
        store.import_members(&prepared.members(), keys, &ServingPolicy::default()).map_err(store_err)?;
    Ok(ImportReport {
        id: committed.id,
        existed: committed.existed,
        bytes: prepared.bytes,
        // Every member but the whole files and the manifest.
        tensors: committed.tensors
            - scanned.files.iter().filter(|(n, _)| !is_safetensors_name(n)).count()
            - 1,
        files: scanned.files.into_iter().map(|(n, _)| n).collect(),
        skipped: scanned.skipped,
    })
}

/// Why a directory artifact could not be exported. Nothing was left at
/// the target path (a temporary directory may be, after a crash:
/// `under/.hg1-…tmp`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExportError {
    /// The store does not know the artifact.
    #[error("artifact {id} is not in this store")]
    Unknown {
        /// The artifact.
        id: ArtifactId,
    },
    /// The disk budget dropped the artifact's bytes.
    #[error(
        "the bytes of artifact {id} are not on this node's disk (the disk budget dropped them); \
         import its directory again, or load {id} through the store daemon, which fetches it \
         from a peer"
    )]
    NotOnDisk {
        /// The artifact.
        id: ArtifactId,
    },
    /// The artifact is not what was asked for (not a directory artifact,
    /// or not the one the caller's check wants).
    #[error("artifact {id} {what}")]
    NotThis {
        /// The artifact.
        id: ArtifactId,
        /// What it is instead.
        what: String,
    },
    /// Reading the artifact failed: corrupt, a chunk that does not match
    /// its hash (never written out).
    #[error("reading artifact {id}: {source}")]
    Read {
        /// The artifact.
        id: ArtifactId,
        /// What the store said.
        source: Box<StoreError>,
    },
    /// Writing the directory failed, or a file written back did not hash
    /// to its record.
    #[error("exporting under {}: {source}", under.display())]
    Write {
        /// The directory exported under.
        under: PathBuf,
        /// What failed, naming the file.
        source: Box<StoreError>,
    },
}

/// Writes the model directory `id` at `under/<artifact id>/` (the id with
/// `:` as `-`) and returns that path; see [`export_with`].
pub fn export(store: &BlobStore, id: &ArtifactId, under: &Path) -> Result<PathBuf, ExportError> {
    export_with(store, id, under, MODEL_CONFIG_FILE, model_dir_check, |index, data, dir| {
        write_files(index, data, dir, Durability::Synced)
    })
}

/// Whether the artifact `index` is a model directory; what it is otherwise.
pub fn model_dir_check(index: &CanonicalIndex, _data: &[u8]) -> Result<(), String> {
    match (carries_manifest(index), crate::adapters::carries_binding(index)) {
        (true, false) => Ok(()),
        (_, true) => Err("is a LoRA adapter, not a model directory".into()),
        (false, false) => {
            Err("is not a model directory (no directory manifest): it was imported from files".into())
        }
    }
}

/// Writes the directory artifact `id` at `under/<artifact id>/` and
/// returns that path.
///
/// Every byte is verified against its chunk hash before anything is
/// written; `check` may refuse the artifact first (what it is not), and
/// `write` writes its files into a directory (for a directory artifact,
/// [`write_files`], which checks every file's hash). The directory
/// appears complete ([`publish`]): one holding `marker` already there is
/// reused as it is, one export per artifact per `under`. Marks the
/// artifact used for the disk budget.
pub fn export_with(
    store: &BlobStore,
    id: &ArtifactId,
    under: &Path,
    marker: &str,
    check: impl FnOnce(&CanonicalIndex, &[u8]) -> Result<(), String>,
    write: impl FnOnce(&CanonicalIndex, &[u8], &Path) -> Result<Vec<PathBuf>, StoreError>,
) -> Result<PathBuf, ExportError> {
    let id = *id;
    let target = under.join(id.file_name());
    if target.join(marker).is_file() {
        return Ok(target);
    }
    if !store.contains(&id) {
        return Err(match store.knows(&id) {
            true => ExportError::NotOnDisk { id },
            false => ExportError::Unknown { id },
        });
    }
    let read = |source| ExportError::Read { id, source: Box::new(source) };
    let art = store.open_artifact(&id).map_err(read)?;
    let data = art.map_verified().map_err(read)?;
    check(&art.index, &data).map_err(|what| ExportError::NotThis { id, what })?;
    let path = publish(under, &id, marker, |dir| write(&art.index, &data, dir).map(drop))
        .map_err(|source| ExportError::Write { under: under.to_owned(), source: Box::new(source) })?;
    // Bookkeeping for the disk budget's least recently used order; an
    // export that succeeded is not failed for it.
    if let Err(e) = store.mark_used(&id) {
        tracing::debug!(%id, error = %e, "could not mark an exported directory used");
    }
    Ok(path)
}

/// Makes the directory `under/<id>/` by `fill`ing a temporary directory
/// under `under` and renaming it into place, and returns its path: a
/// directory at that path is always complete. If one holding `marker` is
/// there already, it is answered as it is and `fill` does not run. Of
/// concurrent publishers — threads or processes — one rename wins and the
/// others remove theirs and answer the same path. An empty directory in
/// the way is replaced; any other is an error. On error the temporary
/// directory is removed.
pub fn publish<E: From<StoreError>>(
    under: &Path,
    id: &ArtifactId,
    marker: &str,
    fill: impl FnOnce(&Path) -> Result<(), E>,
) -> Result<PathBuf, E> {
    let target = under.join(id.file_name());
    let done = |dir: &Path| dir.join(marker).is_file();
    if done(&target) {
        return Ok(target);
    }
    fs::create_dir_all(under).map_err(io_err(under))?;
    let staging = Staging::create(under, &id.file_name())?;
    fill(&staging.0)?;
    match fs::rename(&staging.0, &target) {
        Ok(()) => Ok(target),
        // Another publisher renamed its complete directory into place first.
        Err(e) if done(&target) && e.raw_os_error().is_some_and(is_exists) => Ok(target),
        Err(e) => Err(io_err(&target)(e).into()),
    }
}

/// Makes the files of `dir` and `dir` itself read-only (`0444`, `0555`):
/// what an engine is handed, so that it cannot change what other replicas
/// read. [`remove`] removes such a directory.
pub fn make_read_only(dir: &Path) -> Result<(), StoreError> {
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let path = entry.map_err(io_err(dir))?.path();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o444)).map_err(io_err(&path))?;
    }
    fs::set_permissions(dir, fs::Permissions::from_mode(0o555)).map_err(io_err(dir))
}

/// Removes the directory `dir` that [`publish`] made (read-only or not):
/// renamed to a hidden name first, so it is never seen half removed; gone
/// already is not an error.
pub fn remove(dir: &Path) -> Result<(), StoreError> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let Some((parent, name)) = dir.parent().zip(dir.file_name()) else { return Ok(()) };
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    let grave = parent.join(format!(".{}.{}.{n}.gone", name.to_string_lossy(), std::process::id()));
    match fs::rename(dir, &grave) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_err(dir)(e)),
    }
    // Removing a read-only directory's entries needs its write permission.
    fs::set_permissions(&grave, fs::Permissions::from_mode(0o755)).map_err(io_err(&grave))?;
    fs::remove_dir_all(&grave).map_err(io_err(&grave))
}

/// Whether an OS error number says the rename target exists.
fn is_exists(errno: i32) -> bool {
    errno == rustix::io::Errno::NOTEMPTY.raw_os_error() || errno == rustix::io::Errno::EXIST.raw_os_error()
}

/// A temporary directory a directory is written into, removed on drop
/// (after the rename that publishes it, there is nothing left to remove).
struct Staging(PathBuf);

impl Staging {
    fn create(under: &Path, name: &str) -> Result<Self, StoreError> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static SEQ: AtomicU64 = AtomicU64::new(0);
        loop {
            let n = SEQ.fetch_add(1, Ordering::Relaxed);
            let dir = under.join(format!(".{name}.{}.{n}.tmp", std::process::id()));
            match fs::create_dir(&dir) {
                Ok(()) => return Ok(Staging(dir)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io_err(&dir)(e)),
            }
        }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if self.0.exists() {
            let _ = fs::set_permissions(&self.0, fs::Permissions::from_mode(0o755));
            let _ = fs::remove_dir_all(&self.0);
        }
    }
}

/// Removes the directories under `under` that [`publish`] made for
/// artifacts not in `keep`, and answers which. Work in progress (hidden
/// temporary directories) and anything not a directory are left alone. An
/// engine that loaded its files from a removed directory keeps them: it
/// read them when it loaded.
pub fn prune_exports<'a>(
    under: &Path,
    keep: impl IntoIterator<Item = &'a ArtifactId>,
) -> Result<Vec<PathBuf>, StoreError> {
    let keep: std::collections::HashSet<String> = keep.into_iter().map(ArtifactId::file_name).collect();
    let entries = match fs::read_dir(under) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(under)(e)),
    };
    let mut removed = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io_err(under))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_dir = entry.file_type().map_err(io_err(&entry.path()))?.is_dir();
        if !is_dir || name.starts_with('.') || keep.contains(&name) {
            continue;
        }
        remove(&entry.path())?;
        removed.push(entry.path());
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_written_back_that_does_not_hash_to_its_record_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("m");
        crate::synth::synth_model_dir(&src, 64, 1, 1, 1).unwrap();
        let store = BlobStore::open(dir.path().join("store")).unwrap();
        let scanned = scan(&src).unwrap();
        let mut prepared = Prepared::new(&scanned).unwrap();
        // The record of config.json says other bytes than the file's.
        let mut manifest: Manifest = serde_json::from_slice(&prepared.manifest).unwrap();
        manifest.files[0].blake3 = blake3::hash(b"other bytes").to_hex().to_string();
        prepared.manifest = serde_json::to_vec(&manifest).unwrap();
        let id = store.import_members(&prepared.members(), &[], &ServingPolicy::default()).unwrap().id;
        let out = dir.path().join("out");
        let e = export(&store, &id, &out).unwrap_err().to_string();
        assert!(e.contains("config.json written back") && e.contains("BLAKE3"), "{e}");
        assert!(fs::read_dir(&out).unwrap().next().is_none(), "nothing left: {e}");
    }
}
