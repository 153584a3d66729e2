//! A private `redis-server` for tests and benchmarks.
//!
//! It listens on a Unix socket in its own directory (no TCP port, so
//! parallel tests never collide), keeps its data there with AOF on, and
//! is killed when dropped, even when the test that started it panics.
//! With the `test-ca` feature, [`LocalRedis::start_tls`] starts one that
//! also serves TLS on a loopback port, with a certificate from its own
//! throwaway CA.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The environment variable naming the `redis-server` binary (else it is
/// looked up on `PATH`).
pub const SERVER_ENV: &str = "HANGAR_REDIS_SERVER";

/// Why a local server could not be started.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// No `redis-server` binary.
    #[error(
        "no redis-server found (install Debian's `redis-server` package, or set {SERVER_ENV} to the binary)"
    )]
    NotInstalled,
    /// It could not be spawned or its directory made.
    #[error("redis-server: {0}")]
    Io(#[from] std::io::Error),
    /// `CLIENT PAUSE` failed.
    #[error("redis-server: CLIENT PAUSE failed: {0}")]
    Pause(redis::RedisError),
    /// A `CLUSTER` command that forms a [`LocalRedisCluster`] failed.
    #[error("redis-server: forming the cluster failed: {0}")]
    Cluster(redis::RedisError),
    /// A cluster's answer did not say what a test asked of it.
    #[error("redis-server: the cluster {0}")]
    ClusterState(String),
    /// It did not answer in time; its log's last lines.
    #[error("redis-server did not answer on {socket} within 10 s; its log ends:\n{log}")]
    NoAnswer {
        /// The socket it was told to listen on.
        socket: String,
        /// The end of what it printed and of its log file.
        log: String,
    },
}

/// What a test does with a server it started: uses it, or — no
/// `redis-server` installed and this not CI (`CI` set), where a missing
/// server fails the test instead — skips (`None`, after printing why).
fn or_skip<T>(started: Result<T, ServerError>) -> Option<T> {
    match started {
        Ok(server) => Some(server),
        Err(ServerError::NotInstalled) if std::env::var_os("CI").is_none() => {
            eprintln!("skipped: {}", ServerError::NotInstalled);
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// A running `redis-server` of one's own, with its data in a temporary
/// directory. Dropping it kills the server and removes the directory.
#[derive(Debug)]
pub struct LocalRedis {
    dir: tempfile::TempDir,
    binary: PathBuf,
    child: Option<Child>,
    /// The loopback port of its TLS listener, if it has one.
    tls_port: Option<u16>,
    /// Its loopback port, when it is a node of a [`LocalRedisCluster`]
    /// (whose nodes find each other over TCP; the bus is this + 10000).
    cluster_port: Option<u16>,
}

impl LocalRedis {
    /// The `redis-server` binary: `$HANGAR_REDIS_SERVER`, else the first
    /// on `PATH`.
    pub fn binary() -> Option<PathBuf> {
        if let Some(path) = std::env::var_os(SERVER_ENV) {
            return Some(PathBuf::from(path));
        }
        let path = std::env::var_os("PATH")?;
        std::env::split_paths(&path).map(|d| d.join("redis-server")).find(|p| p.is_file())
    }

    /// Starts a server (AOF on, fsync every second) and waits until it
    /// answers.
    pub fn start() -> Result<LocalRedis, ServerError> {
        let binary = Self::binary().ok_or(ServerError::NotInstalled)?;
        let dir = tempfile::Builder::new().prefix("hangar-redis-").tempdir()?;
        let mut server = LocalRedis { dir, binary, child: None, tls_port: None, cluster_port: None };
        server.spawn()?;
        Ok(server)
    }

    /// A server for a test: started, or `None` (after printing why) when
    /// no `redis-server` is installed and this is not CI (`CI` set),
    /// where a missing server fails the test instead.
    pub fn for_test() -> Option<LocalRedis> {
        or_skip(LocalRedis::start())
    }

    /// [`LocalRedis::start`], also serving TLS on a free loopback port
    /// ([`LocalRedis::tls_url`]) with a certificate for `127.0.0.1` and
    /// `localhost` issued by a CA of its own ([`LocalRedis::ca_file`]);
    /// clients are not asked for certificates. The Unix socket stays
    /// (plain text, as Redis has no TLS there).
    ///
    /// The port is one the kernel had free a moment before the server
    /// binds it (`redis-server` takes no port 0 for TLS): when another
    /// process took it meanwhile, another port is tried, three at most.
    #[cfg(feature = "test-ca")]
    pub fn start_tls() -> Result<LocalRedis, ServerError> {
        let binary = Self::binary().ok_or(ServerError::NotInstalled)?;
        let dir = tempfile::Builder::new().prefix("hangar-redis-").tempdir()?;
        let ca = crate::tls::TestCa::new("hangar LocalRedis CA");
        let (cert, key) = ca.issue(&["127.0.0.1", "localhost"]);
        std::fs::write(dir.path().join("tls-ca.pem"), ca.pem())?;
        std::fs::write(dir.path().join("tls-server.pem"), cert)?;
        std::fs::write(dir.path().join("tls-server.key"), key)?;
        let mut server = LocalRedis { dir, binary, child: None, tls_port: None, cluster_port: None };
        let mut tries = 0;
        loop {
            server.tls_port = Some(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port());
            tries += 1;
            match server.spawn() {
                Err(ServerError::NoAnswer { log, .. }) if log.contains("in use") && tries < 3 => {}
                done => return done.map(|()| server),
            }
        }
    }

    /// [`LocalRedis::start_tls`] for a test, as [`LocalRedis::for_test`].
    #[cfg(feature = "test-ca")]
    pub fn for_test_tls() -> Option<LocalRedis> {
        or_skip(LocalRedis::start_tls())
    }

    /// The URL of its TLS listener (`rediss://127.0.0.1:PORT`), when it
    /// has one.
    pub fn tls_url(&self) -> Option<String> {
        self.tls_port.map(|port| format!("rediss://127.0.0.1:{port}"))
    }

    /// The PEM file of the CA that issued its TLS certificate, when it
    /// has one.
    pub fn ca_file(&self) -> Option<PathBuf> {
        self.tls_port.map(|_| self.dir.path().join("tls-ca.pem"))
    }

    /// The URL clients connect with (`unix:///…/redis.sock`).
    pub fn url(&self) -> String {
        format!("unix://{}", self.socket().display())
    }

    /// The server's process id (for its CPU time).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The directory holding the socket, the AOF and the log.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("redis.sock")
    }

    fn spawn(&mut self) -> Result<(), ServerError> {
        let socket = self.socket();
        let _ = std::fs::remove_file(&socket);
        let mut command = Command::new(&self.binary);
        // A cluster node over TLS listens on its TLS port only.
        let port = if self.tls_port.is_some() { 0 } else { self.cluster_port.unwrap_or(0) }.to_string();
        command
            .args(["--port", &port, "--unixsocket"])
            .arg(&socket)
            .args(["--unixsocketperm", "700", "--dir"])
            .arg(self.dir.path())
            .args(["--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--logfile"])
            .arg(self.dir.path().join("redis.log"));
        if self.cluster_port.is_some() {
            command
                .args(["--cluster-node-timeout", "2000"])
                .args(["--bind", "127.0.0.1", "--cluster-enabled", "yes", "--cluster-config-file"])
                .arg(self.dir.path().join("nodes.conf"));
            if self.tls_port.is_some() {
                // The bus between nodes over TLS too, and the TLS port
                // announced to clients.
                command.args(["--tls-cluster", "yes"]);
            }
        }
        if let Some(port) = self.tls_port {
            let file = |name: &str| self.dir.path().join(name);
            command
                .args(["--bind", "127.0.0.1", "--tls-port", &port.to_string(), "--tls-cert-file"])
                .arg(file("tls-server.pem"))
                .arg("--tls-key-file")
                .arg(file("tls-server.key"))
                .arg("--tls-ca-cert-file")
                .arg(file("tls-ca.pem"))
                .args(["--tls-auth-clients", "no"]);
        }
        // What it says before its log file is open (a refused option).
        let out = std::fs::File::create(self.dir.path().join("redis.out"))?;
        let child = command.stdin(Stdio::null()).stdout(out.try_clone()?).stderr(out).spawn()?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(mut stream) = std::os::unix::net::UnixStream::connect(&socket) {
                use std::io::{Read, Write};
                let mut pong = [0u8; 7];
                // `-LOADING` while the AOF is replayed; `+PONG` once ready.
                if stream.write_all(b"PING\r\n").is_ok()
                    && stream.read_exact(&mut pong).is_ok()
                    && &pong == b"+PONG\r\n"
                {
                    return Ok(());
                }
            }
            if let Some(Ok(Some(_))) = self.child.as_mut().map(Child::try_wait) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let read = |name: &str| std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default();
        let log = read("redis.out") + &read("redis.log");
        let tail: Vec<&str> = log.lines().rev().take(10).collect();
        self.kill();
        Err(ServerError::NoAnswer {
            socket: socket.display().to_string(),
            log: tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
        })
    }

    /// Stops the server as an operator would (SIGTERM: it flushes its AOF)
    /// and starts it again on the same socket and data.
    pub fn restart(&mut self) -> Result<(), ServerError> {
        self.stop();
        self.spawn()
    }

    /// Stops the server as an operator would (SIGTERM: it flushes its
    /// AOF) and leaves it stopped: clients find nothing on the socket
    /// until [`LocalRedis::start_again`]. Redis refuses a shutdown while
    /// it writes its first AOF — a replica does right after a sync — and
    /// ignores that SIGTERM, so it is sent again every half second until
    /// the server exits, and after 10 s the server is killed.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            }
            let asked = Instant::now();
            while asked.elapsed() < Duration::from_millis(500) {
                if !matches!(child.try_wait(), Ok(None)) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Starts a stopped server again on the same socket and data, and
    /// waits until it answers; does nothing if it runs.
    pub fn start_again(&mut self) -> Result<(), ServerError> {
        if self.child.is_some() {
            return Ok(());
        }
        self.spawn()
    }

    /// Makes the server hold every client's commands for `duration`
    /// (`CLIENT PAUSE <ms> ALL`), as a server stalled by a slow disk or a
    /// long fork would: connections stay open, nothing is answered, and
    /// what it holds runs when the pause ends. Returns at once.
    pub fn pause(&self, duration: Duration) -> Result<(), ServerError> {
        let client = redis::Client::open(self.url()).map_err(ServerError::Pause)?;
        let mut conn = client.get_connection().map_err(ServerError::Pause)?;
        redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(duration.as_millis() as u64)
            .arg("ALL")
            .query::<()>(&mut conn)
            .map_err(ServerError::Pause)
    }

    /// Kills the server with SIGKILL (what it wrote in the last second may
    /// be lost: AOF is fsynced every second) and starts it again on the
    /// same data.
    pub fn crash_and_restart(&mut self) -> Result<(), ServerError> {
        self.crash();
        self.start_again()
    }

    /// Kills the server with SIGKILL and leaves it down (clients meet a
    /// refused connection) until [`LocalRedis::start_again`]: an outage
    /// of any length, as the fault-injection suite makes them.
    pub fn crash(&mut self) {
        self.kill();
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for LocalRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A cluster's hash slots, its primaries, and how many slots each of them
/// but the last (which takes the rest) is given.
const SLOTS: u16 = 16384;
const PRIMARIES: usize = 3;
const SLOTS_EACH: u16 = SLOTS / PRIMARIES as u16;

/// A Redis Cluster of one's own for tests: three `redis-server` nodes in
/// cluster mode on loopback ports, each holding a third of the hash slots
/// (no replicas), each with its data in a temporary directory; dropping it
/// kills them all.
#[derive(Debug)]
pub struct LocalRedisCluster {
    nodes: Vec<LocalRedis>,
}

impl LocalRedisCluster {
    /// Starts three nodes, gives each its slots, introduces them and waits
    /// until every node says the cluster is `ok`.
    pub fn start() -> Result<LocalRedisCluster, ServerError> {
        Self::form(None, false)
    }

    /// [`LocalRedisCluster::start`] with a replica for each of the three
    /// primaries (nodes 3, 4 and 5 replicate 0, 1 and 2), which takes over
    /// its primary's slots about two seconds after the primary stops
    /// answering (`cluster-node-timeout` 2000).
    pub fn start_with_replicas() -> Result<LocalRedisCluster, ServerError> {
        Self::form(None, true)
    }

    /// [`LocalRedisCluster::start_with_replicas`] for a test, as
    /// [`LocalRedis::for_test`].
    pub fn for_test_with_replicas() -> Option<LocalRedisCluster> {
        or_skip(LocalRedisCluster::start_with_replicas())
    }

    /// [`LocalRedisCluster::start`] with every node served over TLS only
    /// (clients and the bus between nodes), with one certificate for
    /// `127.0.0.1` and `localhost` from a CA of its own: its
    /// [`LocalRedisCluster::url`] is `rediss+cluster://…?ca_file=…`.
    #[cfg(feature = "test-ca")]
    pub fn start_tls() -> Result<LocalRedisCluster, ServerError> {
        let ca = crate::tls::TestCa::new("hangar LocalRedisCluster CA");
        let (cert, key) = ca.issue(&["127.0.0.1", "localhost"]);
        Self::form(Some(&TlsFiles { ca: ca.pem(), cert, key }), false)
    }

    /// [`LocalRedisCluster::start_tls`] for a test, as [`LocalRedis::for_test`].
    #[cfg(feature = "test-ca")]
    pub fn for_test_tls() -> Option<LocalRedisCluster> {
        or_skip(LocalRedisCluster::start_tls())
    }

    fn form(tls: Option<&TlsFiles>, replicas: bool) -> Result<LocalRedisCluster, ServerError> {
        let binary = LocalRedis::binary().ok_or(ServerError::NotInstalled)?;
        let mut nodes = Vec::new();
        for _ in 0..if replicas { 2 * PRIMARIES } else { PRIMARIES } {
            nodes.push(Self::node(&binary, tls)?);
        }
        for (i, node) in nodes.iter().take(PRIMARIES).enumerate() {
            let (lo, hi) = (
                SLOTS_EACH * i as u16,
                if i + 1 == PRIMARIES { SLOTS - 1 } else { SLOTS_EACH * (i as u16 + 1) - 1 },
            );
            command(node, &["CLUSTER", "ADDSLOTSRANGE", &lo.to_string(), &hi.to_string()])?;
        }
        for other in &nodes[1..] {
            let port = other.cluster_port.expect("a cluster node has a port");
            command(&nodes[0], &["CLUSTER", "MEET", "127.0.0.1", &port.to_string()])?;
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        let known = format!("cluster_known_nodes:{}", nodes.len());
        let mut replicating = !replicas;
        loop {
            let mut states = Vec::new();
            for node in &nodes {
                states.push(command(node, &["CLUSTER", "INFO"])?);
            }
            let ok = |info: &String| info.contains("cluster_state:ok") && info.contains(&known);
            // A replica counts once its primary streams to it.
            let mut synced = true;
            if replicating && replicas {
                for primary in &nodes[..PRIMARIES] {
                    let info = command(primary, &["INFO", "replication"])?;
                    synced &= info.contains("connected_slaves:1") && info.contains("state=online");
                }
            }
            if states.iter().all(ok) && synced {
                if replicating {
                    return Ok(LocalRedisCluster { nodes });
                }
                // Every node knows every other: each replica follows its
                // primary, and the cluster is ok again once they have.
                for i in 0..PRIMARIES {
                    let primary = command(&nodes[i], &["CLUSTER", "MYID"])?;
                    command(&nodes[i + PRIMARIES], &["CLUSTER", "REPLICATE", &primary])?;
                }
                replicating = true;
            }
            if Instant::now() > deadline {
                return Err(ServerError::NoAnswer {
                    socket: nodes[0].url(),
                    log: format!("the cluster did not form within 30 s: {}", states.join(" | ")),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A node on a port the kernel had free a moment before (with its
    /// bus port, 10000 above it): another port when one was taken
    /// meanwhile, three at most.
    fn node(binary: &Path, tls: Option<&TlsFiles>) -> Result<LocalRedis, ServerError> {
        let mut tries = 0;
        loop {
            let port = loop {
                let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
                if port <= u16::MAX - 10_000
                    && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok()
                {
                    break port;
                }
            };
            let dir = tempfile::Builder::new().prefix("hangar-redis-cluster-").tempdir()?;
            if let Some(files) = tls {
                std::fs::write(dir.path().join("tls-ca.pem"), &files.ca)?;
                std::fs::write(dir.path().join("tls-server.pem"), &files.cert)?;
                std::fs::write(dir.path().join("tls-server.key"), &files.key)?;
            }
            let tls_port = tls.map(|_| port);
            let mut node = LocalRedis {
                dir,
                binary: binary.to_owned(),
                child: None,
                tls_port,
                cluster_port: Some(port),
            };
            tries += 1;
            match node.spawn() {
                Err(ServerError::NoAnswer { log, .. }) if log.contains("in use") && tries < 3 => {}
                done => return done.map(|()| node),
            }
        }
    }

    /// [`LocalRedisCluster::start`] for a test, as [`LocalRedis::for_test`].
    pub fn for_test() -> Option<LocalRedisCluster> {
        or_skip(LocalRedisCluster::start())
    }

    /// The URL clients connect with: `redis+cluster://` and every node, or
    /// over TLS `rediss+cluster://…?ca_file=` (the CA that issued the
    /// nodes' certificate).
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.cluster_port.expect("a node's port")))
            .collect();
        match self.nodes[0].ca_file() {
            Some(ca) => format!("rediss+cluster://{}?ca_file={}", nodes.join(","), ca.display()),
            None => format!("redis+cluster://{}", nodes.join(",")),
        }
    }

    /// Its nodes (to read one's keys, or stop one).
    pub fn nodes(&mut self) -> &mut [LocalRedis] {
        &mut self.nodes
    }

    /// The node that is the primary of `key`'s hash slot now, as the
    /// cluster's running nodes see it (`CLUSTER NODES`): after a failover,
    /// the promoted replica. An index into [`LocalRedisCluster::nodes`], so
    /// that the node can be killed and later started again. While no
    /// running primary holds the slot (its only primary is down, and no
    /// replica took over yet), the one that held it.
    pub fn primary_for(&self, key: &str) -> Result<usize, ServerError> {
        let mut last = None;
        for (_, node) in self.running() {
            let slot: u16 = match command(node, &["CLUSTER", "KEYSLOT", key]).map(|s| s.parse()) {
                Ok(Ok(slot)) => slot,
                Ok(Err(_)) => return Err(ServerError::ClusterState(format!("gave no slot for `{key}`"))),
                Err(e) => {
                    last = Some(e);
                    continue;
                }
            };
            let table = command(node, &["CLUSTER", "NODES"])?;
            let holders = primaries_holding(&table, slot);
            // A running primary first; a failed one only if none runs.
            let found = holders.iter().find(|(_, failed)| !failed).or(holders.first());
            let ours =
                found.and_then(|(port, _)| self.nodes.iter().position(|n| n.cluster_port == Some(*port)));
            if let Some(i) = ours {
                return Ok(i);
            }
            return Err(ServerError::ClusterState(format!(
                "names no node of its own as the primary of slot {slot} (`{key}`):\n{table}"
            )));
        }
        Err(last.unwrap_or(ServerError::ClusterState("has no node running".to_owned())))
    }

    /// The nodes that run (not killed or stopped), with their indexes.
    fn running(&self) -> impl Iterator<Item = (usize, &LocalRedis)> {
        self.nodes.iter().enumerate().filter(|(_, n)| n.child.is_some())
    }

    /// The running node that replicates node `primary` (`INFO
    /// replication`: its primary's port), as an index into
    /// [`LocalRedisCluster::nodes`].
    pub fn replica_of(&self, primary: usize) -> Result<usize, ServerError> {
        let port = self.nodes[primary].cluster_port.expect("a cluster node has a port");
        for (i, node) in self.running() {
            let info = command(node, &["INFO", "replication"])?;
            if info.contains("role:slave") && info.lines().any(|l| l.trim() == format!("master_port:{port}"))
            {
                return Ok(i);
            }
        }
        Err(ServerError::ClusterState(format!("has no running replica of node {primary}")))
    }

    /// Waits (`limit` at most) until node `i` — started again after it was
    /// killed — has its place back: a replica whose link to its primary is
    /// up (its slot failed over while it was down; it rejoins under the
    /// promoted replica, which it could replace at the next failover), or
    /// a primary again (it came back before any replica took over), with
    /// every running node saying the cluster is `ok`. Returns which.
    pub fn wait_rejoined(&self, i: usize, limit: Duration) -> Result<Rejoined, ServerError> {
        let deadline = Instant::now() + limit;
        loop {
            let info = command(&self.nodes[i], &["INFO", "replication"])?;
            let role = if info.contains("role:master") {
                Some(Rejoined::Primary)
            } else {
                info.contains("master_link_status:up").then_some(Rejoined::Replica)
            };
            let mut ok = true;
            for (_, node) in self.running() {
                ok &= command(node, &["CLUSTER", "INFO"])?.contains("cluster_state:ok");
            }
            match role {
                Some(role) if ok => return Ok(role),
                _ if Instant::now() > deadline => {
                    return Err(ServerError::NoAnswer {
                        socket: self.nodes[i].url(),
                        log: format!(
                            "it did not rejoin its cluster within {} s: {}",
                            limit.as_secs(),
                            info.replace("\r\n", " ")
                        ),
                    })
                }
                _ => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}

/// What a node of a [`LocalRedisCluster`] started again became.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejoined {
    /// The primary of its slots again: no replica had taken over.
    Primary,
    /// A replica of the one that took its slots over.
    Replica,
}

/// A command on one node (its Unix socket), its answer as text.
fn command(node: &LocalRedis, args: &[&str]) -> Result<String, ServerError> {
    let client = redis::Client::open(node.url()).map_err(ServerError::Cluster)?;
    let mut conn = client.get_connection().map_err(ServerError::Cluster)?;
    let mut cmd = redis::cmd(args[0]);
    cmd.arg(&args[1..]);
    cmd.query::<redis::Value>(&mut conn)
        .map(|v| match v {
            redis::Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
            redis::Value::VerbatimString { text, .. } => text,
            redis::Value::Int(n) => n.to_string(),
            other => format!("{other:?}"),
        })
        .map_err(ServerError::Cluster)
}

/// The client ports of the primaries that `CLUSTER NODES` says hold
/// `slot`, each with whether it is marked failed (`fail`, or `fail?`
/// while the others still vote on it). A line is `ID HOST:PORT@BUS FLAGS
/// PRIMARY PING PONG EPOCH LINK SLOT…`, a slot a number or `LO-HI`
/// (`[…]` entries are slots in migration, which a primary does not hold).
fn primaries_holding(table: &str, slot: u16) -> Vec<(u16, bool)> {
    let mut out = Vec::new();
    for line in table.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [_, address, flags, _, _, _, _, _, slots @ ..] = fields.as_slice() else { continue };
        if !flags.split(',').any(|f| f == "master") {
            continue;
        }
        let holds = slots.iter().filter(|s| !s.starts_with('[')).any(|s| {
            let (lo, hi) = s.split_once('-').unwrap_or((s, s));
            matches!((lo.parse::<u16>(), hi.parse::<u16>()), (Ok(lo), Ok(hi)) if (lo..=hi).contains(&slot))
        });
        let port =
            address.split('@').next().and_then(|a| a.rsplit_once(':')).and_then(|(_, p)| p.parse().ok());
        if let (true, Some(port)) = (holds, port) {
            out.push((port, flags.split(',').any(|f| f == "fail" || f == "fail?")));
        }
    }
    out
}

/// The PEM files of a TLS cluster's nodes: its CA, and the one certificate
/// and key every node presents.
struct TlsFiles {
    ca: String,
    cert: String,
    key: String,
}

#[cfg(test)]
mod tests {
    use super::primaries_holding;

    #[test]
    fn the_primaries_holding_a_slot_are_read_from_cluster_nodes() {
        // After a failover: 7001 failed, 7004 promoted to its slots; a
        // slot in migration (`[…]`) is not held; a replica holds nothing.
        let table = "\
a 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460
b 127.0.0.1:7001@17001 master,fail - 0 0 2 disconnected
c 127.0.0.1:7002@17002 master - 0 0 3 connected 10923-16383 [5461->-b]
d 127.0.0.1:7003@17003 slave a 0 0 1 connected
e 127.0.0.1:7004@17004 master - 0 0 7 connected 5461-10922
f 127.0.0.1:7005@17005 master,fail? - 0 0 8 connected 12000
";
        assert_eq!(primaries_holding(table, 0), vec![(7000, false)]);
        assert_eq!(primaries_holding(table, 5461), vec![(7004, false)]);
        assert_eq!(primaries_holding(table, 12000), vec![(7002, false), (7005, true)]);
        assert_eq!(primaries_holding(table, 16383), vec![(7002, false)]);
    }
}
