//! The daemon's TCP side: artifacts for peers, `/metrics`, `/v1/events`.
//!
//! - `GET /v1/artifacts/{id}/index` — canonical index bytes
//! - `GET /v1/artifacts/{id}/chunks` — chunk hashes (32 bytes each)
//! - `GET /v1/artifacts/{id}/data?from_chunk=K&to_chunk=L` — canonical data
//!   of chunks K (default 0) up to L (exclusive; default the end), streamed;
//!   every chunk is verified before it is sent and the stream is cut (never
//!   corrupted) on a mismatch. Sent with `Upgrade: hangar-chunks`
//!   (as daemons do), the answer is `101 Switching Protocols` and the same
//!   bytes follow raw on the connection, without HTTP chunk framing: the
//!   receiver reads them straight into its shared memory.
//!
//! Peers are served from the local blob store only (remotely fetched
//! artifacts are persisted there first).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use bytes::Bytes;
use hangar_core::exposition::Format;

use super::Core;
use crate::blob::StoredArtifact;
use crate::chunks::{self, chunk_range};
use crate::error::StoreError;
use crate::id::ArtifactId;

pub(super) async fn serve(core: Arc<Core>, listener: tokio::net::TcpListener) {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/v1/events", get(events))
        .route("/v1/artifacts/{id}/{part}", get(artifact))
        .with_state(core);
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!(error = %e, "peer HTTP server stopped");
    }
}

/// `GET /metrics`: OpenMetrics for a scraper that asks for it (Prometheus
/// does), the text format 0.0.4 otherwise.
async fn metrics(State(core): State<Arc<Core>>, headers: axum::http::HeaderMap) -> impl IntoResponse {
    let format = Format::negotiate(headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()));
    ([(header::CONTENT_TYPE, format.content_type())], format.render(core.telemetry.encode()))
}

async fn events(State(core): State<Arc<Core>>) -> impl IntoResponse {
    Json(core.telemetry.events())
}

#[derive(serde::Deserialize)]
struct DataQuery {
    #[serde(default)]
    from_chunk: usize,
    to_chunk: Option<usize>,
}

fn reject(status: StatusCode, msg: impl ToString) -> Response {
    (status, msg.to_string()).into_response()
}

/// The `Upgrade` protocol name under which artifact data is sent raw.
pub(super) const RAW_DATA_PROTOCOL: &str = "hangar-chunks";

async fn artifact(
    State(core): State<Arc<Core>>,
    Path((id, part)): Path<(String, String)>,
    Query(q): Query<DataQuery>,
    mut req: Request,
) -> Response {
    let id: ArtifactId = match id.parse() {
        Ok(id) => id,
        Err(e) => return reject(StatusCode::BAD_REQUEST, e),
    };
    let blobs = core.blobs.clone();
    let art = match tokio::task::spawn_blocking(move || blobs.open_artifact(&id)).await {
        Ok(Ok(a)) => a,
        Ok(Err(StoreError::UnknownArtifact(_))) => {
            return reject(StatusCode::NOT_FOUND, format!("{id} not held here"))
        }
        Ok(Err(e)) => return reject(StatusCode::INTERNAL_SERVER_ERROR, e),
        Err(e) => return reject(StatusCode::INTERNAL_SERVER_ERROR, e),
    };
    match part.as_str() {
        "index" => art.index.to_bytes().into_response(),
        "chunks" => chunks::encode(&art.chunk_hashes).into_response(),
        "data" => {
            let n = art.chunk_hashes.len();
            let to = q.to_chunk.unwrap_or(n);
            if q.from_chunk > to || to > n {
                let msg = format!("chunks {}..{to} are not within the artifact's 0..{n}", q.from_chunk);
                return reject(StatusCode::RANGE_NOT_SATISFIABLE, msg);
            }
            let chunks = stream_data(core.clone(), art, q.from_chunk..to);
            if !wants_raw(&req) {
                return Body::from_stream(chunks).into_response();
            }
            let upgrade = hyper::upgrade::on(&mut req);
            tokio::spawn(async move {
                match upgrade.await {
                    Ok(io) => send_raw(hyper_util::rt::TokioIo::new(io), chunks).await,
                    Err(e) => tracing::warn!(error = %e, "peer data upgrade failed"),
                }
            });
            (
                StatusCode::SWITCHING_PROTOCOLS,
                [(header::CONNECTION, "upgrade"), (header::UPGRADE, RAW_DATA_PROTOCOL)],
            )
                .into_response()
        }
        _ => reject(StatusCode::NOT_FOUND, format!("unknown part `{part}`")),
    }
}

fn wants_raw(req: &Request) -> bool {
    req.headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(RAW_DATA_PROTOCOL))
}

/// Writes verified chunks raw on an upgraded connection, straight from the
/// blob's map. On a verification error the connection is closed early, so
/// the receiver sees a short stream, never a wrong byte. A receiver that
/// hangs up (it sends nothing after the upgrade) ends the transfer, which
/// also stops the chunk producer.
async fn send_raw(
    io: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    chunks: impl futures::Stream<Item = Result<Bytes, StoreError>>,
) {
    use futures::StreamExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut rd, mut wr) = tokio::io::split(io);
    let mut chunks = std::pin::pin!(chunks);
    let mut probe = [0u8; 1];
    loop {
        let item = tokio::select! {
            item = chunks.next() => item,
            _ = rd.read(&mut probe) => {
                tracing::debug!("peer hung up during a raw transfer");
                return;
            }
        };
        let sent = match item {
            Some(Ok(bytes)) => wr.write_all(&bytes).await,
            Some(Err(e)) => {
                tracing::error!(error = %e, "not serving a chunk that fails verification");
                break;
            }
            None => break,
        };
        if let Err(e) = sent {
            tracing::debug!(error = %e, "peer went away during a raw transfer");
            return;
        }
    }
    let _ = wr.shutdown().await;
}

/// One chunk of a mapped blob, sent without copying.
struct MappedChunk {
    map: Arc<memmap2::Mmap>,
    range: std::ops::Range<usize>,
}

impl AsRef<[u8]> for MappedChunk {
    fn as_ref(&self) -> &[u8] {
        &self.map[self.range.clone()]
    }
}

/// Chunks `range`, each verified (on a blocking thread, two chunks ahead of
/// the socket) and then sent straight from the blob's map.
fn stream_data(
    core: Arc<Core>,
    art: StoredArtifact,
    range: std::ops::Range<usize>,
) -> impl futures::Stream<Item = Result<Bytes, StoreError>> {
    let stall_after = core.cfg.fault_stall_after;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, StoreError>>(2);
    tokio::task::spawn_blocking(move || {
        let map = match art.map_unverified() {
            Ok(m) => Arc::new(m),
            Err(e) => {
                let _ = tx.blocking_send(Err(e));
                return;
            }
        };
        let mut sent = 0u64;
        for i in range {
            if stall_after.is_some_and(|s| sent >= s) {
                // Fault injection: hang like a wedged peer until the reader gives up.
                while !tx.is_closed() {
                    std::thread::sleep(Duration::from_millis(20));
                }
                return;
            }
            let (a, b) = chunk_range(i, art.index.data_len);
            let range = a as usize..b as usize;
            let item = art
                .verify_chunk(i, &map[range.clone()])
                .map(|()| Bytes::from_owner(MappedChunk { map: map.clone(), range }));
            let failed = item.is_err();
            if tx.blocking_send(item).is_err() || failed {
                return;
            }
            sent += b - a;
            core.telemetry.peer_sent(b - a);
        }
    });
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item, rx)) })
}
