//! Hangar's content-addressed model-weight store.
//!
//! An *artifact* is a set of named tensors laid out canonically
//! ([`index::CanonicalIndex`]) and identified by content
//! ([`ArtifactId`], `hg1:<index hash>:<data root>`, see [`chunks`]). The
//! [`BlobStore`] keeps verified artifacts on disk; imports come from
//! safetensors files ([`format`](mod@format)) or streaming [`Registration`]s.
//!
//! The per-node [`daemon`] keeps artifacts resident in sealed memfds
//! ([`memory`]) and hands the same memory to every process that selects
//! the same artifact or [`view`] (lease-in-place), tracking holders in a
//! sans-IO [`residency`] table. Misses load from the local blob store, then
//! from a peer daemon found through the [`registry`], then from the
//! [`fallback`] directory or object store. Processes talk to it with the
//! blocking [`client`] over the [`protocol`] on a Unix socket; a process
//! with memory of its own has the daemon stream an artifact straight into
//! it (`MaterializeIntoTarget`, [`client::StoreClient::materialize_into`]),
//! the daemon keeping nothing.
//!
//! An artifact carrying the reserved serving manifest tensor passes the
//! serving [`preflight`] before it is imported, registered or loaded.
//! Ingestions that leave an artifact stored on a node are published once
//! per artifact per window ([`publish`]).
//!
//! A directory an engine loads — a Hugging Face model directory, a LoRA
//! adapter's — is imported as one *directory artifact* whose files are
//! written back byte for byte, each checked against its hash
//! ([`directory`]); a LoRA adapter's is bound to its base model and name
//! and found by that name ([`adapters`]).
//!
//! ```
//! use hangar_store::{synth, BlobStore};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let files = synth::write_files(&dir.path().join("src"), &synth::model(1 << 16, 2, 7), 2).unwrap();
//! let store = BlobStore::open(dir.path().join("store")).unwrap();
//! let first = store.import_files(&files, &["demo/m:v1".parse().unwrap()]).unwrap();
//! let again = store.import_files(&files, &[]).unwrap();
//! assert!(again.existed && again.id == first.id);
//! ```
#![deny(missing_docs)]

pub mod adapters;
pub mod bench;
pub mod blob;
pub mod chunks;
pub mod client;
pub mod daemon;
pub mod directory;
pub mod disk_budget;
pub mod error;
pub mod export;
pub mod fallback;
pub mod format;
pub mod id;
pub mod index;
pub mod memory;
pub mod preflight;
pub mod protocol;
pub mod publish;
pub mod registry;
pub mod residency;
mod service;
pub mod synth;
pub mod telemetry;
pub mod view;

pub use blob::{ArtifactKind, ArtifactSummary, BlobStore, CommitReport, Registration, StoredArtifact};
pub use error::StoreError;
pub use id::{ArtifactId, IdOrKey, StoreKey};

/// The node's store when none is named: `$HANGAR_STORE_ROOT`, else
/// `$XDG_DATA_HOME/hangar/store`, else `~/.local/share/hangar/store` — one
/// per machine, shared by `hangar store` and `hangar serve`.
pub fn default_root() -> std::path::PathBuf {
    use std::path::PathBuf;
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    env("HANGAR_STORE_ROOT").unwrap_or_else(|| {
        env("XDG_DATA_HOME")
            .or_else(|| env("HOME").map(|h| h.join(".local/share")))
            .unwrap_or_else(|| PathBuf::from("."))
            .join("hangar/store")
    })
}
