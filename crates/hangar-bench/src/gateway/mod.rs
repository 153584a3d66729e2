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
use std::path::PathBuf;
use std::time::Duration;

use hyper::body::Bytes;

use crate::load::{self, Client, PathStats, Samples, Target};
use crate::processes::{address, launch_instant_engine, start_serve, Server, MODEL};
use crate::BenchError;

pub use report::{Added, Phase, Report};

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
        Ok(())
    }

    /// Unmeasured requests sent before the closed loop on each path.
    fn warmup(&self) -> usize {
        (self.requests / 10).max(2 * self.concurrency)
    }
}

/// Starts the mock engine and the gateway, runs both phases on both paths
/// and stops the processes again (also on failure: they are killed when
/// dropped).
///
/// # Cancel safety
/// Dropping the future kills both child processes.
pub async fn run(options: &Options) -> Result<Report, BenchError> {
    options.validate()?;
    let engine = launch_instant_engine(&options.hangar_exe).await?;
    let gateway = start_gateway(options, &engine.base_url).await?;
    let report = measure(options, &engine.base_url, &gateway.process.base_url).await;
    gateway.process.stop(Duration::from_secs(5)).await;
    engine.stop(Duration::from_secs(5)).await;
    report
}

/// `hangar serve` with one model whose engine is the mock at `engine_url`.
async fn start_gateway(options: &Options, engine_url: &str) -> Result<Server, BenchError> {
    // Permits beyond the client count: admission never makes a request wait.
    let permits = (options.concurrency * 2).max(1024);
    start_serve(&options.hangar_exe, engine_url, permits, "", "gateway").await
}

async fn measure(options: &Options, engine_url: &str, gateway_url: &str) -> Result<Report, BenchError> {
    let mut paths = Vec::new();
    for url in [engine_url, gateway_url] {
        let target = options.body.target(address(url)?);
        let mut clients = Vec::with_capacity(options.concurrency);
        for _ in 0..options.concurrency {
            clients.push(Client::connect(&target).await?);
        }
        load::closed_loop(&target, &mut clients, options.warmup()).await;
        paths.push((target, clients));
    }
    // The paths take turns, a share of the requests at a time, so a change
    // in the machine's background load hits both alike.
    let mut closed = [Samples::empty(), Samples::empty()];
    let mut open = [Samples::empty(), Samples::empty()];
    for round in 0..ROUNDS {
        let n = options.requests / ROUNDS + usize::from(round < options.requests % ROUNDS);
        if n == 0 {
            continue;
        }
        for (i, (target, clients)) in paths.iter_mut().enumerate() {
            closed[i].append(load::closed_loop(target, clients, n).await);
        }
        for (i, (target, clients)) in paths.iter_mut().enumerate() {
            open[i].append(load::open_loop(target, clients, n, options.rate).await);
        }
    }
    let closed: Vec<PathStats> = closed.into_iter().map(PathStats::from).collect();
    let open: Vec<PathStats> = open.into_iter().map(PathStats::from).collect();
    let [direct, gateway] = <[PathStats; 2]>::try_from(closed).expect("two paths");
    let closed = Phase::new(direct, gateway);
    let [direct, gateway] = <[PathStats; 2]>::try_from(open).expect("two paths");
    let open = Phase::new(direct, gateway);
    Ok(Report {
        requests: options.requests,
        concurrency: options.concurrency,
        rate: options.rate,
        body: options.body,
        engine_url: engine_url.to_owned(),
        gateway_url: gateway_url.to_owned(),
        closed_loop: closed,
        open_loop: open,
    })
}

/// Turns the paths take in each phase.
const ROUNDS: usize = 5;
