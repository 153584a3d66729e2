//! `hangar serve`: models placed on the node's GPUs, engines started for
//! their replicas, and an OpenAI-compatible gateway admitting requests onto
//! replica permits.
//!
//! The request path: the gateway reads `model` from the body, finds the
//! model's [`Processor`], waits for a permit ([`Processor::admit`]; 429
//! when the line is full, 504 past the model's timeout) and forwards the
//! request to the chosen replica, streaming the answer back; the permit is
//! given back when the answer ends or the client leaves.
//!
//! Replicas come from the placement policy (`replicas`): demand, the
//! admin API and failures change what a model should have, placement
//! decides where, and the resulting `DeploymentDelta` is applied in order —
//! `to_cache` puts an evicted replica's engine to sleep, `delete` stops it,
//! `from_cache` wakes it, `create` starts a new engine process. A replica
//! serves as soon as it is ready, and is watched until it is gone.

mod admin;
mod config;
mod data_dir;
mod gateway;
mod guard;
mod metrics;
mod predictions;
mod prompt;
mod relay;
mod replicas;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hangar_core::{AccountId, Millis, ModelKey, ReplicaId};
use hangar_placement::Cluster;
use hangar_queue::ScaleDown;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::processor::Processor;

pub use config::{
    ApiKey, ConfigError, ModelConfig, QueueConfig, ReplicaRouting, ServeConfig, DEMO, MAX_DURATION_S,
    MAX_QUEUE_CAPACITY,
};
pub use data_dir::{DataDirError, DataDirLock};
pub use guard::install_panic_hook;
use metrics::{Metrics, ModelMetrics};
use replicas::Replica;

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The configuration is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Listening or serving failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// A replica's name in logs, metrics and the admin API.
pub(crate) fn replica_name(model: &ModelKey, replica: ReplicaId) -> String {
    format!("{model}:{replica}")
}

pub(crate) struct ModelRuntime {
    pub config: ModelConfig,
    /// How long one request may take, waiting included.
    pub timeout: Duration,
    pub processor: Processor,
    pub metrics: Arc<ModelMetrics>,
    replicas: Mutex<BTreeMap<ReplicaId, Replica>>,
    /// Hot replicas kept whatever the demand: `min_replicas`, or what the
    /// admin API last set.
    target: AtomicU32,
    /// A placement change for this model is under way.
    scaling: AtomicBool,
    /// When replicas beyond the demand may go.
    scale_down: Mutex<ScaleDown>,
}

pub(crate) struct Inner {
    pub models: BTreeMap<String, Arc<ModelRuntime>>,
    /// API key → (account, may use the admin API); empty: the gateway is
    /// open.
    pub api_keys: HashMap<String, (AccountId, bool)>,
    placement: tokio::sync::Mutex<(Cluster, ChaCha8Rng)>,
    hangar_exe: PathBuf,
    /// For the control plane: health checks, sleep and wake-up.
    pub client: reqwest::Client,
    /// For forwarding requests.
    pub upstream: relay::Upstream,
    pub metrics: Metrics,
    /// The account of every request on an open gateway.
    pub anonymous: AccountId,
    /// The bearer key `/metrics` asks for, if any.
    pub metrics_key: Option<String>,
    epoch: Instant,
}

/// A running server's state; drop it (after [`Server::shutdown`]) to stop.
#[derive(Clone)]
pub struct Server {
    inner: Arc<Inner>,
}

impl Server {
    /// Builds the state and starts the `min_replicas` of every model,
    /// returning once they are ready (or failed, which is logged).
    pub async fn start(config: ServeConfig, hangar_exe: PathBuf) -> Result<Self, ServeError> {
        config.validate().map_err(|e| ServeError::Config(e.to_string()))?;
        let cluster = Cluster::new(config.cluster()).map_err(|e| ServeError::Config(e.to_string()))?;
        let api_keys =
            config.api_keys.iter().map(|k| (k.key.clone(), (k.account.clone(), k.admin))).collect();
        let metrics = Metrics::new();
        let models = config
            .models
            .iter()
            .map(|m| {
                let rt = ModelRuntime {
                    config: m.clone(),
                    timeout: config.timeout(m),
                    processor: Processor::new(m.admission(), m.chooser(config.seed)),
                    metrics: metrics.model(&m.key),
                    replicas: Mutex::new(BTreeMap::new()),
                    target: AtomicU32::new(m.min_replicas),
                    scaling: AtomicBool::new(false),
                    scale_down: Mutex::new(ScaleDown::new(m.scale_down_after_ms())),
                };
                (m.key.to_string(), Arc::new(rt))
            })
            .collect();
        let inner = Arc::new(Inner {
            models,
            api_keys,
            placement: tokio::sync::Mutex::new((cluster, ChaCha8Rng::seed_from_u64(config.seed))),
            hangar_exe,
            client: reqwest::Client::new(),
            upstream: relay::upstream(),
            metrics,
            anonymous: "anonymous".parse().expect("a valid account id"),
            metrics_key: config.metrics_key.clone(),
            epoch: Instant::now(),
        });
        tokio::spawn(replicas::watch_excess(Arc::downgrade(&inner)));
        for rt in inner.models.values() {
            if rt.config.min_replicas > 0 {
                if let Err(e) = inner.ensure(rt, rt.config.min_replicas).await {
                    tracing::error!(model = %rt.config.key, "could not start replicas: {e}");
                }
            }
        }
        Ok(Server { inner })
    }

    /// Every route of `hangar serve`: the OpenAI API, the admin API,
    /// health, metrics and the `predictions` API, under one body limit
    /// (413 beyond `max_body_bytes`) and the [`guard`] (request ids; a
    /// panicking handler answers 500).
    pub fn router(&self, predictions: &hangar_predictions::Service, max_body_bytes: usize) -> axum::Router {
        gateway::router(self.inner.clone())
            .merge(admin::router(self.inner.clone()))
            .merge(predictions.router())
            .layer(axum::extract::DefaultBodyLimit::max(max_body_bytes))
            .layer(axum::middleware::from_fn_with_state(self.inner.metrics.panics(), guard::guard))
    }

    /// Stops every engine this server started.
    pub async fn shutdown(&self) {
        for rt in self.inner.models.values() {
            for engine in rt.take_engines() {
                engine.stop(Duration::from_secs(5)).await;
            }
        }
    }
}

impl ModelRuntime {
    /// Milliseconds from `now` until replicas beyond the demand are given
    /// back if the model stays quiet; `None` when it has none in excess.
    pub fn scale_down_in(&self, now: Millis) -> Option<Millis> {
        let at = self.scale_down.lock().expect("scale-down lock").poll_timeout()?;
        Some(at.saturating_sub(now))
    }

    /// Whether `account` may use this model.
    pub fn allows(&self, account: &AccountId) -> bool {
        self.config.access.as_ref().is_none_or(|accounts| accounts.contains(account))
    }
}

impl Inner {
    pub(crate) fn now(&self) -> Millis {
        self.epoch.elapsed().as_millis() as Millis
    }
}
