//! [`NodeEngines`]: the node's real engines as the lifecycle driver uses
//! them — a start materializes the model's weights through the node's
//! store, launches its engine ([`crate::engine`]) and asks what it can do
//! ([`crate::capabilities`]); sleep and wake go through the engine's own
//! sleep API; a stop ends the process and lets the weights go; a health
//! check looks at the process and, while awake, at its health route.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hangar_core::{ModelKey, ReplicaId};
use tokio_util::sync::CancellationToken;

use super::driver::{Engines, Health, SleepAnswer, StartError, StartReport, Started, STOP_GRACE};
use super::machine::Slot;
use crate::capabilities::{self, SleepApi};
use crate::cog;
use crate::engine::{launch_on, EngineSpec, LaunchContext, RunningEngine};
use crate::weights::{LoadedWeights, WeightStore, WeightsSource};

/// How long one health check may take.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a sleep or wake call may take: well beyond moving a large
/// model's weights between GPU and host memory (140 GB at PCIe speed is
/// about ten seconds), and an end to a step on an engine that hung.
const SLEEP_CALL_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a mock engine may take to load.
const MOCK_SETUP_TIMEOUT: Duration = Duration::from_secs(600);

/// What runs one model's replicas on this node.
#[derive(Debug, Clone)]
pub struct ModelEngine {
    /// Its engine.
    pub spec: EngineSpec,
    /// Its weights, materialized before each start, if it has any.
    pub weights: Option<WeightsSource>,
}

/// The node's engines: how each model's replicas start, and where.
pub struct NodeEngines {
    models: BTreeMap<ModelKey, ModelEngine>,
    hangar_exe: PathBuf,
    engine_host: String,
    client: reqwest::Client,
    store: Option<Arc<WeightStore>>,
}

impl NodeEngines {
    /// Engines for `models`, bound to `engine_host` (loopback on one
    /// machine, an address the gateways reach on a fleet's node), `mock`
    /// ones run from `hangar_exe`, weights through `store` (needed when a
    /// model has weights).
    pub fn new(
        models: BTreeMap<ModelKey, ModelEngine>,
        hangar_exe: PathBuf,
        engine_host: String,
        client: reqwest::Client,
        store: Option<Arc<WeightStore>>,
    ) -> Self {
        NodeEngines { models, hangar_exe, engine_host, client, store }
    }

    /// `POST {url}{path}` with an empty JSON object: a sleep or wake call
    /// (SGLang's take a body, vLLM's ignore it).
    ///
    /// An engine that does not answer within [`SLEEP_CALL_TIMEOUT`] has
    /// hung: the call fails, so a sleep is refused (the engine is then
    /// stopped) and a wake fails (the same), rather than the step waiting
    /// for ever.
    async fn call(&self, url: &str, path: &str) -> reqwest::Result<reqwest::Response> {
        let call = self.client.post(format!("{url}{path}")).json(&serde_json::json!({}));
        call.timeout(SLEEP_CALL_TIMEOUT).send().await
    }

    /// Ends `replica`'s engine process — stopped within `grace`, or killed
    /// at once (`None`) — and lets its weights go.
    async fn end(&self, replica: ReplicaId, engine: &LiveEngine, grace: Option<Duration>) {
        let process = engine.process.lock().await.take();
        match (process, grace) {
            (Some(p), Some(grace)) => p.stop(grace).await,
            (Some(p), None) => p.kill().await,
            (None, _) => {}
        }
        self.release(replica).await;
    }

    /// Materializes `model`'s weights for `replica`, if it has any.
    async fn load(&self, replica: ReplicaId, model: &ModelKey) -> Result<Option<LoadedWeights>, String> {
        let Some(source) = self.models.get(model).and_then(|m| m.weights.as_ref()) else { return Ok(None) };
        let store =
            self.store.as_ref().ok_or_else(|| format!("`{model}` has weights but the node has no store"))?;
        store.load(model, source, replica).await.map(Some).map_err(|e| e.to_string())
    }

    async fn release(&self, replica: ReplicaId) {
        if let Some(store) = &self.store {
            store.release(replica).await;
        }
    }

    /// A start after its weights: launch, probe, report.
    async fn launch(
        &self,
        model: &ModelKey,
        spec: &EngineSpec,
        slot: &Slot,
        weights: Option<LoadedWeights>,
        placed: Instant,
    ) -> Result<Started<LiveEngine>, String> {
        let ctx = LaunchContext {
            model: model.to_string(),
            gpus: slot.gpu_list(),
            gpu_fraction: slot.fraction.unwrap_or(1.0),
            hangar_exe: self.hangar_exe.clone(),
            mock_setup_timeout: MOCK_SETUP_TIMEOUT,
            weights: weights.as_ref().map(LoadedWeights::handed),
        };
        let spawned = Instant::now();
        let engine = launch_on(spec, &ctx, &self.engine_host).await.map_err(|e| e.to_string())?;
        let engine_ms = spawned.elapsed().as_millis() as u64;
        let url = engine.base_url.clone();
        let capabilities = capabilities::probe(&self.client, &url, spec).await;
        let report = StartReport {
            logs: engine.logs().text(),
            ..StartReport::ready(
                weights.as_ref().map(|w| w.report.clone()),
                engine_ms,
                placed.elapsed().as_millis() as u64,
            )
        };
        let pid = engine.pid();
        let live = LiveEngine {
            process: tokio::sync::Mutex::new(Some(engine)),
            url: url.clone(),
            sleep: capabilities.sleep,
            cog: spec.is_cog(),
            metrics: capabilities.metrics,
            _weights: Mutex::new(weights),
        };
        Ok(Started { engine: live, url, pid, capabilities, report })
    }
}

/// One running engine of the node.
pub struct LiveEngine {
    /// The process (`None` once stopped).
    process: tokio::sync::Mutex<Option<RunningEngine>>,
    url: String,
    sleep: Option<SleepApi>,
    cog: bool,
    /// It serves Prometheus metrics (which may say how busy it is).
    metrics: bool,
    /// Its weights' memory, mapped while the engine lives.
    _weights: Mutex<Option<LoadedWeights>>,
}

impl Engines for NodeEngines {
    type Engine = LiveEngine;

    async fn start(
        &self,
        replica: ReplicaId,
        model: &ModelKey,
        slot: &Slot,
        abandon: CancellationToken,
    ) -> Result<Started<LiveEngine>, StartError> {
        let Some(spec) = self.models.get(model).map(|m| m.spec.clone()) else {
            return Err(StartError::Failed(format!("this node's configuration has no model `{model}`")));
        };
        let placed = Instant::now();
        let started = tokio::select! {
            // Dropping a launch kills what it started; a load finishes on
            // its thread and is released below.
            () = abandon.cancelled() => Err(StartError::Abandoned),
            r = async {
                let weights = self.load(replica, model).await.map_err(StartError::Failed)?;
                self.launch(model, &spec, slot, weights, placed).await.map_err(StartError::Failed)
            } => r,
        };
        if started.is_err() {
            self.release(replica).await;
        }
        started
    }

    async fn sleep(&self, engine: &LiveEngine) -> SleepAnswer {
        let Some(api) = engine.sleep else { return SleepAnswer::Refused("its engine cannot sleep".into()) };
        match self.call(&engine.url, api.sleep_path()).await {
            Ok(r) if r.status().is_success() => SleepAnswer::Slept,
            Ok(r) if r.status() == reqwest::StatusCode::CONFLICT => SleepAnswer::Busy,
            other => SleepAnswer::Refused(capabilities::describe(other).await),
        }
    }

    async fn wake(&self, engine: &LiveEngine) -> Result<(), String> {
        let Some(api) = engine.sleep else { return Err("its engine cannot sleep, nor wake".into()) };
        match self.call(&engine.url, api.wake_path()).await {
            Ok(r) if r.status().is_success() => Ok(()),
            other => Err(capabilities::describe(other).await),
        }
    }

    async fn stop(&self, replica: ReplicaId, engine: Arc<LiveEngine>) {
        self.end(replica, &engine, Some(STOP_GRACE)).await;
    }

    async fn kill(&self, replica: ReplicaId, engine: Arc<LiveEngine>) {
        self.end(replica, &engine, None).await;
    }

    async fn busy(&self, engine: &LiveEngine) -> Option<u32> {
        if !engine.metrics || engine.process.lock().await.is_none() {
            return None;
        }
        let answer =
            self.client.get(format!("{}/metrics", engine.url)).timeout(HEALTH_TIMEOUT).send().await.ok()?;
        busy_requests(&answer.text().await.ok()?)
    }

    async fn check(&self, engine: &LiveEngine, awake: bool) -> Health {
        {
            let mut process = engine.process.lock().await;
            if process.as_mut().is_none_or(RunningEngine::has_exited) {
                return Health::Exited;
            }
        }
        let path = match (awake, engine.sleep) {
            (true, _) => "/health",
            (false, Some(api)) => api.state_path(),
            (false, None) => return Health::Ok,
        };
        if engine.cog {
            // Cog answers 200 whatever its state: read the state.
            return match cog::health(&self.client, &engine.url, HEALTH_TIMEOUT).await {
                Ok(h) if h.serves() => Health::Ok,
                _ => Health::NoAnswer,
            };
        }
        match self.client.get(format!("{}{path}", engine.url)).timeout(HEALTH_TIMEOUT).send().await {
            Ok(r) if r.status().is_success() => Health::Ok,
            _ => Health::NoAnswer,
        }
    }
}

/// The gauges engines publish for the requests they run or hold: vLLM's,
/// SGLang's, llama.cpp's and Hangar's mock engine's.
const BUSY_GAUGES: [&str; 7] = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "llamacpp:requests_processing",
    "hangar_mock_num_requests_running",
    "hangar_mock_num_requests_waiting",
];

/// The requests an engine's Prometheus text says it runs or holds: the sum
/// of the [`BUSY_GAUGES`] it has (over all their label sets); `None` if it
/// has none of them.
fn busy_requests(metrics: &str) -> Option<u32> {
    let mut found = None;
    for line in metrics.lines().filter(|l| !l.starts_with('#')) {
        let Some((name, value)) = line.rsplit_once(' ') else { continue };
        let name = name.split('{').next().unwrap_or(name).trim();
        if BUSY_GAUGES.contains(&name) {
            let v = value.trim().parse::<f64>().unwrap_or(0.0).max(0.0) as u32;
            found = Some(found.unwrap_or(0) + v);
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An engine that accepts connections and never answers (hung).
    async fn hung_engine() -> (tokio::net::TcpListener, LiveEngine) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let engine = LiveEngine {
            process: tokio::sync::Mutex::new(None),
            url: format!("http://{}", listener.local_addr().unwrap()),
            sleep: Some(SleepApi::Vllm),
            cog: false,
            metrics: false,
            _weights: Mutex::new(None),
        };
        (listener, engine)
    }

    /// A sleep or wake of a hung engine ends (refused, failed) once its
    /// time is out, so the step ends and the engine is stopped.
    #[tokio::test(start_paused = true)]
    async fn a_hung_engine_refuses_to_sleep_and_fails_to_wake_in_time() {
        let (_listener, engine) = hung_engine().await;
        let engines = NodeEngines::new(
            BTreeMap::new(),
            PathBuf::new(),
            "127.0.0.1".into(),
            crate::direct_http().build().unwrap(),
            None,
        );
        let began = tokio::time::Instant::now();
        let answer = tokio::time::timeout(2 * SLEEP_CALL_TIMEOUT, engines.sleep(&engine))
            .await
            .expect("the sleep ended");
        assert_eq!(answer, SleepAnswer::Refused("it did not answer in time".into()));
        assert!(began.elapsed() >= SLEEP_CALL_TIMEOUT, "ended before its time: {:?}", began.elapsed());
        let why = tokio::time::timeout(2 * SLEEP_CALL_TIMEOUT, engines.wake(&engine))
            .await
            .expect("the wake ended");
        assert_eq!(why, Err("it did not answer in time".into()));
    }

    #[test]
    fn engines_say_how_busy_they_are_in_their_own_gauges() {
        let vllm = "# HELP vllm:num_requests_running x\nvllm:num_requests_running{model_name=\"m\"} 2.0\n\
                    vllm:num_requests_waiting{model_name=\"m\"} 1.0\nvllm:gpu_cache_usage_perc 0.5\n";
        assert_eq!(busy_requests(vllm), Some(3));
        assert_eq!(
            busy_requests("hangar_mock_num_requests_running 0\nhangar_mock_num_requests_waiting 0\n"),
            Some(0)
        );
        assert_eq!(busy_requests("process_cpu_seconds_total 12\n"), None);
    }
}
