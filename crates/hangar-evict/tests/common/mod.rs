//! Shared fixtures: generated trees in temporary directories and a usage
//! source the test controls.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use hangar_evict::synth::{BlockFile, TreeSpec};
use hangar_evict::{Config, Usage};

/// A cache root in a temporary directory: `<tmp>/mnt/cache`.
pub struct Fixture {
    pub tmp: tempfile::TempDir,
    pub root: PathBuf,
}

impl Fixture {
    pub fn new() -> Fixture {
        Fixture::in_dir(tempfile::tempdir().expect("tempdir"))
    }

    /// A fixture on tmpfs (`/dev/shm`) where there is one, for tests that
    /// write many trees: on a busy disk a 2,000-file tree takes seconds.
    pub fn in_memory() -> Fixture {
        let shm = Path::new("/dev/shm");
        // The evictor refuses a symlink on the way to its root.
        let real = std::fs::canonicalize(shm).is_ok_and(|r| r == shm);
        match real.then(|| tempfile::tempdir_in(shm).ok()).flatten() {
            Some(tmp) => Fixture::in_dir(tmp),
            None => Fixture::new(),
        }
    }

    pub fn in_dir(tmp: tempfile::TempDir) -> Fixture {
        let root = tmp.path().join("mnt/cache");
        std::fs::create_dir_all(&root).expect("mkdir");
        Fixture { tmp, root }
    }

    pub fn mount(&self) -> PathBuf {
        self.tmp.path().join("mnt")
    }

    /// Config over this fixture with `extra` settings.
    pub fn config(&self, extra: &[(&str, &str)]) -> Config {
        let mut env: HashMap<String, String> = [
            ("PVC_MOUNT_PATH", self.mount().to_str().expect("utf8").to_owned()),
            ("CACHE_DIRECTORY", "cache".to_owned()),
            ("NUM_CRAWLER_PROCESSES", "2".to_owned()),
            ("FILE_QUEUE_MIN_SIZE", "1".to_owned()),
            ("DELETION_BATCH_SIZE", "10".to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        Config::from_lookup(|k| env.get(k).cloned()).expect("valid test config")
    }

    /// Writes a tree of `files` cold 4 KiB blocks (current layout).
    pub fn tree(&self, spec: TreeSpec) -> Vec<BlockFile> {
        spec.write(&self.root, SystemTime::now(), 2).expect("write tree")
    }

    pub fn exists(&self, f: &BlockFile) -> bool {
        self.root.join(&f.path).symlink_metadata().is_ok()
    }

    pub fn remaining(&self, files: &[BlockFile]) -> Vec<BlockFile> {
        files.iter().filter(|f| self.exists(f)).cloned().collect()
    }
}

pub fn spec(files: usize) -> TreeSpec {
    TreeSpec { files, ..TreeSpec::default() }
}

/// Marks `path` as read at `when` (its atime), leaving its mtime: what a
/// block read by an engine looks like on a `strictatime` mount.
pub fn read_at(path: &Path, when: SystemTime) {
    let mtime = path.metadata().expect("stat").modified().expect("mtime");
    hangar_evict::synth::set_times(path, when, mtime).expect("utimensat");
}

/// Usage measured from the tree itself: bytes of regular files under
/// `root` (what the evictor can free) plus `other_bytes`, out of `capacity`.
#[derive(Clone)]
pub struct TreeUsage {
    pub root: PathBuf,
    pub capacity: u64,
    pub other_bytes: Arc<Mutex<u64>>,
}

impl TreeUsage {
    /// A capacity at which the tree fills `percent` of the volume.
    pub fn filled_to(root: &Path, percent: f64) -> TreeUsage {
        let used = tree_bytes(root);
        TreeUsage {
            root: root.to_owned(),
            capacity: (used as f64 * 100.0 / percent).round() as u64,
            other_bytes: Arc::default(),
        }
    }

    pub fn usage(&self) -> io::Result<Usage> {
        let used = tree_bytes(&self.root) + *self.other_bytes.lock().unwrap();
        Ok(Usage { used_bytes: used, avail_bytes: self.capacity.saturating_sub(used) })
    }

    pub fn source(&self) -> impl Fn() -> io::Result<Usage> + Send + Sync + 'static {
        let this = self.clone();
        move || this.usage()
    }

    pub fn percent(&self) -> f64 {
        self.usage().unwrap().percent()
    }
}

/// Allocated bytes of the regular files below `dir`, never following links.
pub fn tree_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| match e.path().symlink_metadata() {
            Ok(m) if m.is_dir() => tree_bytes(&e.path()),
            Ok(m) if m.is_file() => m.blocks() * 512,
            _ => 0,
        })
        .sum()
}

/// A usage source returning whatever percentage the test sets.
#[derive(Clone, Default)]
pub struct Dial(pub Arc<Mutex<f64>>);

impl Dial {
    pub fn set(&self, percent: f64) {
        *self.0.lock().unwrap() = percent;
    }

    pub fn source(&self) -> impl Fn() -> io::Result<Usage> + Send + Sync + 'static {
        let this = self.clone();
        move || {
            let p = *this.0.lock().unwrap();
            Ok(Usage {
                used_bytes: (p * 1_000_000.0) as u64,
                avail_bytes: ((100.0 - p) * 1_000_000.0) as u64,
            })
        }
    }
}

/// Waits for `cond` up to a generous bound (liveness, not speed).
pub fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::time::Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    cond()
}
