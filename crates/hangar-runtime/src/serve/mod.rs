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
//! Replicas come from the placement policy: starting (and a model's first
//! request when it has none) asks `hangar-placement` for replicas, and the
//! resulting `DeploymentDelta` is applied in order — `to_cache` puts an
//! evicted replica's engine to sleep, `delete` stops it, `from_cache` wakes
//! it, `create` starts a new engine process. A replica serves as soon as it
//! is ready.

mod config;
mod gateway;
mod predictions;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hangar_core::{AccountId, Millis, ModelKey, ReplicaId};
use hangar_placement::{Action, Cluster, DeploymentDelta, ReplicaRequest};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::engine::{launch, LaunchContext, RunningEngine};
use crate::processor::Processor;

pub use config::{ApiKey, ModelConfig, ReplicaRouting, ServeConfig, DEMO};

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The placement part of the configuration is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Listening or serving failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

struct Replica {
    base_url: String,
    engine: Option<RunningEngine>,
    /// Serving (not put to sleep by an eviction to the warm cache).
    awake: bool,
}

pub(crate) struct ModelRuntime {
    pub config: ModelConfig,
    pub processor: Processor,
    replicas: Mutex<BTreeMap<ReplicaId, Replica>>,
    scaling: AtomicBool,
}

pub(crate) struct Inner {
    pub models: BTreeMap<String, Arc<ModelRuntime>>,
    /// API key → account; empty: the gateway is open.
    pub api_keys: HashMap<String, AccountId>,
    placement: tokio::sync::Mutex<(Cluster, ChaCha8Rng)>,
    hangar_exe: PathBuf,
    pub client: reqwest::Client,
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
        let cluster = Cluster::new(config.cluster()).map_err(|e| ServeError::Config(e.to_string()))?;
        let mut api_keys = HashMap::new();
        for (i, k) in config.api_keys.iter().enumerate() {
            if k.key.trim().is_empty() {
                return Err(ServeError::Config(format!("api_keys[{i}].key is empty")));
            }
            if api_keys.insert(k.key.clone(), k.account.clone()).is_some() {
                return Err(ServeError::Config(format!("api_keys[{i}].key repeats an earlier key")));
            }
        }
        let models = config
            .models
            .iter()
            .map(|m| {
                let rt = ModelRuntime {
                    config: m.clone(),
                    processor: Processor::new(m.queue.clone(), m.router.chooser()),
                    replicas: Mutex::new(BTreeMap::new()),
                    scaling: AtomicBool::new(false),
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
            epoch: Instant::now(),
        });
        let server = Server { inner };
        for m in &config.models {
            if m.min_replicas > 0 {
                if let Err(e) = server.inner.ensure(&m.key, m.min_replicas).await {
                    tracing::error!(model = %m.key, "could not start replicas: {e}");
                }
            }
        }
        Ok(server)
    }

    /// The HTTP gateway for this server.
    pub fn router(&self, max_body_bytes: usize) -> axum::Router {
        gateway::router(self.inner.clone(), max_body_bytes)
    }

    /// Stops every engine this server started.
    pub async fn shutdown(&self) {
        for rt in self.inner.models.values() {
            let engines: Vec<RunningEngine> = {
                let mut replicas = rt.replicas.lock().expect("replica table lock");
                std::mem::take(&mut *replicas).into_values().filter_map(|r| r.engine).collect()
            };
            for e in engines {
                e.stop(Duration::from_secs(5)).await;
            }
        }
    }
}

impl ModelRuntime {
    /// Whether `account` may use this model.
    pub fn allows(&self, account: &AccountId) -> bool {
        self.config.access.as_ref().is_none_or(|accounts| accounts.contains(account))
    }
}

impl Inner {
    fn now(&self) -> Millis {
        self.epoch.elapsed().as_millis() as Millis
    }

    /// Starts a replica for a model with none, unless one is on its way.
    pub fn wake_model(self: &Arc<Self>, rt: &Arc<ModelRuntime>) {
        let empty = !rt.replicas.lock().expect("replica table lock").values().any(|r| r.awake);
        if empty && !rt.scaling.swap(true, Ordering::SeqCst) {
            let inner = self.clone();
            let rt = rt.clone();
            tokio::spawn(async move {
                if let Err(e) = inner.ensure(&rt.config.key, 1).await {
                    tracing::error!(model = %rt.config.key, "cold start failed: {e}");
                    rt.processor.fail_waiting(&format!("no replica of `{}` could start: {e}", rt.config.key));
                }
                rt.scaling.store(false, Ordering::SeqCst);
            });
        }
    }

    /// Asks placement for `replicas` hot replicas of `model` and applies
    /// the resulting delta.
    async fn ensure(&self, model: &ModelKey, replicas: u32) -> Result<(), String> {
        let delta = {
            let mut guard = self.placement.lock().await;
            let (cluster, rng) = &mut *guard;
            let before = cluster.snapshot();
            let request = ReplicaRequest { model_key: model.clone(), replicas, dedicated: false };
            let outcome = cluster.deploy(&[request], self.now(), rng);
            if outcome.models.first().is_none_or(|m| m.hot() == 0) {
                let reason = outcome
                    .models
                    .first()
                    .and_then(|m| m.replicas.iter().find_map(|r| r.reason.as_ref()))
                    .map_or("no room".to_owned(), |r| format!("{r:?}"));
                return Err(format!("placement found no room: {reason}"));
            }
            DeploymentDelta::between(&before, &cluster.snapshot()).map_err(|e| e.to_string())?
        };
        for step in delta.steps() {
            let d = step.deployment;
            let Some(rt) = self.models.get(d.model_key.as_str()) else { continue };
            match step.action {
                Action::ToCache | Action::Delete => {
                    self.retire(rt, d.replica_id, step.action == Action::Delete).await
                }
                Action::FromCache => {
                    let url =
                        rt.replicas.lock().expect("lock").get(&d.replica_id).map(|r| r.base_url.clone());
                    if let Some(url) = url {
                        let _ = self.client.post(format!("{url}/wake_up")).send().await;
                        if let Some(r) = rt.replicas.lock().expect("lock").get_mut(&d.replica_id) {
                            r.awake = true;
                        }
                        rt.processor.replica_ready(d.replica_id, rt.config.concurrency);
                    }
                }
                Action::Create => {
                    let ctx = LaunchContext {
                        model: d.model_key.to_string(),
                        gpus: d.gpu_bytes_by_gpu.keys().copied().collect(),
                        gpu_fraction: d.gpu_fraction.unwrap_or(1.0),
                        hangar_exe: self.hangar_exe.clone(),
                        mock_setup_timeout: Duration::from_secs(600),
                    };
                    let engine = launch(&rt.config.engine, &ctx).await.map_err(|e| e.to_string())?;
                    tracing::info!(replica = %d.name(), url = %engine.base_url, "replica ready");
                    let base_url = engine.base_url.clone();
                    let replica = Replica { base_url, engine: Some(engine), awake: true };
                    rt.replicas.lock().expect("lock").insert(d.replica_id, replica);
                    rt.processor.replica_ready(d.replica_id, rt.config.concurrency);
                }
                Action::Update => {}
            }
        }
        Ok(())
    }

    /// Takes a replica out of service: no new requests; then it sleeps
    /// (warm) once idle, or is stopped.
    async fn retire(&self, rt: &Arc<ModelRuntime>, replica: ReplicaId, delete: bool) {
        rt.processor.replica_gone(replica);
        if delete {
            let engine = rt.replicas.lock().expect("lock").remove(&replica).and_then(|r| r.engine);
            if let Some(e) = engine {
                e.stop(Duration::from_secs(5)).await;
            }
            return;
        }
        let url = rt.replicas.lock().expect("lock").get_mut(&replica).map(|r| {
            r.awake = false;
            r.base_url.clone()
        });
        if let Some(url) = url {
            // The engine refuses to sleep while requests run; wait for them.
            for _ in 0..600 {
                match self.client.post(format!("{url}/sleep")).send().await {
                    Ok(r) if r.status() == reqwest::StatusCode::CONFLICT => {
                        tokio::time::sleep(Duration::from_millis(100)).await
                    }
                    _ => break,
                }
            }
        }
    }

    /// The base URL of a replica of `rt`.
    pub fn replica_url(&self, rt: &ModelRuntime, replica: ReplicaId) -> Option<String> {
        rt.replicas.lock().expect("lock").get(&replica).map(|r| r.base_url.clone())
    }
}
