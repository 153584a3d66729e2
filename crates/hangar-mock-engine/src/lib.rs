//! Hangar's live mock engine.
//!
//! A real HTTP server that behaves like an OpenAI-compatible LLM engine
//! (vLLM's API: `/v1/chat/completions`, `/v1/completions` with and without
//! SSE streaming, `/v1/embeddings`, `/v1/models`, `/health`, `/metrics`,
//! sleep mode's `/sleep`, `/wake_up`, `/is_sleeping`, and the runtime LoRA
//! API's `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`) without a GPU. It
//! drives the same [`hangar_engine::EngineCore`] the simulator replays, in
//! real time: concurrent requests are batched into passes, tokens come out
//! when the modelled pass ends, and prefix caching, preemption and KV memory
//! behave as in the simulator. Output text is deterministic (a function of
//! the prompt and the token's position) and usage counts are exact, so
//! tests can assert on them.
//!
//! Weights given at start (`--weights`) are read whole before it serves: a
//! file, or a Hugging Face model directory whose `config.json` and
//! safetensors headers are checked as vLLM's loader checks them
//! ([`weights`]).
//!
//! LoRA adapters are read whole from the path a load names and take a load
//! time modelled on their size; a request naming a loaded adapter runs on
//! the same engine core as the base model's, with output text and prefix
//! cache of its own (the adapter table, `adapters`, is sans-IO).
//!
//! The server is what `hangar engine mock` runs; the platform's node agent
//! starts it as a child process to stand in for vLLM.
#![deny(missing_docs)]

mod adapters;
mod api;
mod driver;
mod error;
mod lora;
mod metrics;
mod openai;
mod text;
pub mod weights;
mod ws;

use std::future::Future;
use std::num::NonZeroU64;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::serve::ListenerExt;
use hangar_engine::{EngineConfig, EngineCore};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

pub use error::ApiError;
pub use hangar_engine::preset::{preset, presets, Preset};
pub use weights::WeightsRead;

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
    /// The weights it read at start (`--weights`: a file, or a model
    /// directory, [`weights::read`]), which `/v1/models` reports: what a
    /// test checks to know the engine opened the bytes it was handed.
    pub weights: Option<WeightsRead>,
    /// Whether it serves vLLM's runtime LoRA API (`/v1/load_lora_adapter`,
    /// `/v1/unload_lora_adapter`), as vLLM does with
    /// `VLLM_ALLOW_RUNTIME_LORA_UPDATING`; without it those answer 404, so
    /// Hangar's capability probe finds no LoRA.
    pub lora_api: bool,
    /// Most adapters loaded (and loading) at once; a load beyond is refused
    /// with 400 naming the limit (vLLM's `--max-loras`).
    pub max_loras: usize,
    /// How fast a load reads an adapter's bytes: its load time is
    /// `bytes / lora_load_bytes_per_s + lora_load_ms`.
    pub lora_load_bytes_per_s: NonZeroU64,
    /// The part of an adapter's load time that does not depend on its size
    /// (building its layers, copying them to the GPU).
    pub lora_load_ms: u64,
    /// While this file exists, every inference request is answered 500 at
    /// once while `/health` still answers 200: an engine that fails every
    /// request without looking dead (a *black hole*), to try what a
    /// gateway does with one.
    pub fail_while: Option<std::path::PathBuf>,
}

/// Default of [`MockConfig::lora_load_bytes_per_s`]: 2 GB/s, an NVMe
/// drive's sequential read and the simulator's `cold_start.disk_gbps`.
pub const DEFAULT_LORA_LOAD_BYTES_PER_S: NonZeroU64 = NonZeroU64::new(2_000_000_000).expect("non-zero");
/// Default of [`MockConfig::lora_load_ms`]: 50 ms, what PEFT takes to set
/// up an adapter apart from reading it (25–60 ms measured).
pub const DEFAULT_LORA_LOAD_MS: u64 = 50;
/// Default of [`MockConfig::max_loras`]: 8, as the adapter slots' default
/// (`AdapterConfig::slots`).
pub const DEFAULT_MAX_LORAS: usize = 8;

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
            lora_api: true,
            max_loras: DEFAULT_MAX_LORAS,
            lora_load_bytes_per_s: DEFAULT_LORA_LOAD_BYTES_PER_S,
            lora_load_ms: DEFAULT_LORA_LOAD_MS,
            fail_while: None,
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
    let lora = lora::Lora::new(
        &config.model,
        config.max_loras,
        config.lora_load_bytes_per_s,
        Duration::from_millis(config.lora_load_ms),
    );
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
        lora,
        fail_while: config.fail_while,
    });
    let app = api::router(state, config.max_body_bytes, config.sleep_api, config.lora_api);
    // Streamed tokens are small writes: send each at once (no Nagle).
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await?;
    engine_task.abort();
    Ok(())
}
