//! The evictor: activator, sweeps, deleter and reporting wired together.
//!
//! The [`Activator`] decides, sans-IO; this driver carries its steps out:
//! it measures usage, runs the sweeps that fill the deletion queue, deletes
//! from the queue, and reports each outcome back. [`Evictor::tick`] is one
//! decision carried out in the foreground; [`Evictor::run`] is the daemon
//! loop, which runs a pre-fill in a background thread while it goes on
//! checking usage, so that a crossing is acted on at the next check.
//!
//! While deletion is OFF the work is one `statvfs` per
//! `LOGGER_INTERVAL_SECONDS` and, with pre-fill, a sweep at start, one per
//! `PREFILL_INTERVAL_SECONDS` and one after a deletion that left the queue
//! thin — the Python evictor re-crawled the whole tree every second.
//!
//! # Memory
//!
//! The deletion queue and the selection of a sweep in progress together
//! hold at most `MAX_CANDIDATES` candidates of 40 bytes: a pre-fill builds
//! the next queue beside the current one, which gives up its most recently
//! used files as the new selection grows. If usage crosses meanwhile, the
//! pre-fill is abandoned and deletion starts from what the queue still
//! holds — its oldest files.
//!
//! # Never outside the tree
//!
//! Queued files are located by shard handles opened during their sweep.
//! Before deleting from a queue, every shard is opened again from `/`
//! without following a symlink and compared with the handle it holds
//! (device and inode); files of a shard renamed or replaced since are not
//! deleted (counted as vanished).
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
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hangar_core::Millis;

use crate::activator::{Activator, ActivatorConfig, QueueInfo, Step, SweepEnd, BUDGET_MARGIN};
use crate::config::Config;
use crate::crawl::{self, DirHook, Shard, SweepInput};
use crate::delete::{Deleter, Removed};
use crate::fsops::{self, Opener, Root, RootError};
use crate::hysteresis::Mode;
use crate::select::{Candidate, Selection};
use crate::shutdown::Shutdown;
use crate::stats::Stats;
use crate::usage::{Usage, UsageSource};

/// How far below the target a deletion may carry usage, as a share of the
/// volume: the files taken for deletion stop at what was above the target
/// when it started plus this, and each batch holds at most this over the
/// threads' count of bytes — so with every thread's batch in flight when
/// the target is reached, usage lands within about this of it however
/// small the volume (a fixed 100 files a batch once took a small volume
/// from 91 % to 32 % for a 70 % target).
const LANDING_SLACK: f64 = 0.01;
/// First wait after a sweep that found nothing deletable.
const MIN_BACKOFF: Duration = Duration::from_millis(500);
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

/// The files one sweep selected, least recently used first: the deletion
/// queue, with the open shard directories that locate them.
#[derive(Debug)]
pub struct Sweep {
    shards: Vec<Shard>,
    candidates: Vec<Candidate>,
    budget_bytes: u64,
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

    /// Bytes the sweep set out to select.
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

    fn info(&self) -> QueueInfo {
        QueueInfo { files: self.candidates.len(), bytes: bytes_of(&self.candidates) }
    }

    /// The oldest files whose sizes add up to `need_bytes` will all go
    /// whatever the order, so they are deleted in inode order: on ext4 that
    /// keeps consecutive unlinks on the same inode-table and bitmap blocks
    /// and cuts journal traffic (2.6x faster on a loop-mounted volume). The
    /// files beyond stay oldest first, so stopping at the target still
    /// spares the most recently used.
    fn order_core_by_inode(&mut self, need_bytes: u64) {
        let mut bytes = 0;
        let core = self
            .candidates
            .iter()
            .take_while(|c| {
                let before = bytes;
                bytes += c.bytes();
                before < need_bytes
            })
            .count();
        self.candidates[..core].sort_unstable_by_key(|c| c.ino);
    }
}

/// What one [`Evictor::tick`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Tick {
    /// Deletion is OFF and nothing was due.
    Idle {
        /// Usage percentage measured.
        usage_percent: f64,
    },
    /// Deletion is OFF: a pre-fill sweep filled the deletion queue.
    Prefilled(QueueInfo),
    /// Deletion is ON but no file is old enough to delete.
    NothingEligible,
    /// Files were deleted from the queue.
    Evicted(EvictReport),
}

/// Result of deleting from the queue once.
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
    /// Whether the tree was swept between the decision to delete and the
    /// first deletion; `false` when the queue was filled beforehand.
    pub swept: bool,
}

/// Why deletion from the queue stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// Usage reached the target.
    TargetReached,
    /// Every queued file was processed.
    Exhausted,
    /// The files taken cover what was above the target when deletion
    /// started, yet usage is not down to it (some were spared or had
    /// vanished, or others wrote meanwhile); the rest stays queued.
    Covered,
    /// Shutdown was requested.
    Shutdown,
}

/// One evictor over one cache root.
pub struct Evictor {
    config: Config,
    usage: Box<dyn UsageSource>,
    stats: Arc<Stats>,
    shutdown: Shutdown,
    activator: Activator,
    /// Origin of the activator's clock.
    epoch: Instant,
    /// The deletion queue.
    queue: Option<Sweep>,
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

/// What a sweep borrows from the evictor: everything but the activator,
/// the usage source and the queue, so that a pre-fill can run beside the
/// usage checks.
struct Crawl<'a> {
    config: &'a Config,
    opener: &'a Opener,
    stats: &'a Stats,
    shutdown: &'a Shutdown,
    hook: Option<&'a DirHook>,
    exclude: Option<&'a HashSet<u64>>,
}

impl Crawl<'_> {
    /// Walks the tree once and selects the oldest files covering
    /// `budget_bytes`. `queue`, the deletion queue held meanwhile, gives up
    /// its most recently used files as the selection grows, so that the two
    /// never hold more than `MAX_CANDIDATES` together. `None` when `cancel`
    /// was set: an unfinished walk does not know the oldest files.
    ///
    /// The cache root is opened afresh from `/`, never through a symlink; a
    /// symlinked root or one on another filesystem than `PVC_MOUNT_PATH` is
    /// an error, a missing or unreadable one an empty sweep.
    fn sweep(
        &self,
        budget_bytes: u64,
        queue: &Mutex<Option<Sweep>>,
        cancel: Option<&AtomicBool>,
    ) -> Result<Option<Sweep>, EvictError> {
        let config = self.config;
        let selection = Selection::new(budget_bytes, config.file_queue_min_size, config.max_candidates);
        Stats::add(&self.stats.sweeps, 1);
        self.stats.discovered.store(0, Relaxed);
        self.stats.hot_skipped.store(0, Relaxed);
        let Some(root) = open_root(config)? else {
            return Ok(Some(Sweep { shards: Vec::new(), candidates: Vec::new(), budget_bytes }));
        };
        let on_selected = |len: usize| {
            if let Some(q) = lock(queue).as_mut() {
                let keep = config.max_candidates.saturating_sub(len);
                if q.candidates.len() > keep {
                    q.candidates.truncate(keep); // the newest go: what is left is still the oldest
                    if q.candidates.len() <= q.candidates.capacity() / 2 {
                        q.candidates.shrink_to_fit();
                    }
                    self.stats.queued.store(q.candidates.len() as u64, Relaxed);
                }
            }
        };
        let input = SweepInput {
            config,
            root_dev: root.dev,
            opener: self.opener,
            stats: self.stats,
            shutdown: self.shutdown,
            hook: self.hook,
            exclude: self.exclude,
            now_ns: fsops::now_ns(),
            cancel,
            on_selected: Some(&on_selected),
        };
        let started = Instant::now();
        let (shards, selection) = crawl::sweep(&input, &root.fd, selection);
        self.stats.selected.store(0, Relaxed);
        if cancel.is_some_and(|c| c.load(Relaxed)) {
            tracing::debug!(elapsed_ms = started.elapsed().as_millis() as u64, "sweep cancelled");
            return Ok(None);
        }
        let mut candidates = selection.into_oldest_first();
        candidates.shrink_to_fit();
        tracing::debug!(
            shards = shards.len(),
            selected = candidates.len(),
            budget_bytes,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "sweep done"
        );
        Ok(Some(Sweep { shards, candidates, budget_bytes }))
    }
}

impl Evictor {
    /// An evictor for `config`, measuring usage with `usage` (use
    /// [`crate::Statvfs`] on `PVC_MOUNT_PATH` in production).
    pub fn new(config: Config, usage: impl UsageSource + 'static) -> Evictor {
        let activator = Activator::new(ActivatorConfig::from_config(&config));
        Evictor {
            config,
            usage: Box::new(usage),
            stats: Arc::default(),
            shutdown: Shutdown::new(),
            activator,
            epoch: Instant::now(),
            queue: None,
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

    /// The activator, as the driver last fed it.
    pub fn activator(&self) -> &Activator {
        &self.activator
    }

    /// What the deletion queue holds.
    pub fn queue(&self) -> QueueInfo {
        self.queue.as_ref().map(Sweep::info).unwrap_or_default()
    }

    /// Files in the deletion queue relative to the cache root, oldest first.
    pub fn queued_paths(&self) -> Vec<PathBuf> {
        self.queue.as_ref().map(Sweep::paths).unwrap_or_default()
    }

    /// Measures usage (minus what a dry run pretends to have freed) and
    /// feeds the activator.
    pub fn check(&mut self) -> Result<(Usage, Mode), EvictError> {
        observe(&*self.usage, self.dry.bytes, &mut self.activator, &self.stats, now_ms(self.epoch))
    }

    /// Walks the tree once and selects the least recently used files whose
    /// sizes cover what `usage` is above the target; [`Evictor::evict`]
    /// deletes the result. The deletion queue stays, shortened if need be
    /// to keep both within `MAX_CANDIDATES`.
    ///
    /// The cache root is opened afresh from `/`, never through a symlink;
    /// a symlinked root or one on another filesystem than `PVC_MOUNT_PATH`
    /// is an error ([`EvictError::Symlink`], [`EvictError::OtherFilesystem`]),
    /// a missing or unreadable one an empty sweep.
    pub fn sweep(&mut self, usage: Usage) -> Result<Sweep, EvictError> {
        let margin = (usage.capacity_bytes() as f64 * BUDGET_MARGIN) as u64;
        let budget = usage.bytes_above(self.config.target_threshold) + margin;
        let held = Mutex::new(self.queue.take());
        let swept = self.crawl().sweep(budget, &held, None);
        self.queue = held.into_inner().unwrap_or_else(|e| e.into_inner());
        Ok(swept?.expect("a sweep without a cancel flag is never cancelled"))
    }

    /// Fills the deletion queue now, whatever the activator would decide:
    /// a sweep for everything that could have to go (see
    /// [`Activator::budget`]), built beside the current queue, which it
    /// then replaces.
    pub fn prefill(&mut self) -> Result<QueueInfo, EvictError> {
        let (usage, _) = self.check()?;
        let budget = self.activator.budget(usage);
        self.fill_queue(budget, true)
    }

    /// Makes `sweep` the deletion queue (dropping the one held) and deletes
    /// from it; see [`Evictor::tick`] for how deletion proceeds.
    pub fn evict(&mut self, sweep: Sweep) -> Result<EvictReport, EvictError> {
        self.queue = Some(sweep);
        self.evict_queue()
    }

    /// One activator decision, carried out in the foreground: nothing, a
    /// pre-fill, or (deletion ON) deletion from the queue, preceded by a
    /// sweep when the queue is empty.
    ///
    /// Deletion takes the queue oldest first, in batches of
    /// `DELETION_BATCH_SIZE`, re-measuring usage after every batch and
    /// stopping as soon as it reaches the target or a stop is requested.
    /// `NUM_CRAWLER_PROCESSES` threads take consecutive batches, so at most
    /// that many batches are in flight when the target is reached. A batch
    /// is also bounded in bytes, and no batch is taken once those taken
    /// cover what was above the target by [`LANDING_SLACK`] of the volume:
    /// usage lands within about that of the target. Each file is checked
    /// again with `fstatat` just before its `unlinkat` and spared if used
    /// since it was queued. What was not taken stays queued, oldest first.
    pub fn tick(&mut self) -> Result<Tick, EvictError> {
        let (usage, mode) = self.check()?;
        let idle = |mode| match mode {
            Mode::On => Tick::NothingEligible,
            Mode::Off => Tick::Idle { usage_percent: usage.percent() },
        };
        match self.activator.poll_step(now_ms(self.epoch)) {
            Step::Wait | Step::CancelPrefill => Ok(idle(mode)),
            Step::DropQueue => {
                self.drop_queue();
                Ok(idle(mode))
            }
            Step::Prefill { budget_bytes } => Ok(Tick::Prefilled(self.fill_queue(budget_bytes, true)?)),
            Step::Evict => Ok(Tick::Evicted(self.evict_queue()?)),
            Step::Sweep { budget_bytes } => {
                if self.fill_queue(budget_bytes, false)?.files == 0 {
                    return Ok(Tick::NothingEligible);
                }
                match self.activator.poll_step(now_ms(self.epoch)) {
                    Step::Evict => Ok(Tick::Evicted(EvictReport { swept: true, ..self.evict_queue()? })),
                    other => unreachable!("ON with a queue filled just now, the activator said {other:?}"),
                }
            }
        }
    }

    /// Runs until the stop flag is set: the activator's steps, an
    /// aggregated status line every `STATUS_INTERVAL_SECONDS`, back-off
    /// while nothing is eligible. Returns within about one batch of a stop
    /// request.
    pub fn run(mut self) -> Result<(), EvictError> {
        let reporter = self.spawn_reporter()?;
        let result = self.run_loop();
        self.shutdown.trigger();
        let _ = reporter.join();
        result
    }

    fn run_loop(&mut self) -> Result<(), EvictError> {
        let mut backoff = MIN_BACKOFF;
        while !self.shutdown.is_triggered() {
            self.check()?;
            match self.activator.poll_step(now_ms(self.epoch)) {
                Step::Wait | Step::CancelPrefill => {
                    let wait = self.activator.poll_timeout().saturating_sub(now_ms(self.epoch));
                    self.shutdown.sleep(Duration::from_millis(wait));
                }
                Step::DropQueue => self.drop_queue(),
                Step::Prefill { budget_bytes } => {
                    self.prefill_watching(budget_bytes)?;
                }
                Step::Sweep { budget_bytes } => {
                    if self.fill_queue(budget_bytes, false)?.files == 0 {
                        tracing::warn!(
                            retry_in_s = backoff.as_secs_f64(),
                            "usage above threshold but every block was used within FILE_ACCESS_TIME_THRESHOLD_MINUTES"
                        );
                        self.shutdown.sleep(backoff);
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                    }
                }
                Step::Evict => {
                    backoff = MIN_BACKOFF;
                    let r = self.evict_queue()?;
                    tracing::debug!(deleted = r.deleted, bytes = r.bytes, stopped = ?r.stopped, "deleted from the queue");
                }
            }
        }
        Ok(())
    }

    fn crawl(&self) -> Crawl<'_> {
        Crawl {
            config: &self.config,
            opener: &self.opener,
            stats: &self.stats,
            shutdown: &self.shutdown,
            hook: self.hook.as_ref(),
            exclude: self.config.dry_run.then_some(&self.dry.reported),
        }
    }

    /// A sweep in the foreground that makes its selection the queue.
    fn fill_queue(&mut self, budget_bytes: u64, prefill: bool) -> Result<QueueInfo, EvictError> {
        let held = Mutex::new(self.queue.take());
        let result = self.crawl().sweep(budget_bytes, &held, None);
        let held = held.into_inner().unwrap_or_else(|e| e.into_inner());
        let now = now_ms(self.epoch);
        settle_sweep(&mut self.queue, &mut self.activator, &self.stats, now, held, result, prefill)
    }

    /// A pre-fill sweep on its own thread while this one keeps checking
    /// usage every `LOGGER_INTERVAL_SECONDS`; cancelled when the activator
    /// says so (usage crossed and the queue holds files to start with).
    fn prefill_watching(&mut self, budget_bytes: u64) -> Result<QueueInfo, EvictError> {
        let Evictor { config, usage, stats, shutdown, activator, epoch, queue, opener, hook, dry, .. } = self;
        let epoch = *epoch;
        let crawl = Crawl {
            config,
            opener,
            stats,
            shutdown,
            hook: hook.as_ref(),
            exclude: config.dry_run.then_some(&dry.reported),
        };
        let held = Mutex::new(queue.take());
        let cancel = AtomicBool::new(false);
        let mut failure = None;
        let result = std::thread::scope(|scope| {
            let (tx, rx) = crossbeam_channel::bounded(1);
            let (crawl, held, cancel) = (&crawl, &held, &cancel);
            let worker = std::thread::Builder::new()
                .name("evict-prefill".into())
                .spawn_scoped(scope, move || {
                    let _ = tx.send(crawl.sweep(budget_bytes, held, Some(cancel)));
                })
                .map_err(|source| EvictError::Start { what: "pre-fill sweep", source })?;
            loop {
                let wait = match failure {
                    Some(_) => 10,
                    None => activator.poll_timeout().saturating_sub(now_ms(epoch)),
                };
                match rx.recv_timeout(Duration::from_millis(wait)) {
                    Ok(swept) => {
                        let _ = worker.join();
                        return swept;
                    }
                    Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                        if let Err(panic) = worker.join() {
                            std::panic::resume_unwind(panic);
                        }
                        return Ok(None);
                    }
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) if failure.is_none() => {
                        let now = now_ms(epoch);
                        match observe(&**usage, dry.bytes, activator, stats, now) {
                            Ok(_) if activator.poll_step(now) == Step::CancelPrefill => {
                                tracing::debug!(
                                    "usage crossed during a pre-fill: deleting from the queue instead"
                                );
                                cancel.store(true, Relaxed);
                            }
                            Ok(_) => {}
                            Err(e) => {
                                failure = Some(e);
                                cancel.store(true, Relaxed);
                            }
                        }
                    }
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
                }
            }
        });
        let held = held.into_inner().unwrap_or_else(|e| e.into_inner());
        let info = settle_sweep(queue, activator, stats, now_ms(epoch), held, result, true)?;
        match failure {
            Some(e) => Err(e),
            None => Ok(info),
        }
    }

    fn drop_queue(&mut self) {
        self.queue = None;
        self.stats.queued.store(0, Relaxed);
    }

    /// Measures usage minus what a dry run pretends to have freed.
    fn measure(&self) -> Result<Usage, EvictError> {
        Ok(self.usage.usage().map_err(EvictError::Usage)?.minus(self.dry.bytes))
    }

    /// Leaves out the queued files of every shard that is no longer the
    /// directory at its path below the cache root (see
    /// [`Shard::still_at`]), counting them as vanished.
    fn drop_moved_shards(&self, sweep: &mut Sweep) -> Result<(), EvictError> {
        if sweep.candidates.is_empty() {
            return Ok(());
        }
        let live: Vec<bool> = match open_root(&self.config)? {
            Some(root) => sweep.shards.iter().map(|s| s.still_at(root.fd.as_fd(), &self.opener)).collect(),
            None => vec![false; sweep.shards.len()],
        };
        if live.iter().all(|l| *l) {
            return Ok(());
        }
        for (shard, _) in sweep.shards.iter().zip(&live).filter(|(_, l)| !**l) {
            tracing::warn!(shard = %shard.path.display(), "moved or replaced since it was swept: its queued files are left alone");
        }
        let before = sweep.candidates.len();
        sweep.candidates.retain(|c| live[c.shard as usize]);
        Stats::add(&self.stats.vanished, (before - sweep.candidates.len()) as u64);
        Ok(())
    }

    /// Deletes from the queue until usage reaches the target, the queue is
    /// exhausted or a stop is requested (see [`Evictor::tick`]).
    fn evict_queue(&mut self) -> Result<EvictReport, EvictError> {
        let mut sweep = self.queue.take().unwrap_or(Sweep {
            shards: Vec::new(),
            candidates: Vec::new(),
            budget_bytes: 0,
        });
        let at_start = self.measure()?;
        let need = at_start.bytes_above(self.config.target_threshold);
        if need > 0 {
            self.drop_moved_shards(&mut sweep)?;
        }
        sweep.order_core_by_inode(need);
        self.stats.queued.store(sweep.candidates.len() as u64, Relaxed);
        let hot_ns = self.config.access_time_threshold.as_nanos() as i64;
        let hot_cutoff_ns = fsops::now_ns().saturating_sub(hot_ns);
        let slack = (at_start.capacity_bytes() as f64 * LANDING_SLACK) as u64;
        let batch_bytes = (slack / self.config.crawler_threads.max(1) as u64).max(1);
        let batches = match need {
            0 => Vec::new(),
            _ => batches(&sweep.candidates, self.config.deletion_batch_size, batch_bytes),
        };
        let processed: Vec<AtomicBool> = batches.iter().map(|_| AtomicBool::new(false)).collect();
        let enough = need.saturating_add(slack);
        let taken = AtomicU64::new(0);
        let threads = self.config.crawler_threads.min(batches.len()).max(1);
        let next = AtomicUsize::new(0);
        let reached = AtomicBool::new(need == 0);
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
                        let index = next.fetch_add(1, Relaxed);
                        let Some(batch) = batches.get(index) else {
                            break;
                        };
                        if taken.fetch_add(bytes_of(batch), Relaxed) >= enough {
                            break;
                        }
                        processed[index].store(true, Relaxed);
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
        // What no thread took stays queued, oldest first again (the core
        // was in inode order), in place: no second copy of the queue. Spared
        // files are not kept, their last use moved on.
        let taken: Vec<(usize, bool)> =
            batches.iter().zip(&processed).map(|(b, p)| (b.len(), p.load(Relaxed))).collect();
        drop(batches);
        let mut taken = taken.into_iter().flat_map(|(len, done)| std::iter::repeat_n(done, len));
        sweep.candidates.retain(|_| !taken.next().unwrap_or(false));
        sweep.candidates.sort_unstable();
        sweep.candidates.shrink_to_fit();
        self.stats.queued.store(sweep.candidates.len() as u64, Relaxed);
        self.queue = (!sweep.is_empty()).then_some(sweep);
        if let Some(e) = failure.into_inner().unwrap_or_else(|e| e.into_inner()) {
            return Err(EvictError::Usage(e));
        }
        self.dry.bytes = dry_bytes.into_inner();
        self.activator.handle_evicted(now_ms(self.epoch), self.queue());
        let (usage, mode) = self.check()?;
        let stopped = if mode == Mode::Off {
            Stop::TargetReached
        } else if self.shutdown.is_triggered() {
            Stop::Shutdown
        } else if self.queue.is_some() {
            Stop::Covered
        } else {
            Stop::Exhausted
        };
        Ok(EvictReport {
            deleted: deleted.into_inner(),
            bytes: freed.into_inner(),
            usage_percent: usage.percent(),
            stopped,
            swept: false,
        })
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

/// Milliseconds since `epoch`: the activator's clock.
fn now_ms(epoch: Instant) -> Millis {
    epoch.elapsed().as_millis() as Millis
}

/// Measures usage (minus `dry_bytes`) and feeds the activator and the
/// counters.
fn observe(
    source: &dyn UsageSource,
    dry_bytes: u64,
    activator: &mut Activator,
    stats: &Stats,
    now: Millis,
) -> Result<(Usage, Mode), EvictError> {
    let usage = source.usage().map_err(EvictError::Usage)?.minus(dry_bytes);
    let mode = activator.handle_usage(now, usage);
    stats.set_usage(usage.percent());
    stats.deleting.store(mode == Mode::On, Relaxed);
    Ok((usage, mode))
}

/// Makes a finished sweep's selection the queue (a cancelled or failed one
/// leaves `held`, the queue from before, as it is now) and tells the
/// activator.
fn settle_sweep(
    queue: &mut Option<Sweep>,
    activator: &mut Activator,
    stats: &Stats,
    now: Millis,
    held: Option<Sweep>,
    result: Result<Option<Sweep>, EvictError>,
    prefill: bool,
) -> Result<QueueInfo, EvictError> {
    let (end, failure) = match result {
        Ok(Some(swept)) => {
            *queue = (!swept.is_empty()).then_some(swept);
            if prefill {
                Stats::add(&stats.prefills, 1);
            }
            (SweepEnd::Complete, None)
        }
        Ok(None) => {
            *queue = held;
            Stats::add(&stats.prefills_cancelled, 1);
            (SweepEnd::Cancelled, None)
        }
        Err(e) => {
            *queue = held;
            (SweepEnd::Cancelled, Some(e))
        }
    };
    let info = queue.as_ref().map(Sweep::info).unwrap_or_default();
    stats.queued.store(info.files as u64, Relaxed);
    activator.handle_swept(now, info, end);
    match failure {
        Some(e) => Err(e),
        None => Ok(info),
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
