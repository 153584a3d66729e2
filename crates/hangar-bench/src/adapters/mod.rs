//! `hangar bench adapters`: what a LoRA adapter costs a request through
//! `hangar serve`, on the mock engine (docs/adapters.md).
//!
//! The set-up is a user's: a weight store (in a temporary directory) with
//! synthetic PEFT adapters registered under the bench's model, a mock
//! engine with zero compute time and the runtime LoRA API (`hangar engine
//! mock --preset instant`, a child process: its loads take the adapter's
//! bytes at 2 GB/s plus 50 ms, reading every byte), and `hangar serve` in
//! front of it (another child process, the model's engine `external` at
//! that mock, `router = "adapter"`, 4 adapter slots). Two figures, each a
//! side-by-side in one run:
//!
//! 1. **A loaded adapter**: requests for the base model and for an adapter
//!    already loaded on its replica, one client, one of each in turn so a
//!    change in the machine's load hits both alike. The target: the adapter
//!    adds no measurable latency (its p50 and p99 against the base's).
//! 2. **An adapter that needs a load**: for each of `fresh` adapters never
//!    asked for, first the engine's own load of it, straight to the mock
//!    (`POST /v1/load_lora_adapter` with the directory the store exports,
//!    then unloaded again), then a request for it through the gateway. The
//!    target: the request pays only the load — its latency less the
//!    engine's load and less a base request's p50 is Hangar's overhead
//!    — once the server has exported its adapters ahead of need, as it
//!    does in the background from its start (how long that took is
//!    reported).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hangar_core::AdapterRef;
use hangar_store::BlobStore;
use hyper::body::Bytes;
use serde::Serialize;

use crate::load::{self, Client, PathStats, Samples, Target};
use crate::processes::{address, launch_instant_engine, start_serve, MODEL};
use crate::BenchError;

/// How to run the benchmark.
#[derive(Debug, Clone)]
pub struct Options {
    /// Requests per path (base, loaded adapter) in the first figure.
    pub requests: usize,
    /// Adapters loaded on demand in the second figure.
    pub fresh: usize,
    /// The adapters' LoRA rank (their size: layers × 8 × rank × 4096
    /// bytes, 32 layers: 67 MB at rank 64).
    pub rank: usize,
    /// The `hangar` binary, to start the mock engine and the gateway.
    pub hangar_exe: PathBuf,
}

impl Options {
    fn validate(&self) -> Result<(), BenchError> {
        if self.requests < 10 {
            return Err(BenchError::Options("--requests must be at least 10".into()));
        }
        if self.fresh == 0 || self.fresh > 256 {
            return Err(BenchError::Options("--fresh must be between 1 and 256".into()));
        }
        if !(1..=256).contains(&self.rank) {
            return Err(BenchError::Options("--rank must be between 1 and 256".into()));
        }
        Ok(())
    }
}

/// The figures.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Each adapter's bytes.
    pub adapter_bytes: u64,
    /// Seconds from the server's start until it had exported every
    /// adapter ahead of need (what the second figure waits for).
    pub exported_ahead_s: f64,
    /// Requests for the base model.
    pub base: PathStats,
    /// Requests for an adapter loaded on the replica.
    pub loaded: PathStats,
    /// What the loaded adapter adds: its p50 and p99 less the base's, ms.
    pub loaded_added_p50_ms: f64,
    /// As above, p99.
    pub loaded_added_p99_ms: f64,
    /// Each fresh adapter: the engine's own load and the gateway request.
    pub fresh: Vec<FreshLoad>,
    /// The median of the fresh requests' overhead, ms.
    pub overhead_p50_ms: f64,
    /// The largest, ms.
    pub overhead_max_ms: f64,
}

/// One adapter asked for the first time.
#[derive(Debug, Clone, Serialize)]
pub struct FreshLoad {
    /// Its name.
    pub adapter: String,
    /// The engine's load of it, straight to the mock, ms.
    pub engine_load_ms: f64,
    /// The request for it through the gateway, ms.
    pub request_ms: f64,
    /// `request_ms` less `engine_load_ms` less the base's p50, ms.
    pub overhead_ms: f64,
}

/// Layers and hidden size of the synthetic adapters (an 8B Llama's).
const LAYERS: usize = 32;
const HIDDEN: usize = 4096;

/// Runs both figures; the child processes are killed when dropped (also
/// on failure).
///
/// # Cancel safety
/// Dropping the future kills both child processes.
pub async fn run(options: &Options) -> Result<Report, BenchError> {
    options.validate()?;
    let store_dir = tempfile::tempdir()?;
    let names: Vec<String> = (0..=options.fresh).map(|i| format!("bench/lora-{i}")).collect();
    let (store, adapter_bytes) = register(store_dir.path(), &names, options.rank).await?;
    let engine = launch_instant_engine(&options.hangar_exe).await?;
    let extra = format!(
        "router = \"adapter\"\nadapters = {{ slots = {SLOTS} }}\n\n[store]\nroot = \"{}\"\n",
        store_dir.path().display()
    );
    let server = start_serve(&options.hangar_exe, &engine.base_url, 8, &extra, "hangar serve").await?;
    let started = Instant::now();
    let gateway = address(&server.process.base_url)?;
    let target = |model: &str| Target {
        addr: gateway,
        path: "/v1/chat/completions",
        body: Bytes::from(
            serde_json::json!({
                "model": model,
                "messages": [{"role": "user", "content": "Say hello to the adapter benchmark."}],
                "max_tokens": 1,
            })
            .to_string(),
        ),
        headers: &[],
    };
    let base = target(MODEL);
    let hot = target(&format!("{MODEL}:{}", names[0]));
    let mut client = vec![Client::connect(&base).await?];
    // Warm-up, not measured: connections, and the hot adapter's load.
    load::closed_loop(&base, &mut client, 20).await;
    load::closed_loop(&hot, &mut client, 20).await.ok_or_first_error("the loaded adapter's warm-up")?;

    // One request of each in turn, on one connection: whatever the machine
    // does meanwhile hits both alike.
    let (mut base_samples, mut hot_samples) = (Samples::empty(), Samples::empty());
    let started_pairs = Instant::now();
    let connection = &mut client[0];
    for _ in 0..options.requests {
        for (target, samples) in [(&base, &mut base_samples), (&hot, &mut hot_samples)] {
            let sent = Instant::now();
            let outcome = connection.exchange(target).await;
            samples.record(sent.elapsed(), outcome);
        }
    }
    base_samples.elapsed = started_pairs.elapsed();
    hot_samples.elapsed = base_samples.elapsed;
    let base_stats = PathStats::from(base_samples);
    let loaded = PathStats::from(hot_samples);
    if let Some(e) = base_stats.first_error.as_ref().or(loaded.first_error.as_ref()) {
        return Err(BenchError::Failed(format!("a request failed: {e}")));
    }

    // The steady state: the server has exported every adapter ahead of
    // need (a first request right after registering pays its export).
    let exported_ahead_s = exported_ahead(store_dir.path(), names.len(), started).await?;
    let http = hangar_agent::direct_http().build().expect("a plain HTTP client");
    let exports = tempfile::tempdir()?;
    let mut fresh = Vec::with_capacity(options.fresh);
    for name in &names[1..] {
        let engine_load_ms = direct_load(&http, &engine.base_url, &store, name, exports.path()).await?;
        let cold = target(&format!("{MODEL}:{name}"));
        let took = load::closed_loop(&cold, &mut client, 1).await;
        let request_ms =
            took.ok_or_first_error(&format!("the request for {name}"))?.latency_ns.max() as f64 / 1e6;
        let overhead_ms = request_ms - engine_load_ms - base_stats.p50_ms;
        fresh.push(FreshLoad { adapter: name.clone(), engine_load_ms, request_ms, overhead_ms });
    }
    server.process.stop(Duration::from_secs(5)).await;
    engine.stop(Duration::from_secs(5)).await;
    let mut overheads: Vec<f64> = fresh.iter().map(|f| f.overhead_ms).collect();
    overheads.sort_by(f64::total_cmp);
    Ok(Report {
        adapter_bytes,
        exported_ahead_s,
        loaded_added_p50_ms: loaded.p50_ms - base_stats.p50_ms,
        loaded_added_p99_ms: loaded.p99_ms - base_stats.p99_ms,
        base: base_stats,
        loaded,
        overhead_p50_ms: overheads[overheads.len() / 2],
        overhead_max_ms: *overheads.last().expect("at least one fresh adapter"),
        fresh,
    })
}

/// Adapter slots of the gateway's replica: half the mock engine's 8, so
/// the bench's own direct load always finds room on the engine.
const SLOTS: u32 = 4;

/// A store at `root` with a synthetic adapter of `rank` registered under
/// the bench's model for each of `names`; and each adapter's bytes.
async fn register(root: &Path, names: &[String], rank: usize) -> Result<(BlobStore, u64), BenchError> {
    let (root, names) = (root.to_owned(), names.to_vec());
    tokio::task::spawn_blocking(move || {
        let store =
            BlobStore::open(&root).map_err(|e| BenchError::Failed(format!("the bench's store: {e}")))?;
        let sources = tempfile::tempdir()?;
        let mut bytes = 0;
        for (i, name) in names.iter().enumerate() {
            let dir = sources.path().join(format!("a{i}"));
            hangar_store::synth::synth_adapter_dir(&dir, MODEL, rank, HIDDEN, LAYERS, i as u64)
                .map_err(|e| BenchError::Failed(format!("writing a synthetic adapter: {e}")))?;
            let adapter: AdapterRef = format!("{MODEL}:{name}").parse().expect("a valid adapter name");
            let report = hangar_store::adapters::import_dir(&store, &dir, &adapter)
                .map_err(|e| BenchError::Failed(format!("registering {adapter}: {e}")))?;
            bytes = report.bytes;
        }
        Ok((store, bytes))
    })
    .await
    .expect("registering adapters does not panic")
}

/// Waits until the server has exported all `count` adapters of the store
/// at `root` ahead of need (a minute at most); the seconds since `since`.
async fn exported_ahead(root: &Path, count: usize, since: Instant) -> Result<f64, BenchError> {
    let dirs = root.join("adapter-dirs");
    let exported = || {
        std::fs::read_dir(&dirs)
            .map(|d| {
                d.filter_map(Result::ok).filter(|e| e.path().join("adapter_config.json").exists()).count()
            })
            .unwrap_or(0)
    };
    while exported() < count {
        if since.elapsed() > Duration::from_secs(60) {
            return Err(BenchError::Failed(format!(
                "the server exported {} of {count} adapters ahead of need within a minute",
                exported()
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(since.elapsed().as_secs_f64())
}

/// The engine's own load of adapter `name`, straight to the mock at `base`
/// from the directory the store exports under `under` (then unloaded, so
/// the gateway's request finds it absent), ms.
async fn direct_load(
    http: &reqwest::Client,
    base: &str,
    store: &BlobStore,
    name: &str,
    under: &Path,
) -> Result<f64, BenchError> {
    let adapter: AdapterRef = format!("{MODEL}:{name}").parse().expect("a valid adapter name");
    let entry = hangar_store::adapters::find(store, &adapter)
        .map_err(|e| BenchError::Failed(e.to_string()))?
        .ok_or_else(|| BenchError::Failed(format!("{adapter} is not registered")))?;
    let dir = hangar_store::adapters::export_dir(store, &entry, under)
        .map_err(|e| BenchError::Failed(format!("exporting {adapter}: {e}")))?;
    let direct = format!("direct/{name}");
    let started = Instant::now();
    let load = serde_json::json!({"lora_name": direct, "lora_path": dir});
    expect_ok(http.post(format!("{base}/v1/load_lora_adapter")).json(&load).send().await, "a direct load")?;
    let took = started.elapsed();
    let unload = serde_json::json!({"lora_name": direct});
    expect_ok(
        http.post(format!("{base}/v1/unload_lora_adapter")).json(&unload).send().await,
        "a direct unload",
    )?;
    Ok(took.as_secs_f64() * 1000.0)
}

fn expect_ok(answer: Result<reqwest::Response, reqwest::Error>, what: &str) -> Result<(), BenchError> {
    match answer {
        Ok(r) if r.status().is_success() => Ok(()),
        Ok(r) => Err(BenchError::Failed(format!("{what} answered {}", r.status()))),
        Err(e) => Err(BenchError::Failed(format!("{what} failed: {e}"))),
    }
}

impl Samples {
    /// The samples, or the first error of any request as `what` failing.
    fn ok_or_first_error(self, what: &str) -> Result<Samples, BenchError> {
        match &self.first_error {
            Some(e) => Err(BenchError::Failed(format!("{what} failed: {e}"))),
            None => Ok(self),
        }
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mb = self.adapter_bytes as f64 / 1e6;
        writeln!(
            f,
            "adapters of {mb:.1} MB on the mock engine (loads at 2 GB/s + 50 ms), through hangar serve"
        )?;
        writeln!(
            f,
            "\n1. an adapter already loaded, against the base model ({} requests each, one client):",
            self.base.requests
        )?;
        writeln!(f, "   {:<16} {:>9} {:>9} {:>9}", "", "p50 ms", "p90 ms", "p99 ms")?;
        for (name, s) in [("base model", &self.base), ("loaded adapter", &self.loaded)] {
            writeln!(f, "   {name:<16} {:>9.3} {:>9.3} {:>9.3}", s.p50_ms, s.p90_ms, s.p99_ms)?;
        }
        writeln!(
            f,
            "   added by the adapter: p50 {:+.3} ms, p99 {:+.3} ms   (target: none measurable)",
            self.loaded_added_p50_ms, self.loaded_added_p99_ms
        )?;
        writeln!(
            f,
            "\n2. an adapter that needs a load ({} adapters, each asked for once, after the server exported \
             them ahead of need, {:.1} s after it started):",
            self.fresh.len(),
            self.exported_ahead_s
        )?;
        writeln!(
            f,
            "   {:<18} {:>14} {:>12} {:>12}",
            "adapter", "engine load ms", "request ms", "overhead ms"
        )?;
        for l in &self.fresh {
            writeln!(
                f,
                "   {:<18} {:>14.1} {:>12.1} {:>12.1}",
                l.adapter, l.engine_load_ms, l.request_ms, l.overhead_ms
            )?;
        }
        writeln!(
            f,
            "   overhead (request - engine load - base p50): median {:.1} ms, max {:.1} ms   (target: only the load)",
            self.overhead_p50_ms, self.overhead_max_ms
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_out_of_range_are_refused_naming_the_flag() {
        let ok = Options { requests: 100, fresh: 4, rank: 16, hangar_exe: "hangar".into() };
        ok.validate().unwrap();
        let e = Options { requests: 1, ..ok.clone() }.validate().unwrap_err().to_string();
        assert!(e.contains("--requests"), "{e}");
        let e = Options { fresh: 0, ..ok.clone() }.validate().unwrap_err().to_string();
        assert!(e.contains("--fresh"), "{e}");
        let e = Options { rank: 0, ..ok }.validate().unwrap_err().to_string();
        assert!(e.contains("--rank"), "{e}");
    }
}
