//! `hangar bench adapters`: what a LoRA adapter costs a request through
//! Hangar, on the mock engine (docs/adapters.md).
//!
//! The set-up is a user's, in one of two shapes:
//! - **one machine** ([`machine`]): a weight store (in a temporary
//!   directory) with synthetic PEFT adapters registered under the bench's
//!   model, a mock engine with zero compute time and the runtime LoRA API
//!   (`hangar engine mock --preset instant`, a child process: its loads
//!   take the adapter's bytes at 2 GB/s plus 50 ms, reading every byte),
//!   and `hangar serve` in front of it (another child process, the model's
//!   engine `external` at that mock);
//! - **a fleet** (`--fleet`, [`fleet`]): a private Redis, a store registry,
//!   two nodes each with its own weight store daemon and agent, and one
//!   gateway; the model has one replica, on whichever node placement
//!   chooses. An agent makes the directories of its own store's adapters
//!   ahead of need and a peer's on demand (docs/adapters.md, "On a
//!   fleet"), so a fresh adapter registered only on the other node pays
//!   its fetch from that peer and its directory's making.
//!
//! Either way `router = "adapter"` and 4 adapter slots, and two figures,
//! each a side-by-side in one run:
//!
//! 1. **A loaded adapter**: requests for the base model and for an adapter
//!    already loaded on its replica, one client, one of each in turn so a
//!    change in the machine's load hits both alike. The target: the adapter
//!    adds no measurable latency (its p50 and p99 against the base's).
//! 2. **An adapter that needs a load**: for each of `fresh` adapters never
//!    asked for, first the engine's own load of it, straight to the mock
//!    (`POST /v1/load_lora_adapter` with a directory the bench exports,
//!    then unloaded again), then a request for it through the gateway. Its
//!    latency less the engine's load and less a base request's p50 is
//!    Hangar's overhead. The target is that the request pays only the
//!    load, once the adapters were exported ahead of need, as the server
//!    does in the background from its start (on a fleet each node's agent,
//!    for its own store's adapters; how long that took is reported); on a
//!    fleet the overhead is also reported by where the adapter was
//!    registered, a peer's being made on demand.

mod fleet;
mod machine;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hangar_core::AdapterRef;
use hangar_store::BlobStore;
use hyper::body::Bytes;
use serde::Serialize;

use crate::load::{self, Client, PathStats, Samples, Target};
use crate::processes::MODEL;
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
    /// On a fleet of two nodes behind one gateway instead of one machine.
    pub fleet: bool,
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
    /// Measured on a fleet (else one machine).
    pub fleet: bool,
    /// Each adapter's bytes.
    pub adapter_bytes: u64,
    /// Seconds from the server's start until it had exported every
    /// adapter ahead of need (what the second figure waits for); on a
    /// fleet, from the agents' start until each node had made its own
    /// store's (a peer's are made on demand).
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
    /// On a fleet, the median overhead of the adapters registered on the
    /// replica's own node, and of those registered only on the other, ms.
    pub overhead_p50_by_source_ms: Vec<(Source, f64)>,
}

/// Where a fresh adapter was registered, seen from the replica that
/// loads it (on a fleet).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Source {
    /// In the weight store of the replica's own node.
    ThisNode,
    /// Only in the other node's store: its agent fetches it from that peer.
    Peer,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Source::ThisNode => "this node",
            Source::Peer => "a peer",
        })
    }
}

/// One adapter asked for the first time.
#[derive(Debug, Clone, Serialize)]
pub struct FreshLoad {
    /// Its name.
    pub adapter: String,
    /// Where it was registered (on a fleet).
    pub source: Option<Source>,
    /// The engine's own load of it, straight to the mock, ms.
    pub engine_load_ms: f64,
    /// The request for it through the gateway, ms.
    pub request_ms: f64,
    /// `request_ms` less `engine_load_ms` less the base's p50, ms.
    pub overhead_ms: f64,
}

/// Layers and hidden size of the synthetic adapters (an 8B Llama's).
const LAYERS: usize = 32;
const HIDDEN: usize = 4096;

/// Adapter slots of the gateway's replica: half the mock engine's 8, so
/// the bench's own direct load always finds room on the engine.
const SLOTS: u32 = 4;

/// Runs both figures; the child processes are killed when dropped (also
/// on failure).
///
/// # Cancel safety
/// Dropping the future kills every child process.
pub async fn run(options: &Options) -> Result<Report, BenchError> {
    options.validate()?;
    let names: Vec<String> = (0..=options.fresh).map(|i| format!("bench/lora-{i}")).collect();
    if options.fleet {
        fleet::run(options, &names).await
    } else {
        machine::run(options, &names).await
    }
}

/// The model's part of the configuration, beside its engine.
fn model_extra() -> String {
    format!("router = \"adapter\"\nadapters = {{ slots = {SLOTS} }}\n")
}

/// A chat for `model` through the gateway at `addr`.
fn chat(addr: SocketAddr, model: &str) -> Target {
    Target {
        addr,
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
    }
}

/// The first figure through the gateway at `gateway`, `hot` the adapter
/// it loads: the base's and the loaded adapter's figures, and the client
/// (one connection) for the second.
async fn loaded_figure(
    gateway: SocketAddr,
    hot: &str,
    requests: usize,
) -> Result<(Vec<Client>, PathStats, PathStats), BenchError> {
    let base = chat(gateway, MODEL);
    let hot = chat(gateway, &format!("{MODEL}:{hot}"));
    let mut client = vec![Client::connect(&base).await?];
    // Warm-up, not measured: connections, and the hot adapter's load.
    load::closed_loop(&base, &mut client, 20).await.ok_or_first_error("the base model's warm-up")?;
    load::closed_loop(&hot, &mut client, 20).await.ok_or_first_error("the loaded adapter's warm-up")?;

    // One request of each in turn, on one connection: whatever the machine
    // does meanwhile hits both alike.
    let (mut base_samples, mut hot_samples) = (Samples::empty(), Samples::empty());
    let started_pairs = Instant::now();
    let connection = &mut client[0];
    for _ in 0..requests {
        for (target, samples) in [(&base, &mut base_samples), (&hot, &mut hot_samples)] {
            let sent = Instant::now();
            let outcome = connection.exchange(target).await;
            samples.record(sent.elapsed(), outcome);
        }
    }
    base_samples.elapsed = started_pairs.elapsed();
    hot_samples.elapsed = base_samples.elapsed;
    let (base, loaded) = (PathStats::from(base_samples), PathStats::from(hot_samples));
    if let Some(e) = base.first_error.as_ref().or(loaded.first_error.as_ref()) {
        return Err(BenchError::Failed(format!("a request failed: {e}")));
    }
    Ok((client, base, loaded))
}

/// A fresh adapter of the second figure: its name, the store that
/// registers it, where that is from the replica.
struct Fresh<'a> {
    name: &'a str,
    store: &'a BlobStore,
    source: Option<Source>,
}

/// The second figure: each of `fresh` loaded straight on the engine at
/// `engine_url`, then asked for through the gateway at `gateway` on
/// `client`; `base_p50_ms` is what a request costs without a load.
async fn fresh_figure(
    client: &mut Vec<Client>,
    gateway: SocketAddr,
    engine_url: &str,
    fresh: &[Fresh<'_>],
    base_p50_ms: f64,
) -> Result<Vec<FreshLoad>, BenchError> {
    let http = hangar_agent::direct_http().build().expect("a plain HTTP client");
    let exports = tempfile::tempdir()?;
    let mut loads = Vec::with_capacity(fresh.len());
    for f in fresh {
        let engine_load_ms = direct_load(&http, engine_url, f.store, f.name, exports.path()).await?;
        let cold = chat(gateway, &format!("{MODEL}:{}", f.name));
        let took = load::closed_loop(&cold, client, 1).await;
        let request_ms =
            took.ok_or_first_error(&format!("the request for {}", f.name))?.latency_ns.max() as f64 / 1e6;
        let overhead_ms = request_ms - engine_load_ms - base_p50_ms;
        loads.push(FreshLoad {
            adapter: f.name.to_owned(),
            source: f.source,
            engine_load_ms,
            request_ms,
            overhead_ms,
        });
    }
    Ok(loads)
}

impl Report {
    fn new(
        fleet: bool,
        adapter_bytes: u64,
        exported_ahead_s: f64,
        (base, loaded): (PathStats, PathStats),
        fresh: Vec<FreshLoad>,
    ) -> Report {
        let median = |of: &mut dyn Iterator<Item = &FreshLoad>| {
            let mut overheads: Vec<f64> = of.map(|f| f.overhead_ms).collect();
            overheads.sort_by(f64::total_cmp);
            (overheads.get(overheads.len() / 2).copied(), overheads.last().copied())
        };
        let (p50, max) = median(&mut fresh.iter());
        let by_source = [Source::ThisNode, Source::Peer]
            .into_iter()
            .filter_map(|s| median(&mut fresh.iter().filter(|f| f.source == Some(s))).0.map(|m| (s, m)))
            .collect();
        Report {
            fleet,
            adapter_bytes,
            exported_ahead_s,
            loaded_added_p50_ms: loaded.p50_ms - base.p50_ms,
            loaded_added_p99_ms: loaded.p99_ms - base.p99_ms,
            base,
            loaded,
            overhead_p50_ms: p50.expect("at least one fresh adapter"),
            overhead_max_ms: max.expect("at least one fresh adapter"),
            overhead_p50_by_source_ms: by_source,
            fresh,
        }
    }
}

/// Registers a synthetic adapter of `rank` under the bench's model in the
/// store at `root` for each `(seed, name)` of `adapters` (the same seed
/// makes the same artifact in any store); the store, and each adapter's
/// bytes.
async fn register(
    root: &Path,
    adapters: &[(u64, &str)],
    rank: usize,
) -> Result<(BlobStore, u64), BenchError> {
    let root = root.to_owned();
    let adapters: Vec<(u64, String)> = adapters.iter().map(|&(s, n)| (s, n.to_owned())).collect();
    tokio::task::spawn_blocking(move || {
        let store =
            BlobStore::open(&root).map_err(|e| BenchError::Failed(format!("the bench's store: {e}")))?;
        let shape = hangar_store::synth::AdapterShape { rank, hidden: HIDDEN, layers: LAYERS };
        let mut bytes = 0;
        for (seed, name) in &adapters {
            let adapter: AdapterRef = format!("{MODEL}:{name}").parse().expect("a valid adapter name");
            let report = hangar_store::synth::register_adapter(&store, &adapter, shape, *seed)
                .map_err(|e| BenchError::Failed(format!("registering {adapter}: {e}")))?;
            bytes = report.bytes;
        }
        Ok((store, bytes))
    })
    .await
    .expect("registering adapters does not panic")
}

/// Sends `target` until it is answered 2xx (a minute at most: the replica
/// starting, the catalog catching up), `what` naming it in the error.
async fn until_ok(target: &Target, what: &str) -> Result<(), BenchError> {
    let started = Instant::now();
    loop {
        let mut client = vec![Client::connect(target).await?];
        let samples = load::closed_loop(target, &mut client, 1).await;
        match samples.first_error {
            None => return Ok(()),
            Some(e) if started.elapsed() > Duration::from_secs(60) => {
                return Err(BenchError::Failed(format!("{what} still failed after a minute: {e}")))
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Waits until `count` adapters of the store at `root` have their
/// directories, made ahead of need (by `hangar serve` on one machine, by
/// the node's agent on a fleet; a minute at most); the seconds since
/// `since`.
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
                "{} of {count} adapters of the store at {} had their directories made ahead of need within a minute",
                exported(),
                root.display()
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
        let through = match self.fleet {
            true => "through a fleet's gateway (Redis, a store registry, two nodes each with its store daemon and agent)",
            false => "through hangar serve",
        };
        writeln!(f, "adapters of {mb:.1} MB on the mock engine (loads at 2 GB/s + 50 ms), {through}")?;
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
        let (count, s) = (self.fresh.len(), self.exported_ahead_s);
        match self.fleet {
            false => writeln!(
                f,
                "\n2. an adapter that needs a load ({count} adapters, each asked for once, after the server exported \
                 them ahead of need, {s:.1} s after it started):",
            )?,
            true => writeln!(
                f,
                "\n2. an adapter that needs a load ({count} adapters, each asked for once, after each node made \
                 its own store's adapters' directories ahead of need, {s:.1} s after the agents started; a peer's \
                 are made on demand):",
            )?,
        }
        let registered = if self.fleet { "registered on" } else { "" };
        writeln!(
            f,
            "   {:<18} {registered:<14}{:>14} {:>12} {:>12}",
            "adapter", "engine load ms", "request ms", "overhead ms"
        )?;
        for l in &self.fresh {
            let source = l.source.map(|s| s.to_string()).unwrap_or_default();
            writeln!(
                f,
                "   {:<18} {source:<14}{:>14.1} {:>12.1} {:>12.1}",
                l.adapter, l.engine_load_ms, l.request_ms, l.overhead_ms
            )?;
        }
        writeln!(
            f,
            "   overhead (request - engine load - base p50): median {:.1} ms, max {:.1} ms   (target: only the load)",
            self.overhead_p50_ms, self.overhead_max_ms
        )?;
        for (source, p50) in &self.overhead_p50_by_source_ms {
            writeln!(f, "   registered on {source}: median {p50:.1} ms")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_out_of_range_are_refused_naming_the_flag() {
        let ok = Options { requests: 100, fresh: 4, rank: 16, fleet: false, hangar_exe: "hangar".into() };
        ok.validate().unwrap();
        let e = Options { requests: 1, ..ok.clone() }.validate().unwrap_err().to_string();
        assert!(e.contains("--requests"), "{e}");
        let e = Options { fresh: 0, ..ok.clone() }.validate().unwrap_err().to_string();
        assert!(e.contains("--fresh"), "{e}");
        let e = Options { rank: 0, ..ok }.validate().unwrap_err().to_string();
        assert!(e.contains("--rank"), "{e}");
    }
}
