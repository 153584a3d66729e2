//! Synthetic FileMapper trees for tests and the benchmark: real directories
//! and files in either layout, with chosen sizes and access times, generated
//! from a seed.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::layout::{self, Layout, Leaf};

/// Shape of a generated tree.
#[derive(Debug, Clone)]
pub struct TreeSpec {
    /// Layout to write.
    pub layout: Layout,
    /// Model name (may contain `/`).
    pub model: String,
    /// Rank directories per model.
    pub ranks: u32,
    /// Block files in total.
    pub files: usize,
    /// Bytes per file (the smallest, with `max_file_bytes`).
    pub file_bytes: usize,
    /// Largest file: sizes are uniform from `file_bytes` to this; at or
    /// below `file_bytes`, every file has `file_bytes`.
    pub max_file_bytes: usize,
    /// Last uses are spread uniformly over this span before `now`.
    pub age_span: Duration,
    /// Fraction of files used within `hot_window` before `now`.
    pub hot_fraction: f64,
    /// Recent window for hot files.
    pub hot_window: Duration,
    /// Youngest last use of a cold file (at least `hot_window`).
    pub min_cold_age: Duration,
    /// dtype directory name of the older layout (e.g. `bf16`).
    pub dtype: String,
    /// Seed for hashes and ages.
    pub seed: u64,
}

impl Default for TreeSpec {
    fn default() -> Self {
        TreeSpec {
            layout: Layout::Current { bucket_len: 3 },
            model: "meta-llama/Llama-3.1-8B".into(),
            ranks: 1,
            files: 100,
            file_bytes: 4096,
            max_file_bytes: 0,
            age_span: Duration::from_secs(3 * 86_400),
            hot_fraction: 0.0,
            hot_window: Duration::from_secs(30 * 60),
            min_cold_age: Duration::from_secs(2 * 3600),
            dtype: "bfloat16".into(),
            seed: 7,
        }
    }
}

/// One generated block file.
#[derive(Debug, Clone)]
pub struct BlockFile {
    /// Path relative to the cache root.
    pub path: PathBuf,
    /// Block hash.
    pub hash: u64,
    /// Last use (atime) given to the file.
    pub last_use: SystemTime,
    /// Whether it falls in the hot window.
    pub hot: bool,
    /// Bytes written.
    pub bytes: usize,
}

impl TreeSpec {
    /// Directory of rank `rank`, relative to the cache root.
    pub fn shard_dir(&self, rank: u32) -> PathBuf {
        match self.layout {
            Layout::Current { .. } => PathBuf::from(format!("{}_{}_r{rank}", self.safe_model(), DIGEST)),
            Layout::Legacy => PathBuf::from(&self.model)
                .join("block_size_16_blocks_per_file_1")
                .join("tp_1_pp_size_1_pcp_size_1")
                .join(format!("rank_{rank}"))
                .join(&self.dtype),
        }
    }

    fn safe_model(&self) -> String {
        self.model.replace('/', "--")
    }

    /// Plans the files (paths, hashes, ages) without touching the disk.
    pub fn plan(&self, now: SystemTime) -> Vec<BlockFile> {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        let min_cold = self.min_cold_age.max(self.hot_window);
        let cold_span = self.age_span.saturating_sub(min_cold);
        (0..self.files)
            .map(|i| {
                let hash: u64 = rng.random();
                let rank = i as u32 % self.ranks.max(1);
                let hot = rng.random::<f64>() < self.hot_fraction;
                let age = if hot {
                    self.hot_window.mul_f64(rng.random::<f64>())
                } else {
                    min_cold + cold_span.mul_f64(rng.random::<f64>())
                };
                // Drawn last and only when sizes vary, so trees of one size
                // stay what they were for a given seed.
                let bytes = match self.max_file_bytes > self.file_bytes {
                    true => rng.random_range(self.file_bytes..=self.max_file_bytes),
                    false => self.file_bytes,
                };
                let hex = format!("{hash:016x}");
                let bucket_len = self.layout.bucket_len();
                let hh = u8::from_str_radix(&hex[bucket_len..bucket_len + 2], 16).unwrap_or(0);
                let leaf = Leaf { hh, group: matches!(self.layout, Layout::Current { .. }).then_some(0) };
                let path = self
                    .shard_dir(rank)
                    .join(&hex[..bucket_len])
                    .join(self.layout.leaf_name(leaf))
                    .join(layout::block_file_name(hash));
                BlockFile { path, hash, last_use: now - age, hot, bytes }
            })
            .collect()
    }

    /// Writes the tree under `root` using `threads` writers and returns the
    /// files written.
    pub fn write(&self, root: &Path, now: SystemTime, threads: usize) -> io::Result<Vec<BlockFile>> {
        let files = self.plan(now);
        if let Layout::Current { .. } = self.layout {
            let base = root.join(format!("{}_{}", self.safe_model(), DIGEST));
            fs::create_dir_all(&base)?;
            let config = serde_json::json!({ "model_name": self.model });
            fs::write(base.join("config.json"), config.to_string())?;
        }
        let payload = vec![0xA5u8; self.file_bytes.max(self.max_file_bytes)];
        let threads = threads.max(1);
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let (files, payload) = (&files, &payload);
                    s.spawn(move || -> io::Result<()> {
                        for f in files.iter().skip(t).step_by(threads) {
                            write_block(&root.join(&f.path), &payload[..f.bytes], f.last_use)?;
                        }
                        Ok(())
                    })
                })
                .collect();
            handles.into_iter().try_for_each(|h| h.join().expect("writer thread panicked"))
        })?;
        Ok(files)
    }
}

/// Digest part of generated current-layout directory names.
const DIGEST: &str = "0123456789ab";

fn write_block(path: &Path, payload: &[u8], last_use: SystemTime) -> io::Result<()> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
    }
    fs::write(path, payload)?;
    set_last_use(path, last_use)
}

/// Sets both atime and mtime of `path` (no-follow) to `t`.
pub fn set_last_use(path: &Path, t: SystemTime) -> io::Result<()> {
    set_times(path, t, t)
}

/// Sets atime and mtime of `path` without following a symlink.
pub fn set_times(path: &Path, atime: SystemTime, mtime: SystemTime) -> io::Result<()> {
    let ts = |t: SystemTime| {
        let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
        rustix::fs::Timespec { tv_sec: d.as_secs() as _, tv_nsec: d.subsec_nanos() as _ }
    };
    let times = rustix::fs::Timestamps { last_access: ts(atime), last_modification: ts(mtime) };
    rustix::fs::utimensat(rustix::fs::CWD, path, &times, rustix::fs::AtFlags::SYMLINK_NOFOLLOW)?;
    Ok(())
}
