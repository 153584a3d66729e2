//! Defence in depth around every route: a request id, and a handler that
//! panics answers 500 instead of dropping the connection.
//!
//! Input is validated where it enters, so no request should make a handler
//! panic; this layer is for the bug that slips through. The panic is
//! caught at the handler's future, answered with a generic 500 that carries
//! the request id (nothing internal in the body), counted in `/metrics`
//! (`hangar_http_panics_total`) and logged once, in one line, by the hook
//! [`install_panic_hook`] sets — no backtrace flood.
//!
//! Every answer carries `x-request-id`: the caller's own when it sent a
//! usable one, else one made here.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::extract::{Request, State};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use futures::FutureExt;
use prometheus_client::metrics::counter::Counter;

use crate::openai::error;

/// The header carrying a request's id, both ways.
pub(crate) static REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

tokio::task_local! {
    /// The id of the request whose handler runs on this task, for the
    /// panic hook's log line.
    static CURRENT: HeaderValue;
}

/// A process-unique id: a random start, then a counter (cheap on the hot
/// path, and two servers' ids do not collide in a shared log).
fn new_id() -> HeaderValue {
    static NEXT: std::sync::OnceLock<AtomicU64> = std::sync::OnceLock::new();
    let n = NEXT.get_or_init(|| AtomicU64::new(rand::random())).fetch_add(1, Ordering::Relaxed);
    HeaderValue::from_str(&format!("{n:016x}")).expect("hex digits are a valid header value")
}

/// `f` of the id of the request this task serves (its inference event's
/// `id`), read in place; of an empty id outside the guard (a handler
/// called without the middleware).
pub(crate) fn with_current_id<T>(f: impl FnOnce(&[u8]) -> T) -> T {
    let mut f = Some(f);
    CURRENT
        .try_with(|id| f.take().expect("called once")(id.as_bytes()))
        .unwrap_or_else(|_| f.take().expect("not called: no id is set")(&[]))
}

/// The caller's `x-request-id` when it is short, visible ASCII; else a new one.
fn request_id(request: &Request) -> HeaderValue {
    match request.headers().get(&REQUEST_ID) {
        Some(v) if (1..=128).contains(&v.len()) && v.as_bytes().iter().all(|b| b.is_ascii_graphic()) => {
            v.clone()
        }
        _ => new_id(),
    }
}

/// The middleware: runs the rest of the stack with the request id set,
/// catching a panic of the handler's future; `panics` counts them.
///
/// # Cancel safety
/// Dropping it drops the handler's future, as without it.
pub(crate) async fn guard(State(panics): State<Counter>, request: Request, next: Next) -> Response {
    let id = request_id(&request);
    let run = AssertUnwindSafe(CURRENT.scope(id.clone(), next.run(request))).catch_unwind();
    let mut response = match run.await {
        Ok(response) => response,
        Err(_) => {
            // The hook has logged it, with the id.
            panics.inc();
            let message = format!(
                "internal error: the server failed on this request (request id {}); it is logged",
                id.to_str().unwrap_or_default()
            );
            error(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", &message, None)
        }
    };
    response.headers_mut().insert(REQUEST_ID.clone(), id);
    response
}

/// Logs every panic of this process in one line — where, what, and the
/// request id when it happened in a handler — instead of the default
/// hook's message and backtrace. `hangar serve` installs it at start.
pub fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let location = info.location().map(|l| format!("{}:{}", l.file(), l.line())).unwrap_or_default();
        let payload = info.payload();
        let what = payload
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("(no message)");
        let what = what.replace('\n', " ");
        match CURRENT.try_with(|id| id.to_str().unwrap_or_default().to_owned()) {
            Ok(id) => tracing::error!(request_id = %id, "panic in a handler at {location}: {what}"),
            Err(_) => tracing::error!("panic at {location}: {what}"),
        }
    }));
}

#[cfg(test)]
mod tests {
    use axum::routing::get;
    use tower::ServiceExt;

    use super::*;

    #[tokio::test]
    async fn a_panicking_handler_answers_500_with_its_request_id_and_is_counted() {
        let panics = Counter::default();
        let app = axum::Router::new()
            .route("/boom", get(|| async { panic!("a bug") as &'static str }))
            .route("/fine", get(|| async { "ok" }))
            .layer(axum::middleware::from_fn_with_state(panics.clone(), guard));
        let request =
            |path: &str| Request::get(path).header(&REQUEST_ID, "req-7").body(axum::body::Body::empty());
        let r = app.clone().oneshot(request("/boom").unwrap()).await.unwrap();
        assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(r.headers()[&REQUEST_ID], "req-7");
        let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        let body = String::from_utf8_lossy(&body);
        assert!(body.contains("request id req-7") && !body.contains("a bug"), "{body}");
        assert_eq!(panics.get(), 1);
        // The server goes on serving, and counts nothing for a good request.
        let r = app.oneshot(request("/fine").unwrap()).await.unwrap();
        assert_eq!((r.status(), panics.get()), (StatusCode::OK, 1));
        assert_eq!(r.headers()[&REQUEST_ID], "req-7");
    }

    #[test]
    fn a_caller_id_is_kept_when_usable_and_replaced_otherwise() {
        let with = |v: &str| {
            let r = Request::builder().header(&REQUEST_ID, v).body(axum::body::Body::empty()).unwrap();
            request_id(&r)
        };
        assert_eq!(with("abc-123"), "abc-123");
        let long = "x".repeat(200);
        assert_ne!(with(&long), long.as_str());
        assert_ne!(with("has space"), "has space");
        assert_ne!(new_id(), new_id());
    }
}
