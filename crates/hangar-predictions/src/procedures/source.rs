//! Procedure sources fetched, cached by a hash of their URL and extracted
//! once.
//!
//! The cache is `DIR/sources/HASH/` (HASH: the SHA-256 of the URL), the
//! extracted source. It is written under a temporary name and renamed into
//! place once whole, so a directory of that name is always a complete,
//! checked source and a crash leaves only a temporary one (removed at the
//! next start). One fetch per URL runs at a time; the others wait for it
//! and use its result.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::webhook_target::{self, AllowList};

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

/// The source cache and its fetcher.
pub struct Sources {
    dir: PathBuf,
    limits: Limits,
    http: reqwest::Client,
    allow: Arc<AllowList>,
    /// One lock per URL hash being prepared.
    busy: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    fetches: AtomicU64,
}

/// The cache key of `url`: 64 hex digits of its SHA-256.
pub fn key(url: &str) -> String {
    crate::version_id(url)
}

impl Sources {
    /// The cache in `dir` (`dir/sources`, created), fetching with `http`
    /// (the webhook client, whose resolver vets every address) after
    /// checking each URL against `allow`. Leftovers of an interrupted
    /// extraction are removed.
    pub fn open(
        dir: &Path,
        limits: Limits,
        http: reqwest::Client,
        allow: Arc<AllowList>,
    ) -> Result<Sources, SourceError> {
        let dir = dir.join("sources");
        let cache = |source| SourceError::Cache { path: dir.display().to_string(), source };
        std::fs::create_dir_all(&dir).map_err(cache)?;
        for entry in std::fs::read_dir(&dir).map_err(cache)?.flatten() {
            if entry.file_name().to_string_lossy().contains(".partial") {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        Ok(Sources { dir, limits, http, allow, busy: Mutex::default(), fetches: AtomicU64::new(0) })
    }

    /// How many archives were fetched since the cache was opened.
    pub fn fetches(&self) -> u64 {
        self.fetches.load(Ordering::Relaxed)
    }

    /// Where `url`'s extracted source is (whether or not it is there).
    pub fn path_of(&self, url: &str) -> PathBuf {
        self.dir.join(key(url))
    }

    /// The extracted source of `url`: from the cache, or fetched, checked
    /// and extracted into it first.
    ///
    /// # Cancel safety
    /// Dropping the future leaves the cache as it was or with the source
    /// in place, never a partial source under its name (a temporary
    /// directory may be left until the next start).
    pub async fn prepare(&self, url: &str) -> Result<PathBuf, SourceError> {
        let at = self.path_of(url);
        if at.is_dir() {
            return Ok(at);
        }
        let lock = self.busy.lock().expect("busy table").entry(key(url)).or_default().clone();
        let _held = lock.lock().await;
        if at.is_dir() {
            return Ok(at);
        }
        let bytes = self.fetch(url).await?;
        let partial = self.dir.join(format!("{}.partial-{}", key(url), crate::api::new_id()));
        let cache = |source| SourceError::Cache { path: partial.display().to_string(), source };
        std::fs::create_dir_all(&partial).map_err(cache)?;
        let limits = self.limits;
        let dest = partial.clone();
        let extracted = tokio::task::spawn_blocking(move || archive::extract(&bytes, &dest, &limits))
            .await
            .expect("extraction does not panic");
        if let Err(source) = extracted {
            let _ = std::fs::remove_dir_all(&partial);
            return Err(SourceError::Archive { url: url.to_owned(), source });
        }
        std::fs::rename(&partial, &at).map_err(cache)?;
        Ok(at)
    }

    /// Drops `url`'s cached source (a procedure deleted or expired).
    pub fn forget(&self, url: &str) {
        let at = self.path_of(url);
        if let Err(e) = std::fs::remove_dir_all(&at) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!("could not remove the cached procedure source {}: {e}", at.display());
            }
        }
    }

    /// The archive at `url`, at most `max_archive_bytes` of it.
    async fn fetch(&self, url: &str) -> Result<Vec<u8>, SourceError> {
        webhook_target::check_url(url, &self.allow)
            .map_err(|e| SourceError::Refused { url: url.to_owned(), why: e.to_string() })?;
        self.fetches.fetch_add(1, Ordering::Relaxed);
        let failed = |why: String| SourceError::Fetch { url: url.to_owned(), why };
        let mut answer =
            self.http.get(url).send().await.map_err(|e| failed(webhook_target::error_chain(&e)))?;
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
mod tests {
    use super::*;
    use crate::procedures::archive::tests::{tar_gz, Entry, LIMITS};

    /// A loopback HTTP server answering every GET with `body`; counts them.
    async fn origin(body: Vec<u8>) -> (String, Arc<AtomicU64>) {
        let hits = Arc::new(AtomicU64::new(0));
        let counted = hits.clone();
        let app = axum::Router::new().route(
            "/{*path}",
            axum::routing::get(move || {
                counted.fetch_add(1, Ordering::Relaxed);
                let body = body.clone();
                async move { body }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (url, hits)
    }

    fn sources(dir: &Path, allow: &[&str]) -> Sources {
        let allow =
            Arc::new(AllowList::parse(&allow.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap());
        let http = webhook_target::client(allow.clone(), None).unwrap();
        Sources::open(dir, LIMITS, http, allow).unwrap()
    }

    #[tokio::test]
    async fn a_source_is_fetched_once_and_then_served_from_the_cache() {
        let (base, hits) = origin(tar_gz(&[Entry::File("predict.py", b"def predict(): pass\n")])).await;
        let dir = tempfile::tempdir().unwrap();
        let s = sources(dir.path(), &["127.0.0.1/32"]);
        let url = format!("{base}/p.tar.gz");
        let first = s.prepare(&url).await.unwrap();
        assert_eq!(first, dir.path().join("sources").join(key(&url)));
        assert!(first.join("predict.py").is_file());
        let second = s.prepare(&url).await.unwrap();
        assert_eq!(first, second);
        assert_eq!((hits.load(Ordering::Relaxed), s.fetches()), (1, 1), "the second run did not fetch");
        // A restarted server finds the cache too.
        let again = sources(dir.path(), &["127.0.0.1/32"]);
        again.prepare(&url).await.unwrap();
        assert_eq!(hits.load(Ordering::Relaxed), 1);
        // Forgotten, it is fetched again.
        again.forget(&url);
        again.prepare(&url).await.unwrap();
        assert_eq!(hits.load(Ordering::Relaxed), 2);
    }

    #[tokio::test]
    async fn the_webhook_guard_refuses_loopback_without_an_allow_entry() {
        let (base, hits) = origin(tar_gz(&[Entry::File("predict.py", b"")])).await;
        let dir = tempfile::tempdir().unwrap();
        let s = sources(dir.path(), &[]);
        let e = s.prepare(&format!("{base}/p.tar.gz")).await.unwrap_err();
        assert!(matches!(e, SourceError::Refused { .. }), "{e}");
        assert_eq!(hits.load(Ordering::Relaxed), 0, "nothing was sent");
        let e = s.prepare("file:///etc/passwd").await.unwrap_err();
        assert!(matches!(e, SourceError::Refused { .. }), "{e}");
    }

    #[tokio::test]
    async fn a_bad_archive_names_its_url_and_leaves_nothing_cached() {
        let (base, _) = origin(tar_gz(&[Entry::File("../evil.py", b"x")])).await;
        let dir = tempfile::tempdir().unwrap();
        let s = sources(dir.path(), &["127.0.0.1/32"]);
        let url = format!("{base}/bad.tar.gz");
        let e = s.prepare(&url).await.unwrap_err();
        assert!(e.to_string().contains(&url) && e.to_string().contains("`../evil.py` escapes"), "{e}");
        assert_eq!(std::fs::read_dir(dir.path().join("sources")).unwrap().count(), 0);
        let (big, _) = origin(vec![0x1f; (LIMITS.max_archive_bytes + 1) as usize]).await;
        let e = s.prepare(&format!("{big}/big.tar.gz")).await.unwrap_err();
        assert!(e.to_string().contains("max_archive_bytes"), "{e}");
    }
}
