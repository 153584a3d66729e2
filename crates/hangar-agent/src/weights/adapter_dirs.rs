//! LoRA adapters on a fleet's node: the directory an engine here loads an
//! adapter from (docs/adapters.md, "On a fleet").
//!
//! A fleet's gateways carry out the adapter slots' loads, but the engine
//! that loads an adapter reads a path on its own node's disk. So before
//! posting the load, the gateway asks the replica's agent for that path,
//! naming the adapter and the artifact the fleet serves under its name;
//! the agent materializes the artifact through the node's store daemon —
//! from its own blob store if this node registered the adapter, else from
//! a peer that holds it (the store's registry) or the fallback, each
//! chunk verified — checks that it is bound to that adapter, and writes
//! its files once under `<store root>/adapter-dirs/<artifact id>/`, where
//! every later load on the node finds them.
//!
//! The adapters this node's own store registers for a model it serves are
//! made ahead of need ([`WeightStore::make_adapter_dirs_ahead`]), as a
//! single machine exports its store's: their first request pays the
//! engine's load only, not a materialization and a write of every byte
//! (265 ms at the median for 67 MB in `hangar bench adapters --fleet`).
//! Those of other nodes' stores are made on demand, since a fleet's
//! adapters may be far more than one node should copy.
//!
//! A directory nobody asked for within [`ADAPTER_DIR_IDLE`] is removed
//! (an engine that loaded it keeps what it read) unless it was made ahead
//! for an adapter the node still registers; directories found on
//! disk (an earlier run's) count as asked when first seen, and are written
//! again before they are first answered, so that every answer rests on a
//! binding this process checked.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hangar_core::AdapterRef;
use hangar_store::client::{StoreClient, TargetMemory};
use hangar_store::protocol::Selection;
use hangar_store::{adapters, directory, ArtifactId};

use super::WeightStore;

/// How long an adapter directory nobody asks for stays on the node's disk.
pub const ADAPTER_DIR_IDLE: Duration = Duration::from_secs(3600);

/// Why the directory of an adapter could not be made on this node; each
/// names the adapter and its artifact.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdapterDirError {
    /// The node's store daemon does not answer (503).
    #[error("adapter {adapter}: the weight store at {socket} is not reachable: {why}")]
    Unreachable {
        /// The adapter.
        adapter: AdapterRef,
        /// The daemon's socket.
        socket: String,
        /// What connecting said.
        why: String,
    },
    /// No source has the artifact, or loading it failed (502: the store's
    /// message names every source and what it said).
    #[error("adapter {adapter}: artifact {id} could not be loaded on this node: {why}")]
    Load {
        /// The adapter.
        adapter: AdapterRef,
        /// Its artifact.
        id: ArtifactId,
        /// What the store said.
        why: String,
    },
    /// The artifact is not that adapter (409).
    #[error("adapter {adapter}: artifact {id} {what}")]
    NotThisAdapter {
        /// The adapter asked for.
        adapter: AdapterRef,
        /// The artifact named.
        id: ArtifactId,
        /// What the artifact is instead.
        what: String,
    },
    /// Writing the directory failed (500).
    #[error("adapter {adapter}: writing artifact {id} under {under}: {why}")]
    Write {
        /// The adapter.
        adapter: AdapterRef,
        /// Its artifact.
        id: ArtifactId,
        /// The directory written under.
        under: String,
        /// What failed, naming the file.
        why: String,
    },
}

impl AdapterDirError {
    /// The HTTP status the agent answers it with.
    pub fn status(&self) -> u16 {
        match self {
            AdapterDirError::Unreachable { .. } => 503,
            AdapterDirError::Load { .. } => 502,
            AdapterDirError::NotThisAdapter { .. } => 409,
            AdapterDirError::Write { .. } => 500,
        }
    }
}

/// What [`WeightStore::adapter_dir`] fills a directory with, or why not.
enum Fill {
    Unreachable(String),
    Load(String),
    NotThis(String),
    Write(hangar_store::StoreError),
}

impl From<hangar_store::StoreError> for Fill {
    fn from(e: hangar_store::StoreError) -> Self {
        Fill::Write(e)
    }
}

/// The node's adapter directories this process knows, by name (the
/// artifact's file name).
pub(super) type Known = HashMap<String, Arc<Mutex<KnownDir>>>;

/// One adapter directory: locked while it is made, checked or removed.
#[derive(Debug)]
pub(super) struct KnownDir {
    /// When it was last asked for.
    asked: Instant,
    /// The adapter its artifact is bound to, once this process checked
    /// it: a directory found on disk (an earlier run's) is written again
    /// before it is first answered, so no answer rests on an unchecked
    /// binding.
    adapter: Option<AdapterRef>,
}

/// What [`WeightStore::make_adapter_dirs_ahead`] keeps between calls.
#[derive(Debug, Default)]
pub(super) struct Ahead {
    /// The directories (artifact file names) it was last asked to keep.
    keep: HashSet<String>,
    /// Artifacts whose making failed: left to be made on demand, not tried
    /// again every call (nor named in the log again).
    failed: HashSet<ArtifactId>,
}

impl KnownDir {
    /// A directory first heard of now: asked for now, its binding not
    /// checked by this process.
    fn first_seen() -> Arc<Mutex<KnownDir>> {
        Arc::new(Mutex::new(KnownDir { asked: Instant::now(), adapter: None }))
    }
}

impl WeightStore {
    /// Where this node's adapter directories are.
    fn adapter_dirs(&self) -> PathBuf {
        self.settings.root().join(adapters::EXPORT_DIRS)
    }

    /// The directory an engine on this node loads `adapter` from: the
    /// artifact `id`, materialized through the store daemon, checked to be
    /// bound to `adapter`, and written once per node. Blocking: it may
    /// fetch the artifact from a peer.
    pub fn adapter_dir(&self, adapter: &AdapterRef, id: ArtifactId) -> Result<PathBuf, Box<AdapterDirError>> {
        let (under, socket) = (self.adapter_dirs(), self.settings.socket());
        let known = {
            let mut dirs = self.adapter_dirs_known.lock().expect("adapter directories lock");
            dirs.entry(id.file_name()).or_insert_with(KnownDir::first_seen).clone()
        };
        // Held until answered: a prune skips it, a second asking waits.
        let mut known = known.lock().expect("adapter directory lock");
        known.asked = Instant::now();
        let failed = |e: Fill| {
            Box::new(match e {
                Fill::Unreachable(why) => AdapterDirError::Unreachable {
                    adapter: adapter.clone(),
                    socket: socket.display().to_string(),
                    why,
                },
                Fill::Load(why) => AdapterDirError::Load { adapter: adapter.clone(), id, why },
                Fill::NotThis(what) => AdapterDirError::NotThisAdapter { adapter: adapter.clone(), id, what },
                Fill::Write(e) => AdapterDirError::Write {
                    adapter: adapter.clone(),
                    id,
                    under: under.display().to_string(),
                    why: e.to_string(),
                },
            })
        };
        match &known.adapter {
            Some(bound) if bound != adapter => {
                return Err(failed(Fill::NotThis(format!("is bound to adapter {bound}"))))
            }
            Some(_) => {}
            None => directory::remove(&under.join(id.file_name())).map_err(|e| failed(Fill::Write(e)))?,
        }
        let written = directory::publish(&under, &id, adapters::CONFIG_FILE, |dir: &Path| {
            let mut client = StoreClient::connect(&socket).map_err(|e| Fill::Unreachable(e.to_string()))?;
            let selection = Selection { artifact_id: id, view: None, key: None };
            let (_, index) = client.describe(&selection).map_err(|e| Fill::Load(e.to_string()))?;
            // Into this process's memory, the daemon keeping no copy: the
            // directory is what the node keeps.
            let target = TargetMemory::allocate(index.data_len).map_err(|e| Fill::Load(e.to_string()))?;
            let into =
                client.materialize_into(&selection, &target, 0).map_err(|e| Fill::Load(e.to_string()))?;
            let data = &target.bytes()[..into.bytes as usize];
            adapters::check_binding(&into.index, data, adapter).map_err(Fill::NotThis)?;
            // Cached: a directory found after a restart is written again
            // before it is answered, never trusted.
            adapters::write_files(&into.index, data, dir, directory::Durability::Cached)?;
            Ok(())
        });
        let path = written.map_err(failed)?;
        known.adapter = Some(adapter.clone());
        Ok(path)
    }

    /// Makes the directory of each of `own` — the adapters this node's own
    /// store registers for a model it serves, with their artifacts — that
    /// this process has not made yet, one after another, and keeps all of
    /// them from [`prune_adapter_dirs`](Self::prune_adapter_dirs) until a
    /// later call leaves them out. Answers the failures, each once (that
    /// adapter is then made when a request needs it). Blocking: each is a
    /// materialization through the node's daemon from its own blob store.
    pub fn make_adapter_dirs_ahead(&self, own: &[(AdapterRef, ArtifactId)]) -> Vec<Box<AdapterDirError>> {
        let keep: HashSet<String> = own.iter().map(|(_, id)| id.file_name()).collect();
        let failed = {
            let mut ahead = self.adapter_dirs_ahead.lock().expect("adapter directories ahead lock");
            ahead.keep = keep;
            ahead.failed.clone()
        };
        let mut errors = Vec::new();
        for (adapter, id) in own {
            if failed.contains(id) || self.adapter_dir_made(adapter, *id) {
                continue;
            }
            if let Err(e) = self.adapter_dir(adapter, *id) {
                self.adapter_dirs_ahead.lock().expect("adapter directories ahead lock").failed.insert(*id);
                errors.push(e);
            }
        }
        errors
    }

    /// Whether this process made (or checked) the directory of `id` for
    /// `adapter`; `false` while another thread makes it.
    fn adapter_dir_made(&self, adapter: &AdapterRef, id: ArtifactId) -> bool {
        let known =
            self.adapter_dirs_known.lock().expect("adapter directories lock").get(&id.file_name()).cloned();
        known.is_some_and(|k| k.try_lock().is_ok_and(|k| k.adapter.as_ref() == Some(adapter)))
    }

    /// Removes the adapter directories nobody asked for within `idle`
    /// (one found on disk for the first time counts as asked now) but
    /// those made ahead of need and still kept, and answers how many; one
    /// being made or answered now is left, as is work in progress (hidden
    /// temporary directories). Blocking.
    pub fn prune_adapter_dirs(&self, idle: Duration) -> Result<usize, hangar_store::StoreError> {
        let under = self.adapter_dirs();
        let entries = match std::fs::read_dir(&under) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => {
                return Err(hangar_store::StoreError::Io { path: under.display().to_string(), source: e })
            }
        };
        let keep = self.adapter_dirs_ahead.lock().expect("adapter directories ahead lock").keep.clone();
        let mut dirs = self.adapter_dirs_known.lock().expect("adapter directories lock");
        let mut removed = 0;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || !entry.file_type().is_ok_and(|t| t.is_dir()) || keep.contains(&name) {
                continue;
            }
            let known = dirs.entry(name.clone()).or_insert_with(KnownDir::first_seen).clone();
            // Locked: being made or answered now, so asked for now.
            let Ok(known) = known.try_lock() else { continue };
            if known.asked.elapsed() >= idle {
                directory::remove(&entry.path())?;
                drop(known);
                dirs.remove(&name);
                removed += 1;
            }
        }
        Ok(removed)
    }
}
