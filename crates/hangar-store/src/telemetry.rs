//! Daemon metrics (Prometheus text on `/metrics`) and ingestion events.
//!
//! Every load publishes an `ingestion_started` and an `ingestion_completed`
//! (or `ingestion_failed`) event with one context id, the source used, bytes
//! and duration; so does a producer's registration (source `register`). An
//! ingestion that leaves an artifact stored on this node is also
//! *published* (`ingestion_published`), deduplicated by publish context
//! within a window ([`crate::publish`]). Events go to `tracing` and to a
//! bounded in-memory ring served as JSON on `/v1/events`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::Serialize;

use crate::id::ArtifactId;
use crate::protocol::Source;
use crate::publish::{Decision, PublishDedupe};

/// Events kept for `/v1/events`.
pub const EVENT_RING: usize = 256;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabel {
    source: &'static str,
}

/// What happened to an ingestion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// Loading began (memory allocated).
    IngestionStarted,
    /// Loading finished and every byte verified.
    IngestionCompleted,
    /// Loading failed.
    IngestionFailed,
    /// The artifact is stored on this node and announced (deduplicated).
    IngestionPublished,
}

/// One ingestion event.
#[derive(Debug, Clone, Serialize)]
pub struct IngestionEvent {
    /// Kind.
    pub kind: EventKind,
    /// Shared by the started and completed events of one load.
    pub context_id: u64,
    /// What is loaded.
    pub id: ArtifactId,
    /// Source used (set when known).
    pub source: Option<Source>,
    /// Bytes.
    pub bytes: u64,
    /// Ms since start (0 for `started`).
    pub duration_ms: u64,
    /// Error message for failures.
    pub error: Option<String>,
    /// Whether the bytes went into a caller's own memory
    /// (`MaterializeIntoTarget`) rather than the daemon's.
    #[serde(default)]
    pub into_target: bool,
}

/// Metrics and the event ring.
#[derive(Debug)]
pub struct Telemetry {
    registry: Registry,
    resident_bytes: Gauge,
    lip_hits: Counter,
    materializations: Counter,
    bytes_by_source: Family<SourceLabel, Counter>,
    evictions: Counter,
    load_failures: Counter,
    peer_sent_bytes: Counter,
    publishes: Counter,
    publishes_deduplicated: Counter,
    dedupe: Mutex<PublishDedupe>,
    next_context: AtomicU64,
    events: Mutex<VecDeque<IngestionEvent>>,
}

impl Default for Telemetry {
    fn default() -> Self {
        Telemetry::new(crate::publish::DEFAULT_WINDOW_MS)
    }
}

impl Telemetry {
    /// Metrics, an empty ring, and publishes deduplicated within `window` ms.
    pub fn new(window: hangar_core::Millis) -> Self {
        let mut registry = Registry::with_prefix("hangar_store");
        let t = Telemetry {
            resident_bytes: Gauge::default(),
            lip_hits: Counter::default(),
            materializations: Counter::default(),
            bytes_by_source: Family::default(),
            evictions: Counter::default(),
            load_failures: Counter::default(),
            peer_sent_bytes: Counter::default(),
            publishes: Counter::default(),
            publishes_deduplicated: Counter::default(),
            dedupe: Mutex::new(PublishDedupe::new(window)),
            next_context: AtomicU64::new(1),
            events: Mutex::new(VecDeque::with_capacity(EVENT_RING)),
            registry: Registry::default(),
        };
        registry.register("resident_bytes", "Bytes of resident shared memory", t.resident_bytes.clone());
        registry.register("lip_hits", "Materialize calls served lease-in-place", t.lip_hits.clone());
        registry.register("materializations", "Materialize calls", t.materializations.clone());
        registry.register("loaded_bytes", "Bytes loaded, by source", t.bytes_by_source.clone());
        registry.register("evictions", "Resident artifacts evicted to make room", t.evictions.clone());
        registry.register("load_failures", "Loads that failed", t.load_failures.clone());
        registry.register(
            "peer_sent_bytes",
            "Verified bytes sent to peer daemons",
            t.peer_sent_bytes.clone(),
        );
        registry.register(
            "publishes",
            "Ingestions published (artifact stored on this node and announced)",
            t.publishes.clone(),
        );
        registry.register(
            "publishes_deduplicated",
            "Publishes that joined a live publish context of the same artifact (no-op, TTL refresh)",
            t.publishes_deduplicated.clone(),
        );
        Telemetry { registry, ..t }
    }
}

impl Telemetry {
    /// Sets the resident-bytes gauge.
    pub fn set_resident(&self, bytes: u64) {
        self.resident_bytes.set(bytes as i64);
    }
    /// Counts a `Materialize`, and whether it was a lease-in-place hit.
    pub fn materialized(&self, lip_hit: bool) {
        self.materializations.inc();
        if lip_hit {
            self.lip_hits.inc();
        }
    }
    /// Counts bytes sent to a peer.
    pub fn peer_sent(&self, bytes: u64) {
        self.peer_sent_bytes.inc_by(bytes);
    }
    /// Counts evictions.
    pub fn evicted(&self, n: usize) {
        self.evictions.inc_by(n as u64);
    }

    /// Publishes `ingestion_started`; returns the context id for the rest.
    pub fn started(&self, id: ArtifactId, bytes: u64, into_target: bool) -> u64 {
        let context_id = self.next_context.fetch_add(1, Ordering::Relaxed);
        tracing::info!(context_id, %id, bytes, into_target, "ingestion started");
        self.push(IngestionEvent {
            kind: EventKind::IngestionStarted,
            context_id,
            id,
            source: None,
            bytes,
            duration_ms: 0,
            error: None,
            into_target,
        });
        context_id
    }

    /// Publishes the outcome of a load.
    pub fn finished(
        &self,
        context_id: u64,
        id: ArtifactId,
        outcome: Result<Source, &str>,
        bytes: u64,
        duration_ms: u64,
        into_target: bool,
    ) {
        let (kind, source, error) = match outcome {
            Ok(s) => {
                self.bytes_by_source.get_or_create(&SourceLabel { source: s.as_str() }).inc_by(bytes);
                tracing::info!(context_id, %id, source = s.as_str(), bytes, duration_ms, "ingestion completed");
                (EventKind::IngestionCompleted, Some(s), None)
            }
            Err(e) => {
                self.load_failures.inc();
                tracing::warn!(context_id, %id, error = e, duration_ms, "ingestion failed");
                (EventKind::IngestionFailed, None, Some(e.to_owned()))
            }
        };
        self.push(IngestionEvent { kind, context_id, id, source, bytes, duration_ms, error, into_target });
    }

    /// Publishes that ingestion `context_id` left `id` stored on this node
    /// (by `source`), unless `id` was published within the dedupe window
    /// ([`crate::publish`]): then it joins that context, refreshes the
    /// window and publishes nothing. Returns whether it published — the
    /// caller announces the holding to the registry only then.
    pub fn publish(
        &self,
        now: hangar_core::Millis,
        context_id: u64,
        id: ArtifactId,
        source: Source,
        bytes: u64,
    ) -> bool {
        let decision = self.dedupe.lock().expect("not poisoned").publish(now, id, context_id);
        match decision {
            Decision::Duplicate { context } => {
                self.publishes_deduplicated.inc();
                tracing::debug!(context_id, joined = context, %id, "publish deduplicated (TTL refresh)");
                false
            }
            Decision::Publish { context } => {
                self.publishes.inc();
                tracing::info!(context_id = context, %id, source = source.as_str(), bytes, "ingestion published");
                self.push(IngestionEvent {
                    kind: EventKind::IngestionPublished,
                    context_id: context,
                    id,
                    source: Some(source),
                    bytes,
                    duration_ms: 0,
                    error: None,
                    into_target: false,
                });
                true
            }
        }
    }

    /// Forgets `id`'s publish context (it left the store).
    pub fn unpublished(&self, id: &ArtifactId) {
        self.dedupe.lock().expect("not poisoned").forget(id);
    }

    fn push(&self, e: IngestionEvent) {
        let mut ring = self.events.lock().expect("not poisoned");
        if ring.len() == EVENT_RING {
            ring.pop_front();
        }
        ring.push_back(e);
    }

    /// Recent events, oldest first.
    pub fn events(&self) -> Vec<IngestionEvent> {
        self.events.lock().expect("not poisoned").iter().cloned().collect()
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("writing to a String");
        out
    }
}
