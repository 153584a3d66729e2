//! The client library for the local daemon (blocking; one per process).
//!
//! ```no_run
//! use hangar_store::client::{Hold, StoreClient};
//! use hangar_store::protocol::Selection;
//! use std::time::Duration;
//!
//! let mut c = StoreClient::connect("/run/hangar/store.sock")?;
//! let id = c.resolve_key(&"meta/llama:v1".parse().unwrap())?;
//! let sel = Selection { artifact_id: id, view: None, key: None };
//! let m = c.materialize(&sel, Hold::Process)?; // memory mapped, maybe still loading
//! c.confirm(&m, Duration::from_secs(30))?;      // now every byte is verified
//! let weight: &[u8] = m.tensor("lm_head.weight").unwrap();
//! c.unload(&m)?;
//! # Ok::<(), hangar_store::client::ClientError>(())
//! ```
//!
//! A process that has its own memory for the weights (a buffer it
//! allocated, a region it lays out itself) asks the daemon to stream an
//! artifact straight into it, the daemon keeping no copy
//! ([`StoreClient::materialize_into`], TensorCast's `MaterializeIntoTarget`):
//!
//! ```no_run
//! use hangar_store::client::{StoreClient, TargetMemory};
//! use hangar_store::protocol::Selection;
//! # let id: hangar_store::ArtifactId = "hg1:0000000000000000000000000000000000000000000000000000000000000000:0000000000000000000000000000000000000000000000000000000000000000".parse().unwrap();
//!
//! let mut c = StoreClient::connect("/run/hangar/store.sock")?;
//! let sel = Selection { artifact_id: id, view: Some("0/2:*.weight=0".parse().unwrap()), key: None };
//! let (_, layout) = c.describe(&sel)?;                       // size the region
//! let mut mem = TargetMemory::allocate(layout.data_len)?;    // this process's memory
//! let done = c.materialize_into(&sel, &mem, 0)?;              // filled and verified
//! let bias: &[u8] = done.tensor(mem.bytes(), "layers.0.mlp.bias").unwrap();
//! # Ok::<(), hangar_store::client::ClientError>(())
//! ```
//!
//! Key lookups are cached for [`KEY_CACHE_TTL`]. A request that fails on
//! the transport (daemon restarted, connection reset) is retried once on a
//! fresh connection; requests are idempotent per replica id, so a retried
//! `Materialize` does not take a second reference.

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hangar_core::ReplicaId;
use memmap2::Mmap;

use crate::blob::CommitReport;
use crate::id::{ArtifactId, StoreKey};
use crate::index::{CanonicalIndex, TensorSpec};
use crate::memory::{map_readonly, map_writable, recv_frame, send_frame};
use crate::preflight::ServingPolicy;
use crate::protocol::{ErrorKind, Request, ResidentInfo, Response, Selection, Source};

/// How long a key → id lookup is reused.
pub const KEY_CACHE_TTL: Duration = Duration::from_secs(30);

/// What can go wrong talking to the daemon.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// Nothing answers on the socket. Start one with `hangar store serve`.
    #[error("store daemon unavailable at {socket}: {source} (start it with `hangar store serve`)")]
    DaemonUnavailable {
        /// The socket path.
        socket: String,
        /// The connect / transport error.
        source: std::io::Error,
    },
    /// The key is unknown to the daemon and its registry.
    #[error("unknown key: {0}")]
    UnknownKey(String),
    /// No source holds the artifact.
    #[error("unknown artifact: {0}")]
    UnknownArtifact(String),
    /// Bytes failed verification; they were not served.
    #[error("hash mismatch: {0}")]
    HashMismatch(String),
    /// The daemon's memory budget is held by referenced artifacts.
    #[error("out of memory budget: {0}")]
    OutOfBudget(String),
    /// Loading did not finish before the deadline.
    #[error("timed out: {0}")]
    Timeout(String),
    /// The daemon refused the request as invalid.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The artifact failed the serving preflight (the message names the
    /// rule and the artifact).
    #[error("{0}")]
    Preflight(String),
    /// This process could not set up its own target memory.
    #[error("target memory: {0}")]
    TargetMemory(#[from] std::io::Error),
    /// The daemon failed otherwise.
    #[error("daemon error: {0}")]
    Daemon(String),
    /// The daemon answered something unexpected.
    #[error("protocol error: {0}")]
    Protocol(String),
}

impl ClientError {
    fn from_wire(kind: ErrorKind, message: String) -> Self {
        match kind {
            ErrorKind::UnknownKey => ClientError::UnknownKey(message),
            ErrorKind::UnknownArtifact => ClientError::UnknownArtifact(message),
            ErrorKind::HashMismatch => ClientError::HashMismatch(message),
            ErrorKind::OutOfBudget => ClientError::OutOfBudget(message),
            ErrorKind::Timeout => ClientError::Timeout(message),
            ErrorKind::BadRequest => ClientError::BadRequest(message),
            ErrorKind::Preflight => ClientError::Preflight(message),
            ErrorKind::Internal => ClientError::Daemon(message),
        }
    }
}

/// How a materialization is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// By this process: released by `unload` or when the process exits.
    Process,
    /// By a TTL lease, kept with [`StoreClient::keep_alive`].
    Lease(Duration),
}

/// Shared memory holding an artifact (or view), mapped read-only.
///
/// The bytes are complete and verified only after [`StoreClient::confirm`]
/// succeeded; before that they may still be loading.
#[derive(Debug)]
pub struct Materialized {
    /// Id of what is mapped.
    pub id: ArtifactId,
    /// Layout.
    pub index: CanonicalIndex,
    /// True if it was already resident (lease-in-place; nothing allocated).
    pub reused: bool,
    /// The handle used for confirm / unload / keep-alive.
    pub replica: ReplicaId,
    fd: OwnedFd,
    map: Mmap,
}

impl Materialized {
    /// The canonical data.
    pub fn data(&self) -> &[u8] {
        &self.map[..self.index.data_len as usize]
    }
    /// One tensor's bytes.
    pub fn tensor(&self, name: &str) -> Option<&[u8]> {
        let t = self.index.tensor(name)?;
        Some(&self.data()[t.offset as usize..(t.offset + t.len) as usize])
    }
    /// The shared memory's descriptor (read-only, sealed): what a process
    /// that should map the artifact itself (an engine) is handed.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// `(device, inode)` of the shared memory: equal across processes iff
    /// they map the same memory.
    pub fn memory_identity(&self) -> std::io::Result<(u64, u64)> {
        let st = rustix::fs::fstat(self.fd.as_fd())?;
        Ok((st.st_dev, st.st_ino))
    }
}

/// A streaming registration in progress: write each tensor's bytes in
/// place ([`Producing::tensor_mut`]), then commit or abort through the client.
#[derive(Debug)]
pub struct Producing {
    /// The registration handle.
    pub handle: ReplicaId,
    /// Where each tensor goes.
    pub index: CanonicalIndex,
    map: memmap2::MmapMut,
}

impl Producing {
    /// The writable bytes of tensor `name`.
    pub fn tensor_mut(&mut self, name: &str) -> Option<&mut [u8]> {
        let t = self.index.tensor(name)?;
        let (a, b) = (t.offset as usize, (t.offset + t.len) as usize);
        Some(&mut self.map[a..b])
    }
}

/// Memory of this process that the daemon may fill
/// ([`StoreClient::materialize_into`]): a memfd sealed against resizing
/// (so the daemon's mapping of it can never fault), mapped writable here.
#[derive(Debug)]
pub struct TargetMemory {
    region: crate::memory::SharedRegion,
    map: memmap2::MmapMut,
}

impl TargetMemory {
    /// Allocates `len` zeroed bytes (at least 1).
    pub fn allocate(len: u64) -> std::io::Result<Self> {
        let region = crate::memory::SharedRegion::allocate_for_producer("hangar-target", len)?;
        let map = map_writable(region.fd(), region.len())?;
        Ok(TargetMemory { region, map })
    }

    /// The memfd (what is passed to the daemon).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.region.fd()
    }

    /// Its length.
    pub fn len(&self) -> u64 {
        self.region.len()
    }

    /// Whether it is empty (never: at least 1 byte).
    pub fn is_empty(&self) -> bool {
        self.region.is_empty()
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// The bytes, writable (the memory is this process's).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }
}

/// What `MaterializeIntoTarget` wrote into the caller's memory.
#[derive(Debug, Clone)]
pub struct MaterializedInto {
    /// Id of what was written (the view id for a view).
    pub id: ArtifactId,
    /// Its layout, from the region's start.
    pub index: CanonicalIndex,
    /// Where the bytes came from.
    pub source: Source,
    /// Bytes written.
    pub bytes: u64,
    /// Time taken.
    pub duration_ms: u64,
}

impl MaterializedInto {
    /// Tensor `name`'s bytes in `region` (the region it was written to,
    /// from its start).
    pub fn tensor<'a>(&self, region: &'a [u8], name: &str) -> Option<&'a [u8]> {
        let t = self.index.tensor(name)?;
        region.get(t.offset as usize..(t.offset + t.len) as usize)
    }
}

/// Outcome of a successful `Confirm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Confirmed {
    /// Where the bytes came from.
    pub source: Source,
    /// Bytes.
    pub bytes: u64,
    /// Load time.
    pub duration_ms: u64,
}

/// A connection to the local daemon.
#[derive(Debug)]
pub struct StoreClient {
    socket: PathBuf,
    conn: Option<UnixStream>,
    keys: HashMap<StoreKey, (ArtifactId, Instant)>,
    key_ttl: Duration,
}

impl StoreClient {
    /// Connects to the daemon at `socket`.
    pub fn connect(socket: impl AsRef<Path>) -> Result<Self, ClientError> {
        let mut c = StoreClient {
            socket: socket.as_ref().to_owned(),
            conn: None,
            keys: HashMap::new(),
            key_ttl: KEY_CACHE_TTL,
        };
        c.conn = Some(c.dial()?);
        Ok(c)
    }

    /// Overrides the key cache TTL (zero disables caching).
    pub fn with_key_cache_ttl(mut self, ttl: Duration) -> Self {
        self.key_ttl = ttl;
        self
    }

    fn dial(&self) -> Result<UnixStream, ClientError> {
        UnixStream::connect(&self.socket).map_err(|source| ClientError::DaemonUnavailable {
            socket: self.socket.display().to_string(),
            source,
        })
    }

    fn round_trip(
        &mut self,
        body: &[u8],
        fd: Option<BorrowedFd<'_>>,
    ) -> std::io::Result<(Vec<u8>, Vec<OwnedFd>)> {
        let conn = match &self.conn {
            Some(c) => c,
            None => return Err(std::io::ErrorKind::NotConnected.into()),
        };
        send_frame(conn, body, fd)?;
        recv_frame(conn)?.ok_or_else(|| std::io::ErrorKind::UnexpectedEof.into())
    }

    /// Sends a request; on a transport error retries once on a fresh connection.
    fn call(&mut self, req: &Request) -> Result<(Response, Vec<OwnedFd>), ClientError> {
        self.call_with(req, None)
    }

    /// [`Self::call`] with `fd` attached to the request (sent again on the retry).
    fn call_with(
        &mut self,
        req: &Request,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<(Response, Vec<OwnedFd>), ClientError> {
        let body = serde_json::to_vec(req).expect("requests serialize");
        let (payload, fds) = match self.round_trip(&body, fd) {
            Ok(r) => r,
            Err(first) => {
                tracing::debug!(error = %first, "store daemon transport error; reconnecting once");
                self.conn = None;
                self.conn = Some(self.dial()?);
                self.round_trip(&body, fd).map_err(|source| {
                    self.conn = None;
                    ClientError::DaemonUnavailable { socket: self.socket.display().to_string(), source }
                })?
            }
        };
        let resp: Response = serde_json::from_slice(&payload)
            .map_err(|e| ClientError::Protocol(format!("bad response: {e}")))?;
        match resp {
            Response::Error { kind, message } => Err(ClientError::from_wire(kind, message)),
            other => Ok((other, fds)),
        }
    }

    /// Resolves a key (cached for the key-cache TTL).
    pub fn resolve_key(&mut self, key: &StoreKey) -> Result<ArtifactId, ClientError> {
        if let Some((id, at)) = self.keys.get(key) {
            if at.elapsed() < self.key_ttl {
                return Ok(*id);
            }
        }
        match self.call(&Request::ResolveKey { key: key.clone() })? {
            (Response::Resolved { id }, _) => {
                self.keys.insert(key.clone(), (id, Instant::now()));
                Ok(id)
            }
            (other, _) => Err(unexpected(&other)),
        }
    }

    /// Materializes a selection with a fresh replica id.
    pub fn materialize(&mut self, sel: &Selection, hold: Hold) -> Result<Materialized, ClientError> {
        self.materialize_as(sel, fresh_replica(), hold)
    }

    /// Materializes a selection for `replica`.
    pub fn materialize_as(
        &mut self,
        sel: &Selection,
        replica: ReplicaId,
        hold: Hold,
    ) -> Result<Materialized, ClientError> {
        let lease_ttl_ms = match hold {
            Hold::Process => None,
            Hold::Lease(d) => Some(d.as_millis() as u64),
        };
        let req = Request::Materialize {
            selection: sel.clone(),
            replica,
            pid: (hold == Hold::Process).then(std::process::id),
            lease_ttl_ms,
        };
        match self.call(&req)? {
            (Response::Materialized { id, index, reused }, fds) => {
                let fd = first_fd(fds, "Materialized")?;
                let map = map_readonly(fd.as_fd(), index.data_len)
                    .map_err(|e| ClientError::Protocol(format!("cannot map the shared memory: {e}")))?;
                Ok(Materialized { id, index, reused, replica, fd, map })
            }
            (other, _) => Err(unexpected(&other)),
        }
    }

    /// Waits until the load finished (at most `timeout`, capped at 30 s by the daemon).
    pub fn confirm(&mut self, m: &Materialized, timeout: Duration) -> Result<Confirmed, ClientError> {
        let req = Request::Confirm { replica: m.replica, timeout_ms: timeout.as_millis() as u64 };
        match self.call(&req)? {
            (Response::Confirmed { source, bytes, duration_ms }, _) => {
                Ok(Confirmed { source, bytes, duration_ms })
            }
            (other, _) => Err(unexpected(&other)),
        }
    }

    /// Drops the reference (the mapping stays valid until `m` is dropped).
    /// Returns whether a reference was held.
    pub fn unload(&mut self, m: &Materialized) -> Result<bool, ClientError> {
        self.unload_replica(m.replica)
    }

    /// Drops `replica`'s reference.
    pub fn unload_replica(&mut self, replica: ReplicaId) -> Result<bool, ClientError> {
        match self.call(&Request::Unload { replica })? {
            (Response::Unloaded { released }, _) => Ok(released),
            (other, _) => Err(unexpected(&other)),
        }
    }

    /// Extends a lease; returns the time left.
    pub fn keep_alive(&mut self, m: &Materialized, ttl: Duration) -> Result<Duration, ClientError> {
        let req = Request::KeepAlive { replica: m.replica, ttl_ms: ttl.as_millis() as u64 };
        match self.call(&req)? {
            (Response::KeptAlive { expires_in_ms }, _) => Ok(Duration::from_millis(expires_in_ms)),
            (other, _) => Err(unexpected(&other)),
        }
    }

    /// Begins a streaming registration of `tensors`; `keys` point at the
    /// artifact on commit. The returned memory is laid out canonically.
    pub fn begin_register(
        &mut self,
        tensors: Vec<TensorSpec>,
        keys: Vec<StoreKey>,
    ) -> Result<Producing, ClientError> {
        match self.call(&Request::BeginRegister { tensors, keys })? {
            (Response::RegisterBegun { handle, index }, fds) => {
                let fd = first_fd(fds, "RegisterBegun")?;
                let map = map_writable(fd.as_fd(), index.data_len)
                    .map_err(|e| ClientError::Protocol(format!("cannot map the registration memory: {e}")))?;
                Ok(Producing { handle, index, map })
            }
            (other, _) => Err(unexpected(&other)),
        }
    }

    /// Stores what was written: hashed by the daemon, `existed` if the store
    /// already held the content. A present manifest tensor must pass the
    /// serving preflight ([`crate::preflight`]).
    pub fn commit_register(&mut self, p: Producing) -> Result<CommitReport, ClientError> {
        self.commit_register_with(p, &ServingPolicy::default())
    }

    /// [`Self::commit_register`] under a serving policy (strict: an artifact
    /// without a manifest is refused too, [`ClientError::Preflight`]).
    pub fn commit_register_with(
        &mut self,
        p: Producing,
        policy: &ServingPolicy,
    ) -> Result<CommitReport, ClientError> {
        let req = Request::CommitRegister { handle: p.handle, serving: policy.clone() };
        match self.call(&req)? {
            (Response::Committed { report }, _) => Ok(report),
            (other, _) => Err(unexpected(&other)),
        }
    }

    /// Abandons a registration.
    pub fn abort_register(&mut self, p: Producing) -> Result<(), ClientError> {
        match self.call(&Request::AbortRegister { handle: p.handle })? {
            (Response::Aborted { .. }, _) => Ok(()),
            (other, _) => Err(unexpected(&other)),
        }
    }

    /// The id and canonical layout of a selection (a view's own), loading
    /// nothing: what a target region must hold (`index.data_len` bytes).
    pub fn describe(&mut self, sel: &Selection) -> Result<(ArtifactId, CanonicalIndex), ClientError> {
        match self.call(&Request::Describe { selection: sel.clone() })? {
            (Response::Described { id, index }, _) => Ok((id, index)),
            (other, _) => Err(unexpected(&other)),
        }
    }

    /// `MaterializeIntoTarget` into `target` from byte `offset`: the
    /// daemon streams the artifact (or view) into this process's memory
    /// from its resident copy, its disk, a peer or the fallback, verifying
    /// every chunk, and returns when all of it is there. It takes no
    /// reference and keeps no copy (nothing to `unload`). Refused, with
    /// both sizes named, when the region after `offset` is smaller than
    /// the selection.
    pub fn materialize_into(
        &mut self,
        sel: &Selection,
        target: &TargetMemory,
        offset: u64,
    ) -> Result<MaterializedInto, ClientError> {
        let len = target.len().saturating_sub(offset);
        self.materialize_into_fd(sel, target.fd(), offset, len)
    }

    /// [`Self::materialize_into`] into `len` bytes at `offset` of any
    /// memfd: it must be writable, sealed against shrinking
    /// (`F_SEAL_SHRINK`), not sealed against writes, and large enough.
    pub fn materialize_into_fd(
        &mut self,
        sel: &Selection,
        fd: BorrowedFd<'_>,
        offset: u64,
        len: u64,
    ) -> Result<MaterializedInto, ClientError> {
        let req = Request::MaterializeIntoTarget { selection: sel.clone(), offset, len };
        match self.call_with(&req, Some(fd))? {
            (Response::MaterializedInto { id, index, source, bytes, duration_ms }, _) => {
                Ok(MaterializedInto { id, index, source, bytes, duration_ms })
            }
            (other, _) => Err(unexpected(&other)),
        }
    }

    /// Resident bytes, budget and residents.
    pub fn status(&mut self) -> Result<(u64, u64, Vec<ResidentInfo>), ClientError> {
        match self.call(&Request::Status)? {
            (Response::Status { used, budget, residents }, _) => Ok((used, budget, residents)),
            (other, _) => Err(unexpected(&other)),
        }
    }
}

/// The memfd that must come with a `what` response.
fn first_fd(fds: Vec<OwnedFd>, what: &str) -> Result<OwnedFd, ClientError> {
    fds.into_iter().next().ok_or_else(|| ClientError::Protocol(format!("{what} came without a memory fd")))
}

fn unexpected(r: &Response) -> ClientError {
    ClientError::Protocol(format!("unexpected response {r:?}"))
}

/// A replica id unique to this process and call.
pub fn fresh_replica() -> ReplicaId {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let mut h = blake3::Hasher::new();
    h.update(&std::process::id().to_le_bytes());
    h.update(&SEQ.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    h.update(&t.as_nanos().to_le_bytes());
    let b = h.finalize();
    ReplicaId::from_u128(u128::from_le_bytes(b.as_bytes()[..16].try_into().expect("16 bytes")))
}
