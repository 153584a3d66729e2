//! The WebSocket relay (seed 001: Workers AI's `handle_ws_inference_request`):
//! `GET /v1/ws?model=KEY`, upgraded, relayed both ways to one replica of
//! a model whose engine speaks WebSocket (`[models.websocket]`).
//!
//! The connection takes a permit like any request and holds it for its
//! whole life; it is sent to one replica, with no retry (a relayed
//! conversation cannot be replayed elsewhere). Everything that can be
//! refused is refused *before* the upgrade, with an HTTP status: the key
//! (401), the model (404, or 400 for a model that takes no WebSocket),
//! the line (429, 503, 504), the replica's own handshake (502). After it,
//! the connection is closed with a WebSocket close code that says why:
//! 1009 for a message over `max_message_bytes` (either way), 1008 when it
//! reaches `max_duration_s`, 1011 when the replica's side fails.
//!
//! It is counted once, when it ends ([`Tally`]): 200 when either side
//! closed it, 504 (`timeout`) at its maximum duration, 400
//! (`bad_request`) for a message over the limit, 502 (`replica_failed`)
//! when the replica's side failed, 499 when the client's did.

use std::time::Instant;

use axum::extract::rejection::QueryRejection;
use axum::extract::ws::{self, CloseFrame, WebSocket, WebSocketUpgrade};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use futures::{SinkExt, StreamExt};
use hangar_core::{ErrorCode, RequestKind};
use hangar_runtime::events::RequestTrace;
use hangar_runtime::processor::{Lease, Wait};
use hangar_runtime::serve::{ModelRuntime, Server, Tally, WebSocketConfig};
use tokio_tungstenite::tungstenite::protocol::{
    frame::coding::CloseCode, CloseFrame as EngineClose, WebSocketConfig as Limits,
};
use tokio_tungstenite::tungstenite::{self, Message as EngineMessage};
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use crate::openai::{account, admit_error, denied, error, no_such_model};

pub(crate) fn router(server: Server) -> Router {
    Router::new().route("/v1/ws", get(connect)).with_state(server)
}

#[derive(serde::Deserialize)]
struct Params {
    model: Option<String>,
}

type Engine = WebSocketStream<MaybeTlsStream<tokio::net::TcpStream>>;

/// Admits the connection, opens the replica's side, then upgrades the
/// client's and relays until either side closes.
async fn connect(
    State(server): State<Server>,
    params: Result<Query<Params>, QueryRejection>,
    headers: HeaderMap,
    upgrade: Result<WebSocketUpgrade, ws::rejection::WebSocketUpgradeRejection>,
) -> Response {
    let arrival = Instant::now();
    let account = match account(&server, &headers) {
        Ok(a) => a,
        Err(e) => return denied(StatusCode::UNAUTHORIZED, &e.to_string()),
    };
    let model = match params {
        Ok(Query(Params { model: Some(model) })) => model,
        Ok(_) => {
            let message = "query parameter `model` is missing: GET /v1/ws?model=KEY";
            return error(StatusCode::BAD_REQUEST, "invalid_request_error", message, Some("model"));
        }
        Err(r) => return error(r.status(), "invalid_request_error", &r.body_text(), None),
    };
    let Some(rt) = server.model(&model).filter(|rt| rt.allows(&account)).cloned() else {
        return no_such_model(&model).into_response();
    };
    let Some(config) = rt.config().websocket.clone() else {
        let message = format!(
            "the model `{model}` takes no WebSocket connections: its engine speaks none \
             (a model whose engine does has a [models.websocket] table)"
        );
        return error(StatusCode::BAD_REQUEST, "invalid_request_error", &message, Some("model"));
    };
    let upgrade = match upgrade {
        Ok(u) => u,
        Err(r) => return r.into_response(),
    };
    let trace = crate::guard::with_current_id(|id| {
        RequestTrace::start(&rt, id, account.clone(), arrival, &Default::default())
    });
    let mut tally = Tally::new(rt.metrics(), RequestKind::Sync).traced(trace);
    let timeout = rt.timeout();
    let lease =
        match rt.processor().admit_with(account, Wait { timeout: Some(timeout), ..Wait::default() }).await {
            Ok(lease) => lease,
            Err(e) => {
                let (code, response) = admit_error(&e, timeout.as_secs());
                tally.ended(response.status().as_u16(), Some(code));
                return response;
            }
        };
    if let Some(trace) = tally.trace() {
        trace.admitted(Instant::now(), lease.replica, lease.queued_at);
    }
    let engine = match open(&rt, &lease, &config, arrival + timeout).await {
        Ok(engine) => engine,
        Err(message) => {
            let response = error(StatusCode::BAD_GATEWAY, "service_unavailable", &message, None);
            tally.ended(502, Some(ErrorCode::ReplicaFailed));
            return response;
        }
    };
    let limit = config.max_message_bytes.bytes() as usize;
    upgrade
        .max_message_size(limit)
        .max_frame_size(limit)
        .on_upgrade(move |client| relay(client, engine, lease, tally, config))
}

/// The replica's side of the connection, opened before `deadline`.
async fn open(
    rt: &ModelRuntime,
    lease: &Lease,
    config: &WebSocketConfig,
    deadline: Instant,
) -> Result<Engine, String> {
    let Some(base) = rt.replica_url(lease.replica) else {
        return Err("the replica given the connection left before it was opened".to_owned());
    };
    let url = format!("ws{}{}", base.strip_prefix("http").unwrap_or(&base), config.path);
    let limit = config.max_message_bytes.bytes() as usize;
    let limits = Limits::default().max_message_size(Some(limit)).max_frame_size(Some(limit));
    let opening = tokio_tungstenite::connect_async_with_config(url.as_str(), Some(limits), false);
    match tokio::time::timeout_at(deadline.into(), opening).await {
        Ok(Ok((engine, _))) => Ok(engine),
        Ok(Err(e)) => Err(format!("the replica refused the WebSocket connection: {e}")),
        Err(_) => {
            Err("the replica did not accept the WebSocket connection within the request's timeout".into())
        }
    }
}

/// How a relayed connection ended.
enum End {
    /// Either side closed it.
    Closed,
    /// It reached its maximum duration.
    Expired,
    /// A message was over the limit (on the side named).
    TooBig(&'static str),
    /// The replica's side failed.
    Replica(String),
    /// The client's side failed.
    Client,
}

/// Relays between `client` and `engine` until either closes, a message is
/// too big, or the connection reaches its maximum duration; then closes
/// both with the code that says why, gives the permit back and counts the
/// connection.
///
/// # Cancel safety
/// Dropped (the server stops), both sockets drop, the permit is given
/// back and the connection counted as dropped unended.
async fn relay(
    mut client: WebSocket,
    mut engine: Engine,
    lease: Lease,
    tally: Tally,
    config: WebSocketConfig,
) {
    let expiry = tokio::time::sleep(std::time::Duration::from_secs(config.max_duration_s));
    tokio::pin!(expiry);
    let end = loop {
        tokio::select! {
            from_client = client.recv() => match from_client {
                Some(Ok(message)) => {
                    let closing = matches!(message, ws::Message::Close(_));
                    if let Err(e) = engine.send(to_engine(message)).await {
                        break End::Replica(e.to_string());
                    }
                    if closing {
                        break End::Closed;
                    }
                }
                Some(Err(e)) if too_big(&e) => break End::TooBig("client"),
                Some(Err(_)) => break End::Client,
                None => break End::Closed,
            },
            from_engine = engine.next() => match from_engine {
                Some(Ok(message)) => {
                    let closing = matches!(message, EngineMessage::Close(_));
                    let Some(message) = to_client(message) else { continue };
                    if client.send(message).await.is_err() {
                        break End::Client;
                    }
                    if closing {
                        break End::Closed;
                    }
                }
                Some(Err(tungstenite::Error::Capacity(_))) => break End::TooBig("replica"),
                Some(Err(e)) => break End::Replica(e.to_string()),
                None => break End::Replica("the replica closed the connection without a close frame".into()),
            },
            () = &mut expiry => break End::Expired,
        }
    };
    let limit = config.max_message_bytes.bytes();
    let (code, reason, status, error) = match end {
        End::Closed => (None, String::new(), 200, None),
        End::Expired => (
            Some(1008),
            format!("the connection reached its maximum duration of {} s", config.max_duration_s),
            504,
            Some(ErrorCode::Timeout),
        ),
        End::TooBig(side) => (
            Some(1009),
            format!("a message from the {side} was over the {limit}-byte limit"),
            400,
            Some(ErrorCode::BadRequest),
        ),
        End::Replica(why) => {
            (Some(1011), format!("the replica failed: {why}"), 502, Some(ErrorCode::ReplicaFailed))
        }
        End::Client => (None, String::new(), 499, Some(ErrorCode::ClientClosed)),
    };
    if let Some(code) = code {
        // A close frame's reason is at most 123 bytes.
        let reason: String = reason
            .chars()
            .scan(0, |n, c| {
                *n += c.len_utf8();
                (*n <= 123).then_some(c)
            })
            .collect();
        let to_client = CloseFrame { code, reason: reason.as_str().into() };
        let _ = client.send(ws::Message::Close(Some(to_client))).await;
        let to_engine = EngineClose { code: CloseCode::from(code), reason: reason.as_str().into() };
        let _ = engine.close(Some(to_engine)).await;
    }
    drop(lease);
    tally.ended(status, error);
}

/// Whether a receive failed for a message over the size limit.
fn too_big(e: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(e) = source {
        if matches!(e.downcast_ref::<tungstenite::Error>(), Some(tungstenite::Error::Capacity(_))) {
            return true;
        }
        source = e.source();
    }
    false
}

/// A client's message as the replica's side sends it.
fn to_engine(message: ws::Message) -> EngineMessage {
    match message {
        ws::Message::Text(text) => EngineMessage::Text(text.as_str().into()),
        ws::Message::Binary(bytes) => EngineMessage::Binary(bytes),
        ws::Message::Ping(bytes) => EngineMessage::Ping(bytes),
        ws::Message::Pong(bytes) => EngineMessage::Pong(bytes),
        ws::Message::Close(frame) => EngineMessage::Close(
            frame.map(|f| EngineClose { code: CloseCode::from(f.code), reason: f.reason.as_str().into() }),
        ),
    }
}

/// A replica's message as the client's side sends it (a raw frame, which
/// a read never yields, is dropped).
fn to_client(message: EngineMessage) -> Option<ws::Message> {
    Some(match message {
        EngineMessage::Text(text) => ws::Message::Text(text.as_str().into()),
        EngineMessage::Binary(bytes) => ws::Message::Binary(bytes),
        EngineMessage::Ping(bytes) => ws::Message::Ping(bytes),
        EngineMessage::Pong(bytes) => ws::Message::Pong(bytes),
        EngineMessage::Close(frame) => ws::Message::Close(
            frame.map(|f| CloseFrame { code: f.code.into(), reason: f.reason.as_str().into() }),
        ),
        EngineMessage::Frame(_) => return None,
    })
}
