//! What a [`Redis`](crate::Redis) is connected to — one server, or a Redis
//! Cluster — and the pool's connections to it.
//!
//! A standalone server (or a Sentinel's primary, or a managed Redis without
//! cluster mode) is `redis://`, `rediss://` or `unix://`. A **Redis
//! Cluster** is `redis+cluster://HOST:PORT[,HOST:PORT…]` (`rediss+cluster://`
//! over TLS, `?ca_file=` as for `rediss://`): the nodes listed are where the
//! client first asks for the cluster's slot map, any one of them
//! answering is enough. On a cluster every key Hangar writes starts with
//! `{hangar}` rather than `hangar` ([`Client::prefix`]): the braces make
//! Redis hash only `hangar`, so all of them share one slot, and the Lua
//! scripts and transactions that change several at once — each a single
//! atomic step — run on the one node that holds them. (A cluster then
//! spreads nothing of Hangar's over its nodes; what it gives is the
//! managed services that exist only in cluster mode, and their failover.)

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use redis::cluster::{ClusterClient, ClusterClientBuilder, ClusterConfig, ClusterConnection};
use redis::{ConnectionLike, RedisResult, Value};

use crate::{tls, CA_FILE_PARAM, IO_TIMEOUT};

/// The key prefix on a standalone server.
const STANDALONE_PREFIX: &str = "hangar";
/// The key prefix on a cluster: one hash slot for every key.
const CLUSTER_PREFIX: &str = "{hangar}";

/// How often a cluster command is tried again after a redirection
/// (`MOVED`, `ASK`), `TRYAGAIN` or a connection lost to a failover,
/// before it fails: enough to follow a slot that moved, few enough that
/// a command on a cluster that does not answer fails within a few
/// [`IO_TIMEOUT`]s rather than minutes.
const CLUSTER_RETRIES: u32 = 3;

/// A standalone server or a cluster.
#[derive(Debug)]
pub(crate) enum Client {
    Single(redis::Client),
    Cluster(ClusterClient),
}

impl Client {
    /// The client of `url`, or why there is none (a phrase that follows
    /// the URL in a message).
    pub(crate) fn parse(url: &str) -> Result<Client, String> {
        match url.split_once("://") {
            Some(("redis+cluster", rest)) => cluster(rest, false),
            Some(("rediss+cluster", rest)) => cluster(rest, true),
            _ => single(url),
        }
    }

    /// What every key Hangar writes starts with: `hangar`, or on a
    /// cluster `{hangar}` (see the module docs).
    pub(crate) fn prefix(&self) -> &'static str {
        match self {
            Client::Single(_) => STANDALONE_PREFIX,
            Client::Cluster(_) => CLUSTER_PREFIX,
        }
    }

    /// Where the server is, without credentials or options
    /// ([`crate::Redis::address`]); `url` is what the client was made from.
    pub(crate) fn address(&self, url: &str) -> String {
        match self {
            Client::Single(client) => match client.get_connection_info().addr() {
                redis::ConnectionAddr::Tcp(host, port) => format!("redis://{host}:{port}"),
                redis::ConnectionAddr::TcpTls { host, port, .. } => format!("rediss://{host}:{port}"),
                redis::ConnectionAddr::Unix(path) => format!("unix://{}", path.display()),
                _ => "redis".to_owned(),
            },
            Client::Cluster(_) => {
                let (scheme, rest) = url.split_once("://").expect("a cluster URL has a scheme");
                let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
                let hosts = authority.rsplit_once('@').map_or(authority, |(_, hosts)| hosts);
                format!("{scheme}://{hosts}")
            }
        }
    }
}

/// Explains a URL the redis crate would not read.
fn not_a_url(e: impl std::fmt::Display) -> String {
    format!(
        "is not a Redis URL ({e}); use redis://HOST:PORT/DB (redis://:PASSWORD@HOST:PORT/DB with a \
         password), rediss://HOST:PORT/DB (TLS, optionally ?{CA_FILE_PARAM}=/path/ca.pem), \
         unix:///path/to/socket, or redis+cluster://HOST:PORT,HOST:PORT (rediss+cluster:// over TLS) \
         for a Redis Cluster"
    )
}

/// A URL's query: the CA file it names, and its other pairs.
struct Query {
    ca: Option<tls::CaFile>,
    others: Vec<(String, String)>,
}

/// The CA file a URL's query names, with the query's other pairs: one
/// `ca_file` at most, and only over TLS.
fn ca_file(query: Option<&str>, tls: bool) -> Result<Query, String> {
    let pairs = url::form_urlencoded::parse(query.unwrap_or_default().as_bytes());
    let (ca_files, others): (Vec<_>, Vec<_>) =
        pairs.map(|(k, v)| (k.into_owned(), v.into_owned())).partition(|(k, _)| k == CA_FILE_PARAM);
    let ca = match ca_files.as_slice() {
        [] => None,
        [_] if !tls => {
            return Err(format!(
                "gives `{CA_FILE_PARAM}`, which only a TLS URL (rediss://, rediss+cluster://) uses"
            ))
        }
        [(_, path)] => Some(
            tls::CaFile::load(Path::new(path))
                .map_err(|e| format!("names a {CA_FILE_PARAM} that cannot be used: {e}"))?,
        ),
        _ => return Err(format!("gives `{CA_FILE_PARAM}` more than once")),
    };
    Ok(Query { ca, others })
}

fn certificates(ca: &tls::CaFile) -> redis::TlsCertificates {
    redis::TlsCertificates { client_tls: None, root_cert: Some(ca.pem().to_vec()) }
}

/// A standalone server's client.
fn single(url: &str) -> Result<Client, String> {
    let Ok(mut parsed) = url::Url::parse(url) else {
        return redis::Client::open(url).map(Client::Single).map_err(not_a_url);
    };
    let tls = matches!(parsed.scheme(), "rediss" | "valkeys");
    if tls && parsed.fragment() == Some("insecure") {
        return Err(insecure());
    }
    let Query { ca: Some(ca), others } = ca_file(parsed.query(), tls)? else {
        return redis::Client::open(url).map(Client::Single).map_err(not_a_url);
    };
    // The redis crate reads the rest of the URL; the CA goes beside it.
    if others.is_empty() {
        parsed.set_query(None);
    } else {
        parsed.query_pairs_mut().clear().extend_pairs(others);
    }
    redis::Client::build_with_tls(parsed.as_str(), certificates(&ca)).map(Client::Single).map_err(not_a_url)
}

fn insecure() -> String {
    format!(
        "asks for `#insecure`, which would accept any certificate: Hangar always verifies it; give the CA \
         that signed it with ?{CA_FILE_PARAM}=/path/ca.pem"
    )
}

/// A cluster's client, from what follows `redis+cluster://` (or
/// `rediss+cluster://`, `tls`): `[USER:PASSWORD@]HOST:PORT[,HOST:PORT…][/0][?ca_file=…]`.
fn cluster(rest: &str, tls: bool) -> Result<Client, String> {
    let (rest, fragment) = rest.split_once('#').map_or((rest, None), |(r, f)| (r, Some(f)));
    if tls && fragment == Some("insecure") {
        return Err(insecure());
    }
    let (rest, query) = rest.split_once('?').map_or((rest, None), |(r, q)| (r, Some(q)));
    let (authority, path) = rest.split_once('/').map_or((rest, ""), |(a, p)| (a, p));
    if !matches!(path, "" | "0") {
        return Err(format!(
            "names the database `{path}`: a Redis Cluster has only database 0 (leave the path out)"
        ));
    }
    let (userinfo, hosts) = authority.rsplit_once('@').map_or((None, authority), |(u, h)| (Some(u), h));
    let Query { ca, others } = ca_file(query, tls)?;
    if let Some((key, _)) = others.first() {
        return Err(format!("gives `{key}`, which a cluster URL does not take (only `{CA_FILE_PARAM}`)"));
    }
    let scheme = if tls { "rediss" } else { "redis" };
    let credentials = userinfo.map_or(String::new(), |u| format!("{u}@"));
    let mut nodes = Vec::new();
    for host in hosts.split(',') {
        if host.is_empty() || !host.contains(':') {
            return Err(format!("lists the node `{host}`: give each node as HOST:PORT, separated by commas"));
        }
        nodes.push(format!("{scheme}://{credentials}{host}"));
    }
    let mut builder = ClusterClientBuilder::new(nodes).retries(CLUSTER_RETRIES);
    if let Some(ca) = &ca {
        builder = builder.certs(certificates(ca));
    }
    builder.build().map(Client::Cluster).map_err(not_a_url)
}

/// A connection to a standalone server or to a cluster (which holds one to
/// each node it needs, following the slot map): what [`crate::Redis::run`]
/// hands its callers. Commands, pipelines and scripts run on either alike.
pub enum Link {
    /// A standalone server.
    Single(redis::Connection),
    /// A Redis Cluster (boxed: it holds a connection per node and the
    /// slot map).
    Cluster(Box<ClusterConnection>),
}

impl ConnectionLike for Link {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<Value> {
        match self {
            Link::Single(c) => c.req_packed_command(cmd),
            Link::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands(&mut self, cmd: &[u8], offset: usize, count: usize) -> RedisResult<Vec<Value>> {
        match self {
            Link::Single(c) => c.req_packed_commands(cmd, offset, count),
            // A pipeline goes whole to the node of its first key — every
            // key of Hangar's is in one slot.
            Link::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Link::Single(c) => c.get_db(),
            Link::Cluster(c) => c.get_db(),
        }
    }

    fn check_connection(&mut self) -> bool {
        match self {
            Link::Single(c) => c.check_connection(),
            Link::Cluster(c) => c.check_connection(),
        }
    }

    fn is_open(&self) -> bool {
        match self {
            Link::Single(c) => c.is_open(),
            Link::Cluster(c) => c.is_open(),
        }
    }
}

/// Opens the pool's connections, each with [`IO_TIMEOUT`] on connecting,
/// reading and writing, so a server that stops answering fails a
/// command instead of hanging its caller; each tagged with the epoch it
/// was opened in.
#[derive(Debug)]
pub struct Manager {
    pub(crate) client: Client,
    /// Bumped when a dropped connection is seen: older ones are retired.
    pub(crate) epoch: Arc<AtomicU64>,
}

/// A pooled connection and the epoch it was opened in.
pub struct Tagged {
    pub(crate) conn: Link,
    pub(crate) epoch: u64,
    /// A command on it timed out: it is closed instead of going back to
    /// the pool (see [`crate::Redis::run`]).
    pub(crate) broken: bool,
}

impl r2d2::ManageConnection for Manager {
    type Connection = Tagged;
    type Error = redis::RedisError;

    fn connect(&self) -> Result<Tagged, redis::RedisError> {
        let epoch = self.epoch.load(Ordering::Relaxed);
        let conn = match &self.client {
            Client::Single(client) => {
                let conn = client.get_connection_with_timeout(IO_TIMEOUT)?;
                conn.set_read_timeout(Some(IO_TIMEOUT))?;
                conn.set_write_timeout(Some(IO_TIMEOUT))?;
                Link::Single(conn)
            }
            Client::Cluster(client) => {
                let config =
                    ClusterConfig::new().set_connection_timeout(IO_TIMEOUT).set_response_timeout(IO_TIMEOUT);
                let conn = client.get_connection_with_config(config)?;
                conn.set_read_timeout(Some(IO_TIMEOUT))?;
                conn.set_write_timeout(Some(IO_TIMEOUT))?;
                Link::Cluster(Box::new(conn))
            }
        };
        Ok(Tagged { conn, epoch, broken: false })
    }

    fn is_valid(&self, conn: &mut Tagged) -> Result<(), redis::RedisError> {
        redis::cmd("PING").query::<String>(&mut conn.conn).map(drop)
    }

    fn has_broken(&self, conn: &mut Tagged) -> bool {
        conn.broken || conn.epoch != self.epoch.load(Ordering::Relaxed) || !conn.conn.is_open()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cluster_url_lists_its_nodes_and_takes_no_database_or_other_option() {
        let c = Client::parse("redis+cluster://:s3cret@10.0.0.1:7000,10.0.0.2:7001").unwrap();
        assert_eq!(c.prefix(), "{hangar}");
        assert_eq!(
            c.address("redis+cluster://:s3cret@10.0.0.1:7000,10.0.0.2:7001/"),
            "redis+cluster://10.0.0.1:7000,10.0.0.2:7001"
        );
        assert_eq!(Client::parse("redis://h:6379/0").unwrap().prefix(), "hangar");
        for (url, says) in [
            ("redis+cluster://h:7000/3", "only database 0"),
            ("redis+cluster://h:7000?protocol=resp3", "gives `protocol`"),
            ("redis+cluster://h:7000,,h2:7001", "the node ``"),
            ("redis+cluster://h", "the node `h`"),
            ("redis+cluster://h:7000?ca_file=/x.pem", "only a TLS URL"),
            ("rediss+cluster://h:7000#insecure", "`#insecure`"),
            ("rediss+cluster://h:7000?ca_file=/nonexistent/ca.pem", "cannot be used"),
        ] {
            let e = Client::parse(url).unwrap_err();
            assert!(e.contains(says), "{url}: {e}");
        }
    }
}
