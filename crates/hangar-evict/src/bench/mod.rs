//! `hangar evict bench`: the evictor as a separate process against
//! loop-mounted ext4 images, measured from outside.
//!
//! For each tree size: build an image (`truncate`, `mkfs.ext4`,
//! `mount -o loop,strictatime`), write a current-layout tree of 8 KiB
//! blocks with last uses spread over three days and 5 % used in the last
//! 30 minutes, top the volume up to 90 % with a ballast file outside the
//! cache directory, start `hangar evict` with default settings and measure:
//! time until `df` usage ≤ 70 %, files deleted per second, CPU seconds,
//! peak RSS, idle CPU at 80 % usage, SIGTERM-to-exit time during a sweep,
//! and whether recently used blocks survived while older ones went. The
//! image is unmounted and deleted afterwards, also on failure.
//!
//! Next to the evictor it measures a bare walk (see [`bare_walk`]): on a
//! copy of the same image, warmed the same way, a walk that does nothing
//! but list, stat and unlink the same blocks. The ratio says how much of
//! the time is the evictor's and how much the file system's.

mod bare_walk;

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use crate::layout::Layout;
use crate::synth::{BlockFile, TreeSpec};
use crate::usage::{Statvfs, Usage, UsageSource};

/// What to measure.
#[derive(Debug, Clone)]
pub struct Options {
    /// The `hangar` binary to run as `hangar evict`.
    pub exe: PathBuf,
    /// Tree sizes in files.
    pub files: Vec<usize>,
    /// Idle CPU measurement window.
    pub idle: Duration,
    /// Where images and mount points go.
    pub work_dir: PathBuf,
}

/// Why the benchmark could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// Loop mounts need root.
    #[error("the benchmark mounts loop devices and must run as root")]
    NotRoot,
    /// A tree too small to measure: the ballast would outweigh it.
    #[error("--files {0}: trees of fewer than {MIN_FILES} files leave nothing to measure")]
    TooFewFiles(usize),
    /// An external command failed.
    #[error("`{command}` failed: {detail}")]
    Command {
        /// The command line.
        command: String,
        /// Exit status and stderr.
        detail: String,
    },
    /// A file operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Underlying error.
        #[source]
        source: io::Error,
    },
    /// The evictor misbehaved (exited early, never reached the target).
    #[error("evictor: {0}")]
    Evictor(String),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> BenchError {
    let what = what.into();
    move |source| BenchError::Io { what, source }
}

/// Figures for one tree size.
#[derive(Debug, Clone)]
pub struct Row {
    /// Files in the tree.
    pub files: usize,
    /// Usage when the evictor started.
    pub start_percent: f64,
    /// Time from start until usage ≤ 70 %.
    pub to_target: Duration,
    /// Files deleted.
    pub deleted: usize,
    /// CPU seconds (user + system) until idle after reaching the target.
    pub cpu_seconds: f64,
    /// Peak resident set (VmHWM) over the whole run, KiB.
    pub peak_rss_kib: u64,
    /// CPU used over the idle window at 80 %, percent of one core.
    pub idle_cpu_percent: f64,
    /// SIGTERM during a sweep until the process exited.
    pub sigterm_exit: Duration,
    /// Whether it exited with status 0.
    pub clean_exit: bool,
    /// Recently used blocks (last 30 min) and how many survived.
    pub recent: (usize, usize),
    /// Deleted blocks used more recently than the oldest surviving cold block.
    pub order_violations: usize,
    /// A bare walk on a copy of the volume unlinking the same blocks with
    /// one thread per core.
    pub bare_walk: Duration,
}

/// All rows, printable as a table with the targets.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// One row per tree size.
    pub rows: Vec<Row>,
}

/// Runs the benchmark.
pub fn run(opts: &Options) -> Result<Report, BenchError> {
    if let Some(&files) = opts.files.iter().find(|&&f| f < MIN_FILES) {
        return Err(BenchError::TooFewFiles(files));
    }
    if !rustix::process::geteuid().is_root() {
        return Err(BenchError::NotRoot);
    }
    // The evictor refuses a root with a symlink anywhere on its path, so the
    // images are mounted below the real path of the work directory.
    let work_dir = &opts.work_dir;
    std::fs::create_dir_all(work_dir).map_err(io_err(format!("creating {}", work_dir.display())))?;
    let work_dir =
        std::fs::canonicalize(work_dir).map_err(io_err(format!("resolving {}", work_dir.display())))?;
    let opts = &Options { work_dir, ..opts.clone() };
    let mut report = Report::default();
    for &files in &opts.files {
        report.rows.push(one(opts, files)?);
    }
    Ok(report)
}

/// The evictor's default `CACHE_DIRECTORY`, under which the tree is written.
const CACHE_DIRECTORY: &str = "kv/model-cache/models";
/// Smallest tree measured.
const MIN_FILES: usize = 1000;
const BLOCK: usize = 8192;
const RANKS: u32 = 2;

fn one(opts: &Options, files: usize) -> Result<Row, BenchError> {
    let dir = opts.work_dir.join(format!("hangar-evict-bench-{}-{files}", std::process::id()));
    let mut vol = Volume::create(&dir, files)?;
    let mnt = vol.mnt.clone();
    let cache_directory = Path::new(CACHE_DIRECTORY);
    let root = mnt.join(cache_directory);
    let spec = TreeSpec {
        layout: Layout::Current { bucket_len: 3 },
        model: "meta-llama/Llama-3.1-70B".into(),
        ranks: RANKS,
        files,
        file_bytes: BLOCK,
        age_span: Duration::from_secs(3 * 86_400),
        hot_fraction: 0.05,
        hot_window: Duration::from_secs(30 * 60),
        min_cold_age: Duration::from_secs(30 * 60),
        seed: files as u64,
        ..TreeSpec::default()
    };
    tracing::info!(files, mount = %mnt.display(), "writing tree");
    let started = Instant::now();
    let plan = spec.write(&root, SystemTime::now(), 4).map_err(io_err("writing the tree"))?;
    rustix::fs::sync();
    let disk = Statvfs::new(&mnt);
    tracing::info!(
        files,
        secs = started.elapsed().as_secs(),
        usage = format_args!("{:.1}%", usage(&disk)?.percent()),
        "tree written"
    );
    vol.fill_to(&disk, 90.0, "ballast-90")?;
    let start_percent = usage(&disk)?.percent();
    // The bare walk's copy is taken before the evictor runs; copying remounts
    // both, so both are warmed by the same walk.
    let bare_vol = vol.copy(&dir.join("bare-walk"))?;
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    for m in [&mnt, &bare_vol.mnt] {
        bare_walk::walk(m, cache_directory, threads, None)
            .map_err(io_err(format!("warming {}", m.join(cache_directory).display())))?;
    }

    let log = dir.join("evict.log");
    let mut child = Evictor::spawn(&opts.exe, &mnt, &log)?;
    let t0 = Instant::now();
    while usage(&disk)?.percent() > 70.0 {
        child.check_alive()?;
        if t0.elapsed() > Duration::from_secs(600) {
            return Err(BenchError::Evictor("usage still above 70 % after 10 minutes".into()));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let to_target = t0.elapsed();
    child.wait_idle()?;
    let cpu_seconds = child.cpu_seconds()?;

    let Survivors { deleted, recent, order_violations, newest_deleted } = survivors(&root, &plan);
    let up_to_ns = newest_deleted
        .map_or(i64::MIN, |t| t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as i64));
    let bare = bare_walk::walk(&bare_vol.mnt, cache_directory, threads, Some(up_to_ns))
        .map_err(io_err("the bare walk"))?;
    tracing::info!(
        secs = bare.elapsed.as_secs_f64(),
        files = bare.files,
        deleted = bare.deleted,
        evictor_deleted = deleted,
        "bare walk done"
    );
    drop(bare_vol);

    vol.fill_to(&disk, 80.0, "ballast-80")?;
    std::thread::sleep(Duration::from_secs(2));
    let before = child.cpu_seconds()?;
    std::thread::sleep(opts.idle);
    let idle_cpu_percent = (child.cpu_seconds()? - before) * 100.0 / opts.idle.as_secs_f64();

    // Back above the cleanup threshold: stop it in the middle of a sweep.
    vol.fill_to(&disk, 88.0, "ballast-88")?;
    let busy_from = child.cpu_seconds()?;
    let wait_start = Instant::now();
    while child.cpu_seconds()? - busy_from < 0.05 && wait_start.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let peak_rss_kib = child.peak_rss_kib()?;
    let (sigterm_exit, clean_exit) = child.terminate()?;
    let kept_log = opts.work_dir.join(format!("hangar-evict-bench-{files}.log"));
    if std::fs::copy(&log, &kept_log).is_ok() {
        tracing::info!(log = %kept_log.display(), "evictor log kept");
    }
    Ok(Row {
        files,
        start_percent,
        to_target,
        deleted,
        cpu_seconds,
        peak_rss_kib,
        idle_cpu_percent,
        sigterm_exit,
        clean_exit,
        recent,
        order_violations,
        bare_walk: bare.elapsed,
    })
}

fn usage(disk: &Statvfs) -> Result<Usage, BenchError> {
    disk.usage().map_err(io_err("statvfs"))
}

/// What the evictor left of the planned tree.
struct Survivors {
    deleted: usize,
    /// (recently used blocks, how many survived).
    recent: (usize, usize),
    order_violations: usize,
    /// Last use of the most recently used block deleted.
    newest_deleted: Option<SystemTime>,
}

fn survivors(root: &Path, plan: &[BlockFile]) -> Survivors {
    let exists: Vec<bool> = plan.iter().map(|f| root.join(&f.path).symlink_metadata().is_ok()).collect();
    let deleted = exists.iter().filter(|e| !**e).count();
    let recent_total = plan.iter().filter(|f| f.hot).count();
    let recent_kept = plan.iter().zip(&exists).filter(|(f, e)| f.hot && **e).count();
    let oldest_kept_cold =
        plan.iter().zip(&exists).filter(|(f, e)| !f.hot && **e).map(|(f, _)| f.last_use).min();
    let violations = match oldest_kept_cold {
        Some(oldest) => plan.iter().zip(&exists).filter(|(f, e)| !**e && f.last_use > oldest).count(),
        None => 0,
    };
    let newest_deleted = plan.iter().zip(&exists).filter(|(_, e)| !**e).map(|(f, _)| f.last_use).max();
    Survivors { deleted, recent: (recent_total, recent_kept), order_violations: violations, newest_deleted }
}

/// A loop-mounted ext4 image, unmounted and deleted on drop.
struct Volume {
    dir: PathBuf,
    img: PathBuf,
    mnt: PathBuf,
    mounted: bool,
}

impl Volume {
    /// Sizes the image so that a tree of `files` 8 KiB blocks fills about
    /// 87 % of it, leaving the rest to the ballast.
    fn create(dir: &Path, files: usize) -> Result<Volume, BenchError> {
        std::fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
        let mut vol =
            Volume { dir: dir.to_owned(), img: dir.join("ext4.img"), mnt: dir.join("mnt"), mounted: false };
        std::fs::create_dir_all(&vol.mnt).map_err(io_err("creating the mount point"))?;
        // Leaf directories in use for `files` random hashes over 4096 × 256.
        let leaves_per_rank = 1_048_576.0 * (1.0 - (-(files as f64 / RANKS as f64) / 1_048_576.0).exp());
        let dirs = (leaves_per_rank + 4096.0) * RANKS as f64;
        let data = files as f64 * BLOCK as f64 + dirs * 4096.0;
        let inodes = ((files as f64 + dirs) * 1.1) as u64 + 10_000;
        // First format at a guess to learn the fixed overhead, then resize.
        vol.format(data as u64 * 2, inodes)?;
        let empty = usage(&Statvfs::new(&vol.mnt))?;
        let overhead = empty.used_bytes as f64;
        let usable = empty.capacity_bytes() as f64 / (data * 2.0);
        vol.unmount();
        let size = ((overhead + data) / (0.87 * usable)) as u64;
        vol.format(size, inodes)?;
        Ok(vol)
    }

    fn format(&mut self, size: u64, inodes: u64) -> Result<(), BenchError> {
        let _ = std::fs::remove_file(&self.img);
        let size = size.div_ceil(1 << 20) << 20;
        run_cmd(Command::new("truncate").arg("-s").arg(size.to_string()).arg(&self.img))?;
        run_cmd(
            Command::new("mkfs.ext4")
                .args(["-q", "-F", "-b", "4096", "-N"])
                .arg(inodes.to_string())
                .arg(&self.img),
        )?;
        self.mount()
    }

    fn mount(&mut self) -> Result<(), BenchError> {
        run_cmd(Command::new("mount").args(["-o", "loop,strictatime"]).arg(&self.img).arg(&self.mnt))?;
        self.mounted = true;
        Ok(())
    }

    /// A mounted copy of this volume in `dir` (sparse, so it costs only the
    /// bytes in use); this volume is remounted.
    fn copy(&mut self, dir: &Path) -> Result<Volume, BenchError> {
        std::fs::create_dir_all(dir.join("mnt")).map_err(io_err(format!("creating {}", dir.display())))?;
        let mut copy =
            Volume { dir: dir.to_owned(), img: dir.join("ext4.img"), mnt: dir.join("mnt"), mounted: false };
        self.unmount();
        run_cmd(Command::new("cp").arg("--sparse=always").arg(&self.img).arg(&copy.img))?;
        self.mount()?;
        copy.mount()?;
        Ok(copy)
    }

    /// Allocates a ballast file outside the cache directory so usage reaches
    /// `percent`.
    fn fill_to(&self, disk: &Statvfs, percent: f64, name: &str) -> Result<(), BenchError> {
        let u = usage(disk)?;
        let want = (u.capacity_bytes() as f64 * percent / 100.0) as u64;
        let Some(bytes) = want.checked_sub(u.used_bytes).filter(|b| *b > 0) else {
            return Ok(());
        };
        let path = self.mnt.join(name);
        let file = std::fs::File::create(&path).map_err(io_err(format!("creating {}", path.display())))?;
        rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, bytes).map_err(|e| {
            BenchError::Io { what: format!("allocating {} bytes of ballast", bytes), source: e.into() }
        })?;
        rustix::fs::fsync(&file).map_err(|e| io_err("fsync ballast")(e.into()))?;
        Ok(())
    }

    fn unmount(&mut self) {
        if self.mounted {
            for _ in 0..50 {
                let ok = Command::new("umount")
                    .arg(&self.mnt)
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success());
                if ok {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            self.mounted = false;
        }
    }
}

impl Drop for Volume {
    fn drop(&mut self) {
        self.unmount();
        let _ = std::fs::remove_file(&self.img);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn run_cmd(cmd: &mut Command) -> Result<(), BenchError> {
    let line = format!("{cmd:?}");
    let out =
        cmd.output().map_err(|e| BenchError::Command { command: line.clone(), detail: e.to_string() })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(BenchError::Command {
            command: line,
            detail: format!("{}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim()),
        })
    }
}

/// The evictor process under test; killed on drop if still running.
struct Evictor {
    child: Child,
    exited: bool,
}

impl Evictor {
    fn spawn(exe: &Path, mnt: &Path, log: &Path) -> Result<Evictor, BenchError> {
        let log = std::fs::File::create(log).map_err(io_err("creating the evictor log"))?;
        let child = Command::new(exe)
            .arg("evict")
            .env("PVC_MOUNT_PATH", mnt)
            .env("CACHE_DIRECTORY", CACHE_DIRECTORY)
            // Logging only: one status line per second, sweep timings.
            .env("STATUS_INTERVAL_SECONDS", "1")
            .env("LOG_LEVEL", "DEBUG")
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(io_err(format!("starting {} evict", exe.display())))?;
        Ok(Evictor { child, exited: false })
    }

    fn check_alive(&mut self) -> Result<(), BenchError> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => {
                self.exited = true;
                Err(BenchError::Evictor(format!("exited early with {status}")))
            }
            Err(e) => Err(io_err("waiting for the evictor")(e)),
        }
    }

    fn proc_file(&self, name: &str) -> Result<String, BenchError> {
        let path = format!("/proc/{}/{name}", self.child.id());
        std::fs::read_to_string(&path).map_err(io_err(path))
    }

    /// User plus system time of all threads.
    fn cpu_seconds(&self) -> Result<f64, BenchError> {
        let stat = self.proc_file("stat")?;
        let after_comm = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
        let fields: Vec<&str> = after_comm.split_whitespace().collect();
        // Fields 14 and 15 of /proc/pid/stat; `after_comm` starts at field 3.
        let ticks: u64 = fields
            .get(11..13)
            .map(|f| f.iter().filter_map(|v| v.parse::<u64>().ok()).sum())
            .unwrap_or_default();
        let hz = rustix::param::clock_ticks_per_second() as f64;
        Ok(ticks as f64 / hz)
    }

    fn peak_rss_kib(&self) -> Result<u64, BenchError> {
        let status = self.proc_file("status")?;
        Ok(status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_default())
    }

    /// Waits until CPU time stops growing for a second.
    fn wait_idle(&mut self) -> Result<(), BenchError> {
        let mut last = self.cpu_seconds()?;
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            std::thread::sleep(Duration::from_secs(1));
            self.check_alive()?;
            let now = self.cpu_seconds()?;
            if now - last < 0.02 {
                return Ok(());
            }
            last = now;
        }
        Err(BenchError::Evictor("still busy two minutes after reaching the target".into()))
    }

    /// SIGTERM, then the time until it exited and whether cleanly.
    fn terminate(&mut self) -> Result<(Duration, bool), BenchError> {
        let pid = rustix::process::Pid::from_child(&self.child);
        let sent = Instant::now();
        rustix::process::kill_process(pid, rustix::process::Signal::TERM)
            .map_err(|e| io_err("sending SIGTERM")(e.into()))?;
        let status = self.child.wait().map_err(io_err("waiting for the evictor"))?;
        self.exited = true;
        Ok((sent.elapsed(), status.success()))
    }
}

impl Drop for Evictor {
    fn drop(&mut self) {
        if !self.exited {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "hangar evict bench: loop-mounted ext4 (strictatime), 8 KiB blocks, 2 ranks, \
             default settings (85 % -> 70 %, 8 crawler threads, batch 100)"
        )?;
        writeln!(
            f,
            "{:>8} {:>6} {:>10} {:>10} {:>8} {:>9} {:>9} {:>6} {:>9} {:>10} {:>13} {:>10}",
            "files",
            "start",
            "to <=70%",
            "bare walk",
            "deleted",
            "files/s",
            "peak RSS",
            "CPU s",
            "idle CPU",
            "SIGTERM",
            "recent kept",
            "order viol"
        )?;
        for r in &self.rows {
            writeln!(
                f,
                "{:>8} {:>5.1}% {:>8.2} s {:>8.2} s {:>8} {:>9.0} {:>5.1} MiB {:>6.2} {:>8.2}% {:>7.0} ms{} {:>6}/{:<6} {:>10}",
                r.files,
                r.start_percent,
                r.to_target.as_secs_f64(),
                r.bare_walk.as_secs_f64(),
                r.deleted,
                r.deleted as f64 / r.to_target.as_secs_f64().max(1e-9),
                r.peak_rss_kib as f64 / 1024.0,
                r.cpu_seconds,
                r.idle_cpu_percent,
                r.sigterm_exit.as_secs_f64() * 1000.0,
                if r.clean_exit { " " } else { "!" },
                r.recent.1,
                r.recent.0,
                r.order_violations,
            )?;
        }
        writeln!(
            f,
            "bare walk: a copy of the same volume, warmed alike, on which a plain walk lists, stats and \
             unlinks the same blocks in the order it finds them, one thread per core"
        )?;
        writeln!(
            f,
            "targets: 500k tree <= 3 s to target, <= 19 MiB RSS, idle CPU < 1 % of a core, \
             exit <= 1 s, every recent block kept, 0 order violations"
        )?;
        writeln!(
            f,
            "python evictor (8 crawlers): 6.4-7.5 s (100k) / 29-40 s (500k), 2,850-3,850 files/s, \
             28-35 CPU s, ~190 MiB, 0.88 core idle, SIGTERM ends in SIGKILL"
        )
    }
}
