//! The body that streams a replica's answer to the client (the model's
//! connections to its replicas are `hangar-runtime`'s: `ModelRuntime::send`).
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
use std::time::Instant;

use axum::body::Bytes;
use hangar_runtime::processor::Lease;
use hangar_runtime::serve::ModelMetrics;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use serde_json::json;

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
