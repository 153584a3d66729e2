//! The per-node store daemon (`hangar store serve`).
//!
//! Local clients talk to it over a Unix-domain socket ([`crate::protocol`]);
//! peers, the registry and Prometheus talk to it over HTTP on TCP
//! ([`http`]). It keeps artifacts resident in sealed memfds, shares an
//! already-resident artifact with every caller that selects it
//! (lease-in-place), tracks holders in a [`Residency`] table (per pid, with
//! pidfd-based death detection, or TTL leases) and loads misses from, in
//! order: the local blob store, a peer daemon found through the registry,
//! the fallback source ([`load`]).
//!
//! `Materialize` answers as soon as memory is allocated; the load continues
//! in a task and `Confirm` waits for it. `MaterializeIntoTarget` instead
//! writes into a region of the caller's own memfd, passed with the request,
//! and answers when it is filled: no holder, no resident, nothing stored. A failed load is removed from the
//! resident table at once, so its memory is never handed to a later caller.
//!
//! Under a disk budget the daemon drops the bytes of stored artifacts
//! nothing uses, never their keys: such an artifact is loaded again like
//! any miss (peer, then fallback), and stored again.
//!
//! With a registry and a TCP listener, the daemon's first heartbeat is sent
//! before it serves: a node name another live daemon holds stops it from
//! starting ([`StoreError::NodeNameTaken`]).

mod http;
mod load;
mod uds;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hangar_core::{Millis, ReplicaId};
use tokio::sync::{oneshot, watch};

use crate::blob::BlobStore;
use crate::blob::CommitReport;
use crate::error::StoreError;
use crate::fallback::Fallback;
use crate::id::{ArtifactId, StoreKey};
use crate::index::{CanonicalIndex, TensorSpec};
use crate::memory::SharedRegion;
use crate::protocol::{ErrorKind, ResidentInfo, Selection, Source};
use crate::residency::{Owner, Residency, ResidencyError};
use crate::telemetry::Telemetry;

/// Longest a `Confirm` waits, whatever the caller asks.
pub const MAX_CONFIRM: Duration = Duration::from_secs(30);

/// How the daemon is set up.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    /// Blob store root.
    pub root: PathBuf,
    /// Unix socket path for local clients.
    pub socket: PathBuf,
    /// TCP address for peers and `/metrics` (port 0 picks one); `None` disables P2P serving.
    pub listen: Option<SocketAddr>,
    /// URL peers should use; default `http://<bound listen address>`.
    pub advertise: Option<String>,
    /// Node name reported to the registry, one daemon's: while another
    /// live daemon (another URL) holds it the registry refuses it, and the
    /// daemon does not start ([`StoreError::NodeNameTaken`]).
    pub node: String,
    /// Resident memory budget in bytes.
    pub budget: u64,
    /// Registry base URL.
    pub registry: Option<String>,
    /// Heartbeat period.
    pub heartbeat: Duration,
    /// Fallback directory or object-store URL.
    pub fallback: Option<String>,
    /// A peer that sends nothing for this long is abandoned for the next source.
    pub peer_timeout: Duration,
    /// Fault injection for tests: stop sending artifact data to peers after
    /// this many bytes (the connection stays open, as with a hung peer).
    pub fault_stall_after: Option<u64>,
    /// Bytes the blob store may hold on disk: after each materialization,
    /// the bytes of artifacts beyond it are dropped least recently used
    /// first, never one a holder references ([`crate::disk_budget`]); their
    /// keys stay and a later load fetches them again. `None`: no limit.
    pub disk_budget: Option<u64>,
    /// Publishes of one artifact within this window of the first join its
    /// publish context and only refresh it ([`crate::publish`]).
    pub publish_dedupe_window: Duration,
}

impl DaemonConfig {
    /// A config with defaults: no TCP, no registry, no fallback, 4 GiB
    /// budget, the machine's host name as node name.
    pub fn new(root: impl Into<PathBuf>, socket: impl Into<PathBuf>) -> Self {
        DaemonConfig {
            root: root.into(),
            socket: socket.into(),
            listen: None,
            advertise: None,
            node: host_name().unwrap_or_else(|| format!("node-{}", std::process::id())),
            budget: 4 << 30,
            registry: None,
            heartbeat: Duration::from_secs(2),
            fallback: None,
            peer_timeout: Duration::from_secs(5),
            fault_stall_after: None,
            disk_budget: None,
            publish_dedupe_window: Duration::from_millis(crate::publish::DEFAULT_WINDOW_MS),
        }
    }
}

/// The machine's host name (the kernel's, which a container without
/// `/etc/hostname` also has).
fn host_name() -> Option<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    Some(name.trim().to_owned()).filter(|n| !n.is_empty())
}

/// State of one resident's load.
#[derive(Debug, Clone, PartialEq, Eq)]
enum LoadStatus {
    Loading,
    Ready { source: Source, bytes: u64, duration_ms: u64 },
    Failed { kind: ErrorKind, message: String },
}

#[derive(Debug, Clone)]
struct Resident {
    region: Arc<SharedRegion>,
    index: Arc<CanonicalIndex>,
    status: watch::Receiver<LoadStatus>,
}

#[derive(Debug)]
struct State {
    residency: Residency,
    residents: HashMap<ArtifactId, Resident>,
    /// Replicas whose artifact failed to load, with the error, until they
    /// `Confirm` or `Unload` (their references are already gone).
    failed: HashMap<ReplicaId, (ErrorKind, String)>,
    /// The stored artifact each resident was made from (itself, or a
    /// view's parent): what a holder keeps on disk.
    stored_of: HashMap<ArtifactId, ArtifactId>,
}

/// What `Materialize` hands back.
#[derive(Debug, Clone)]
pub struct Granted {
    /// Id of what is mapped (view id for a view).
    pub id: ArtifactId,
    /// The memory.
    pub region: Arc<SharedRegion>,
    /// Its layout.
    pub index: Arc<CanonicalIndex>,
    /// Lease-in-place hit.
    pub reused: bool,
}

/// The daemon's shared core; cheap to clone.
#[derive(Debug)]
struct Core {
    cfg: DaemonConfig,
    blobs: BlobStore,
    epoch: Instant,
    state: Mutex<State>,
    telemetry: Telemetry,
    http: reqwest::Client,
    fallback: Option<Fallback>,
    own_url: Mutex<Option<String>>,
    watched: Mutex<HashSet<u32>>,
    internal: std::sync::atomic::AtomicU64,
    registrations: Mutex<HashMap<ReplicaId, Pending>>,
    /// Wakes the heartbeat loop when an ingestion is published.
    announce: tokio::sync::Notify,
}

/// A streaming registration waiting for its producer to commit.
#[derive(Debug)]
struct Pending {
    region: Arc<SharedRegion>,
    index: CanonicalIndex,
    keys: Vec<StoreKey>,
}

impl Core {
    fn now(&self) -> Millis {
        self.epoch.elapsed().as_millis() as Millis
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("daemon state not poisoned")
    }

    /// Lease-in-place: if `id` is resident and not failed, add the holder and return it.
    fn try_lip(
        &self,
        st: &mut State,
        id: ArtifactId,
        replica: ReplicaId,
        owner: Owner,
    ) -> Result<Option<Granted>, StoreError> {
        let Some(r) = st.residents.get(&id) else { return Ok(None) };
        if matches!(*r.status.borrow(), LoadStatus::Failed { .. }) {
            return Ok(None);
        }
        let granted = Granted { id, region: r.region.clone(), index: r.index.clone(), reused: true };
        st.residency.acquire(replica, id, owner, self.now()).map_err(residency_err)?;
        Ok(Some(granted))
    }

    /// `Materialize`: returns memory for the selection as soon as it is allocated.
    async fn materialize(
        self: &Arc<Self>,
        sel: &Selection,
        replica: ReplicaId,
        owner: Owner,
    ) -> Result<Granted, StoreError> {
        let id = match &sel.view {
            Some(v) => ArtifactId::view_of(&sel.artifact_id, &v.canonical()),
            None => sel.artifact_id,
        };
        if let ArtifactId::View(_) = sel.artifact_id {
            return Err(StoreError::View("select the parent artifact id and give the view spec".into()));
        }
        self.lock().stored_of.insert(id, sel.artifact_id);
        // Marked used (and the disk budget applied) only once the caller
        // holds it, so the budget never drops what is being materialized.
        if let Some(g) = self.try_lip(&mut self.lock(), id, replica, owner)? {
            self.telemetry.materialized(true);
            self.watch_owner(owner);
            self.used(sel.artifact_id);
            return Ok(g);
        }
        let job = self.clone().plan(sel, load::Mode::Resident).await?;
        let index = Arc::new(job.index().clone());
        let (granted, writer, tx) = {
            let mut st = self.lock();
            if let Some(g) = self.try_lip(&mut st, id, replica, owner)? {
                self.telemetry.materialized(true);
                drop(st);
                self.watch_owner(owner);
                self.used(sel.artifact_id);
                return Ok(g);
            }
            let now = self.now();
            let evicted = st.residency.reserve(id, index.data_len.max(1), now).map_err(residency_err)?;
            for e in &evicted {
                st.residents.remove(e);
                tracing::info!(id = %e, "evicted unreferenced resident");
            }
            self.telemetry.evicted(evicted.len());
            let (region, writer) = match SharedRegion::allocate(&id.file_name(), index.data_len) {
                Ok(x) => x,
                Err(e) => {
                    st.residency.remove(&id);
                    return Err(StoreError::Io { path: "memfd".into(), source: e });
                }
            };
            let region = Arc::new(region);
            let (tx, rx) = watch::channel(LoadStatus::Loading);
            st.residents.insert(id, Resident { region: region.clone(), index: index.clone(), status: rx });
            st.residency.acquire(replica, id, owner, now).map_err(residency_err)?;
            self.telemetry.set_resident(st.residency.used());
            (Granted { id, region, index, reused: false }, writer, tx)
        };
        self.telemetry.materialized(false);
        self.watch_owner(owner);
        self.used(sel.artifact_id);
        tokio::spawn(self.clone().run_load(id, job, writer, tx));
        Ok(granted)
    }

    async fn run_load(
        self: Arc<Self>,
        id: ArtifactId,
        job: load::Job,
        writer: memmap2::MmapMut,
        tx: watch::Sender<LoadStatus>,
    ) {
        let bytes = job.index().data_len;
        let ctx = self.telemetry.started(id, bytes, false);
        let t0 = Instant::now();
        let result = self.clone().load(id, job, load::Dest::Shared(writer), load::Mode::Resident, ctx).await;
        let duration_ms = t0.elapsed().as_millis() as u64;
        match result {
            Ok(source) => {
                self.telemetry.finished(ctx, id, Ok(source), bytes, duration_ms, false);
                let _ = tx.send(LoadStatus::Ready { source, bytes, duration_ms });
                // A load from a peer or the fallback stored a new blob.
                let stored = self.lock().stored_of.get(&id).copied().unwrap_or(id);
                self.used(stored);
            }
            Err(e) => {
                let message = e.to_string();
                self.telemetry.finished(ctx, id, Err(&message), bytes, duration_ms, false);
                {
                    let mut st = self.lock();
                    st.residents.remove(&id);
                    for replica in st.residency.remove(&id) {
                        st.failed.insert(replica, (error_kind(&e), message.clone()));
                    }
                    self.telemetry.set_resident(st.residency.used());
                }
                let _ = tx.send(LoadStatus::Failed { kind: error_kind(&e), message });
            }
        }
    }

    /// `MaterializeIntoTarget`: streams the selection into the caller's
    /// region `offset..offset+len` of the memfd `fd` and returns once every
    /// byte is written and verified. The daemon allocates nothing for the
    /// data and keeps nothing: no holder, no resident, no blob (a peer's or
    /// the fallback's bytes are not persisted); it maps the region for the
    /// call and unmaps it when done. Sources, in order: a ready resident
    /// copy (of the selection, or of a view's parent), the local blob
    /// store, peers, the fallback. The region is checked before anything
    /// is written ([`crate::memory::TargetError`]); on a load error its
    /// contents are unspecified.
    ///
    /// # Cancel safety
    /// Cancel-safe in effect: dropping it stops the load at its next await
    /// and unmaps the region (a blocking copy already running finishes
    /// into the caller's memory first).
    async fn materialize_into(
        self: &Arc<Self>,
        sel: &Selection,
        fd: Option<std::os::fd::OwnedFd>,
        offset: u64,
        len: u64,
    ) -> Result<(ArtifactId, CanonicalIndex, Source, u64, u64), StoreError> {
        if let ArtifactId::View(_) = sel.artifact_id {
            return Err(StoreError::View("select the parent artifact id and give the view spec".into()));
        }
        let id = match &sel.view {
            Some(v) => ArtifactId::view_of(&sel.artifact_id, &v.canonical()),
            None => sel.artifact_id,
        };
        let fd = fd.ok_or(crate::memory::TargetError::NoFd)?;
        let target = crate::memory::TargetMap::open(std::os::fd::AsFd::as_fd(&fd), offset, len)?;
        drop(fd);
        let job = self.clone().plan(sel, load::Mode::Target).await?;
        let index = job.index().clone();
        let bytes = index.data_len;
        if target.len() < bytes {
            return Err(crate::memory::TargetError::TooSmall {
                region: target.len(),
                need: bytes,
                what: id.to_string(),
            }
            .into());
        }
        let ctx = self.telemetry.started(id, bytes, true);
        let t0 = Instant::now();
        let result = self.clone().load(id, job, load::Dest::Target(target), load::Mode::Target, ctx).await;
        let duration_ms = t0.elapsed().as_millis() as u64;
        match result {
            Ok(source) => {
                self.telemetry.finished(ctx, id, Ok(source), bytes, duration_ms, true);
                self.used(sel.artifact_id);
                Ok((id, index, source, bytes, duration_ms))
            }
            Err(e) => {
                self.telemetry.finished(ctx, id, Err(&e.to_string()), bytes, duration_ms, true);
                Err(e)
            }
        }
    }

    /// `Describe`: the id and layout of a selection — what a caller sizes
    /// its target region by — without loading or allocating anything.
    async fn describe(self: &Arc<Self>, sel: &Selection) -> Result<(ArtifactId, CanonicalIndex), StoreError> {
        if let ArtifactId::View(_) = sel.artifact_id {
            return Err(StoreError::View("select the parent artifact id and give the view spec".into()));
        }
        let id = match &sel.view {
            Some(v) => ArtifactId::view_of(&sel.artifact_id, &v.canonical()),
            None => sel.artifact_id,
        };
        let job = self.clone().plan(sel, load::Mode::Target).await?;
        Ok((id, job.index().clone()))
    }

    /// Publishes that ingestion `context` left `id` stored on this node
    /// (deduplicated, [`crate::publish`]) and, when it was published,
    /// wakes the heartbeat so the registry hears of it now.
    fn publish_stored(&self, context: u64, id: ArtifactId, source: Source, bytes: u64) {
        if self.telemetry.publish(self.now(), context, id, source, bytes) {
            self.announce.notify_one();
        }
    }

    /// Marks `stored` used (if this node stores it) and, under a disk
    /// budget, drops what exceeds it; in the background, off the
    /// caller's path.
    fn used(self: &Arc<Self>, stored: ArtifactId) {
        let core = self.clone();
        tokio::task::spawn_blocking(move || core.used_now(stored));
    }

    /// [`Core::used`] on the calling thread (it does file I/O).
    fn used_now(&self, stored: ArtifactId) {
        if self.blobs.contains(&stored) {
            if let Err(e) = self.blobs.mark_used(&stored) {
                tracing::warn!(id = %stored, "cannot mark the artifact used: {e}");
            }
        }
        if let Err(e) = self.reap_disk() {
            tracing::warn!("disk budget: {e}");
        }
    }

    /// Drops the bytes of stored artifacts beyond the disk budget, least
    /// recently used first, never those a holder references; their keys
    /// stay, so a later load fetches them again. Returns what it dropped.
    fn reap_disk(&self) -> Result<Vec<ArtifactId>, StoreError> {
        let Some(budget) = self.cfg.disk_budget else { return Ok(Vec::new()) };
        let referenced: HashSet<ArtifactId> = {
            let mut st = self.lock();
            let live: HashSet<ArtifactId> = st.residency.residents().map(|(id, _, _)| id).collect();
            st.stored_of.retain(|id, _| live.contains(id));
            st.residency
                .residents()
                .filter(|(_, _, refs)| *refs > 0)
                .map(|(id, _, _)| st.stored_of.get(&id).copied().unwrap_or(id))
                .collect()
        };
        let dropped = self.blobs.enforce_disk_budget(budget, &referenced)?;
        for id in &dropped {
            tracing::info!(%id, "dropped from disk, keys kept: the store is over its disk budget and nothing uses it");
            // No longer stored here: its next store is published again.
            self.telemetry.unpublished(id);
        }
        Ok(dropped)
    }

    /// `Confirm`: waits (at most [`MAX_CONFIRM`]) for the replica's load.
    async fn confirm(&self, replica: ReplicaId, timeout: Duration) -> Result<(Source, u64, u64), StoreError> {
        let (id, mut rx) = {
            let mut st = self.lock();
            if let Some((kind, message)) = st.failed.remove(&replica) {
                return Err(StoreError::LoadFailed { kind, message });
            }
            let Some((id, _)) = st.residency.holder(&replica) else {
                return Err(StoreError::UnknownHandle(format!(
                    "replica {replica} holds nothing (never materialized, unloaded, or its load failed)"
                )));
            };
            (id, st.residents.get(&id).expect("holders point at residents").status.clone())
        };
        let wait = rx.wait_for(|s| *s != LoadStatus::Loading);
        let status = match tokio::time::timeout(timeout.min(MAX_CONFIRM), wait).await {
            Err(_) => return Err(StoreError::Timeout(id)),
            Ok(Err(_)) => return Err(StoreError::UnknownHandle(replica.to_string())),
            Ok(Ok(s)) => s.clone(),
        };
        match status {
            LoadStatus::Ready { source, bytes, duration_ms } => Ok((source, bytes, duration_ms)),
            LoadStatus::Failed { kind, message } => Err(StoreError::LoadFailed { kind, message }),
            LoadStatus::Loading => unreachable!("waited for not loading"),
        }
    }

    /// `Unload`: drops the replica's reference; `false` if it held nothing.
    fn unload(&self, replica: ReplicaId) -> bool {
        let mut st = self.lock();
        st.failed.remove(&replica);
        let released = st.residency.release(&replica, self.now()).is_some();
        self.telemetry.set_resident(st.residency.used());
        released
    }

    /// `KeepAlive`: extends a lease; returns ms to expiry.
    fn keep_alive(&self, replica: ReplicaId, ttl: Millis) -> Result<u64, StoreError> {
        let now = self.now();
        let at = self.lock().residency.keep_alive(&replica, ttl, now).map_err(residency_err)?;
        Ok(at - now)
    }

    /// `ResolveKey`: local keys, then the registry.
    async fn resolve_key(&self, key: &StoreKey) -> Result<ArtifactId, StoreError> {
        if let Some(id) = self.blobs.keys()?.get(key) {
            return Ok(*id);
        }
        if let Some(reg) = &self.cfg.registry {
            let url = format!("{reg}/v1/keys/{key}");
            match self.http.get(&url).send().await {
                Ok(r) if r.status().is_success() => {
                    #[derive(serde::Deserialize)]
                    struct Resolved {
                        id: ArtifactId,
                    }
                    if let Ok(r) = r.json::<Resolved>().await {
                        return Ok(r.id);
                    }
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(%url, error = %e, "registry unreachable for key lookup"),
            }
        }
        Err(StoreError::UnknownKey(key.clone()))
    }

    fn status(&self) -> (u64, u64, Vec<ResidentInfo>) {
        let st = self.lock();
        let mut residents: Vec<ResidentInfo> = st
            .residency
            .residents()
            .map(|(id, bytes, refs)| ResidentInfo {
                id,
                bytes,
                refs,
                ready: matches!(*st.residents[&id].status.borrow(), LoadStatus::Ready { .. }),
            })
            .collect();
        residents.sort_by_key(|r| r.id);
        (st.residency.used(), st.residency.budget(), residents)
    }

    /// Releases a process's references when it exits (pidfd readable).
    fn watch_owner(self: &Arc<Self>, owner: Owner) {
        let Owner::Pid(pid) = owner else { return };
        if !self.watched.lock().expect("not poisoned").insert(pid) {
            return;
        }
        let core = self.clone();
        tokio::spawn(async move {
            let exited = async {
                let raw = rustix::process::Pid::from_raw(pid as i32)?;
                let fd = rustix::process::pidfd_open(raw, rustix::process::PidfdFlags::empty()).ok()?;
                // SAFETY: `fd` is an OwnedFd moved into the AsyncFd, so it stays
                // open and the same descriptor for the AsyncFd's lifetime.
                let afd = unsafe {
                    tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
                }
                .ok()?;
                let _ = afd.readable().await;
                Some(())
            };
            // `None`: the process was already gone (or pid invalid): release now.
            let _ = exited.await;
            let mut st = core.lock();
            let released = st.residency.release_pid(pid, core.now());
            core.telemetry.set_resident(st.residency.used());
            core.watched.lock().expect("not poisoned").remove(&pid);
            if !released.is_empty() {
                tracing::info!(pid, handles = released.len(), "client exited; released its references");
            }
        });
    }

    /// `BeginRegister`: lays out the tensors and allocates a writable memfd
    /// of that layout for the producer.
    fn begin_register(
        &self,
        tensors: Vec<TensorSpec>,
        keys: Vec<StoreKey>,
    ) -> Result<(ReplicaId, CanonicalIndex, Arc<SharedRegion>), StoreError> {
        let index = CanonicalIndex::build(tensors)?;
        if index.data_len == 0 {
            return Err(crate::index::IndexError::Empty.into());
        }
        let region = SharedRegion::allocate_for_producer("hangar-register", index.data_len)
            .map_err(|e| StoreError::Io { path: "memfd".into(), source: e })?;
        let region = Arc::new(region);
        let handle = self.internal_replica();
        let pending = Pending { region: region.clone(), index: index.clone(), keys };
        self.registrations.lock().expect("not poisoned").insert(handle, pending);
        Ok((handle, index, region))
    }

    /// `CommitRegister`: hashes what the producer wrote, runs the serving
    /// preflight under `policy`, stores it, and publishes the ingestion
    /// (`ingestion_started`, `ingestion_completed` with source `register`,
    /// then `ingestion_published` unless deduplicated).
    ///
    /// # Cancel safety
    /// Not cancel-safe: the registration is taken before hashing; dropped
    /// mid-way, it is gone (the producer begins again).
    async fn commit_register(
        self: &Arc<Self>,
        handle: ReplicaId,
        policy: crate::preflight::ServingPolicy,
    ) -> Result<CommitReport, StoreError> {
        let p = self
            .registrations
            .lock()
            .expect("not poisoned")
            .remove(&handle)
            .ok_or_else(|| StoreError::UnknownHandle(format!("registration {handle}")))?;
        let blobs = self.blobs.clone();
        let bytes = p.index.data_len;
        let t0 = Instant::now();
        let result = tokio::task::spawn_blocking(move || {
            let map = p.region.map().map_err(|e| StoreError::Io { path: "memfd".into(), source: e })?;
            let mut reg = blobs.register(
                p.index
                    .tensors
                    .iter()
                    .map(|t| TensorSpec { name: t.name.clone(), dtype: t.dtype, shape: t.shape.clone() })
                    .collect(),
            )?;
            for t in &p.index.tensors {
                reg.feed(&t.name, &map[t.offset as usize..(t.offset + t.len) as usize])?;
            }
            reg.commit_with(&p.keys, &policy)
        })
        .await
        .map_err(|e| StoreError::Source { source_name: "registration".into(), reason: e.to_string() })?;
        let report = result?;
        let ctx = self.telemetry.started(report.id, bytes, false);
        let ms = t0.elapsed().as_millis() as u64;
        self.telemetry.finished(ctx, report.id, Ok(Source::Register), bytes, ms, false);
        self.publish_stored(ctx, report.id, Source::Register, bytes);
        Ok(report)
    }

    /// `AbortRegister` (also run for a producer's connection that closes
    /// with registrations open): forgets the registration.
    fn abort_register(&self, handle: ReplicaId) -> bool {
        self.registrations.lock().expect("not poisoned").remove(&handle).is_some()
    }

    fn internal_replica(&self) -> ReplicaId {
        let n = self.internal.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        ReplicaId::from_u128((0xffff_u128 << 112) | n as u128)
    }
}

fn residency_err(e: ResidencyError) -> StoreError {
    match e {
        ResidencyError::OutOfBudget { need, budget, pinned } => {
            StoreError::OutOfBudget { need, budget, pinned }
        }
        other => StoreError::UnknownHandle(other.to_string()),
    }
}

/// The wire kind of an error.
pub fn error_kind(e: &StoreError) -> ErrorKind {
    match e {
        StoreError::UnknownKey(_) => ErrorKind::UnknownKey,
        StoreError::UnknownArtifact(_) | StoreError::NotOnDisk { .. } | StoreError::Unavailable(_) => {
            ErrorKind::UnknownArtifact
        }
        StoreError::LoadFailed { kind, .. } => *kind,
        StoreError::HashMismatch { .. } | StoreError::Corrupt { .. } => ErrorKind::HashMismatch,
        StoreError::OutOfBudget { .. } => ErrorKind::OutOfBudget,
        StoreError::Timeout(_) => ErrorKind::Timeout,
        StoreError::Preflight(_) => ErrorKind::Preflight,
        StoreError::View(_)
        | StoreError::UnknownHandle(_)
        | StoreError::Parse(_)
        | StoreError::Index(_)
        | StoreError::Format(_)
        | StoreError::Target(_) => ErrorKind::BadRequest,
        _ => ErrorKind::Internal,
    }
}

/// A running daemon. Dropping it shuts the daemon down and removes its socket.
#[derive(Debug)]
pub struct DaemonHandle {
    socket: PathBuf,
    http: Option<SocketAddr>,
    service: crate::service::ServiceThread,
}

impl DaemonHandle {
    /// Starts a daemon on its own runtime thread; returns once its sockets are bound.
    pub fn start(cfg: DaemonConfig) -> Result<DaemonHandle, StoreError> {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (shutdown_tx, shutdown_rx) = oneshot::channel();
        let socket = cfg.socket.clone();
        let thread = std::thread::Builder::new()
            .name("hangar-store-daemon".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ =
                            ready_tx.send(Err(StoreError::Io { path: "tokio runtime".into(), source: e }));
                        return;
                    }
                };
                rt.block_on(async move {
                    match serve(cfg).await {
                        Ok((addr, running)) => {
                            let _ = ready_tx.send(Ok(addr));
                            tokio::select! {
                                _ = running => {}
                                _ = shutdown_rx => {}
                            }
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                        }
                    }
                });
                rt.shutdown_timeout(Duration::from_secs(1));
            })
            .map_err(|e| StoreError::Io { path: "daemon thread".into(), source: e })?;
        let http = ready_rx.recv().map_err(|_| StoreError::Source {
            source_name: "daemon".into(),
            reason: "daemon thread exited during startup".into(),
        })??;
        Ok(DaemonHandle { socket, http, service: crate::service::ServiceThread::new(shutdown_tx, thread) })
    }

    /// The Unix socket path.
    pub fn socket(&self) -> &std::path::Path {
        &self.socket
    }

    /// The bound TCP address, if serving peers.
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http
    }

    /// Blocks until the daemon stops (it runs until killed).
    pub fn wait(mut self) {
        self.service.wait();
    }
}

impl Drop for DaemonHandle {
    fn drop(&mut self) {
        self.service.stop();
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// Binds everything and returns the TCP address plus the future that runs the daemon.
async fn serve(
    cfg: DaemonConfig,
) -> Result<(Option<SocketAddr>, impl std::future::Future<Output = ()>), StoreError> {
    let blobs = BlobStore::open(&cfg.root)?;
    let fallback = cfg.fallback.as_deref().map(Fallback::open).transpose()?;
    let tcp = match cfg.listen {
        Some(addr) => {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| StoreError::Io { path: addr.to_string(), source: e })?;
            Some(l)
        }
        None => None,
    };
    let http_addr = tcp.as_ref().and_then(|l| l.local_addr().ok());
    let own_url = cfg.advertise.clone().or_else(|| http_addr.map(|a| format!("http://{a}")));
    let window = cfg.publish_dedupe_window.as_millis() as Millis;
    let core = Arc::new(Core {
        state: Mutex::new(State {
            residency: Residency::new(cfg.budget),
            residents: HashMap::new(),
            failed: HashMap::new(),
            stored_of: HashMap::new(),
        }),
        cfg,
        blobs,
        epoch: Instant::now(),
        telemetry: Telemetry::new(window),
        announce: tokio::sync::Notify::new(),
        // Registry and peers are the fleet's own: never through the
        // environment's proxy (see `hangar_agent::direct_http`).
        http: reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(Duration::from_secs(2))
            .build()
            .map_err(|e| StoreError::Source { source_name: "http client".into(), reason: e.to_string() })?,
        fallback,
        own_url: Mutex::new(own_url),
        watched: Mutex::new(HashSet::new()),
        internal: std::sync::atomic::AtomicU64::new(0),
        registrations: Mutex::new(HashMap::new()),
    });
    // Before the socket exists: a daemon whose node name is taken leaves
    // nothing behind.
    if tcp.is_some() {
        load::register(&core).await?;
    }
    let uds = uds::bind(&core.cfg.socket)?;
    tracing::info!(socket = %core.cfg.socket.display(), http = ?http_addr, root = %core.cfg.root.display(), "store daemon listening");
    let running = async move {
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(uds::accept_loop(core.clone(), uds));
        if let Some(l) = tcp {
            tasks.spawn(http::serve(core.clone(), l));
            if core.cfg.registry.is_some() {
                tasks.spawn(load::heartbeat_loop(core.clone()));
            }
        }
        tasks.spawn(lease_ticker(core.clone()));
        let _ = tasks.join_next().await;
    };
    Ok((http_addr, running))
}

/// Expires TTL leases.
async fn lease_ticker(core: Arc<Core>) {
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tick.tick().await;
        let now = core.now();
        let mut st = core.lock();
        if st.residency.poll_timeout().is_some_and(|t| t <= now) {
            let expired = st.residency.handle_timeout(now);
            tracing::info!(leases = expired.len(), "TTL leases expired");
            core.telemetry.set_resident(st.residency.used());
        }
    }
}
