//! Procedures (seed 001, "Procedures"): user-provided Python pipelines run
//! on the shared *procedures runtime* (Replicate's `pipelines-runtime`).
//!
//! A [`Procedure`] is `owner/name` (the owner is the account that created
//! it), the URL of its source archive (a tar.gz) and whether it is
//! *ephemeral* — a draft whose source expires [`ProceduresConfig::ephemeral_ttl_s`]
//! (12 h) after it was created, as Replicate's `EphemeralProcedure` — or
//! persistent. The [`Registry`] keeps them in `procedures.json` under the
//! data directory.
//!
//! Running one is a prediction of kind [`JobKind::Procedure`](crate::record::JobKind):
//! it waits in the one shared queue `input:procedure` (Replicate's unified
//! pipeline queue), and its run first has the source ready ([`Sources`]):
//! fetched by the server through the webhook destination guard (the same
//! [`AllowList`] and client as webhooks), cached under a hash of its URL,
//! extracted once ([`archive`]); then the executor sends it to the runtime
//! model's replicas (`PUT /procedures/{id}`) with a context naming the
//! extracted source as a `file://` URL and the caller's credentials. The
//! API shows the run as a prediction, as Replicate's does.

pub mod archive;
pub(crate) mod routes;
mod source;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use hangar_core::Millis;
use serde::{Deserialize, Serialize};

use hangar_core::FieldError;

pub use archive::{ArchiveError, Limits};
pub use source::{SourceError, Sources};

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

    /// Its version id: a hash of its source URL (a new source, a new
    /// version).
    pub fn version(&self) -> String {
        crate::version_id(&self.source_url)
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

/// Why a procedure could not be found to run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LookupError {
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
}

/// Why the registry could not be changed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// A procedure of that name exists for the owner.
    #[error("procedure `{0}` already exists; delete it first to replace its source")]
    Exists(String),
    /// The registry file could not be read or written (the registry in
    /// memory is unchanged).
    #[error("the procedures registry {path} could not be {what}: {source}")]
    Io {
        /// The file.
        path: String,
        /// `read` or `written`.
        what: &'static str,
        /// The cause.
        source: std::io::Error,
    },
}

/// The procedures of every account, kept in a JSON file.
pub struct Registry {
    path: PathBuf,
    ttl_ms: Millis,
    all: Mutex<BTreeMap<String, Procedure>>,
}

impl Registry {
    /// The registry in `dir` (`procedures.json`; none yet: empty).
    pub fn open(dir: &Path, ttl_s: u64) -> Result<Registry, RegistryError> {
        let path = dir.join("procedures.json");
        let shown = path.display().to_string();
        let all = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice::<Vec<Procedure>>(&bytes)
                .map_err(|e| RegistryError::Io { path: shown, what: "read", source: e.into() })?
                .into_iter()
                .map(|p| (p.key(), p))
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(source) => return Err(RegistryError::Io { path: shown, what: "read", source }),
        };
        Ok(Registry { path, ttl_ms: ttl_s.saturating_mul(1000), all: Mutex::new(all) })
    }

    /// An ephemeral source's lifetime, ms.
    pub fn ttl_ms(&self) -> Millis {
        self.ttl_ms
    }

    fn save(&self, all: &BTreeMap<String, Procedure>) -> Result<(), RegistryError> {
        let io =
            |source| RegistryError::Io { path: self.path.display().to_string(), what: "written", source };
        let list: Vec<&Procedure> = all.values().collect();
        let tmp = self.path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(&list).expect("procedures serialize")).map_err(io)?;
        std::fs::rename(&tmp, &self.path).map_err(io)
    }

    /// Adds `p` (refused if its key exists).
    pub fn create(&self, p: Procedure) -> Result<(), RegistryError> {
        let mut all = self.all.lock().expect("registry");
        let key = p.key();
        if all.contains_key(&key) {
            return Err(RegistryError::Exists(key));
        }
        let mut next = all.clone();
        next.insert(key, p);
        self.save(&next)?;
        *all = next;
        Ok(())
    }

    /// Removes `key`; the removed procedure, if it existed.
    pub fn delete(&self, key: &str) -> Result<Option<Procedure>, RegistryError> {
        let mut all = self.all.lock().expect("registry");
        let mut next = all.clone();
        let Some(gone) = next.remove(key) else { return Ok(None) };
        self.save(&next)?;
        *all = next;
        Ok(Some(gone))
    }

    /// The procedure `key` (whatever its expiry).
    pub fn get(&self, key: &str) -> Option<Procedure> {
        self.all.lock().expect("registry").get(key).cloned()
    }

    /// The procedure `key` to run at `now`: refused once an ephemeral one's
    /// source expired.
    pub fn runnable(&self, key: &str, now: Millis) -> Result<Procedure, LookupError> {
        let p = self.get(key).ok_or_else(|| LookupError::NotFound(key.to_owned()))?;
        match p.expires_at(self.ttl_ms) {
            Some(at) if now >= at => Err(LookupError::Expired {
                key: key.to_owned(),
                at: crate::record::rfc3339(at),
                ttl_s: self.ttl_ms / 1000,
            }),
            _ => Ok(p),
        }
    }

    /// Every procedure.
    pub fn all(&self) -> Vec<Procedure> {
        self.all.lock().expect("registry").values().cloned().collect()
    }

    /// `owner`'s procedures, by name.
    pub fn of(&self, owner: &str) -> Vec<Procedure> {
        self.all.lock().expect("registry").values().filter(|p| p.owner == owner).cloned().collect()
    }

    /// The ephemeral procedures expired at `now` (their sources to drop).
    pub fn expired(&self, now: Millis) -> Vec<Procedure> {
        self.all.lock().expect("registry").values().filter(|p| p.expired(now, self.ttl_ms)).cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn procedure(owner: &str, ephemeral: bool, created_at: Millis) -> Procedure {
        Procedure {
            owner: owner.into(),
            name: "pipe".into(),
            source_url: "https://example.com/p.tar.gz".into(),
            ephemeral,
            created_at,
        }
    }

    #[test]
    fn an_ephemeral_source_expires_after_its_ttl_on_the_given_clock() {
        let dir = tempfile::tempdir().unwrap();
        let r = Registry::open(dir.path(), DEFAULT_EPHEMERAL_TTL_S).unwrap();
        let t0 = 1_800_000_000_000;
        r.create(procedure("alice", true, t0)).unwrap();
        r.create(procedure("bob", false, t0)).unwrap();
        let ttl = 12 * 3600 * 1000;
        assert!(r.runnable("alice/pipe", t0 + ttl - 1).is_ok(), "alive a millisecond before");
        let e = r.runnable("alice/pipe", t0 + ttl).unwrap_err();
        assert!(matches!(&e, LookupError::Expired { ttl_s: 43_200, .. }), "{e}");
        assert!(e.to_string().contains("ephemeral procedure `alice/pipe` expired"), "{e}");
        assert!(r.runnable("bob/pipe", t0 + 100 * ttl).is_ok(), "a persistent one never expires");
        assert_eq!(r.expired(t0 + ttl).iter().map(Procedure::key).collect::<Vec<_>>(), ["alice/pipe"]);
        assert_eq!(r.runnable("carol/pipe", t0), Err(LookupError::NotFound("carol/pipe".into())));
    }

    #[test]
    fn the_registry_survives_a_restart_and_refuses_duplicates() {
        let dir = tempfile::tempdir().unwrap();
        let r = Registry::open(dir.path(), 60).unwrap();
        r.create(procedure("alice", false, 5)).unwrap();
        assert!(
            matches!(r.create(procedure("alice", true, 6)), Err(RegistryError::Exists(k)) if k == "alice/pipe")
        );
        let again = Registry::open(dir.path(), 60).unwrap();
        assert_eq!(again.get("alice/pipe"), Some(procedure("alice", false, 5)));
        assert_eq!(again.of("alice").len(), 1);
        assert!(again.of("bob").is_empty());
        assert_eq!(again.delete("alice/pipe").unwrap().map(|p| p.owner), Some("alice".into()));
        assert!(Registry::open(dir.path(), 60).unwrap().get("alice/pipe").is_none());
    }
}
