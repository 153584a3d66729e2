//! A model's way to its replicas: a pooled keep-alive HTTP/1 client, which
//! [`ModelRuntime::send`](super::ModelRuntime::send) forwards requests on.
//!
//! The pool is the model's state, built once from its `[models.connections]`;
//! the gateway (`hangar-gateway`) sends on it and streams the answer back.

use std::time::Duration;

use axum::body::Bytes;
use axum::http::header;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::config::ConnectionPool;

/// A client requests are forwarded with.
type Client1 = Client<HttpConnector, Full<Bytes>>;

/// A model's way to its replicas: a pool of keep-alive connections, and a
/// client that opens a fresh connection for each request, for the retry
/// of a request whose pooled connection turned out closed.
pub(crate) struct Upstream {
    pooled: Client1,
    fresh: Client1,
}

/// How long an answer may be silent before its connection's host is
/// asked, by a keep-alive probe, whether it is still there (and how often
/// after): with [`ConnectionPool::unacked_timeout_ms`], a host that stops
/// acknowledging while an engine streams nothing is found as one that
/// stops acknowledging a request.
const KEEPALIVE_EVERY: Duration = Duration::from_secs(1);

/// The clients of a model whose pool is `pool`, with `TCP_NODELAY` so
/// small streamed frames are not held back by Nagle's algorithm, and
/// bounds that find a replica's host gone or cut off in seconds, not at
/// each request's deadline: the connect timeout, and keep-alive probes
/// with `TCP_USER_TIMEOUT` (neither costs the request path anything: they
/// are socket options set once per connection).
pub(crate) fn upstream(pool: &ConnectionPool) -> Upstream {
    let client = |idle: Duration, max_idle: usize| {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_millis(pool.connect_timeout_ms)));
        connector.set_keepalive(Some(KEEPALIVE_EVERY));
        connector.set_keepalive_interval(Some(KEEPALIVE_EVERY));
        connector.set_tcp_user_timeout(Some(Duration::from_millis(pool.unacked_timeout_ms)));
        Client::builder(TokioExecutor::new())
            .pool_idle_timeout(idle)
            .pool_max_idle_per_host(max_idle)
            .build(connector)
    };
    let idle = Duration::from_millis(pool.idle_timeout_ms);
    let max_idle = if pool.idle_timeout_ms == 0 { 0 } else { pool.max_idle };
    Upstream { pooled: client(idle, max_idle), fresh: client(Duration::ZERO, 0) }
}

/// Why a request forwarded to a replica got no answer.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// The replica's URL does not make a request (engine URLs are checked
    /// at load, so this replica cannot serve).
    #[error("cannot address the replica: {0}")]
    Address(#[from] axum::http::Error),
    /// No answer came back: the connection failed, also on a fresh one.
    #[error(transparent)]
    Failed(#[from] hyper_util::client::legacy::Error),
}

impl Upstream {
    /// POSTs the JSON `body` to `url` on a pooled connection, and once more
    /// on a fresh one (telling `retried`) if that connection was lost
    /// before any answer came back (an engine such as llama.cpp's server
    /// closes idle keep-alive connections, and one may close just as it is
    /// reused).
    ///
    /// # Cancel safety
    /// Dropping the future drops the request and its connection.
    pub(crate) async fn send(
        &self,
        url: &str,
        body: Bytes,
        retried: impl FnOnce(),
    ) -> Result<hyper::Response<Incoming>, SendError> {
        let request = || {
            hyper::Request::post(url)
                .header(header::CONTENT_TYPE, "application/json")
                .body(Full::new(body.clone()))
        };
        match self.pooled.request(request()?).await {
            Err(e) if connection_lost(&e) => {
                tracing::debug!(%url, "pooled connection lost before an answer ({e}); sending on a fresh one");
                retried();
                Ok(self.fresh.request(request()?).await?)
            }
            answer => Ok(answer?),
        }
    }
}

/// Whether a failed forward never got an answer's first byte because its
/// connection was refused, reset or closed — a pooled connection the
/// engine had closed while it sat idle is the common case — so the
/// request may go again on a fresh connection. (An engine that got the
/// request and lost the connection cancels it; running it again costs
/// compute, never a wrong answer.)
fn connection_lost(e: &hyper_util::client::legacy::Error) -> bool {
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Sends to a listener whose accept queue is full, which drops the
    /// SYNs of new connections as a host cut off from the gateway does,
    /// and checks the send fails as a connect, on the pooled client and
    /// on the fresh one, well before the kernel's two minutes of SYN
    /// retries.
    async fn fails_to_connect(pool: ConnectionPool) {
        let listener = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        listener.bind(&"127.0.0.1:0".parse::<std::net::SocketAddr>().unwrap().into()).unwrap();
        listener.listen(0).unwrap();
        let addr = listener.local_addr().unwrap().as_socket().unwrap();
        // The one connection a backlog of 0 holds, never accepted.
        let _queued = std::net::TcpStream::connect(addr).unwrap();
        let up = upstream(&pool);
        let mut retried = false;
        let sent = tokio::time::timeout(
            Duration::from_secs(20),
            up.send(&format!("http://{addr}/v1/chat/completions"), Bytes::from_static(b"{}"), || {
                retried = true
            }),
        )
        .await
        .expect("the connect gave up within its bound, not after the kernel's SYN retries");
        match sent {
            Err(SendError::Failed(e)) => assert!(e.is_connect(), "{e:?}"),
            other => panic!("expected a failed connect, got {other:?}"),
        }
        assert!(retried, "the pooled client's failed connect is tried once more on a fresh one");
    }

    #[tokio::test]
    async fn a_host_that_answers_no_connection_fails_it_within_the_connect_timeout() {
        // The longest unacked bound, which would end the SYNs' retries too.
        fails_to_connect(ConnectionPool {
            connect_timeout_ms: 200,
            unacked_timeout_ms: 600_000,
            ..Default::default()
        })
        .await;
    }

    /// `TCP_USER_TIMEOUT` bounds a SYN left unacknowledged as it bounds a
    /// request: that it ends the connect shows the socket carries it.
    #[tokio::test]
    async fn the_unacked_bound_is_set_on_the_replicas_connections() {
        fails_to_connect(ConnectionPool {
            connect_timeout_ms: 60_000,
            unacked_timeout_ms: 1_000,
            ..Default::default()
        })
        .await;
    }
}
