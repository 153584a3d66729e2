//! Network side-services on one small tokio runtime thread, started only
//! when configured: the Prometheus `/metrics` endpoint (`METRICS_PORT`) and
//! the `BlockRemoved` event publisher (`STORAGE_EVENTS_ENDPOINT`).
//!
//! Events use vLLM's KV-event wire format so a KV-aware router can forget
//! evicted blocks: a ZMQ PUB socket sends multipart messages
//! `[topic, sequence (u64 big-endian), payload]`, the topic being
//! `kv@SHARED_STORAGE@<model>` and the payload the msgpack array
//! `[timestamp, [["BlockRemoved", [hash, …], "SHARED_STORAGE"]]]`. Blocks
//! are batched up to `DELETION_BATCH_SIZE` per message. If the publisher
//! falls behind, events are dropped (and counted) rather than slowing the
//! deleter: a PUB socket drops for slow subscribers anyway.

use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use hangar_core::exposition::Format;
use tokio::sync::{mpsc, oneshot};

use crate::config::Config;
use crate::delete::Removed;
use crate::engine::EvictError;
use crate::stats::{Snapshot, Stats};

/// Storage medium named in events and topics.
pub const MEDIUM: &str = "SHARED_STORAGE";
/// Events buffered between deleter and publisher before dropping.
const EVENT_BUFFER: usize = 1 << 16;

/// Running side-services; stopped on drop.
pub struct Services {
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    events: Option<mpsc::Sender<Removed>>,
    metrics_addr: Option<SocketAddr>,
    stats: Arc<Stats>,
}

impl Services {
    /// Starts what `config` asks for; returns once sockets are bound, so a
    /// port conflict is an error at start.
    pub fn start(config: &Config, stats: Arc<Stats>) -> Result<Services, EvictError> {
        let metrics = config.metrics_port.map(|port| SocketAddr::new(config.metrics_address, port));
        let endpoint = config.storage_events_endpoint.clone();
        if metrics.is_none() && endpoint.is_none() {
            return Ok(Services { stop: None, thread: None, events: None, metrics_addr: None, stats });
        }
        let (stop_tx, stop_rx) = oneshot::channel();
        let (flush_tx, flush_rx) = oneshot::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (events_tx, events_rx) = mpsc::channel(EVENT_BUFFER);
        let batch = config.deletion_batch_size;
        let served = stats.clone();
        let thread = std::thread::Builder::new()
            .name("evict-io".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(("runtime", e)));
                        return;
                    }
                };
                rt.block_on(async move {
                    let metrics_addr = match metrics {
                        Some(addr) => match serve_metrics(addr, served).await {
                            Ok(a) => Some(a),
                            Err(e) => {
                                let _ = ready_tx.send(Err(("metrics server", e)));
                                return;
                            }
                        },
                        None => None,
                    };
                    let publisher = match endpoint {
                        Some(ep) => match bind_publisher(&ep).await {
                            Ok(p) => Some(tokio::spawn(publish(p, events_rx, batch, flush_rx))),
                            Err(e) => {
                                let _ = ready_tx.send(Err(("event publisher", e)));
                                return;
                            }
                        },
                        None => None,
                    };
                    let _ = ready_tx.send(Ok(metrics_addr));
                    let _ = stop_rx.await;
                    let _ = flush_tx.send(());
                    if let Some(p) = publisher {
                        let _ = p.await;
                    }
                });
            })
            .map_err(|source| EvictError::Start { what: "service thread", source })?;
        match ready_rx.recv() {
            Ok(Ok(metrics_addr)) => Ok(Services {
                stop: Some(stop_tx),
                thread: Some(thread),
                events: config.storage_events_endpoint.as_ref().map(|_| events_tx),
                metrics_addr,
                stats,
            }),
            Ok(Err((what, source))) => Err(EvictError::Start { what, source }),
            Err(_) => Err(EvictError::Start {
                what: "service thread",
                source: io::Error::other("exited during start"),
            }),
        }
    }

    /// Address the metrics server listens on, if any.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// A sink for removed blocks, if events are enabled.
    pub fn removed_sink(&self) -> Option<impl FnMut(Removed) + Send + 'static> {
        let tx = self.events.clone()?;
        let stats = self.stats.clone();
        Some(move |r: Removed| {
            if tx.try_send(r).is_err() {
                Stats::add(&stats.events_dropped, 1);
            }
        })
    }

    /// Flushes queued events and stops the services.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.events = None;
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Services {
    fn drop(&mut self) {
        self.shutdown();
    }
}

async fn serve_metrics(addr: SocketAddr, stats: Arc<Stats>) -> io::Result<SocketAddr> {
    use axum::routing::get;
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    // OpenMetrics for a scraper that asks for it (Prometheus does), the
    // text format 0.0.4 otherwise.
    let app = axum::Router::new().route(
        "/metrics",
        get(move |headers: axum::http::HeaderMap| {
            let accept = headers.get(axum::http::header::ACCEPT).and_then(|v| v.to_str().ok());
            let format = Format::negotiate(accept);
            let text = format.render(render_metrics(&stats.snapshot()));
            async move { ([(axum::http::header::CONTENT_TYPE, format.content_type())], text) }
        }),
    );
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "metrics server stopped");
        }
    });
    tracing::info!(%bound, "serving Prometheus metrics at /metrics");
    Ok(bound)
}

/// The OpenMetrics text for one snapshot.
pub fn render_metrics(s: &Snapshot) -> String {
    use prometheus_client::metrics::counter::ConstCounter;
    use prometheus_client::metrics::gauge::ConstGauge;
    let mut reg = prometheus_client::registry::Registry::with_prefix("hangar_evict");
    reg.register("usage_percent", "Disk usage as df reports it", ConstGauge::new(s.usage_percent));
    reg.register("deleting", "1 while deletion is ON", ConstGauge::new(i64::from(s.deleting)));
    reg.register(
        "discovered_files",
        "Block files seen by the current sweep",
        ConstGauge::new(s.discovered as i64),
    );
    reg.register(
        "queued_files",
        "Files in the deletion queue (pre-filled while OFF)",
        ConstGauge::new(s.queued as i64),
    );
    let counters: [(&str, &str, u64); 12] = [
        ("sweeps", "Sweeps started", s.sweeps),
        ("prefills", "Pre-fill sweeps completed while deletion was OFF", s.prefills),
        (
            "cancelled_prefills",
            "Pre-fill sweeps abandoned because usage crossed meanwhile",
            s.prefills_cancelled,
        ),
        ("deleted_files", "Files deleted (reported, in a dry run)", s.deleted),
        ("freed_bytes", "Bytes freed", s.bytes_freed),
        (
            "spared_files",
            "Selected files spared because they were used after selection",
            s.spared_recently_used,
        ),
        ("vanished_files", "Selected files that vanished before deletion", s.vanished),
        ("removed_dirs", "Empty directories removed", s.dirs_removed),
        ("removed_tmp_files", "Stale temporary files removed", s.tmp_removed),
        ("errors", "I/O errors", s.errors),
        ("crawler_restarts", "Crawler threads restarted after a panic", s.crawler_restarts),
        ("dropped_events", "BlockRemoved events dropped", s.events_dropped),
    ];
    for (name, help, v) in counters {
        reg.register(name, help, ConstCounter::new(v));
    }
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &reg).expect("writing to a String");
    out
}

async fn bind_publisher(endpoint: &str) -> io::Result<zeromq::PubSocket> {
    use zeromq::Socket;
    // libzmq spells "all interfaces" as `*`; the native implementation wants an address.
    let endpoint = endpoint.replacen("tcp://*:", "tcp://0.0.0.0:", 1);
    let mut socket = zeromq::PubSocket::new();
    let bound = socket.bind(&endpoint).await.map_err(|e| io::Error::other(format!("{endpoint}: {e}")))?;
    tracing::info!(endpoint = %bound, "publishing BlockRemoved events");
    Ok(socket)
}

/// Publishes removed blocks until told to flush, then sends what is queued
/// and returns.
async fn publish(
    mut socket: zeromq::PubSocket,
    mut rx: mpsc::Receiver<Removed>,
    batch: usize,
    mut flush: oneshot::Receiver<()>,
) {
    let mut seq: u64 = 0;
    let mut buf = Vec::with_capacity(batch);
    loop {
        tokio::select! {
            n = rx.recv_many(&mut buf, batch) => {
                if n == 0 {
                    return;
                }
                send_grouped(&mut socket, &mut seq, &mut buf).await;
            }
            _ = &mut flush => {
                while let Ok(r) = rx.try_recv() {
                    buf.push(r);
                    if buf.len() >= batch {
                        send_grouped(&mut socket, &mut seq, &mut buf).await;
                    }
                }
                send_grouped(&mut socket, &mut seq, &mut buf).await;
                return;
            }
        }
    }
}

/// Sends `buf` as one message per model and empties it.
async fn send_grouped(socket: &mut zeromq::PubSocket, seq: &mut u64, buf: &mut Vec<Removed>) {
    use zeromq::SocketSend;
    let mut by_model: BTreeMap<Arc<str>, Vec<u64>> = BTreeMap::new();
    for r in buf.drain(..) {
        by_model.entry(r.model).or_default().push(r.hash);
    }
    for (model, hashes) in by_model {
        let msg = match event_message(&model, *seq, &hashes) {
            Ok(m) => m,
            Err(e) => {
                tracing::error!(error = %e, "cannot encode BlockRemoved event");
                continue;
            }
        };
        *seq += 1;
        if let Err(e) = socket.send(msg).await {
            tracing::warn!(error = %e, "BlockRemoved event not sent");
        }
    }
}

/// One multipart event message: topic, sequence number, msgpack payload.
pub fn event_message(
    model: &str,
    seq: u64,
    hashes: &[u64],
) -> Result<zeromq::ZmqMessage, rmp_serde::encode::Error> {
    let ts = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or_default();
    let payload = rmp_serde::to_vec(&(ts, [("BlockRemoved", hashes, MEDIUM)]))?;
    let frames = vec![
        bytes::Bytes::from(format!("kv@{MEDIUM}@{model}")),
        bytes::Bytes::copy_from_slice(&seq.to_be_bytes()),
        bytes::Bytes::from(payload),
    ];
    Ok(zeromq::ZmqMessage::try_from(frames).expect("three frames"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_render_current_figures() {
        let s = Snapshot { usage_percent: 72.5, deleting: true, deleted: 42, ..Snapshot::default() };
        let text = render_metrics(&s);
        assert!(text.contains("hangar_evict_usage_percent 72.5"), "{text}");
        assert!(text.contains("hangar_evict_deleting 1"), "{text}");
        assert!(text.contains("hangar_evict_deleted_files_total 42"), "{text}");
    }

    #[test]
    fn event_payload_is_vllm_block_removed() {
        let msg = event_message("org/model", 7, &[1, u64::MAX]).unwrap();
        let frames = msg.into_vec();
        assert_eq!(&frames[0][..], b"kv@SHARED_STORAGE@org/model");
        assert_eq!(&frames[1][..], &7u64.to_be_bytes());
        let (_ts, events): (f64, Vec<(String, Vec<u64>, String)>) =
            rmp_serde::from_slice(&frames[2]).unwrap();
        assert_eq!(events, vec![("BlockRemoved".into(), vec![1, u64::MAX], MEDIUM.into())]);
    }
}
