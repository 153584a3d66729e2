//! `hangar bench store`: the store against the physical reference, measured
//! in the same run on the same bytes.
//!
//! 1. Import throughput vs a plain sequential `read` of the same files.
//! 2. Cold `Materialize` (+ `Confirm`) from the local blob store vs a plain
//!    `read` of the blob's bytes into freshly allocated memory.
//! 3. Lease-in-place `Materialize` latency of a resident artifact (p50/p99).
//! 4. P2P between two daemons on loopback vs a plain TCP copy of the same
//!    bytes into freshly allocated memory.
//!
//! Import and local Materialize are measured twice, both sides from the same
//! page-cache state each time: *warm* (the files are in the page cache) and
//! *cold* (the page cache is dropped before every run of either side, which
//! needs root; otherwise those rows are skipped with a note). P2P runs warm.
//!
//! Context rows without a target explain the import figure: a plain copy of
//! the files, and BLAKE3 of the files on all cores with nothing written —
//! the ceiling of any import that hashes what it stores.
//!
//! Files are generated once under the working directory and reused; every
//! figure is the best of a few runs, store and reference alternating, to
//! damp noise from a shared machine.

use std::fmt;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::client::{Hold, StoreClient};
use crate::daemon::{DaemonConfig, DaemonHandle};
use crate::error::{io_err, StoreError};
use crate::id::ArtifactId;
use crate::protocol::{Selection, Source};
use crate::registry::RegistryHandle;
use crate::synth;
use crate::BlobStore;

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Working directory.
    pub dir: PathBuf,
    /// Artifact size in bytes.
    pub size: u64,
    /// Lease-in-place calls to time.
    pub lip_calls: std::num::NonZeroUsize,
    /// Also measure from a cold page cache (drops the whole machine's page
    /// cache before every run; needs root).
    pub cold: bool,
}

/// One throughput comparison.
#[derive(Debug, Clone)]
pub struct Ratio {
    /// What was measured.
    pub name: &'static str,
    /// The store's throughput, bytes/s.
    pub store: f64,
    /// The physical reference's throughput, bytes/s.
    pub reference: f64,
    /// What the reference is.
    pub reference_name: &'static str,
    /// Target ratio.
    pub target: f64,
}

/// The bench's figures.
#[derive(Debug, Clone)]
pub struct BenchReport {
    /// Bytes of the artifact.
    pub bytes: u64,
    /// Import, cold materialize and P2P ratios.
    pub ratios: Vec<Ratio>,
    /// Extra comparisons that explain a ratio (no target).
    pub context: Vec<Ratio>,
    /// Measurements that could not be made, and why.
    pub notes: Vec<String>,
    /// Lease-in-place latency p50.
    pub lip_p50: Duration,
    /// Lease-in-place latency p99.
    pub lip_p99: Duration,
    /// Lease-in-place calls timed.
    pub lip_calls: usize,
    /// Share of CPU time the hypervisor gave to other guests while the
    /// lease-in-place calls ran (`None` where the kernel does not report it).
    pub lip_steal: Option<f64>,
}

const RUNS: usize = 4;

fn gbs(x: f64) -> String {
    format!("{:.2} GB/s", x / 1e9)
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "hangar bench store: {:.2} GiB artifact, best of {RUNS} runs",
            self.bytes as f64 / (1u64 << 30) as f64
        )?;
        writeln!(
            f,
            "{:<30} {:>12} {:>12}  {:<34} {:>7} {:>8}",
            "measure", "store", "reference", "reference is", "ratio", "target"
        )?;
        for r in &self.ratios {
            let ratio = r.store / r.reference;
            let ok = if ratio >= r.target { "ok" } else { "MISS" };
            writeln!(
                f,
                "{:<30} {:>12} {:>12}  {:<34} {:>6.0}% {:>6.0}% {ok}",
                r.name,
                gbs(r.store),
                gbs(r.reference),
                r.reference_name,
                ratio * 100.0,
                r.target * 100.0
            )?;
        }
        for r in &self.context {
            writeln!(
                f,
                "{:<30} {:>12} {:>12}  {:<34} {:>6.0}%   (context)",
                r.name,
                gbs(r.store),
                gbs(r.reference),
                r.reference_name,
                r.store / r.reference * 100.0
            )?;
        }
        let ok = if self.lip_p99 <= Duration::from_millis(1) { "ok" } else { "MISS" };
        write!(
            f,
            "{:<30} p50 {:?}  p99 {:?} over {} calls (target p99 <= 1ms) {ok}",
            "lease-in-place Materialize", self.lip_p50, self.lip_p99, self.lip_calls
        )?;
        match self.lip_steal {
            Some(steal) => writeln!(f, "  [host steal meanwhile: {:.0}% of CPU time]", steal * 100.0)?,
            None => writeln!(f)?,
        }
        for n in &self.notes {
            writeln!(f, "{n}")?;
        }
        Ok(())
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64().max(1e-9)
}

/// Generates (once) the model files: 4 files, 8 layers per GiB.
fn model_files(dir: &Path, size: u64) -> Result<Vec<PathBuf>, StoreError> {
    let src = dir.join(format!("src-{size}"));
    let done = src.join(".complete");
    if !done.exists() {
        let _ = std::fs::remove_dir_all(&src);
        tracing::info!(bytes = size, dir = %src.display(), "generating the benchmark model");
        let layers = ((size >> 30).max(1) * 8) as usize;
        let tensors = synth::model(size, layers, 42);
        synth::write_files(&src, &tensors, 4)?;
        File::create(&done).map_err(io_err(&done))?;
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(&src)
        .map_err(io_err(&src))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    Ok(files)
}

/// Plain sequential read of `files` (8 MiB buffer); returns bytes/s.
fn plain_read(files: &[PathBuf]) -> Result<f64, StoreError> {
    let mut buf = vec![0u8; 8 << 20];
    let t = Instant::now();
    let mut total = 0u64;
    for p in files {
        let mut f = File::open(p).map_err(io_err(p))?;
        loop {
            let n = f.read(&mut buf).map_err(io_err(p))?;
            if n == 0 {
                break;
            }
            total += n as u64;
        }
    }
    Ok(total as f64 / secs(t.elapsed()))
}

/// BLAKE3 of every chunk of `files` on all cores, read through maps and
/// written nowhere: the least an import must do, so its ceiling; bytes/s.
fn plain_hash(files: &[PathBuf]) -> Result<f64, StoreError> {
    let t = Instant::now();
    let mut total = 0u64;
    for p in files {
        let f = File::open(p).map_err(io_err(p))?;
        // SAFETY: read-only map of a generated file nobody modifies.
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(io_err(p))?;
        std::hint::black_box(crate::chunks::hash_chunks(&map));
        total += map.len() as u64;
    }
    Ok(total as f64 / secs(t.elapsed()))
}

/// Plain copy of `files` into new files under `dir` through maps (what an
/// import must at least do: read every byte and write it once); bytes/s.
fn plain_copy(files: &[PathBuf], dir: &Path) -> Result<f64, StoreError> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let t = Instant::now();
    let mut total = 0u64;
    for (i, p) in files.iter().enumerate() {
        let src = File::open(p).map_err(io_err(p))?;
        // SAFETY: read-only map of a generated file nobody modifies.
        let src = unsafe { memmap2::Mmap::map(&src) }.map_err(io_err(p))?;
        let out = dir.join(i.to_string());
        let dst = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&out)
            .map_err(io_err(&out))?;
        dst.set_len(src.len() as u64).map_err(io_err(&out))?;
        // SAFETY: a fresh file of ours.
        let mut map = unsafe { memmap2::MmapMut::map_mut(&dst) }.map_err(io_err(&out))?;
        map.copy_from_slice(&src);
        total += src.len() as u64;
    }
    let rate = total as f64 / secs(t.elapsed());
    let _ = std::fs::remove_dir_all(dir);
    Ok(rate)
}

/// Plain read of one file into freshly allocated memory; returns bytes/s.
/// The reference a load of the store is held to (here and in `hangar
/// bench coldstart`).
pub fn plain_read_into_memory(path: &Path) -> Result<f64, StoreError> {
    let t = Instant::now();
    let mut f = File::open(path).map_err(io_err(path))?;
    let len = f.metadata().map_err(io_err(path))?.len() as usize;
    let mut mem = vec![0u8; len];
    f.read_exact(&mut mem).map_err(io_err(path))?;
    let rate = len as f64 / secs(t.elapsed());
    std::hint::black_box(&mem);
    Ok(rate)
}

/// Plain TCP copy over loopback of `path` into freshly allocated memory; bytes/s.
fn plain_tcp_copy(path: &Path) -> Result<f64, StoreError> {
    let io = |e: std::io::Error| StoreError::Io { path: "loopback tcp".into(), source: e };
    let listener = TcpListener::bind("127.0.0.1:0").map_err(io)?;
    let addr = listener.local_addr().map_err(io)?;
    let file = File::open(path).map_err(io_err(path))?;
    // SAFETY: read-only map of a blob, never modified in place.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err(path))?;
    let len = map.len();
    let t = Instant::now();
    let sender = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        for chunk in map.chunks(1 << 20) {
            s.write_all(chunk)?;
        }
        Ok(())
    });
    let mut s = TcpStream::connect(addr).map_err(io)?;
    let mut mem = vec![0u8; len];
    s.read_exact(&mut mem).map_err(io)?;
    let rate = len as f64 / secs(t.elapsed());
    sender.join().expect("sender thread").map_err(io)?;
    std::hint::black_box(&mem);
    Ok(rate)
}

/// The page-cache state both sides of a comparison start from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cache {
    /// Files already in the page cache (the previous run read them).
    Warm,
    /// Page cache dropped before every run of either side: files come from disk.
    Cold,
}

/// Writes back dirty pages and drops the clean page cache, so the next
/// measurement reads from disk. `Ok(false)` if not permitted (needs root).
fn drop_caches() -> Result<bool, StoreError> {
    rustix::fs::sync();
    let path = Path::new("/proc/sys/vm/drop_caches");
    match std::fs::write(path, b"3") {
        Ok(()) => Ok(true),
        Err(e) if matches!(e.kind(), std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::NotFound) => {
            Ok(false)
        }
        Err(e) => Err(io_err(path)(e)),
    }
}

/// The best of [`RUNS`] runs of a context measurement.
fn best_of_runs(mut run: impl FnMut() -> Result<f64, StoreError>) -> Result<f64, StoreError> {
    (0..RUNS).try_fold(0f64, |top, _| Ok(top.max(run()?)))
}

/// CPU time the hypervisor ran other guests on this VM's vCPUs (`steal` in
/// `/proc/stat`), in seconds summed over CPUs; `None` where not reported.
fn steal_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: u64 = stat.lines().next()?.split_whitespace().nth(8)?.parse().ok()?;
    Some(ticks as f64 / rustix::param::clock_ticks_per_second() as f64)
}

/// Runs the reference and the store alternately [`RUNS`] times and keeps
/// the best of each, so both see the same background load on a shared
/// machine, each run starting from the same page-cache state `cache`.
/// `None` when a cold cache was asked for and caches cannot be dropped.
fn paired(
    cache: Cache,
    mut reference: impl FnMut() -> Result<f64, StoreError>,
    mut store: impl FnMut() -> Result<f64, StoreError>,
) -> Result<Option<(f64, f64)>, StoreError> {
    let settle = || match cache {
        Cache::Warm => Ok(true),
        Cache::Cold => drop_caches(),
    };
    let (mut r, mut s) = (0f64, 0f64);
    for _ in 0..RUNS {
        if !settle()? {
            return Ok(None);
        }
        r = r.max(reference()?);
        if !settle()? {
            return Ok(None);
        }
        s = s.max(store()?);
    }
    Ok(Some((r, s)))
}

/// Runs one comparison from a warm and then from a cold page cache (see
/// [`paired`]), `rows` naming each (what, reference), and records each
/// ratio, or a note saying why it was skipped.
fn warm_and_cold(
    cfg: &BenchConfig,
    rows: [(&'static str, &'static str); 2],
    target: f64,
    mut reference: impl FnMut() -> Result<f64, StoreError>,
    mut store: impl FnMut() -> Result<f64, StoreError>,
    (ratios, notes): (&mut Vec<Ratio>, &mut Vec<String>),
) -> Result<(), StoreError> {
    for (cache, (name, reference_name)) in [Cache::Warm, Cache::Cold].into_iter().zip(rows) {
        if cache == Cache::Cold && !cfg.cold {
            notes.push(format!("{name}: skipped (--warm-only)"));
            continue;
        }
        match paired(cache, &mut reference, &mut store)? {
            Some((reference, store)) => ratios.push(Ratio { name, store, reference, reference_name, target }),
            None => notes.push(format!("{name}: skipped (dropping the page cache needs root)")),
        }
    }
    Ok(())
}

fn daemon(root: &Path, size: u64, tweak: impl FnOnce(&mut DaemonConfig)) -> Result<DaemonHandle, StoreError> {
    let mut cfg = DaemonConfig::new(root, root.join("store.sock"));
    cfg.budget = size * 2 + (64 << 20);
    tweak(&mut cfg);
    DaemonHandle::start(cfg)
}

fn client_err(e: crate::client::ClientError) -> StoreError {
    StoreError::Source { source_name: "bench client".into(), reason: e.to_string() }
}

/// Materialize + Confirm on a fresh daemon connection; returns bytes/s and the source.
fn timed_materialize(socket: &Path, id: ArtifactId) -> Result<(f64, Source), StoreError> {
    let mut c = StoreClient::connect(socket).map_err(client_err)?;
    let sel = Selection { artifact_id: id, view: None, key: None };
    let t = Instant::now();
    let m = c.materialize(&sel, Hold::Process).map_err(client_err)?;
    let done = c.confirm(&m, Duration::from_secs(30)).map_err(client_err)?;
    let rate = m.index.data_len as f64 / secs(t.elapsed());
    c.unload(&m).map_err(client_err)?;
    Ok((rate, done.source))
}

/// Runs the benchmark.
pub fn run(cfg: &BenchConfig) -> Result<BenchReport, StoreError> {
    std::fs::create_dir_all(&cfg.dir).map_err(io_err(&cfg.dir))?;
    let files = model_files(&cfg.dir, cfg.size)?;
    let (root_a, root_b) = (cfg.dir.join("root-a"), cfg.dir.join("root-b"));
    let mut ratios = Vec::new();
    let mut notes = Vec::new();

    // 1. Import vs plain sequential read, from the page cache and from disk.
    let mut id = None;
    let mut import_once = || {
        let _ = std::fs::remove_dir_all(&root_a);
        let store = BlobStore::open(&root_a)?;
        let t = Instant::now();
        let r = store.import_files(&files, &[])?;
        let total: u64 = files.iter().filter_map(|p| p.metadata().ok()).map(|m| m.len()).sum();
        id = Some(r.id);
        Ok(total as f64 / secs(t.elapsed()))
    };
    warm_and_cold(
        cfg,
        [
            ("import, warm cache", "sequential read, page cache"),
            ("import, cold cache", "sequential read, from disk"),
        ],
        0.70,
        || plain_read(&files),
        &mut import_once,
        (&mut ratios, &mut notes),
    )?;
    let id = id.expect("imported");
    let copy_dir = cfg.dir.join("plain-copy");
    let copy = best_of_runs(|| plain_copy(&files, &copy_dir))?;
    let hash = best_of_runs(|| plain_hash(&files))?;
    let (import_warm, read_warm) = ratios.first().map_or((0.0, 0.0), |r| (r.store, r.reference));
    let context = vec![
        Ratio {
            name: "import, warm cache",
            store: import_warm,
            reference: copy,
            reference_name: "plain copy of the files (read+write)",
            target: 0.0,
        },
        Ratio {
            name: "import, warm cache",
            store: import_warm,
            reference: hash,
            reference_name: "BLAKE3 of the files, all cores",
            target: 0.0,
        },
        Ratio {
            name: "BLAKE3 only (import ceiling)",
            store: hash,
            reference: read_warm,
            reference_name: "sequential read, page cache",
            target: 0.0,
        },
    ];

    // 2. Cold Materialize vs plain read into memory, blob in the page cache and on disk.
    let blob = root_a.join("artifacts").join(id.file_name()).join("data");
    let materialize_once = || {
        let d = daemon(&root_a, cfg.size, |_| {})?;
        let (rate, source) = timed_materialize(d.socket(), id)?;
        if source != Source::Local {
            return Err(StoreError::Source {
                source_name: "bench".into(),
                reason: format!("cold load came from {source:?}"),
            });
        }
        Ok(rate)
    };
    warm_and_cold(
        cfg,
        [
            ("Materialize, blob cached", "read of the blob into new memory"),
            ("Materialize, blob on disk", "read of the blob into new memory"),
        ],
        0.90,
        || plain_read_into_memory(&blob),
        materialize_once,
        (&mut ratios, &mut notes),
    )?;

    // 3. Lease-in-place latency.
    let (lip_p50, lip_p99, lip_steal) = {
        let d = daemon(&root_a, cfg.size, |_| {})?;
        let mut holder = StoreClient::connect(d.socket()).map_err(client_err)?;
        let sel = Selection { artifact_id: id, view: None, key: None };
        let held = holder.materialize(&sel, Hold::Process).map_err(client_err)?;
        holder.confirm(&held, Duration::from_secs(30)).map_err(client_err)?;
        let mut c = StoreClient::connect(d.socket()).map_err(client_err)?;
        let mut lat = Vec::with_capacity(cfg.lip_calls.get());
        let (steal_before, started) = (steal_seconds(), Instant::now());
        for _ in 0..cfg.lip_calls.get() {
            let t = Instant::now();
            let m = c.materialize(&sel, Hold::Process).map_err(client_err)?;
            lat.push(t.elapsed());
            if !m.reused {
                return Err(StoreError::Source {
                    source_name: "bench".into(),
                    reason: "lease-in-place missed".into(),
                });
            }
            c.unload(&m).map_err(client_err)?;
        }
        let cpu_seconds = secs(started.elapsed()) * crate::chunks::parallelism() as f64;
        let steal = steal_before.zip(steal_seconds()).map(|(a, b)| (b - a) / cpu_seconds);
        lat.sort();
        let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
        (pct(0.50), pct(0.99), steal)
    };

    // 4. P2P vs plain TCP copy.
    let registry = RegistryHandle::start("127.0.0.1:0".parse().expect("addr"), 10_000)
        .map_err(|e| StoreError::Io { path: "registry".into(), source: e })?;
    let peer_cfg = |c: &mut DaemonConfig| {
        c.listen = Some("127.0.0.1:0".parse().expect("addr"));
        c.registry = Some(registry.url());
        c.heartbeat = Duration::from_millis(100);
    };
    let _a = daemon(&root_a, cfg.size, |c| {
        peer_cfg(c);
        c.node = "bench-a".into();
    })?;
    std::thread::sleep(Duration::from_millis(300)); // first heartbeat
                                                    // Each run's second daemon listens on a port of its own, so it takes a
                                                    // name of its own too: the registry keeps a name for its last holder's
                                                    // address until the holder has been silent for the TTL.
    let runs = std::cell::Cell::new(0u32);
    let (reference, p2p) = paired(
        Cache::Warm,
        || plain_tcp_copy(&blob),
        || {
            let _ = std::fs::remove_dir_all(&root_b);
            runs.set(runs.get() + 1);
            let b = daemon(&root_b, cfg.size, |c| {
                peer_cfg(c);
                c.node = format!("bench-b{}", runs.get());
            })?;
            let (rate, source) = timed_materialize(b.socket(), id)?;
            if source != Source::Peer {
                return Err(StoreError::Source {
                    source_name: "bench".into(),
                    reason: format!("P2P came from {source:?}"),
                });
            }
            // Let the background persist finish before the next run deletes the root.
            let store_b = BlobStore::open(&root_b)?;
            let t = Instant::now();
            while !store_b.contains(&id) && t.elapsed() < Duration::from_secs(60) {
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(rate)
        },
    )?
    .expect("a warm cache needs no dropping");
    ratios.push(Ratio {
        name: "P2P Materialize (loopback)",
        store: p2p,
        reference,
        reference_name: "plain TCP copy into new memory",
        target: 0.80,
    });
    Ok(BenchReport {
        bytes: cfg.size,
        ratios,
        context,
        notes,
        lip_p50,
        lip_p99,
        lip_calls: cfg.lip_calls.get(),
        lip_steal,
    })
}
