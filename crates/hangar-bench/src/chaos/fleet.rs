//! The fleet under test: a private Redis (one server with AOF, or a
//! cluster, [`super::redis`]), gateways and agents as
//! child processes of the run, each restartable, and what the other parts
//! of the run read of them (the [`Roster`]).
//!
//! Every process the run starts carries `HANGAR_CHAOS_RUN=<run id>` in
//! its environment, and so do the engines the agents start, which inherit
//! it: the checker finds the run's engine processes by it (an engine its
//! agent no longer lists, or one that outlived its agent), and the run
//! kills whatever still carries it when it ends, even after a failure.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use super::redis::{RedisUnderTest, Topology};
use rustix::process::{kill_process, Pid, Signal};

use super::schedule::agent_name;
use crate::processes::{spawn_announcing, Process};
use crate::BenchError;

/// The environment variable marking the run's processes.
pub const RUN_ENV: &str = "HANGAR_CHAOS_RUN";

/// GPUs per agent.
pub const GPUS: u32 = 2;
/// Memory of each (virtual) GPU.
pub const GPU_MEMORY: &str = "80GB";

/// The LoRA adapters of `chaos/pair`, registered in every agent's store
/// (the same artifacts: the same synthetic bytes).
pub const ADAPTERS: [&str; 3] = ["chaos/pair:chaos/a0", "chaos/pair:chaos/a1", "chaos/pair:chaos/a2"];

/// How the fleet's models are set: sizes against 80 GB GPUs (`large`
/// takes most of one, so two engines on a GPU would show as an
/// over-commit), fixed counts and one that scales from zero, idempotent
/// and not.
pub fn config(redis_url: &str) -> String {
    format!(
        r#"redis = "{redis_url}"

# Most of a GPU: two on one GPU would be an over-commit.
[[models]]
key = "chaos/large"
engine = {{ kind = "mock", preset = "fast", startup_delay_ms = 300 }}
size = "60GB"
min_replicas = 1
predictions = {{ idempotent = true }}

# Two replicas, kept; LoRA adapters (`ADAPTERS`, registered in every
# agent's own store) loaded through each replica's agent.
[[models]]
key = "chaos/pair"
engine = {{ kind = "mock", preset = "fast", startup_delay_ms = 200 }}
size = "10GB"
min_replicas = 2
predictions = {{ idempotent = true }}
adapters = {{ slots = 2 }}

# One replica, more under load; not idempotent: a prediction whose gateway
# dies mid-run fails (docs/cluster.md) rather than running again.
[[models]]
key = "chaos/small"
engine = {{ kind = "mock", preset = "fast" }}
size = "20GB"
min_replicas = 1
max_replicas = 3
scaling = {{ policy = "hangar", scale_down_after_s = 20, min_quiet_s = 5 }}

# None until asked for; put to sleep (WARM) when idle, then let go.
[[models]]
key = "chaos/burst"
engine = {{ kind = "mock", preset = "fast", startup_delay_ms = 200, wake_delay_ms = 100 }}
size = "30GB"
min_replicas = 0
max_replicas = 2
scaling = {{ policy = "hangar", scale_down_after_s = 15, min_quiet_s = 5, warm_keep_s = 20 }}
predictions = {{ idempotent = true }}

[predictions]
async_slots = 4
# Above the longest Redis fault (10 s) plus a renewal (lease_s / 3), so an
# outage never sweeps a claim its gateway still renews.
lease_s = 20
webhook_retry_base_ms = 200
webhook_retry_cap_ms = 2000
webhook_allow = ["127.0.0.1/32"]
"#
    )
}

/// What the rest of the run reads of the fleet: who runs, where.
#[derive(Debug, Clone, Default)]
pub struct Roster {
    /// Each gateway's URL while it runs.
    pub gateways: Vec<Option<String>>,
    /// Each agent.
    pub agents: Vec<AgentEntry>,
    /// A Redis fault is under way (down, paused, or not answering yet).
    pub redis_fault: bool,
}

/// One agent as the roster holds it.
#[derive(Debug, Clone, Default)]
pub struct AgentEntry {
    /// Its node's name.
    pub name: String,
    /// Its URL and process id while it runs.
    pub running: Option<(String, u32)>,
    /// It is stopped (SIGSTOP).
    pub stopped: bool,
}

impl AgentEntry {
    /// Its URL if it runs and is not stopped (so it can answer).
    pub fn answering(&self) -> Option<&str> {
        self.running.as_ref().filter(|_| !self.stopped).map(|(u, _)| u.as_str())
    }
}

/// The shared roster.
pub type SharedRoster = Arc<RwLock<Roster>>;

/// The fleet's processes. Dropping it kills them all.
pub struct Fleet {
    exe: PathBuf,
    dir: PathBuf,
    config: PathBuf,
    run_id: String,
    redis: Arc<Mutex<RedisUnderTest>>,
    redis_url: String,
    gateways: Vec<Option<Process>>,
    agents: Vec<Option<Process>>,
    /// Engines the run planted itself ([`Fleet::plant_stray_engine`]).
    strays: Vec<tokio::process::Child>,
    roster: SharedRoster,
    t0: Instant,
}

impl Fleet {
    /// Starts Redis of `topology`, `gateways` gateways and `agents`
    /// agents, their logs and data in `dir`.
    pub async fn start(
        exe: &Path,
        dir: &Path,
        topology: Topology,
        gateways: usize,
        agents: usize,
        t0: Instant,
    ) -> Result<Fleet, BenchError> {
        let redis = tokio::task::spawn_blocking(move || RedisUnderTest::start(topology))
            .await
            .expect("no panic")
            .map_err(redis_error)?;
        let redis_url = redis.url();
        let config = dir.join("fleet.toml");
        std::fs::write(&config, self::config(&redis_url))?;
        let nanos = std::time::SystemTime::UNIX_EPOCH.elapsed().unwrap_or_default().as_nanos();
        let run_id = format!("{}-{nanos:x}", std::process::id());
        let roster = Arc::new(RwLock::new(Roster {
            gateways: vec![None; gateways],
            agents: (0..agents)
                .map(|i| AgentEntry { name: agent_name(i), ..AgentEntry::default() })
                .collect(),
            redis_fault: false,
        }));
        let mut fleet = Fleet {
            exe: exe.to_owned(),
            dir: dir.to_owned(),
            config,
            run_id,
            redis: Arc::new(Mutex::new(redis)),
            redis_url,
            gateways: (0..gateways).map(|_| None).collect(),
            agents: (0..agents).map(|_| None).collect(),
            strays: Vec::new(),
            roster,
            t0,
        };
        for g in 0..gateways {
            fleet.start_gateway(g).await?;
        }
        for a in 0..agents {
            fleet.start_agent(a).await?;
        }
        Ok(fleet)
    }

    /// The roster, shared.
    pub fn roster(&self) -> SharedRoster {
        self.roster.clone()
    }

    /// The run's id (the value of [`RUN_ENV`] in its processes).
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    fn log(&self, name: &str) -> Result<std::fs::File, BenchError> {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{name}.log")))?;
        writeln!(f, "=== chaos: started at t={:.1} s ===", self.t0.elapsed().as_secs_f64())?;
        Ok(f)
    }

    /// Starts gateway `g` (again): its own directory (data and
    /// configuration), a fresh loopback port.
    pub async fn start_gateway(&mut self, g: usize) -> Result<(), BenchError> {
        let dir = self.dir.join(format!("gateway-{g}"));
        std::fs::create_dir_all(&dir)?;
        let config = dir.join("gateway.toml");
        std::fs::copy(&self.config, &config)?;
        let config = config.to_str().expect("a UTF-8 temporary path").to_owned();
        let args = ["serve", "--config", &config, "--listen", "127.0.0.1:0"];
        let p = spawn_announcing(
            &self.exe,
            &args,
            &[(RUN_ENV, &self.run_id)],
            self.log(&format!("gateway-{g}"))?,
        )
        .await?;
        self.roster.write().expect("roster").gateways[g] = Some(p.url.clone());
        self.gateways[g] = Some(p);
        Ok(())
    }

    /// Kills gateway `g` with SIGKILL.
    pub async fn kill_gateway(&mut self, g: usize) {
        self.roster.write().expect("roster").gateways[g] = None;
        if let Some(mut p) = self.gateways[g].take() {
            let _ = p.child.start_kill();
            let _ = p.child.wait().await;
        }
    }

    /// The gateway whose URL is `url`, if one runs there.
    pub fn gateway_at(&self, url: &str) -> Option<usize> {
        self.gateways.iter().position(|p| p.as_ref().is_some_and(|p| p.url == url))
    }

    /// Agent `a`'s configuration: the fleet's, with a weight store of its
    /// own (a node's, its daemon run in the agent) in which [`ADAPTERS`]
    /// are registered; written once, kept across the agent's restarts.
    fn agent_config(&self, a: usize) -> Result<PathBuf, BenchError> {
        let own = self.dir.join(format!("{}-store", agent_name(a)));
        let config = self.dir.join(format!("{}.toml", agent_name(a)));
        if config.exists() {
            return Ok(config);
        }
        let store = hangar_store::BlobStore::open(&own)
            .map_err(|e| BenchError::Failed(format!("agent {a}'s store: {e}")))?;
        for (seed, adapter) in ADAPTERS.iter().enumerate() {
            let adapter: hangar_core::AdapterRef = adapter.parse().expect("a valid adapter");
            let shape = hangar_store::synth::AdapterShape::TINY;
            hangar_store::synth::register_adapter(&store, &adapter, shape, seed as u64)
                .map_err(|e| BenchError::Failed(format!("registering {adapter} for agent {a}: {e}")))?;
        }
        let fleet = std::fs::read_to_string(&self.config)?;
        std::fs::write(&config, format!("{fleet}\n[store]\nroot = \"{}\"\n", own.display()))?;
        Ok(config)
    }

    /// Starts agent `a` under its name once: an error if it did not
    /// register (its name still held, among others).
    async fn start_agent(&mut self, a: usize) -> Result<(), BenchError> {
        let name = agent_name(a);
        let config = self.agent_config(a)?;
        let args = [
            "agent",
            "--config",
            config.to_str().expect("a UTF-8 temporary path"),
            "--redis",
            &self.redis_url,
            "--name",
            &name,
            "--gpus",
            &GPUS.to_string(),
            "--gpu-memory",
            GPU_MEMORY,
            "--virtual-gpus",
            "--cpu-cache",
            "200GB",
            "--drain-s",
            "1",
            "--listen",
            "127.0.0.1:0",
        ];
        let p = spawn_announcing(&self.exe, &args, &[(RUN_ENV, &self.run_id)], self.log(&name)?).await?;
        let pid = p.child.id().unwrap_or(0);
        {
            let mut roster = self.roster.write().expect("roster");
            roster.agents[a].running = Some((p.url.clone(), pid));
            roster.agents[a].stopped = false;
        }
        self.agents[a] = Some(p);
        Ok(())
    }

    /// Starts agent `a` again under its name, as a supervisor would: a
    /// refused start (its name still held by the run that was killed) is
    /// tried again every half second, for a minute at most. Returns the
    /// refused starts.
    pub async fn restart_agent(&mut self, a: usize) -> Result<u32, BenchError> {
        let until = Instant::now() + Duration::from_secs(60);
        let mut refused = 0;
        loop {
            match self.start_agent(a).await {
                Ok(()) => return Ok(refused),
                Err(e) if Instant::now() > until => return Err(e),
                Err(_) => refused += 1,
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Kills agent `a` with SIGKILL (its engines die with it).
    pub async fn kill_agent(&mut self, a: usize) {
        self.roster.write().expect("roster").agents[a].running = None;
        if let Some(mut p) = self.agents[a].take() {
            let _ = p.child.start_kill();
            let _ = p.child.wait().await;
        }
    }

    /// Stops agent `a` on purpose (SIGTERM: it leaves the fleet, drains and
    /// stops its engines) and waits for it to exit (SIGKILL after 30 s).
    pub async fn terminate_agent(&mut self, a: usize) {
        self.roster.write().expect("roster").agents[a].running = None;
        if let Some(mut p) = self.agents[a].take() {
            signal(p.child.id(), Signal::TERM);
            if tokio::time::timeout(Duration::from_secs(30), p.child.wait()).await.is_err() {
                let _ = p.child.start_kill();
                let _ = p.child.wait().await;
            }
        }
    }

    /// SIGSTOP (`stop`) or SIGCONT agent `a`.
    pub fn pause_agent(&mut self, a: usize, stop: bool) {
        if let Some(p) = &self.agents[a] {
            signal(p.child.id(), if stop { Signal::STOP } else { Signal::CONT });
        }
        self.roster.write().expect("roster").agents[a].stopped = stop;
    }

    /// Agent `a`'s URL, if it runs and is not stopped.
    pub fn agent_url(&self, a: usize) -> Option<String> {
        self.roster.read().expect("roster").agents[a].answering().map(str::to_owned)
    }

    /// Marks a Redis fault under way, or over.
    pub fn redis_fault(&self, on: bool) {
        self.roster.write().expect("roster").redis_fault = on;
    }

    /// Kills Redis (on a cluster: the primary of Hangar's slot) with
    /// SIGKILL; it stays down. Returns what was killed, in words.
    pub async fn crash_redis(&self) -> Result<String, BenchError> {
        self.with_redis(RedisUnderTest::crash).await
    }

    /// Starts Redis again on its AOF and waits until it answers (on a
    /// cluster: until the node has its place back). Returns what it
    /// became, in words.
    pub async fn start_redis(&self) -> Result<String, BenchError> {
        self.with_redis(RedisUnderTest::start_again).await
    }

    /// Pauses every client of Redis (on a cluster: of the primary of
    /// Hangar's slot) for `ms` (`CLIENT PAUSE ms ALL`), on a connection
    /// of its own.
    pub async fn pause_redis(&self, ms: u64) -> Result<(), BenchError> {
        self.with_redis(move |r| r.pause(Duration::from_millis(ms))).await
    }

    /// Runs `f` on the Redis under test on a blocking thread (its calls
    /// wait for servers).
    async fn with_redis<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut RedisUnderTest) -> Result<T, hangar_redis::ServerError> + Send + 'static,
    ) -> Result<T, BenchError> {
        let redis = self.redis.clone();
        tokio::task::spawn_blocking(move || f(&mut redis.lock().expect("redis lock")))
            .await
            .expect("no panic")
            .map_err(redis_error)
    }

    /// Starts an engine process of the run that no agent owns (a test of
    /// the checker, which must find it); returns its process id.
    pub fn plant_stray_engine(&mut self) -> Result<u32, BenchError> {
        let child = tokio::process::Command::new(&self.exe)
            .args([
                "engine",
                "mock",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--preset",
                "fast",
                "--model",
                "chaos/stray",
            ])
            .env(RUN_ENV, &self.run_id)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        let pid = child.id().unwrap_or(0);
        self.strays.push(child);
        Ok(pid)
    }

    /// Stops everything: gateways and agents (SIGKILL), Redis, and every
    /// process of the run still alive (engines included). Returns the
    /// engine processes that were still alive after their agents died.
    pub async fn shut_down(&mut self) -> Vec<u32> {
        for mut s in self.strays.drain(..) {
            let _ = s.start_kill();
            let _ = s.wait().await;
        }
        for a in 0..self.agents.len() {
            if self.roster.read().expect("roster").agents[a].stopped {
                self.pause_agent(a, false);
            }
            self.kill_agent(a).await;
        }
        for g in 0..self.gateways.len() {
            self.kill_gateway(g).await;
        }
        // Engines die with their agent (a parent-death signal); give the
        // kernel a moment, then take what is left.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let left: Vec<u32> = run_processes(&self.run_id).into_iter().map(|p| p.pid).collect();
        for pid in &left {
            signal(Some(*pid), Signal::KILL);
        }
        self.redis.lock().expect("redis lock").shut_down();
        left
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        // The children are killed on drop (`kill_on_drop`); a stopped one
        // is let go on first, and engines that outlived them are taken.
        for p in self.agents.iter().flatten() {
            signal(p.child.id(), Signal::CONT);
        }
        for p in run_processes(&self.run_id) {
            signal(Some(p.pid), Signal::KILL);
        }
    }
}

fn signal(pid: Option<u32>, sig: Signal) {
    if let Some(pid) = pid.and_then(|p| Pid::from_raw(p as i32)) {
        let _ = kill_process(pid, sig);
    }
}

fn redis_error(e: impl std::fmt::Display) -> BenchError {
    BenchError::Options(format!("redis: {e}"))
}

/// One process of the run, from `/proc`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunProcess {
    /// Its id.
    pub pid: u32,
    /// Its parent's.
    pub ppid: u32,
    /// It is an engine (`hangar engine …`).
    pub engine: bool,
}

/// Every live (not zombie) process whose environment carries `RUN_ENV=run_id`.
pub fn run_processes(run_id: &str) -> Vec<RunProcess> {
    let marker = format!("{RUN_ENV}={run_id}");
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(env) = std::fs::read(e.path().join("environ")) else { continue };
        if !env.split(|b| *b == 0).any(|v| v == marker.as_bytes()) {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { continue };
        // `pid (comm) state ppid …`; comm may hold spaces and parentheses.
        let Some(after) = stat.rfind(')').map(|i| &stat[i + 2..]) else { continue };
        let mut fields = after.split(' ');
        let state = fields.next().unwrap_or("");
        let ppid = fields.next().and_then(|p| p.parse().ok()).unwrap_or(0);
        if state == "Z" || state == "X" {
            continue;
        }
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let engine = cmdline.split(|b| *b == 0).nth(1) == Some(b"engine".as_slice());
        out.push(RunProcess { pid, ppid, engine });
    }
    out
}
