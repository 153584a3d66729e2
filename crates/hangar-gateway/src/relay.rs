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
use hangar_runtime::events::{Outcome, RequestRecord};
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
    /// The request's inference event, finished when the answer ends
    /// (dropped unfinished, it ends as the client gone).
    record: Option<RequestRecord>,
    /// The replica's status, answered to the client.
    status: u16,
    /// Why the answer was cut, if it was.
    cut: Option<&'static str>,
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
        Self {
            upstream,
            _lease: lease,
            deadline,
            sse,
            first: true,
            done: false,
            metrics,
            arrival,
            record: None,
            status: 200,
            cut: None,
        }
    }

    /// Records the answer, whose status is `status`, in `record`.
    pub fn recording(mut self, record: Option<RequestRecord>, status: u16) -> Self {
        (self.record, self.status) = (record, status);
        self
    }

    /// The answer ended (in full, or cut with `self.cut`): the event goes.
    fn ended(&mut self) {
        self.done = true;
        if let Some(record) = &mut self.record {
            let error = match (self.cut, self.status) {
                (Some(code), _) => Some((Outcome::Failed, code)),
                (None, 200..=299) => None,
                (None, _) => Some((Outcome::Failed, "engine_error")),
            };
            record.finish(self.status, error);
        }
    }

    fn fail(&mut self, code: &'static str, why: &str) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.cut = Some(code);
        self.ended();
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
        // hyper stops polling once the body says it has ended: a full
        // answer may end here rather than on a last `None`.
        if !self.done && self.upstream.is_end_stream() {
            self.ended();
        }
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
                if let Some(data) = frame.data_ref() {
                    if this.first {
                        this.first = false;
                        this.metrics.first_byte(this.arrival.elapsed());
                    }
                    if let Some(record) = &mut this.record {
                        record.frame(data);
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                this.ended();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                tracing::warn!("a replica's answer broke off: {e}");
                this.fail("stream_broken", "the replica failed while answering")
            }
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    this.fail("timeout", "the answer did not finish within the request's timeout")
                }
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
