//! Shared memory for resident artifacts, and passing it over the socket.
//!
//! A resident artifact lives in a memfd. The daemon maps it writable *before*
//! sealing it with `F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE |
//! F_SEAL_SEAL`: its own mapping keeps working (so it can hand the fd out as
//! soon as memory is allocated and keep loading), while every mapping a
//! client makes can only be read-only and the size can never change under
//! it. This is the CPU analogue of exporting a CUDA IPC handle; a GPU backend
//! would replace this module.
//!
//! The fd travels as `SCM_RIGHTS` ancillary data on the first bytes of a
//! response frame ([`send_frame`], [`recv_frame`]).

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use memmap2::{Mmap, MmapMut, MmapOptions};
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags,
};

use crate::protocol::MAX_FRAME;

/// A sealed memfd of `len` bytes.
#[derive(Debug)]
pub struct SharedRegion {
    fd: OwnedFd,
    len: u64,
}

impl SharedRegion {
    /// Allocates `len` zeroed bytes (at least 1) named `name`, and returns
    /// the sealed region plus the only writable mapping of it. Pages are
    /// materialized by the loaders, chunk by chunk on all cores
    /// ([`populate`]).
    pub fn allocate(name: &str, len: u64) -> io::Result<(SharedRegion, MmapMut)> {
        let len = len.max(1);
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&fd, len)?;
        // SAFETY: the memfd is fresh and ours; after sealing no one else can
        // write it or change its size, so the map stays valid.
        let writer = unsafe { MmapOptions::new().len(len as usize).map_mut(&fd)? };
        rustix::fs::fcntl_add_seals(
            &fd,
            SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE | SealFlags::SEAL,
        )?;
        Ok((SharedRegion { fd, len }, writer))
    }

    /// Allocates `len` zeroed bytes for a producer to fill: sealed only
    /// against resizing, so the client that receives the fd can map it
    /// writable and the daemon can always read `len` bytes of it.
    pub fn allocate_for_producer(name: &str, len: u64) -> io::Result<SharedRegion> {
        let len = len.max(1);
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&fd, len)?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        Ok(SharedRegion { fd, len })
    }

    /// The fd to pass to clients.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region is empty (never: regions are at least 1 byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A read-only mapping (for serving peers and building views).
    pub fn map(&self) -> io::Result<Mmap> {
        map_readonly(self.fd.as_fd(), self.len)
    }
}

/// Allocates and maps the pages behind `range` of a writable mapping in one
/// call (`MADV_POPULATE_WRITE`) instead of one page fault per 4 KiB — on
/// virtual machines the faults cost more than copying the data. `range`
/// must start on a page boundary. Best effort: on kernels without the
/// advice the copy simply faults.
pub fn populate(range: &mut [u8]) {
    // A range that does not start on a page (a caller's target region at
    // an odd offset) is populated from its first whole page on.
    let page = rustix::param::page_size();
    let skip = range.as_ptr().align_offset(page).min(range.len());
    let range = &mut range[skip..];
    if range.is_empty() {
        return;
    }
    // SAFETY: the range is memory we own mutably; populating only
    // allocates and maps its pages, it does not change their contents.
    let r = unsafe {
        rustix::mm::madvise(range.as_mut_ptr().cast(), range.len(), rustix::mm::Advice::LinuxPopulateWrite)
    };
    if let Err(e) = r {
        tracing::debug!(error = %e, "MADV_POPULATE_WRITE unavailable");
    }
}

/// Maps `len` bytes of a received producer region writable.
pub fn map_writable(fd: BorrowedFd<'_>, len: u64) -> io::Result<MmapMut> {
    // SAFETY: the region is sealed against shrinking; the daemon only reads
    // it after the producer commits.
    unsafe { MmapOptions::new().len(len.max(1) as usize).map_mut(fd.as_raw_fd()) }
}

/// Maps `len` bytes of a received region read-only.
pub fn map_readonly(fd: BorrowedFd<'_>, len: u64) -> io::Result<Mmap> {
    // SAFETY: the region is sealed against shrinking, so the mapping cannot
    // fault; its bytes may still be filled in by the daemon until `Confirm`.
    unsafe { MmapOptions::new().len(len.max(1) as usize).map(fd.as_raw_fd()) }
}

/// Why a caller's target region cannot be written (`MaterializeIntoTarget`).
/// Checked before a byte is written; the region is then left untouched.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TargetError {
    /// The request came without a file descriptor.
    #[error("MaterializeIntoTarget needs the target memfd attached to the request (SCM_RIGHTS); none came")]
    NoFd,
    /// The region is empty.
    #[error("the target region is empty (len 0)")]
    Empty,
    /// The fd is not a shared-memory file (memfd).
    #[error("the target is not a memfd (F_GET_SEALS: {0}); create it with memfd_create(MFD_ALLOW_SEALING)")]
    NotMemfd(std::io::Error),
    /// The memfd is sealed against writes.
    #[error("the target memfd is sealed against writes ({0}); the daemon cannot fill it")]
    SealedAgainstWrites(&'static str),
    /// The memfd may shrink under the daemon's mapping.
    #[error(
        "the target memfd is not sealed against shrinking: add F_SEAL_SHRINK (a shrink under the daemon's \
         mapping would fault it; StoreClient's TargetMemory does this)"
    )]
    NotSealedAgainstShrink,
    /// The fd was opened read-only.
    #[error("the target fd is open read-only; pass a read-write memfd")]
    ReadOnly,
    /// The region reaches past the memfd's end.
    #[error("the target region {offset}..{end} reaches past the end of the memfd, which is {size} bytes")]
    BeyondEnd {
        /// Region start.
        offset: u64,
        /// Region end.
        end: u64,
        /// The memfd's size.
        size: u64,
    },
    /// The region is smaller than what is to be written into it.
    #[error("the target region is {region} bytes, smaller than the {need} bytes of {what}")]
    TooSmall {
        /// Region bytes.
        region: u64,
        /// Bytes of the artifact or view.
        need: u64,
        /// The artifact or view id.
        what: String,
    },
    /// The kernel refused something else (mapping, `fstat`).
    #[error("the target memfd: {0}")]
    Io(std::io::Error),
}

/// A caller's region of its own memfd, mapped writable by the daemon for
/// one `MaterializeIntoTarget` and unmapped when dropped: the daemon holds
/// no other reference to it.
#[derive(Debug)]
pub struct TargetMap {
    map: MmapMut,
    skip: usize,
    len: usize,
}

impl TargetMap {
    /// Checks that `fd` is a memfd the daemon may write `offset..offset+len`
    /// of — not sealed against writes, sealed against shrinking (so the
    /// mapping can never fault), open read-write, large enough — and maps
    /// that region. The fd may be closed afterwards; the mapping keeps the
    /// memory.
    pub fn open(fd: BorrowedFd<'_>, offset: u64, len: u64) -> Result<TargetMap, TargetError> {
        if len == 0 {
            return Err(TargetError::Empty);
        }
        let seals = rustix::fs::fcntl_get_seals(fd).map_err(|e| TargetError::NotMemfd(e.into()))?;
        if seals.contains(SealFlags::WRITE) {
            return Err(TargetError::SealedAgainstWrites("F_SEAL_WRITE"));
        }
        if seals.contains(SealFlags::FUTURE_WRITE) {
            return Err(TargetError::SealedAgainstWrites("F_SEAL_FUTURE_WRITE"));
        }
        if !seals.contains(SealFlags::SHRINK) {
            return Err(TargetError::NotSealedAgainstShrink);
        }
        let flags = rustix::fs::fcntl_getfl(fd).map_err(|e| TargetError::Io(e.into()))?;
        if !flags.contains(rustix::fs::OFlags::RDWR) {
            return Err(TargetError::ReadOnly);
        }
        let size = rustix::fs::fstat(fd).map_err(|e| TargetError::Io(e.into()))?.st_size as u64;
        let end = offset.saturating_add(len);
        if end > size {
            return Err(TargetError::BeyondEnd { offset, end, size });
        }
        let page = rustix::param::page_size() as u64;
        let base = offset / page * page;
        let skip = (offset - base) as usize;
        // SAFETY: the memfd is sealed against shrinking and the region lies
        // inside it, so the mapping cannot fault; its bytes are the
        // caller's, which lent them for this call.
        let map = unsafe { MmapOptions::new().offset(base).len(skip + len as usize).map_mut(fd.as_raw_fd()) }
            .map_err(TargetError::Io)?;
        Ok(TargetMap { map, skip, len: len as usize })
    }

    /// The region's length.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// Whether the region is empty (never: [`TargetMap::open`] refuses that).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The region's bytes.
    pub fn bytes(&mut self) -> &mut [u8] {
        &mut self.map[self.skip..self.skip + self.len]
    }
}

/// Builds a frame: `u32 LE length ‖ payload`.
pub fn frame(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + payload.len());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// Sends one frame, with `fd` attached to its first bytes if given
/// (blocking socket).
pub fn send_frame(stream: &UnixStream, payload: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let bytes = frame(payload);
    let sent = sendmsg_with_fd(stream, &bytes, fd)?;
    (&*stream).write_all(&bytes[sent..])
}

/// One `sendmsg` of (a prefix of) `bytes` carrying `fd`; returns bytes sent.
pub fn sendmsg_with_fd(sock: impl AsFd, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<usize> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut anc = SendAncillaryBuffer::new(&mut space);
    let fds;
    if let Some(fd) = fd {
        fds = [fd];
        anc.push(SendAncillaryMessage::ScmRights(&fds));
    }
    Ok(rustix::net::sendmsg(sock, &[IoSlice::new(bytes)], &mut anc, SendFlags::NOSIGNAL)?)
}

/// Receives one frame and any fds that came with it (blocking socket).
/// Returns `Ok(None)` on a clean end of stream before a frame started.
pub fn recv_frame(stream: &UnixStream) -> io::Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
    let mut fds = Vec::new();
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
        let mut anc = RecvAncillaryBuffer::new(&mut space);
        let msg = rustix::net::recvmsg(
            stream,
            &mut [IoSliceMut::new(&mut len[got..])],
            &mut anc,
            RecvFlags::CMSG_CLOEXEC,
        )?;
        for m in anc.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = m {
                fds.extend(received);
            }
        }
        if msg.bytes == 0 {
            return if got == 0 { Ok(None) } else { Err(io::ErrorKind::UnexpectedEof.into()) };
        }
        got += msg.bytes;
    }
    let n = u32::from_le_bytes(len);
    if n > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {n} bytes exceeds {MAX_FRAME}"),
        ));
    }
    let mut payload = vec![0u8; n as usize];
    (&*stream).read_exact(&mut payload)?;
    Ok(Some((payload, fds)))
}
