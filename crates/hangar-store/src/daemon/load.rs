//! Where a miss is loaded from: the local blob store, then a peer daemon
//! found through the registry, then the fallback source. An artifact the
//! store knows but whose bytes the disk budget dropped is fetched the same
//! way (its index, kept on disk, picks its files in the fallback). When no
//! source gives it, the error ([`StoreError::Unavailable`]) names the key,
//! the artifact and what every source tried said, on one line.
//!
//! Every path verifies bytes before `Confirm` reports success: local chunks
//! against the stored chunk list, peer chunks against the peer's chunk list
//! (itself checked against the id's data root), and fallback bytes by
//! recomputing the data root. A peer that fails or stalls longer than
//! `peer_timeout` is abandoned and the load resumes, from the last verified
//! chunk, with the next peer or the fallback. Artifacts obtained remotely are
//! written to the local blob store afterwards, so this node can serve them.
//! A view of a parent only peers hold fetches just the parent chunks it
//! reads, one chunk at a time through a chunk-sized buffer (and is not
//! persisted: the view is cheap to rebuild from a peer).
//!
//! A load runs in one of two [`Mode`]s. Into the daemon's own shared memory
//! (`Materialize`), remotely fetched artifacts are persisted and a view may
//! make its whole parent resident. Into a caller's region
//! (`MaterializeIntoTarget`) nothing is kept: no resident, no blob, no
//! staging copy of the data — a resident copy is copied out, the disk and
//! peers are streamed straight into the region, and a view of a parent
//! only the fallback holds is streamed through one chunk buffer.

use std::sync::Arc;
use std::time::Duration;

use memmap2::{Mmap, MmapMut};
use tokio::io::AsyncReadExt;

use super::Core;
use crate::blob::StoredArtifact;
use crate::chunks::{self, chunk_count, chunk_range};
use crate::error::{StoreError, Unavailable};
use crate::fallback::FallbackArtifact;
use crate::id::{hex, ArtifactId, Digest, StoreKey};
use crate::index::{CanonicalIndex, TensorSpec};
use crate::memory::TargetMap;
use crate::preflight::ServingPolicy;
use crate::protocol::{Selection, Source};
use crate::registry::{Heartbeat, Holders, NameTaken};
use crate::residency::Owner;
use crate::view::ViewPlan;

/// The future of [`Core::whole_parent`]: the parent's index and the parent.
type WholeParent<'a> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<(CanonicalIndex, Parent), StoreError>> + Send + 'a>,
>;

/// A planned load.
#[derive(Debug)]
pub(super) enum Job {
    /// From the local blob store.
    Local(StoredArtifact),
    /// From peers, then the fallback.
    Remote {
        index: CanonicalIndex,
        peers: Vec<String>,
        fallback: Option<FallbackArtifact>,
        key: Option<StoreKey>,
        /// What the sources tried while planning said (for the error if
        /// every source fails).
        tried: Vec<String>,
    },
    /// A view built from its parent.
    View { plan: ViewPlan, parent: Parent },
    /// A view of a parent that only peers hold: just the parent chunks the
    /// view reads are fetched; if no peer completes them, the whole parent
    /// is materialized (peers, then the fallback) and the view built from
    /// it — or, into a caller's region, streamed from the fallback.
    PeerView {
        plan: ViewPlan,
        parent: ArtifactId,
        parent_len: u64,
        peers: Vec<String>,
        key: Option<StoreKey>,
    },
    /// Into a caller's region: a view of a parent only the fallback holds,
    /// streamed chunk by chunk (every parent chunk hashed for the data root).
    FallbackView { plan: ViewPlan, parent: ArtifactId, found: FallbackArtifact },
    /// Into a caller's region: a copy of a resident, verified when it was loaded.
    Resident { memory: Mmap, index: CanonicalIndex },
}

/// Into whose memory a load writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// The daemon's shared memory (`Materialize`): remote fetches are
    /// persisted, a view may make its whole parent resident.
    Resident,
    /// A caller's region (`MaterializeIntoTarget`): nothing kept.
    Target,
}

/// The memory a load fills: the daemon's writable mapping of a fresh
/// memfd, or a caller's region.
#[derive(Debug)]
pub(super) enum Dest {
    Shared(MmapMut),
    Target(TargetMap),
}

impl Dest {
    /// The bytes, from the artifact's offset 0 (at least its length).
    fn bytes(&mut self) -> &mut [u8] {
        match self {
            Dest::Shared(m) => m,
            Dest::Target(t) => t.bytes(),
        }
    }
}

/// Where verified peer chunks go ([`Core::fetch_from_peer`]).
trait ChunkSink: Send {
    /// The memory chunk `i` (of length `len`) is read into.
    fn slot(&mut self, i: usize, start: u64, len: usize) -> &mut [u8];
    /// Chunk `i`, now in its slot, matched its hash.
    fn verified(&mut self, i: usize);
}

/// Chunks read straight into their places in memory laid out like the artifact.
struct InPlace<'a>(&'a mut [u8]);

impl ChunkSink for InPlace<'_> {
    fn slot(&mut self, _i: usize, start: u64, len: usize) -> &mut [u8] {
        let dst = &mut self.0[start as usize..start as usize + len];
        crate::memory::populate(dst);
        dst
    }
    fn verified(&mut self, _i: usize) {}
}

/// Parent chunks read into one chunk buffer, each copied into the view
/// once verified: a view from a peer stages nothing the parent's size.
struct IntoView<'a> {
    plan: &'a ViewPlan,
    parent_len: u64,
    view: &'a mut [u8],
    buf: Vec<u8>,
}

impl ChunkSink for IntoView<'_> {
    fn slot(&mut self, _i: usize, _start: u64, len: usize) -> &mut [u8] {
        self.buf.resize(len, 0);
        &mut self.buf[..len]
    }
    fn verified(&mut self, i: usize) {
        self.plan.apply_chunk(i, self.parent_len, &self.buf, self.view);
    }
}

/// Where a view reads its parent from.
#[derive(Debug)]
pub(super) enum Parent {
    Local(StoredArtifact),
    /// A resident parent, mapped (the map keeps its memory even if it is
    /// evicted meanwhile) and, when the daemon made it resident for this
    /// view, held by an internal replica until the view is built.
    Resident {
        memory: Mmap,
        len: u64,
        _hold: Option<InternalHold>,
    },
}

impl Parent {
    fn source(&self) -> Source {
        match self {
            Parent::Local(_) => Source::Local,
            Parent::Resident { .. } => Source::Resident,
        }
    }

    /// Fills `dst` with the view `plan` of this parent.
    fn build(&self, plan: &ViewPlan, dst: &mut [u8]) -> Result<(), StoreError> {
        let (memory, len): (&[u8], u64) = match self {
            Parent::Local(art) => {
                return plan.execute(art.index.data_len, dst, |i, buf| art.read_chunk(i, buf));
            }
            Parent::Resident { memory, len, .. } => (memory, *len),
        };
        plan.execute(len, dst, |i, buf| {
            let (a, b) = chunk_range(i, len);
            buf.copy_from_slice(&memory[a as usize..b as usize]);
            Ok(())
        })
    }
}

/// An internal reference on a resident parent; released when dropped, so a
/// view that fails to allocate or load never leaves its parent pinned.
#[derive(Debug)]
pub(super) struct InternalHold {
    core: Arc<Core>,
    replica: hangar_core::ReplicaId,
}

impl Drop for InternalHold {
    fn drop(&mut self) {
        self.core.unload(self.replica);
    }
}

impl Job {
    pub(super) fn index(&self) -> &CanonicalIndex {
        match self {
            Job::Local(a) => &a.index,
            Job::Remote { index, .. } => index,
            Job::View { plan, .. } | Job::PeerView { plan, .. } | Job::FallbackView { plan, .. } => {
                &plan.index
            }
            Job::Resident { index, .. } => index,
        }
    }
}

fn source_err(name: &str, reason: impl ToString) -> StoreError {
    StoreError::Source { source_name: name.to_owned(), reason: reason.to_string() }
}

/// What a failed source said, for [`StoreError::Unavailable`]'s list:
/// `source: reason`, the source named once.
fn said(source: &str, e: &StoreError) -> String {
    match e {
        StoreError::Source { reason, .. } => format!("{source}: {reason}"),
        e => format!("{source}: {e}"),
    }
}

impl Core {
    /// Works out where a selection's bytes will come from, and its layout.
    /// Into a caller's region ([`Mode::Target`]) a ready resident copy of
    /// the selection (or of a view's parent) is used first, and nothing is
    /// made resident.
    pub(super) async fn plan(self: Arc<Self>, sel: &Selection, mode: Mode) -> Result<Job, StoreError> {
        let view_id = sel.view.as_ref().map(|v| ArtifactId::view_of(&sel.artifact_id, &v.canonical()));
        if mode == Mode::Target {
            if let Some((memory, index)) = self.ready_resident(&view_id.unwrap_or(sel.artifact_id))? {
                return Ok(Job::Resident { memory, index });
            }
        }
        let Some(spec) = &sel.view else { return self.locate(&sel.artifact_id, sel.key.as_ref()).await };
        spec.validate()?;
        let parent_id = sel.artifact_id;
        if self.blobs.contains(&parent_id) {
            let parent = self.blobs.open_artifact(&parent_id)?;
            let plan = ViewPlan::new(&parent.index, spec)?;
            return Ok(Job::View { plan, parent: Parent::Local(parent) });
        }
        if mode == Mode::Target {
            if let Some((memory, index)) = self.ready_resident(&parent_id)? {
                let parent = Parent::Resident { memory, len: index.data_len, _hold: None };
                return Ok(Job::View { plan: ViewPlan::new(&index, spec)?, parent });
            }
        }
        let mut tried = Vec::new();
        if mode == Mode::Target || !self.is_resident(&parent_id) {
            if let (peers, Some(index)) = self.peers_with_index(&parent_id, &mut tried).await {
                return Ok(Job::PeerView {
                    plan: ViewPlan::new(&index, spec)?,
                    parent: parent_id,
                    parent_len: index.data_len,
                    peers,
                    key: sel.key.clone(),
                });
            }
        }
        if mode == Mode::Target {
            let found = self.fallback_parent(parent_id, sel.key.as_ref(), tried).await?;
            return Ok(Job::FallbackView {
                plan: ViewPlan::new(&found.index, spec)?,
                parent: parent_id,
                found,
            });
        }
        let (index, parent) = self.whole_parent(parent_id, sel.key.clone()).await?;
        Ok(Job::View { plan: ViewPlan::new(&index, spec)?, parent })
    }

    /// A view's parent in the fallback (its index from this node's disk
    /// when the disk budget dropped only its bytes); every source tried is
    /// named when it is not there.
    async fn fallback_parent(
        &self,
        parent: ArtifactId,
        key: Option<&StoreKey>,
        mut tried: Vec<String>,
    ) -> Result<FallbackArtifact, StoreError> {
        let Some(fb) = &self.fallback else {
            tried.push("fallback: none configured".into());
            return Err(Unavailable { id: parent, key: key.cloned(), tried }.into());
        };
        let known = self.blobs.known_index(&parent)?;
        fb.locate(&parent, key, known.as_ref()).await.map_err(|e| {
            tried.push(said(&format!("fallback {}", fb.label()), &e));
            Unavailable { id: parent, key: key.cloned(), tried }.into()
        })
    }

    /// A read-only map of `id` and its layout if it is resident and its
    /// load finished (verified); `None` otherwise.
    fn ready_resident(&self, id: &ArtifactId) -> Result<Option<(Mmap, CanonicalIndex)>, StoreError> {
        let found = {
            let st = self.lock();
            st.residents
                .get(id)
                .filter(|r| matches!(*r.status.borrow(), super::LoadStatus::Ready { .. }))
                .map(|r| (r.region.clone(), (*r.index).clone()))
        };
        let Some((region, index)) = found else { return Ok(None) };
        let memory = region.map().map_err(|e| StoreError::Io { path: "memfd".into(), source: e })?;
        Ok(Some((memory, index)))
    }

    fn is_resident(&self, id: &ArtifactId) -> bool {
        self.lock()
            .residents
            .get(id)
            .is_some_and(|r| !matches!(*r.status.borrow(), super::LoadStatus::Failed { .. }))
    }

    /// Makes the whole parent resident (any source; lease-in-place if it
    /// already is) and holds it until the view built from it is done.
    ///
    /// Boxed as `Send` by hand: materialize → load → here → materialize is a
    /// cycle the compiler cannot prove `Send` through on its own.
    fn whole_parent(self: &Arc<Self>, parent_id: ArtifactId, key: Option<StoreKey>) -> WholeParent<'_> {
        Box::pin(async move {
            let hold = self.internal_replica();
            let lease = Owner::Lease { expires_at: self.now() + 600_000 };
            let parent_sel = Selection { artifact_id: parent_id, view: None, key };
            let granted = self.materialize(&parent_sel, hold, lease).await?;
            let guard = InternalHold { core: self.clone(), replica: hold };
            self.confirm(hold, super::MAX_CONFIRM).await?;
            let memory =
                granted.region.map().map_err(|e| StoreError::Io { path: "memfd".into(), source: e })?;
            let len = granted.index.data_len;
            Ok(((*granted.index).clone(), Parent::Resident { memory, len, _hold: Some(guard) }))
        })
    }

    /// Local blob store, else the registry's peers, else the fallback; the
    /// index comes from the store itself when it knows the artifact (its
    /// bytes dropped by the disk budget), else from a peer or the fallback.
    async fn locate(&self, id: &ArtifactId, key: Option<&StoreKey>) -> Result<Job, StoreError> {
        if self.blobs.contains(id) {
            return Ok(Job::Local(self.blobs.open_artifact(id)?));
        }
        let known = self.blobs.known_index(id)?;
        let mut tried = vec![match known {
            Some(_) => "this node's disk: the disk budget dropped its bytes".to_owned(),
            None => "this node's disk: not stored".to_owned(),
        }];
        let (peers, index) = match &known {
            Some(index) => (self.holders(id, &mut tried).await, Some(index.clone())),
            None => self.peers_with_index(id, &mut tried).await,
        };
        if let Some(index) = index.filter(|_| !peers.is_empty()) {
            return Ok(Job::Remote { index, peers, fallback: None, key: key.cloned(), tried });
        }
        let Some(fb) = &self.fallback else {
            tried.push("fallback: none configured".into());
            return Err(Unavailable { id: *id, key: key.cloned(), tried }.into());
        };
        match fb.locate(id, key, known.as_ref()).await {
            Ok(found) => Ok(Job::Remote {
                index: found.index.clone(),
                peers,
                fallback: Some(found),
                key: key.cloned(),
                tried,
            }),
            Err(e) => {
                tried.push(said(&format!("fallback {}", fb.label()), &e));
                Err(Unavailable { id: *id, key: key.cloned(), tried }.into())
            }
        }
    }

    /// Peers the registry says hold `id`, and the index from the first that
    /// gives a valid one; what failed is added to `tried`.
    async fn peers_with_index(
        &self,
        id: &ArtifactId,
        tried: &mut Vec<String>,
    ) -> (Vec<String>, Option<CanonicalIndex>) {
        let peers = self.holders(id, tried).await;
        for peer in &peers {
            match self.peer_index(peer, id).await {
                Ok(index) => return (peers.clone(), Some(index)),
                Err(e) => {
                    tracing::warn!(%peer, %id, error = %e, "peer could not give the index");
                    tried.push(said(&format!("peer {peer}"), &e));
                }
            }
        }
        (peers, None)
    }

    /// Peers the registry says hold `id`, excluding this node; when there
    /// are none, why is added to `tried`.
    async fn holders(&self, id: &ArtifactId, tried: &mut Vec<String>) -> Vec<String> {
        let Some(reg) = &self.cfg.registry else {
            tried.push("peers: no registry configured".into());
            return vec![];
        };
        let own = self.own_url.lock().expect("not poisoned").clone();
        let url = format!("{reg}/v1/holders/{id}");
        let got = async { self.http.get(&url).send().await?.error_for_status()?.json::<Holders>().await };
        let peers: Vec<String> = match tokio::time::timeout(self.cfg.peer_timeout, got).await {
            Ok(Ok(h)) => h.peers.into_iter().filter(|p| Some(p) != own.as_ref()).collect(),
            Ok(Err(e)) => {
                tracing::warn!(%url, error = %e, "registry lookup failed");
                tried.push(format!("registry {reg}: {e}"));
                return vec![];
            }
            Err(_) => {
                tracing::warn!(%url, "registry lookup timed out");
                tried.push(format!("registry {reg}: timed out after {:?}", self.cfg.peer_timeout));
                return vec![];
            }
        };
        if peers.is_empty() {
            tried.push(format!("registry {reg}: no live peer holds it"));
        }
        peers
    }

    async fn peer_get(&self, peer: &str, id: &ArtifactId, what: &str) -> Result<Vec<u8>, StoreError> {
        let url = format!("{peer}/v1/artifacts/{id}/{what}");
        let fetch = async { self.http.get(&url).send().await?.error_for_status()?.bytes().await };
        match tokio::time::timeout(self.cfg.peer_timeout, fetch).await {
            Ok(Ok(b)) => Ok(b.to_vec()),
            Ok(Err(e)) => Err(source_err(&url, e)),
            Err(_) => Err(source_err(&url, "timed out")),
        }
    }

    async fn peer_index(&self, peer: &str, id: &ArtifactId) -> Result<CanonicalIndex, StoreError> {
        let ArtifactId::Full { index: want, .. } = id else { return Err(StoreError::UnknownArtifact(*id)) };
        let bytes = self.peer_get(peer, id, "index").await?;
        if blake3::hash(&bytes).as_bytes() != want {
            return Err(source_err(peer, format!("index does not hash to {}", hex(want))));
        }
        Ok(CanonicalIndex::from_bytes(&bytes)?)
    }

    /// Runs a planned load into `dst`; returns the source that completed
    /// it. Every byte is verified before this returns `Ok`, and a whole
    /// artifact passes the serving preflight ([`crate::preflight`]) on the
    /// bytes loaded. In [`Mode::Target`] a view's region is zeroed first
    /// (padding is zero, whatever the caller's memory held) and nothing is
    /// persisted; on error the region's contents are unspecified.
    pub(super) async fn load(
        self: Arc<Self>,
        id: ArtifactId,
        job: Job,
        mut dst: Dest,
        mode: Mode,
        context: u64,
    ) -> Result<Source, StoreError> {
        let len = job.index().data_len as usize;
        if mode == Mode::Target
            && matches!(job, Job::View { .. } | Job::PeerView { .. } | Job::FallbackView { .. })
        {
            dst.bytes()[..len].fill(0);
        }
        match job {
            Job::Local(art) => {
                art.advise_sequential();
                let dst = tokio::task::spawn_blocking(move || {
                    chunks::for_each_chunk_mut_parallel(&mut dst.bytes()[..len], |i, chunk| {
                        crate::memory::populate(chunk);
                        art.read_chunk(i, chunk)
                    })
                    .map(|()| (dst, art.index))
                })
                .await
                .map_err(|e| source_err("local", e))??;
                let (mut dst, index) = dst;
                crate::preflight::check_data(&id, &index, &dst.bytes()[..len], &ServingPolicy::default())?;
                Ok(Source::Local)
            }
            Job::Resident { memory, .. } => {
                tokio::task::spawn_blocking(move || {
                    chunks::for_each_chunk_mut_parallel::<()>(&mut dst.bytes()[..len], |i, chunk| {
                        crate::memory::populate(chunk);
                        let (a, b) = chunk_range(i, len as u64);
                        chunk.copy_from_slice(&memory[a as usize..b as usize]);
                        Ok(())
                    })
                })
                .await
                .map_err(|e| source_err("resident", e))?
                .expect("copies cannot fail");
                Ok(Source::Resident)
            }
            Job::View { plan, parent } => Self::build_view(plan, parent, dst).await,
            Job::PeerView { plan, parent, parent_len, peers, key } => {
                let wanted = plan.needed_chunks();
                let mut done = 0;
                {
                    let mut sink =
                        IntoView { plan: &plan, parent_len, view: &mut dst.bytes()[..len], buf: Vec::new() };
                    for peer in &peers {
                        match self
                            .fetch_from_peer(peer, &parent, parent_len, &mut sink, &wanted, &mut done)
                            .await
                        {
                            Ok(()) => break,
                            Err(e) => {
                                tracing::warn!(%peer, %parent, done, of = wanted.len(), error = %e, "peer could not give a view's chunks")
                            }
                        }
                    }
                }
                if done == wanted.len() {
                    return Ok(Source::Peer);
                }
                match mode {
                    Mode::Resident => {
                        let (_, parent) = self.whole_parent(parent, key.clone()).await?;
                        Self::build_view(plan, parent, dst).await
                    }
                    Mode::Target => {
                        let tried =
                            vec![format!("peers: none completed the {} chunks the view reads", wanted.len())];
                        let found = self.fallback_parent(parent, key.as_ref(), tried).await?;
                        Self::stream_fallback_view(&plan, parent, &found, &mut dst.bytes()[..len]).await
                    }
                }
            }
            Job::FallbackView { plan, parent, found } => {
                Self::stream_fallback_view(&plan, parent, &found, &mut dst.bytes()[..len]).await
            }
            Job::Remote { index, peers, mut fallback, key, mut tried } => {
                let n = chunk_count(index.data_len);
                let wanted: Vec<usize> = (0..n).collect();
                let mut verified = 0usize;
                let mut source = None;
                for peer in &peers {
                    let mut sink = InPlace(&mut dst.bytes()[..len]);
                    match self
                        .fetch_from_peer(peer, &id, index.data_len, &mut sink, &wanted, &mut verified)
                        .await
                    {
                        Ok(()) => {
                            source = Some(Source::Peer);
                            break;
                        }
                        Err(e) => {
                            tracing::warn!(%peer, %id, verified, of = n, error = %e, "peer transfer failed; trying next source");
                            tried.push(said(&format!("peer {peer}"), &e));
                        }
                    }
                }
                if source.is_none() {
                    if fallback.is_none() {
                        match &self.fallback {
                            Some(fb) => match fb.locate(&id, key.as_ref(), Some(&index)).await {
                                Ok(found) => fallback = Some(found),
                                Err(e) => tried.push(said(&format!("fallback {}", fb.label()), &e)),
                            },
                            None => tried.push("fallback: none configured".into()),
                        }
                    }
                    let Some(fb) = fallback else {
                        return Err(Unavailable { id, key, tried }.into());
                    };
                    let from = verified as u64 * chunks::CHUNK_SIZE;
                    // Padding is zero: a caller's region may hold anything,
                    // and a peer that failed mid-chunk left bytes behind.
                    let data = &mut dst.bytes()[..len];
                    data[from as usize..].fill(0);
                    if let Err(e) = fb.fill_range(&mut data[from as usize..], from).await {
                        tried.push(said(&format!("fallback {}", fb.label()), &e));
                        return Err(Unavailable { id, key, tried }.into());
                    }
                    let root = chunks::data_root(index.data_len, &chunks::hash_chunks(data));
                    if Some(&root) != id.data_root() {
                        return Err(StoreError::Corrupt {
                            what: id.to_string(),
                            reason: format!("the bytes of fallback {} do not hash to the id", fb.label()),
                        });
                    }
                    source = Some(Source::Fallback);
                }
                crate::preflight::check_data(&id, &index, &dst.bytes()[..len], &ServingPolicy::default())?;
                let source = source.expect("set above");
                if mode == Mode::Resident {
                    self.persist(id, index, dst, key, context, source);
                }
                Ok(source)
            }
        }
    }

    /// Builds a view from its parent on a blocking thread; the parent (and
    /// any hold on it) is released right after.
    async fn build_view(plan: ViewPlan, parent: Parent, mut dst: Dest) -> Result<Source, StoreError> {
        let source = parent.source();
        tokio::task::spawn_blocking(move || {
            parent.build(&plan, &mut dst.bytes()[..plan.index.data_len as usize])
        })
        .await
        .map_err(|e| source_err("view", e))??;
        Ok(source)
    }

    /// Builds a view (into `view`, zeroed) from a parent that only the
    /// fallback holds without staging the parent: every parent chunk is
    /// read into one chunk buffer and hashed, the chunks the view reads
    /// are copied into it, and the recomputed data root must be the
    /// parent's (the fallback has no chunk list to check chunks one by one).
    async fn stream_fallback_view(
        plan: &ViewPlan,
        parent: ArtifactId,
        found: &FallbackArtifact,
        view: &mut [u8],
    ) -> Result<Source, StoreError> {
        let len = found.index.data_len;
        let n = chunk_count(len);
        let needed = plan.needed_chunks();
        let mut hashes = Vec::with_capacity(n);
        let mut buf = vec![0u8; chunks::CHUNK_SIZE as usize];
        for i in 0..n {
            let (a, b) = chunk_range(i, len);
            let chunk = &mut buf[..(b - a) as usize];
            chunk.fill(0);
            found.fill_range(chunk, a).await?;
            hashes.push(chunks::hash_chunk(chunk));
            if needed.binary_search(&i).is_ok() {
                plan.apply_chunk(i, len, chunk, view);
            }
        }
        if Some(&chunks::data_root(len, &hashes)) != parent.data_root() {
            return Err(StoreError::Corrupt {
                what: parent.to_string(),
                reason: format!("the bytes of fallback {} do not hash to the id", found.label()),
            });
        }
        Ok(Source::Fallback)
    }

    /// Streams the chunks `wanted[*done..]` (ascending) of artifact `id` from
    /// a peer into `sink`, verifying each; `done` advances past every
    /// verified chunk, so the next source resumes where this one stopped.
    /// Each run of consecutive chunks is one request.
    async fn fetch_from_peer(
        &self,
        peer: &str,
        id: &ArtifactId,
        data_len: u64,
        sink: &mut impl ChunkSink,
        wanted: &[usize],
        done: &mut usize,
    ) -> Result<(), StoreError> {
        let n = chunk_count(data_len);
        let list: Vec<Digest> = chunks::decode(&self.peer_get(peer, id, "chunks").await?)
            .filter(|l| l.len() == n)
            .ok_or_else(|| source_err(peer, "chunk list has the wrong length"))?;
        if Some(&chunks::data_root(data_len, &list)) != id.data_root() {
            return Err(source_err(peer, "chunk list does not hash to the id"));
        }
        while *done < wanted.len() {
            let from = wanted[*done];
            let run = wanted[*done..].iter().zip(from..).take_while(|(w, c)| *w == c).count();
            let to = from + run;
            let url = format!("{peer}/v1/artifacts/{id}/data?from_chunk={from}&to_chunk={to}");
            let mut raw = self.open_raw(&url).await?;
            // Each chunk is read straight into its slot and verified
            // before the next is read.
            for (i, want) in list.iter().enumerate().take(to).skip(from) {
                let (a, b) = chunk_range(i, data_len);
                let dst = sink.slot(i, a, (b - a) as usize);
                let mut got = 0;
                while got < dst.len() {
                    let read = tokio::time::timeout(self.cfg.peer_timeout, raw.read(&mut dst[got..]))
                        .await
                        .map_err(|_| source_err(&url, format!("stalled for {:?}", self.cfg.peer_timeout)))?
                        .map_err(|e| source_err(&url, e))?;
                    if read == 0 {
                        let at = a + got as u64;
                        return Err(source_err(&url, format!("stream ended at byte {at} of {data_len}")));
                    }
                    got += read;
                }
                if chunks::hash_chunk(dst) != *want {
                    return Err(StoreError::HashMismatch { id: *id, chunk: i });
                }
                sink.verified(i);
                *done += 1;
            }
        }
        Ok(())
    }

    /// Asks a peer for `url` with `Upgrade: hangar-chunks` and returns the
    /// raw connection its data follows on.
    async fn open_raw(&self, url: &str) -> Result<reqwest::Upgraded, StoreError> {
        let request = self
            .http
            .get(url)
            .header(reqwest::header::CONNECTION, "upgrade")
            .header(reqwest::header::UPGRADE, super::http::RAW_DATA_PROTOCOL)
            .send();
        let resp = tokio::time::timeout(self.cfg.peer_timeout, request)
            .await
            .map_err(|_| source_err(url, "timed out"))?
            .and_then(|r| r.error_for_status())
            .map_err(|e| source_err(url, e))?;
        if resp.status() != reqwest::StatusCode::SWITCHING_PROTOCOLS {
            return Err(source_err(url, format!("answered {} to a raw data request", resp.status())));
        }
        resp.upgrade().await.map_err(|e| source_err(url, e))
    }

    /// Writes a remotely obtained artifact into the local blob store (in the
    /// background; failure only costs a future re-fetch) — for a known
    /// artifact whose bytes the disk budget dropped, puts them back — then
    /// publishes it under the load's `context` (deduplicated,
    /// [`crate::publish`]), marks it used and applies the disk budget.
    fn persist(
        self: &Arc<Self>,
        id: ArtifactId,
        index: CanonicalIndex,
        mut dst: Dest,
        key: Option<StoreKey>,
        context: u64,
        source: Source,
    ) {
        let core = self.clone();
        tokio::task::spawn_blocking(move || {
            let mem = dst.bytes();
            let specs = index.tensors.iter().map(|t| TensorSpec {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
            });
            let result = core.blobs.register(specs.collect()).and_then(|mut reg| {
                for t in &index.tensors {
                    reg.feed(&t.name, &mem[t.offset as usize..(t.offset + t.len) as usize])?;
                }
                reg.commit(&key.into_iter().collect::<Vec<_>>())
            });
            match result {
                Ok(r) if r.id == id => {
                    tracing::info!(%id, "stored remotely fetched artifact locally");
                    core.publish_stored(context, id, source, r.bytes);
                    core.used_now(id);
                }
                Ok(r) => tracing::error!(%id, got = %r.id, "persisted artifact hashed differently"),
                Err(e) => tracing::warn!(%id, error = %e, "could not store fetched artifact locally"),
            }
        });
    }
}

/// Why one heartbeat was not recorded.
enum HeartbeatFailed {
    /// The registry refused the node name.
    Refused(StoreError),
    /// The blob store could not be listed, or the registry not reached.
    Other(String),
}

/// Sends one heartbeat: the artifacts whose bytes this node holds (what
/// peers can fetch from it) and all its keys.
async fn heartbeat_once(core: &Core, reg: &str, url: &str) -> Result<(), HeartbeatFailed> {
    let (list, keys) = match (core.blobs.list(), core.blobs.keys()) {
        (Ok(list), Ok(keys)) => (list, keys),
        (Err(e), _) | (_, Err(e)) => {
            return Err(HeartbeatFailed::Other(format!("cannot list the blob store: {e}")));
        }
    };
    let hb = Heartbeat {
        node: core.cfg.node.clone(),
        url: url.to_owned(),
        artifacts: list.into_iter().filter(|a| a.on_disk).map(|a| a.id).collect(),
        keys,
    };
    let sent = core
        .http
        .post(format!("{reg}/v1/heartbeat"))
        .json(&hb)
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .map_err(|e| HeartbeatFailed::Other(e.to_string()))?;
    if sent.status() == reqwest::StatusCode::CONFLICT {
        let taken = sent.json::<NameTaken>().await.map_err(|e| HeartbeatFailed::Other(e.to_string()))?;
        return Err(HeartbeatFailed::Refused(StoreError::NodeNameTaken { registry: reg.to_owned(), taken }));
    }
    sent.error_for_status().map(drop).map_err(|e| HeartbeatFailed::Other(e.to_string()))
}

/// The first heartbeat, before the daemon serves: a node name another
/// live daemon holds is an error (the daemon does not start); an
/// unreachable registry is not (its state is soft, and the heartbeat loop
/// keeps trying).
pub(super) async fn register(core: &Core) -> Result<(), StoreError> {
    let (Some(reg), Some(url)) = (&core.cfg.registry, core.own_url.lock().expect("not poisoned").clone())
    else {
        return Ok(());
    };
    match heartbeat_once(core, reg, &url).await {
        Ok(()) => Ok(()),
        Err(HeartbeatFailed::Refused(e)) => Err(e),
        Err(HeartbeatFailed::Other(why)) => {
            tracing::warn!(registry = %reg, error = %why, "first heartbeat failed; retrying every heartbeat");
            Ok(())
        }
    }
}

/// Reports this node's holdings to the registry every heartbeat period. A
/// name taken meanwhile (this daemon was silent past the registry's TTL
/// and another took it) is logged as an error; the daemon keeps serving
/// its local clients and retries.
pub(super) async fn heartbeat_loop(core: Arc<Core>) {
    let Some(reg) = core.cfg.registry.clone() else { return };
    let Some(url) = core.own_url.lock().expect("not poisoned").clone() else { return };
    let mut tick = tokio::time::interval(core.cfg.heartbeat);
    let mut failing = false;
    loop {
        // A publish announces the new holding now rather than at the next period.
        tokio::select! {
            _ = tick.tick() => {}
            _ = core.announce.notified() => {}
        }
        match heartbeat_once(&core, &reg, &url).await {
            Ok(()) if failing => {
                failing = false;
                tracing::info!(registry = %reg, "registry reachable again");
            }
            Ok(()) => {}
            Err(HeartbeatFailed::Refused(e)) if !failing => {
                failing = true;
                tracing::error!(error = %e, "heartbeat refused: peers cannot find this daemon");
            }
            Err(HeartbeatFailed::Other(why)) if !failing => {
                failing = true;
                tracing::warn!(registry = %reg, error = %why, "heartbeat failed");
            }
            Err(_) => {}
        }
    }
}
