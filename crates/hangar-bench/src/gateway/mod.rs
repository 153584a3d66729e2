//! `hangar bench gateway`: what the gateway adds in front of an engine.
//!
//! The set-up is the one a user runs, minus compute: a mock engine with
//! zero compute time (`hangar engine mock --preset instant`, a child
//! process) and a gateway in front of it (`hangar serve`, another child
//! process, configured with one model whose engine is `external`, pointing
//! at that mock). The gateway runs as its own process so that it has its own
//! tokio runtime, exactly as deployed, and does not share worker threads
//! with the load generator; the mock is a process for the same reason.
//!
//! The same requests are then sent twice — straight to the engine and
//! through the gateway — in two phases, each in five rounds in which the
//! paths take turns (so a change in the machine's background load hits
//! both paths alike):
//!
//! 1. **Closed loop** (maximum throughput): `concurrency` keep-alive
//!    clients each send their next request as soon as the previous answer
//!    is read, `requests` in all. The figure to watch is the gateway's
//!    requests per second as a share of the engine's.
//! 2. **Open loop** (latency at a given load): `requests` requests released
//!    at `rate` per second on a fixed schedule, each on a free client. The
//!    figure to watch is the added latency: each gateway percentile minus
//!    the same direct percentile.
//!
//! Before the closed loop every path gets a warm-up (connections opened,
//! the gateway's pool to the engine filled) that is not measured. Every
//! request asks for one output token, so the engine answers after one
//! (zero-time) pass and what is measured is HTTP, JSON and the path.
//!
//! The gateway's model has more permits than there are clients, so
//! admission never queues: the bench measures the path, not a queue.

mod report;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper::body::Bytes;

use crate::load::{self, Client, PathStats, Samples, Target};
use crate::processes::{address, launch_instant_engine, process_cpu, start_serve, ProcessCpu, Server, MODEL};
use crate::BenchError;

pub use report::{Added, Cpu, Gateway, Phase, Report};

/// What the benchmark requests look like.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BodyKind {
    /// `POST /v1/chat/completions` with one user message.
    Chat,
    /// `POST /v1/completions` with a short prompt.
    Completion,
}

impl BodyKind {
    fn target(self, addr: SocketAddr) -> Target {
        let (path, body) = match self {
            Self::Chat => (
                "/v1/chat/completions",
                serde_json::json!({
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "Say hello to the gateway benchmark."}],
                    "max_tokens": 1,
                }),
            ),
            Self::Completion => (
                "/v1/completions",
                serde_json::json!({"model": MODEL, "prompt": "Say hello to the gateway benchmark.", "max_tokens": 1}),
            ),
        };
        Target { addr, path, body: Bytes::from(body.to_string()), headers: &[] }
    }
}

/// How to run the benchmark.
#[derive(Debug, Clone)]
pub struct Options {
    /// Requests per path in each phase.
    pub requests: usize,
    /// Keep-alive clients (connections) per path.
    pub concurrency: usize,
    /// Requests per second in the open-loop phase.
    pub rate: f64,
    /// What the requests look like.
    pub body: BodyKind,
    /// The `hangar` binary, to start the mock engine and the gateway.
    pub hangar_exe: PathBuf,
    /// Also run a second gateway with `[events] enabled = false`, taking
    /// turns with the first: what inference events cost, in one run.
    pub compare_events: bool,
    /// Also run the gateway of this other `hangar` binary (an earlier
    /// build), taking turns: a change's cost side by side, in one run.
    pub baseline: Option<PathBuf>,
}

impl Options {
    fn validate(&self) -> Result<(), BenchError> {
        if self.requests == 0 {
            return Err(BenchError::Options("--requests must be at least 1".into()));
        }
        if self.concurrency == 0 || self.concurrency > 10_000 {
            return Err(BenchError::Options("--concurrency must be between 1 and 10000".into()));
        }
        if !(self.rate.is_finite() && self.rate > 0.0) {
            return Err(BenchError::Options(format!("--rate must be a positive number, not {}", self.rate)));
        }
        if let Some(exe) = self.baseline.as_ref().filter(|exe| !exe.is_file()) {
            return Err(BenchError::Options(format!("--baseline {}: no such file", exe.display())));
        }
        Ok(())
    }

    /// Unmeasured requests sent before the closed loop on each path.
    fn warmup(&self) -> usize {
        (self.requests / 10).max(2 * self.concurrency)
    }
}

/// Starts the mock engine and the gateway (and the gateways it is to be
/// compared with), runs both phases on every path and stops the processes
/// again (also on failure: they are killed when dropped).
///
/// # Cancel safety
/// Dropping the future kills the child processes.
pub async fn run(options: &Options) -> Result<Report, BenchError> {
    options.validate()?;
    let engine = launch_instant_engine(&options.hangar_exe).await?;
    let mut gateways =
        vec![(Role::Gateway, start_gateway(options, &options.hangar_exe, &engine.base_url, "").await?)];
    if options.compare_events {
        let extra = "[events]\nenabled = false\n";
        gateways.push((
            Role::WithoutEvents,
            start_gateway(options, &options.hangar_exe, &engine.base_url, extra).await?,
        ));
    }
    if let Some(exe) = &options.baseline {
        gateways.push((Role::Baseline, start_gateway(options, exe, &engine.base_url, "").await?));
    }
    let report = measure(options, &engine.base_url, &gateways).await;
    for (_, server) in gateways {
        server.process.stop(Duration::from_secs(5)).await;
    }
    engine.stop(Duration::from_secs(5)).await;
    report
}

/// `hangar serve` of the binary `exe` with one model whose engine is the
/// mock at `engine_url`, plus the TOML `extra`.
async fn start_gateway(
    options: &Options,
    exe: &Path,
    engine_url: &str,
    extra: &str,
) -> Result<Server, BenchError> {
    // Permits beyond the client count: admission never makes a request wait.
    let permits = (options.concurrency * 2).max(1024);
    start_serve(exe, engine_url, permits, extra, "gateway").await
}

/// What a path is for, in the report's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Role {
    /// Straight to the engine.
    Direct,
    /// Through the gateway of this build.
    Gateway,
    /// Through this build's gateway with `[events] enabled = false`.
    WithoutEvents,
    /// Through the gateway of `--baseline`.
    Baseline,
}

/// One way the requests go: its clients, and the gateway process whose
/// CPU the closed loop reads (none for the engine itself).
struct Route {
    role: Role,
    target: Target,
    clients: Vec<Client>,
    gateway_pid: Option<u32>,
    closed: Samples,
    open: Samples,
    /// The gateway's CPU over its closed-loop rounds.
    cpu: ProcessCpu,
}

impl Route {
    async fn connect(
        options: &Options,
        role: Role,
        url: &str,
        gateway_pid: Option<u32>,
    ) -> Result<Self, BenchError> {
        let target = options.body.target(address(url)?);
        let mut clients = Vec::with_capacity(options.concurrency);
        for _ in 0..options.concurrency {
            clients.push(Client::connect(&target).await?);
        }
        load::closed_loop(&target, &mut clients, options.warmup()).await;
        let (closed, open, cpu) = (Samples::empty(), Samples::empty(), ProcessCpu::default());
        Ok(Route { role, target, clients, gateway_pid, closed, open, cpu })
    }

    /// `n` requests back to back, the gateway's CPU read around them.
    async fn closed_round(&mut self, n: usize) {
        let read = |pid: Option<u32>| pid.and_then(|pid| process_cpu(pid, Some(EVENTS_THREAD)));
        let before = read(self.gateway_pid);
        self.closed.append(load::closed_loop(&self.target, &mut self.clients, n).await);
        if let (Some(before), Some(after)) = (before, read(self.gateway_pid)) {
            self.cpu += after - before;
        }
    }
}

/// The gateway's thread that writes inference events.
const EVENTS_THREAD: &str = "hangar-events";

async fn measure(
    options: &Options,
    engine_url: &str,
    servers: &[(Role, Server)],
) -> Result<Report, BenchError> {
    let mut routes = vec![Route::connect(options, Role::Direct, engine_url, None).await?];
    for (role, server) in servers {
        routes.push(Route::connect(options, *role, &server.process.base_url, server.process.pid()).await?);
    }
    // The paths take turns, a share of the requests at a time, so a change
    // in the machine's background load hits all alike; the gateways go in
    // a different order each round, so none always follows the same one.
    for round in 0..ROUNDS {
        let n = options.requests / ROUNDS + usize::from(round < options.requests % ROUNDS);
        if n == 0 {
            continue;
        }
        for route in &mut routes {
            route.closed_round(n).await;
        }
        for route in &mut routes {
            route.open.append(load::open_loop(&route.target, &mut route.clients, n, options.rate).await);
        }
        routes[1..].rotate_left(1);
    }
    routes.sort_by_key(|r| r.role);
    let mut routes = routes.into_iter().map(|r| {
        let cpu = Cpu::new(r.cpu, r.closed.ok + r.closed.errors);
        (r.role, PathStats::from(r.closed), PathStats::from(r.open), cpu)
    });
    let (_, direct_closed, direct_open, _) = routes.next().expect("the direct path");
    let mut gateways = routes.map(|(role, closed, open, cpu)| {
        let gateway = Gateway {
            closed_loop: Phase::new(direct_closed.clone(), closed),
            open_loop: Phase::new(direct_open.clone(), open),
            cpu,
        };
        (role, gateway)
    });
    let (_, this) = gateways.next().expect("the gateway's path");
    let (mut without_events, mut baseline) = (None, None);
    for (role, gateway) in gateways {
        match role {
            Role::WithoutEvents => without_events = Some(gateway),
            Role::Baseline => baseline = Some(gateway),
            Role::Direct | Role::Gateway => unreachable!("sorted first, taken above"),
        }
    }
    Ok(Report {
        requests: options.requests,
        concurrency: options.concurrency,
        rate: options.rate,
        body: options.body,
        engine_url: engine_url.to_owned(),
        gateway_url: servers[0].1.process.base_url.clone(),
        closed_loop: this.closed_loop,
        open_loop: this.open_loop,
        cpu: this.cpu,
        without_events,
        baseline,
    })
}

/// Turns the paths take in each phase.
const ROUNDS: usize = 5;
