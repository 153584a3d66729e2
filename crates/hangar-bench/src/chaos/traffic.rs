//! The run's load and what it got back: sync chat requests and async
//! predictions with webhooks, sent through random gateways at a bounded
//! rate, every one recorded with its outcome; and the webhook receiver
//! that records every delivery.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use serde_json::{json, Value};

use super::fleet::SharedRoster;

/// The models the load asks for, with their weights: `chaos/burst` less
/// often, so it goes idle, sleeps and is woken; `chaos/pair`'s adapters
/// (`BASE:ADAPTER`, sync chats only: the predictions routes name models)
/// as often as their base, so that its two replicas' agents load and
/// unload them (2 slots, 3 adapters) under the faults.
pub const MODELS: [(&str, u32); 7] = [
    ("chaos/large", 3),
    ("chaos/pair", 3),
    ("chaos/small", 3),
    ("chaos/burst", 1),
    (super::fleet::ADAPTERS[0], 1),
    (super::fleet::ADAPTERS[1], 1),
    (super::fleet::ADAPTERS[2], 1),
];

/// How a sync request ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum SyncOutcome {
    /// An HTTP answer with this status.
    Answered {
        /// The status.
        status: u16,
        /// The start of its body, unless 200.
        body: String,
    },
    /// The connection was refused: its gateway was down. Never accepted.
    Refused,
    /// Sent, but the connection broke or timed out before an answer.
    Cut {
        /// What the client saw.
        error: String,
    },
}

/// One sync request.
#[derive(Debug, Clone, Serialize)]
pub struct SyncRecord {
    /// The gateway it went to (index).
    pub gateway: usize,
    /// The model.
    pub model: String,
    /// Sent, ms into the run.
    pub start_ms: u64,
    /// Ended, ms into the run.
    pub end_ms: u64,
    /// How.
    pub outcome: SyncOutcome,
}

/// How a create ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum CreateOutcome {
    /// 201: accepted, with this id.
    Accepted {
        /// The prediction's id.
        id: String,
    },
    /// Answered with another status.
    Answered {
        /// The status.
        status: u16,
        /// It carried `Retry-After`.
        retry_after: bool,
        /// The start of its body.
        body: String,
    },
    /// The connection was refused: its gateway was down.
    Refused,
    /// Sent, but no answer came: whether it was stored is unknown.
    Cut {
        /// What the client saw.
        error: String,
    },
}

/// One create.
#[derive(Debug, Clone, Serialize)]
pub struct CreateRecord {
    /// The gateway it went to (index).
    pub gateway: usize,
    /// The model.
    pub model: String,
    /// Sent, ms into the run.
    pub start_ms: u64,
    /// Answered, ms into the run.
    pub end_ms: u64,
    /// How.
    pub outcome: CreateOutcome,
}

/// Everything the load sent and got.
#[derive(Debug, Default)]
pub struct Traffic {
    /// The sync requests.
    pub syncs: Mutex<Vec<SyncRecord>>,
    /// The creates.
    pub creates: Mutex<Vec<CreateRecord>>,
}

/// The load's knobs.
#[derive(Debug, Clone, Copy)]
pub struct LoadShape {
    /// Concurrent clients.
    pub clients: usize,
    /// Requests per second, all clients together (Poisson arrivals).
    pub rate: f64,
    /// Seed of the clients' draws.
    pub seed: u64,
}

fn excerpt(s: &str) -> String {
    s.chars().take(200).collect()
}

/// Runs the load until `stop` is set: `shape.clients` clients, each
/// sending at `rate / clients` per second (exponential gaps), a sync chat
/// or a prediction (half each; an adapter's always a chat) of a model
/// drawn by [`MODELS`], through a
/// gateway drawn at random. A request to a gateway that is down is
/// recorded as refused.
pub async fn run(
    traffic: Arc<Traffic>,
    roster: SharedRoster,
    hook_url: String,
    shape: LoadShape,
    t0: Instant,
    stop: Arc<AtomicBool>,
) {
    let client = hangar_agent::direct_http()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(90))
        .build()
        .expect("a client");
    let mean_gap = shape.clients as f64 / shape.rate.max(0.01);
    let mut tasks = Vec::new();
    for c in 0..shape.clients {
        let (traffic, roster, hook_url, client, stop) =
            (traffic.clone(), roster.clone(), hook_url.clone(), client.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng =
                ChaCha8Rng::seed_from_u64(shape.seed.wrapping_mul(1_000_003).wrapping_add(c as u64));
            let total: u32 = MODELS.iter().map(|(_, w)| w).sum();
            while !stop.load(Ordering::Relaxed) {
                let u: f64 = rng.random_range(f64::EPSILON..1.0);
                tokio::time::sleep(Duration::from_secs_f64(-u.ln() * mean_gap)).await;
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                let mut draw = rng.random_range(0..total);
                let model = MODELS
                    .iter()
                    .find(|(_, w)| {
                        let hit = draw < *w;
                        draw = draw.saturating_sub(*w);
                        hit
                    })
                    .map(|(m, _)| *m)
                    .expect("below the total");
                let tokens = rng.random_range(4..32u32);
                let sync = rng.random_bool(0.5) || model.contains(':');
                let (gateway, url) = {
                    let r = roster.read().expect("roster");
                    let g = rng.random_range(0..r.gateways.len());
                    (g, r.gateways[g].clone())
                };
                let start_ms = t0.elapsed().as_millis() as u64;
                if sync {
                    let outcome = match url {
                        None => SyncOutcome::Refused,
                        Some(url) => chat(&client, &url, model, tokens).await,
                    };
                    let end_ms = t0.elapsed().as_millis() as u64;
                    let r = SyncRecord { gateway, model: model.into(), start_ms, end_ms, outcome };
                    traffic.syncs.lock().expect("syncs").push(r);
                } else {
                    let outcome = match url {
                        None => CreateOutcome::Refused,
                        Some(url) => create(&client, &url, model, tokens, &hook_url).await,
                    };
                    let end_ms = t0.elapsed().as_millis() as u64;
                    let r = CreateRecord { gateway, model: model.into(), start_ms, end_ms, outcome };
                    traffic.creates.lock().expect("creates").push(r);
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}

async fn chat(client: &reqwest::Client, url: &str, model: &str, tokens: u32) -> SyncOutcome {
    let body =
        json!({"model": model, "messages": [{"role": "user", "content": "chaos"}], "max_tokens": tokens});
    match client.post(format!("{url}/v1/chat/completions")).json(&body).send().await {
        Err(e) if e.is_connect() => SyncOutcome::Refused,
        Err(e) => SyncOutcome::Cut { error: excerpt(&e.to_string()) },
        Ok(r) => {
            let status = r.status().as_u16();
            match r.text().await {
                Ok(_) if status == 200 => SyncOutcome::Answered { status, body: String::new() },
                Ok(text) => SyncOutcome::Answered { status, body: excerpt(&text) },
                Err(e) => SyncOutcome::Cut { error: excerpt(&e.to_string()) },
            }
        }
    }
}

async fn create(client: &reqwest::Client, url: &str, model: &str, tokens: u32, hook: &str) -> CreateOutcome {
    let body = json!({
        "input": {"prompt": "chaos", "max_tokens": tokens},
        "webhook": hook,
        "webhook_events_filter": ["start", "completed"],
    });
    match client.post(format!("{url}/v1/models/{model}/predictions")).json(&body).send().await {
        Err(e) if e.is_connect() => CreateOutcome::Refused,
        Err(e) => CreateOutcome::Cut { error: excerpt(&e.to_string()) },
        Ok(r) => {
            let status = r.status().as_u16();
            let retry_after = r.headers().contains_key("retry-after");
            match r.text().await {
                Err(e) => CreateOutcome::Cut { error: excerpt(&e.to_string()) },
                Ok(text) if status == 201 => {
                    match serde_json::from_str::<Value>(&text)
                        .ok()
                        .and_then(|v| v["id"].as_str().map(str::to_owned))
                    {
                        Some(id) => CreateOutcome::Accepted { id },
                        None => CreateOutcome::Answered { status, retry_after, body: excerpt(&text) },
                    }
                }
                Ok(text) => CreateOutcome::Answered { status, retry_after, body: excerpt(&text) },
            }
        }
    }
}

/// What one prediction's webhooks said.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Hooks {
    /// The `webhook-id` of each `start` delivery (one per run; a resend
    /// of one keeps its id).
    pub starts: BTreeSet<String>,
    /// Each terminal delivery's `webhook-id` → the status and error it
    /// carried.
    pub terminals: BTreeMap<String, (String, Option<String>)>,
    /// The first terminal delivery, ms into the run.
    pub terminal_ms: Option<u64>,
}

/// The webhook receiver's records, by prediction id.
#[derive(Debug, Default)]
pub struct Receiver {
    by_id: Mutex<HashMap<String, Hooks>>,
}

impl Receiver {
    /// A copy of what was received.
    pub fn snapshot(&self) -> HashMap<String, Hooks> {
        self.by_id.lock().expect("hooks").clone()
    }
}

/// Starts the receiver on a loopback port: `(its URL, the task)`. Every
/// delivery is answered 200 and recorded.
pub async fn receiver(t0: Instant) -> std::io::Result<(String, Arc<Receiver>, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/hook", listener.local_addr()?);
    let state = Arc::new(Receiver::default());
    let app = axum::Router::new()
        .route(
            "/hook",
            post(|State((r, t0)): State<(Arc<Receiver>, Instant)>, headers: HeaderMap, body: String| async move {
                let Ok(v) = serde_json::from_str::<Value>(&body) else { return StatusCode::BAD_REQUEST };
                let hook_id = headers.get("webhook-id").and_then(|h| h.to_str().ok()).unwrap_or("").to_owned();
                let (Some(id), Some(status)) = (v["id"].as_str(), v["status"].as_str()) else {
                    return StatusCode::BAD_REQUEST;
                };
                let mut by_id = r.by_id.lock().expect("hooks");
                let hooks = by_id.entry(id.to_owned()).or_default();
                if matches!(status, "starting" | "processing") {
                    hooks.starts.insert(hook_id);
                } else {
                    hooks.terminals.insert(hook_id, (status.to_owned(), v["error"].as_str().map(str::to_owned)));
                    hooks.terminal_ms.get_or_insert(t0.elapsed().as_millis() as u64);
                }
                StatusCode::OK
            }),
        )
        .with_state((state.clone(), t0));
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((url, state, task))
}
