//! Errors of the store library (blob store, loader, daemon side).
//!
//! Client-side errors are [`crate::client::ClientError`]; the daemon maps a
//! [`StoreError`] to a wire [`crate::protocol::ErrorKind`] so the client can
//! rebuild a typed error.

use std::path::Path;

use crate::format::FormatError;
use crate::id::{ArtifactId, IdParseError, StoreKey};
use crate::index::IndexError;

/// Everything the store can refuse or fail at.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// A file-system operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The path operated on.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A safetensors source is malformed.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// A tensor set or index is invalid.
    #[error(transparent)]
    Index(#[from] IndexError),
    /// An id or key did not parse.
    #[error(transparent)]
    Parse(#[from] IdParseError),
    /// No key of that name exists here (nor in the registry, for the daemon).
    #[error("unknown key `{0}`; import it with `hangar store import FILES --key {0}`")]
    UnknownKey(StoreKey),
    /// No source holds the artifact.
    #[error("artifact {0} is not in this store nor in any configured source")]
    UnknownArtifact(ArtifactId),
    /// The store knows the artifact (its keys resolve) but the disk budget
    /// dropped its bytes; a load through the daemon fetches them again.
    #[error(
        "artifact {id}{} is known here but its bytes are not on disk (the disk budget dropped \
         them); a load through the daemon (`hangar store get --socket …`, a replica start) \
         fetches them again from a peer or the fallback",
        key.as_ref().map(|k| format!(" (key `{k}`)")).unwrap_or_default()
    )]
    NotOnDisk {
        /// The artifact.
        id: ArtifactId,
        /// The key it was named by, if any.
        key: Option<StoreKey>,
    },
    /// Every source was tried for an artifact whose bytes this node does
    /// not hold, and none gave it: one line naming the artifact, its key
    /// and what each source said.
    #[error(transparent)]
    Unavailable(Box<Unavailable>),
    /// A load that ran in the daemon failed; what it said, kept whole for
    /// the replica that `Confirm`s it.
    #[error("{message}")]
    LoadFailed {
        /// The wire kind of the original error.
        kind: crate::protocol::ErrorKind,
        /// Its message.
        message: String,
    },
    /// Stored metadata does not match the id.
    #[error("artifact {what} is corrupt: {reason}")]
    Corrupt {
        /// What was checked.
        what: String,
        /// What did not match.
        reason: String,
    },
    /// Bytes read do not match their chunk hash; they were not served.
    #[error("hash mismatch in artifact {id} at chunk {chunk} (bytes {start}..): data is corrupt and was not served", start = *chunk as u64 * crate::chunks::CHUNK_SIZE)]
    HashMismatch {
        /// The artifact.
        id: ArtifactId,
        /// The failing chunk.
        chunk: usize,
    },
    /// A registration was fed a tensor not in its index.
    #[error("tensor `{0}` is not part of this registration")]
    UnknownTensor(String),
    /// A registration was fed more bytes than the tensor has.
    #[error("tensor `{tensor}` has {len} bytes; {got} were fed")]
    Overfeed {
        /// Tensor name.
        tensor: String,
        /// Its length.
        len: u64,
        /// Bytes fed including the refused feed.
        got: u64,
    },
    /// A registration was committed before every tensor was complete.
    #[error("tensor `{tensor}` has {len} bytes but only {got} were fed before commit")]
    Incomplete {
        /// Tensor name.
        tensor: String,
        /// Its length.
        len: u64,
        /// Bytes fed.
        got: u64,
    },
    /// Resident memory would exceed the daemon's budget even after evicting
    /// every unreferenced artifact.
    #[error(
        "out of memory budget: {need} bytes needed, {budget} budget, {pinned} held by referenced artifacts"
    )]
    OutOfBudget {
        /// Bytes requested.
        need: u64,
        /// The budget.
        budget: u64,
        /// Bytes that cannot be evicted.
        pinned: u64,
    },
    /// A view spec is invalid for this artifact.
    #[error("view: {0}")]
    View(String),
    /// A remote source (peer, registry, object store) failed.
    #[error("source {source_name}: {reason}")]
    Source {
        /// Which source.
        source_name: String,
        /// What happened.
        reason: String,
    },
    /// Loading did not finish before the deadline.
    #[error("loading {0} did not finish before the deadline")]
    Timeout(ArtifactId),
    /// The registry refused this daemon's node name: another live daemon
    /// holds it.
    #[error("registry {registry}: {taken}")]
    NodeNameTaken {
        /// The registry's URL.
        registry: String,
        /// Who holds the name.
        taken: crate::registry::NameTaken,
    },
    /// An artifact failed the serving preflight; nothing was accepted.
    #[error(transparent)]
    Preflight(#[from] crate::preflight::PreflightError),
    /// A caller's target region (`MaterializeIntoTarget`) cannot be written.
    #[error(transparent)]
    Target(#[from] crate::memory::TargetError),
    /// An unknown replica / lease handle.
    #[error("unknown handle `{0}`")]
    UnknownHandle(String),
}

/// What [`StoreError::Unavailable`] says: an artifact, the key it was
/// selected by, and what every source tried said.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "artifact {id}{} is in no source: {}",
    key.as_ref().map(|k| format!(" (key `{k}`)")).unwrap_or_default(),
    tried.join("; ")
)]
pub struct Unavailable {
    /// The artifact.
    pub id: ArtifactId,
    /// The key it was selected by, if any.
    pub key: Option<StoreKey>,
    /// `source: what happened`, in the order tried.
    pub tried: Vec<String>,
}

impl From<Unavailable> for StoreError {
    fn from(u: Unavailable) -> Self {
        StoreError::Unavailable(Box::new(u))
    }
}

/// Builds a closure mapping an I/O error to [`StoreError::Io`] at `path`.
pub fn io_err(path: &Path) -> impl Fn(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io { path: path.display().to_string(), source }
}
