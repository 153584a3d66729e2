//! `hangar bench chaos`: a loopback fleet of real processes under bounded
//! mixed load and a seeded random schedule of faults, with a checker that
//! runs throughout and at the end.
//!
//! The fleet ([`fleet`]): a private `redis-server` with AOF (or, with
//! [`Topology::Cluster`], a Redis Cluster whose slot fails over), two gateways
//! (`hangar serve`), three agents (`hangar agent`, two virtual 80 GB GPUs
//! each) and four mock models — one of 60 GB, most of a GPU, so two on a
//! GPU would be an over-commit; kept counts, one that scales and one that
//! scales from zero through the warm cache. The load ([`traffic`]): sync
//! chat requests and predictions with webhooks, through random gateways,
//! at a bounded rate. The faults ([`schedule`]): kill -9 of an agent (its
//! name restarted at once, still held, or after the TTL), of a gateway, of
//! the leader and of an engine; SIGSTOP/SIGCONT of an agent for up to
//! 15 s; Redis killed for up to 10 s and paused for up to 10 s; an agent
//! leaving and rejoining under its name — one at a time, each after a gap.
//!
//! The checker ([`judge`], fed by `probe` twice a second) holds the fleet
//! to: no GPU over-commit on any node at any sample; engines == placed
//! replicas on every node once the fleet has had [`judge::ALLOWANCE_MS`]
//! of calm time to converge; and, at the end ([`report`]): every accepted
//! request answered (sync: an HTTP answer; predictions: terminal), re-runs
//! and failures only after a fault docs/cluster.md says causes them,
//! exactly one terminal webhook each, every model whole within 15 s of the
//! last fault, and across each Redis fault 0 replicas restarted (engine
//! pids unchanged), 0 accepted predictions failed, 0 sync requests failed.
//!
//! The schedule is printed (on stderr) when the run starts, and again with
//! the findings when it fails, so a seed replays; a failed run keeps its
//! processes' logs.

mod fleet;
pub mod judge;
mod probe;
mod redis;
pub mod report;
pub mod schedule;
mod traffic;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustix::process::{kill_process, Pid, Signal};
use serde_json::Value;

pub use fleet::{config as fleet_config, RUN_ENV};
pub use judge::{Mismatch, Violation, ALLOWANCE_MS};
pub use redis::Topology;
pub use report::{Figure, Report};
pub use schedule::{Fault, Kind, Schedule, Step};

use fleet::Fleet;
use probe::Findings;
use report::{FinalState, Injected, Records, RedisCheck};
use schedule::REDIS_QUIET_MS;
use traffic::{CreateOutcome, LoadShape, Traffic};

use crate::BenchError;

/// Gateways in the fleet.
pub const GATEWAYS: usize = 2;
/// Agents in the fleet.
pub const AGENTS: usize = 3;

/// How to run it.
#[derive(Debug, Clone)]
pub struct Options {
    /// The seed of the schedule and of the load's draws.
    pub seed: u64,
    /// How long the schedule runs (faults and their gaps).
    pub duration: Duration,
    /// A schedule to run instead of the seed's.
    pub schedule: Option<Schedule>,
    /// Concurrent clients of the load.
    pub clients: usize,
    /// Requests per second of the load, all clients together.
    pub rate: f64,
    /// The Redis the fleet runs on.
    pub redis: Topology,
    /// The `hangar` binary.
    pub hangar_exe: PathBuf,
    /// Keep the processes' logs even when the run passes (a failed run
    /// always keeps them).
    pub keep_logs: bool,
}

/// Runs the fleet, its load and its faults, and checks them.
///
/// # Cancel safety
/// Dropping the future kills every process it started: the children are
/// killed on drop and the fleet's drop kills what carries the run's mark
/// (engines included).
pub async fn run(options: &Options) -> Result<Report, BenchError> {
    if options.clients == 0 || options.rate <= 0.0 {
        return Err(BenchError::Options("--clients and --rate must be positive".into()));
    }
    let schedule = options.schedule.clone().unwrap_or_else(|| {
        Schedule::random(options.seed, options.duration.as_millis() as u64, AGENTS, GATEWAYS)
    });
    eprint!("{schedule}");
    let dir = tempfile::Builder::new().prefix("hangar-chaos-").tempdir()?;
    let t0 = Instant::now();
    let mut fleet =
        Fleet::start(&options.hangar_exe, dir.path(), options.redis, GATEWAYS, AGENTS, t0).await?;
    let client = hangar_agent::direct_http().timeout(Duration::from_secs(5)).build().expect("a client");
    wait_whole(&client, &fleet, t0).await?;
    eprintln!("chaos: the fleet is whole at t={:.1} s; load and faults begin", t0.elapsed().as_secs_f64());

    let (hook_url, receiver, receiver_task) = traffic::receiver(t0).await?;
    let findings = Arc::new(Mutex::new(Findings::default()));
    let probing = Arc::new(AtomicBool::new(false));
    let prober = tokio::spawn(probe::run(
        fleet.roster(),
        fleet.run_id().to_owned(),
        t0,
        findings.clone(),
        probing.clone(),
    ));
    let traffic = Arc::new(Traffic::default());
    let loading = Arc::new(AtomicBool::new(false));
    let shape = LoadShape { clients: options.clients, rate: options.rate, seed: options.seed };
    let load =
        tokio::spawn(traffic::run(traffic.clone(), fleet.roster(), hook_url, shape, t0, loading.clone()));

    let mut injected = Vec::new();
    let mut redis_checks = Vec::new();
    let mut refused_starts = 0;
    let mut pending: Option<(usize, Kind, Snapshot)> = None;
    for (i, step) in schedule.steps.iter().enumerate() {
        let mut gap = Duration::from_millis(step.gap_ms);
        if let Some((s, kind, before)) = pending.take() {
            let quiet = Duration::from_millis(REDIS_QUIET_MS).min(gap);
            tokio::time::sleep(quiet).await;
            gap -= quiet;
            redis_checks.push(compare(s, kind, &before, &findings));
        }
        tokio::time::sleep(gap).await;
        if step.fault.kind().is_redis() {
            pending = Some((i, step.fault.kind(), engines_now(&findings)));
        }
        eprintln!("chaos: t={:.1} s #{i} {}", t0.elapsed().as_secs_f64(), step.fault);
        let (done, refused) = inject(&mut fleet, &client, i, &step.fault, t0).await?;
        refused_starts += refused;
        if !done.note.is_empty() || done.skipped.is_some() {
            eprintln!(
                "chaos:   {}{}",
                done.note,
                done.skipped.as_deref().map(|s| format!(" (skipped: {s})")).unwrap_or_default()
            );
        }
        injected.push(done);
    }
    if let Some((s, kind, before)) = pending.take() {
        tokio::time::sleep(Duration::from_millis(REDIS_QUIET_MS)).await;
        redis_checks.push(compare(s, kind, &before, &findings));
    }
    // The fleet gets a minute to be whole after the last fault, under load.
    let last_end = injected.last().map_or(0, |f: &Injected| f.end_ms);
    let until = Instant::now() + Duration::from_secs(60);
    while Instant::now() < until {
        let whole = findings.lock().expect("findings").whole.iter().any(|(t, w)| *t >= last_end && *w);
        if whole {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    loading.store(true, Ordering::Relaxed);
    let _ = load.await;
    eprintln!(
        "chaos: t={:.1} s load stopped; waiting for every prediction to end",
        t0.elapsed().as_secs_f64()
    );
    let finals = drain(&client, &fleet, &traffic, &receiver).await;
    probing.store(true, Ordering::Relaxed);
    let _ = prober.await;
    let run_ms = t0.elapsed().as_millis() as u64;
    let leftover = fleet.shut_down().await;
    receiver_task.abort();
    let findings = std::mem::take(&mut *findings.lock().expect("findings"));
    let records = Records {
        schedule,
        injected,
        syncs: std::mem::take(&mut *traffic.syncs.lock().expect("syncs")),
        creates: std::mem::take(&mut *traffic.creates.lock().expect("creates")),
        hooks: receiver.snapshot(),
        finals,
        violations: findings.violations,
        samples: findings.samples,
        split_leaders: findings.split_leaders,
        whole: findings.whole,
        converged: findings.converged,
        redis: redis_checks,
        leftover,
        refused_starts,
        run_ms,
        topology: options.redis,
    };
    let mut report = records.report(None);
    if options.keep_logs || !report.passed() {
        report.logs = Some(dir.keep().display().to_string());
    }
    Ok(report)
}

/// Waits (three minutes at most) until every model is whole.
async fn wait_whole(client: &reqwest::Client, fleet: &Fleet, t0: Instant) -> Result<(), BenchError> {
    let until = Instant::now() + Duration::from_secs(180);
    loop {
        let s = probe::sample(client, &fleet.roster(), fleet.run_id(), t0).await;
        if s.leader.as_ref().is_some_and(|m| judge::whole(m)) {
            return Ok(());
        }
        if Instant::now() > until {
            return Err(BenchError::Options(format!(
                "the fleet was never whole: {}",
                serde_json::to_string(&s).unwrap_or_default()
            )));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// One engine before a Redis fault.
#[derive(Debug, Clone)]
struct Before {
    model: String,
    node: String,
    pid: u32,
}

/// What a Redis fault is compared against: the engines, and the leader.
struct Snapshot {
    engines: BTreeMap<String, Before>,
    leader: Option<String>,
}

/// Every engine that runs (awake or asleep, with its process) in the last
/// sample, and the gateway that led then.
fn engines_now(findings: &Arc<Mutex<Findings>>) -> Snapshot {
    let f = findings.lock().expect("findings");
    let leader = f.last.as_ref().and_then(|s| s.leader_id.clone());
    let mut out = BTreeMap::new();
    for n in f.last.iter().flat_map(|s| &s.nodes) {
        for e in &n.engines {
            if let (Some(pid), "awake" | "asleep") = (e.pid, e.state.as_str()) {
                out.insert(e.replica.clone(), Before { model: e.model.clone(), node: n.name.clone(), pid });
            }
        }
    }
    Snapshot { engines: out, leader }
}

/// The engines of `snapshot` that a Redis fault restarted (same replica,
/// another process) or replaced (gone, and a replica of its model that
/// was not there before runs), and whether another gateway leads now.
fn compare(step: usize, kind: Kind, snapshot: &Snapshot, findings: &Arc<Mutex<Findings>>) -> RedisCheck {
    let before = &snapshot.engines;
    let f = findings.lock().expect("findings");
    let leader_after = f.last.as_ref().and_then(|s| s.leader_id.clone());
    let mut after: BTreeMap<&str, (&str, &str, Option<u32>)> = BTreeMap::new();
    for n in f.last.iter().flat_map(|s| &s.nodes) {
        for e in n.engines.iter().filter(|e| e.has_process) {
            after.insert(&e.replica, (&e.model, &n.name, e.pid));
        }
    }
    let mut restarted = Vec::new();
    for (replica, b) in before {
        match after.get(replica.as_str()) {
            Some((_, node, pid)) if *pid != Some(b.pid) => restarted.push(format!(
                "{}:{replica} on {}: engine pid {} → {pid:?} on {node}",
                b.model, b.node, b.pid
            )),
            Some(_) => {}
            None => {
                let new = after.iter().find(|(r, (m, _, _))| *m == b.model && !before.contains_key(**r));
                if let Some((r, (_, node, _))) = new {
                    restarted.push(format!(
                        "{}:{replica} on {} (pid {}): gone, replaced by {r} on {node}",
                        b.model, b.node, b.pid
                    ));
                }
            }
        }
    }
    RedisCheck {
        step,
        kind,
        engines_before: before.len(),
        restarted,
        leader_moved: (snapshot.leader != leader_after)
            .then(|| format!("{:?} → {leader_after:?}", snapshot.leader)),
    }
}

fn kill9(pid: u32) {
    signal(pid, Signal::KILL);
}

fn signal(pid: u32, signal: Signal) {
    if let Some(pid) = Pid::from_raw(pid as i32) {
        let _ = kill_process(pid, signal);
    }
}

/// How long process `pid` took to be gone (reaped by its parent), if it
/// went within `within`.
async fn gone_within(pid: u32, within: Duration) -> Option<Duration> {
    let (began, proc) = (Instant::now(), std::path::PathBuf::from(format!("/proc/{pid}")));
    while began.elapsed() < within {
        if !proc.exists() {
            return Some(began.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

/// The `pick`-th (modulo their number) engine process of agent `agent`, in
/// replica order, from its `/status` (only those that serve if `serving`):
/// replica, model and pid.
async fn engine_of(
    client: &reqwest::Client,
    fleet: &Fleet,
    agent: usize,
    pick: u32,
    serving: bool,
) -> Result<(String, String, u32), String> {
    let status: Option<Value> = match fleet.agent_url(agent) {
        Some(url) => match client.get(format!("{url}/status")).send().await {
            Ok(r) => r.json().await.ok(),
            Err(_) => None,
        },
        None => None,
    };
    let mut engines: Vec<(String, String, u32)> = status
        .iter()
        .flat_map(|s| s["replicas"].as_array().into_iter().flatten())
        .filter(|r| !serving || r["phase"] == "ready")
        .filter_map(|r| {
            let pid = r["pid"].as_u64()? as u32;
            let v = &r["view"];
            Some((v["replica"].as_str()?.to_owned(), v["model"].as_str()?.to_owned(), pid))
        })
        .collect();
    engines.sort();
    match engines.get(pick as usize % engines.len().max(1)) {
        Some(engine) => Ok(engine.clone()),
        None => Err(format!(
            "{} runs no engine{} (or did not answer)",
            schedule::agent_name(agent),
            if serving { " that serves" } else { "" }
        )),
    }
}

/// The gateway that leads now, asked of each (ten seconds at most).
async fn leader(client: &reqwest::Client, fleet: &Fleet) -> Option<usize> {
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until {
        let urls: Vec<String> =
            fleet.roster().read().expect("roster").gateways.iter().flatten().cloned().collect();
        for url in urls {
            let status: Option<Value> = match client.get(format!("{url}/admin/status")).send().await {
                Ok(r) => r.json().await.ok(),
                Err(_) => None,
            };
            if status.is_some_and(|s| s["fleet"]["leading"] == true) {
                return fleet.gateway_at(&url);
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    None
}

/// Drains node `node` (`on`) or calls its drain off through the gateway
/// that leads (waiting for one, 10 s at most): the gateway, or why not.
async fn drain_node(client: &reqwest::Client, fleet: &Fleet, node: &str, on: bool) -> Result<usize, String> {
    let g = leader(client, fleet).await.ok_or("no gateway led for 10 s")?;
    let url = fleet.roster().read().expect("roster").gateways[g].clone().ok_or("the leader is gone")?;
    crate::cluster::set_drain(client, &url, node, on)
        .await
        .map(|()| g)
        .map_err(|e| format!("gateway {g}: {e}"))
}

/// Carries out `fault` (step `step`) and returns it as injected, with the
/// agent starts refused meanwhile.
async fn inject(
    fleet: &mut Fleet,
    client: &reqwest::Client,
    step: usize,
    fault: &Fault,
    t0: Instant,
) -> Result<(Injected, u32), BenchError> {
    let ms = || t0.elapsed().as_millis() as u64;
    let start_ms = ms();
    let mut done = Injected {
        step,
        kind: fault.kind(),
        start_ms,
        end_ms: start_ms,
        gateway: None,
        note: String::new(),
        skipped: None,
        hung_left: false,
    };
    let mut refused = 0;
    let sleep = |ms: u64| tokio::time::sleep(Duration::from_millis(ms));
    match *fault {
        Fault::AgentKill { agent, restart_after_ms } => {
            fleet.kill_agent(agent).await;
            sleep(restart_after_ms).await;
            match fleet.restart_agent(agent).await {
                Ok(n) => {
                    refused = n;
                    done.note = format!("started again after {n} refused starts");
                }
                Err(e) => done.note = format!("NOT started again: {e}"),
            }
        }
        Fault::GatewayKill { gateway, restart_after_ms } => {
            done.gateway = Some(gateway);
            fleet.kill_gateway(gateway).await;
            sleep(restart_after_ms).await;
            fleet.start_gateway(gateway).await?;
        }
        Fault::LeaderKill { restart_after_ms } => match leader(client, fleet).await {
            None => done.skipped = Some("no gateway led for 10 s".into()),
            Some(g) => {
                done.gateway = Some(g);
                done.note = format!("gateway {g} led");
                fleet.kill_gateway(g).await;
                sleep(restart_after_ms).await;
                fleet.start_gateway(g).await?;
            }
        },
        Fault::EngineKill { agent, pick } | Fault::EngineHang { agent, pick } => {
            // A hang under load: an engine that serves (one asleep is found
            // hung the same way, `serve_lifecycle.rs`'s hung sleeping case).
            let serving = matches!(fault, Fault::EngineHang { .. });
            match engine_of(client, fleet, agent, pick, serving).await {
                Err(why) => done.skipped = Some(why),
                Ok((replica, model, pid)) => {
                    done.note = format!("engine pid {pid} of {model}:{replica}");
                    if matches!(fault, Fault::EngineKill { .. }) {
                        kill9(pid);
                    } else {
                        signal(pid, Signal::STOP);
                        match gone_within(pid, Duration::from_millis(judge::ALLOWANCE_MS)).await {
                            Some(took) => {
                                done.note +=
                                    &format!("; killed by its agent after {:.1} s", took.as_secs_f64())
                            }
                            None => {
                                done.hung_left = true;
                                done.note += "; NOT killed by its agent within 15 s (killed by the run)";
                                kill9(pid);
                            }
                        }
                    }
                }
            }
        }
        Fault::AgentStop { agent, ms } => {
            fleet.pause_agent(agent, true);
            sleep(ms).await;
            fleet.pause_agent(agent, false);
        }
        Fault::RedisDown { ms } => {
            fleet.redis_fault(true);
            let killed = fleet.crash_redis().await?;
            sleep(ms).await;
            let back = fleet.start_redis().await?;
            fleet.redis_fault(false);
            if !killed.is_empty() {
                done.note = format!("{killed}; {back}");
            }
        }
        Fault::RedisPause { ms } => {
            fleet.redis_fault(true);
            fleet.pause_redis(ms).await?;
            sleep(ms).await;
            fleet.redis_fault(false);
        }
        Fault::NodeDrain { agent, ms } => {
            let node = schedule::agent_name(agent);
            match drain_node(client, fleet, &node, true).await {
                Err(why) => done.skipped = Some(why),
                Ok(g) => {
                    done.gateway = Some(g);
                    sleep(ms).await;
                    done.note = match drain_node(client, fleet, &node, false).await {
                        Ok(g) => format!("drained through gateway {g}; called off"),
                        Err(why) => format!("drained; NOT called off: {why}"),
                    };
                }
            }
        }
        Fault::StrayEngine => {
            let pid = fleet.plant_stray_engine()?;
            done.note = format!("stray engine pid {pid}");
            sleep(fault.planned_ms()).await;
        }
        Fault::AgentRejoin { agent } => {
            fleet.terminate_agent(agent).await;
            match fleet.restart_agent(agent).await {
                Ok(n) => {
                    refused = n;
                    if n > 0 {
                        done.note = format!("started again after {n} refused starts");
                    }
                }
                Err(e) => done.note = format!("NOT started again: {e}"),
            }
        }
    }
    done.end_ms = ms();
    Ok((done, refused))
}

/// Waits (two minutes at most) until every accepted prediction has its
/// terminal webhook; then reads those that have none through a gateway.
async fn drain(
    client: &reqwest::Client,
    fleet: &Fleet,
    traffic: &Traffic,
    receiver: &traffic::Receiver,
) -> std::collections::HashMap<String, FinalState> {
    let ids: Vec<String> = traffic
        .creates
        .lock()
        .expect("creates")
        .iter()
        .filter_map(|c| match &c.outcome {
            CreateOutcome::Accepted { id } => Some(id.clone()),
            _ => None,
        })
        .collect();
    let until = Instant::now() + Duration::from_secs(120);
    let mut missing: Vec<String> = ids.clone();
    while !missing.is_empty() && Instant::now() < until {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let hooks = receiver.snapshot();
        missing.retain(|id| hooks.get(id).is_none_or(|h| h.terminals.is_empty()));
    }
    // A moment more, for a second terminal webhook to show if one comes.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut finals = std::collections::HashMap::new();
    let gateway = fleet.roster().read().expect("roster").gateways.iter().flatten().next().cloned();
    for id in missing {
        let state = match &gateway {
            Some(g) => match client.get(format!("{g}/v1/predictions/{id}")).send().await {
                Ok(r) => r.json::<Value>().await.ok(),
                Err(_) => None,
            },
            None => None,
        };
        finals.insert(
            id,
            FinalState {
                status: state.as_ref().and_then(|s| s["status"].as_str().map(str::to_owned)),
                error: state.as_ref().and_then(|s| s["error"].as_str().map(str::to_owned)),
            },
        );
    }
    finals
}
