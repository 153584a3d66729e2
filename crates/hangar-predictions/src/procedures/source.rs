//! Procedure sources: fetched, checked, and cached by the SHA-256 of the
//! archive.
//!
//! The cache is `DIR/sources/SHA256.tar.gz`, archives that passed every
//! rule of [`archive`] (they were extracted into a scratch directory,
//! which is then removed: the gateway runs nothing of them, a runtime
//! replica extracts them again on its own node). An archive is written
//! under a temporary name and renamed into place once whole, so a file of
//! that name is always a complete, checked archive and a crash leaves
//! only a temporary one (removed at the next start). One fetch per URL
//! runs at a time; the others wait for it and use its result.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::webhook_target::{self, Outbound};

use super::archive::{self, ArchiveError, Limits};

/// Why a source could not be made ready. Each names the URL.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SourceError {
    /// The URL is one the server may not fetch (the webhook destination
    /// guard: private, loopback and metadata addresses without an
    /// allow-list entry; not http(s); credentials in it).
    #[error("source_url `{url}` is refused: {why}")]
    Refused {
        /// The URL.
        url: String,
        /// Why.
        why: String,
    },
    /// The fetch failed or its answer was not 200.
    #[error("source_url `{url}` could not be fetched: {why}")]
    Fetch {
        /// The URL.
        url: String,
        /// What happened.
        why: String,
    },
    /// The archive was refused.
    #[error("the archive at source_url `{url}` {source}")]
    Archive {
        /// The URL.
        url: String,
        /// What is wrong with it.
        source: ArchiveError,
    },
    /// The URL now serves other bytes than when the procedure was created.
    #[error(
        "the archive at source_url `{url}` changed since the procedure was created (its SHA-256 was \
         {expected}, it is now {found}); create the procedure again to run the new source"
    )]
    Changed {
        /// The URL.
        url: String,
        /// The hash recorded at creation.
        expected: String,
        /// The hash of what it serves now.
        found: String,
    },
    /// The cache directory could not be written.
    #[error("the procedure source cache {path} could not be written: {source}")]
    Cache {
        /// The directory.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
}

impl SourceError {
    /// Whether the fault is the source's (its URL, its origin, its
    /// archive) rather than the server's.
    pub fn is_the_sources(&self) -> bool {
        !matches!(self, SourceError::Cache { .. })
    }
}

/// A checked archive in the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Archive {
    /// Its SHA-256, 64 hex digits.
    pub sha256: String,
    /// Where it is.
    pub path: PathBuf,
}

/// The source cache and its fetcher.
pub struct Sources {
    dir: PathBuf,
    limits: Limits,
    outbound: Outbound,
    /// One lock per URL being fetched.
    busy: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    fetches: AtomicU64,
}

/// Whether `name` is a cached archive's file name: 64 lowercase hex
/// digits and `.tar.gz`.
fn cached_name(name: &str) -> Option<&str> {
    name.strip_suffix(".tar.gz")
        .filter(|h| h.len() == 64 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
}

impl Sources {
    /// The cache in `dir` (`dir/sources`, created), fetching through
    /// `outbound` (the webhooks' client and destination guard). Whatever
    /// else is there —
    /// leftovers of an interrupted fetch, the extracted sources of earlier
    /// versions — is removed.
    pub fn open(dir: &Path, limits: Limits, outbound: Outbound) -> Result<Sources, SourceError> {
        let dir = dir.join("sources");
        let cache = |source| SourceError::Cache { path: dir.display().to_string(), source };
        std::fs::create_dir_all(&dir).map_err(cache)?;
        for entry in std::fs::read_dir(&dir).map_err(cache)?.flatten() {
            if cached_name(&entry.file_name().to_string_lossy()).is_none() {
                let path = entry.path();
                let _ = std::fs::remove_dir_all(&path).or_else(|_| std::fs::remove_file(&path));
            }
        }
        Ok(Sources { dir, limits, outbound, busy: Mutex::default(), fetches: AtomicU64::new(0) })
    }

    /// How many archives were fetched since the cache was opened.
    pub fn fetches(&self) -> u64 {
        self.fetches.load(Ordering::Relaxed)
    }

    /// Where the archive of hash `sha256` is (whether or not it is there).
    pub fn path_of(&self, sha256: &str) -> PathBuf {
        self.dir.join(format!("{sha256}.tar.gz"))
    }

    /// The hashes of the archives in the cache.
    pub fn cached(&self) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return Vec::new() };
        entries
            .flatten()
            .filter_map(|e| cached_name(&e.file_name().to_string_lossy()).map(str::to_owned))
            .collect()
    }

    /// The checked archive of `url`: from the cache when `expected` (the
    /// hash recorded at the procedure's creation) is there; else fetched,
    /// held to `expected` if given, checked and cached.
    ///
    /// # Cancel safety
    /// Dropping the future leaves the cache as it was or with the archive
    /// in place, never a partial one under its name (a temporary file or
    /// directory may be left until the next start).
    pub async fn prepare(&self, url: &str, expected: Option<&str>) -> Result<Archive, SourceError> {
        let cached = |sha256: &str| {
            let path = self.path_of(sha256);
            path.is_file().then(|| Archive { sha256: sha256.to_owned(), path })
        };
        if let Some(hit) = expected.and_then(cached) {
            return Ok(hit);
        }
        let lock = self.busy.lock().expect("busy table").entry(url.to_owned()).or_default().clone();
        let _held = lock.lock().await;
        if let Some(hit) = expected.and_then(cached) {
            return Ok(hit);
        }
        let bytes = self.fetch(url).await?;
        let sha256 = crate::sha256_hex(&bytes);
        if let Some(expected) = expected.filter(|e| **e != sha256) {
            return Err(SourceError::Changed {
                url: url.to_owned(),
                expected: expected.to_owned(),
                found: sha256,
            });
        }
        if let Some(hit) = cached(&sha256) {
            return Ok(hit);
        }
        let scratch = self.dir.join(format!("{sha256}.check-{}", crate::api::new_id()));
        let cache = |path: &Path| {
            let path = path.display().to_string();
            move |source| SourceError::Cache { path, source }
        };
        std::fs::create_dir_all(&scratch).map_err(cache(&scratch))?;
        let (limits, dest) = (self.limits, scratch.clone());
        let (checked, bytes) = tokio::task::spawn_blocking(move || {
            let checked = archive::extract(&bytes, &dest, &limits);
            let _ = std::fs::remove_dir_all(&dest);
            (checked, bytes)
        })
        .await
        .expect("extraction does not panic");
        checked.map_err(|source| SourceError::Archive { url: url.to_owned(), source })?;
        let path = self.path_of(&sha256);
        let partial = self.dir.join(format!("{sha256}.partial-{}", crate::api::new_id()));
        std::fs::write(&partial, &bytes).map_err(cache(&partial))?;
        std::fs::rename(&partial, &path).map_err(cache(&path))?;
        Ok(Archive { sha256, path })
    }

    /// Drops the archive of hash `sha256` (no procedure wants it any more).
    pub fn forget(&self, sha256: &str) {
        let at = self.path_of(sha256);
        if let Err(e) = std::fs::remove_file(&at) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!("could not remove the cached procedure source {}: {e}", at.display());
            }
        }
    }

    /// The archive at `url`, at most `max_archive_bytes` of it.
    async fn fetch(&self, url: &str) -> Result<Vec<u8>, SourceError> {
        self.outbound
            .check(url)
            .await
            .map_err(|e| SourceError::Refused { url: url.to_owned(), why: e.to_string() })?;
        self.fetches.fetch_add(1, Ordering::Relaxed);
        let failed = |why: String| SourceError::Fetch { url: url.to_owned(), why };
        let mut answer = self
            .outbound
            .http()
            .get(url)
            .send()
            .await
            .map_err(|e| failed(webhook_target::error_chain(&e)))?;
        if !answer.status().is_success() {
            return Err(failed(format!("the server answered {}", answer.status())));
        }
        let limit = self.limits.max_archive_bytes;
        let too_large = || SourceError::Archive {
            url: url.to_owned(),
            source: ArchiveError::CompressedTooLarge { limit },
        };
        if answer.content_length().is_some_and(|n| n > limit) {
            return Err(too_large());
        }
        let mut bytes = Vec::new();
        while let Some(chunk) = answer.chunk().await.map_err(|e| failed(webhook_target::error_chain(&e)))? {
            if (bytes.len() + chunk.len()) as u64 > limit {
                return Err(too_large());
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(bytes)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::procedures::archive::tests::{tar_gz, Entry, LIMITS};

    /// A loopback HTTP server answering every GET with `body`; counts them.
    pub(crate) async fn origin(body: Vec<u8>) -> (String, Arc<AtomicU64>) {
        let body = Arc::new(Mutex::new(body));
        let (url, hits, _) = origin_changing(body).await;
        (url, hits)
    }

    /// [`origin`] whose body the test may change.
    async fn origin_changing(body: Arc<Mutex<Vec<u8>>>) -> (String, Arc<AtomicU64>, Arc<Mutex<Vec<u8>>>) {
        let hits = Arc::new(AtomicU64::new(0));
        let counted = hits.clone();
        let served = body.clone();
        let app = axum::Router::new().route(
            "/{*path}",
            axum::routing::get(move || {
                counted.fetch_add(1, Ordering::Relaxed);
                let body = served.lock().unwrap().clone();
                async move { body }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (url, hits, body)
    }

    pub(crate) fn sources(dir: &Path, allow: &[&str]) -> Sources {
        let allow = Arc::new(
            webhook_target::AllowList::parse(&allow.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .unwrap(),
        );
        Sources::open(dir, LIMITS, Outbound::new(allow, None, None).unwrap()).unwrap()
    }

    #[tokio::test]
    async fn an_archive_is_fetched_once_checked_and_then_served_from_the_cache_by_its_hash() {
        let bytes = tar_gz(&[Entry::File("predict.py", b"def predict(): pass\n")]);
        let (base, hits) = origin(bytes.clone()).await;
        let dir = tempfile::tempdir().unwrap();
        let s = sources(dir.path(), &["127.0.0.1/32"]);
        let url = format!("{base}/p.tar.gz");
        let first = s.prepare(&url, None).await.unwrap();
        assert_eq!(first.sha256, crate::sha256_hex(&bytes));
        assert_eq!(first.path, dir.path().join("sources").join(format!("{}.tar.gz", first.sha256)));
        assert_eq!(std::fs::read(&first.path).unwrap(), bytes, "the archive itself, byte for byte");
        assert_eq!(s.cached(), std::slice::from_ref(&first.sha256), "the scratch extraction is gone");
        let second = s.prepare(&url, Some(&first.sha256)).await.unwrap();
        assert_eq!(first, second);
        assert_eq!((hits.load(Ordering::Relaxed), s.fetches()), (1, 1), "the second run did not fetch");
        // A restarted server finds the cache too, and drops what is not an archive of it.
        std::fs::create_dir(dir.path().join("sources").join("0123.partial-x")).unwrap();
        let again = sources(dir.path(), &["127.0.0.1/32"]);
        again.prepare(&url, Some(&first.sha256)).await.unwrap();
        assert_eq!(hits.load(Ordering::Relaxed), 1);
        assert_eq!(again.cached(), std::slice::from_ref(&first.sha256));
        // Forgotten, it is fetched again.
        again.forget(&first.sha256);
        again.prepare(&url, Some(&first.sha256)).await.unwrap();
        assert_eq!(hits.load(Ordering::Relaxed), 2);
    }

    #[tokio::test]
    async fn an_origin_serving_other_bytes_than_at_creation_is_refused() {
        let before = tar_gz(&[Entry::File("predict.py", b"def predict(): 1\n")]);
        let (base, _, body) = origin_changing(Arc::new(Mutex::new(before.clone()))).await;
        let dir = tempfile::tempdir().unwrap();
        let s = sources(dir.path(), &["127.0.0.1/32"]);
        let url = format!("{base}/p.tar.gz");
        let created = s.prepare(&url, None).await.unwrap();
        s.forget(&created.sha256);
        let after = tar_gz(&[Entry::File("predict.py", b"def predict(): 2\n")]);
        *body.lock().unwrap() = after.clone();
        let e = s.prepare(&url, Some(&created.sha256)).await.unwrap_err();
        assert!(
            matches!(&e, SourceError::Changed { found, .. } if *found == crate::sha256_hex(&after)),
            "{e}"
        );
        assert!(
            e.to_string().contains(&url) && e.to_string().contains("changed since the procedure was created")
        );
        assert!(s.cached().is_empty(), "nothing of it kept");
    }

    #[tokio::test]
    async fn the_webhook_guard_refuses_loopback_without_an_allow_entry() {
        let (base, hits) = origin(tar_gz(&[Entry::File("predict.py", b"")])).await;
        let dir = tempfile::tempdir().unwrap();
        let s = sources(dir.path(), &[]);
        let e = s.prepare(&format!("{base}/p.tar.gz"), None).await.unwrap_err();
        assert!(matches!(e, SourceError::Refused { .. }), "{e}");
        assert_eq!(hits.load(Ordering::Relaxed), 0, "nothing was sent");
        let e = s.prepare("file:///etc/passwd", None).await.unwrap_err();
        assert!(matches!(e, SourceError::Refused { .. }), "{e}");
    }

    #[tokio::test]
    async fn a_bad_archive_names_its_url_and_leaves_nothing_cached() {
        let (base, _) = origin(tar_gz(&[Entry::File("../evil.py", b"x")])).await;
        let dir = tempfile::tempdir().unwrap();
        let s = sources(dir.path(), &["127.0.0.1/32"]);
        let url = format!("{base}/bad.tar.gz");
        let e = s.prepare(&url, None).await.unwrap_err();
        assert!(e.to_string().contains(&url) && e.to_string().contains("`../evil.py` escapes"), "{e}");
        assert_eq!(std::fs::read_dir(dir.path().join("sources")).unwrap().count(), 0);
        let (big, _) = origin(vec![0x1f; (LIMITS.max_archive_bytes + 1) as usize]).await;
        let e = s.prepare(&format!("{big}/big.tar.gz"), None).await.unwrap_err();
        assert!(e.to_string().contains("max_archive_bytes"), "{e}");
    }
}
