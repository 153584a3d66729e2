//! Hangar's live mock engine.
//!
//! A real HTTP server that behaves like an OpenAI-compatible LLM engine
//! (vLLM's API: `/v1/chat/completions`, `/v1/completions` with and without
//! SSE streaming, `/v1/embeddings`, `/v1/models`, `/health`, `/metrics`,
//! and sleep mode's `/sleep`, `/wake_up`, `/is_sleeping`) without a GPU. It
//! drives the same [`hangar_engine::EngineCore`] the simulator replays, in
//! real time: concurrent requests are batched into passes, tokens come out
//! when the modelled pass ends, and prefix caching, preemption and KV memory
//! behave as in the simulator. Output text is deterministic (a function of
//! the prompt and the token's position) and usage counts are exact, so
//! tests can assert on them.
//!
//! The server is what `hangar engine mock` runs; the platform's node agent
//! starts it as a child process to stand in for vLLM.
#![deny(missing_docs)]

mod api;
mod driver;
mod error;
mod metrics;
mod openai;
mod text;
mod ws;

use std::future::Future;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::serve::ListenerExt;
use hangar_engine::{EngineConfig, EngineCore};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

pub use error::ApiError;
pub use hangar_engine::preset::{preset, presets, Preset};

/// How to run a mock engine.
#[derive(Debug, Clone)]
pub struct MockConfig {
    /// The model name clients must send (and `/v1/models` lists).
    pub model: String,
    /// The scheduler and its timing.
    pub engine: EngineConfig,
    /// Dimensions of embedding vectors.
    pub embedding_dims: usize,
    /// How long the server reports "loading" after start (weight loading).
    pub startup_delay: Duration,
    /// How long `/wake_up` takes (reloading weights after sleep).
    pub wake_delay: Duration,
    /// Output tokens of a chat request that sets no `max_tokens`.
    pub default_max_tokens: u32,
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    /// Whether it serves vLLM's sleep API (`/sleep`, `/wake_up`,
    /// `/is_sleeping`); without it those answer 404, as llama.cpp's
    /// server does, so the engine can only be stopped, not put to sleep.
    pub sleep_api: bool,
    /// The weights file it read at start (`--weights`), which `/v1/models`
    /// reports: what a test checks to know the engine opened the bytes it
    /// was handed.
    pub weights: Option<WeightsRead>,
}

/// A weights file the mock engine read whole before serving.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct WeightsRead {
    /// The path it was given.
    pub path: String,
    /// Bytes read.
    pub bytes: u64,
    /// BLAKE3 of those bytes, hex.
    pub blake3: String,
}

impl MockConfig {
    /// A configuration from a preset, with defaults for the rest.
    pub fn from_preset(p: &Preset, model: impl Into<String>) -> Self {
        Self {
            model: model.into(),
            engine: p.engine.clone(),
            embedding_dims: p.embedding_dims,
            startup_delay: Duration::ZERO,
            wake_delay: Duration::ZERO,
            sleep_api: true,
            default_max_tokens: 16,
            max_body_bytes: 16 << 20,
            weights: None,
        }
    }
}

/// Why a mock engine could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The engine configuration is invalid.
    #[error(transparent)]
    Engine(#[from] hangar_engine::ConfigError),
    /// The listener failed.
    #[error("serving HTTP failed: {0}")]
    Io(#[from] std::io::Error),
}

/// Serves on `listener` until `shutdown` resolves, then finishes the
/// requests in flight and returns. `load` reads a timing table file if the
/// engine configuration names one.
///
/// # Cancel safety
/// Dropping the returned future stops the server and the engine task with
/// it; requests in flight are dropped.
pub async fn serve(
    config: MockConfig,
    listener: TcpListener,
    load: impl FnOnce(&str) -> Result<String, String>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), StartError> {
    let engine = EngineCore::new(&config.engine, load)?;
    let (commands, rx) = mpsc::unbounded_channel();
    let (asleep_tx, asleep) = watch::channel(false);
    let metrics = metrics::Metrics::default();
    let engine_task = tokio::spawn(driver::run(engine, rx, asleep_tx, config.wake_delay, metrics.clone()));
    let state = Arc::new(api::AppState {
        model: config.model,
        block_size: config.engine.block_size,
        embedding_dims: config.embedding_dims,
        default_max_tokens: config.default_max_tokens,
        commands,
        asleep,
        ready_at: Instant::now() + config.startup_delay,
        next_id: AtomicU64::new(0),
        metrics,
        weights: config.weights,
    });
    let app = api::router(state, config.max_body_bytes, config.sleep_api);
    // Streamed tokens are small writes: send each at once (no Nagle).
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await?;
    engine_task.abort();
    Ok(())
}
