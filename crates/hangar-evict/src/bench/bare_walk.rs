//! The reference the evictor is compared with: the least work any evictor
//! must do on the same volume — list every directory once, stat every
//! block, unlink the ones old enough, in the order the walk finds them —
//! with one thread per core, no selection, no usage checks, no re-checks.
//!
//! It runs on a copy of the evictor's image taken before the evictor
//! starts, after the same warm-up walk, and deletes exactly as many blocks
//! as the evictor did (everything at or below the evictor's final cutoff),
//! so the two figures differ only by what the evictor adds.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use crate::fsops::{self, Listing, Opener};

/// What one walk did.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Walk {
    pub(crate) elapsed: Duration,
    pub(crate) files: u64,
    pub(crate) deleted: u64,
}

/// Walks the shard directories `mount/cache_directory/*/` bucket by bucket
/// on `threads` threads, unlinking each block whose last use is at or
/// before `delete_up_to_ns` (`None`: delete nothing, only warm the caches).
/// The root is opened as the evictor opens it: no symlinks, same filesystem.
pub(crate) fn walk(
    mount: &Path,
    cache_directory: &Path,
    threads: usize,
    delete_up_to_ns: Option<i64>,
) -> io::Result<Walk> {
    let opener = Opener::default();
    let root_fd = fsops::open_root(mount, cache_directory).map_err(io::Error::other)?.fd;
    let mut buckets = Vec::new();
    let mut shards = Listing::reopen(root_fd.as_fd())?;
    while let Some(shard) = shards.next_entry() {
        let shard = shard?;
        if !shard.is_dir() {
            continue;
        }
        let shard_fd = opener.dir(root_fd.as_fd(), &shard.name)?;
        let mut listing = Listing::reopen(shard_fd.as_fd())?;
        let shard_fd = std::sync::Arc::new(shard_fd);
        while let Some(bucket) = listing.next_entry() {
            let bucket = bucket?;
            if bucket.is_dir() {
                buckets.push((shard_fd.clone(), bucket.name));
            }
        }
    }
    let next = AtomicUsize::new(0);
    let files = AtomicU64::new(0);
    let deleted = AtomicU64::new(0);
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1) {
            scope.spawn(|| {
                while let Some((shard, name)) = buckets.get(next.fetch_add(1, Relaxed)) {
                    let Ok(bucket) = opener.dir(shard.as_fd(), name) else { continue };
                    let Ok(mut leaves) = Listing::reopen(bucket.as_fd()) else { continue };
                    while let Some(Ok(leaf)) = leaves.next_entry() {
                        let Ok(fd) = opener.dir(leaves.fd(), &leaf.name) else { continue };
                        let Ok(listing) = Listing::new(fd) else { continue };
                        let (f, d) = leaf_files(listing, delete_up_to_ns);
                        files.fetch_add(f, Relaxed);
                        deleted.fetch_add(d, Relaxed);
                    }
                }
            });
        }
    });
    Ok(Walk { elapsed: started.elapsed(), files: files.into_inner(), deleted: deleted.into_inner() })
}

/// Stats (and maybe unlinks) the files of one leaf: (files, deleted).
fn leaf_files(mut listing: Listing, delete_up_to_ns: Option<i64>) -> (u64, u64) {
    let (mut files, mut deleted) = (0, 0);
    while let Some(Ok(entry)) = listing.next_entry() {
        let dir: BorrowedFd<'_> = listing.fd();
        let Ok(Some(info)) = fsops::stat(dir, &entry.name) else { continue };
        files += 1;
        if delete_up_to_ns.is_some_and(|up_to| info.regular && info.last_use_ns <= up_to)
            && fsops::unlink(dir, &entry.name).unwrap_or(false)
        {
            deleted += 1;
        }
    }
    (files, deleted)
}
