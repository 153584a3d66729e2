//! The local socket: framed JSON requests, memfds passed with `SCM_RIGHTS`
//! — in responses (the daemon's memory) and in `MaterializeIntoTarget`
//! requests (the caller's).

use std::io::{self, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
use tokio::io::{AsyncReadExt, Interest};
use tokio::net::{UnixListener, UnixStream};

use super::{error_kind, Core};
use crate::error::StoreError;
use crate::memory::{frame, sendmsg_with_fd, SharedRegion};
use crate::protocol::{ErrorKind, Request, Response, MAX_FRAME};
use crate::residency::Owner;

/// Binds the socket, replacing a stale one (a socket file nobody answers on).
pub(super) fn bind(path: &Path) -> Result<UnixListener, StoreError> {
    let io_err = |e| StoreError::Io { path: path.display().to_string(), source: e };
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(io_err(io::Error::new(
                io::ErrorKind::AddrInUse,
                "another daemon is serving this socket",
            )));
        }
        std::fs::remove_file(path).map_err(io_err)?;
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io_err)?;
    }
    UnixListener::bind(path).map_err(io_err)
}

pub(super) async fn accept_loop(core: Arc<Core>, listener: UnixListener) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(connection(core.clone(), stream));
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept on the store socket failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Most fds accepted on one request; more are closed by the kernel.
const MAX_FDS: usize = 4;

/// Reads one frame and the fds that came on its first bytes (a client
/// attaches a target memfd there); `Ok(None)` on a clean end of stream.
async fn read_frame(stream: &mut UnixStream) -> io::Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    let mut fds = Vec::new();
    while got < len.len() {
        stream.readable().await?;
        let read = stream.try_io(Interest::READABLE, || {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
            let mut anc = RecvAncillaryBuffer::new(&mut space);
            let msg = rustix::net::recvmsg(
                &*stream,
                &mut [IoSliceMut::new(&mut len[got..])],
                &mut anc,
                RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
            )?;
            for m in anc.drain() {
                if let RecvAncillaryMessage::ScmRights(received) = m {
                    fds.extend(received);
                }
            }
            Ok(msg.bytes)
        });
        match read {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    let n = u32::from_le_bytes(len);
    if n > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {n} bytes exceeds {MAX_FRAME}"),
        ));
    }
    let mut buf = vec![0; n as usize];
    stream.read_exact(&mut buf).await?;
    Ok(Some((buf, fds)))
}

/// Sends one frame; `region`'s fd rides on its first bytes.
async fn send(stream: &UnixStream, payload: &[u8], region: Option<&SharedRegion>) -> io::Result<()> {
    let bytes = frame(payload);
    let mut sent = 0;
    while sent < bytes.len() {
        stream.writable().await?;
        let fd = if sent == 0 { region.map(|r| r.fd()) } else { None };
        match stream.try_io(Interest::WRITABLE, || sendmsg_with_fd(stream, &bytes[sent..], fd)) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Serves one client connection until it closes.
///
/// # Cancel safety
/// Not cancel-safe mid-request: dropping it may leave a half-sent frame; the
/// daemon only drops it at shutdown.
async fn connection(core: Arc<Core>, mut stream: UnixStream) {
    let peer_pid = stream.peer_cred().ok().and_then(|c| c.pid()).map(|p| p as u32);
    // Registrations begun here and not yet committed; aborted if the producer goes away.
    let mut open = Vec::new();
    serve_requests(&core, &mut stream, peer_pid, &mut open).await;
    for handle in open {
        if core.abort_register(handle) {
            tracing::info!(%handle, "producer disconnected; registration aborted");
        }
    }
}

async fn serve_requests(
    core: &Arc<Core>,
    stream: &mut UnixStream,
    peer_pid: Option<u32>,
    open: &mut Vec<hangar_core::ReplicaId>,
) {
    loop {
        let (payload, fds) = match read_frame(stream).await {
            Ok(Some(p)) => p,
            Ok(None) => return,
            Err(e) => {
                tracing::debug!(error = %e, "dropping client connection");
                return;
            }
        };
        let (resp, region) = match serde_json::from_slice::<Request>(&payload) {
            Ok(req) => {
                let out = handle(core, req, peer_pid, fds).await;
                if let (Response::RegisterBegun { handle, .. }, _) = &out {
                    open.push(*handle);
                }
                out
            }
            Err(e) => (
                Response::Error { kind: ErrorKind::BadRequest, message: format!("malformed request: {e}") },
                None,
            ),
        };
        let body = serde_json::to_vec(&resp).expect("responses serialize");
        if let Err(e) = send(stream, &body, region.as_deref()).await {
            tracing::debug!(error = %e, "client went away mid-response");
            return;
        }
    }
}

fn error(e: StoreError) -> Response {
    Response::Error { kind: error_kind(&e), message: e.to_string() }
}

/// Answers one request; `fds` came with it (only `MaterializeIntoTarget`
/// uses one, the others are closed when this returns).
async fn handle(
    core: &Arc<Core>,
    req: Request,
    peer_pid: Option<u32>,
    fds: Vec<OwnedFd>,
) -> (Response, Option<Arc<SharedRegion>>) {
    match req {
        Request::MaterializeIntoTarget { selection, offset, len } => {
            let fd = fds.into_iter().next();
            match core.materialize_into(&selection, fd, offset, len).await {
                Ok((id, index, source, bytes, duration_ms)) => {
                    (Response::MaterializedInto { id, index, source, bytes, duration_ms }, None)
                }
                Err(e) => (error(e), None),
            }
        }
        Request::Describe { selection } => match core.describe(&selection).await {
            Ok((id, index)) => (Response::Described { id, index }, None),
            Err(e) => (error(e), None),
        },
        Request::ResolveKey { key } => match core.resolve_key(&key).await {
            Ok(id) => (Response::Resolved { id }, None),
            Err(e) => (error(e), None),
        },
        Request::Materialize { selection, replica, pid, lease_ttl_ms } => {
            let owner = match (lease_ttl_ms, peer_pid.or(pid)) {
                (Some(ttl), _) => Owner::Lease { expires_at: core.now() + ttl },
                (None, Some(pid)) => Owner::Pid(pid),
                (None, None) => {
                    let message =
                        "no pid: give `pid` or `lease_ttl_ms` (peer credentials unavailable)".into();
                    return (Response::Error { kind: ErrorKind::BadRequest, message }, None);
                }
            };
            match core.materialize(&selection, replica, owner).await {
                Ok(g) => (
                    Response::Materialized { id: g.id, index: (*g.index).clone(), reused: g.reused },
                    Some(g.region),
                ),
                Err(e) => (error(e), None),
            }
        }
        Request::Confirm { replica, timeout_ms } => {
            match core.confirm(replica, Duration::from_millis(timeout_ms)).await {
                Ok((source, bytes, duration_ms)) => {
                    (Response::Confirmed { source, bytes, duration_ms }, None)
                }
                Err(e) => (error(e), None),
            }
        }
        Request::Unload { replica } => (Response::Unloaded { released: core.unload(replica) }, None),
        Request::KeepAlive { replica, ttl_ms } => match core.keep_alive(replica, ttl_ms) {
            Ok(expires_in_ms) => (Response::KeptAlive { expires_in_ms }, None),
            Err(e) => (error(e), None),
        },
        Request::Status => {
            let (used, budget, residents) = core.status();
            (Response::Status { used, budget, residents }, None)
        }
        Request::BeginRegister { tensors, keys } => match core.begin_register(tensors, keys) {
            Ok((handle, index, region)) => (Response::RegisterBegun { handle, index }, Some(region)),
            Err(e) => (error(e), None),
        },
        Request::CommitRegister { handle, serving } => match core.commit_register(handle, serving).await {
            Ok(report) => (Response::Committed { report }, None),
            Err(e) => (error(e), None),
        },
        Request::AbortRegister { handle } => {
            (Response::Aborted { existed: core.abort_register(handle) }, None)
        }
    }
}
