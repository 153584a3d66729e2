//! Redis, the distributed substrate of a Hangar fleet.
//!
//! Without a `redis` setting Hangar runs on one machine with SQLite; with
//! one, what must span machines lives in one Redis (7 or later, standalone,
//! with AOF; Sentinel or a managed Redis for failover): the predictions
//! queue on Streams, the node [`registry`] (agents' heartbeats), the
//! leader [`lease`], and the [`fleet`] state (what the leader wants on
//! each node, what each node and gateway reports). Every key Hangar writes starts with
//! [`PREFIX`]; `docs/cluster.md` lists them all.
//!
//! [`Redis`] is a small pool of blocking connections (the callers are
//! short synchronous store methods); [`LocalRedis`] starts a private
//! `redis-server` for tests and benchmarks.
//!
//! A `rediss://` URL reaches Redis over TLS (rustls), the server's
//! certificate verified against the trust roots of [`tls`] (the Mozilla
//! roots by default) and the URL's host; `?ca_file=/abs/path/ca.pem`
//! ([`CA_FILE_PARAM`]) trusts the CAs of that PEM file instead, for a
//! Redis with a private CA. Verification cannot be turned off: the
//! `#insecure` fragment the `redis` crate knows is refused.

pub mod fleet;
pub mod lease;
pub mod liveness;
pub mod registry;
mod server;
pub mod tls;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use redis;
pub use server::{LocalRedis, ServerError};

/// The first part of every key Hangar writes (`hangar:p:ID`, …).
pub const PREFIX: &str = "hangar";

/// How long connecting, and any one command, may take before it fails.
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// Connections kept per process.
const POOL_SIZE: u32 = 16;

/// The query parameter of a `rediss://` URL naming a PEM file (absolute
/// path) of the CAs that may sign the server's certificate, in place of
/// the default roots: `rediss://redis.internal:6380/0?ca_file=/etc/hangar/redis-ca.pem`.
pub const CA_FILE_PARAM: &str = "ca_file";

/// A Redis failure, naming the server.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedisError {
    /// The URL is not a Redis URL (`redis://host:port/db`,
    /// `rediss://host:port/db?ca_file=…`, `unix:///path/to/socket`), or
    /// its `ca_file` cannot be used.
    #[error("redis URL `{url}` {reason}")]
    Url {
        /// The URL as given.
        url: String,
        /// What is wrong with it, a phrase that follows the URL
        /// (`is not a Redis URL (…)`).
        reason: String,
    },
    /// No connection could be made (or taken from the pool in time).
    #[error("cannot reach redis at {url}: {reason}")]
    Unreachable {
        /// The server.
        url: String,
        /// The cause.
        reason: String,
    },
    /// A command failed.
    #[error("redis at {url}: {source}")]
    Command {
        /// The server.
        url: String,
        /// The cause.
        source: redis::RedisError,
    },
}

/// A pool of connections to one Redis. Cheap to clone.
#[derive(Clone)]
pub struct Redis {
    pool: r2d2::Pool<Manager>,
    /// The pool manager's epoch (see [`Redis::run`]).
    epoch: Arc<AtomicU64>,
    url: String,
}

impl std::fmt::Debug for Redis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Redis").field("url", &self.url).finish_non_exhaustive()
    }
}

/// A connection taken from the pool (back to it on drop).
type Conn = r2d2::PooledConnection<Manager>;

/// Checks that `url` is a Redis URL, and reads and checks the CA file a
/// `rediss://` URL names ([`CA_FILE_PARAM`]), without connecting: what a
/// configuration loader can say about it.
pub fn check_url(url: &str) -> Result<(), String> {
    client(url).map(drop).map_err(|reason| format!("`{url}` {reason}"))
}

/// The client of `url`, or why there is none (a phrase that follows the
/// URL in a message).
fn client(url: &str) -> Result<redis::Client, String> {
    let not_a_url = |e: redis::RedisError| {
        format!(
            "is not a Redis URL ({e}); use redis://HOST:PORT/DB, rediss://HOST:PORT/DB (TLS, \
             optionally ?{CA_FILE_PARAM}=/path/ca.pem) or unix:///path/to/socket"
        )
    };
    let Ok(mut parsed) = url::Url::parse(url) else {
        return redis::Client::open(url).map_err(not_a_url);
    };
    let tls = matches!(parsed.scheme(), "rediss" | "valkeys");
    if tls && parsed.fragment() == Some("insecure") {
        return Err(format!(
            "asks for `#insecure`, which would accept any certificate: Hangar always verifies it; \
             give the CA that signed it with ?{CA_FILE_PARAM}=/path/ca.pem"
        ));
    }
    let (ca_files, others): (Vec<_>, Vec<_>) = parsed
        .query_pairs()
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .partition(|(k, _)| k == CA_FILE_PARAM);
    let ca_file = match ca_files.as_slice() {
        [] => return redis::Client::open(url).map_err(not_a_url),
        [_] if !tls => return Err(format!("gives `{CA_FILE_PARAM}`, which only a rediss:// (TLS) URL uses")),
        [(_, path)] => tls::CaFile::load(Path::new(path))
            .map_err(|e| format!("names a {CA_FILE_PARAM} that cannot be used: {e}"))?,
        _ => return Err(format!("gives `{CA_FILE_PARAM}` more than once")),
    };
    // The redis crate reads the rest of the URL; the CA goes beside it.
    if others.is_empty() {
        parsed.set_query(None);
    } else {
        parsed.query_pairs_mut().clear().extend_pairs(others);
    }
    let certificates = redis::TlsCertificates { client_tls: None, root_cert: Some(ca_file.pem().to_vec()) };
    redis::Client::build_with_tls(parsed.as_str(), certificates).map_err(not_a_url)
}

impl Redis {
    /// Checks `url` (and reads the CA file it names) and that the server
    /// answers `PING`, then keeps up to 16 connections. Fails naming the
    /// URL when it is malformed, its CA file unusable, the server's
    /// certificate not trusted (`rediss://`), or the server does not
    /// answer within 5 s.
    pub fn connect(url: &str) -> Result<Redis, RedisError> {
        let client = client(url).map_err(|reason| RedisError::Url { url: url.to_owned(), reason })?;
        tls::install_crypto_provider();
        // A dead connection is found when a command on it fails (and is
        // then dropped, `has_broken`), not by a PING before every use,
        // which would double each command's round trip.
        let epoch = Arc::<AtomicU64>::default();
        let pool = r2d2::Pool::builder()
            .max_size(POOL_SIZE)
            .min_idle(Some(1))
            .connection_timeout(IO_TIMEOUT)
            .test_on_check_out(false)
            .error_handler(Box::new(r2d2::NopErrorHandler))
            .build_unchecked(Manager { client, epoch: epoch.clone() });
        let redis = Redis { pool, epoch, url: url.to_owned() };
        redis.run(|c| redis::cmd("PING").query::<String>(c))?;
        Ok(redis)
    }

    /// A connection, with commands bounded by a 5 s timeout. Never one
    /// opened before the last dropped connection was seen (see
    /// [`Redis::run`]).
    fn conn(&self) -> Result<Conn, RedisError> {
        loop {
            let conn = self
                .pool
                .get()
                .map_err(|e| RedisError::Unreachable { url: self.url.clone(), reason: e.to_string() })?;
            if conn.epoch == self.epoch.load(Ordering::Relaxed) {
                return Ok(conn);
            }
            // Dropping it hands it back, where `has_broken` discards it.
        }
    }

    /// Runs `f` on a connection. When the connection turns out dropped
    /// (Redis restarted, or the network cut it), every connection opened
    /// before is retired and `f` runs once more on a fresh one — so `f`
    /// must be safe to repeat: idempotent, or a compare-and-set whose
    /// second run reports the first's success.
    pub fn run<T>(
        &self,
        mut f: impl FnMut(&mut redis::Connection) -> redis::RedisResult<T>,
    ) -> Result<T, RedisError> {
        let mut conn = self.conn()?;
        match f(&mut conn.conn) {
            Err(e) if e.is_connection_dropped() => {
                self.epoch.fetch_add(1, Ordering::Relaxed);
                drop(conn);
                let mut conn = self.conn()?;
                f(&mut conn.conn).map_err(|e| self.error(e))
            }
            r => r.map_err(|e| self.error(e)),
        }
    }

    /// The live entries of an index: `index` is a sorted set of names,
    /// each name's value is the string at `key(name)` (all read in one
    /// `MGET`), and a name whose value is gone (its TTL passed) — or is
    /// not a string, which `MGET` reads as nothing — leaves the index.
    /// Returns (name, value) for the others, in the index's order. A name
    /// written again between the read and its removal is put back by its
    /// writer's next write, which adds it to the index.
    pub fn live_in_index(
        &self,
        index: &str,
        key: impl Fn(&str) -> String,
    ) -> Result<Vec<(String, String)>, RedisError> {
        let names: Vec<String> = self.run(|c| redis::cmd("ZRANGE").arg(index).arg(0).arg(-1).query(c))?;
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = names.iter().map(|n| key(n)).collect();
        let values: Vec<Option<String>> = self.run(|c| redis::cmd("MGET").arg(&keys).query(c))?;
        let (live, gone): (Vec<_>, Vec<_>) = names.into_iter().zip(values).partition(|(_, v)| v.is_some());
        if !gone.is_empty() {
            let gone: Vec<&String> = gone.iter().map(|(n, _)| n).collect();
            self.run(|c| redis::cmd("ZREM").arg(index).arg(&gone).query::<i64>(c))?;
        }
        Ok(live.into_iter().filter_map(|(n, v)| Some((n, v?))).collect())
    }

    /// The server's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// `e`, naming this server.
    fn error(&self, source: redis::RedisError) -> RedisError {
        RedisError::Command { url: self.url.clone(), source }
    }
}

/// Opens the pool's connections, each with [`IO_TIMEOUT`] on connecting,
/// reading and writing, so a server that stops answering fails a
/// command instead of hanging its caller; each tagged with the epoch it
/// was opened in.
#[derive(Debug)]
pub struct Manager {
    client: redis::Client,
    /// Bumped when a dropped connection is seen: older ones are retired.
    epoch: Arc<AtomicU64>,
}

/// A pooled connection and the epoch it was opened in.
pub struct Tagged {
    conn: redis::Connection,
    epoch: u64,
}

impl r2d2::ManageConnection for Manager {
    type Connection = Tagged;
    type Error = redis::RedisError;

    fn connect(&self) -> Result<Tagged, redis::RedisError> {
        let epoch = self.epoch.load(Ordering::Relaxed);
        let conn = self.client.get_connection_with_timeout(IO_TIMEOUT)?;
        conn.set_read_timeout(Some(IO_TIMEOUT))?;
        conn.set_write_timeout(Some(IO_TIMEOUT))?;
        Ok(Tagged { conn, epoch })
    }

    fn is_valid(&self, conn: &mut Tagged) -> Result<(), redis::RedisError> {
        redis::cmd("PING").query::<String>(&mut conn.conn).map(drop)
    }

    fn has_broken(&self, conn: &mut Tagged) -> bool {
        conn.epoch != self.epoch.load(Ordering::Relaxed) || !redis::ConnectionLike::is_open(&conn.conn)
    }
}
