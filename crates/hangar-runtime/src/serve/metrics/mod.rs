//! The server's figures, rendered in the OpenMetrics text format for
//! `GET /metrics` (served by `hangar-gateway`, and by `hangar agent` for
//! its node). docs/observability.md lists every one.
//!
//! Counters and histograms are updated where things happen; the request
//! path only increments atomics it resolved earlier: each model's handles
//! are looked up once, and the counter of a status or error code the
//! first time it is seen ([`ModelMetrics`]) — no label set is built, no
//! string allocated and no lock taken per request. Gauges that describe
//! state (the line, permits, replicas) are read from the processors and
//! replica tables when scraped, so they are never stale; the five-minute
//! figures of the line come from a [`PermitWindow`] per model, sampled
//! every 500 ms by a task of the server ([`sample`]), which also takes a
//! point of each model's [`History`] every 5 s (the status page's plots).

mod history;
mod window;

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use hangar_core::instance::InstanceState;
use hangar_core::{ErrorCode, Millis, ModelKey, ReplicaPhase, RequestKind};
use hangar_scaler::{StartTier, TtftWindow};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::{Inner, ModelRuntime};
use crate::events::RequestTrace;
use crate::processor::Counters;
pub use history::HistoryPoint;
use history::{History, Reading, HISTORY_EVERY};
pub(crate) use window::{PermitWindow, Sample, SAMPLE_EVERY};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabel {
    model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    model: String,
    kind: &'static str,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    model: String,
    kind: &'static str,
    code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    model: String,
    kind: &'static str,
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
struct AdapterStepLabels {
    model: String,
    step: &'static str,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    model: String,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReplicaStateLabels {
    model: String,
    /// `<model>:<replica_id>`.
    replica: String,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeStateLabel {
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabels {
    model: String,
    tier: &'static str,
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;
type Ratio = Gauge<f64, AtomicU64>;

/// Latency buckets from 1 ms to about 65 s.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// Replica start buckets from 50 ms to about 27 minutes: a wake from the
/// warm cache takes a fraction of a second, a cold start of a large model
/// minutes.
fn start_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.05, 2.0, 16))
}

/// The statuses whose counters a model resolves once and keeps: what the
/// gateway answers itself and the usual ones an engine passes on. Any
/// other is counted through its family (a lookup per answer, rare).
const KEPT_STATUSES: [u16; 12] = [200, 400, 404, 408, 413, 422, 429, 499, 500, 502, 503, 504];

/// The label value of a replica start's tier.
fn tier_label(tier: StartTier) -> &'static str {
    match tier {
        StartTier::Cold => "cold",
        StartTier::Warm => "warm",
    }
}

pub(crate) struct Metrics {
    /// Everything: what `hangar serve` (one machine, or a fleet's
    /// gateway) serves.
    registry: Registry,
    /// What happens on a node — its replicas, their starts and failures:
    /// what `hangar agent` serves.
    node_registry: Registry,
    requests: Family<RequestLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    replica_failures: Family<ModelLabel, Counter>,
    connection_retries: Family<ModelLabel, Counter>,
    capacity_failovers: Family<ModelLabel, Counter>,
    failing_streaks: Family<ModelLabel, Counter>,
    adapter_steps: Family<AdapterStepLabels, Counter>,
    panics: Counter,
    /// The nodes this server places on (a fleet gateway: the live nodes
    /// of its view), and of them those it holds suspect and those
    /// draining.
    nodes: Family<NodeStateLabel, Gauge>,
    /// 1 while this server runs the controller: always on one machine, on
    /// a fleet while its gateway holds the lease.
    leader: Gauge,
    decisions: Family<DirectionLabels, Counter>,
    unplaceable: Family<ModelLabel, Gauge>,
    queue_wait: Histograms<KindLabels>,
    ttft: Histograms<KindLabels>,
    e2e: Histograms<KindLabels>,
    starts: Histograms<TierLabels>,
    queue_depth: Family<ModelLabel, Gauge>,
    queue_full_fraction: Family<ModelLabel, Ratio>,
    queue_depth_mean: Family<ModelLabel, Ratio>,
    permits_used_mean: Family<ModelLabel, Ratio>,
    permits: Family<ModelLabel, Gauge>,
    permits_used: Family<ModelLabel, Gauge>,
    replicas: Family<StateLabels, Gauge>,
    in_flight: Family<ReplicaLabels, Gauge>,
    instances: Family<StateLabels, Gauge>,
    utilization: Family<ReplicaLabels, Ratio>,
    mean_concurrency: Family<ReplicaLabels, Ratio>,
    window_seconds: Family<ReplicaStateLabels, Ratio>,
}

impl Metrics {
    pub fn new() -> Self {
        let latency = || Histograms::new_with_constructor(latency_histogram as fn() -> Histogram);
        let mut m = Self {
            requests: Family::default(),
            errors: Family::default(),
            replica_failures: Family::default(),
            connection_retries: Family::default(),
            capacity_failovers: Family::default(),
            failing_streaks: Family::default(),
            adapter_steps: Family::default(),
            panics: Counter::default(),
            nodes: Family::default(),
            leader: Gauge::default(),
            decisions: Family::default(),
            unplaceable: Family::default(),
            queue_wait: latency(),
            ttft: latency(),
            e2e: latency(),
            starts: Histograms::new_with_constructor(start_histogram as fn() -> Histogram),
            queue_depth: Family::default(),
            queue_full_fraction: Family::default(),
            queue_depth_mean: Family::default(),
            permits_used_mean: Family::default(),
            permits: Family::default(),
            permits_used: Family::default(),
            replicas: Family::default(),
            in_flight: Family::default(),
            instances: Family::default(),
            utilization: Family::default(),
            mean_concurrency: Family::default(),
            window_seconds: Family::default(),
            registry: Registry::with_prefix("hangar"),
            node_registry: Registry::with_prefix("hangar"),
        };
        // The node's figures, in both registries (a family's clones share
        // its values).
        for registry in [&mut m.registry, &mut m.node_registry] {
            registry.register("replicas", "Replicas by state", m.replicas.clone());
            registry.register(
                "replica_start_seconds",
                "Time from a replica's start (or wake) to its engine serving, by tier (cold: a new engine; \
                 warm: a sleeping one woken; swap: a hotswap model's sleeping copy swapped back in)",
                m.starts.clone(),
            );
            registry.register(
                "replica_failures",
                "Replicas removed because their engine exited or failed health checks",
                m.replica_failures.clone(),
            );
            registry.register(
                "instances",
                "Replicas by instance state (boot, idle, active, off), by the instance monitor",
                m.instances.clone(),
            );
            registry.register(
                "replica_utilization",
                "Share of a replica's last 15 s window with at least one request in flight",
                m.utilization.clone(),
            );
            registry.register(
                "replica_mean_concurrency",
                "Requests in flight on a replica over its last 15 s window, weighted by time",
                m.mean_concurrency.clone(),
            );
            registry.register(
                "replica_window_seconds",
                "Seconds of a replica's last 15 s window spent in each instance state",
                m.window_seconds.clone(),
            );
        }
        let r = &mut m.registry;
        r.register(
            "requests",
            "Requests and predictions ended, by model, kind (sync, prediction, training) and HTTP status",
            m.requests.clone(),
        );
        r.register(
            "errors",
            "Requests and predictions that did not succeed, by model, kind and error code",
            m.errors.clone(),
        );
        r.register(
            "connection_retries",
            "Requests sent again on a fresh connection because their pooled one was lost before an answer",
            m.connection_retries.clone(),
        );
        r.register(
            "capacity_failovers",
            "Requests a replica refused for want of capacity (429 or 503) and that were sent to another",
            m.capacity_failovers.clone(),
        );
        r.register(
            "failing_streaks",
            "Times a replica answered requests with server errors so many in a row that it was chosen last for a while",
            m.failing_streaks.clone(),
        );
        r.register(
            "adapter_steps",
            "LoRA adapter loads and unloads carried out on replicas' engines, by model, step and outcome",
            m.adapter_steps.clone(),
        );
        r.register(
            "nodes",
            "The nodes this server places on (a fleet gateway: the live nodes it sees), and of them those it \
             holds suspect — agent and engines not answering it — and those draining",
            m.nodes.clone(),
        );
        r.register(
            "leader",
            "1 while this server runs the controller: always on one machine, on a fleet while its gateway \
             holds the lease",
            m.leader.clone(),
        );
        r.register(
            "http_panics",
            "Requests whose handler panicked (answered 500 and logged with the request id)",
            m.panics.clone(),
        );
        r.register(
            "scale_decisions",
            "Scaler decisions that changed a model's replica count, by direction",
            m.decisions.clone(),
        );
        r.register(
            "model_unplaceable",
            "1 while placement cannot fit (or start) the replicas a model's scaler wants",
            m.unplaceable.clone(),
        );
        r.register(
            "queue_wait_seconds",
            "Time from arrival (a prediction's creation) to a permit",
            m.queue_wait.clone(),
        );
        r.register(
            "time_to_first_token_seconds",
            "Time from arrival to the first byte of the answer (a prediction's first output)",
            m.ttft.clone(),
        );
        r.register("request_duration_seconds", "Time from arrival to the end of the answer", m.e2e.clone());
        r.register("queue_depth", "Requests waiting for a permit", m.queue_depth.clone());
        r.register(
            "queue_full_fraction_5m",
            "Share of the last 5 minutes' samples (every 500 ms) in which no permit was free",
            m.queue_full_fraction.clone(),
        );
        r.register(
            "queue_depth_mean_5m",
            "Mean requests waiting for a permit over the last 5 minutes (sampled every 500 ms)",
            m.queue_depth_mean.clone(),
        );
        r.register(
            "permits_used_mean_5m",
            "Mean permits held over the last 5 minutes (sampled every 500 ms)",
            m.permits_used_mean.clone(),
        );
        r.register("permits", "Permits of ready replicas", m.permits.clone());
        r.register("permits_used", "Permits held by requests", m.permits_used.clone());
        r.register("replica_in_flight", "Requests holding a permit on a replica", m.in_flight.clone());
        m
    }

    /// The server's registry, for figures kept elsewhere (the event
    /// sink's).
    pub fn registry_mut(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// The nodes this server places on — how many it sees live, how many
    /// of them it holds suspect and how many are draining — and whether
    /// it runs the controller.
    pub(crate) fn nodes(&self, live: usize, suspect: usize, draining: usize, leader: bool) {
        for (state, n) in [("live", live), ("suspect", suspect), ("draining", draining)] {
            self.nodes.get_or_create(&NodeStateLabel { state }).set(n as i64);
        }
        self.leader.set(i64::from(leader));
    }

    /// The counter of handlers that panicked, for the guard to bump.
    pub fn panics(&self) -> Counter {
        self.panics.clone()
    }

    /// Handles for one model's figures, resolved once so the request path
    /// does not build label sets.
    pub fn model(&self, model: &ModelKey) -> Arc<ModelMetrics> {
        let key = label(model.as_str());
        // One statement per label set of a family: its guard lives to the
        // end of the statement, and a second `get_or_create` on the same
        // family within it would wait for that guard forever.
        let direction = |direction| DirectionLabels { model: key.model.clone(), direction };
        let up = self.decisions.get_or_create(&direction("up")).clone();
        let down = self.decisions.get_or_create(&direction("down")).clone();
        Arc::new(ModelMetrics {
            kinds: Default::default(),
            requests: self.requests.clone(),
            errors: self.errors.clone(),
            queue_wait: self.queue_wait.clone(),
            ttft: self.ttft.clone(),
            e2e: self.e2e.clone(),
            starts: self.starts.clone(),
            failures: self.replica_failures.get_or_create(&key).clone(),
            connection_retries: self.connection_retries.get_or_create(&key).clone(),
            capacity_failovers: self.capacity_failovers.get_or_create(&key).clone(),
            failing_streaks: self.failing_streaks.get_or_create(&key).clone(),
            adapter_steps: self.adapter_steps.clone(),
            up,
            down,
            unplaceable: self.unplaceable.get_or_create(&key).clone(),
            recent_ttft: Mutex::new((Instant::now(), TtftWindow::new())),
            window: Mutex::default(),
            history: Mutex::default(),
            model: key.model,
        })
    }

    /// The exposition of a server (one machine, or a fleet's gateway),
    /// with the state gauges read from `models` now.
    pub fn render<'a>(&self, models: impl Iterator<Item = &'a ModelRuntime>) -> String {
        // Replicas come and go: only those serving now are reported.
        self.in_flight.clear();
        self.clear_instances();
        for rt in models {
            let model = rt.config.key.as_str();
            let load = rt.processor.load();
            self.queue_depth.get_or_create(&label(model)).set(load.waiting as i64);
            self.permits.get_or_create(&label(model)).set(i64::from(load.permits));
            self.permits_used.get_or_create(&label(model)).set(i64::from(load.in_use));
            {
                let window = rt.metrics.window.lock().expect("never poisoned: no panics while held");
                self.queue_full_fraction.get_or_create(&label(model)).set(window.full_fraction());
                self.queue_depth_mean.get_or_create(&label(model)).set(window.mean_waiting());
                self.permits_used_mean.get_or_create(&label(model)).set(window.mean_in_use());
            }
            self.set_replicas(rt);
            self.set_instances(rt);
            for (replica, in_flight) in rt.in_flight() {
                let labels = ReplicaLabels { model: model.to_owned(), replica };
                self.in_flight.get_or_create(&labels).set(i64::from(in_flight));
            }
        }
        encoded(&self.registry)
    }

    /// The exposition of a fleet's node agent: its replicas by state, their
    /// starts and failures.
    pub fn render_node<'a>(&self, models: impl Iterator<Item = &'a ModelRuntime>) -> String {
        self.clear_instances();
        for rt in models {
            self.set_replicas(rt);
            self.set_instances(rt);
        }
        encoded(&self.node_registry)
    }

    fn clear_instances(&self) {
        self.utilization.clear();
        self.mean_concurrency.clear();
        self.window_seconds.clear();
    }

    /// The instance monitors' figures of `rt`'s replicas: how many are in
    /// each state, and each one's last window.
    fn set_instances(&self, rt: &ModelRuntime) {
        let model = rt.config.key.to_string();
        let mut counts = [0i64; InstanceState::ALL.len()];
        for (replica, instance) in rt.instances() {
            counts[instance.state as usize] += 1;
            let Some(w) = instance.window else { continue };
            let labels = ReplicaLabels { model: model.clone(), replica };
            self.utilization.get_or_create(&labels).set(w.utilization);
            self.mean_concurrency.get_or_create(&labels).set(w.mean_concurrency);
            for (state, ms) in [
                (InstanceState::Boot, w.boot_ms),
                (InstanceState::Idle, w.idle_ms),
                (InstanceState::Active, w.active_ms),
                (InstanceState::Off, w.off_ms),
            ] {
                let labels = ReplicaStateLabels {
                    model: model.clone(),
                    replica: labels.replica.clone(),
                    state: state.as_str(),
                };
                self.window_seconds.get_or_create(&labels).set(ms as f64 / 1000.0);
            }
        }
        for (state, count) in InstanceState::ALL.into_iter().zip(counts) {
            let labels = StateLabels { model: model.clone(), state: state.as_str() };
            self.instances.get_or_create(&labels).set(count);
        }
    }

    fn set_replicas(&self, rt: &ModelRuntime) {
        for state in ReplicaPhase::ALL {
            let labels = StateLabels { model: rt.config.key.to_string(), state: state.as_str() };
            self.replicas.get_or_create(&labels).set(rt.count(state) as i64);
        }
    }
}

fn encoded(registry: &Registry) -> String {
    let mut out = String::new();
    encode(&mut out, registry).expect("writing to a String cannot fail");
    out
}

/// One kind of request's figures for one model, each resolved the first
/// time it is needed (a model that never gets a training shows no
/// training series).
#[derive(Default)]
struct KindFigures {
    statuses: [OnceLock<Counter>; KEPT_STATUSES.len()],
    errors: [OnceLock<Counter>; ErrorCode::ALL.len()],
    queue_wait: OnceLock<Histogram>,
    ttft: OnceLock<Histogram>,
    e2e: OnceLock<Histogram>,
}

/// One model's figures, recorded where things happen
/// ([`ModelRuntime::metrics`]).
pub struct ModelMetrics {
    model: String,
    kinds: [KindFigures; RequestKind::ALL.len()],
    requests: Family<RequestLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    queue_wait: Histograms<KindLabels>,
    ttft: Histograms<KindLabels>,
    e2e: Histograms<KindLabels>,
    starts: Histograms<TierLabels>,
    failures: Counter,
    connection_retries: Counter,
    capacity_failovers: Counter,
    failing_streaks: Counter,
    adapter_steps: Family<AdapterStepLabels, Counter>,
    up: Counter,
    down: Counter,
    unplaceable: Gauge,
    /// Recent TTFTs of synchronous requests for the controller's
    /// observations, on a clock of its own (`epoch`): the `hangar` policy
    /// scales on their p99.
    recent_ttft: Mutex<(Instant, TtftWindow)>,
    /// The line and permits over the last five minutes.
    window: Mutex<PermitWindow>,
    /// Its recent minutes, a point every 5 s.
    history: Mutex<History>,
}

impl ModelMetrics {
    /// A request of `kind` ended with `status` — and, unless it succeeded,
    /// `code`. Counted once per request ([`Tally`] sees to it for the
    /// gateway's).
    pub fn ended(&self, kind: RequestKind, status: u16, code: Option<ErrorCode>) {
        let figures = &self.kinds[kind.index()];
        match KEPT_STATUSES.iter().position(|s| *s == status) {
            Some(i) => figures.statuses[i].get_or_init(|| self.request_counter(kind, status)).inc(),
            None => self.request_counter(kind, status).inc(),
        };
        if let Some(code) = code {
            let counter = figures.errors[code.index()].get_or_init(|| {
                let labels =
                    ErrorLabels { model: self.model.clone(), kind: kind.as_str(), code: code.as_str() };
                self.errors.get_or_create(&labels).clone()
            });
            counter.inc();
        }
    }

    fn request_counter(&self, kind: RequestKind, status: u16) -> Counter {
        let labels = RequestLabels { model: self.model.clone(), kind: kind.as_str(), status };
        self.requests.get_or_create(&labels).clone()
    }

    fn histogram<'a>(
        &self,
        cell: &'a OnceLock<Histogram>,
        family: &Histograms<KindLabels>,
        kind: RequestKind,
    ) -> &'a Histogram {
        cell.get_or_init(|| {
            family.get_or_create(&KindLabels { model: self.model.clone(), kind: kind.as_str() }).clone()
        })
    }

    /// A request of `kind` waited `wait` for its permit.
    pub fn queue_wait(&self, kind: RequestKind, wait: Duration) {
        let figures = &self.kinds[kind.index()];
        self.histogram(&figures.queue_wait, &self.queue_wait, kind).observe(wait.as_secs_f64());
    }

    /// The first byte of an answer came back (a prediction's first output),
    /// `since_arrival` after its request arrived. Synchronous requests'
    /// are the TTFTs the `hangar` scaling policy reads.
    pub fn first_byte(&self, kind: RequestKind, since_arrival: Duration) {
        let figures = &self.kinds[kind.index()];
        self.histogram(&figures.ttft, &self.ttft, kind).observe(since_arrival.as_secs_f64());
        if kind == RequestKind::Sync {
            let mut recent = self.recent_ttft.lock().expect("never poisoned: no panics while held");
            let now = recent.0.elapsed().as_millis() as Millis;
            recent.1.record(now, since_arrival.as_millis() as Millis);
        }
    }

    /// The p99 TTFT of the last minute's synchronous requests.
    pub fn recent_ttft_p99(&self) -> Option<Millis> {
        let mut recent = self.recent_ttft.lock().expect("never poisoned: no panics while held");
        let now = recent.0.elapsed().as_millis() as Millis;
        recent.1.p99(now)
    }

    /// An answer ended (or its client left), `since_arrival` after its
    /// request arrived.
    pub fn finished(&self, kind: RequestKind, since_arrival: Duration) {
        let figures = &self.kinds[kind.index()];
        self.histogram(&figures.e2e, &self.e2e, kind).observe(since_arrival.as_secs_f64());
    }

    /// A replica became ready, `took` after it was placed (a cold start)
    /// or woken (a warm one).
    /// A WARM wake of a `hotswap` model is counted as a `swap`.
    pub(crate) fn replica_started(&self, tier: StartTier, hotswap: bool, took: Duration) {
        let tier = match (tier, hotswap) {
            (StartTier::Warm, true) => "swap",
            (tier, _) => tier_label(tier),
        };
        let labels = TierLabels { model: self.model.clone(), tier };
        self.starts.get_or_create(&labels).observe(took.as_secs_f64());
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

    /// A replica's server errors in a row put it last for a while.
    pub(crate) fn failing_streak(&self) {
        self.failing_streaks.inc();
    }

    /// The model loads adapters: its step counters are shown from the
    /// start, at 0, so a dashboard and an alert find them before the first
    /// load.
    pub(crate) fn show_adapter_steps(&self) {
        for step in ["load", "unload"] {
            for outcome in ["ok", "failed"] {
                let _ = self.adapter_steps.get_or_create(&AdapterStepLabels {
                    model: self.model.clone(),
                    step,
                    outcome,
                });
            }
        }
    }

    /// An adapter step (a load, else an unload) was carried out, `ok` if
    /// the engine did it.
    pub fn adapter_step(&self, load: bool, ok: bool) {
        let step = if load { "load" } else { "unload" };
        let outcome = if ok { "ok" } else { "failed" };
        self.adapter_steps
            .get_or_create(&AdapterStepLabels { model: self.model.clone(), step, outcome })
            .inc();
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

    /// Takes a point of the model's history: the processor's cumulative
    /// `counters` and its line (`waiting`, `in_flight`) now, `at_ms` since
    /// the Unix epoch, with the p99 of the TTFTs since the last point.
    pub(crate) fn record_history(&self, at_ms: u64, counters: Counters, waiting: usize, in_flight: u32) {
        let mut history = self.history.lock().expect("never poisoned: no panics while held");
        let (now, ttft_p99_ms) = {
            let mut recent = self.recent_ttft.lock().expect("never poisoned: no panics while held");
            let now = recent.0.elapsed().as_millis() as Millis;
            (now, recent.1.p99_between(history.last_now().unwrap_or(now), now))
        };
        history.record(Reading { at_ms, now, counters, ttft_p99_ms, waiting, in_flight });
    }

    /// The model's recent minutes, a point every 5 s, oldest first.
    pub fn history(&self) -> Vec<HistoryPoint> {
        self.history.lock().expect("never poisoned: no panics while held").points()
    }

    /// One sample of the model's line and permits for the five-minute
    /// window.
    pub(crate) fn sample(&self, sample: Sample) {
        self.window.lock().expect("never poisoned: no panics while held").record(sample);
    }
}

/// One request's count in `hangar_requests_total` (and, unless it
/// succeeded, `hangar_errors_total`), taken exactly once: by
/// [`Tally::ended`], or — when it is dropped first, because the client
/// went away — as `499 client_closed`. Its inference event, when it
/// carries a [`RequestTrace`], ends at the same moment with the same
/// status and code.
///
/// The gateway makes one when a request for a known model arrives and
/// hands it to the body that streams the answer, so a stream cut by its
/// deadline or by its replica is counted as what it is, not as the 200
/// its head said.
pub struct Tally {
    metrics: Arc<ModelMetrics>,
    kind: RequestKind,
    counted: bool,
    /// Boxed: the tally is moved through the request's futures, a pointer
    /// is cheaper to move than the trace.
    trace: Option<Box<RequestTrace>>,
}

impl Tally {
    /// The count of one request of `kind` to the model of `metrics`.
    pub fn new(metrics: &Arc<ModelMetrics>, kind: RequestKind) -> Self {
        Tally { metrics: metrics.clone(), kind, counted: false, trace: None }
    }

    /// The tally that also ends `trace` (none: events are off).
    pub fn traced(mut self, trace: Option<RequestTrace>) -> Self {
        self.trace = trace.map(Box::new);
        self
    }

    /// The request's event in the making, to note what happens to it.
    pub fn trace(&mut self) -> Option<&mut RequestTrace> {
        self.trace.as_deref_mut()
    }

    /// The request ended with `status` (and `code`, unless it succeeded).
    pub fn ended(mut self, status: u16, code: Option<ErrorCode>) {
        self.count(status, code);
    }

    fn count(&mut self, status: u16, code: Option<ErrorCode>) {
        self.counted = true;
        self.metrics.ended(self.kind, status, code);
        if let Some(trace) = self.trace.take() {
            trace.end(status, code);
        }
    }

    /// The model's figures.
    pub fn metrics(&self) -> &Arc<ModelMetrics> {
        &self.metrics
    }

    /// The request is not counted as one: Workers AI's async mode made it
    /// a durable job, counted (with its event) when the job ends, or it
    /// only asked after such a job. Its trace is dropped unsent.
    pub fn handed_over(mut self) {
        self.counted = true;
        self.trace = None;
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        if !self.counted {
            let code = ErrorCode::ClientClosed;
            self.count(code.http_status(), Some(code));
        }
    }
}

/// Samples every model's line and permits each [`SAMPLE_EVERY`] for the
/// five-minute figures, and takes a point of its history each
/// [`HISTORY_EVERY`], until the server is dropped or stops.
///
/// # Cancel safety
/// Holds nothing across its awaits: dropping it only ends the sampling.
pub(crate) async fn sample(inner: Weak<Inner>) {
    let mut every = tokio::time::interval(SAMPLE_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let per_point = (HISTORY_EVERY.as_millis() / SAMPLE_EVERY.as_millis()) as u64;
    for tick in 0u64.. {
        every.tick().await;
        let Some(inner) = inner.upgrade() else { return };
        if inner.stopping.is_cancelled() {
            return;
        }
        let point = tick % per_point == 0;
        let at_ms = super::wall_ms();
        for rt in inner.models.values() {
            let load = rt.processor.load();
            rt.metrics.sample(Sample { waiting: load.waiting, in_use: load.in_use, permits: load.permits });
            if point {
                rt.metrics.record_history(at_ms, load.counters, load.waiting, load.in_use);
            }
        }
    }
}

fn label(model: &str) -> ModelLabel {
    ModelLabel { model: model.to_owned() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(k: &str) -> ModelKey {
        k.parse().unwrap()
    }

    fn rendered(m: &Metrics) -> String {
        encoded(&m.registry)
    }

    #[test]
    fn a_request_is_counted_once_under_its_kind_status_and_code() {
        let m = Metrics::new();
        let a = m.model(&key("t/a"));
        a.ended(RequestKind::Sync, 200, None);
        a.ended(RequestKind::Sync, 200, None);
        a.ended(RequestKind::Prediction, 504, Some(ErrorCode::Timeout));
        // A status outside the kept ones is counted all the same.
        a.ended(RequestKind::Sync, 418, Some(ErrorCode::EngineError));
        let text = rendered(&m);
        for line in [
            "hangar_requests_total{model=\"t/a\",kind=\"sync\",status=\"200\"} 2",
            "hangar_requests_total{model=\"t/a\",kind=\"prediction\",status=\"504\"} 1",
            "hangar_requests_total{model=\"t/a\",kind=\"sync\",status=\"418\"} 1",
            "hangar_errors_total{model=\"t/a\",kind=\"prediction\",code=\"timeout\"} 1",
            "hangar_errors_total{model=\"t/a\",kind=\"sync\",code=\"engine_error\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line} in\n{text}");
        }
        assert!(!text.contains("kind=\"training\""), "no series before a training:\n{text}");
    }

    #[test]
    fn a_tally_dropped_unended_counts_a_client_that_left() {
        let m = Metrics::new();
        let a = m.model(&key("t/a"));
        Tally::new(&a, RequestKind::Sync).ended(200, None);
        drop(Tally::new(&a, RequestKind::Sync));
        let text = rendered(&m);
        assert!(
            text.contains("hangar_requests_total{model=\"t/a\",kind=\"sync\",status=\"200\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("hangar_requests_total{model=\"t/a\",kind=\"sync\",status=\"499\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("hangar_errors_total{model=\"t/a\",kind=\"sync\",code=\"client_closed\"} 1\n"),
            "{text}"
        );
    }

    #[test]
    fn starts_are_histograms_by_tier_and_the_node_registry_has_only_the_nodes_figures() {
        let m = Metrics::new();
        let a = m.model(&key("t/a"));
        a.replica_started(StartTier::Cold, false, Duration::from_secs(3));
        a.replica_started(StartTier::Warm, false, Duration::from_millis(200));
        a.ended(RequestKind::Sync, 200, None);
        let node = encoded(&m.node_registry);
        assert!(
            node.contains("hangar_replica_start_seconds_count{model=\"t/a\",tier=\"cold\"} 1\n"),
            "{node}"
        );
        assert!(
            node.contains("hangar_replica_start_seconds_count{model=\"t/a\",tier=\"warm\"} 1\n"),
            "{node}"
        );
        assert!(node.contains("# TYPE hangar_replicas gauge"), "{node}");
        assert!(!node.contains("hangar_requests"), "request figures are the gateway's:\n{node}");
        assert!(rendered(&m).contains("hangar_replica_start_seconds_sum{model=\"t/a\",tier=\"cold\"} 3.0"));
    }

    #[test]
    fn the_window_figures_follow_the_samples() {
        let m = Metrics::new();
        let a = m.model(&key("t/a"));
        a.sample(Sample { waiting: 2, in_use: 4, permits: 4 });
        a.sample(Sample { waiting: 0, in_use: 1, permits: 4 });
        let window = a.window.lock().unwrap();
        assert_eq!((window.full_fraction(), window.mean_waiting(), window.mean_in_use()), (0.5, 1.0, 2.5));
    }
}
