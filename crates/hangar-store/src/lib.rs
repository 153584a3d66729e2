//! Hangar's content-addressed model-weight store.
//!
//! An *artifact* is a set of named tensors laid out canonically
//! ([`index::CanonicalIndex`]) and identified by content
//! ([`id::ArtifactId`], `hg1:<index hash>:<data root>`). The
//! [`blob::BlobStore`] keeps verified artifacts on disk; imports come from
//! safetensors files ([`format`]) or streaming registrations.
#![deny(missing_docs)]

pub mod blob;
pub mod chunks;
pub mod error;
pub mod export;
pub mod format;
pub mod id;
pub mod index;
pub mod synth;

pub use blob::{BlobStore, CommitReport, Registration, StoredArtifact};
pub use error::StoreError;
pub use id::{ArtifactId, IdOrKey, StoreKey};
pub mod bench;
pub mod client;
pub mod daemon;
pub mod fallback;
pub mod memory;
pub mod protocol;
pub mod registry;
pub mod residency;
pub mod telemetry;
pub mod view;
