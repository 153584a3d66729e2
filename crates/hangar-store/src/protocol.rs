//! The daemon's local protocol over a Unix-domain socket.
//!
//! Frames are a `u32` little-endian length followed by that many bytes of
//! JSON. A response that hands out memory carries the sealed memfd as
//! `SCM_RIGHTS` ancillary data on the bytes of its frame (see
//! [`crate::memory`]). One request is answered by one response, in order.
//!
//! Operation names follow the TensorCast reference: `ResolveKey`,
//! `Materialize`, `Confirm`, `Unload`, plus `KeepAlive` for TTL leases and
//! `Status`, the streaming registration `BeginRegister` /
//! `CommitRegister` / `AbortRegister`, and `MaterializeIntoTarget` (with
//! `Describe` to size the target), whose *request* carries the caller's
//! memfd as `SCM_RIGHTS`.

use hangar_core::ReplicaId;
use serde::{Deserialize, Serialize};

use crate::blob::CommitReport;
use crate::id::{ArtifactId, StoreKey};
use crate::index::{CanonicalIndex, TensorSpec};
use crate::preflight::ServingPolicy;
use crate::view::ViewSpec;

/// Largest frame accepted (an index of a huge checkpoint is a few MiB).
pub const MAX_FRAME: u32 = 64 << 20;

/// What to materialize: an artifact, optionally narrowed by a view.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Selection {
    /// The artifact (never a view id; views are given by `view`).
    pub artifact_id: ArtifactId,
    /// Optional tensor-parallel view.
    #[serde(default)]
    pub view: Option<ViewSpec>,
    /// The key the caller resolved, if any; lets the daemon find the
    /// artifact in a fallback directory laid out by key.
    #[serde(default)]
    pub key: Option<StoreKey>,
}

/// A request from a local client.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op")]
pub enum Request {
    /// Key → id, locally then through the registry.
    ResolveKey {
        /// The key.
        key: StoreKey,
    },
    /// Allocate (or reuse) shared memory holding the selection and start loading it.
    Materialize {
        /// What.
        selection: Selection,
        /// The caller's replica id; the handle for `Confirm`/`Unload`/`KeepAlive`.
        replica: ReplicaId,
        /// Process holding the reference when the socket's peer credentials
        /// are unavailable (the kernel-reported peer pid wins otherwise).
        #[serde(default)]
        pid: Option<u32>,
        /// Hold by a TTL lease of this many ms instead of by a process.
        #[serde(default)]
        lease_ttl_ms: Option<u64>,
    },
    /// Stream the selection into the caller's own memory: the memfd rides on
    /// the request as `SCM_RIGHTS`, and the daemon writes the artifact (or
    /// view) at `offset` of it, verifying every chunk, then answers. It
    /// keeps nothing: no holder, no resident, no copy.
    MaterializeIntoTarget {
        /// What.
        selection: Selection,
        /// Where the region starts in the memfd.
        #[serde(default)]
        offset: u64,
        /// The region's length: at least the artifact's (or view's) `data_len`.
        len: u64,
    },
    /// The id and canonical layout of a selection, loading nothing: how a
    /// caller sizes a target region.
    Describe {
        /// What.
        selection: Selection,
    },
    /// Wait (bounded) until loading finished; surfaces loader errors.
    Confirm {
        /// The handle.
        replica: ReplicaId,
        /// Deadline in ms, capped at 30 000.
        timeout_ms: u64,
    },
    /// Drop the replica's reference. A no-op success if it holds nothing.
    Unload {
        /// The handle.
        replica: ReplicaId,
    },
    /// Extend a TTL lease.
    KeepAlive {
        /// The handle.
        replica: ReplicaId,
        /// New TTL from now.
        ttl_ms: u64,
    },
    /// Residents and budget.
    Status,
    /// Begin a streaming registration: the daemon lays the tensors out
    /// canonically and returns a writable memfd of that layout (as
    /// `SCM_RIGHTS`) for the producer to fill in place.
    BeginRegister {
        /// The tensors.
        tensors: Vec<TensorSpec>,
        /// Keys to point at the artifact on commit.
        #[serde(default)]
        keys: Vec<StoreKey>,
    },
    /// Hash what the producer wrote and store it (idempotent: `existed`).
    CommitRegister {
        /// The registration.
        handle: ReplicaId,
        /// The serving policy the artifact must pass (strict: a manifest required).
        #[serde(default)]
        serving: ServingPolicy,
    },
    /// Drop a registration without storing anything.
    AbortRegister {
        /// The registration.
        handle: ReplicaId,
    },
}

/// Where the bytes of a materialization came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// Already resident (lease-in-place).
    Resident,
    /// The local blob store.
    Local,
    /// A peer daemon.
    Peer,
    /// The fallback directory / object store.
    Fallback,
    /// A producer's registration (`CommitRegister`).
    Register,
}

impl Source {
    /// Lowercase label.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Resident => "resident",
            Source::Local => "local",
            Source::Peer => "peer",
            Source::Fallback => "fallback",
            Source::Register => "register",
        }
    }
}

/// One resident artifact in `Status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResidentInfo {
    /// Id (a view id for views).
    pub id: ArtifactId,
    /// Bytes.
    pub bytes: u64,
    /// Holders.
    pub refs: u32,
    /// Whether loading finished successfully.
    pub ready: bool,
}

/// Machine-readable error kinds, mapped to typed client errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// Unknown key.
    UnknownKey,
    /// No source holds the artifact.
    UnknownArtifact,
    /// Bytes did not match their hash.
    HashMismatch,
    /// Budget exhausted by referenced artifacts.
    OutOfBudget,
    /// Confirm's deadline passed.
    Timeout,
    /// The request was invalid (bad view, unknown handle, busy replica, a
    /// target region that cannot be written).
    BadRequest,
    /// The artifact failed the serving preflight.
    Preflight,
    /// Anything else.
    Internal,
}

/// A response to a [`Request`].
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op")]
pub enum Response {
    /// Answer to `ResolveKey`.
    Resolved {
        /// The id.
        id: ArtifactId,
    },
    /// Answer to `Materialize`; the memfd rides along as `SCM_RIGHTS`.
    Materialized {
        /// Id of what is mapped (the view id for a view).
        id: ArtifactId,
        /// Its layout.
        index: CanonicalIndex,
        /// True when it was already resident (lease-in-place: no allocation, no copy).
        reused: bool,
    },
    /// Answer to `MaterializeIntoTarget`: every byte is in the caller's
    /// region and verified.
    MaterializedInto {
        /// Id of what was written (the view id for a view).
        id: ArtifactId,
        /// Its layout, from the region's start.
        index: CanonicalIndex,
        /// Where the bytes came from.
        source: Source,
        /// Bytes written.
        bytes: u64,
        /// Time taken in ms.
        duration_ms: u64,
    },
    /// Answer to `Describe`.
    Described {
        /// Id (the view id for a view).
        id: ArtifactId,
        /// Its layout.
        index: CanonicalIndex,
    },
    /// Answer to `Confirm`.
    Confirmed {
        /// Where the bytes came from.
        source: Source,
        /// Bytes loaded.
        bytes: u64,
        /// Load time in ms.
        duration_ms: u64,
    },
    /// Answer to `Unload`.
    Unloaded {
        /// Whether a reference was dropped.
        released: bool,
    },
    /// Answer to `KeepAlive`.
    KeptAlive {
        /// Ms until expiry.
        expires_in_ms: u64,
    },
    /// Answer to `Status`.
    Status {
        /// Resident bytes.
        used: u64,
        /// Budget.
        budget: u64,
        /// Residents.
        residents: Vec<ResidentInfo>,
    },
    /// Answer to `BeginRegister`; the writable memfd rides along.
    RegisterBegun {
        /// Handle for commit / abort.
        handle: ReplicaId,
        /// Where each tensor goes in the memfd.
        index: CanonicalIndex,
    },
    /// Answer to `CommitRegister`.
    Committed {
        /// What was stored.
        report: CommitReport,
    },
    /// Answer to `AbortRegister`.
    Aborted {
        /// Whether the handle existed.
        existed: bool,
    },
    /// The request failed.
    Error {
        /// Kind.
        kind: ErrorKind,
        /// Human message.
        message: String,
    },
}
