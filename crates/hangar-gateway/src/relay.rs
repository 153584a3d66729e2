//! The body that carries a replica's answer to the client (the model's
//! connections to its replicas are `hangar-runtime`'s: `ModelRuntime::send`).
//!
//! A JSON answer is read whole first (within the request's deadline), so
//! its `model` can be given the requested key ([`crate::rename`]) and its
//! `Content-Length` kept; any other answer — an SSE stream above all — is
//! passed through frame by frame ([`RelayBody`]), an SSE stream's events
//! renamed as they pass, another answer untouched with the replica's
//! `Content-Length` when it sent one. The body owns the request's permit,
//! so the permit is released exactly when the answer ends or the client
//! goes away (hyper drops the body), and dropping it also closes the
//! replica's connection, which cancels the engine's work. It also owns
//! the request's [`Tally`]: the request is counted when the body ends, as
//! what happened to it — completed with the replica's status, cut by its
//! deadline (504) or by its replica (502), or left by its client (499).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Bytes;
use hangar_core::{ErrorCode, RequestKind};
use hangar_runtime::processor::Lease;
use hangar_runtime::serve::{ModelRuntime, Tally};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use serde_json::json;

use crate::rename::StreamRename;

/// Where the answer's bytes come from.
enum Source {
    /// A whole answer, read already; `None` once sent.
    Whole(Option<Bytes>),
    /// The replica's body, streamed; an SSE stream is renamed on the way.
    Stream { upstream: Incoming, deadline: Pin<Box<tokio::time::Sleep>>, sse: Option<StreamRename> },
}

/// How the answer ended, so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Open,
    Completed,
    Cut(ErrorCode),
}

/// A replica's answer on its way to the client. A stream that breaks off
/// or outlives the request's deadline ends with an error event (SSE) or a
/// body error (which aborts the response, so the client sees it cut).
pub(crate) struct RelayBody {
    source: Source,
    _lease: Lease,
    rt: Arc<ModelRuntime>,
    /// Taken when the body is dropped, to count the request.
    tally: Option<Tally>,
    /// The replica's status, which a completed answer is counted under.
    status: u16,
    first: bool,
    end: End,
    arrival: Instant,
    /// The name answers give the model when it is not the model's key (a
    /// request for an adapter, `BASE:ADAPTER`).
    name: Option<Arc<str>>,
}

impl RelayBody {
    /// A whole answer, read and renamed already (its first byte counted).
    pub fn whole(
        body: Bytes,
        lease: Lease,
        rt: Arc<ModelRuntime>,
        tally: Tally,
        status: u16,
        arrival: Instant,
    ) -> Self {
        // An empty answer is sent already: hyper does not poll a body of
        // length 0, and it must count as completed.
        let source = Source::Whole((!body.is_empty()).then_some(body));
        let tally = Some(tally);
        Self { source, _lease: lease, rt, tally, status, first: false, end: End::Open, arrival, name: None }
    }

    /// The replica's body streamed within `deadline`; `sse` when it is an
    /// event stream, whose events are renamed (to `name` if given, else
    /// the model's key).
    #[allow(clippy::too_many_arguments)]
    pub fn stream(
        upstream: Incoming,
        deadline: Pin<Box<tokio::time::Sleep>>,
        sse: bool,
        lease: Lease,
        rt: Arc<ModelRuntime>,
        tally: Tally,
        status: u16,
        arrival: Instant,
    ) -> Self {
        let source = Source::Stream { upstream, deadline, sse: sse.then(StreamRename::default) };
        let tally = Some(tally);
        Self { source, _lease: lease, rt, tally, status, first: true, end: End::Open, arrival, name: None }
    }

    /// Answers name the model `name` (a request's `BASE:ADAPTER`) rather
    /// than its key.
    pub fn named(mut self, name: Option<Arc<str>>) -> Self {
        self.name = name;
        self
    }

    fn fail(&mut self, code: ErrorCode, why: &str) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.end = End::Cut(code);
        let sse = matches!(self.source, Source::Stream { sse: Some(_), .. });
        Poll::Ready(Some(match sse {
            true => {
                let error = json!({"error": {"message": why, "type": "service_unavailable", "param": null, "code": null}});
                Ok(Frame::data(Bytes::from(format!("data: {error}\n\n"))))
            }
            false => Err(std::io::Error::other(why.to_owned())),
        }))
    }

    /// `data` of a streamed answer goes to the client: the first byte is
    /// timed, and the request's trace keeps a handle on it.
    fn sent(&mut self, data: &Bytes) {
        if data.is_empty() {
            return;
        }
        let first = std::mem::take(&mut self.first).then(Instant::now);
        if let Some(now) = first {
            self.rt.metrics().first_byte(RequestKind::Sync, now - self.arrival);
        }
        if let Some(trace) = self.tally.as_mut().and_then(Tally::trace) {
            if let Some(now) = first {
                trace.first_byte(now);
            }
            trace.frame(data);
        }
    }

    /// Whether the answer was sent to its end (hyper stops polling a body
    /// that says so, so that counts as completed too).
    fn completed(&self) -> bool {
        self.end == End::Completed || (self.end == End::Open && self.is_end_stream())
    }
}

impl Drop for RelayBody {
    fn drop(&mut self) {
        let metrics = self.rt.metrics();
        metrics.finished(RequestKind::Sync, self.arrival.elapsed());
        let Some(tally) = self.tally.take() else { return };
        match self.end {
            End::Cut(code) => tally.ended(code.http_status(), Some(code)),
            _ if self.completed() => {
                let code = (self.status >= 400).then_some(ErrorCode::EngineError);
                tally.ended(self.status, code);
            }
            // Dropped mid-answer: the client went away (the tally says so).
            _ => drop(tally),
        }
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
        if this.end != End::Open {
            return Poll::Ready(None);
        }
        let key = this.name.as_deref().unwrap_or(this.rt.config().key.as_str());
        let (upstream, deadline, sse) = match &mut this.source {
            Source::Whole(body) => {
                return match body.take() {
                    Some(b) => Poll::Ready(Some(Ok(Frame::data(b)))),
                    None => {
                        this.end = End::Completed;
                        Poll::Ready(None)
                    }
                }
            }
            Source::Stream { upstream, deadline, sse } => (upstream, deadline, sse),
        };
        loop {
            match Pin::new(&mut *upstream).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let frame = match frame.into_data() {
                        Ok(data) => {
                            let data = match sse.as_mut() {
                                Some(rename) => match rename.frame(data, key) {
                                    Some(d) => d,
                                    // All of it waits for the end of its line.
                                    None => continue,
                                },
                                None => data,
                            };
                            this.sent(&data);
                            Frame::data(data)
                        }
                        Err(frame) => frame,
                    };
                    return Poll::Ready(Some(Ok(frame)));
                }
                Poll::Ready(None) => {
                    this.end = End::Completed;
                    return match sse.as_mut().and_then(|r| r.finish(key)) {
                        Some(rest) => {
                            this.sent(&rest);
                            Poll::Ready(Some(Ok(Frame::data(rest))))
                        }
                        None => Poll::Ready(None),
                    };
                }
                Poll::Ready(Some(Err(e))) => {
                    tracing::warn!("a replica's answer broke off: {e}");
                    return this.fail(ErrorCode::ReplicaFailed, "the replica failed while answering");
                }
                Poll::Pending => {
                    return match deadline.as_mut().poll(cx) {
                        Poll::Ready(()) => this.fail(
                            ErrorCode::Timeout,
                            "the answer did not finish within the request's timeout",
                        ),
                        Poll::Pending => Poll::Pending,
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.source {
            Source::Whole(body) => body.is_none(),
            Source::Stream { upstream, sse, .. } => {
                self.end != End::Open
                    || (upstream.is_end_stream() && sse.as_ref().is_none_or(StreamRename::is_empty))
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.source {
            Source::Whole(body) => SizeHint::with_exact(body.as_ref().map_or(0, |b| b.len() as u64)),
            // Renamed events may change length.
            Source::Stream { sse: Some(_), .. } => SizeHint::default(),
            Source::Stream { upstream, .. } => upstream.size_hint(),
        }
    }
}
