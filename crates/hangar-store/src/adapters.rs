//! LoRA adapters as store artifacts, registered under their base model.
//!
//! A LoRA adapter, as users have it, is a PEFT directory:
//! `adapter_config.json`, the weights in `adapter_model.safetensors` (or
//! `adapter_model.bin` / `.pt`), sometimes tokenizer files. vLLM loads it
//! from that directory (`POST /v1/load_lora_adapter {"lora_name",
//! "lora_path"}`). [`import_dir`] makes the directory one directory
//! artifact ([`crate::directory`]: `adapter_model.safetensors` tensor by
//! tensor, every other file whole under its name — `adapter_model.bin`
//! included —, the directory manifest recording each file's hash) with
//! one more reserved whole-file member, the **binding** [`BINDING_FILE`]
//! (`{"version":1,"base":…,"name":…}`, compact, fixed field order), which
//! says whose adapter this is.
//!
//! Because the binding is part of the content, the id covers it: the same
//! directory imported under the same `BASE:ADAPTER` is the same artifact
//! (`existed`), and under another base or name it is another artifact —
//! the same name under two bases is two adapters, as
//! [`AdapterRef`] says. Any node holding the artifact knows what it is.
//!
//! **Names.** `<root>/adapters.json` maps each [`AdapterRef`] to its
//! artifact and its exported size, rewritten atomically under the lock
//! the store's keys use: finding an adapter ([`find`]) or listing them
//! ([`list`]) reads that one file and `stat`s each artifact's data, never
//! an artifact's bytes. It is a table of names, as `keys.json` is for
//! keys, rather than store keys: a key's name is one model key of at most
//! 128 bytes, which `BASE` and `ADAPTER` (each up to 128) do not fit
//! without an ambiguous encoding. Importing other content under an
//! existing name moves the name, as a key moves ([`ImportReport::moved_from`]);
//! the older artifact stays until removed. The disk budget never touches
//! names; an adapter whose bytes it dropped is listed `on_disk: false`.
//!
//! **Export.** [`export_dir`] writes the adapter as the directory an
//! engine loads at `under/<artifact id>/`, every file byte for byte as it
//! was imported, every byte verified against its chunk hash first and
//! every file against its hash as it is written ([`directory::export_with`]:
//! a temporary directory renamed into place, so a directory at that path
//! is always complete, and concurrent exports of one adapter end with one
//! directory).
//!
//! Every call here does blocking file I/O (an export also hashes every
//! byte): from async code, run it on a blocking thread.
//!
//! ```
//! use hangar_store::{adapters, synth, BlobStore};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let src = dir.path().join("support-v2");
//! synth::synth_adapter_dir(&src, "meta-llama/Meta-Llama-3-8B", 8, 64, 2, 7).unwrap();
//! let store = BlobStore::open(dir.path().join("store")).unwrap();
//! let name = "meta/llama-3-8b:acme/support-v2".parse().unwrap();
//!
//! let imported = adapters::import_dir(&store, &src, &name).unwrap();
//! assert!(!imported.existed && imported.warnings.is_empty());
//! let entry = adapters::find(&store, &name).unwrap().expect("registered");
//! assert_eq!(entry.id, imported.id);
//!
//! let path = adapters::export_dir(&store, &entry, &dir.path().join("exports")).unwrap();
//! assert_eq!(
//!     std::fs::read(path.join("adapter_config.json")).unwrap(),
//!     std::fs::read(src.join("adapter_config.json")).unwrap(),
//! );
//! ```

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use hangar_core::{Adapter, AdapterName, AdapterRef, ByteSize, ModelKey};
use serde::{Deserialize, Serialize};

use crate::blob::{BlobStore, Member};
use crate::directory::{self, json_kind, ConfigError, Durability, ScanError};
use crate::error::{io_err, StoreError};
use crate::export::{is_plain_file_name, SafetensorsLayout};
use crate::format::FILE_TENSOR_PREFIX;
use crate::id::ArtifactId;
use crate::index::CanonicalIndex;
use crate::preflight::ServingPolicy;

/// The reserved member that binds an adapter artifact to its base model
/// and name. A directory may not hold a file of that name.
pub const BINDING_FILE: &str = "__hangar_adapter__.json";

/// The binding's tensor in the canonical index ([`FILE_TENSOR_PREFIX`] +
/// [`BINDING_FILE`]); an artifact carrying it is an adapter.
pub const BINDING_TENSOR: &str = "file:__hangar_adapter__.json";

/// The adapter's configuration, required in every adapter directory.
pub const CONFIG_FILE: &str = "adapter_config.json";

/// Where a node writes the adapter directories its engines load, under
/// the store's root (`<root>/adapter-dirs/<artifact id>/`).
pub const EXPORT_DIRS: &str = "adapter-dirs";

/// The weights file imported tensor by tensor (any other file is kept whole).
pub const SAFETENSORS_FILE: &str = "adapter_model.safetensors";

/// The weights files an engine looks for (vLLM's, in its order); a
/// directory needs at least one.
pub const WEIGHTS_FILES: [&str; 3] = [SAFETENSORS_FILE, "adapter_model.bin", "adapter_model.pt"];

/// The names table under the store root.
const NAMES_FILE: &str = "adapters.json";

/// The binding's version; part of the hashed bytes.
const BINDING_VERSION: u32 = 1;

/// What the binding member says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Binding {
    version: u32,
    base: ModelKey,
    name: AdapterName,
    /// `adapter_model.safetensors`'s `__metadata__`, restored on export.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    metadata: BTreeMap<String, String>,
}

impl Binding {
    fn adapter(&self) -> AdapterRef {
        AdapterRef::new(self.base.clone(), self.name.clone())
    }
}

/// One line of the names table: the artifact an adapter's name points at
/// and the bytes of its files as exported (a function of the content).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct NameRecord {
    pub(crate) id: ArtifactId,
    pub(crate) bytes: u64,
}

/// The names table, `adapters.json`.
pub(crate) type Names = BTreeMap<AdapterRef, NameRecord>;

/// Reads the names table (empty when the store has none).
pub(crate) fn read_names(store: &BlobStore) -> Result<Names, StoreError> {
    let path = store.root().join(NAMES_FILE);
    match fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map_err(|e| StoreError::Corrupt { what: path.display().to_string(), reason: e.to_string() }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Names::new()),
        Err(e) => Err(io_err(&path)(e)),
    }
}

/// Replaces the names table; call it holding the names lock.
pub(crate) fn write_names(store: &BlobStore, names: &Names) -> Result<(), StoreError> {
    store.write_atomically(NAMES_FILE, &serde_json::to_vec_pretty(names).expect("names serialize"))
}

/// Whether the artifact of `index` is an adapter (carries the binding).
pub fn carries_binding(index: &CanonicalIndex) -> bool {
    index.tensor(BINDING_TENSOR).is_some()
}

/// A registered adapter: its name, its artifact, its size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AdapterEntry {
    /// `BASE:ADAPTER`.
    pub adapter: AdapterRef,
    /// The artifact its name points at.
    pub id: ArtifactId,
    /// The bytes of its files as [`export_dir`] writes them.
    pub bytes: u64,
    /// Whether the artifact's bytes are on this node's disk; `false` when
    /// the disk budget dropped them ([`export_dir`] then fails with
    /// [`ExportError::NotOnDisk`]).
    pub on_disk: bool,
}

impl AdapterEntry {
    /// The adapter with its size, as the router's adapter slots count it.
    pub fn sized(&self) -> Adapter {
        Adapter::sized(self.adapter.clone(), ByteSize::new(self.bytes))
    }

    fn from_record(store: &BlobStore, adapter: AdapterRef, r: NameRecord) -> Self {
        AdapterEntry { adapter, id: r.id, bytes: r.bytes, on_disk: store.contains(&r.id) }
    }
}

/// Why the adapters' names could not be read ([`list`], [`find`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LookupError {
    /// `adapters.json` cannot be read or is not a names table.
    #[error("reading the adapters' names: {0}")]
    Names(#[source] StoreError),
}

/// Every registered adapter — of `base` only, when given — sorted by base,
/// then name. Reads the names table and `stat`s each artifact's data.
pub fn list(store: &BlobStore, base: Option<&ModelKey>) -> Result<Vec<AdapterEntry>, LookupError> {
    let names = read_names(store).map_err(LookupError::Names)?;
    Ok(names
        .into_iter()
        .filter(|(a, _)| base.is_none_or(|b| a.base() == b))
        .map(|(a, r)| AdapterEntry::from_record(store, a, r))
        .collect())
}

/// The adapter registered as `adapter`, if any. Reads the names table and
/// `stat`s the artifact's data.
pub fn find(store: &BlobStore, adapter: &AdapterRef) -> Result<Option<AdapterEntry>, LookupError> {
    let names = read_names(store).map_err(LookupError::Names)?;
    Ok(names.get(adapter).map(|r| AdapterEntry::from_record(store, adapter.clone(), *r)))
}

/// What [`import_dir`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ImportReport {
    /// The name it was registered under.
    pub adapter: AdapterRef,
    /// Its artifact.
    pub id: ArtifactId,
    /// The bytes of its files as exported.
    pub bytes: u64,
    /// The store already held this artifact: the same files under the same name.
    pub existed: bool,
    /// The artifact the name pointed at before, when it pointed at another
    /// (different files): the name moved; that artifact is still stored.
    pub moved_from: Option<ArtifactId>,
    /// The files imported, by name.
    pub files: Vec<String>,
    /// Hidden entries (names starting with `.`: `.gitattributes`, a
    /// `.cache/` directory) left out.
    pub skipped: Vec<String>,
    /// What looks wrong without being refused: a `base_model_name_or_path`
    /// unlike the base.
    pub warnings: Vec<String>,
}

/// Why an adapter directory was not imported. Nothing was registered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImportError {
    /// The directory holds what may not be imported (a subdirectory, a
    /// special file, a link leading out, a reserved name), or is missing.
    #[error(transparent)]
    Scan(#[from] ScanError),
    /// The directory has no `adapter_config.json`.
    #[error(
        "{} has no {CONFIG_FILE}; an adapter directory holds {CONFIG_FILE} and \
         adapter_model.safetensors (or adapter_model.bin), as PEFT's save_pretrained writes them",
        dir.display()
    )]
    NoConfig {
        /// The directory.
        dir: PathBuf,
    },
    /// `adapter_config.json` is not a JSON object.
    #[error("{}: not a JSON object: {reason}", path.display())]
    ConfigNotJson {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        reason: String,
    },
    /// No weights file.
    #[error("{} has no weights file: none of {}", dir.display(), WEIGHTS_FILES.join(", "))]
    NoWeights {
        /// The directory.
        dir: PathBuf,
    },
    /// The store refused the files (a malformed `adapter_model.safetensors`,
    /// named with what is wrong) or could not write them.
    #[error("importing adapter {adapter} from {}: {source}", dir.display())]
    Store {
        /// The adapter.
        adapter: AdapterRef,
        /// The directory.
        dir: PathBuf,
        /// What the store said.
        source: Box<StoreError>,
    },
}

/// Imports the PEFT directory `dir` as one artifact and registers it as
/// `adapter` (see the module documentation for the layout).
///
/// Idempotent: the same files under the same name are the same artifact,
/// reported `existed`. Other files under a name already registered move
/// the name ([`ImportReport::moved_from`]). Hidden entries are skipped;
/// subdirectories, special files and symbolic links leading outside `dir`
/// are refused. An `adapter_config.json` whose `base_model_name_or_path`
/// does not look like `adapter`'s base is imported with a warning: model
/// keys are not Hugging Face ids, so it cannot be checked strictly.
///
/// On error nothing is registered; the artifact may have been stored
/// (when the names table could not be written), without a name.
pub fn import_dir(store: &BlobStore, dir: &Path, adapter: &AdapterRef) -> Result<ImportReport, ImportError> {
    let scanned = directory::scan(dir)?;
    let config_path =
        scanned.find(CONFIG_FILE).ok_or_else(|| ImportError::NoConfig { dir: dir.to_owned() })?;
    if !WEIGHTS_FILES.iter().any(|w| scanned.find(w).is_some()) {
        return Err(ImportError::NoWeights { dir: dir.to_owned() });
    }
    let config = directory::json_object(config_path).map_err(|e| match e {
        ConfigError::Io { path, source } => ImportError::Scan(ScanError::Io { path, source }),
        ConfigError::NotJson { path, reason } => ImportError::ConfigNotJson { path, reason },
    })?;
    let warnings = base_warnings(&config, adapter.base()).into_iter().collect();

    let store_err = |source: StoreError| ImportError::Store {
        adapter: adapter.clone(),
        dir: dir.to_owned(),
        source: Box::new(source),
    };
    let prepared = directory::Prepared::new(&scanned).map_err(store_err)?;
    let binding = Binding {
        version: BINDING_VERSION,
        base: adapter.base().clone(),
        name: adapter.name().clone(),
        metadata: BTreeMap::new(),
    };
    let binding_bytes = serde_json::to_vec(&binding).expect("a binding serializes");
    let mut members = prepared.members();
    members.push(Member::Bytes { name: BINDING_FILE, data: &binding_bytes });
    let committed = store.import_members(&members, &[], &ServingPolicy::default()).map_err(store_err)?;
    let bytes = prepared.bytes;

    let record = NameRecord { id: committed.id, bytes };
    let before = store
        .with_names_locked(|| -> Result<Option<NameRecord>, StoreError> {
            let mut names = read_names(store)?;
            let before = names.insert(adapter.clone(), record);
            if before != Some(record) {
                write_names(store, &names)?;
            }
            Ok(before)
        })
        .and_then(|r| r)
        .map_err(store_err)?;
    Ok(ImportReport {
        adapter: adapter.clone(),
        id: committed.id,
        bytes,
        existed: committed.existed,
        moved_from: before.map(|b| b.id).filter(|id| *id != committed.id),
        files: scanned.files.into_iter().map(|(n, _)| n).collect(),
        skipped: scanned.skipped,
        warnings,
    })
}

/// The warning, if `config`'s `base_model_name_or_path` does not look like
/// `base`: neither's last path segment, lowercased and with only letters
/// and digits kept, contains the other's (`meta/llama-3-8b` looks like
/// `meta-llama/Meta-Llama-3-8B`, not like `mistralai/Mistral-7B-v0.1`).
fn base_warnings(config: &serde_json::Map<String, serde_json::Value>, base: &ModelKey) -> Option<String> {
    let field = "base_model_name_or_path";
    let said = match config.get(field)? {
        serde_json::Value::Null => return None,
        serde_json::Value::String(s) => s,
        other => {
            return Some(format!(
                "{CONFIG_FILE}: {field} is {}, not a string; imported as an adapter of `{base}` anyway",
                json_kind(other)
            ))
        }
    };
    let squash = |s: &str| -> String {
        let last = s.trim_end_matches('/').rsplit('/').next().unwrap_or(s);
        last.chars().filter(|c| c.is_ascii_alphanumeric()).map(|c| c.to_ascii_lowercase()).collect()
    };
    let (a, b) = (squash(said), squash(base.as_str()));
    let alike = !a.is_empty() && !b.is_empty() && (a.contains(&b) || b.contains(&a));
    (!alike).then(|| {
        format!(
            "{CONFIG_FILE}: {field} is `{said}`, which does not look like the base model `{base}` it is \
             imported under; an adapter runs only on the base it was trained from (imported anyway: \
             model keys are not Hugging Face ids, so this is not checked strictly)"
        )
    })
}

/// The binding of the adapter artifact `index` whose canonical bytes are
/// `data`; what is wrong otherwise.
fn read_binding(index: &CanonicalIndex, data: &[u8]) -> Result<Binding, String> {
    let t =
        index.tensor(BINDING_TENSOR).ok_or_else(|| format!("carries no {BINDING_FILE}: not an adapter"))?;
    let bytes = &data[t.offset as usize..(t.offset + t.len) as usize];
    let binding: Binding =
        serde_json::from_slice(bytes).map_err(|e| format!("has an unreadable {BINDING_FILE}: {e}"))?;
    if binding.version != BINDING_VERSION {
        return Err(format!("has a {BINDING_FILE} of version {}, not {BINDING_VERSION}", binding.version));
    }
    Ok(binding)
}

/// Whether the artifact `index` (canonical bytes `data`) is the adapter
/// `adapter`: its binding names it. Else what it is instead, to follow
/// "artifact ID " in an error.
pub fn check_binding(index: &CanonicalIndex, data: &[u8], adapter: &AdapterRef) -> Result<(), String> {
    let binding = read_binding(index, data)?;
    match binding.adapter() == *adapter {
        true => Ok(()),
        false => Err(format!("is bound to adapter {}", binding.adapter())),
    }
}

/// Writes the files of the adapter artifact `index`, whose canonical bytes
/// are `data` (verified by the caller), into the existing directory `dir`,
/// each synced if `durability` says so, not the binding: as the directory artifact it is
/// ([`directory::write_files`], every file as it was imported). An adapter
/// imported before adapters were directory artifacts (its artifact has no
/// manifest) is written as it was then: every whole file under its name,
/// the other tensors as `adapter_model.safetensors` with the metadata its
/// binding kept. Returns the paths written, by name.
pub fn write_files(
    index: &CanonicalIndex,
    data: &[u8],
    dir: &Path,
    durability: Durability,
) -> Result<Vec<PathBuf>, StoreError> {
    let corrupt = |reason: String| StoreError::Corrupt { what: dir.display().to_string(), reason };
    let binding = read_binding(index, data).map_err(|e| corrupt(format!("the artifact {e}")))?;
    if directory::carries_manifest(index) {
        return directory::write_files(index, data, dir, durability);
    }
    let mut written = Vec::new();
    let mut tensors = Vec::new();
    for t in &index.tensors {
        let Some(name) = t.name.strip_prefix(FILE_TENSOR_PREFIX) else {
            tensors.push(t);
            continue;
        };
        if name == BINDING_FILE {
            continue;
        }
        if !is_plain_file_name(name) || name == SAFETENSORS_FILE {
            return Err(corrupt(format!(
                "the artifact holds a file named `{name}`, which an adapter may not"
            )));
        }
        let path = dir.join(name);
        let file = fs::File::create(&path).map_err(io_err(&path))?;
        file.write_all_at(&data[t.offset as usize..(t.offset + t.len) as usize], 0).map_err(io_err(&path))?;
        if durability == Durability::Synced {
            file.sync_data().map_err(io_err(&path))?;
        }
        written.push(path);
    }
    if !tensors.is_empty() {
        let path = dir.join(SAFETENSORS_FILE);
        let file = SafetensorsLayout::new(tensors, binding.metadata).write_file(data, &path)?;
        if durability == Durability::Synced {
            file.sync_data().map_err(io_err(&path))?;
        }
        written.push(path);
    }
    written.sort();
    Ok(written)
}

/// Why an adapter could not be exported. Nothing was left at the target
/// path (a temporary directory may be, after a crash: `under/.hg1-…tmp`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExportError {
    /// The store does not know the artifact.
    #[error("adapter {adapter}: artifact {id} is not in this store")]
    Unknown {
        /// The adapter.
        adapter: AdapterRef,
        /// Its artifact.
        id: ArtifactId,
    },
    /// The disk budget dropped the artifact's bytes.
    #[error(
        "adapter {adapter}: the bytes of artifact {id} are not on this node's disk (the disk budget \
         dropped them); import its directory again (`hangar store import-adapter DIR --adapter \
         {adapter}`), or load {id} through the store daemon, which fetches it from a peer"
    )]
    NotOnDisk {
        /// The adapter.
        adapter: AdapterRef,
        /// Its artifact.
        id: ArtifactId,
    },
    /// The artifact is not this adapter (the names table was edited, or
    /// the artifact is not an adapter at all).
    #[error("adapter {adapter}: artifact {id} {what}")]
    NotThisAdapter {
        /// The adapter.
        adapter: AdapterRef,
        /// The artifact its name points at.
        id: ArtifactId,
        /// What the artifact is instead.
        what: String,
    },
    /// Reading the artifact failed: corrupt, a chunk that does not match
    /// its hash (never written out).
    #[error("adapter {adapter}: reading artifact {id}: {source}")]
    Read {
        /// The adapter.
        adapter: AdapterRef,
        /// Its artifact.
        id: ArtifactId,
        /// What the store said.
        source: Box<StoreError>,
    },
    /// Writing the directory failed.
    #[error("adapter {adapter}: exporting under {}: {source}", under.display())]
    Write {
        /// The adapter.
        adapter: AdapterRef,
        /// The directory exported under.
        under: PathBuf,
        /// What failed, naming the file.
        source: Box<StoreError>,
    },
}

/// Writes `entry`'s adapter as the directory an engine loads, at
/// `under/<artifact id>/` (the id with `:` as `-`), and returns that path.
///
/// Every byte is verified against its chunk hash before anything is
/// written, and every file against its hash as it is written (see
/// [`write_files`]). The files are written and synced in a temporary directory
/// under `under`, then renamed into place: a directory at the returned
/// path is always complete. If it exists already (holding
/// `adapter_config.json`, as every export does) it is reused as it is: one
/// export per adapter per node. Of concurrent exports — threads or
/// processes — one rename wins and the others remove theirs and answer
/// the same path. An empty directory in the way is replaced; any other is
/// an error. Marks the artifact used for the disk budget.
pub fn export_dir(store: &BlobStore, entry: &AdapterEntry, under: &Path) -> Result<PathBuf, ExportError> {
    let (adapter, id) = (&entry.adapter, entry.id);
    let check = |index: &CanonicalIndex, data: &[u8]| check_binding(index, data, adapter);
    let write =
        |index: &CanonicalIndex, data: &[u8], dir: &Path| write_files(index, data, dir, Durability::Synced);
    directory::export_with(store, &id, under, CONFIG_FILE, check, write).map_err(|e| match e {
        directory::ExportError::Unknown { id } => ExportError::Unknown { adapter: adapter.clone(), id },
        directory::ExportError::NotOnDisk { id } => ExportError::NotOnDisk { adapter: adapter.clone(), id },
        directory::ExportError::NotThis { id, what } => {
            ExportError::NotThisAdapter { adapter: adapter.clone(), id, what }
        }
        directory::ExportError::Read { id, source } => {
            ExportError::Read { adapter: adapter.clone(), id, source }
        }
        directory::ExportError::Write { under, source } => {
            ExportError::Write { adapter: adapter.clone(), under, source }
        }
    })
}

/// Removes the adapter exports no longer registered (the directory
/// artifacts' [`directory::prune_exports`]).
pub use crate::directory::prune_exports;

/// What [`remove`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Removed {
    /// The artifact the name pointed at.
    pub id: ArtifactId,
    /// Whether the artifact went too (no key pointed at it).
    pub artifact_removed: bool,
}

/// Why an adapter could not be removed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RemoveError {
    /// No adapter of that name.
    #[error("unknown adapter {adapter}; `hangar store adapters` lists the adapters of this store")]
    Unknown {
        /// The name given.
        adapter: AdapterRef,
    },
    /// Reading or writing the names, or removing the artifact, failed.
    #[error("removing adapter {adapter}: {source}")]
    Store {
        /// The adapter.
        adapter: AdapterRef,
        /// What the store said.
        source: Box<StoreError>,
    },
}

/// Removes the name `adapter`, and its artifact unless a key points at it
/// (as removing a store key does). Exported directories are not touched.
pub fn remove(store: &BlobStore, adapter: &AdapterRef) -> Result<Removed, RemoveError> {
    let store_err = |source| RemoveError::Store { adapter: adapter.clone(), source: Box::new(source) };
    let removed = store
        .with_names_locked(|| -> Result<Option<(ArtifactId, bool)>, StoreError> {
            let mut names = read_names(store)?;
            let Some(record) = names.remove(adapter) else { return Ok(None) };
            write_names(store, &names)?;
            let keyed = store.keys()?.values().any(|id| *id == record.id);
            Ok(Some((record.id, !keyed)))
        })
        .and_then(|r| r)
        .map_err(store_err)?;
    let Some((id, doomed)) = removed else { return Err(RemoveError::Unknown { adapter: adapter.clone() }) };
    let artifact_removed = doomed && store.discard(&id).map_err(store_err)?;
    Ok(Removed { id, artifact_removed })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_binding_tensor_is_the_binding_file_as_a_whole_file() {
        assert_eq!(BINDING_TENSOR, format!("{FILE_TENSOR_PREFIX}{BINDING_FILE}"));
    }

    /// An adapter imported before adapters were directory artifacts (no
    /// manifest; the safetensors metadata kept in its binding) is still
    /// written back: its config byte for byte, its weights as the same
    /// tensors and metadata.
    #[test]
    fn an_adapter_imported_before_the_directory_manifest_is_still_written_back() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        crate::synth::synth_adapter_dir(&src, "b", 4, 32, 2, 1).unwrap();
        let store = BlobStore::open(dir.path().join("store")).unwrap();
        let binding = Binding {
            version: BINDING_VERSION,
            base: "b".parse().unwrap(),
            name: "x".parse().unwrap(),
            metadata: BTreeMap::from([("format".to_owned(), "pt".to_owned())]),
        };
        let binding = serde_json::to_vec(&binding).unwrap();
        let (config, weights) = (src.join(CONFIG_FILE), src.join(SAFETENSORS_FILE));
        let members = [
            Member::Whole { path: &config, name: CONFIG_FILE.to_owned() },
            Member::Tensors(&weights),
            Member::Bytes { name: BINDING_FILE, data: &binding },
        ];
        let id = store.import_members(&members, &[], &ServingPolicy::default()).unwrap().id;
        let art = store.open_artifact(&id).unwrap();
        assert!(!directory::carries_manifest(&art.index));
        let out = dir.path().join("out");
        fs::create_dir(&out).unwrap();
        write_files(&art.index, &art.map_verified().unwrap(), &out, Durability::Synced).unwrap();
        assert_eq!(fs::read(out.join(CONFIG_FILE)).unwrap(), fs::read(&config).unwrap());
        let (a, b) = (fs::read(out.join(SAFETENSORS_FILE)).unwrap(), fs::read(&weights).unwrap());
        let (a, b) = (
            safetensors::SafeTensors::deserialize(&a).unwrap(),
            safetensors::SafeTensors::deserialize(&b).unwrap(),
        );
        let mut names = a.names();
        names.sort();
        let mut want = b.names();
        want.sort();
        assert_eq!(names, want);
        for n in names {
            assert_eq!(a.tensor(n).unwrap().data(), b.tensor(n).unwrap().data(), "{n}");
        }
        let meta =
            |bytes: &[u8]| safetensors::SafeTensors::read_metadata(bytes).unwrap().1.metadata().clone();
        assert_eq!(meta(&fs::read(out.join(SAFETENSORS_FILE)).unwrap()), meta(&fs::read(&weights).unwrap()));
    }

    #[test]
    fn the_binding_is_compact_in_a_fixed_order() {
        let b = Binding {
            version: 1,
            base: "meta/llama-3-8b".parse().unwrap(),
            name: "acme/x".parse().unwrap(),
            metadata: BTreeMap::new(),
        };
        let bytes = serde_json::to_vec(&b).unwrap();
        assert_eq!(bytes, br#"{"version":1,"base":"meta/llama-3-8b","name":"acme/x"}"#);
        let mut with = b.clone();
        with.metadata.insert("format".into(), "pt".into());
        let bytes = serde_json::to_vec(&with).unwrap();
        assert_eq!(serde_json::from_slice::<Binding>(&bytes).unwrap(), with);
    }

    #[test]
    fn a_base_model_path_looks_like_its_key_by_its_last_segment() {
        let warn = |said: &str, base: &str| {
            let config = serde_json::json!({ "base_model_name_or_path": said });
            base_warnings(config.as_object().unwrap(), &base.parse().unwrap())
        };
        assert_eq!(warn("meta-llama/Meta-Llama-3-8B", "meta/llama-3-8b"), None);
        assert_eq!(warn("meta-llama/Meta-Llama-3-8B-Instruct", "meta/llama-3-8b-instruct"), None);
        assert_eq!(warn("/models/Qwen2.5-7B/", "qwen/qwen2.5-7b"), None);
        assert_eq!(warn("llama-3-8b", "llama-3-8b"), None);
        let w = warn("mistralai/Mistral-7B-v0.1", "meta/llama-3-8b").unwrap();
        assert!(w.contains("`mistralai/Mistral-7B-v0.1`") && w.contains("`meta/llama-3-8b`"), "{w}");
        assert!(warn("", "meta/llama-3-8b").is_some(), "an empty name looks like nothing");
        let config = serde_json::json!({ "base_model_name_or_path": 3 });
        let w = base_warnings(config.as_object().unwrap(), &"m".parse().unwrap()).unwrap();
        assert!(w.contains("a number"), "{w}");
        let none = serde_json::json!({});
        assert_eq!(base_warnings(none.as_object().unwrap(), &"m".parse().unwrap()), None);
    }
}
