//! The HTTP surface of `hangar serve`, over the state and control plane
//! `hangar-runtime`'s [`Server`] holds.
//!
//! - `openai`: the OpenAI-compatible API (chat, completions, embeddings,
//!   models), forwarded to the models' replicas with per-request deadlines
//!   and one retry, and the server's health, readiness and `/metrics`;
//! - `admin`: the admin API, what runs where and the operator's levers;
//! - `usage`: `GET /v1/usage`, the inference events added up per model,
//!   account, day or hour, an account seeing only its own;
//! - `queued`: Workers AI's async mode on the OpenAI routes
//!   (`options.queueRequest`, answered by polling with
//!   `inputs.request_id`), on the predictions' durable queue;
//! - `ui`: the live status page, `/ui` (admin key), drawn from
//!   `GET /admin/status`;
//! - `guard`: the layer on every route (request ids; a panicking handler
//!   answers 500, logged once by [`install_panic_hook`]);
//! - [`router`]: all of them with the predictions API of
//!   `hangar-predictions`, under one body limit.
#![deny(missing_docs)]

mod admin;
mod guard;
mod openai;
mod queued;
mod relay;
mod rename;
mod ui;
mod usage;
mod ws;

use axum::extract::DefaultBodyLimit;
use axum::middleware::from_fn_with_state;
use hangar_predictions::Service;
use hangar_runtime::serve::Server;

pub use guard::install_panic_hook;

/// Every route of `hangar serve`: the OpenAI API, the admin API and the
/// status page, health, metrics, usage and the `predictions` API, under one
/// body limit (413 beyond
/// `max_body_bytes`) and the guard (request ids; a panicking handler
/// answers 500).
pub fn router(server: &Server, predictions: &Service, max_body_bytes: usize) -> axum::Router {
    openai::router(server.clone())
        .merge(admin::router(server.clone()))
        .merge(ui::router(server.clone()))
        .merge(usage::router(server.clone()))
        .merge(ws::router(server.clone()))
        .merge(predictions.router())
        // The OpenAI routes queue requests in Workers AI's async mode.
        .layer(axum::Extension(predictions.clone()))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(from_fn_with_state(server.panic_counter(), guard::guard))
}
