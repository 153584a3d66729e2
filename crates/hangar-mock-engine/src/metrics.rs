//! Prometheus metrics of the mock engine (`GET /metrics`), named like
//! vLLM's where vLLM has the same figure.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use hangar_engine::Pass;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Shared handles to every metric; cloning is cheap.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

struct Inner {
    registry: Registry,
    requests: Counter,
    aborted: Counter,
    passes: Counter,
    generation_tokens: Counter,
    prompt_tokens: Counter,
    running: Gauge,
    waiting: Gauge,
    kv_usage: Gauge<f64, AtomicU64>,
    max_batch: Gauge,
    adapter_loads: Counter,
    adapters_loaded: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("hangar_mock");
        let (requests, aborted, passes) = (Counter::default(), Counter::default(), Counter::default());
        let (generation_tokens, prompt_tokens) = (Counter::default(), Counter::default());
        let (running, waiting, max_batch) = (Gauge::default(), Gauge::default(), Gauge::default());
        let kv_usage = Gauge::<f64, AtomicU64>::default();
        let (adapter_loads, adapters_loaded) = (Counter::default(), Gauge::default());
        registry.register("requests", "Requests accepted by the engine", requests.clone());
        registry.register("requests_aborted", "Requests aborted because their client left", aborted.clone());
        registry.register("passes", "Scheduler passes run", passes.clone());
        registry.register("generation_tokens", "Output tokens produced", generation_tokens.clone());
        registry.register(
            "prompt_tokens",
            "Prompt tokens computed (cache hits excluded)",
            prompt_tokens.clone(),
        );
        registry.register("num_requests_running", "Requests holding KV memory", running.clone());
        registry.register("num_requests_waiting", "Requests waiting for admission", waiting.clone());
        registry.register("kv_cache_usage_perc", "Fraction of KV memory in use", kv_usage.clone());
        registry.register("max_batch_size", "Most requests scheduled in one pass so far", max_batch.clone());
        registry.register(
            "adapter_loads",
            "LoRA adapter loads finished (POST /v1/load_lora_adapter)",
            adapter_loads.clone(),
        );
        registry.register("loaded_adapters", "LoRA adapters loaded now", adapters_loaded.clone());
        let inner = Inner {
            registry,
            requests,
            aborted,
            passes,
            generation_tokens,
            prompt_tokens,
            running,
            waiting,
            kv_usage,
            max_batch,
            adapter_loads,
            adapters_loaded,
        };
        Self { inner: Arc::new(inner) }
    }
}

impl Metrics {
    pub(crate) fn admitted(&self) {
        self.inner.requests.inc();
    }

    pub(crate) fn aborted(&self) {
        self.inner.aborted.inc();
    }

    /// A LoRA adapter finished loading; `loaded` are loaded now.
    pub(crate) fn adapter_loaded(&self, loaded: usize) {
        self.inner.adapter_loads.inc();
        self.inner.adapters_loaded.set(loaded as i64);
    }

    /// A LoRA adapter was unloaded; `loaded` remain.
    pub(crate) fn adapter_unloaded(&self, loaded: usize) {
        self.inner.adapters_loaded.set(loaded as i64);
    }

    pub(crate) fn pass(&self, pass: &Pass, running: usize, waiting: usize, kv_usage: f64) {
        let i = &self.inner;
        i.passes.inc();
        i.generation_tokens.inc_by(pass.tokens.len() as u64);
        i.prompt_tokens.inc_by(u64::from(pass.prefill_tokens));
        i.running.set(running as i64);
        i.waiting.set(waiting as i64);
        i.kv_usage.set(kv_usage);
        let batch = i64::from(pass.scheduled_seqs);
        if batch > i.max_batch.get() {
            i.max_batch.set(batch);
        }
    }

    /// The metrics in the OpenMetrics text format (`/metrics` serves them
    /// in the format its scraper asks for: [`hangar_core::exposition`]).
    pub fn render(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.inner.registry).expect("writing to a String cannot fail");
        out
    }
}
