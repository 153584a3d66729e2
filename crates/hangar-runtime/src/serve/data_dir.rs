//! One server per data directory: an exclusive lock on `data_dir`.
//!
//! Two servers on one directory would each take the other's running
//! predictions for abandoned at start-up and fail or re-run them. So
//! `hangar serve` holds an advisory `flock` on `data_dir/lock` for its whole
//! life; the kernel releases it when the process dies, however it dies, so
//! a crash never leaves a stale lock. The file holds the PID of the holder,
//! which a refused server names.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use rustix::fs::{flock, FlockOperation};

/// The lock file's name inside the data directory.
pub const LOCK_FILE: &str = "lock";

/// Why the data directory could not be taken.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataDirError {
    /// Another process holds it.
    #[error(
        "the data directory {dir} is in use by another hangar serve (PID {pid}); stop it, or give this \
         one its own data_dir"
    )]
    InUse {
        /// The directory.
        dir: PathBuf,
        /// The holder's PID as it wrote it (`unknown` if unreadable).
        pid: String,
    },
    /// The directory or its lock file could not be created or locked.
    #[error("cannot lock the data directory {dir}: {source}")]
    Io {
        /// The directory.
        dir: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

/// The held lock; dropping it (or the process ending) releases it.
#[derive(Debug)]
pub struct DataDirLock {
    _file: File,
}

impl DataDirLock {
    /// Creates `dir` if needed and takes its lock, without waiting.
    pub fn acquire(dir: &Path) -> Result<Self, DataDirError> {
        let io = |source| DataDirError::Io { dir: dir.to_owned(), source };
        std::fs::create_dir_all(dir).map_err(io)?;
        let mut file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(dir.join(LOCK_FILE))
            .map_err(io)?;
        match flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => {
                let mut pid = String::new();
                let _ = file.read_to_string(&mut pid);
                let pid = pid.trim();
                let pid = if pid.is_empty() { "unknown".to_owned() } else { pid.to_owned() };
                return Err(DataDirError::InUse { dir: dir.to_owned(), pid });
            }
            Err(e) => return Err(io(e.into())),
        }
        file.set_len(0).map_err(io)?;
        file.rewind().map_err(io)?;
        writeln!(file, "{}", std::process::id()).map_err(io)?;
        file.sync_all().map_err(io)?;
        Ok(DataDirLock { _file: file })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_naming_the_directory_and_pid_until_the_first_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let first = DataDirLock::acquire(&data).unwrap();
        // flock locks belong to the open file, so a second open in the same
        // process conflicts as another process would.
        let e = DataDirLock::acquire(&data).unwrap_err();
        let message = e.to_string();
        assert!(message.contains(&data.display().to_string()), "{message}");
        assert!(message.contains(&format!("PID {}", std::process::id())), "{message}");
        drop(first);
        DataDirLock::acquire(&data).unwrap();
    }
}
