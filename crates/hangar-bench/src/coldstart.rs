//! `hangar bench coldstart`: a replica's start, placement → first token,
//! by where its weights come from.
//!
//! The engine is a real one from an `openai` command template (its
//! `{weights}` and `{port}` filled in as `hangar serve` fills them), e.g.
//! llama.cpp's `llama-server -m {weights} --port {port}` with a GGUF. Each
//! start is timed from the moment a replica would be placed to the answer
//! of a one-token chat request, in its phases: weights materialized (the
//! store's starts only), engine answering its readiness check, first token.
//! The starts, in turns so that a change in the machine's load hits all
//! alike, `runs` times each (the median is printed):
//!
//! - **plain file, on disk / in page cache**: the engine opens the file
//!   itself (`{weights}` is its path), with the file dropped from the page
//!   cache before (`POSIX_FADV_DONTNEED`, no root needed) or left there;
//! - **store, blob on disk / in page cache**: a fresh store daemon (nothing
//!   resident) materializes the artifact from its blob, dropped from the
//!   page cache or not, and the engine opens the shared memory;
//! - **store, resident**: the daemon still holds the artifact from an
//!   earlier replica (lease-in-place), the case of a replica restarted or
//!   scaled back from zero on the same node;
//! - **WARM wake**: where the engine has a sleep API, a sleeping engine
//!   woken; llama.cpp has none (such engines are stopped, never kept WARM).
//!
//! Beside them, the weight read itself: the store daemon's load of the
//! blob (reading and verifying every byte, its `load_ms`) against a raw
//! sequential read of the same blob into new memory, in the same
//! page-cache state, measured in the same turns. Targets: a
//! store-backed start no slower than the plain-file start, and the weight
//! read ≥ 90 % of the raw read.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hangar_core::{ModelKey, ReplicaId};
use hangar_store::{ArtifactId, BlobStore, StoreKey};
use serde::Serialize;

use hangar_agent::capabilities;
use hangar_agent::engine::{launch, EngineSpec, LaunchContext, LaunchError, RunningEngine};
use hangar_agent::weights::{LoadedWeights, StoreSettings, WeightStore, WeightsError, WeightsSource};

/// How to run it.
#[derive(Debug, Clone)]
pub struct Options {
    /// The engine's command template (`{weights}`, `{port}`).
    pub command: String,
    /// The weights file (a GGUF for llama.cpp).
    pub weights: PathBuf,
    /// Starts of each kind.
    pub runs: usize,
    /// How long an engine may take to answer its readiness check.
    pub setup_timeout: Duration,
    /// The `hangar` binary (unused by `openai` engines, required by the
    /// launcher's context).
    pub hangar_exe: PathBuf,
}

/// Why the bench could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ColdstartError {
    /// An option is out of range.
    #[error("invalid option: {0}")]
    Options(String),
    /// The weights could not be imported or materialized.
    #[error(transparent)]
    Weights(#[from] WeightsError),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] hangar_store::StoreError),
    /// The engine did not start.
    #[error("the engine did not start: {0}")]
    Launch(#[from] LaunchError),
    /// The engine did not answer the chat request.
    #[error("the engine did not answer a chat request: {0}")]
    Chat(String),
    /// A local I/O error.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
}

/// One kind of start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StartKind {
    /// The engine opens the file, dropped from the page cache first.
    PlainFileOnDisk,
    /// The engine opens the file, in the page cache.
    PlainFileCached,
    /// A fresh daemon loads the blob, dropped from the page cache first.
    StoreBlobOnDisk,
    /// A fresh daemon loads the blob from the page cache.
    StoreBlobCached,
    /// The daemon holds the artifact resident (lease-in-place).
    StoreResident,
}

impl StartKind {
    const ALL: [Self; 5] = [
        Self::PlainFileOnDisk,
        Self::PlainFileCached,
        Self::StoreBlobOnDisk,
        Self::StoreBlobCached,
        Self::StoreResident,
    ];

    fn label(self) -> &'static str {
        match self {
            Self::PlainFileOnDisk => "plain file, on disk",
            Self::PlainFileCached => "plain file, in page cache",
            Self::StoreBlobOnDisk => "store, blob on disk",
            Self::StoreBlobCached => "store, blob in page cache",
            Self::StoreResident => "store, resident (lease-in-place)",
        }
    }

    /// The plain-file start it is compared with.
    fn baseline(self) -> Option<Self> {
        match self {
            Self::StoreBlobOnDisk => Some(Self::PlainFileOnDisk),
            Self::StoreBlobCached | Self::StoreResident => Some(Self::PlainFileCached),
            _ => None,
        }
    }
}

/// The medians of one kind of start, ms.
#[derive(Debug, Clone, Serialize)]
pub struct StartRow {
    /// Which start.
    pub kind: StartKind,
    /// Weights materialized (store starts).
    pub weights_ms: Option<f64>,
    /// Engine spawned → answering its readiness check.
    pub engine_ms: f64,
    /// Ready → the first token's answer.
    pub first_token_ms: f64,
    /// Placement → first token.
    pub total_ms: f64,
}

/// The weight read against a raw read of the same bytes, one cache state.
#[derive(Debug, Clone, Serialize)]
pub struct ReadRow {
    /// `on disk` or `in page cache`.
    pub cache: &'static str,
    /// The store daemon's load (read and verified), bytes/s (median).
    pub store_bps: f64,
    /// A sequential read of the blob into new memory, bytes/s (median).
    pub raw_bps: f64,
}

/// What the bench measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The weights' size.
    pub bytes: u64,
    /// Starts of each kind.
    pub runs: usize,
    /// One row per kind of start.
    pub starts: Vec<StartRow>,
    /// Wake of a sleeping engine → first token, ms (median), if it can sleep.
    pub warm_wake_ms: Option<f64>,
    /// The weight read, on disk and in page cache.
    pub reads: Vec<ReadRow>,
}

/// One start's phases, ms.
#[derive(Debug, Clone, Copy)]
struct Sample {
    weights_ms: Option<f64>,
    engine_ms: f64,
    first_token_ms: f64,
    total_ms: f64,
}

const BENCH_MODEL: &str = "bench/coldstart";

/// Runs the bench.
pub async fn run(o: &Options) -> Result<Report, ColdstartError> {
    if o.runs == 0 {
        return Err(ColdstartError::Options("--runs must be at least 1".into()));
    }
    if !o.command.contains("{weights}") || !o.command.contains("{port}") {
        return Err(ColdstartError::Options("--command must use {weights} and {port}".into()));
    }
    let dir = tempfile::tempdir().map_err(io_err("a temporary directory"))?;
    let root = dir.path().join("store");
    let key: StoreKey = format!("{BENCH_MODEL}:latest").parse().expect("a valid store key");
    let imported =
        BlobStore::open(&root)?.import_files(std::slice::from_ref(&o.weights), std::slice::from_ref(&key))?;
    let blob = blob_path(&root, &imported.id);
    let bytes = std::fs::metadata(&blob).map_err(io_err(&blob.display().to_string()))?.len();
    let model: ModelKey = BENCH_MODEL.parse().expect("a valid model key");
    // By key, as `weights = "store:KEY"`: a file source would be hashed
    // again by each fresh store's first import.
    let source = WeightsSource::Store(key);
    let client = hangar_agent::direct_http().build().expect("a plain HTTP client");

    // The resident store: one daemon kept for the whole bench, primed once.
    let resident = open_store(&root, dir.path(), "resident").await?;
    let primed = resident.load(&model, &source, ReplicaId::from_u128(u128::MAX)).await?;
    drop(primed);
    resident.release(ReplicaId::from_u128(u128::MAX)).await;

    let mut samples: Vec<(StartKind, Sample)> = Vec::new();
    let (mut store_reads, mut raw_reads) = (vec![Vec::new(), Vec::new()], vec![Vec::new(), Vec::new()]);
    for run in 0..o.runs {
        for kind in StartKind::ALL {
            let sample = match kind {
                StartKind::PlainFileOnDisk | StartKind::PlainFileCached => {
                    if kind == StartKind::PlainFileOnDisk {
                        drop_from_page_cache(&o.weights)?;
                    }
                    let command = o.command.replace("{weights}", &o.weights.display().to_string());
                    start(o, &client, &command, None, Instant::now()).await?
                }
                StartKind::StoreBlobOnDisk | StartKind::StoreBlobCached => {
                    let on_disk = kind == StartKind::StoreBlobOnDisk;
                    // The raw read first, in the same cache state.
                    if on_disk {
                        drop_from_page_cache(&blob)?;
                    }
                    raw_reads[usize::from(!on_disk)]
                        .push(hangar_store::bench::plain_read_into_memory(&blob)?);
                    if on_disk {
                        drop_from_page_cache(&blob)?;
                    }
                    let store = open_store(&root, dir.path(), &format!("fresh-{run}-{on_disk}")).await?;
                    let placed = Instant::now();
                    let weights = store.load(&model, &source, ReplicaId::from_u128(run as u128)).await?;
                    store_reads[usize::from(!on_disk)]
                        .push(bytes as f64 / (weights.report.load_ms.max(1) as f64 / 1e3));
                    start(o, &client, &o.command, Some(&weights), placed).await?
                }
                StartKind::StoreResident => {
                    let placed = Instant::now();
                    let replica = ReplicaId::from_u128(1_000_000 + run as u128);
                    let weights = resident.load(&model, &source, replica).await?;
                    let sample = start(o, &client, &o.command, Some(&weights), placed).await?;
                    drop(weights);
                    resident.release(replica).await;
                    sample
                }
            };
            samples.push((kind, sample));
        }
    }
    let starts = StartKind::ALL
        .into_iter()
        .map(|kind| {
            let of: Vec<Sample> = samples.iter().filter(|(k, _)| *k == kind).map(|(_, s)| *s).collect();
            StartRow {
                kind,
                weights_ms: of[0].weights_ms.map(|_| median(of.iter().filter_map(|s| s.weights_ms))),
                engine_ms: median(of.iter().map(|s| s.engine_ms)),
                first_token_ms: median(of.iter().map(|s| s.first_token_ms)),
                total_ms: median(of.iter().map(|s| s.total_ms)),
            }
        })
        .collect();
    let reads = ["on disk", "in page cache"]
        .into_iter()
        .zip(store_reads.into_iter().zip(raw_reads))
        .map(|(cache, (store, raw))| ReadRow {
            cache,
            store_bps: median(store.into_iter()),
            raw_bps: median(raw.into_iter()),
        })
        .collect();
    let warm_wake_ms = warm_wake(o, &client, &resident, &model, &source).await?;
    Ok(Report { bytes, runs: o.runs, starts, warm_wake_ms, reads })
}

/// One start: the engine launched (with the weights' descriptor, if any),
/// ready, then a one-token chat answered; stopped after.
async fn start(
    o: &Options,
    client: &reqwest::Client,
    command: &str,
    weights: Option<&LoadedWeights>,
    placed: Instant,
) -> Result<Sample, ColdstartError> {
    let spawned = Instant::now();
    let engine = launch_engine(o, command, weights).await?;
    let ready = Instant::now();
    first_token(client, &engine.base_url).await?;
    let done = Instant::now();
    engine.stop(Duration::from_secs(5)).await;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    Ok(Sample {
        weights_ms: weights.map(|w| w.report.took_ms as f64),
        engine_ms: ms(ready - spawned),
        first_token_ms: ms(done - ready),
        total_ms: ms(done - placed),
    })
}

async fn launch_engine(
    o: &Options,
    command: &str,
    weights: Option<&LoadedWeights>,
) -> Result<RunningEngine, ColdstartError> {
    let spec = EngineSpec::Openai {
        command: command.to_owned(),
        readiness_path: "/health".into(),
        setup_timeout_s: o.setup_timeout.as_secs().max(1),
    };
    let ctx = LaunchContext {
        model: BENCH_MODEL.into(),
        gpus: Vec::new(),
        gpu_fraction: 1.0,
        hangar_exe: o.hangar_exe.clone(),
        mock_setup_timeout: o.setup_timeout,
        weights: weights.map(LoadedWeights::handed),
    };
    Ok(launch(&spec, &ctx).await?)
}

/// A sleeping engine woken, then a first token, ms (median of `runs`);
/// `None` if the engine has no sleep API.
async fn warm_wake(
    o: &Options,
    client: &reqwest::Client,
    store: &Arc<WeightStore>,
    model: &ModelKey,
    source: &WeightsSource,
) -> Result<Option<f64>, ColdstartError> {
    let replica = ReplicaId::from_u128(2_000_000);
    let weights = store.load(model, source, replica).await?;
    let engine = launch_engine(o, &o.command, Some(&weights)).await?;
    let spec = EngineSpec::Openai {
        command: o.command.clone(),
        readiness_path: "/health".into(),
        setup_timeout_s: 1,
    };
    let Some(api) = capabilities::probe(client, &engine.base_url, &spec).await.sleep else {
        engine.stop(Duration::from_secs(5)).await;
        store.release(replica).await;
        return Ok(None);
    };
    let call = |path: &'static str| {
        let url = format!("{}{path}", engine.base_url);
        async move { client.post(url).json(&serde_json::json!({})).send().await }
    };
    let mut wakes = Vec::new();
    for _ in 0..o.runs {
        call(api.sleep_path()).await.map_err(|e| ColdstartError::Chat(e.to_string()))?;
        let t = Instant::now();
        call(api.wake_path()).await.map_err(|e| ColdstartError::Chat(e.to_string()))?;
        first_token(client, &engine.base_url).await?;
        wakes.push(t.elapsed().as_secs_f64() * 1e3);
    }
    engine.stop(Duration::from_secs(5)).await;
    store.release(replica).await;
    Ok(Some(median(wakes.into_iter())))
}

/// A one-token chat request, answered.
async fn first_token(client: &reqwest::Client, base: &str) -> Result<(), ColdstartError> {
    let body = serde_json::json!({
        "model": BENCH_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hello"}],
    });
    let r = client
        .post(format!("{base}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .map_err(|e| ColdstartError::Chat(e.to_string()))?;
    if !r.status().is_success() {
        return Err(ColdstartError::Chat(format!("{}: {}", r.status(), r.text().await.unwrap_or_default())));
    }
    r.bytes().await.map_err(|e| ColdstartError::Chat(e.to_string()))?;
    Ok(())
}

/// A store with a daemon of its own on `root` (a socket named `name`).
async fn open_store(root: &Path, dir: &Path, name: &str) -> Result<Arc<WeightStore>, ColdstartError> {
    let settings = StoreSettings {
        root: Some(root.to_owned()),
        socket: Some(dir.join(format!("{name}.sock"))),
        ..StoreSettings::default()
    };
    let store = tokio::task::spawn_blocking(move || WeightStore::open(settings, std::iter::empty()))
        .await
        .expect("opening a store does not panic")?;
    Ok(Arc::new(store))
}

fn blob_path(root: &Path, id: &ArtifactId) -> PathBuf {
    root.join("artifacts").join(id.file_name()).join("data")
}

/// Drops a file's pages from the page cache, so the next read comes from
/// the disk (`POSIX_FADV_DONTNEED`: clean pages of this file only, no root).
fn drop_from_page_cache(path: &Path) -> Result<(), ColdstartError> {
    let file = std::fs::File::open(path).map_err(io_err(&path.display().to_string()))?;
    rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed)
        .map_err(|e| io_err(&path.display().to_string())(e.into()))
}

fn io_err(path: &str) -> impl Fn(std::io::Error) -> ColdstartError + '_ {
    move |source| ColdstartError::Io { path: path.to_owned(), source }
}

fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n => v[n / 2],
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "cold start, placement → first token ({} bytes of weights, median of {} runs)",
            self.bytes, self.runs
        )?;
        writeln!(
            f,
            "{:<34} {:>10} {:>10} {:>12} {:>10}  vs plain file",
            "start", "weights", "engine", "first token", "total"
        )?;
        let total = |k: StartKind| self.starts.iter().find(|r| r.kind == k).map(|r| r.total_ms);
        for r in &self.starts {
            let weights = r.weights_ms.map_or("-".to_owned(), |w| format!("{w:.0} ms"));
            let versus = match r.kind.baseline().and_then(total) {
                Some(base) => {
                    let verdict = if r.total_ms <= base { "ok" } else { "SLOWER" };
                    format!("{:>4.0}%  {verdict}", r.total_ms / base * 100.0)
                }
                None => String::new(),
            };
            writeln!(
                f,
                "{:<34} {:>10} {:>7.0} ms {:>9.0} ms {:>7.0} ms  {versus}",
                r.kind.label(),
                weights,
                r.engine_ms,
                r.first_token_ms,
                r.total_ms
            )?;
        }
        match self.warm_wake_ms {
            Some(ms) => {
                writeln!(f, "{:<34} {:>10} {:>10} {:>12} {:>7.0} ms", "WARM wake", "-", "-", "-", ms)?
            }
            None => writeln!(
                f,
                "{:<34} n/a: the engine has no sleep API (stopped, never kept WARM)",
                "WARM wake"
            )?,
        }
        writeln!(
            f,
            "weight read                         store   raw read of the same bytes   ratio  target"
        )?;
        for r in &self.reads {
            let ratio = r.store_bps / r.raw_bps;
            writeln!(
                f,
                "  {:<22} {:>10.2} GB/s {:>16.2} GB/s {:>11.0}%  ≥ 90% {}",
                r.cache,
                r.store_bps / 1e9,
                r.raw_bps / 1e9,
                ratio * 100.0,
                if ratio >= 0.9 { "ok" } else { "MISS" }
            )?;
        }
        Ok(())
    }
}
