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
