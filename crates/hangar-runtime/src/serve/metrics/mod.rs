//! The server's figures, rendered in Prometheus text format for
//! `GET /metrics` (served by `hangar-gateway`).
//!
//! Counters and histograms are updated on the request path; gauges that
//! describe state (queue depth, permits, replicas by state) are read from
//! the processors and replica tables when scraped, so they are never stale.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hangar_core::{Millis, ModelKey};
use hangar_scaler::TtftWindow;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::ModelRuntime;
use hangar_core::ReplicaPhase;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabel {
    model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabels {
    model: String,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReplicaLabels {
    model: String,
    /// `<model>:<replica_id>`.
    replica: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabels {
    model: String,
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    model: String,
    state: &'static str,
}

type Histograms = Family<ModelLabel, Histogram, fn() -> Histogram>;

/// Latency buckets from 1 ms to about 65 s.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

pub(crate) struct Metrics {
    registry: Registry,
    requests: Family<StatusLabels, Counter>,
    replica_failures: Family<ModelLabel, Counter>,
    connection_retries: Family<ModelLabel, Counter>,
    capacity_failovers: Family<ModelLabel, Counter>,
    panics: Counter,
    decisions: Family<DirectionLabels, Counter>,
    unplaceable: Family<ModelLabel, Gauge>,
    queue_wait: Histograms,
    ttft: Histograms,
    e2e: Histograms,
    queue_depth: Family<ModelLabel, Gauge>,
    permits_total: Family<ModelLabel, Gauge>,
    permits_used: Family<ModelLabel, Gauge>,
    replicas: Family<StateLabels, Gauge>,
    in_flight: Family<ReplicaLabels, Gauge>,
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("hangar");
        let histograms = || Histograms::new_with_constructor(latency_histogram as fn() -> Histogram);
        let m = Self {
            requests: Family::default(),
            replica_failures: Family::default(),
            connection_retries: Family::default(),
            capacity_failovers: Family::default(),
            panics: Counter::default(),
            decisions: Family::default(),
            unplaceable: Family::default(),
            queue_wait: histograms(),
            ttft: histograms(),
            e2e: histograms(),
            queue_depth: Family::default(),
            permits_total: Family::default(),
            permits_used: Family::default(),
            replicas: Family::default(),
            in_flight: Family::default(),
            registry: Registry::default(),
        };
        registry.register("requests", "Requests answered, by model and HTTP status", m.requests.clone());
        registry.register(
            "replica_failures",
            "Replicas removed because their engine exited or failed health checks",
            m.replica_failures.clone(),
        );
        registry.register(
            "connection_retries",
            "Requests sent again on a fresh connection because their pooled one was lost before an answer",
            m.connection_retries.clone(),
        );
        registry.register(
            "capacity_failovers",
            "Requests a replica refused for want of capacity (429 or 503) and that were sent to another",
            m.capacity_failovers.clone(),
        );
        registry.register(
            "http_panics",
            "Requests whose handler panicked (answered 500 and logged with the request id)",
            m.panics.clone(),
        );
        registry.register(
            "scale_decisions",
            "Scaler decisions that changed a model's replica count, by direction",
            m.decisions.clone(),
        );
        registry.register(
            "model_unplaceable",
            "1 while placement cannot fit (or start) the replicas a model's scaler wants",
            m.unplaceable.clone(),
        );
        registry.register("queue_wait_seconds", "Time from arrival to a permit", m.queue_wait.clone());
        registry.register(
            "time_to_first_token_seconds",
            "Time from arrival to the first byte of the answer",
            m.ttft.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Time from arrival to the end of the answer",
            m.e2e.clone(),
        );
        registry.register("queue_depth", "Requests waiting for a permit", m.queue_depth.clone());
        registry.register("permits_total", "Permits of ready replicas", m.permits_total.clone());
        registry.register("permits_used", "Permits held by requests", m.permits_used.clone());
        registry.register("replicas", "Replicas by state", m.replicas.clone());
        registry.register("replica_in_flight", "Requests holding a permit on a replica", m.in_flight.clone());
        Self { registry, ..m }
    }

    /// The counter of handlers that panicked, for the guard to bump.
    pub fn panics(&self) -> Counter {
        self.panics.clone()
    }

    /// Handles for one model's request figures, resolved once so the
    /// request path does not build label sets.
    pub fn model(&self, model: &ModelKey) -> Arc<ModelMetrics> {
        let key = label(model.as_str());
        // One statement per label set of a family: its guard lives to the
        // end of the statement, and a second `get_or_create` on the same
        // family within it would wait for that guard forever.
        let direction = |direction| DirectionLabels { model: key.model.clone(), direction };
        let up = self.decisions.get_or_create(&direction("up")).clone();
        let down = self.decisions.get_or_create(&direction("down")).clone();
        Arc::new(ModelMetrics {
            ok: self.requests.get_or_create(&StatusLabels { model: key.model.clone(), status: 200 }).clone(),
            requests: self.requests.clone(),
            queue_wait: self.queue_wait.get_or_create(&key).clone(),
            ttft: self.ttft.get_or_create(&key).clone(),
            e2e: self.e2e.get_or_create(&key).clone(),
            failures: self.replica_failures.get_or_create(&key).clone(),
            connection_retries: self.connection_retries.get_or_create(&key).clone(),
            capacity_failovers: self.capacity_failovers.get_or_create(&key).clone(),
            up,
            down,
            unplaceable: self.unplaceable.get_or_create(&key).clone(),
            recent_ttft: Mutex::new((Instant::now(), TtftWindow::new())),
            model: key.model,
        })
    }

    /// The text exposition, with state gauges read from `models` now.
    pub fn render<'a>(&self, models: impl Iterator<Item = &'a ModelRuntime>) -> String {
        // Replicas come and go: only those serving now are reported.
        self.in_flight.clear();
        for rt in models {
            let model = rt.config.key.as_str();
            let load = rt.processor.load();
            self.queue_depth.get_or_create(&label(model)).set(load.waiting as i64);
            self.permits_total.get_or_create(&label(model)).set(i64::from(load.permits));
            self.permits_used.get_or_create(&label(model)).set(i64::from(load.in_use));
            for state in ReplicaPhase::ALL {
                let labels = StateLabels { model: model.to_owned(), state: state.as_str() };
                self.replicas.get_or_create(&labels).set(rt.count(state) as i64);
            }
            for (replica, in_flight) in rt.in_flight() {
                let labels = ReplicaLabels { model: model.to_owned(), replica };
                self.in_flight.get_or_create(&labels).set(i64::from(in_flight));
            }
        }
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

/// One model's request figures, recorded by the request path
/// ([`ModelRuntime::metrics`]).
pub struct ModelMetrics {
    model: String,
    ok: Counter,
    requests: Family<StatusLabels, Counter>,
    queue_wait: Histogram,
    ttft: Histogram,
    e2e: Histogram,
    failures: Counter,
    connection_retries: Counter,
    capacity_failovers: Counter,
    up: Counter,
    down: Counter,
    unplaceable: Gauge,
    /// Recent TTFTs for the controller's observations, on a clock of its
    /// own (`epoch`): the `hangar` policy scales on their p99.
    recent_ttft: Mutex<(Instant, TtftWindow)>,
}

impl ModelMetrics {
    /// A request was answered with `status`.
    pub fn answered(&self, status: u16) {
        match status {
            200 => self.ok.inc(),
            _ => self.requests.get_or_create(&StatusLabels { model: self.model.clone(), status }).inc(),
        };
    }

    /// A request waited `wait` for its permit.
    pub fn queue_wait(&self, wait: Duration) {
        self.queue_wait.observe(wait.as_secs_f64());
    }

    /// The first byte of an answer came back, `since_arrival` after its
    /// request arrived (the TTFT the `hangar` scaling policy reads).
    pub fn first_byte(&self, since_arrival: Duration) {
        self.ttft.observe(since_arrival.as_secs_f64());
        let mut recent = self.recent_ttft.lock().expect("never poisoned: no panics while held");
        let now = recent.0.elapsed().as_millis() as Millis;
        recent.1.record(now, since_arrival.as_millis() as Millis);
    }

    /// The p99 TTFT of the last minute's requests.
    pub(crate) fn recent_ttft_p99(&self) -> Option<Millis> {
        let mut recent = self.recent_ttft.lock().expect("never poisoned: no panics while held");
        let now = recent.0.elapsed().as_millis() as Millis;
        recent.1.p99(now)
    }

    /// An answer ended (or its client left), `since_arrival` after its
    /// request arrived.
    pub fn finished(&self, since_arrival: Duration) {
        self.e2e.observe(since_arrival.as_secs_f64());
    }

    pub(crate) fn replica_failed(&self) {
        self.failures.inc();
    }

    /// A request went again on a fresh connection.
    pub(crate) fn connection_retried(&self) {
        self.connection_retries.inc();
    }

    /// A request a replica refused for want of capacity went to another.
    pub fn capacity_failover(&self) {
        self.capacity_failovers.inc();
    }

    /// Replicas failed so far.
    pub(crate) fn failures(&self) -> u32 {
        u32::try_from(self.failures.get()).unwrap_or(u32::MAX)
    }

    /// The scaler changed the count, up or down.
    pub(crate) fn decided(&self, up: bool) {
        match up {
            true => self.up.inc(),
            false => self.down.inc(),
        };
    }

    /// The model is (not) unplaceable.
    pub(crate) fn unplaceable(&self, yes: bool) {
        self.unplaceable.set(i64::from(yes));
    }
}

fn label(model: &str) -> ModelLabel {
    ModelLabel { model: model.to_owned() }
}
