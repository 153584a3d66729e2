//! Thin, symlink-proof directory primitives relative to open directory
//! handles: nothing here resolves a path from the root again, so a rename or
//! a symlink planted mid-sweep cannot redirect an `unlinkat` outside the tree.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use rustix::fs::{self as rfs, AtFlags, Dir, FileType, Mode, OFlags};
use rustix::io::Errno;

/// Opens directories with `O_NOFOLLOW` and, when the process may (owner or
/// `CAP_FOWNER`), `O_NOATIME`, so crawling does not dirty every directory
/// inode on a `strictatime` mount.
#[derive(Debug)]
pub(crate) struct Opener {
    noatime: AtomicBool,
    openat2: AtomicBool,
}

impl Default for Opener {
    fn default() -> Self {
        Opener { noatime: AtomicBool::new(true), openat2: AtomicBool::new(true) }
    }
}

impl Opener {
    /// Opens `name` under `parent` as a directory, never through a symlink.
    pub(crate) fn dir(&self, parent: BorrowedFd<'_>, name: &CStr) -> io::Result<OwnedFd> {
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        if self.noatime.load(Relaxed) {
            match rfs::openat(parent, name, flags | OFlags::NOATIME, Mode::empty()) {
                Err(Errno::PERM) => self.noatime.store(false, Relaxed),
                r => return r.map_err(io::Error::from),
            }
        }
        Ok(rfs::openat(parent, name, flags, Mode::empty())?)
    }

    /// Opens the directory `first/second` below `parent` in one `openat2`
    /// that refuses symlinks anywhere on the way and never leaves `parent`;
    /// on kernels without `openat2` (before 5.6), one no-follow step at a time.
    pub(crate) fn dir_beneath(
        &self,
        parent: BorrowedFd<'_>,
        first: &str,
        second: &str,
    ) -> io::Result<OwnedFd> {
        use rustix::fs::ResolveFlags as R;
        let cstr = |s: String| CString::new(s).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput));
        if self.openat2.load(Relaxed) {
            let path = cstr(format!("{first}/{second}"))?;
            let resolve = R::NO_SYMLINKS | R::BENEATH | R::NO_MAGICLINKS | R::NO_XDEV;
            let mut flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
            if self.noatime.load(Relaxed) {
                flags |= OFlags::NOATIME;
            }
            match rfs::openat2(parent, &path, flags, Mode::empty(), resolve) {
                Ok(fd) => return Ok(fd),
                Err(Errno::NOSYS) => self.openat2.store(false, Relaxed),
                Err(Errno::PERM) if flags.contains(OFlags::NOATIME) => {
                    self.noatime.store(false, Relaxed);
                    return self.dir_beneath(parent, first, second);
                }
                Err(e) => return Err(e.into()),
            }
        }
        let mid = self.dir(parent, &cstr(first.to_owned())?)?;
        self.dir(mid.as_fd(), &cstr(second.to_owned())?)
    }
}

/// The cache root, opened from `/` one component at a time, none of them a
/// symlink, and known to be on the filesystem of the measured mount.
#[derive(Debug)]
pub(crate) struct Root {
    pub(crate) fd: OwnedFd,
    /// `st_dev` of the root (and of the mount).
    pub(crate) dev: u64,
}

/// Why the cache root could not be opened.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RootError {
    /// A component of the path is a symbolic link: refused, never followed.
    #[error("{} is a symbolic link", component.display())]
    Symlink {
        /// The path up to and including the symlink.
        component: PathBuf,
    },
    /// The root is on another filesystem than the mount path.
    #[error("it is on another filesystem (device {root_dev}) than PVC_MOUNT_PATH {} (device {mount_dev})", mount.display())]
    OtherFilesystem { mount: PathBuf, root_dev: String, mount_dev: String },
    /// A component is missing, not a directory or unreadable.
    #[error("{}: {source}", component.display())]
    Io {
        /// The path up to and including the component that failed.
        component: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl RootError {
    /// Whether the root simply does not exist (yet).
    pub(crate) fn is_missing(&self) -> bool {
        matches!(self, RootError::Io { source, .. } if source.kind() == io::ErrorKind::NotFound)
    }
}

/// Opens `mount/cache_directory` without following a symlink anywhere: `/`,
/// then each component with `O_NOFOLLOW | O_DIRECTORY` relative to its
/// parent's handle (`O_PATH` on the way, so only search permission is
/// needed, as for a path lookup). A symlinked component is refused and
/// named; the root must be on the same filesystem (`st_dev`) as `mount`,
/// whose usage is measured, since deleting anywhere else can never lower it.
pub(crate) fn open_root(mount: &Path, cache_directory: &Path) -> Result<Root, RootError> {
    let mut at = PathBuf::from("/");
    let io_at = |at: &Path, e: Errno| RootError::Io { component: at.to_owned(), source: e.into() };
    let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let top = rfs::open("/", flags, Mode::empty()).map_err(|e| io_at(&at, e))?;
    if !mount.is_absolute() {
        let source = io::Error::new(io::ErrorKind::InvalidInput, "not an absolute path");
        return Err(RootError::Io { component: mount.to_owned(), source });
    }
    let mount_fd = descend(top, &mut at, mount)?;
    let mount_dev = rfs::fstat(&mount_fd).map_err(|e| io_at(&at, e))?.st_dev;
    let dir = descend(mount_fd, &mut at, cache_directory)?;
    let readable = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
    let fd = rfs::openat(&dir, c".", readable, Mode::empty()).map_err(|e| io_at(&at, e))?;
    let dev = rfs::fstat(&fd).map_err(|e| io_at(&at, e))?.st_dev;
    if dev != mount_dev {
        let show = |d: u64| format!("{}:{}", rfs::major(d), rfs::minor(d));
        return Err(RootError::OtherFilesystem {
            mount: mount.to_owned(),
            root_dev: show(dev),
            mount_dev: show(mount_dev),
        });
    }
    Ok(Root { fd, dev })
}

/// Opens each component of `rel` below `dir` with `O_PATH | O_NOFOLLOW |
/// O_DIRECTORY`, extending `at` as it goes.
fn descend(mut dir: OwnedFd, at: &mut PathBuf, rel: &Path) -> Result<OwnedFd, RootError> {
    use std::os::unix::ffi::OsStrExt;
    use std::path::Component;
    let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    for component in rel.components() {
        let name = match component {
            Component::RootDir | Component::CurDir => continue,
            Component::Prefix(_) => unreachable!("no path prefixes on Unix"),
            Component::ParentDir => c"..".to_owned(),
            Component::Normal(name) => CString::new(name.as_bytes()).map_err(|_| RootError::Io {
                component: at.join(name),
                source: io::ErrorKind::InvalidInput.into(),
            })?,
        };
        at.push(component);
        dir = match rfs::openat(&dir, &name, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(e @ (Errno::NOTDIR | Errno::LOOP)) => {
                let symlink = rfs::statat(&dir, &name, AtFlags::SYMLINK_NOFOLLOW)
                    .is_ok_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::Symlink);
                if symlink {
                    return Err(RootError::Symlink { component: at.clone() });
                }
                return Err(RootError::Io { component: at.clone(), source: e.into() });
            }
            Err(e) => return Err(RootError::Io { component: at.clone(), source: e.into() }),
        };
    }
    Ok(dir)
}

/// One directory entry other than `.` and `..`.
pub(crate) struct Entry {
    pub(crate) name: CString,
    pub(crate) kind: FileType,
}

impl Entry {
    pub(crate) fn bytes(&self) -> &[u8] {
        self.name.to_bytes()
    }

    pub(crate) fn is_dir(&self) -> bool {
        self.kind == FileType::Directory
    }
}

/// Streams the entries of a directory, resolving `DT_UNKNOWN` with a
/// no-follow `fstatat`.
pub(crate) struct Listing {
    dir: Dir,
}

impl Listing {
    pub(crate) fn new(fd: OwnedFd) -> io::Result<Listing> {
        Ok(Listing { dir: Dir::new(fd)? })
    }

    /// Lists a directory that is already open, through a fresh handle so
    /// the caller's handle keeps its position.
    pub(crate) fn reopen(dir: BorrowedFd<'_>) -> io::Result<Listing> {
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
        Listing::new(rfs::openat(dir, c".", flags, Mode::empty())?)
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.dir.fd().expect("Dir::fd is infallible on Linux")
    }

    /// The next entry, `None` at the end. Errors end the listing.
    pub(crate) fn next_entry(&mut self) -> Option<io::Result<Entry>> {
        loop {
            let e = match self.dir.read()? {
                Ok(e) => e,
                Err(err) => return Some(Err(err.into())),
            };
            let name = e.file_name();
            if name == c"." || name == c".." {
                continue;
            }
            let mut kind = e.file_type();
            let name = name.to_owned();
            if kind == FileType::Unknown {
                match rfs::statat(self.fd(), &name, AtFlags::SYMLINK_NOFOLLOW) {
                    Ok(st) => kind = FileType::from_raw_mode(st.st_mode),
                    Err(Errno::NOENT) => continue,
                    Err(err) => return Some(Err(err.into())),
                }
            }
            return Some(Ok(Entry { name, kind }));
        }
    }
}

/// What a no-follow `fstatat` says about a file.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FileInfo {
    pub(crate) regular: bool,
    /// `max(atime, mtime)` in nanoseconds since the epoch.
    pub(crate) last_use_ns: i64,
    pub(crate) mtime_ns: i64,
    pub(crate) blocks: u64,
    pub(crate) ino: u64,
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`; `Ok(None)` if it vanished.
pub(crate) fn stat(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<Option<FileInfo>> {
    match rfs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(info(&st))),
        Err(Errno::NOENT) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

// `stat` field types differ between targets; the casts are no-ops on x86_64 only.
#[allow(clippy::unnecessary_cast)]
fn info(st: &rfs::Stat) -> FileInfo {
    let ns = |s: i64, n: i64| s.saturating_mul(1_000_000_000).saturating_add(n);
    let atime = ns(st.st_atime as i64, st.st_atime_nsec as i64);
    let mtime = ns(st.st_mtime as i64, st.st_mtime_nsec as i64);
    FileInfo {
        regular: FileType::from_raw_mode(st.st_mode) == FileType::RegularFile,
        last_use_ns: atime.max(mtime),
        mtime_ns: mtime,
        blocks: st.st_blocks as u64,
        ino: st.st_ino as u64,
    }
}

/// Modification time of an open directory.
pub(crate) fn dir_mtime_ns(fd: impl AsFd) -> io::Result<i64> {
    Ok(info(&rfs::fstat(fd)?).mtime_ns)
}

/// `unlinkat(dir, name, 0)`; `Ok(false)` if it had already vanished.
pub(crate) fn unlink(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<bool> {
    match rfs::unlinkat(dir, name, AtFlags::empty()) {
        Ok(()) => Ok(true),
        Err(Errno::NOENT) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// `rmdir` relative to `parent`; `Ok(false)` if it is not empty any more or
/// vanished — a writer got there first, which is fine.
pub(crate) fn rmdir(parent: BorrowedFd<'_>, name: &CStr) -> io::Result<bool> {
    match rfs::unlinkat(parent, name, AtFlags::REMOVEDIR) {
        Ok(()) => Ok(true),
        Err(Errno::NOENT | Errno::NOTEMPTY | Errno::EXIST | Errno::BUSY) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Current time in nanoseconds since the epoch.
pub(crate) fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}
