//! The data path to replicas: a pooled keep-alive HTTP/1 client, and the
//! body that streams a replica's answer to the client.
//!
//! The answer is passed through frame by frame ([`RelayBody`]), keeping
//! the replica's `Content-Length` when it sent one. The body owns the
//! request's permit, so the permit is released exactly when the answer
//! ends or the client goes away (hyper drops the body), and dropping it
//! also closes the replica's connection, which cancels the engine's work.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::json;

use super::config::ConnectionPool;
use super::metrics::ModelMetrics;
use crate::processor::Lease;

/// A client requests are forwarded with.
pub(crate) type Client1 = Client<HttpConnector, Full<Bytes>>;

/// A model's way to its replicas: a pool of keep-alive connections, and a
/// client that opens a fresh connection for each request, for the retry
/// of a request whose pooled connection turned out closed.
pub(crate) struct Upstream {
    pub pooled: Client1,
    pub fresh: Client1,
}

/// The clients of a model whose pool is `pool`, with `TCP_NODELAY` so
/// small streamed frames are not held back by Nagle's algorithm.
pub(crate) fn upstream(pool: &ConnectionPool) -> Upstream {
    let client = |idle: Duration, max_idle: usize| {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Client::builder(TokioExecutor::new())
            .pool_idle_timeout(idle)
            .pool_max_idle_per_host(max_idle)
            .build(connector)
    };
    let idle = Duration::from_millis(pool.idle_timeout_ms);
    let max_idle = if pool.idle_timeout_ms == 0 { 0 } else { pool.max_idle };
    Upstream { pooled: client(idle, max_idle), fresh: client(Duration::ZERO, 0) }
}

/// Whether a failed forward never got an answer's first byte because its
/// connection was refused, reset or closed — a pooled connection the
/// engine had closed while it sat idle is the common case — so the
/// request may go again on a fresh connection. (An engine that got the
/// request and lost the connection cancels it; running it again costs
/// compute, never a wrong answer.)
pub(crate) fn connection_lost(e: &hyper_util::client::legacy::Error) -> bool {
    if e.is_connect() {
        return true;
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(h) = s.downcast_ref::<hyper::Error>() {
            return h.is_incomplete_message() || h.is_canceled() || h.is_closed();
        }
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::UnexpectedEof
            );
        }
        source = s.source();
    }
    false
}

/// A replica's answer on its way to the client. A stream that breaks off
/// or outlives the request's deadline ends with an error event (SSE) or a
/// body error (which aborts the response, so the client sees it cut).
pub(crate) struct RelayBody {
    upstream: Incoming,
    _lease: Lease,
    deadline: Pin<Box<tokio::time::Sleep>>,
    sse: bool,
    first: bool,
    done: bool,
    metrics: Arc<ModelMetrics>,
    arrival: Instant,
}

impl RelayBody {
    pub fn new(
        upstream: Incoming,
        lease: Lease,
        deadline: Pin<Box<tokio::time::Sleep>>,
        sse: bool,
        metrics: Arc<ModelMetrics>,
        arrival: Instant,
    ) -> Self {
        Self { upstream, _lease: lease, deadline, sse, first: true, done: false, metrics, arrival }
    }

    fn fail(&mut self, why: &str) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.done = true;
        Poll::Ready(Some(match self.sse {
            true => {
                let error = json!({"error": {"message": why, "type": "service_unavailable", "param": null, "code": null}});
                Ok(Frame::data(Bytes::from(format!("data: {error}\n\n"))))
            }
            false => Err(std::io::Error::other(why.to_owned())),
        }))
    }
}

impl Drop for RelayBody {
    fn drop(&mut self) {
        self.metrics.finished(self.arrival.elapsed());
    }
}

impl Body for RelayBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.upstream).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if this.first && frame.is_data() {
                    this.first = false;
                    this.metrics.first_byte(this.arrival.elapsed());
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                this.done = true;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                tracing::warn!("a replica's answer broke off: {e}");
                this.fail("the replica failed while answering")
            }
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => this.fail("the answer did not finish within the request's timeout"),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.upstream.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.upstream.size_hint()
    }
}
