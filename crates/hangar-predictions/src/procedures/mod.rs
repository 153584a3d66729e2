//! Procedures (seed 001, "Procedures"): user-provided Python pipelines run
//! on the shared *procedures runtime* (Replicate's `pipelines-runtime`).
//!
//! A [`Procedure`] is `owner/name` (the owner is the account that created
//! it), the URL of its source archive (a tar.gz) and whether it is
//! *ephemeral* — a draft whose source expires [`ProceduresConfig::ephemeral_ttl_s`]
//! (12 h) after it was created, as Replicate's `EphemeralProcedure` — or
//! persistent. The [`Registry`] keeps them in the prediction store, so
//! every gateway of a fleet shares them.
//!
//! Running one is a prediction of kind [`JobKind::Procedure`](crate::record::JobKind):
//! it waits in the one shared queue `input:procedure` (Replicate's unified
//! pipeline queue), and its run first has the source ready ([`Sources`]):
//! fetched by the gateway that runs it through the webhook destination
//! guard (the same [`AllowList`](crate::webhook_target::AllowList) and
//! client as webhooks), checked against every rule of [`archive`] and
//! against the hash recorded when the procedure was created, and cached
//! under that hash; then the executor sends it to a replica of the runtime
//! model (`PUT /procedures/{id}`), on whatever node it is, with a context
//! carrying the archive's hash and the caller's credentials, and serves the
//! archive to that replica for the run's length (`procedure_source_url`,
//! see `hangar_agent::cog`). The runtime downloads it, checks the hash and
//! extracts it into its own cache. The API shows the run as a prediction,
//! as Replicate's does.

pub mod archive;
pub(crate) mod routes;
mod source;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hangar_core::Millis;
use serde::{Deserialize, Serialize};

use hangar_core::FieldError;

pub use archive::{ArchiveError, Limits};
pub use source::{Archive, SourceError, Sources};

use crate::store::{PredictionQueue, StoreError};

/// The seed's lifetime of an ephemeral procedure's source: 12 h.
pub const DEFAULT_EPHEMERAL_TTL_S: u64 = 12 * 3600;

/// `[predictions.procedures]`: whether procedures run, on what, and the
/// bounds of their sources.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProceduresConfig {
    /// The model whose replicas run procedures: a model of the server
    /// whose engine is of kind `procedures`. Unset: procedures are off
    /// (their routes answer 404).
    #[serde(default)]
    pub runtime: Option<String>,
    /// Seconds an ephemeral procedure's source lives after its creation
    /// (default 43,200: 12 h).
    #[serde(default = "default_ttl")]
    pub ephemeral_ttl_s: u64,
    /// The most bytes a source archive may have, compressed (default 16 MiB).
    #[serde(default = "default_archive")]
    pub max_archive_bytes: u64,
    /// The most bytes it may decompress to (default 64 MiB).
    #[serde(default = "default_extracted")]
    pub max_extracted_bytes: u64,
    /// The most entries it may hold (default 10,000).
    #[serde(default = "default_entries")]
    pub max_entries: u32,
    /// Where the registry and the source cache live: set by the server
    /// (`DATA_DIR/procedures`), not by the file.
    #[serde(skip)]
    pub dir: Option<PathBuf>,
}

fn default_ttl() -> u64 {
    DEFAULT_EPHEMERAL_TTL_S
}
fn default_archive() -> u64 {
    16 << 20
}
fn default_extracted() -> u64 {
    64 << 20
}
fn default_entries() -> u32 {
    10_000
}

impl Default for ProceduresConfig {
    fn default() -> Self {
        serde_json::from_str("{}").expect("every field has a default")
    }
}

impl ProceduresConfig {
    /// The archive limits.
    pub fn limits(&self) -> Limits {
        Limits {
            max_archive_bytes: self.max_archive_bytes,
            max_extracted_bytes: self.max_extracted_bytes,
            max_entries: self.max_entries,
        }
    }

    /// Refuses bounds that cannot work; paths relative to the table.
    pub fn validate(&self) -> Result<(), FieldError> {
        if self.ephemeral_ttl_s == 0 {
            return Err(FieldError::new("ephemeral_ttl_s", "must be at least 1 s"));
        }
        for (field, v) in
            [("max_archive_bytes", self.max_archive_bytes), ("max_extracted_bytes", self.max_extracted_bytes)]
        {
            if v == 0 {
                return Err(FieldError::new(field, "must be at least 1 byte"));
            }
        }
        if self.max_entries == 0 {
            return Err(FieldError::new("max_entries", "must be at least 1"));
        }
        Ok(())
    }
}

/// One procedure.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Procedure {
    /// The account that owns it.
    pub owner: String,
    /// Its name under the owner.
    pub name: String,
    /// Where its source archive is.
    pub source_url: String,
    /// The SHA-256 of the archive fetched when it was created (64 hex
    /// digits): every later fetch, by any gateway, must bring the same
    /// bytes, so all of a fleet runs the source that was checked.
    /// Empty only in a `procedures.json` of an earlier version, before it
    /// is moved into the store ([`adopt_legacy`]).
    #[serde(default)]
    pub source_sha256: String,
    /// A draft whose source expires.
    pub ephemeral: bool,
    /// When it was created (ms since the Unix epoch).
    pub created_at: Millis,
}

impl Procedure {
    /// `owner/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.owner, self.name)
    }

    /// Its version id: the SHA-256 of its source archive (a new source, a
    /// new version).
    pub fn version(&self) -> &str {
        &self.source_sha256
    }

    /// When an ephemeral procedure's source expires, `ttl_ms` after its
    /// creation; `None` for a persistent one.
    pub fn expires_at(&self, ttl_ms: Millis) -> Option<Millis> {
        self.ephemeral.then(|| self.created_at.saturating_add(ttl_ms))
    }

    /// Whether its source has expired at `now`.
    pub fn expired(&self, now: Millis, ttl_ms: Millis) -> bool {
        self.expires_at(ttl_ms).is_some_and(|at| now >= at)
    }
}

/// Why the registry could not do what was asked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// A procedure of that name exists for the owner.
    #[error("procedure `{0}` already exists; delete it first to replace its source")]
    Exists(String),
    /// None of that name for the account.
    #[error("procedure `{0}` does not exist")]
    NotFound(String),
    /// An ephemeral procedure whose source has expired.
    #[error("the source of ephemeral procedure `{key}` expired at {at} ({ttl_s} s after its creation); create it again")]
    Expired {
        /// `owner/name`.
        key: String,
        /// When, RFC 3339.
        at: String,
        /// The lifetime, s.
        ttl_s: u64,
    },
    /// The prediction store did not answer.
    #[error("the procedures registry could not be read or written: {0}")]
    Store(#[from] StoreError),
}

/// The procedures of every account, kept in the prediction store (SQLite
/// on one machine, Redis in a fleet): every gateway of a fleet reads and
/// writes the same registry, and reads it at each use rather than keeping
/// a copy, so a procedure created or deleted through one gateway is
/// created or gone on all of them at once.
pub struct Registry {
    store: Arc<dyn PredictionQueue>,
    ttl_ms: Millis,
}

impl Registry {
    /// The registry in `store`; ephemeral sources live `ttl_s`.
    pub fn new(store: Arc<dyn PredictionQueue>, ttl_s: u64) -> Registry {
        Registry { store, ttl_ms: ttl_s.saturating_mul(1000) }
    }

    /// An ephemeral source's lifetime, ms.
    pub fn ttl_ms(&self) -> Millis {
        self.ttl_ms
    }

    /// Adds `p` (refused if its key exists).
    pub fn create(&self, p: &Procedure) -> Result<(), RegistryError> {
        match self.store.create_procedure(p)? {
            true => Ok(()),
            false => Err(RegistryError::Exists(p.key())),
        }
    }

    /// Removes `key`; whether it existed.
    pub fn delete(&self, key: &str) -> Result<bool, RegistryError> {
        Ok(self.store.delete_procedure(key)?)
    }

    /// The procedure `key` (whatever its expiry).
    pub fn get(&self, key: &str) -> Result<Option<Procedure>, RegistryError> {
        Ok(self.store.procedure(key)?)
    }

    /// The procedure `key` to run at `now`: refused once an ephemeral one's
    /// source expired.
    pub fn runnable(&self, key: &str, now: Millis) -> Result<Procedure, RegistryError> {
        let p = self.get(key)?.ok_or_else(|| RegistryError::NotFound(key.to_owned()))?;
        match p.expires_at(self.ttl_ms) {
            Some(at) if now >= at => Err(RegistryError::Expired {
                key: key.to_owned(),
                at: crate::record::rfc3339(at),
                ttl_s: self.ttl_ms / 1000,
            }),
            _ => Ok(p),
        }
    }

    /// Every procedure, by key.
    pub fn all(&self) -> Result<Vec<Procedure>, RegistryError> {
        Ok(self.store.procedures()?)
    }

    /// `owner`'s procedures, by name.
    pub fn of(&self, owner: &str) -> Result<Vec<Procedure>, RegistryError> {
        Ok(self.all()?.into_iter().filter(|p| p.owner == owner).collect())
    }

    /// The archives still wanted at `now`: those of procedures whose
    /// source has not expired.
    pub fn live_sources(&self, now: Millis) -> Result<BTreeSet<String>, RegistryError> {
        Ok(self
            .all()?
            .into_iter()
            .filter(|p| !p.expired(now, self.ttl_ms))
            .map(|p| p.source_sha256)
            .collect())
    }
}

/// The name of the registry file of earlier versions in the data
/// directory, and what it is renamed to once moved into the store.
const LEGACY_FILE: &str = "procedures.json";
const LEGACY_MOVED: &str = "procedures.json.moved";

/// Moves the procedures of a `procedures.json` of an earlier version (each
/// gateway kept its own) into the store: each one's source is fetched
/// again to learn its archive's hash, and one that fails is logged,
/// naming it and why, and left out. The file is then renamed
/// `procedures.json.moved` (kept for the operator). Nothing to do without
/// the file.
///
/// # Cancel safety
/// Dropped midway, the procedures moved so far are in the store and the
/// file keeps its name: the next start moves the rest (those already in
/// the store are skipped).
pub async fn adopt_legacy(dir: &Path, registry: &Registry, sources: &Sources) {
    let path = dir.join(LEGACY_FILE);
    let legacy: Vec<Procedure> = match std::fs::read(&path) {
        Ok(bytes) => match serde_json::from_slice(&bytes) {
            Ok(list) => list,
            Err(e) => {
                tracing::error!("{}: not a procedures registry ({e}); left as it is", path.display());
                return;
            }
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
        Err(e) => {
            tracing::error!("{} could not be read: {e}", path.display());
            return;
        }
    };
    for mut p in legacy {
        match registry.get(&p.key()) {
            Ok(Some(_)) => continue,
            Ok(None) => {}
            Err(e) => {
                tracing::error!(
                    "procedures from {} not moved: {e}; the next start tries again",
                    path.display()
                );
                return;
            }
        }
        match sources.prepare(&p.source_url, None).await {
            Ok(archive) => p.source_sha256 = archive.sha256,
            Err(e) => {
                tracing::error!(
                    "procedure `{}` of {} not moved into the store: {e}",
                    p.key(),
                    path.display()
                );
                continue;
            }
        }
        if let Err(e) = registry.create(&p) {
            tracing::error!("procedure `{}` of {} not moved into the store: {e}", p.key(), path.display());
        }
    }
    if let Err(e) = std::fs::rename(&path, dir.join(LEGACY_MOVED)) {
        tracing::error!("{} could not be renamed after its move: {e}", path.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::SqliteQueue;

    fn procedure(owner: &str, ephemeral: bool, created_at: Millis) -> Procedure {
        Procedure {
            owner: owner.into(),
            name: "pipe".into(),
            source_url: "https://example.com/p.tar.gz".into(),
            source_sha256: crate::version_id(owner),
            ephemeral,
            created_at,
        }
    }

    fn registry(dir: &Path, ttl_s: u64) -> Registry {
        Registry::new(Arc::new(SqliteQueue::open(dir).unwrap()), ttl_s)
    }

    #[test]
    fn an_ephemeral_source_expires_after_its_ttl_on_the_given_clock() {
        let dir = tempfile::tempdir().unwrap();
        let r = registry(dir.path(), DEFAULT_EPHEMERAL_TTL_S);
        let t0 = 1_800_000_000_000;
        r.create(&procedure("alice", true, t0)).unwrap();
        r.create(&procedure("bob", false, t0)).unwrap();
        let ttl = 12 * 3600 * 1000;
        assert!(r.runnable("alice/pipe", t0 + ttl - 1).is_ok(), "alive a millisecond before");
        let e = r.runnable("alice/pipe", t0 + ttl).unwrap_err();
        assert!(matches!(&e, RegistryError::Expired { ttl_s: 43_200, .. }), "{e}");
        assert!(e.to_string().contains("ephemeral procedure `alice/pipe` expired"), "{e}");
        assert!(r.runnable("bob/pipe", t0 + 100 * ttl).is_ok(), "a persistent one never expires");
        let live = r.live_sources(t0 + ttl).unwrap();
        assert_eq!(live, BTreeSet::from([crate::version_id("bob")]), "alice's archive is no longer wanted");
        assert!(matches!(r.runnable("carol/pipe", t0), Err(RegistryError::NotFound(k)) if k == "carol/pipe"));
    }

    #[test]
    fn the_registry_is_the_stores_and_refuses_duplicates() {
        let dir = tempfile::tempdir().unwrap();
        let r = registry(dir.path(), 60);
        r.create(&procedure("alice", false, 5)).unwrap();
        let taken = r.create(&procedure("alice", true, 6));
        assert!(matches!(taken, Err(RegistryError::Exists(k)) if k == "alice/pipe"));
        drop(r);
        let again = registry(dir.path(), 60);
        assert_eq!(again.get("alice/pipe").unwrap(), Some(procedure("alice", false, 5)));
        assert_eq!(again.of("alice").unwrap().len(), 1);
        assert!(again.of("bob").unwrap().is_empty());
        assert!(again.delete("alice/pipe").unwrap());
        assert!(!again.delete("alice/pipe").unwrap());
        assert!(registry(dir.path(), 60).get("alice/pipe").unwrap().is_none());
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_procedures_json_of_an_earlier_version_is_moved_into_the_store() {
        use source::tests::{origin, sources};
        let archive =
            archive::tests::tar_gz(&[archive::tests::Entry::File("predict.py", b"def predict(): 1\n")]);
        let (base, _) = origin(archive.clone()).await;
        let dir = tempfile::tempdir().unwrap();
        let mut old = procedure("alice", false, 5);
        old.source_sha256 = String::new();
        old.source_url = format!("{base}/p.tar.gz");
        let mut gone = procedure("bob", false, 5);
        gone.source_url = "http://10.255.255.1/not-allowed.tar.gz".into();
        let json = serde_json::json!([old, gone]).to_string().replace(",\"source_sha256\":\"\"", "");
        assert!(!json.contains("source_sha256\":\"\""), "written as an earlier version did");
        std::fs::write(dir.path().join(LEGACY_FILE), json).unwrap();
        let r = registry(dir.path(), 60);
        let s = sources(dir.path(), &["127.0.0.1/32"]);
        adopt_legacy(dir.path(), &r, &s).await;
        let moved = r.get("alice/pipe").unwrap().expect("moved");
        assert_eq!(moved.source_sha256, crate::sha256_hex(&archive));
        assert!(r.get("bob/pipe").unwrap().is_none(), "its source is refused: left out, logged");
        assert!(!dir.path().join(LEGACY_FILE).exists() && dir.path().join(LEGACY_MOVED).exists());
        // Run again (nothing to move), it changes nothing.
        adopt_legacy(dir.path(), &r, &s).await;
        assert_eq!(r.all().unwrap(), [moved]);
    }
}
