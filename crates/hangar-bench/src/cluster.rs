//! `hangar bench cluster`: a fleet's control plane under load and when a
//! node dies.
//!
//! 1. **Heartbeats**: `agents` simulated node agents against one Redis,
//!    each doing what a `hangar agent` does — its registry heartbeat every
//!    2 s and its replicas' report every 250 ms (two replicas each) —
//!    while one thread does what the leading gateway's view does every
//!    250 ms: read the live nodes, their reports, every gateway's load
//!    and the nodes an operator drained. The figure is that thread's CPU time over the run as a share
//!    of one core (target: under 5 % with 1,000 agents), with its refresh
//!    time and Redis's own CPU beside it.
//! 2. **Node loss**: a real fleet on loopback — a private Redis, one
//!    gateway and three agents (`hangar serve`, `hangar agent`, child
//!    processes) with a mock model of two replicas. The agent holding a
//!    replica is killed with SIGKILL; the bench reads the registry's
//!    record of its last heartbeat, sees its registration lapse, and
//!    waits until the gateway routes to two replicas again, none on it.
//!    Figures: detection after the last heartbeat (target ≤ 10 s), and
//!    replicas ready elsewhere after detection, less the engine's own
//!    start (target ≤ 1 s). Before the loss, an operator's drain of a node
//!    holding a replica: how long until the replica serves elsewhere and
//!    the node runs nothing, and the fewest replicas ready meanwhile (both,
//!    make-before-break).
//!
//! Placement of one replica over 1,000 nodes × 8 GPUs (target ≤ 1 ms) is
//! `hangar-placement`'s criterion benchmark (`cargo bench -p
//! hangar-placement --bench placement`).

use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hangar_core::{NodeRecord, NodeReport, ReplicaId, ReplicaPhase, ReplicaReport};
use hangar_redis::fleet::FleetState;
use hangar_redis::registry::{Registry, HEARTBEAT_EVERY, NODE_TTL};
use hangar_redis::{LocalRedis, Redis};
use hangar_runtime::serve::wall_ms;
use serde::Serialize;

use crate::processes::{process_cpu, spawn_announcing, Process};
use crate::BenchError;

/// How to run it.
#[derive(Debug, Clone)]
pub struct Options {
    /// Simulated agents in part 1.
    pub agents: usize,
    /// How long part 1 runs.
    pub seconds: u64,
    /// The `hangar` binary, for part 2's processes.
    pub hangar_exe: PathBuf,
}

/// Part 1's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Heartbeats {
    /// Simulated agents.
    pub agents: usize,
    /// Heartbeats per second they sent.
    pub heartbeats_per_s: f64,
    /// Reports per second they wrote.
    pub reports_per_s: f64,
    /// The leader's view thread: CPU time over wall time, in % of a core.
    pub leader_cpu_pct: f64,
    /// One refresh of that view: p50 and p99, ms.
    pub refresh_ms: [f64; 2],
    /// Redis's CPU over the run, in % of a core.
    pub redis_cpu_pct: Option<f64>,
}

/// Part 2's drain, before the loss: what moving a node's replica away on
/// purpose costs.
#[derive(Debug, Clone, Serialize)]
pub struct Drain {
    /// The drain command → its replica ready elsewhere and the node
    /// running nothing (as the gateway routes), ms.
    pub moved_ms: u64,
    /// The fewest ready replicas the gateway routed to meanwhile (sampled
    /// every 20 ms): the model's count, make-before-break.
    pub fewest_ready: usize,
}

/// Part 2's figures.
#[derive(Debug, Clone, Serialize)]
pub struct NodeLoss {
    /// Before the loss, a drain of the node that is then lost.
    pub drain: Drain,
    /// The dead node's last heartbeat → its registration lapsed, ms.
    pub detected_ms: u64,
    /// Lapsed → both replicas ready elsewhere (as the gateway routes), ms.
    pub replaced_ms: u64,
    /// The replacement engine's own start (placed → ready on its node), ms.
    pub engine_ms: u64,
}

/// Both parts.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Part 1.
    pub heartbeats: Heartbeats,
    /// Part 2.
    pub node_loss: NodeLoss,
}

/// Runs both parts, each on a private `redis-server`.
///
/// # Cancel safety
/// Dropping the future kills the processes it started (they die with
/// it); part 1's threads end with its run time.
pub async fn run(options: &Options) -> Result<Report, BenchError> {
    if options.agents == 0 || options.seconds == 0 {
        return Err(BenchError::Options("--agents and --seconds must be positive".into()));
    }
    let opts = options.clone();
    let heartbeats = tokio::task::spawn_blocking(move || heartbeats(&opts))
        .await
        .expect("the heartbeat part does not panic")?;
    let node_loss = node_loss(&options.hangar_exe).await?;
    Ok(Report { heartbeats, node_loss })
}

fn redis_error(e: impl fmt::Display) -> BenchError {
    BenchError::Options(format!("redis: {e}"))
}

fn private_redis() -> Result<(LocalRedis, Redis), BenchError> {
    let server = LocalRedis::start().map_err(redis_error)?;
    let redis = Redis::connect(&server.url()).map_err(redis_error)?;
    Ok((server, redis))
}

/// CPU time this thread has used.
fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

fn record(i: usize) -> NodeRecord {
    NodeRecord {
        name: format!("sim-{i:04}"),
        agent: format!("sim-run-{i}"),
        gpus: 8,
        gpu_memory: hangar_core::ByteSize::new(80_000_000_000),
        virtual_gpus: true,
        gpu_kind: Some("h100-80gb".into()),
        cpu_memory: hangar_core::ByteSize::new(1_000_000_000_000),
        url: format!("http://10.0.{}.{}:9400", i / 250, i % 250),
        draining: false,
    }
}

fn report(r: &NodeRecord, i: usize) -> NodeReport {
    let replica = |n: u128| ReplicaReport {
        replica: ReplicaId::from_u128((i as u128) << 8 | n),
        model: "bench/model".parse().expect("a valid key"),
        phase: ReplicaPhase::Ready,
        url: Some(format!("{}{n}", r.url)),
        ready_ms: Some(1_000),
        gpus: vec![n as u32],
        sleeps: true,
        lora: true,
        failure: None,
        start: None,
        instance: None,
    };
    NodeReport { agent: r.agent.clone(), replicas: vec![replica(0), replica(1)], ..NodeReport::default() }
}

/// Part 1.
fn heartbeats(options: &Options) -> Result<Heartbeats, BenchError> {
    let (server, redis) = private_redis()?;
    let registry = Registry::new(redis.clone(), NODE_TTL);
    let fleet = FleetState::new(redis);
    let records: Vec<NodeRecord> = (0..options.agents).map(record).collect();
    for r in &records {
        registry.register(r).map_err(redis_error)?;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let threads = 8.min(options.agents);
    let report_every = Duration::from_millis(250);
    let agents: Vec<_> = (0..threads)
        .map(|t| {
            let mine: Vec<(usize, NodeRecord)> =
                records.iter().cloned().enumerate().filter(|(i, _)| i % threads == t).collect();
            let (registry, fleet, stop) = (registry.clone(), fleet.clone(), stop.clone());
            std::thread::spawn(move || -> Result<(u64, u64), String> {
                let (mut beats, mut reports) = (0, 0);
                let mut next_beat = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    let round = Instant::now();
                    for (i, r) in &mine {
                        fleet.report(&r.name, &report(r, *i)).map_err(|e| e.to_string())?;
                        reports += 1;
                    }
                    if round >= next_beat {
                        for (_, r) in &mine {
                            registry.heartbeat(r).map_err(|e| e.to_string())?;
                            beats += 1;
                        }
                        next_beat = round + HEARTBEAT_EVERY;
                    }
                    std::thread::sleep(report_every.saturating_sub(round.elapsed()));
                }
                Ok((beats, reports))
            })
        })
        .collect();
    // Every agent has reported once before the view is measured.
    std::thread::sleep(report_every * 2);
    let redis_before = server.pid().and_then(|pid| process_cpu(pid, None));
    let (start, cpu_start) = (Instant::now(), thread_cpu());
    let mut refreshes = Vec::new();
    while start.elapsed() < Duration::from_secs(options.seconds) {
        let t = Instant::now();
        let live = registry.registered().map_err(redis_error)?.nodes;
        let names: Vec<String> = live.iter().map(|n| n.record.name.clone()).collect();
        let reports = fleet.reports(&names).map_err(redis_error)?;
        let _ = fleet.loads().map_err(redis_error)?;
        let _ = fleet.drained_nodes().map_err(redis_error)?;
        if reports.iter().flatten().count() < options.agents {
            return Err(BenchError::Options("simulated agents' reports went missing".into()));
        }
        refreshes.push(t.elapsed().as_secs_f64() * 1000.0);
        std::thread::sleep(Duration::from_millis(250).saturating_sub(t.elapsed()));
    }
    let (wall, cpu) = (start.elapsed(), thread_cpu() - cpu_start);
    let redis_after = server.pid().and_then(|pid| process_cpu(pid, None));
    stop.store(true, Ordering::Relaxed);
    let (mut beats, mut reports) = (0, 0);
    for a in agents {
        let (b, r) = a.join().expect("no panic").map_err(redis_error)?;
        beats += b;
        reports += r;
    }
    refreshes.sort_by(f64::total_cmp);
    let pick = |q: f64| refreshes[((refreshes.len() - 1) as f64 * q).round() as usize];
    let pct = |d: Duration| d.as_secs_f64() / wall.as_secs_f64() * 100.0;
    Ok(Heartbeats {
        agents: options.agents,
        heartbeats_per_s: beats as f64 / wall.as_secs_f64(),
        reports_per_s: reports as f64 / wall.as_secs_f64(),
        leader_cpu_pct: pct(cpu),
        refresh_ms: [pick(0.5), pick(0.99)],
        redis_cpu_pct: redis_before.zip(redis_after).map(|(b, a)| pct((a - b).total)),
    })
}

async fn spawn(exe: &std::path::Path, args: &[&str], log: std::fs::File) -> Result<Process, BenchError> {
    spawn_announcing(exe, args, &[], log).await
}

/// The gateway's ready replicas of the bench model, with their nodes.
async fn placed(client: &reqwest::Client, gateway: &str) -> Vec<String> {
    let Ok(answer) = client.get(format!("{gateway}/admin/status")).send().await else { return Vec::new() };
    let status: serde_json::Value = answer.json().await.unwrap_or_default();
    status["models"][0]["replicas"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["state"] == "ready")
        .map(|r| r["node"].as_str().unwrap_or("").to_owned())
        .collect()
}

/// Part 2.
async fn node_loss(exe: &std::path::Path) -> Result<NodeLoss, BenchError> {
    let (server, redis) = private_redis()?;
    let dir = tempfile::tempdir()?;
    let config = format!(
        "redis = \"{}\"\n\n[[models]]\nkey = \"bench/m\"\nengine = {{ kind = \"mock\", preset = \"fast\" }}\nsize = \"10GB\"\nmin_replicas = 2\n",
        server.url()
    );
    let path = dir.path().join("fleet.toml");
    std::fs::write(&path, config)?;
    let path = path.to_str().expect("a UTF-8 temporary path");
    let log = |name: &str| std::fs::File::create(dir.path().join(format!("{name}.log")));
    let gateway =
        spawn(exe, &["serve", "--config", path, "--listen", "127.0.0.1:0"], log("gateway")?).await?;
    let url = server.url();
    let mut agents = Vec::new();
    for i in 0..3 {
        let name = format!("bench-n{i}");
        let args = [
            "agent",
            "--config",
            path,
            "--redis",
            &url,
            "--name",
            &name,
            "--gpus",
            "2",
            "--gpu-memory",
            "80GB",
            "--virtual-gpus",
        ];
        agents.push((name.clone(), spawn(exe, &args, log(&name)?).await?));
    }
    let client = hangar_agent::direct_http().build().expect("a plain HTTP client");
    let until = Instant::now() + Duration::from_secs(60);
    let nodes = loop {
        let nodes = placed(&client, &gateway.url).await;
        if nodes.len() == 2 && nodes.iter().all(|n| !n.is_empty()) {
            break nodes;
        }
        if Instant::now() > until {
            return Err(BenchError::Options("the fleet never ran two replicas".into()));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let drain = drain(&client, &gateway.url, &nodes[0]).await?;
    // The node lost is one that holds a replica now.
    let victim = placed(&client, &gateway.url).await.into_iter().next().unwrap_or_default();
    let (registry, reader) = (Registry::new(redis.clone(), NODE_TTL), FleetState::new(redis.clone()));
    let index_redis = redis.clone();
    let index_name = victim.clone();
    let (_, agent) = agents.iter_mut().find(|(n, _)| *n == victim).expect("the victim is an agent");
    agent.child.start_kill()?;
    let _ = agent.child.wait().await;
    let last_beat: u64 = tokio::task::spawn_blocking(move || {
        index_redis.run(|c| {
            hangar_redis::redis::cmd("ZSCORE").arg(index_redis.key("nodes")).arg(&index_name).query(c)
        })
    })
    .await
    .expect("no panic")
    .map_err(redis_error)?;
    let detected_at = loop {
        let r = registry.clone();
        let live = tokio::task::spawn_blocking(move || r.registered())
            .await
            .expect("no panic")
            .map_err(redis_error)?
            .nodes;
        if live.iter().all(|n| n.record.name != victim) {
            break wall_ms();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let detected = Instant::now();
    let until = detected + Duration::from_secs(60);
    loop {
        let nodes = placed(&client, &gateway.url).await;
        if nodes.len() == 2 && nodes.iter().all(|n| !n.is_empty() && *n != victim) {
            break;
        }
        if Instant::now() > until {
            return Err(BenchError::Options("the dead node's replica never ran elsewhere".into()));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let replaced_ms = detected.elapsed().as_millis() as u64;
    let others: Vec<String> = agents.iter().map(|(n, _)| n.clone()).filter(|n| *n != victim).collect();
    let reports = tokio::task::spawn_blocking(move || reader.reports(&others))
        .await
        .expect("no panic")
        .map_err(redis_error)?;
    let engine_ms =
        reports.into_iter().flatten().flat_map(|r| r.replicas).filter_map(|r| r.ready_ms).max().unwrap_or(0);
    drop((gateway, agents));
    Ok(NodeLoss { drain, detected_ms: detected_at.saturating_sub(last_beat), replaced_ms, engine_ms })
}

/// Drains `node` through `gateway`'s admin API and times its replica's
/// move, sampling how many replicas the gateway routes to meanwhile; then
/// calls the drain off (nothing moves back).
async fn drain(client: &reqwest::Client, gateway: &str, node: &str) -> Result<Drain, BenchError> {
    let refused = |e: String| BenchError::Options(format!("the drain of {node}: {e}"));
    let started = Instant::now();
    set_drain(client, gateway, node, true).await.map_err(refused)?;
    let mut fewest_ready = usize::MAX;
    loop {
        let nodes = placed(client, gateway).await;
        fewest_ready = fewest_ready.min(nodes.len());
        if nodes.len() == 2 && nodes.iter().all(|n| !n.is_empty() && n != node) {
            break;
        }
        if started.elapsed() > Duration::from_secs(60) {
            return Err(refused("its replica did not move in a minute".into()));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let moved_ms = started.elapsed().as_millis() as u64;
    set_drain(client, gateway, node, false).await.map_err(|e| refused(format!("calling it off: {e}")))?;
    Ok(Drain { moved_ms, fewest_ready })
}

/// Drains `node` (`on`) or calls its drain off through `gateway`'s admin
/// API (`POST` / `DELETE /admin/nodes/{node}/drain`): anything but 202 is
/// an error saying what came back.
pub(crate) async fn set_drain(
    client: &reqwest::Client,
    gateway: &str,
    node: &str,
    on: bool,
) -> Result<(), String> {
    let url = format!("{gateway}/admin/nodes/{node}/drain");
    let request = if on { client.post(url) } else { client.delete(url) };
    match request.send().await {
        Ok(r) if r.status() == reqwest::StatusCode::ACCEPTED => Ok(()),
        Ok(r) => Err(format!("{gateway} answered {}", r.status())),
        Err(e) => Err(format!("{gateway}: {e}")),
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let h = &self.heartbeats;
        writeln!(f, "hangar bench cluster")?;
        writeln!(
            f,
            "heartbeats  {} simulated agents: {:.0} heartbeats/s, {:.0} reports/s; the leader's view every 250 ms: \
             {:.2} % of a core (target < 5 %: {}), refresh p50 {:.2} ms, p99 {:.2} ms; redis {}",
            h.agents,
            h.heartbeats_per_s,
            h.reports_per_s,
            h.leader_cpu_pct,
            if h.leader_cpu_pct < 5.0 { "meets" } else { "MISSES" },
            h.refresh_ms[0],
            h.refresh_ms[1],
            h.redis_cpu_pct.map_or("n/a".into(), |p| format!("{p:.1} % of a core")),
        )?;
        let n = &self.node_loss;
        writeln!(
            f,
            "drain       a node's replica ready elsewhere and the node empty {} ms after the drain command; never \
             fewer than {} of 2 replicas ready meanwhile (make-before-break: {})",
            n.drain.moved_ms,
            n.drain.fewest_ready,
            if n.drain.fewest_ready >= 2 { "meets" } else { "MISSES" },
        )?;
        let after_engine = n.replaced_ms.saturating_sub(n.engine_ms);
        writeln!(
            f,
            "node loss   detected {} ms after its last heartbeat (target <= 10000: {}); replicas ready elsewhere {} ms \
             after detection, {} ms of it the engine's start, {} ms the fleet's (target <= 1000: {})",
            n.detected_ms,
            if n.detected_ms <= 10_000 { "meets" } else { "MISSES" },
            n.replaced_ms,
            n.engine_ms,
            after_engine,
            if after_engine <= 1_000 { "meets" } else { "MISSES" },
        )
    }
}
