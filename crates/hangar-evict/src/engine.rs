//! The evictor: activator, sweep, deleter and reporting wired together.
//!
//! [`Evictor::tick`] is one activator decision followed, when deletion is ON,
//! by one sweep and the deletion of its selection; [`Evictor::run`] repeats
//! ticks until asked to stop. While deletion is OFF the only work is one
//! `statvfs` per `LOGGER_INTERVAL_SECONDS`, so an idle evictor uses no CPU —
//! the Python one re-crawled the whole tree continuously.
//!
//! # Recency on `relatime` mounts
//!
//! A file's last use is `max(atime, mtime)`: a block rewritten recently is as
//! fresh as one read recently. On `strictatime` every read counts. On
//! `relatime` (the Linux default) only the first read after a write, or a
//! read a day after the previous atime, updates atime; a block read
//! constantly then looks up to 24 h old. The evictor therefore ranks by
//! "first use since written, refreshed at least daily" there — still oldest
//! first across days, coarse within one day. It logs a warning at start on
//! such mounts and recommends `strictatime` or `lazytime` for exact LRU. On
//! `noatime` only writes count.

use std::collections::HashSet;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::config::Config;
use crate::crawl::{self, DirHook, Shard, SweepInput};
use crate::delete::{Deleter, Removed};
use crate::fsops::{self, Opener, Root, RootError};
use crate::hysteresis::{Hysteresis, Mode};
use crate::select::{Candidate, Selection};
use crate::shutdown::Shutdown;
use crate::stats::Stats;
use crate::usage::{Usage, UsageSource};

/// Extra share of the volume a sweep selects beyond the exact overshoot, so
/// that rounding and metadata blocks do not force a second sweep.
const BUDGET_MARGIN: f64 = 0.01;
/// How far below the target a deletion may carry usage, as a share of the
/// volume: the files taken for deletion stop at what the sweep found above
/// the target plus this, and each batch holds at most this over the
/// threads' count of bytes — so with every thread's batch in flight when
/// the target is reached, usage lands within about this of it however
/// small the volume (a fixed 100 files a batch once took a small volume
/// from 91 % to 32 % for a 70 % target).
const LANDING_SLACK: f64 = 0.01;
/// Longest wait between sweeps that found nothing deletable.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// Why the evictor could not go on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EvictError {
    /// `statvfs` failed while running: the volume went away.
    #[error("cannot measure disk usage")]
    Usage(#[source] io::Error),
    /// `PVC_MOUNT_PATH` cannot be measured at start: wrong path or not mounted.
    #[error("cannot measure disk usage of PVC_MOUNT_PATH {}", path.display())]
    Mount {
        /// The configured mount path.
        path: PathBuf,
        /// Underlying error.
        #[source]
        source: io::Error,
    },
    /// The cache root, or a directory on the way to it, is a symbolic link.
    /// Symlinks are never followed, at any level, so the evictor refuses
    /// the root instead of deleting wherever the link points.
    #[error(
        "refusing cache root {}: {} is a symbolic link, and the evictor never follows symlinks; \
         set PVC_MOUNT_PATH and CACHE_DIRECTORY to the real directory",
        root.display(),
        component.display()
    )]
    Symlink {
        /// `PVC_MOUNT_PATH/CACHE_DIRECTORY` as configured.
        root: PathBuf,
        /// The configured path up to and including the symlink.
        component: PathBuf,
    },
    /// The cache root is on another filesystem than `PVC_MOUNT_PATH`, whose
    /// usage is measured: deleting there could never lower it.
    #[error(
        "refusing cache root {}: it is on another filesystem (device {root_dev}) than \
         PVC_MOUNT_PATH {} (device {mount_dev}), whose usage is measured; deleting there could never lower it",
        root.display(),
        mount.display()
    )]
    OtherFilesystem {
        /// `PVC_MOUNT_PATH/CACHE_DIRECTORY` as configured.
        root: PathBuf,
        /// `PVC_MOUNT_PATH`.
        mount: PathBuf,
        /// `major:minor` of the cache root's filesystem.
        root_dev: String,
        /// `major:minor` of the mount's filesystem.
        mount_dev: String,
    },
    /// A background service (signals, metrics, events) could not start.
    #[error("cannot start {what}")]
    Start {
        /// Which service.
        what: &'static str,
        /// Underlying error.
        #[source]
        source: io::Error,
    },
}

/// The files one sweep selected, least recently used first.
#[derive(Debug)]
pub struct Sweep {
    shards: Vec<Shard>,
    candidates: Vec<Candidate>,
    budget_bytes: u64,
    need_bytes: u64,
    /// The volume's size when swept.
    capacity_bytes: u64,
}

impl Sweep {
    /// Selected files.
    pub fn len(&self) -> usize {
        self.candidates.len()
    }

    /// Whether nothing was selected.
    pub fn is_empty(&self) -> bool {
        self.candidates.is_empty()
    }

    /// Bytes the sweep set out to free.
    pub fn budget_bytes(&self) -> u64 {
        self.budget_bytes
    }

    /// Selected files relative to the cache root, oldest first.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.candidates.iter().map(|c| self.shards[c.shard as usize].file_path(c)).collect()
    }

    /// The shards (model/rank directories) the sweep found.
    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }

    /// The oldest files whose sizes add up to what must be freed will all
    /// go whatever the order, so they are deleted in inode order: on ext4
    /// that keeps consecutive unlinks on the same inode-table and bitmap
    /// blocks and cut journal traffic (2.6x faster on a loop-mounted
    /// volume). The margin beyond the need stays oldest first, so stopping
    /// at the target still spares the most recently used.
    fn order_core_by_inode(&mut self) {
        let mut bytes = 0;
        let core = self
            .candidates
            .iter()
            .take_while(|c| {
                let before = bytes;
                bytes += c.bytes();
                before < self.need_bytes
            })
            .count();
        self.candidates[..core].sort_unstable_by_key(|c| c.ino);
    }
}

/// What one [`Evictor::tick`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Tick {
    /// Deletion is OFF.
    Idle {
        /// Usage percentage measured.
        usage_percent: f64,
    },
    /// Deletion is ON but no file is old enough to delete.
    NothingEligible,
    /// A sweep's selection was processed.
    Evicted(EvictReport),
}

/// Result of deleting one sweep's selection.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvictReport {
    /// Files deleted (reported, in a dry run).
    pub deleted: u64,
    /// Bytes freed.
    pub bytes: u64,
    /// Usage after the last batch.
    pub usage_percent: f64,
    /// Why it stopped.
    pub stopped: Stop,
}

/// Why deletion of a selection stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// Usage reached the target.
    TargetReached,
    /// Every selected file was processed.
    Exhausted,
    /// Shutdown was requested.
    Shutdown,
}

/// One evictor over one cache root.
pub struct Evictor {
    config: Config,
    usage: Box<dyn UsageSource>,
    stats: Arc<Stats>,
    shutdown: Shutdown,
    hysteresis: Hysteresis,
    opener: Arc<Opener>,
    hook: Option<DirHook>,
    events: Option<Box<dyn FnMut(Removed) + Send>>,
    dry: DryRunLedger,
}

/// In a dry run nothing is freed, so the evictor pretends: reported bytes
/// are subtracted from measured usage and reported blocks are never
/// reported again. The Python evictor re-queued the same files forever and
/// reported hundreds of thousands of "deletions" on a 10k-file tree.
#[derive(Debug, Default)]
struct DryRunLedger {
    reported: HashSet<u64>,
    bytes: u64,
}

impl Evictor {
    /// An evictor for `config`, measuring usage with `usage` (use
    /// [`crate::Statvfs`] on `PVC_MOUNT_PATH` in production).
    pub fn new(config: Config, usage: impl UsageSource + 'static) -> Evictor {
        let hysteresis = Hysteresis::new(config.cleanup_threshold, config.target_threshold);
        Evictor {
            config,
            usage: Box::new(usage),
            stats: Arc::default(),
            shutdown: Shutdown::new(),
            hysteresis,
            opener: Arc::default(),
            hook: None,
            events: None,
            dry: DryRunLedger::default(),
        }
    }

    /// Calls `hook` with each bucket directory a crawler starts on.
    pub fn with_dir_hook(mut self, hook: DirHook) -> Evictor {
        self.hook = Some(hook);
        self
    }

    /// Uses `shutdown` as the stop flag (e.g. one wired to signals).
    pub fn with_shutdown(mut self, shutdown: Shutdown) -> Evictor {
        self.shutdown = shutdown;
        self
    }

    /// Sends every removed block to `sink` (the events publisher).
    pub fn with_removed_sink(mut self, sink: impl FnMut(Removed) + Send + 'static) -> Evictor {
        self.events = Some(Box::new(sink));
        self
    }

    /// Live counters.
    pub fn stats(&self) -> Arc<Stats> {
        self.stats.clone()
    }

    /// The stop flag.
    pub fn shutdown_handle(&self) -> Shutdown {
        self.shutdown.clone()
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Measures usage (minus what a dry run pretends to have freed) and
    /// feeds the activator.
    pub fn check(&mut self) -> Result<(Usage, Mode), EvictError> {
        let usage = self.usage.usage().map_err(EvictError::Usage)?.minus(self.dry.bytes);
        let mode = self.hysteresis.observe(usage.percent());
        self.stats.set_usage(usage.percent());
        self.stats.deleting.store(mode == Mode::On, Relaxed);
        Ok((usage, mode))
    }

    /// Walks the tree once and selects the least recently used files whose
    /// sizes cover what `usage` is above the target.
    ///
    /// The cache root is opened afresh from `/`, never through a symlink;
    /// a symlinked root or one on another filesystem than `PVC_MOUNT_PATH`
    /// is an error ([`EvictError::Symlink`], [`EvictError::OtherFilesystem`]),
    /// a missing or unreadable one an empty sweep.
    pub fn sweep(&mut self, usage: Usage) -> Result<Sweep, EvictError> {
        let need = usage.bytes_above(self.config.target_threshold);
        let budget_bytes = need + (usage.capacity_bytes() as f64 * BUDGET_MARGIN) as u64;
        let selection =
            Selection::new(budget_bytes, self.config.file_queue_min_size, self.config.max_candidates);
        Stats::add(&self.stats.sweeps, 1);
        self.stats.discovered.store(0, Relaxed);
        self.stats.hot_skipped.store(0, Relaxed);
        let Some(root) = open_root(&self.config)? else {
            return Ok(Sweep {
                shards: Vec::new(),
                candidates: Vec::new(),
                budget_bytes,
                need_bytes: need,
                capacity_bytes: usage.capacity_bytes(),
            });
        };
        let input = SweepInput {
            config: &self.config,
            root_dev: root.dev,
            opener: &self.opener,
            stats: &self.stats,
            shutdown: &self.shutdown,
            hook: self.hook.as_ref(),
            exclude: self.config.dry_run.then_some(&self.dry.reported),
            now_ns: fsops::now_ns(),
        };
        let started = Instant::now();
        let (shards, selection) = crawl::sweep(&input, &root.fd, selection);
        let candidates = selection.into_oldest_first();
        self.stats.queued.store(candidates.len() as u64, Relaxed);
        tracing::debug!(
            shards = shards.len(),
            selected = candidates.len(),
            budget_bytes,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "sweep done"
        );
        Ok(Sweep {
            shards,
            candidates,
            budget_bytes,
            need_bytes: need,
            capacity_bytes: usage.capacity_bytes(),
        })
    }

    /// Deletes a sweep's selection oldest first, in batches of
    /// `DELETION_BATCH_SIZE`, re-measuring usage after every batch and
    /// stopping as soon as it reaches the target or a stop is requested.
    ///
    /// `NUM_CRAWLER_PROCESSES` threads take consecutive batches, so at most
    /// that many batches are in flight when the target is reached, and
    /// order is kept to within those batches. A batch is also bounded in
    /// bytes, and no batch is taken once those taken cover what was above
    /// the target by [`LANDING_SLACK`] of the volume: usage lands within
    /// about that of the target.
    pub fn evict(&mut self, mut sweep: Sweep) -> Result<EvictReport, EvictError> {
        sweep.order_core_by_inode();
        let hot_ns = self.config.access_time_threshold.as_nanos() as i64;
        let hot_cutoff_ns = fsops::now_ns().saturating_sub(hot_ns);
        let slack = (sweep.capacity_bytes as f64 * LANDING_SLACK) as u64;
        let batch_bytes = (slack / self.config.crawler_threads.max(1) as u64).max(1);
        let batches = batches(&sweep.candidates, self.config.deletion_batch_size, batch_bytes);
        let enough = sweep.need_bytes.saturating_add(slack);
        let taken = AtomicU64::new(0);
        let threads = self.config.crawler_threads.min(batches.len()).max(1);
        let next = AtomicUsize::new(0);
        let reached = AtomicBool::new(false);
        let deleted = AtomicU64::new(0);
        let freed = AtomicU64::new(0);
        let failure: Mutex<Option<io::Error>> = Mutex::new(None);
        let dry_bytes = AtomicU64::new(self.dry.bytes);
        let sink = Mutex::new(self.events.as_mut());
        let dry_reported = Mutex::new(&mut self.dry.reported);
        let started = Instant::now();
        let (config, shards, opener, stats, usage, shutdown) =
            (&self.config, &sweep.shards, &*self.opener, &*self.stats, &*self.usage, &self.shutdown);
        std::thread::scope(|scope| {
            for _ in 0..threads {
                scope.spawn(|| {
                    let mut deleter = Deleter::new(config, shards, opener, stats, hot_cutoff_ns);
                    let mut removed = Vec::new();
                    while !reached.load(Relaxed) && !shutdown.is_triggered() {
                        let Some(batch) = batches.get(next.fetch_add(1, Relaxed)) else {
                            break;
                        };
                        if taken.fetch_add(bytes_of(batch), Relaxed) >= enough {
                            break;
                        }
                        let out = deleter.batch(batch, &mut |r| removed.push(r));
                        stats.queued.fetch_sub(batch.len() as u64, Relaxed);
                        deleted.fetch_add(out.deleted, Relaxed);
                        freed.fetch_add(out.bytes, Relaxed);
                        if let Some(sink) = lock(&sink).as_mut() {
                            removed.drain(..).for_each(sink);
                        }
                        removed.clear();
                        if config.dry_run {
                            dry_bytes.fetch_add(out.bytes, Relaxed);
                            lock(&dry_reported).extend(
                                batch.iter().map(|c| shards[c.shard as usize].block_fingerprint(c.hash)),
                            );
                        }
                        match usage.usage() {
                            Ok(u) => {
                                let u = u.minus(dry_bytes.load(Relaxed));
                                stats.set_usage(u.percent());
                                if u.percent() <= config.target_threshold {
                                    reached.store(true, Relaxed);
                                }
                            }
                            Err(e) => {
                                *lock(&failure) = Some(e);
                                reached.store(true, Relaxed);
                            }
                        }
                        if let Some(rate) = config.max_files_per_second {
                            let due = Duration::from_secs_f64(deleted.load(Relaxed) as f64 / rate);
                            if let Some(wait) = due.checked_sub(started.elapsed()) {
                                shutdown.sleep(wait);
                            }
                        }
                    }
                });
            }
        });
        if let Some(e) = failure.into_inner().unwrap_or_else(|e| e.into_inner()) {
            return Err(EvictError::Usage(e));
        }
        self.dry.bytes = dry_bytes.into_inner();
        self.stats.queued.store(0, Relaxed);
        let (usage, mode) = self.check()?;
        let stopped = if mode == Mode::Off {
            Stop::TargetReached
        } else if self.shutdown.is_triggered() {
            Stop::Shutdown
        } else {
            Stop::Exhausted
        };
        Ok(EvictReport {
            deleted: deleted.into_inner(),
            bytes: freed.into_inner(),
            usage_percent: usage.percent(),
            stopped,
        })
    }

    /// One activator decision and, if deletion is ON, one sweep and its
    /// deletion.
    pub fn tick(&mut self) -> Result<Tick, EvictError> {
        let (usage, mode) = self.check()?;
        if mode == Mode::Off {
            return Ok(Tick::Idle { usage_percent: usage.percent() });
        }
        let sweep = self.sweep(usage)?;
        if sweep.is_empty() {
            return Ok(Tick::NothingEligible);
        }
        Ok(Tick::Evicted(self.evict(sweep)?))
    }

    /// Runs until the stop flag is set: ticks, an aggregated status line
    /// every `STATUS_INTERVAL_SECONDS`, back-off while nothing is eligible.
    /// Returns within about one batch of a stop request.
    pub fn run(mut self) -> Result<(), EvictError> {
        let reporter = self.spawn_reporter()?;
        let result = self.run_loop();
        self.shutdown.trigger();
        let _ = reporter.join();
        result
    }

    fn run_loop(&mut self) -> Result<(), EvictError> {
        let mut backoff = self.config.logger_interval;
        while !self.shutdown.is_triggered() {
            match self.tick()? {
                Tick::Idle { .. } => {
                    backoff = self.config.logger_interval;
                    self.shutdown.sleep(self.config.logger_interval);
                }
                Tick::NothingEligible => {
                    tracing::warn!(
                        retry_in_s = backoff.as_secs_f64(),
                        "usage above threshold but every block was used within FILE_ACCESS_TIME_THRESHOLD_MINUTES"
                    );
                    self.shutdown.sleep(backoff);
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
                Tick::Evicted(r) => {
                    backoff = self.config.logger_interval;
                    tracing::debug!(deleted = r.deleted, bytes = r.bytes, stopped = ?r.stopped, "selection processed");
                }
            }
        }
        Ok(())
    }

    fn spawn_reporter(&self) -> Result<std::thread::JoinHandle<()>, EvictError> {
        let stats = self.stats.clone();
        let shutdown = self.shutdown.clone();
        let interval = self.config.status_interval;
        let dry_run = self.config.dry_run;
        std::thread::Builder::new()
            .name("evict-status".into())
            .spawn(move || {
                let mut prev = stats.snapshot();
                let mut at = Instant::now();
                loop {
                    let stopping = shutdown.sleep(interval);
                    let now = stats.snapshot();
                    tracing::info!(target: "hangar_evict::status", "{}", now.status_line(&prev, at.elapsed(), dry_run));
                    if stopping {
                        break;
                    }
                    (prev, at) = (now, Instant::now());
                }
            })
            .map_err(|source| EvictError::Start {
                what: "status reporter",
                source,
            })
    }
}

/// Opens `PVC_MOUNT_PATH/CACHE_DIRECTORY` without following symlinks (see
/// [`fsops::open_root`]). A symlink on the way or another filesystem is an
/// error; a root that is missing or unreadable is logged and `None`: there
/// is nothing to evict until it appears.
pub(crate) fn open_root(config: &Config) -> Result<Option<Root>, EvictError> {
    let root = || config.cache_root();
    match fsops::open_root(&config.pvc_mount_path, &config.cache_directory) {
        Ok(r) => Ok(Some(r)),
        Err(RootError::Symlink { component }) => Err(EvictError::Symlink { root: root(), component }),
        Err(RootError::OtherFilesystem { mount, root_dev, mount_dev }) => {
            Err(EvictError::OtherFilesystem { root: root(), mount, root_dev, mount_dev })
        }
        Err(e) if e.is_missing() => {
            tracing::warn!(root = %root().display(), error = %e, "cache directory does not exist (yet); nothing to evict");
            Ok(None)
        }
        Err(e) => {
            tracing::warn!(root = %root().display(), error = %e, "cache directory unreadable; nothing to evict");
            Ok(None)
        }
    }
}

/// Allocated bytes of `files` (what `df` counts).
fn bytes_of(files: &[Candidate]) -> u64 {
    files.iter().map(Candidate::bytes).sum()
}

/// `candidates` cut, in order, into batches of at most `count` files and
/// at most `max_bytes` (one file at least each).
fn batches(candidates: &[Candidate], count: usize, max_bytes: u64) -> Vec<&[Candidate]> {
    let mut out = Vec::new();
    let mut rest = candidates;
    while !rest.is_empty() {
        let mut bytes = 0u64;
        let len = rest
            .iter()
            .take(count.max(1))
            .take_while(|c| {
                bytes += c.bytes();
                bytes <= max_bytes
            })
            .count()
            .max(1);
        let (batch, tail) = rest.split_at(len);
        out.push(batch);
        rest = tail;
    }
    out
}

/// Locks a mutex, ignoring poisoning: the data are counters and sinks that
/// stay usable after a panicking holder.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
