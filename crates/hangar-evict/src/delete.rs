//! The deleter: batched `unlinkat` relative to open directory handles, with
//! the last-use time re-checked immediately before each unlink.
//!
//! A file selected at crawl time and read since (its `max(atime, mtime)`
//! moved forward, or now lies within `FILE_ACCESS_TIME_THRESHOLD_MINUTES`)
//! is spared: the Python evictor looked at atime only when crawling and
//! deleted blocks a request had just loaded. A file that vanished meanwhile
//! is counted and skipped.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, OwnedFd};

use crate::config::Config;
use crate::crawl::Shard;
use crate::fsops::{self, Opener};
use crate::layout;
use crate::select::Candidate;
use crate::stats::Stats;

/// A block the deleter removed, for `BlockRemoved` events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removed {
    /// Model the block belongs to.
    pub model: std::sync::Arc<str>,
    /// Block hash from the file name.
    pub hash: u64,
}

/// Outcome of one batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchOutcome {
    /// Files removed (reported, in a dry run).
    pub deleted: u64,
    /// Bytes those files occupied.
    pub bytes: u64,
}

/// Deletes batches of one sweep's candidates.
pub(crate) struct Deleter<'a> {
    pub(crate) config: &'a Config,
    pub(crate) shards: &'a [Shard],
    pub(crate) opener: &'a Opener,
    pub(crate) stats: &'a Stats,
    /// Files used after this instant are never deleted.
    pub(crate) hot_cutoff_ns: i64,
    /// Handle of the previous file's leaf directory, reused when the next
    /// file lives in the same one.
    leaf: Option<((u32, u16, layout::Leaf), OwnedFd)>,
}

impl<'a> Deleter<'a> {
    pub(crate) fn new(
        config: &'a Config,
        shards: &'a [Shard],
        opener: &'a Opener,
        stats: &'a Stats,
        hot_cutoff_ns: i64,
    ) -> Self {
        Deleter { config, shards, opener, stats, hot_cutoff_ns, leaf: None }
    }

    /// Processes `batch` in order; `removed` receives each removed block.
    pub(crate) fn batch(&mut self, batch: &[Candidate], removed: &mut impl FnMut(Removed)) -> BatchOutcome {
        let mut out = BatchOutcome::default();
        for c in batch {
            match self.one(c) {
                Ok(Some(bytes)) => {
                    out.deleted += 1;
                    out.bytes += bytes;
                    removed(Removed { model: self.shards[c.shard as usize].model.clone(), hash: c.hash });
                }
                Ok(None) => {}
                Err(e) => {
                    Stats::add(&self.stats.errors, 1);
                    let path = self.shards[c.shard as usize].file_path(c);
                    tracing::warn!(file = %path.display(), error = %e, "unlink failed");
                }
            }
        }
        Stats::add(&self.stats.deleted, out.deleted);
        Stats::add(&self.stats.bytes_freed, out.bytes);
        out
    }

    /// `Ok(Some(bytes))` when removed, `Ok(None)` when spared or vanished.
    fn one(&mut self, c: &Candidate) -> io::Result<Option<u64>> {
        let (config, shards, stats, hot_cutoff_ns) =
            (self.config, self.shards, self.stats, self.hot_cutoff_ns);
        let Some(leaf) = self.leaf_dir(c)? else {
            Stats::add(&stats.vanished, 1);
            return Ok(None);
        };
        let name = CString::new(layout::block_file_name(c.hash)).expect("hex has no NUL");
        let Some(now) = fsops::stat(leaf.as_fd(), &name)?.filter(|i| i.regular) else {
            Stats::add(&stats.vanished, 1);
            return Ok(None);
        };
        if now.last_use_ns > c.last_use_ns || now.last_use_ns > hot_cutoff_ns {
            Stats::add(&stats.spared_recently_used, 1);
            return Ok(None);
        }
        let bytes = now.blocks * 512;
        if config.dry_run {
            let path = shards[c.shard as usize].file_path(c);
            tracing::info!(file = %path.display(), bytes, "dry run: would delete");
            return Ok(Some(bytes));
        }
        if fsops::unlink(leaf.as_fd(), &name)? {
            Ok(Some(bytes))
        } else {
            Stats::add(&stats.vanished, 1);
            Ok(None)
        }
    }

    /// The open leaf directory of `c`, or `None` if it vanished.
    fn leaf_dir(&mut self, c: &Candidate) -> io::Result<Option<&OwnedFd>> {
        let key = (c.shard, c.bucket, c.leaf);
        if self.leaf.as_ref().is_none_or(|(k, _)| *k != key) {
            self.leaf = None;
            let shard = &self.shards[c.shard as usize];
            let bucket = shard.layout.bucket_name(c.bucket);
            let leaf = shard.layout.leaf_name(c.leaf);
            match self.opener.dir_beneath(shard.fd.as_fd(), &bucket, &leaf) {
                Ok(fd) => self.leaf = Some((key, fd)),
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(e),
            }
        }
        Ok(self.leaf.as_ref().map(|(_, fd)| fd))
    }
}
