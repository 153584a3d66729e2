//! Daemon metrics (Prometheus text on `/metrics`) and ingestion events.
//!
//! Every load publishes an `ingestion_started` and an `ingestion_completed`
//! (or `ingestion_failed`) event with one context id, the source used, bytes
//! and duration. Events go to `tracing` and to a bounded in-memory ring
//! served as JSON on `/v1/events`.

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
    next_context: AtomicU64,
    events: Mutex<VecDeque<IngestionEvent>>,
}

impl Default for Telemetry {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("hangar_store");
        let t = Telemetry {
            resident_bytes: Gauge::default(),
            lip_hits: Counter::default(),
            materializations: Counter::default(),
            bytes_by_source: Family::default(),
            evictions: Counter::default(),
            load_failures: Counter::default(),
            peer_sent_bytes: Counter::default(),
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
    pub fn started(&self, id: ArtifactId, bytes: u64) -> u64 {
        let context_id = self.next_context.fetch_add(1, Ordering::Relaxed);
        tracing::info!(context_id, %id, bytes, "ingestion started");
        self.push(IngestionEvent {
            kind: EventKind::IngestionStarted,
            context_id,
            id,
            source: None,
            bytes,
            duration_ms: 0,
            error: None,
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
        self.push(IngestionEvent { kind, context_id, id, source, bytes, duration_ms, error });
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
