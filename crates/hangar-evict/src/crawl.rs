//! Discovery: one sweep over the tree, in parallel, streaming, with bounded
//! memory and back-pressure.
//!
//! The coordinator lists the skeleton (root, model directories, rank and
//! dtype directories — a few dozen entries) and each shard's first bucket
//! level, and streams one task per bucket into a bounded channel. Crawler
//! threads take buckets and list them and their leaves, so every directory is
//! listed exactly once per sweep — the Python evictor had every crawler
//! re-walk the whole skeleton and filter by hex modulo.
//!
//! Crawlers `fstatat` each block file (no-follow) relative to the open leaf
//! handle and send deletable ones, in chunks, through a channel bounded by
//! `FILE_QUEUE_MAXSIZE` to the selector thread. When the selector lags, the
//! crawlers block: nothing discovered is dropped. The selector publishes its
//! cutoff so crawlers do not send files that could not enter the selection.
//!
//! A sweep stops early on shutdown or when its `cancel` flag is set (a
//! pre-fill abandoned because usage crossed); the caller discards what a
//! cancelled sweep found, since an unfinished walk does not know the oldest
//! files. As its selection grows the selector reports its size, so that the
//! deletion queue held beside it can give up room.
//!
//! A crawler thread that panics is joined, counted in
//! [`Stats::crawler_restarts`] and replaced; the bucket it was on is picked
//! up again by the next sweep.

use std::collections::HashSet;
use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::{Scope, ScopedJoinHandle};
use std::time::Duration;

use crossbeam_channel::{bounded, select, unbounded, Receiver, Sender};

use crate::config::Config;
use crate::fsops::{self, Listing, Opener};
use crate::layout::{self, Layout, Leaf};
use crate::select::{Candidate, Selection};
use crate::shutdown::Shutdown;
use crate::stats::Stats;

/// Candidates travel from crawlers to the selector in chunks of this size.
const CHUNK: usize = 64;
/// Model names may contain `/`; the older layout is searched this deep.
const MAX_MODEL_DEPTH: usize = 6;

/// Called with each bucket directory (relative to the cache root) as a
/// crawler starts on it. Lets tests inject faults and delays.
pub type DirHook = Arc<dyn Fn(&Path) + Send + Sync>;

/// A directory that directly holds first-level buckets, held open.
#[derive(Debug)]
pub struct Shard {
    /// Path relative to the cache root.
    pub path: PathBuf,
    /// Its layout.
    pub layout: Layout,
    /// Model name for events: `model_name` of the current layout's
    /// `config.json`, else the directory name's model part, or the model
    /// directories of the older layout joined with `/`.
    pub model: Arc<str>,
    /// Fingerprint of `path`, to tell blocks of different shards apart.
    pub(crate) fingerprint: u64,
    pub(crate) fd: OwnedFd,
}

impl Shard {
    /// Path of a candidate's file relative to the cache root.
    pub fn file_path(&self, c: &Candidate) -> PathBuf {
        self.path
            .join(self.layout.bucket_name(c.bucket))
            .join(self.layout.leaf_name(c.leaf))
            .join(layout::block_file_name(c.hash))
    }

    /// Whether `path`, opened again from `root` without following a
    /// symlink, is still the directory this shard holds open (same device
    /// and inode): a shard renamed or replaced since the sweep is not, and
    /// its queued files must not be deleted through the old handle, which
    /// may now lie outside the tree.
    pub(crate) fn still_at(&self, root: BorrowedFd<'_>, opener: &Opener) -> bool {
        use std::os::unix::ffi::OsStrExt;
        let mut dir: Option<OwnedFd> = None;
        for component in self.path.components() {
            let Ok(name) = CString::new(component.as_os_str().as_bytes()) else {
                return false;
            };
            let parent = dir.as_ref().map_or(root, |d| d.as_fd());
            match opener.dir(parent, &name) {
                Ok(fd) => dir = Some(fd),
                Err(_) => return false,
            }
        }
        let (Some(dir), Ok(held)) = (dir, rustix::fs::fstat(&self.fd)) else {
            return false;
        };
        rustix::fs::fstat(&dir).is_ok_and(|now| (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino))
    }

    /// Fingerprint of one block of this shard (dry-run bookkeeping).
    pub(crate) fn block_fingerprint(&self, hash: u64) -> u64 {
        (self.fingerprint ^ hash).wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }
}

/// Everything one sweep needs.
pub(crate) struct SweepInput<'a> {
    pub(crate) config: &'a Config,
    /// `st_dev` of the cache root: shards on any other filesystem are skipped.
    pub(crate) root_dev: u64,
    pub(crate) opener: &'a Opener,
    pub(crate) stats: &'a Stats,
    pub(crate) shutdown: &'a Shutdown,
    pub(crate) hook: Option<&'a DirHook>,
    /// Blocks a dry run already reported.
    pub(crate) exclude: Option<&'a HashSet<u64>>,
    pub(crate) now_ns: i64,
    /// Set to abandon the sweep (a pre-fill overtaken by a crossing).
    pub(crate) cancel: Option<&'a AtomicBool>,
    /// Told, before the selector offers a chunk, how many candidates the
    /// selection may hold once it has.
    pub(crate) on_selected: Option<&'a (dyn Fn(usize) + Sync)>,
}

impl SweepInput<'_> {
    /// Whether the sweep should stop now: shutdown or cancelled.
    pub(crate) fn stopping(&self) -> bool {
        self.shutdown.is_triggered() || self.cancel.is_some_and(|c| c.load(Relaxed))
    }
}

/// Walks the tree below the open cache root once and returns the shards and
/// the filled selection.
pub(crate) fn sweep(
    input: &SweepInput<'_>,
    root_fd: &OwnedFd,
    selection: Selection,
) -> (Vec<Shard>, Selection) {
    let shards = find_shards(input, root_fd);
    let selection = crawl(input, &shards, selection);
    (shards, selection)
}

fn crawl(input: &SweepInput<'_>, shards: &[Shard], mut selection: Selection) -> Selection {
    let cutoff = AtomicI64::new(i64::MAX);
    let hot_ns = input.config.access_time_threshold.as_nanos() as i64;
    let ctx = Ctx { input, shards, cutoff: &cutoff, hot_cutoff_ns: input.now_ns.saturating_sub(hot_ns) };
    let chunk = CHUNK.min(input.config.file_queue_maxsize);
    let capacity = (input.config.file_queue_maxsize / chunk).max(1);
    std::thread::scope(|scope| {
        let (cand_tx, cand_rx) = bounded::<Vec<Candidate>>(capacity);
        let (task_tx, task_rx) = bounded::<Task>(256);
        let (exit_tx, exit_rx) = unbounded::<usize>();

        let selector = scope.spawn(|| {
            for batch in cand_rx {
                // Room is made before the chunk is offered, so whatever is
                // held beside the selection never exceeds its share.
                if let Some(report) = input.on_selected {
                    report(selection.len() + batch.len());
                }
                for c in batch {
                    selection.offer(c);
                }
                input.stats.selected.store(selection.len() as u64, Relaxed);
                if let Some(cut) = selection.cutoff() {
                    cutoff.store(cut, Relaxed);
                }
            }
            selection
        });

        let spawn = |idx: usize| {
            spawn_crawler(scope, idx, &ctx, task_rx.clone(), cand_tx.clone(), exit_tx.clone(), chunk)
        };
        let threads = input.config.crawler_threads;
        let mut workers: Vec<_> = (0..threads).map(|i| spawn(i).ok()).collect();
        let running = |w: &[Option<_>]| w.iter().filter(|h| h.is_some()).count();
        let on_exit = |idx: usize, workers: &mut Vec<_>, more: bool| {
            let respawn = more && !input.stopping();
            reap(idx, workers, input.stats, respawn.then_some(&spawn));
        };

        'feed: for (shard_idx, shard) in shards.iter().enumerate() {
            let mut listing = match shard_listing(input, shard) {
                Some(l) => l,
                None => continue,
            };
            while let Some(entry) = listing.next_entry() {
                if input.stopping() || running(&workers) == 0 {
                    break 'feed;
                }
                let entry = match entry {
                    Ok(e) => e,
                    Err(e) => {
                        io_error(input.stats, &shard.path, &e);
                        break;
                    }
                };
                let Some(bucket) = shard.layout.parse_bucket(entry.bytes()) else {
                    continue;
                };
                if !entry.is_dir() {
                    continue;
                }
                let task = Task { shard: shard_idx as u32, bucket };
                loop {
                    select! {
                        send(task_tx, task) -> r => { if r.is_err() { break 'feed } break }
                        recv(exit_rx) -> idx => {
                            if let Ok(idx) = idx { on_exit(idx, &mut workers, true) }
                            if running(&workers) == 0 { break 'feed }
                        }
                        default(Duration::from_millis(100)) => {
                            if input.stopping() { break 'feed }
                        }
                    }
                }
            }
        }
        drop(task_tx);
        while running(&workers) > 0 {
            match exit_rx.recv() {
                Ok(idx) => on_exit(idx, &mut workers, !task_rx.is_empty()),
                Err(_) => break,
            }
        }
        drop(cand_tx);
        selector.join().expect("the selector does not panic")
    })
}

fn shard_listing(input: &SweepInput<'_>, shard: &Shard) -> Option<Listing> {
    Listing::reopen(shard.fd.as_fd()).map_err(|e| io_error(input.stats, &shard.path, &e)).ok()
}

/// Joins crawler `idx` after it ended; if it panicked, counts a restart
/// and starts a replacement through `respawn`.
fn reap<'scope>(
    idx: usize,
    workers: &mut [Option<ScopedJoinHandle<'scope, ()>>],
    stats: &Stats,
    respawn: Option<&dyn Fn(usize) -> io::Result<ScopedJoinHandle<'scope, ()>>>,
) {
    let Some(handle) = workers[idx].take() else {
        return;
    };
    if handle.join().is_err() {
        Stats::add(&stats.crawler_restarts, 1);
        tracing::error!(crawler = idx, "crawler thread panicked; restarting it");
        if let Some(spawn) = respawn {
            workers[idx] = spawn(idx).ok();
        }
    }
}

fn spawn_crawler<'scope, 'env>(
    scope: &'scope Scope<'scope, 'env>,
    idx: usize,
    ctx: &'env Ctx<'env>,
    tasks: Receiver<Task>,
    out: Sender<Vec<Candidate>>,
    exit: Sender<usize>,
    chunk: usize,
) -> io::Result<ScopedJoinHandle<'scope, ()>> {
    std::thread::Builder::new().name(format!("evict-crawl-{idx}")).spawn_scoped(scope, move || {
        let _exit = ExitNotice { idx, tx: exit };
        Crawler::new(ctx, out, chunk).run(&tasks);
    })
}

#[derive(Debug, Clone, Copy)]
struct Task {
    shard: u32,
    bucket: u16,
}

/// Tells the coordinator a crawler ended, also when it ended by panicking.
struct ExitNotice {
    idx: usize,
    tx: Sender<usize>,
}

impl Drop for ExitNotice {
    fn drop(&mut self) {
        let _ = self.tx.send(self.idx);
    }
}

struct Ctx<'a> {
    input: &'a SweepInput<'a>,
    shards: &'a [Shard],
    cutoff: &'a AtomicI64,
    hot_cutoff_ns: i64,
}

struct Crawler<'a> {
    ctx: &'a Ctx<'a>,
    out: Sender<Vec<Candidate>>,
    buf: Vec<Candidate>,
    chunk: usize,
    /// Counted locally and published per bucket, not per file, so eight
    /// crawlers do not fight over one cache line.
    discovered: u64,
    hot: u64,
}

impl<'a> Crawler<'a> {
    fn new(ctx: &'a Ctx<'a>, out: Sender<Vec<Candidate>>, chunk: usize) -> Self {
        Crawler { ctx, out, buf: Vec::with_capacity(chunk), chunk, discovered: 0, hot: 0 }
    }

    fn run(mut self, tasks: &Receiver<Task>) {
        for task in tasks {
            if self.ctx.input.stopping() {
                break;
            }
            self.bucket(task);
            self.publish_counts();
        }
        self.flush();
    }

    fn publish_counts(&mut self) {
        let stats = self.ctx.input.stats;
        Stats::add(&stats.discovered, std::mem::take(&mut self.discovered));
        Stats::add(&stats.hot_skipped, std::mem::take(&mut self.hot));
    }

    fn flush(&mut self) {
        if !self.buf.is_empty() {
            let full = std::mem::replace(&mut self.buf, Vec::with_capacity(self.chunk));
            // Blocks while the selector is behind: back-pressure, not loss.
            let _ = self.out.send(full);
        }
    }

    fn bucket(&mut self, task: Task) {
        let input = self.ctx.input;
        let shard = &self.ctx.shards[task.shard as usize];
        let name = cstring(shard.layout.bucket_name(task.bucket));
        if let Some(hook) = input.hook {
            hook(&shard.path.join(name.to_str().unwrap_or_default()));
        }
        let Some(mut listing) = self.open(shard.fd.as_fd(), &name, &shard.path) else {
            return;
        };
        let mut empty = true;
        while let Some(entry) = listing.next_entry() {
            empty = false;
            if input.stopping() {
                return;
            }
            let entry = match entry {
                Ok(e) => e,
                Err(e) => return io_error(input.stats, &shard.path, &e),
            };
            let Some(leaf) = shard.layout.parse_leaf(entry.bytes()) else {
                continue;
            };
            if entry.is_dir() {
                self.leaf(task, shard, leaf, listing.fd(), &entry.name);
            }
        }
        if empty {
            self.maybe_rmdir(shard.fd.as_fd(), &name, listing.fd());
        }
    }

    fn leaf(&mut self, task: Task, shard: &Shard, leaf: Leaf, bucket_fd: BorrowedFd<'_>, name: &CStr) {
        let input = self.ctx.input;
        let Some(mut listing) = self.open(bucket_fd, name, &shard.path) else {
            return;
        };
        let mut empty = true;
        while let Some(entry) = listing.next_entry() {
            empty = false;
            let entry = match entry {
                Ok(e) => e,
                Err(e) => return io_error(input.stats, &shard.path, &e),
            };
            if let Some(hash) = layout::parse_block_file(entry.bytes()) {
                self.block(task, shard, leaf, listing.fd(), &entry.name, hash);
            } else if layout::is_tmp_file(entry.bytes()) {
                self.tmp_file(listing.fd(), &entry.name, &shard.path);
            }
        }
        if empty {
            self.maybe_rmdir(bucket_fd, name, listing.fd());
        }
    }

    fn block(&mut self, task: Task, shard: &Shard, leaf: Leaf, dir: BorrowedFd<'_>, name: &CStr, hash: u64) {
        let input = self.ctx.input;
        let info = match fsops::stat(dir, name) {
            Ok(Some(i)) if i.regular => i,
            Ok(_) => return,
            Err(e) => return io_error(input.stats, &shard.path, &e),
        };
        self.discovered += 1;
        if info.last_use_ns > self.ctx.hot_cutoff_ns {
            self.hot += 1;
            return;
        }
        if info.last_use_ns > self.ctx.cutoff.load(Relaxed) {
            return; // newer than everything the selection still wants
        }
        if input.exclude.is_some_and(|seen| seen.contains(&shard.block_fingerprint(hash))) {
            return;
        }
        self.buf.push(Candidate {
            last_use_ns: info.last_use_ns,
            hash,
            blocks: info.blocks.min(u64::from(u32::MAX)) as u32,
            ino: info.ino as u32,
            shard: task.shard,
            bucket: task.bucket,
            leaf,
        });
        if self.buf.len() >= self.chunk {
            self.flush();
        }
    }

    fn tmp_file(&mut self, dir: BorrowedFd<'_>, name: &CStr, shard: &Path) {
        let input = self.ctx.input;
        let Some(ttl) = input.config.tmp_file_ttl else {
            return;
        };
        let Ok(Some(info)) = fsops::stat(dir, name) else {
            return;
        };
        if !info.regular || input.now_ns - info.mtime_ns < ttl.as_nanos() as i64 {
            return;
        }
        if input.config.dry_run {
            tracing::info!(file = %name.to_string_lossy(), shard = %shard.display(), "dry run: would remove stale temporary file");
            return;
        }
        match fsops::unlink(dir, name) {
            Ok(true) => Stats::add(&input.stats.tmp_removed, 1),
            Ok(false) => {}
            Err(e) => io_error(input.stats, shard, &e),
        }
    }

    /// Removes an empty directory unchanged for `DIR_CLEANUP_TTL_SECONDS`;
    /// a directory a writer just created (or just emptied) is younger.
    fn maybe_rmdir(&self, parent: BorrowedFd<'_>, name: &CStr, own: BorrowedFd<'_>) {
        let input = self.ctx.input;
        if !input.config.enable_dir_cleanup || input.config.dry_run {
            return;
        }
        let Ok(mtime) = fsops::dir_mtime_ns(own) else {
            return;
        };
        if input.now_ns - mtime < input.config.dir_cleanup_ttl.as_nanos() as i64 {
            return;
        }
        match fsops::rmdir(parent, name) {
            Ok(true) => Stats::add(&input.stats.dirs_removed, 1),
            Ok(false) => {}
            Err(e) => tracing::debug!(dir = %name.to_string_lossy(), error = %e, "rmdir failed"),
        }
    }

    fn open(&self, parent: BorrowedFd<'_>, name: &CStr, shard: &Path) -> Option<Listing> {
        match self.ctx.input.opener.dir(parent, name).and_then(Listing::new) {
            Ok(l) => Some(l),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => {
                io_error(self.ctx.input.stats, shard, &e);
                None
            }
        }
    }
}

fn io_error(stats: &Stats, shard: &Path, e: &io::Error) {
    Stats::add(&stats.errors, 1);
    tracing::debug!(shard = %shard.display(), error = %e, "I/O error while crawling");
}

fn cstring(s: String) -> CString {
    CString::new(s).expect("generated names hold no NUL")
}

/// Lists the skeleton and returns every shard, each held open.
fn find_shards(input: &SweepInput<'_>, root: &OwnedFd) -> Vec<Shard> {
    let mut shards = Vec::new();
    let bucket_len = input.config.hex_bucket_len;
    for entry in dirs(input, root.as_fd(), Path::new("")) {
        let Ok(name) = entry.to_str() else { continue };
        if let Some((base, model)) = layout::parse_current_rank_dir(name) {
            let model = model_name(input, root.as_fd(), base).unwrap_or_else(|| model.to_owned());
            push_shard(
                input,
                &mut shards,
                root.as_fd(),
                &entry,
                PathBuf::from(name),
                Layout::Current { bucket_len },
                model,
            );
        } else if let Ok(fd) = input.opener.dir(root.as_fd(), &entry) {
            legacy(input, &mut shards, &fd, PathBuf::from(name), 1);
        }
    }
    shards
}

/// Searches `<model…>/block_size_*/tp_*/rank_*/<dtype>` below `dir`.
fn legacy(input: &SweepInput<'_>, shards: &mut Vec<Shard>, dir: &OwnedFd, model: PathBuf, depth: usize) {
    for entry in dirs(input, dir.as_fd(), &model) {
        let Ok(name) = entry.to_str() else { continue };
        let Ok(fd) = input.opener.dir(dir.as_fd(), &entry) else { continue };
        if layout::is_block_size_dir(name) {
            let model_name = model.to_string_lossy().into_owned();
            for par in dirs(input, fd.as_fd(), &model) {
                if !par.to_str().is_ok_and(layout::is_parallel_dir) {
                    continue;
                }
                let Ok(par_fd) = input.opener.dir(fd.as_fd(), &par) else { continue };
                for rank in dirs(input, par_fd.as_fd(), &model) {
                    if !rank.to_str().is_ok_and(layout::is_legacy_rank_dir) {
                        continue;
                    }
                    let Ok(rank_fd) = input.opener.dir(par_fd.as_fd(), &rank) else { continue };
                    for dtype in dirs(input, rank_fd.as_fd(), &model) {
                        let Ok(dtype_name) = dtype.to_str() else { continue };
                        if !layout::is_dtype_dir(dtype_name) {
                            continue;
                        }
                        let path = model
                            .join(name)
                            .join(par.to_str().unwrap_or_default())
                            .join(rank.to_str().unwrap_or_default())
                            .join(dtype_name);
                        push_shard(
                            input,
                            shards,
                            rank_fd.as_fd(),
                            &dtype,
                            path,
                            Layout::Legacy,
                            model_name.clone(),
                        );
                    }
                }
            }
        } else if depth < MAX_MODEL_DEPTH {
            legacy(input, shards, &fd, model.join(name), depth + 1);
        }
    }
}

fn push_shard(
    input: &SweepInput<'_>,
    shards: &mut Vec<Shard>,
    parent: BorrowedFd<'_>,
    name: &CStr,
    path: PathBuf,
    layout: Layout,
    model: String,
) {
    match input.opener.dir(parent, name) {
        Ok(fd) if rustix::fs::fstat(&fd).is_ok_and(|st| st.st_dev != input.root_dev) => {
            // A mount below the root: deleting there never lowers the
            // measured usage (the deleter's `openat2` refuses crossing
            // mounts below a shard, this the shard itself).
            Stats::add(&input.stats.errors, 1);
            tracing::warn!(shard = %path.display(), "skipping a directory on another filesystem than the cache root");
        }
        Ok(fd) => {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            path.hash(&mut h);
            shards.push(Shard { fingerprint: h.finish(), path, layout, model: model.into(), fd })
        }
        Err(e) => io_error(input.stats, &path, &e),
    }
}

/// Names of the subdirectories of `dir` (never symlinks).
fn dirs(input: &SweepInput<'_>, dir: BorrowedFd<'_>, at: &Path) -> Vec<CString> {
    let mut listing = match Listing::reopen(dir) {
        Ok(l) => l,
        Err(e) => {
            io_error(input.stats, at, &e);
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    while let Some(entry) = listing.next_entry() {
        match entry {
            Ok(e) if e.is_dir() => out.push(e.name),
            Ok(_) => {}
            Err(e) => {
                io_error(input.stats, at, &e);
                break;
            }
        }
    }
    out.sort();
    out
}

/// `model_name` from `<root>/<base>/config.json`, if readable.
fn model_name(input: &SweepInput<'_>, root: BorrowedFd<'_>, base: &str) -> Option<String> {
    use std::io::Read;
    let base = CString::new(base).ok()?;
    let dir = input.opener.dir(root, &base).ok()?;
    let flags = rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::CLOEXEC;
    let fd = rustix::fs::openat(&dir, c"config.json", flags, rustix::fs::Mode::empty()).ok()?;
    let mut text = String::new();
    std::fs::File::from(fd).take(1 << 16).read_to_string(&mut text).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v.get("model_name").or_else(|| v.get("model")).and_then(|m| m.as_str()).map(str::to_owned)
}
