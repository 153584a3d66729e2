//! A token stream over WebSocket, `GET /v1/ws`: what a gateway's
//! WebSocket relay is tested against (Workers AI relays such connections
//! to engines that speak them, seed 001).
//!
//! Each text message the client sends is one completion,
//! `{"prompt": "...", "max_tokens": N}` (`max_tokens` defaults to the
//! engine's default); the engine answers it with one message per token,
//! `{"type": "token", "text": "..."}`, then
//! `{"type": "done", "usage": {...}}` — or `{"type": "error", "message":
//! "..."}` for a request it refuses. Completions on one connection run one
//! after the other, on the same engine core as the HTTP API.

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::response::Response;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::api::{usage, Shared};
use crate::driver::Progress;
use crate::text;

/// One completion asked over the socket.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Ask {
    prompt: String,
    max_tokens: Option<u32>,
}

/// Upgrades the connection and answers completions on it until the client
/// closes it.
pub(crate) async fn stream(State(s): State<Shared>, upgrade: WebSocketUpgrade) -> Response {
    upgrade.on_upgrade(move |socket| serve(s, socket))
}

/// # Cancel safety
/// Dropping it drops the run in progress, which aborts it in the core.
async fn serve(s: Shared, mut socket: WebSocket) {
    while let Some(Ok(message)) = socket.recv().await {
        let text = match message {
            Message::Text(text) => text,
            Message::Close(_) => return,
            _ => continue,
        };
        let answered = match answer(&s, text.as_str(), &mut socket).await {
            Ok(()) => Ok(()),
            Err(why) => send(&mut socket, json!({"type": "error", "message": why})).await,
        };
        if answered.is_err() {
            return;
        }
    }
}

/// Runs one completion, streaming its tokens; `Err` with why it was
/// refused (the socket's own failures end the connection instead).
async fn answer(s: &Shared, text: &str, socket: &mut WebSocket) -> Result<(), String> {
    s.check_ready().map_err(|e| e.message)?;
    let ask: Ask =
        serde_json::from_str(text).map_err(|e| format!("a message must be {{\"prompt\": …}}: {e}"))?;
    let max_tokens = ask.max_tokens.unwrap_or(s.default_max_tokens);
    if max_tokens == 0 {
        return Err("`max_tokens` must be at least 1".into());
    }
    let mut run = s.submit(text::tokenize(&ask.prompt), max_tokens, None).map_err(|e| e.message)?;
    let mut n = 0;
    while let Some(progress) = run.progress.recv().await {
        let message = match progress {
            Progress::Token(i) => {
                n += 1;
                json!({"type": "token", "text": text::output_piece(run.fingerprint, i)})
            }
            Progress::Done { cached_tokens } => {
                json!({"type": "done", "usage": usage(run.prompt_tokens, n, cached_tokens)})
            }
            Progress::Refused(why) => return Err(why),
        };
        let done = message["type"] == "done";
        // The client gone: dropping `run` aborts the request.
        if send(socket, message).await.is_err() || done {
            return Ok(());
        }
    }
    Err("the engine stopped".into())
}

async fn send(socket: &mut WebSocket, message: Value) -> Result<(), axum::Error> {
    socket.send(Message::Text(message.to_string().into())).await
}
