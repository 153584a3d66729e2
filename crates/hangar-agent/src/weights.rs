//! Model weights on the serving path, through the node's weight store
//! (docs/store.md).
//!
//! A model's `weights` is `store:KEY`, an artifact of the store, or a file
//! path, imported into the store the first time a replica needs it. Before a
//! replica's engine starts, its weights are materialized through the store
//! daemon — lease-in-place when they are resident, else from the local blob
//! store, a peer or the fallback — into sealed shared memory, and the engine
//! is handed a path to that memory: the memfd, which the engine process
//! inherits at the same descriptor number, as `/proc/self/fd/N` (the
//! `{weights}` of its command template). An engine that maps its weights
//! file (llama.cpp maps a GGUF) then maps the very pages every other replica
//! of the artifact on the node maps: a second replica costs no read and no
//! memory for its weights.
//!
//! A **model directory** (a directory artifact of a Hugging Face model,
//! `hangar store import DIR`, [`hangar_store::directory`]) is handed over as
//! a directory: the daemon streams its verified bytes into this process's
//! memory (`MaterializeIntoTarget`, keeping no copy of its own: the
//! directory is the node's one copy), and its files are written back byte
//! for byte, each checked against its hash, into
//! `<store root>/model-dirs/<artifact id>/`, made read-only, and `{weights}` is that path — what vLLM's `--model`,
//! SGLang's `--model-path` and TGI's `--model-id` take. It is materialized
//! once per node: every replica of every model with those weights uses the
//! same directory, held by a count of the replicas using it and removed
//! when the last is released. Across processes sharing the store root (a
//! `hangar serve` and a `hangar agent` on one machine), each holder keeps a
//! shared `flock` on `model-dirs/<artifact id>.lock`; the last one out
//! removes the directory only when it can take that lock exclusively, and
//! the kernel drops the locks of a process that dies.
//!
//! Other artifacts of safetensors tensors cannot be handed over: the
//! store's canonical layout of tensors is not a safetensors file, and
//! engines would need a store-aware loader for it.
//!
//! `hangar serve` uses the daemon that serves the store's root, and starts
//! one in its own process when none answers on the socket — at start, or
//! later, when the daemon run apart has died (a replica's start then finds
//! the socket dead and runs the store itself rather than failing every
//! start until an operator restarts the daemon). Each replica
//! holds its materialization as this process's reference (the daemon sees
//! it through a pidfd), released when the replica stops or this process
//! exits; the engine's own mapping keeps the memory alive as long as it
//! runs, whatever the daemon does.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use hangar_core::{ByteSize, ModelKey, ReplicaId};
use hangar_store::client::{ClientError, Hold, Materialized, StoreClient, TargetMemory};
use hangar_store::daemon::{DaemonConfig, DaemonHandle};
use hangar_store::protocol::{Selection, Source};
use hangar_store::{directory, ArtifactId, BlobStore, StoreKey};
use serde::{Deserialize, Serialize};

mod adapter_dirs;

pub use adapter_dirs::{AdapterDirError, ADAPTER_DIR_IDLE};

/// Where a model's weights come from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum WeightsSource {
    /// `store:KEY`: an artifact of the weight store.
    Store(StoreKey),
    /// A file or a model directory, imported into the store on first use
    /// (relative paths are resolved against the configuration file's
    /// directory).
    File(PathBuf),
}

impl FromStr for WeightsSource {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.strip_prefix("store:") {
            Some(key) => key
                .parse()
                .map(WeightsSource::Store)
                .map_err(|e| format!("`{s}` is not a store key (`store:name:tag`): {e}")),
            None if s.is_empty() => Err("is empty: give `store:KEY` or a file path".into()),
            None => Ok(WeightsSource::File(s.into())),
        }
    }
}

impl TryFrom<String> for WeightsSource {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<WeightsSource> for String {
    fn from(w: WeightsSource) -> String {
        w.to_string()
    }
}

impl fmt::Display for WeightsSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WeightsSource::Store(key) => write!(f, "store:{key}"),
            WeightsSource::File(path) => write!(f, "{}", path.display()),
        }
    }
}

/// `[store]`: the node's weight store, used by models with `weights`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreSettings {
    /// The store's root (default: `hangar_store::default_root()`, the
    /// root `hangar store` uses); file weights are imported into it.
    pub root: Option<PathBuf>,
    /// The daemon's socket (default `<root>/store.sock`). When nothing
    /// answers there, `hangar serve` runs the daemon itself.
    pub socket: Option<PathBuf>,
    /// Resident memory the daemon it runs may use.
    pub budget: ByteSize,
    /// Bytes of blobs the daemon it runs keeps on disk (default: no limit).
    pub disk_budget: Option<ByteSize>,
    /// The registry URL of the daemon it runs (peers), if any.
    pub registry: Option<String>,
    /// The fallback directory or object-store URL of the daemon it runs.
    pub fallback: Option<String>,
}

impl Default for StoreSettings {
    fn default() -> Self {
        StoreSettings {
            root: None,
            socket: None,
            budget: ByteSize::new(16 << 30),
            disk_budget: None,
            registry: None,
            fallback: None,
        }
    }
}

impl StoreSettings {
    /// The store's root.
    pub fn root(&self) -> PathBuf {
        self.root.clone().unwrap_or_else(hangar_store::default_root)
    }

    /// The daemon's socket.
    pub fn socket(&self) -> PathBuf {
        self.socket.clone().unwrap_or_else(|| self.root().join("store.sock"))
    }

    /// Whether a missing key can only be missing: no registry or fallback
    /// could supply it later.
    fn local_only(&self) -> bool {
        self.registry.is_none() && self.fallback.is_none()
    }
}

/// Why a replica's weights are not there.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WeightsError {
    /// The store daemon could not be started or reached.
    #[error("model {model}: the weight store at {socket} is not reachable: {why}")]
    Unreachable {
        /// The model.
        model: String,
        /// The daemon's socket.
        socket: String,
        /// What failed.
        why: String,
    },
    /// The key names nothing the store (or its peers and fallback) holds.
    #[error("model {model}: weights `store:{key}`: no such key in the store at {root}")]
    UnknownKey {
        /// The model.
        model: String,
        /// The key.
        key: String,
        /// The store's root.
        root: String,
    },
    /// The weights file cannot be read.
    #[error("model {model}: weights file {path}: {why}")]
    File {
        /// The model.
        model: String,
        /// The path.
        path: String,
        /// What failed.
        why: String,
    },
    /// The artifact is neither one whole file nor a model directory, so
    /// it cannot be handed to an engine as a path.
    #[error(
        "model {model}: weights {weights} {what}: an engine is handed a file or a directory (import \
         a GGUF or other single file, or a model directory: `hangar store import DIR`)"
    )]
    NotAFile {
        /// The model.
        model: String,
        /// The weights as configured.
        weights: String,
        /// What they are instead.
        what: String,
    },
    /// Writing a model directory's files failed (disk full, permissions,
    /// a file that did not hash to its record).
    #[error("model {model}: weights {weights}: writing the model directory under {under}: {why}")]
    Directory {
        /// The model.
        model: String,
        /// The weights as configured.
        weights: String,
        /// Where model directories are written.
        under: String,
        /// What failed.
        why: String,
    },
    /// Materializing failed (a source failed, verification, budget).
    #[error("model {model}: weights {weights}: {why}")]
    Load {
        /// The model.
        model: String,
        /// The weights as configured.
        weights: String,
        /// What the store said.
        why: String,
    },
}

/// A replica's weights, materialized: a whole file's memory stays mapped
/// and its descriptor open while this lives; a model directory stays on
/// disk until [`WeightStore::release`] of its last replica.
#[derive(Debug)]
pub struct LoadedWeights {
    held: Held,
    /// What was loaded and how.
    pub report: WeightsReport,
}

/// What a replica's weights are held as.
#[derive(Debug)]
enum Held {
    /// A whole file's shared memory.
    Memory(Materialized),
    /// A model directory's path, counted in [`WeightStore`]'s table.
    Directory(PathBuf),
}

pub use hangar_core::WeightsReport;

/// How an engine is handed its weights (the `{weights}` of its command).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandedWeights {
    /// A descriptor of a whole file's shared memory, which the engine
    /// inherits at the same number and opens as `/proc/self/fd/N`.
    Fd(RawFd),
    /// A model directory, read-only, shared by the node's replicas.
    Directory(PathBuf),
}

impl HandedWeights {
    /// The path `{weights}` stands for.
    pub fn path(&self) -> String {
        match self {
            HandedWeights::Fd(fd) => format!("/proc/self/fd/{fd}"),
            HandedWeights::Directory(dir) => dir.display().to_string(),
        }
    }
}

impl LoadedWeights {
    /// How the engine is handed these weights (see `LaunchContext::weights`).
    pub fn handed(&self) -> HandedWeights {
        match &self.held {
            Held::Memory(memory) => HandedWeights::Fd(memory.fd().as_raw_fd()),
            Held::Directory(dir) => HandedWeights::Directory(dir.clone()),
        }
    }
}

/// Why a model directory could not be made: its bytes could not be
/// loaded, or its files not written.
#[derive(Debug)]
enum DirFailure {
    Load(String),
    Write(hangar_store::StoreError),
}

impl From<hangar_store::StoreError> for DirFailure {
    fn from(e: hangar_store::StoreError) -> Self {
        DirFailure::Write(e)
    }
}

/// Where a node's model directories are written, under the store's root.
pub const MODEL_DIRS: &str = "model-dirs";

/// One model directory this process materialized, and the replicas using it.
#[derive(Debug)]
struct HeldDir {
    path: PathBuf,
    /// The artifact's bytes, for the start reports of the replicas after
    /// the first.
    bytes: u64,
    /// `model-dirs/<id>.lock`, locked shared while this process holds
    /// the directory.
    lock: std::fs::File,
    replicas: HashSet<ReplicaId>,
}

/// The model directory of one artifact in this process: `None` while no
/// replica holds it. Its mutex is held while the directory is written, so
/// a second replica waits for the first one's directory.
type DirSlot = Arc<Mutex<Option<HeldDir>>>;

/// The node's weight store as `hangar serve` uses it.
pub struct WeightStore {
    settings: StoreSettings,
    /// The daemon this process runs, if none answered on the socket when
    /// one was needed.
    daemon: Mutex<Option<DaemonHandle>>,
    /// File weights already imported: `(path, length, mtime)` → artifact.
    imported: Mutex<HashMap<(PathBuf, u64, SystemTime), ArtifactId>>,
    /// The model directories this process materialized, by artifact.
    dirs: Mutex<HashMap<ArtifactId, DirSlot>>,
    /// The node's adapter directories, as this process knows them.
    adapter_dirs_known: Mutex<adapter_dirs::Known>,
    /// The adapter directories made ahead of need.
    adapter_dirs_ahead: Mutex<adapter_dirs::Ahead>,
}

impl fmt::Debug for WeightStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WeightStore").field("settings", &self.settings).finish_non_exhaustive()
    }
}

/// How long a load may take before the replica fails.
const LOAD_LIMIT: Duration = Duration::from_secs(600);

impl WeightStore {
    /// Connects to the daemon on the store's socket, starting one in this
    /// process when nothing answers there; then checks every model's weights
    /// that can be checked before anything runs: a file is readable, a key
    /// is known (when no registry or fallback could supply it later).
    pub fn open<'m>(
        settings: StoreSettings,
        models: impl IntoIterator<Item = (&'m ModelKey, &'m WeightsSource)>,
    ) -> Result<Self, WeightsError> {
        let models: Vec<_> = models.into_iter().collect();
        let store = WeightStore {
            settings,
            daemon: Mutex::new(None),
            imported: Mutex::new(HashMap::new()),
            dirs: Mutex::new(HashMap::new()),
            adapter_dirs_known: Mutex::default(),
            adapter_dirs_ahead: Mutex::default(),
        };
        if StoreClient::connect(store.settings.socket()).is_err() {
            let names: Vec<String> = models.iter().map(|(m, _)| m.to_string()).collect();
            store.run_daemon(&mut store.daemon.lock().expect("store daemon lock"), &names.join(", "))?;
        }
        store.sweep_model_dirs();
        for (model, source) in models {
            store.check(model, source)?;
        }
        Ok(store)
    }

    fn check(&self, model: &ModelKey, source: &WeightsSource) -> Result<(), WeightsError> {
        match source {
            WeightsSource::File(path) => {
                std::fs::File::open(path).map(drop).map_err(|e| WeightsError::File {
                    model: model.to_string(),
                    path: path.display().to_string(),
                    why: e.to_string(),
                })
            }
            WeightsSource::Store(key) => match self.connect(&model.to_string())?.resolve_key(key) {
                Err(ClientError::UnknownKey(_)) if self.settings.local_only() => {
                    Err(self.unknown(model, key))
                }
                // The registry or fallback may hold it by the time a
                // replica starts; then it fails there, by name.
                Err(ClientError::UnknownKey(_)) => Ok(()),
                Err(e) => Err(self.load_error(model, source, e)),
                Ok(_) => Ok(()),
            },
        }
    }

    /// A connection to the daemon on the store's socket; when none answers
    /// there (the daemon run apart died), one started in this process
    /// first. `models` are those the connection is for, named by the error.
    fn connect(&self, models: &str) -> Result<StoreClient, WeightsError> {
        let socket = self.settings.socket();
        if let Ok(client) = StoreClient::connect(&socket) {
            return Ok(client);
        }
        let mut daemon = self.daemon.lock().expect("store daemon lock");
        // Another start may have run one meanwhile.
        if let Err(e) = StoreClient::connect(&socket) {
            tracing::warn!(socket = %socket.display(), "the weight store daemon does not answer ({e}): running one in this process");
            self.run_daemon(&mut daemon, models)?;
        }
        StoreClient::connect(&socket).map_err(|e| self.unreachable(models, e.to_string()))
    }

    /// Starts the store's daemon in this process on its socket (replacing
    /// one this process ran before, should it have stopped).
    fn run_daemon(&self, daemon: &mut Option<DaemonHandle>, models: &str) -> Result<(), WeightsError> {
        drop(daemon.take());
        let socket = self.settings.socket();
        let mut cfg = DaemonConfig::new(self.settings.root(), &socket);
        cfg.budget = self.settings.budget.bytes();
        cfg.disk_budget = self.settings.disk_budget.map(|b| b.bytes());
        cfg.registry = self.settings.registry.clone();
        cfg.fallback = self.settings.fallback.clone();
        let started = DaemonHandle::start(cfg).map_err(|e| self.unreachable(models, e.to_string()))?;
        tracing::info!(socket = %socket.display(), root = %self.settings.root().display(), "weight store daemon started");
        *daemon = Some(started);
        Ok(())
    }

    fn unreachable(&self, models: &str, why: String) -> WeightsError {
        WeightsError::Unreachable {
            model: models.to_owned(),
            socket: self.settings.socket().display().to_string(),
            why,
        }
    }

    fn unknown(&self, model: &ModelKey, key: &StoreKey) -> WeightsError {
        WeightsError::UnknownKey {
            model: model.to_string(),
            key: key.to_string(),
            root: self.settings.root().display().to_string(),
        }
    }

    fn load_error(&self, model: &ModelKey, source: &WeightsSource, e: impl fmt::Display) -> WeightsError {
        WeightsError::Load { model: model.to_string(), weights: source.to_string(), why: e.to_string() }
    }

    /// Materializes `model`'s weights for `replica` and waits until every
    /// byte is loaded and verified.
    ///
    /// # Cancel safety
    /// The work runs on a blocking thread that finishes even if this future
    /// is dropped; the materialization it made is then released by
    /// [`WeightStore::release`] of the replica, or when this process exits.
    pub async fn load(
        self: &Arc<Self>,
        model: &ModelKey,
        source: &WeightsSource,
        replica: ReplicaId,
    ) -> Result<LoadedWeights, WeightsError> {
        let (this, model, source) = (self.clone(), model.clone(), source.clone());
        tokio::task::spawn_blocking(move || this.load_blocking(&model, &source, replica))
            .await
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
    }

    fn load_blocking(
        &self,
        model: &ModelKey,
        source: &WeightsSource,
        replica: ReplicaId,
    ) -> Result<LoadedWeights, WeightsError> {
        let started = Instant::now();
        let mut client = self.connect(&model.to_string())?;
        let selection = match source {
            WeightsSource::Store(key) => {
                let id = client.resolve_key(key).map_err(|e| match e {
                    ClientError::UnknownKey(_) => self.unknown(model, key),
                    e => self.load_error(model, source, e),
                })?;
                Selection { artifact_id: id, view: None, key: Some(key.clone()) }
            }
            WeightsSource::File(path) => {
                Selection { artifact_id: self.import(model, path)?, view: None, key: None }
            }
        };
        // A model directory a replica of this process holds already.
        if let Some((path, bytes)) = self.hold_dir(&selection.artifact_id, replica) {
            let report = WeightsReport {
                artifact: selection.artifact_id.to_string(),
                source: Source::Resident.as_str().to_owned(),
                bytes,
                took_ms: started.elapsed().as_millis() as u64,
                load_ms: 0,
            };
            return Ok(LoadedWeights { held: Held::Directory(path), report });
        }
        let (_, index) = client.describe(&selection).map_err(|e| match e {
            ClientError::UnknownKey(_) => match &selection.key {
                Some(key) => self.unknown(model, key),
                None => self.load_error(model, source, e),
            },
            e => self.load_error(model, source, e),
        })?;
        if index.whole_file().is_some() {
            return self.load_file(&mut client, model, source, &selection, replica, started);
        }
        directory::model_dir_check(&index, &[]).map_err(|what| WeightsError::NotAFile {
            model: model.to_string(),
            weights: source.to_string(),
            what: what.replacen("is not a model directory", "are not a model directory", 1),
        })?;
        let mut loaded = None;
        let path = self
            .materialize_dir(&selection.artifact_id, index.data_len, replica, |dir| {
                // Into this process's memory, the daemon keeping no copy:
                // the directory is the node's one copy of these bytes.
                let target =
                    TargetMemory::allocate(index.data_len).map_err(|e| DirFailure::Load(e.to_string()))?;
                let into = client
                    .materialize_into(&selection, &target, 0)
                    .map_err(|e| DirFailure::Load(e.to_string()))?;
                // Cached: a directory found after a restart is removed
                // (`sweep_model_dirs`), never trusted.
                let data = &target.bytes()[..into.bytes as usize];
                directory::write_files(&into.index, data, dir, directory::Durability::Cached)?;
                directory::make_read_only(dir)?;
                loaded = Some(into);
                Ok(())
            })
            .map_err(|e| match e {
                DirFailure::Load(why) => self.load_error(model, source, why),
                DirFailure::Write(e) => WeightsError::Directory {
                    model: model.to_string(),
                    weights: source.to_string(),
                    under: self.model_dirs().display().to_string(),
                    why: e.to_string(),
                },
            })?;
        // Written by this load, or found whole on the node's disk (another
        // process's replicas, or an earlier run, wrote it).
        let (source_name, load_ms) = match &loaded {
            Some(into) => (into.source.as_str(), into.duration_ms),
            None => (Source::Resident.as_str(), 0),
        };
        let report = WeightsReport {
            artifact: selection.artifact_id.to_string(),
            source: source_name.to_owned(),
            bytes: index.data_len,
            took_ms: started.elapsed().as_millis() as u64,
            load_ms,
        };
        Ok(LoadedWeights { held: Held::Directory(path), report })
    }

    /// Materializes a whole file into the daemon's shared memory for
    /// `replica` and waits until every byte is loaded and verified.
    fn load_file(
        &self,
        client: &mut StoreClient,
        model: &ModelKey,
        source: &WeightsSource,
        selection: &Selection,
        replica: ReplicaId,
        started: Instant,
    ) -> Result<LoadedWeights, WeightsError> {
        let memory = client
            .materialize_as(selection, replica, Hold::Process)
            .map_err(|e| self.load_error(model, source, e))?;
        let confirmed = loop {
            match client.confirm(&memory, LOAD_LIMIT) {
                Ok(c) => break c,
                Err(ClientError::Timeout(_)) if started.elapsed() < LOAD_LIMIT => continue,
                Err(e) => {
                    let _ = client.unload_replica(replica);
                    return Err(self.load_error(model, source, e));
                }
            }
        };
        let report = WeightsReport {
            artifact: memory.id.to_string(),
            source: source_name(confirmed.source, memory.reused).to_owned(),
            bytes: memory.index.data_len,
            took_ms: started.elapsed().as_millis() as u64,
            load_ms: if memory.reused { 0 } else { confirmed.duration_ms },
        };
        Ok(LoadedWeights { held: Held::Memory(memory), report })
    }

    /// Where this node's model directories are.
    fn model_dirs(&self) -> PathBuf {
        self.settings.root().join(MODEL_DIRS)
    }

    /// The model directory of `id` if this process holds it, counting
    /// `replica` among its holders.
    /// Answers its path and the artifact's bytes.
    fn hold_dir(&self, id: &ArtifactId, replica: ReplicaId) -> Option<(PathBuf, u64)> {
        let slot = self.dirs.lock().expect("model directories lock").get(id)?.clone();
        let mut slot = slot.lock().expect("model directory lock");
        let held = slot.as_mut()?;
        held.replicas.insert(replica);
        Some((held.path.clone(), held.bytes))
    }

    /// Makes the model directory of artifact `id` (of `bytes` bytes) by
    /// `fill`ing it, once per node — one another replica or process wrote
    /// is used as it is, and `fill` does not run — counting `replica`
    /// among its holders.
    fn materialize_dir(
        &self,
        id: &ArtifactId,
        bytes: u64,
        replica: ReplicaId,
        fill: impl FnOnce(&Path) -> Result<(), DirFailure>,
    ) -> Result<PathBuf, DirFailure> {
        let slot = self.dirs.lock().expect("model directories lock").entry(*id).or_default().clone();
        let mut slot = slot.lock().expect("model directory lock");
        if let Some(held) = slot.as_mut() {
            held.replicas.insert(replica);
            return Ok(held.path.clone());
        }
        let under = self.model_dirs();
        let io = |path: &Path| {
            let path = path.display().to_string();
            move |e: std::io::Error| DirFailure::Write(hangar_store::StoreError::Io { path, source: e })
        };
        std::fs::create_dir_all(&under).map_err(io(&under))?;
        let lock_path = under.join(format!("{}.lock", id.file_name()));
        let lock = std::fs::File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io(&lock_path))?;
        // Waits while another process removes the directory (it holds the
        // lock exclusively then), so what is found next is whole or absent.
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockShared)
            .map_err(|e| io(&lock_path)(e.into()))?;
        let path = directory::publish(&under, id, directory::MODEL_CONFIG_FILE, fill)?;
        tracing::info!(artifact = %id, path = %path.display(), "model directory materialized");
        *slot = Some(HeldDir { path: path.clone(), bytes, lock, replicas: HashSet::from([replica]) });
        Ok(path)
    }

    /// Lets `replica` go of the model directories it holds; a directory
    /// whose last holder it was is removed, unless another process holds
    /// it too.
    fn release_dirs(&self, replica: ReplicaId) {
        let slots: Vec<DirSlot> =
            self.dirs.lock().expect("model directories lock").values().cloned().collect();
        for slot in slots {
            let mut slot = slot.lock().expect("model directory lock");
            let Some(held) = slot.as_mut() else { continue };
            if !held.replicas.remove(&replica) || !held.replicas.is_empty() {
                continue;
            }
            let held = slot.take().expect("just seen");
            remove_unless_held(&held.path, &held.lock);
        }
    }

    /// Removes the model directories no process holds (left by a process
    /// that died): at start, so the disk they take comes back.
    fn sweep_model_dirs(&self) {
        let under = self.model_dirs();
        let Ok(entries) = std::fs::read_dir(&under) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let lock_path = under.join(format!("{name}.lock"));
            let Ok(lock) = std::fs::File::options().create(true).truncate(false).write(true).open(&lock_path)
            else {
                continue;
            };
            remove_unless_held(&entry.path(), &lock);
        }
    }

    /// Imports a weights file — or a model directory — into the store,
    /// once per version: a file's length and modification time, a
    /// directory's total length and latest modification time of its files.
    fn import(&self, model: &ModelKey, path: &Path) -> Result<ArtifactId, WeightsError> {
        let file_error = |why: String| WeightsError::File {
            model: model.to_string(),
            path: path.display().to_string(),
            why,
        };
        let meta = std::fs::metadata(path).map_err(|e| file_error(e.to_string()))?;
        let version = match meta.is_dir() {
            false => (path.to_owned(), meta.len(), meta.modified().unwrap_or(SystemTime::UNIX_EPOCH)),
            true => {
                let scanned = directory::scan(path).map_err(|e| file_error(e.to_string()))?;
                let (mut len, mut latest) = (0, SystemTime::UNIX_EPOCH);
                for (_, file) in &scanned.files {
                    let meta = std::fs::metadata(file)
                        .map_err(|e| file_error(format!("{}: {e}", file.display())))?;
                    len += meta.len();
                    latest = latest.max(meta.modified().unwrap_or(SystemTime::UNIX_EPOCH));
                }
                (path.to_owned(), len, latest)
            }
        };
        let blobs = BlobStore::open(self.settings.root()).map_err(|e| file_error(e.to_string()))?;
        if let Some(id) = self.imported.lock().expect("import table lock").get(&version) {
            // Still stored (the disk budget may have removed it since)?
            if blobs.contains(id) {
                return Ok(*id);
            }
        }
        let (id, existed) = match meta.is_dir() {
            false => blobs
                .import_files(&[path.to_owned()], &[])
                .map(|r| (r.id, r.existed))
                .map_err(|e| file_error(e.to_string()))?,
            true => directory::import_model_dir(&blobs, path, &[])
                .map(|r| (r.id, r.existed))
                .map_err(|e| file_error(e.to_string()))?,
        };
        tracing::info!(model = %model, path = %path.display(), artifact = %id, existed, "weights file imported into the store");
        self.imported.lock().expect("import table lock").insert(version, id);
        Ok(id)
    }

    /// The artifacts this node holds resident, sorted: those the store
    /// daemon has loaded and verified into memory (held by a replica or
    /// kept for the next one until its budget needs the room), and the
    /// model directories this process has materialized. A replica of a
    /// model loading one of them starts without reading its weights from
    /// disk or a peer, which is what placement's preference for resident
    /// nodes is worth. Blocking (a round trip to the daemon); an error when
    /// the daemon does not answer, which says nothing about what it holds.
    pub fn resident(&self) -> Result<Vec<String>, ClientError> {
        let (_, _, residents) = StoreClient::connect(self.settings.socket())?.status()?;
        let dirs: Vec<ArtifactId> = {
            let dirs = self.dirs.lock().expect("model directory table lock");
            dirs.iter()
                .filter(|(_, slot)| slot.try_lock().is_ok_and(|held| held.is_some()))
                .map(|(id, _)| *id)
                .collect()
        };
        let mut ids: Vec<String> = residents
            .into_iter()
            .filter(|r| r.ready)
            .map(|r| r.id)
            .chain(dirs)
            .map(|id| id.to_string())
            .collect();
        ids.sort_unstable();
        ids.dedup();
        Ok(ids)
    }

    /// Drops `replica`'s reference to its weights (the memory stays with
    /// the store, resident for the next replica, until its budget needs
    /// it; a model directory whose last replica this was is removed).
    ///
    /// # Cancel safety
    /// The work runs on a blocking thread that finishes even if this
    /// future is dropped.
    pub async fn release(self: &Arc<Self>, replica: ReplicaId) {
        let this = self.clone();
        let _ = tokio::task::spawn_blocking(move || {
            this.release_dirs(replica);
            if let Ok(mut client) = StoreClient::connect(this.settings.socket()) {
                let _ = client.unload_replica(replica);
            }
        })
        .await;
    }
}

/// Removes the model directory `path` if no process holds its `lock`
/// (taken exclusively, without waiting, for the removal; closing the file
/// afterwards lets it go).
fn remove_unless_held(path: &Path, lock: &std::fs::File) {
    use rustix::fs::FlockOperation::NonBlockingLockExclusive;
    if rustix::fs::flock(lock, NonBlockingLockExclusive).is_err() {
        // Another process's replicas use it; the last of them removes it.
        return;
    }
    match directory::remove(path) {
        Ok(()) => tracing::info!(path = %path.display(), "model directory removed: no replica uses it"),
        Err(e) => tracing::warn!(path = %path.display(), error = %e, "could not remove a model directory"),
    }
}

/// The report's name for where bytes came from: a reused materialization is
/// resident whatever the first load read.
fn source_name(source: Source, reused: bool) -> &'static str {
    if reused {
        Source::Resident.as_str()
    } else {
        source.as_str()
    }
}

/// Keeps `fd` open across `exec` in a child (clears its close-on-exec flag
/// there). For a `pre_exec` hook: one async-signal-safe `fcntl`.
pub(crate) fn inherit_in_child(fd: RawFd) -> std::io::Result<()> {
    // SAFETY: called in the forked child, where `fd` is still open (the
    // parent keeps it open until the engine has started).
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    rustix::io::fcntl_setfd(fd.as_fd(), rustix::io::FdFlags::empty()).map_err(std::io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_are_a_store_key_or_a_path() {
        let w: WeightsSource = "store:smol/lm2:q4".parse().unwrap();
        assert!(matches!(&w, WeightsSource::Store(k) if k.to_string() == "smol/lm2:q4"));
        assert_eq!(w.to_string(), "store:smol/lm2:q4");
        let latest: WeightsSource = "store:smol".parse().unwrap();
        assert_eq!(latest.to_string(), "store:smol:latest");
        assert_eq!(
            "m/model.gguf".parse::<WeightsSource>().unwrap(),
            WeightsSource::File("m/model.gguf".into())
        );
        let bad = "store:a/../b".parse::<WeightsSource>().unwrap_err();
        assert!(bad.contains("store:a/../b"), "{bad}");
        assert!("".parse::<WeightsSource>().is_err());
    }
}
