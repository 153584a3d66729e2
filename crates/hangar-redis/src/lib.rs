//! Redis, the distributed substrate of a Hangar fleet.
//!
//! Without a `redis` setting Hangar runs on one machine with SQLite; with
//! one, what must span machines lives in one Redis (7 or later, with AOF:
//! standalone, with Sentinel or a managed Redis for failover, or a Redis
//! Cluster, [`link`]): the predictions queue on Streams, the node
//! [`registry`] (agents' heartbeats), the leader [`lease`], and the
//! [`fleet`] state (what the leader wants on each node, what each node and
//! gateway reports). Every key Hangar writes starts with
//! [`Redis::prefix`]; `docs/cluster.md` lists them all.
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
//!
//! A Redis with a password (`requirepass`) is reached with it in the URL:
//! `redis://:PASSWORD@HOST:PORT/DB` (or `redis://USER:PASSWORD@…` for an
//! ACL user; `unix:///path?pass=PASSWORD` on a socket). Every message and
//! [`Redis::url`] show the URL [`redacted`], its password `***`.

pub mod fleet;
pub mod lease;
pub mod link;
pub mod liveness;
pub mod registry;
mod server;
pub mod tls;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use link::Link;
use link::{Client, Manager};
pub use redis;
pub use server::{LocalRedis, LocalRedisCluster, Rejoined, ServerError};

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
        /// The URL as given, [`redacted`].
        url: String,
        /// What is wrong with it, a phrase that follows the URL
        /// (`is not a Redis URL (…)`).
        reason: String,
    },
    /// No connection could be made (or taken from the pool in time).
    #[error("cannot reach redis at {url}: {reason}")]
    Unreachable {
        /// The server's URL, [`redacted`].
        url: String,
        /// The cause.
        reason: String,
    },
    /// A command failed.
    #[error("redis at {url}: {source}")]
    Command {
        /// The server's URL, [`redacted`].
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
    /// being promoted (`MASTERDOWN`, `READONLY`, `TRYAGAIN`), a primary
    /// that takes writes only while enough replicas follow it and has too
    /// few now (`NOREPLICAS`, `min-replicas-to-write`) — rather than
    /// refusing the command itself. The same call may succeed when
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
                    || matches!(source.code(), Some("BUSY" | "NOREPLICAS"))
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
    /// What every key starts with (see [`Redis::prefix`]).
    prefix: &'static str,
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
///
/// The message shows the URL [`redacted`].
pub fn check_url(url: &str) -> Result<(), String> {
    Client::parse(url).map(drop).map_err(|reason| format!("`{}` {reason}", redacted(url)))
}

/// `url` with its password replaced by `***` — the userinfo's after its
/// `:` (`redis://:***@host:6379/0`, `redis://user:***@…`) and a socket
/// URL's `pass=` — for messages and logs, which must not carry the
/// secret a fleet's URL holds. Anything else is left as it was.
pub fn redacted(url: &str) -> String {
    let Some(start) = url.find("://").map(|i| i + 3) else { return url.to_owned() };
    let mut out = url.to_owned();
    // `pass=…` in the query (unix sockets), up to the next `&` or `#`.
    if let Some(q) = out.find('?') {
        let mut at = q + 1;
        while at < out.len() {
            let end = out[at..].find(['&', '#']).map_or(out.len(), |e| at + e);
            if out[at..end].starts_with("pass=") {
                out.replace_range(at + 5..end, "***");
            }
            at = out[at..].find('&').map_or(out.len(), |e| at + e + 1);
        }
    }
    // The userinfo's password: in the authority, before its last `@`.
    let authority_end = out[start..].find(['/', '?', '#']).map_or(out.len(), |e| start + e);
    if let Some(at) = out[start..authority_end].rfind('@').map(|a| start + a) {
        if let Some(colon) = out[start..at].find(':').map(|c| start + c) {
            out.replace_range(colon + 1..at, "***");
        }
    }
    out
}

impl Redis {
    /// Checks `url` (and reads the CA file it names) and that the server
    /// answers `PING`, then keeps up to 16 connections. Fails naming the
    /// URL when it is malformed, its CA file unusable, the server's
    /// certificate not trusted (`rediss://`), or the server does not
    /// answer within 5 s.
    pub fn connect(url: &str) -> Result<Redis, RedisError> {
        let client = Client::parse(url).map_err(|reason| RedisError::Url { url: redacted(url), reason })?;
        tls::install_crypto_provider();
        let (address, prefix) = (client.address(url), client.prefix());
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
        let redis = Redis { pool, epoch, url: redacted(url), address, prefix };
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
    pub fn run<T>(&self, mut f: impl FnMut(&mut Link) -> redis::RedisResult<T>) -> Result<T, RedisError> {
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

    /// What every key Hangar writes starts with: `hangar` (`hangar:p:ID`,
    /// …), or `{hangar}` on a Redis Cluster, where the braces put them all
    /// in one hash slot ([`link`]).
    pub fn prefix(&self) -> &'static str {
        self.prefix
    }

    /// The key `PREFIX:rest`.
    pub fn key(&self, rest: &str) -> String {
        format!("{}:{rest}", self.prefix)
    }

    /// `script` made ready to run with the key prefix as its `ARGV[1]`
    /// (the scripts name every key from it) and as its one key, which is
    /// how a Redis Cluster sends a script to the node of the keys it
    /// changes. The caller adds the rest of `ARGV`.
    pub fn script<'a>(&self, script: &'a redis::Script) -> redis::ScriptInvocation<'a> {
        let mut invocation = script.prepare_invoke();
        invocation.key(self.prefix).arg(self.prefix);
        invocation
    }

    /// The server's URL, [`redacted`]: for messages, not for connecting.
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
        // A primary told to take writes only while a replica follows it,
        // with none: writes wait for one, reads go on.
        redis
            .run(|c| redis::cmd("CONFIG").arg("SET").arg("min-replicas-to-write").arg(1).query::<()>(c))
            .unwrap();
        let no_replica = redis.run(|c| redis::cmd("SET").arg("k").arg("w").query::<()>(c)).unwrap_err();
        assert!(no_replica.is_unavailable(), "{no_replica}");
        let still: String = redis.run(|c| redis::cmd("GET").arg("k").query(c)).unwrap();
        assert_eq!(still, "v");
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

    /// On a cluster, the node holding Hangar's slot stopped makes every
    /// call *unavailable* (retry later), not refused; back, it serves again
    /// on the same pool, its data kept.
    #[test]
    fn a_cluster_whose_node_is_down_is_unavailable_and_serves_once_it_is_back() {
        let Some(mut cluster) = LocalRedisCluster::for_test() else { return };
        let redis = Redis::connect(&cluster.url()).unwrap();
        let key = redis.key("k");
        redis.run(|c| redis::cmd("SET").arg(&key).arg("v").query::<()>(c)).unwrap();
        let primary = cluster.primary_for(&key).unwrap();
        cluster.nodes()[primary].stop();
        let down = redis.run(|c| redis::cmd("GET").arg(&key).query::<String>(c)).unwrap_err();
        assert!(down.is_unavailable(), "{down}");
        cluster.nodes()[primary].start_again().unwrap();
        assert_eq!(read_back(&redis, &key, Duration::from_secs(30)).0, "v");
    }

    /// The string at `key`, read again every 100 ms while every failure is
    /// *unavailable* (failing the test on any other, or past `limit`), and
    /// how many reads failed first.
    fn read_back(redis: &Redis, key: &str, limit: Duration) -> (String, u32) {
        let t = std::time::Instant::now();
        let mut failures = 0;
        loop {
            match redis.run(|c| redis::cmd("GET").arg(key).query::<String>(c)) {
                Ok(v) => return (v, failures),
                Err(e) => {
                    assert!(e.is_unavailable() && t.elapsed() < limit, "{e}");
                    failures += 1;
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The primary holding Hangar's slot killed: calls are unavailable
    /// while its replica takes over, then the same pool serves from the
    /// promoted replica, with what was written (and replicated) before.
    #[test]
    fn a_cluster_fails_over_and_the_pool_follows_the_promoted_replica() {
        let Some(mut cluster) = LocalRedisCluster::for_test_with_replicas() else { return };
        let redis = Redis::connect(&cluster.url()).unwrap();
        let key = redis.key("k");
        // A write, and its replica's acknowledgement (one pipeline: both go
        // to the node of the key's slot).
        let (acked,): (i64,) = redis
            .run(|c| redis::pipe().set(&key, "v").ignore().cmd("WAIT").arg(1).arg(5000).query(c))
            .unwrap();
        assert_eq!(acked, 1, "the replica has the write");
        let primary = cluster.primary_for(&key).unwrap();
        cluster.nodes()[primary].crash();
        let (back, failures) = read_back(&redis, &key, Duration::from_secs(60));
        assert_eq!(back, "v");
        assert!(failures > 0, "the kill was seen");
        // And it takes writes there.
        redis.run(|c| redis::cmd("SET").arg(&key).arg("w").query::<()>(c)).unwrap();
        // The promoted replica is the slot's primary now; the old primary,
        // started again, rejoins as its replica.
        let promoted = cluster.primary_for(&key).unwrap();
        assert_ne!(promoted, primary);
        cluster.nodes()[primary].start_again().unwrap();
        assert_eq!(cluster.wait_rejoined(primary, Duration::from_secs(30)).unwrap(), Rejoined::Replica);
        assert_eq!(cluster.primary_for(&key).unwrap(), promoted);
    }

    #[test]
    fn a_password_never_reaches_a_message() {
        for (url, shown) in [
            ("redis://:s3cret@hangar-redis:6379/0", "redis://:***@hangar-redis:6379/0"),
            ("redis://hangar:s3cret@10.0.0.5:6379", "redis://hangar:***@10.0.0.5:6379"),
            ("rediss://:s3:cr@t@h:6380/1", "rediss://:***@h:6380/1"),
            ("unix:///run/redis.sock?db=2&pass=s3cret", "unix:///run/redis.sock?db=2&pass=***"),
            ("redis+unix:///r.sock?pass=s3cret#x", "redis+unix:///r.sock?pass=***#x"),
            ("redis://user@h:6379/0", "redis://user@h:6379/0"),
            (
                "redis+cluster://:s3cret@10.0.0.5:7000,10.0.0.6:7000",
                "redis+cluster://:***@10.0.0.5:7000,10.0.0.6:7000",
            ),
            (
                "rediss+cluster://u:s3cret@h1:6380,h2:6380?ca_file=/ca.pem",
                "rediss+cluster://u:***@h1:6380,h2:6380?ca_file=/ca.pem",
            ),
            ("redis://h:6379/0", "redis://h:6379/0"),
            ("not a url", "not a url"),
        ] {
            assert_eq!(redacted(url), shown, "{url}");
        }
        // A password form is a Redis URL, and what is said of a bad one
        // hides the password.
        check_url("redis://:s3cret@hangar-redis:6379/0").unwrap();
        let info = redis::Client::open("redis://:s3cret@hangar-redis:6379/0").unwrap();
        assert_eq!(info.get_connection_info().redis_settings().password(), Some("s3cret"));
        let e = check_url("redis://:s3cret@hangar-redis:port/0").unwrap_err();
        assert!(!e.contains("s3cret") && e.contains(":***@"), "{e}");
        // A cluster's address shows its nodes and nothing of the password.
        let e = Redis::connect("redis+cluster://:s3cret@127.0.0.1:1,127.0.0.1:2").unwrap_err().to_string();
        assert!(!e.contains("s3cret") && e.contains(":***@127.0.0.1:1,127.0.0.1:2"), "{e}");
        // Nothing answers on port 1: the error names the server, not the
        // password.
        let e = Redis::connect("redis://:s3cret@127.0.0.1:1/0").unwrap_err().to_string();
        assert!(!e.contains("s3cret") && e.contains("redis://:***@127.0.0.1:1/0"), "{e}");
    }

    /// A Redis with `requirepass` is refused without the password and
    /// used with it in the URL.
    #[test]
    fn a_password_in_the_url_authenticates() {
        let Some(server) = LocalRedis::for_test() else { return };
        let open = Redis::connect(&server.url()).unwrap();
        open.run(|c| redis::cmd("CONFIG").arg("SET").arg("requirepass").arg("s3cret").query::<()>(c))
            .unwrap();
        drop(open);
        let e = Redis::connect(&server.url()).unwrap_err().to_string();
        assert!(e.contains("NOAUTH") || e.contains("Authentication"), "{e}");
        let wrong = Redis::connect(&format!("{}?pass=wrong", server.url())).unwrap_err().to_string();
        assert!(wrong.contains("pass=***") && !wrong.contains("pass=wrong"), "{wrong}");
        let redis = Redis::connect(&format!("{}?pass=s3cret", server.url())).unwrap();
        assert!(!redis.url().contains("s3cret"));
        let pong: String = redis.run(|c| redis::cmd("PING").query(c)).unwrap();
        assert_eq!(pong, "PONG");
    }
}
