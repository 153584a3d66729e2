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

pub mod fleet;
pub mod lease;
pub mod registry;
mod server;

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

/// A Redis failure, naming the server.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedisError {
    /// The URL is not a Redis URL (`redis://host:port/db`,
    /// `rediss://…`, `unix:///path/to/socket`).
    #[error("redis URL `{url}`: {reason}")]
    Url {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
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

impl RedisError {
    /// Whether the server could not be reached or could not serve now —
    /// not connected, the connection dropped, a command timed out (a
    /// server paused with `CLIENT PAUSE` or overloaded), still loading
    /// its data (`LOADING`), busy with a script (`BUSY`), a replica
    /// being promoted (`MASTERDOWN`, `READONLY`, `TRYAGAIN`) — rather
    /// than refusing the command itself. The same call may succeed when
    /// repeated later; callers answer "retry" (HTTP 503) instead of
    /// failing for good. Judged on the error's kind, never its text.
    pub fn is_unavailable(&self) -> bool {
        use redis::{ErrorKind, ServerErrorKind};
        match self {
            RedisError::Url { .. } => false,
            RedisError::Unreachable { .. } => true,
            RedisError::Command { source, .. } => {
                source.is_io_error()
                    || matches!(
                        source.kind(),
                        ErrorKind::Server(
                            ServerErrorKind::BusyLoading
                                | ServerErrorKind::TryAgain
                                | ServerErrorKind::MasterDown
                                | ServerErrorKind::ClusterDown
                                | ServerErrorKind::ReadOnly
                        )
                    )
                    || source.code() == Some("BUSY")
            }
        }
    }
}

/// A pool of connections to one Redis. Cheap to clone.
#[derive(Clone)]
pub struct Redis {
    pool: r2d2::Pool<Manager>,
    /// The pool manager's epoch (see [`Redis::run`]).
    epoch: Arc<AtomicU64>,
    url: String,
    /// Where the server is, without credentials (see [`Redis::address`]).
    address: String,
}

impl std::fmt::Debug for Redis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Redis").field("url", &self.url).finish_non_exhaustive()
    }
}

/// A connection taken from the pool (back to it on drop).
type Conn = r2d2::PooledConnection<Manager>;

/// Checks that `url` is a Redis URL, without connecting: what a
/// configuration loader can say about it.
pub fn check_url(url: &str) -> Result<(), String> {
    redis::Client::open(url).map(drop).map_err(|e| {
        format!("`{url}` is not a Redis URL ({e}); use redis://HOST:PORT/DB, rediss://… or unix:///path/to/socket")
    })
}

impl Redis {
    /// Checks `url` and that the server answers `PING`, then keeps up to
    /// 16 connections. Fails naming the URL when it is malformed or the
    /// server does not answer within 5 s.
    pub fn connect(url: &str) -> Result<Redis, RedisError> {
        let client = redis::Client::open(url)
            .map_err(|e| RedisError::Url { url: url.to_owned(), reason: e.to_string() })?;
        let address = match client.get_connection_info().addr() {
            redis::ConnectionAddr::Tcp(host, port) => format!("redis://{host}:{port}"),
            redis::ConnectionAddr::TcpTls { host, port, .. } => format!("rediss://{host}:{port}"),
            redis::ConnectionAddr::Unix(path) => format!("unix://{}", path.display()),
            _ => "redis".to_owned(),
        };
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
        let redis = Redis { pool, epoch, url: url.to_owned(), address };
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
    ///
    /// A command that times out (5 s: a server paused with `CLIENT
    /// PAUSE`, or stalled) fails without a repeat, and its connection is
    /// closed rather than kept: a paused server still holds the command
    /// and would run it once it resumes, long after the caller was told
    /// it failed; on a closed connection it never runs. So a timed-out
    /// call has, as far as anyone can tell afterwards, done nothing —
    /// unless the server ran it in the instant before the timeout.
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
                let result = f(&mut conn.conn);
                conn.broken |= result.as_ref().is_err_and(redis::RedisError::is_timeout);
                result.map_err(|e| self.error(e))
            }
            Err(e) => {
                conn.broken |= e.is_timeout();
                Err(self.error(e))
            }
            Ok(v) => Ok(v),
        }
    }

    /// The live entries of an index: `index` is a sorted set of names,
    /// each name's value is read by `read(name)` (all in one pipeline),
    /// and a name whose value is gone (its TTL passed) leaves the index.
    /// Returns (name, value) for the others, in the index's order. A name
    /// written again between the read and its removal is put back by its
    /// writer's next write, which adds it to the index.
    pub fn live_in_index(
        &self,
        index: &str,
        read: impl Fn(&str) -> redis::Cmd,
    ) -> Result<Vec<(String, String)>, RedisError> {
        let names: Vec<String> = self.run(|c| redis::cmd("ZRANGE").arg(index).arg(0).arg(-1).query(c))?;
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for name in &names {
            pipe.add_command(read(name));
        }
        let values: Vec<Option<String>> = self.run(|c| pipe.query(c))?;
        let (live, gone): (Vec<_>, Vec<_>) = names.into_iter().zip(values).partition(|(_, v)| v.is_some());
        if !gone.is_empty() {
            let gone: Vec<&String> = gone.iter().map(|(n, _)| n).collect();
            self.run(|c| redis::cmd("ZREM").arg(index).arg(&gone).query::<i64>(c))?;
        }
        Ok(live.into_iter().filter_map(|(n, v)| Some((n, v?))).collect())
    }

    /// The server's URL, as configured (credentials included: for
    /// connecting, not for showing).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Where the server is — `redis://HOST:PORT`, `rediss://HOST:PORT` or
    /// `unix:///PATH` — without user, password, database or options: what
    /// may be shown to a client of the API (an answer naming the store
    /// that is unreachable).
    pub fn address(&self) -> &str {
        &self.address
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
    /// A command on it timed out: it is closed instead of going back to
    /// the pool (see [`Redis::run`]).
    broken: bool,
}

impl r2d2::ManageConnection for Manager {
    type Connection = Tagged;
    type Error = redis::RedisError;

    fn connect(&self) -> Result<Tagged, redis::RedisError> {
        let epoch = self.epoch.load(Ordering::Relaxed);
        let conn = self.client.get_connection_with_timeout(IO_TIMEOUT)?;
        conn.set_read_timeout(Some(IO_TIMEOUT))?;
        conn.set_write_timeout(Some(IO_TIMEOUT))?;
        Ok(Tagged { conn, epoch, broken: false })
    }

    fn is_valid(&self, conn: &mut Tagged) -> Result<(), redis::RedisError> {
        redis::cmd("PING").query::<String>(&mut conn.conn).map(drop)
    }

    fn has_broken(&self, conn: &mut Tagged) -> bool {
        conn.broken
            || conn.epoch != self.epoch.load(Ordering::Relaxed)
            || !redis::ConnectionLike::is_open(&conn.conn)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A stopped server, and one that holds commands past the timeout,
    /// are unavailable; a command the server refuses is not.
    #[test]
    fn unavailable_is_told_from_refused() {
        let Some(mut server) = LocalRedis::for_test() else { return };
        let redis = Redis::connect(&server.url()).unwrap();
        assert_eq!(redis.address(), server.url());
        redis.run(|c| redis::cmd("SET").arg("k").arg("v").query::<()>(c)).unwrap();
        let wrong = redis.run(|c| redis::cmd("LPUSH").arg("k").arg("x").query::<i64>(c)).unwrap_err();
        assert!(!wrong.is_unavailable(), "WRONGTYPE is the command's fault: {wrong}");
        server.stop();
        let down = redis.run(|c| redis::cmd("GET").arg("k").query::<String>(c)).unwrap_err();
        assert!(down.is_unavailable(), "{down}");
        server.start_again().unwrap();
        let back: String = redis.run(|c| redis::cmd("GET").arg("k").query(c)).unwrap();
        assert_eq!(back, "v", "the AOF kept it, and the pool reconnects by itself");
    }

    /// A command that times out while the server is paused fails, and
    /// never runs afterwards: its connection is closed, so the server
    /// drops what it held for it instead of running it when it resumes.
    #[test]
    fn a_timed_out_command_never_runs_later() {
        let Some(server) = LocalRedis::for_test() else { return };
        let redis = Redis::connect(&server.url()).unwrap();
        server.pause(IO_TIMEOUT + Duration::from_secs(1)).unwrap();
        let e = redis.run(|c| redis::cmd("SET").arg("late").arg("1").query::<()>(c)).unwrap_err();
        assert!(e.is_unavailable(), "{e}");
        // Past the pause: the server answers again, and never ran the SET.
        let late: Option<String> = redis.run(|c| redis::cmd("GET").arg("late").query(c)).unwrap();
        assert_eq!(late, None);
    }
}
