//! `hangar bench predictions`: what the durable predictions path sustains.
//!
//! The set-up is `hangar serve` as a child process (its own runtime, its
//! own SQLite store in a temporary data directory) with one model whose
//! engine is a mock with zero compute time (`--preset instant`, another
//! child process, `external` to the server). Every prediction asks for one
//! token, so what is measured is HTTP, JSON, the store and the worker path.
//!
//! Four figures:
//! 1. **Durable creates per second**: a closed loop of `concurrency`
//!    keep-alive clients posting predictions, each answered `201` only
//!    after the prediction is committed to the store.
//! 2. **Completions per second (queue drain)**: from the start of phase 1
//!    until the last of its predictions has ended — the rate at which the
//!    workers dequeue, run and finish predictions with a backlog.
//! 3. **End-to-end completions per second with `Prefer: wait`**: a closed
//!    loop where every request creates a prediction and is answered when
//!    it has succeeded.
//! 4. **Create latency at a fixed rate**: an open loop at `rate` creates
//!    per second (p50/p90/p99).

use std::fmt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use hyper::body::Bytes;
use serde::Serialize;

use crate::load::{self, Client, PathStats, Target};
use crate::processes::{address, launch_instant_engine, start_serve};
use crate::BenchError;

/// The create route of the bench's model (`bench/instant`).
const PREDICTIONS_PATH: &str = "/v1/models/bench/instant/predictions";
const TARGET_CREATES_PER_S: f64 = 5000.0;
const TARGET_P99_MS: f64 = 5.0;

/// How to run it.
#[derive(Debug, Clone)]
pub struct Options {
    /// Predictions per phase.
    pub requests: usize,
    /// Keep-alive clients in the closed loops.
    pub concurrency: usize,
    /// Creates per second in the open loop.
    pub rate: f64,
    /// The `hangar` binary.
    pub hangar_exe: PathBuf,
}

/// The figures.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Predictions per phase.
    pub requests: usize,
    /// Clients in the closed loops.
    pub concurrency: usize,
    /// Open-loop rate.
    pub rate: f64,
    /// Phase 1: creates answered 201.
    pub creates: PathStats,
    /// Phase 2: predictions of phase 1 ended per second, from its start.
    pub drain_completions_per_s: f64,
    /// Seconds from phase 1's start until its last prediction ended.
    pub drain_seconds: f64,
    /// Phase 3: create-and-wait requests.
    pub wait: PathStats,
    /// Phase 4: creates at `rate`.
    pub open_loop: PathStats,
}

/// Runs the four phases; the child processes are stopped (or killed when
/// dropped) on every path.
///
/// # Cancel safety
/// Dropping the future kills both child processes.
pub async fn run(options: &Options) -> Result<Report, BenchError> {
    if options.requests == 0 || options.concurrency == 0 || !(options.rate.is_finite() && options.rate > 0.0)
    {
        return Err(BenchError::Options("--requests, --concurrency and --rate must be positive".into()));
    }
    let engine = launch_instant_engine(&options.hangar_exe).await?;
    let extra = format!("\n[predictions]\nasync_slots = {}\n", options.concurrency.max(32));
    let server = start_serve(&options.hangar_exe, &engine.base_url, 1024, &extra, "server").await?;
    let report = measure(options, &server.process.base_url).await;
    server.process.stop(Duration::from_secs(5)).await;
    engine.stop(Duration::from_secs(5)).await;
    report
}

fn target(url: &str, headers: &'static [(&'static str, &'static str)]) -> Result<Target, BenchError> {
    let body =
        serde_json::json!({"input": {"prompt": "Say hello to the predictions benchmark.", "max_tokens": 1}});
    Ok(Target { addr: address(url)?, path: PREDICTIONS_PATH, body: Bytes::from(body.to_string()), headers })
}

async fn clients(target: &Target, n: usize) -> Result<Vec<Client>, BenchError> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(Client::connect(target).await?);
    }
    Ok(out)
}

async fn measure(options: &Options, url: &str) -> Result<Report, BenchError> {
    let create = target(url, &[])?;
    let mut pool = clients(&create, options.concurrency).await?;
    // Warm-up: connections, the store's page cache, the engine pool.
    load::closed_loop(&create, &mut pool, (options.requests / 10).max(2 * options.concurrency)).await;
    wait_drained(url).await?;

    let start = Instant::now();
    let creates = PathStats::from(load::closed_loop(&create, &mut pool, options.requests).await);
    wait_drained(url).await?;
    let drain_seconds = start.elapsed().as_secs_f64();

    let wait = target(url, &[("prefer", "wait=60")])?;
    let waited = PathStats::from(load::closed_loop(&wait, &mut pool, options.requests).await);
    wait_drained(url).await?;

    let open_loop =
        PathStats::from(load::open_loop(&create, &mut pool, options.requests, options.rate).await);
    wait_drained(url).await?;
    Ok(Report {
        requests: options.requests,
        concurrency: options.concurrency,
        rate: options.rate,
        drain_completions_per_s: creates.ok as f64 / drain_seconds,
        drain_seconds,
        creates,
        wait: waited,
        open_loop,
    })
}

/// Waits until the newest page of predictions has none left running —
/// its one account's predictions are claimed in order, so every older one
/// has then been dequeued too.
async fn wait_drained(url: &str) -> Result<(), BenchError> {
    let http = hangar_agent::direct_http().build().expect("a plain HTTP client");
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let page = http.get(format!("{url}/v1/predictions")).send().await;
        let text = match page {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(e) => return Err(BenchError::Options(format!("the server stopped answering: {e}"))),
        };
        let page: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        let busy = page["results"].as_array().is_none_or(|r| {
            r.iter().any(|p| matches!(p["status"].as_str(), Some("starting" | "processing")))
        });
        if !busy {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(BenchError::Options("predictions did not drain within 10 minutes".into()));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "meets"
    } else {
        "MISSES"
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let row = |f: &mut fmt::Formatter<'_>, name: &str, s: &PathStats| {
            writeln!(
                f,
                "{name:<34} {:>7}/{:<7} {:>9.0}/s  p50 {:>7.2} ms  p90 {:>7.2} ms  p99 {:>7.2} ms  max {:>8.2} ms",
                s.ok, s.requests, s.req_per_s, s.p50_ms, s.p90_ms, s.p99_ms, s.max_ms
            )?;
            if let Some(e) = &s.first_error {
                writeln!(f, "{:<34} {} failed; first: {e}", "", s.errors)?;
            }
            Ok(())
        };
        writeln!(
            f,
            "hangar bench predictions: {} predictions a phase, {} clients, zero-compute engine, SQLite (WAL) store",
            self.requests, self.concurrency
        )?;
        row(f, "durable creates (closed loop)", &self.creates)?;
        writeln!(
            f,
            "{:<34} {:>15} {:>9.0}/s  ({:.2} s from the first create to the last completion)",
            "completions (queue drain)", "", self.drain_completions_per_s, self.drain_seconds
        )?;
        row(f, "create + Prefer: wait (closed)", &self.wait)?;
        row(f, &format!("creates at {:.0}/s (open loop)", self.rate), &self.open_loop)?;
        writeln!(
            f,
            "targets: creates >= {TARGET_CREATES_PER_S:.0}/s: {:.0}/s {}; p99 create <= {TARGET_P99_MS} ms at {:.0}/s: {:.2} ms {}",
            self.creates.req_per_s,
            verdict(self.creates.req_per_s >= TARGET_CREATES_PER_S),
            self.rate,
            self.open_loop.p99_ms,
            verdict(self.open_loop.p99_ms <= TARGET_P99_MS)
        )
    }
}
