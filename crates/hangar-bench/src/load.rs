//! The load generator: keep-alive HTTP/1.1 clients sending one fixed
//! request, either as fast as answers come back (closed loop) or on a
//! schedule (open loop), recording each latency; [`PathStats`] sums one
//! run up.
//!
//! Each client owns one hyper connection (`TCP_NODELAY`, no pool, no
//! retries), so "C concurrent clients" means exactly C connections and the
//! client adds as little of its own work as a client can.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http1::{self, SendRequest};
use hyper::{header, Method, Request};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

use crate::BenchError;

/// Where requests go and what they carry.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    /// The server's address.
    pub addr: SocketAddr,
    /// The request path, e.g. `/v1/chat/completions`.
    pub path: &'static str,
    /// The JSON body.
    pub body: Bytes,
    /// Extra request headers (e.g. `Prefer: wait`).
    pub headers: &'static [(&'static str, &'static str)],
}

/// One keep-alive connection.
pub(crate) struct Client {
    sender: SendRequest<Full<Bytes>>,
}

/// Latencies and outcomes of one run.
pub(crate) struct Samples {
    /// Latencies in nanoseconds.
    pub latency_ns: Histogram<u64>,
    /// Answers with a 2xx status.
    pub ok: u64,
    /// Answers with another status, or failed exchanges.
    pub errors: u64,
    /// The first error seen, for the report.
    pub first_error: Option<String>,
    /// From the first request sent to the last answer read.
    pub elapsed: Duration,
}

impl Samples {
    fn new() -> Self {
        Self {
            // 1 ns .. 1 h at 3 significant digits.
            latency_ns: Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid histogram bounds"),
            ok: 0,
            errors: 0,
            first_error: None,
            elapsed: Duration::ZERO,
        }
    }

    pub(crate) fn record(&mut self, latency: Duration, outcome: Result<(), String>) {
        self.latency_ns.saturating_record(latency.as_nanos().max(1) as u64);
        match outcome {
            Ok(()) => self.ok += 1,
            Err(e) => {
                self.errors += 1;
                self.first_error.get_or_insert(e);
            }
        }
    }

    fn merge(&mut self, other: Samples) {
        self.latency_ns.add(&other.latency_ns).expect("histograms with equal bounds merge");
        self.ok += other.ok;
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }
}

impl Samples {
    /// An empty record to [`append`](Self::append) runs to.
    pub fn empty() -> Self {
        Self::new()
    }

    /// Adds a later run of the same path: its samples and its wall time.
    pub fn append(&mut self, later: Samples) {
        self.elapsed += later.elapsed;
        self.merge(later);
    }
}

impl Client {
    /// Opens a connection to `target`.
    ///
    /// # Cancel safety
    /// Dropping the future drops the half-open connection.
    pub async fn connect(target: &Target) -> Result<Self, BenchError> {
        let failed = |e: String| BenchError::Connect { addr: target.addr, reason: e };
        let stream = TcpStream::connect(target.addr).await.map_err(|e| failed(e.to_string()))?;
        stream.set_nodelay(true).map_err(|e| failed(e.to_string()))?;
        let (sender, connection) =
            http1::handshake(TokioIo::new(stream)).await.map_err(|e| failed(e.to_string()))?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!("bench connection closed: {e}");
            }
        });
        Ok(Self { sender })
    }

    /// Sends one request and reads the whole answer; `Err` describes a
    /// non-2xx status or a failed exchange.
    pub(crate) async fn exchange(&mut self, target: &Target) -> Result<(), String> {
        self.sender.ready().await.map_err(|e| format!("connection lost: {e}"))?;
        let mut request = Request::builder()
            .method(Method::POST)
            .uri(target.path)
            .header(header::HOST, target.addr.to_string())
            .header(header::CONTENT_TYPE, "application/json");
        for (name, value) in target.headers {
            request = request.header(*name, *value);
        }
        let request = request.body(Full::new(target.body.clone())).expect("a valid request");
        let response = self.sender.send_request(request).await.map_err(|e| format!("request failed: {e}"))?;
        let status = response.status();
        let body = response.into_body().collect().await.map_err(|e| format!("reading the answer: {e}"))?;
        if status.is_success() {
            Ok(())
        } else {
            let text = String::from_utf8_lossy(&body.to_bytes()).chars().take(300).collect::<String>();
            Err(format!("HTTP {status}: {text}"))
        }
    }
}

/// Sends `requests` requests over `clients`, each client sending its next
/// request as soon as its previous answer is read (a closed loop: the
/// offered load is whatever the server sustains).
pub(crate) async fn closed_loop(target: &Target, clients: &mut Vec<Client>, requests: usize) -> Samples {
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = clients
        .drain(..)
        .map(|mut client| {
            let (target, next) = (target.clone(), next.clone());
            tokio::spawn(async move {
                let mut samples = Samples::new();
                while next.fetch_add(1, Ordering::Relaxed) < requests {
                    let sent = Instant::now();
                    let outcome = client.exchange(&target).await;
                    samples.record(sent.elapsed(), outcome);
                }
                (client, samples)
            })
        })
        .collect();
    let mut all = Samples::new();
    for task in tasks {
        let (client, samples) = task.await.expect("a bench client task does not panic");
        clients.push(client);
        all.merge(samples);
    }
    all.elapsed = start.elapsed();
    all
}

/// Sends `requests` requests at `rate` per second on a fixed schedule,
/// whatever the answers do (an open loop), each on a free client of
/// `clients`. A request's latency runs from the moment the schedule
/// released it, so waiting for a free client counts (no coordinated
/// omission).
///
/// The schedule is kept by a plain thread sleeping with the OS timer, not
/// by tokio's millisecond-granular one, so requests leave evenly spaced.
pub(crate) async fn open_loop(
    target: &Target,
    clients: &mut Vec<Client>,
    requests: usize,
    rate: f64,
) -> Samples {
    let permits = Arc::new(Semaphore::new(clients.len()));
    let idle = Arc::new(Mutex::new(std::mem::take(clients)));
    let samples = Arc::new(Mutex::new(Samples::new()));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    let interval = Duration::from_secs_f64(1.0 / rate);
    let pacer = std::thread::spawn(move || {
        let start = Instant::now();
        for i in 0..requests {
            let due = start + interval.mul_f64(i as f64);
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            if tx.send(Instant::now()).is_err() {
                return;
            }
        }
    });
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    while let Some(released) = rx.recv().await {
        let (target, permits, idle, samples) =
            (target.clone(), permits.clone(), idle.clone(), samples.clone());
        tasks.spawn(async move {
            let _permit = permits.acquire().await.expect("the semaphore is never closed");
            let mut client = idle.lock().expect("idle clients lock").pop().expect("a permit means a client");
            let outcome = client.exchange(&target).await;
            let latency = released.elapsed();
            idle.lock().expect("idle clients lock").push(client);
            samples.lock().expect("samples lock").record(latency, outcome);
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("a bench request task does not panic");
    }
    pacer.join().expect("the pacer thread does not panic");
    let mut all = std::mem::replace(&mut *samples.lock().expect("samples lock"), Samples::new());
    all.elapsed = start.elapsed();
    *clients = std::mem::take(&mut *idle.lock().expect("idle clients lock"));
    all
}

/// One path's figures in one phase, summed up from its latencies.
/// Latencies are in milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct PathStats {
    /// Requests sent.
    pub requests: u64,
    /// Answered with a 2xx status.
    pub ok: u64,
    /// Failed or answered with another status.
    pub errors: u64,
    /// The first failure, if any.
    pub first_error: Option<String>,
    /// Wall time from the first request to the last answer.
    pub seconds: f64,
    /// Requests answered per second of wall time.
    pub req_per_s: f64,
    /// Mean latency.
    pub mean_ms: f64,
    /// Median latency.
    pub p50_ms: f64,
    /// 90th percentile latency.
    pub p90_ms: f64,
    /// 99th percentile latency.
    pub p99_ms: f64,
    /// Largest latency.
    pub max_ms: f64,
}

impl From<Samples> for PathStats {
    fn from(s: Samples) -> Self {
        let h = &s.latency_ns;
        let ms = |ns: u64| ns as f64 / 1e6;
        let requests = s.ok + s.errors;
        let seconds = s.elapsed.as_secs_f64();
        Self {
            requests,
            ok: s.ok,
            errors: s.errors,
            first_error: s.first_error,
            seconds,
            req_per_s: if seconds > 0.0 { requests as f64 / seconds } else { 0.0 },
            mean_ms: h.mean() / 1e6,
            p50_ms: ms(h.value_at_quantile(0.50)),
            p90_ms: ms(h.value_at_quantile(0.90)),
            p99_ms: ms(h.value_at_quantile(0.99)),
            max_ms: ms(h.max()),
        }
    }
}
