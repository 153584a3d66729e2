//! Cog's HTTP protocol: how the node agent talks to a cog model server
//! (`python -m cog.server.http`, cog 0.16's Python server).
//!
//! - `GET /health-check` answers `{"status": S, "setup": {"status",
//!   "logs", …}}` with `S` one of `STARTING`, `READY`, `BUSY`,
//!   `SETUP_FAILED`, `DEFUNCT` (and `UNHEALTHY` when a user health check
//!   fails).
//! - `PUT /predictions/{id}` (`/trainings/{id}` in train mode, and
//!   `/procedures/{id}` with a `context` on the procedures runtime) with
//!   `Prefer: respond-async` and a body `{"id", "input", "webhook",
//!   "webhook_events_filter"}` answers 202 and runs the prediction; 409
//!   when the server is already running one (it runs one at a time), 422
//!   naming the input fields it rejects.
//! - The server then POSTs the whole prediction object to `webhook` on
//!   `start`, `output`, `logs` and `completed`: `{"id", "input", "output",
//!   "logs", "error", "status", "started_at", "completed_at", "metrics"}`,
//!   where `output` is the list of items so far for an iterator output and
//!   `logs` all the logs so far.
//! - `POST /predictions/{id}/cancel` cancels it (404 if it is not running);
//!   the `completed` webhook then says `canceled`. A train-mode server
//!   serves trainings the same way under `/trainings`, but its
//!   `/trainings/{id}/cancel` is broken in cog 0.16: a training is
//!   canceled through the predictions route, which every mode serves.
//! - `POST /shutdown` stops the server: uvicorn stops, the worker process
//!   running the model is terminated and joined, the process exits 0. A
//!   server started with `--await-explicit-shutdown true` (as the node
//!   agent starts them) waits for this (or a SIGINT — which it cannot
//!   receive if it inherited SIGINT ignored) and ignores SIGTERM.
//!
//! [`run`] drives one prediction: it receives the webhooks on a port of its
//! own, turns the cumulative objects into new output items and log lines
//! ([`Progress`]), and cancels the prediction on the server if it is
//! dropped before the end.
//!
//! The server may be on another machine (a fleet's node): the port is
//! opened on the address of this machine that the route to the server
//! leaves from (the local end of that route: `127.0.0.1` for a server on
//! loopback, this machine's address on the network between them
//! otherwise), which the server reaches back. Its paths start with a
//! random token of the run, so only who was told the URL posts to it. A
//! procedure's run also serves its source archive there
//! (`GET …/source`, named to the runtime as `procedure_source_url`).

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use rand::Rng;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

/// How often a running prediction's server is checked for having died.
const LIVENESS_INTERVAL: Duration = Duration::from_secs(2);
/// Health checks missed in a row that mean the server is gone.
const LIVENESS_MISSES: u32 = 3;
/// How long to wait before asking a busy server again.
const BUSY_RETRY: Duration = Duration::from_millis(100);

/// Which of a cog model's functions a server runs (`--x-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CogMode {
    /// `predict` in `cog.yaml`: `/predictions`.
    Predict,
    /// `train` in `cog.yaml`: `/trainings`.
    Train,
    /// A procedure on the procedures runtime ([`crate::procedures`]):
    /// `/procedures`, with a `context` naming its source.
    Procedure,
}

impl CogMode {
    /// The `--x-mode` argument.
    pub fn arg(self) -> &'static str {
        match self {
            Self::Predict => "predict",
            Self::Train => "train",
            Self::Procedure => "procedure",
        }
    }

    /// The collection its jobs are created in.
    pub fn collection(self) -> &'static str {
        match self {
            Self::Predict => "predictions",
            Self::Train => "trainings",
            Self::Procedure => "procedures",
        }
    }

    /// Where a job of this mode is canceled: `{collection}/{id}/cancel`,
    /// except a training's, canceled through `/predictions/{id}/cancel`:
    /// cog (0.16) answers its own `/trainings/{id}/cancel` with an error and
    /// never cancels (the route returns the un-awaited coroutine of the
    /// prediction's), while the prediction's route, served in every mode,
    /// cancels whatever runs under the id.
    fn cancel_collection(self) -> &'static str {
        match self {
            Self::Train => Self::Predict.collection(),
            mode => mode.collection(),
        }
    }
}

/// `GET /health-check`'s `status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum HealthStatus {
    /// Running `setup()`.
    Starting,
    /// Ready for a prediction.
    Ready,
    /// Running a prediction.
    Busy,
    /// `setup()` failed; the server will not serve.
    SetupFailed,
    /// A fatal error after setup; the server will not serve.
    Defunct,
    /// The model's own health check failed.
    Unhealthy,
    /// A status this client does not know.
    #[serde(other)]
    Unknown,
}

/// A cog server's answer to `GET /health-check`.
#[derive(Debug, Clone, Deserialize)]
pub struct Health {
    /// Where the server is.
    pub status: HealthStatus,
    /// The result of `setup()`, once it ran.
    #[serde(default)]
    pub setup: Option<SetupResult>,
}

/// `setup()`'s outcome as the health check reports it.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SetupResult {
    /// What `setup()` printed (and its traceback when it failed).
    #[serde(default)]
    pub logs: Option<String>,
}

impl Health {
    /// Whether the server can take (or is running) predictions.
    pub fn serves(&self) -> bool {
        matches!(self.status, HealthStatus::Ready | HealthStatus::Busy)
    }

    /// The setup logs, or empty.
    pub fn setup_logs(&self) -> &str {
        self.setup.as_ref().and_then(|s| s.logs.as_deref()).unwrap_or("")
    }
}

/// Asks a cog server at `base_url` how it is.
pub async fn health(client: &reqwest::Client, base_url: &str, timeout: Duration) -> Result<Health, String> {
    let r = client
        .get(format!("{base_url}/health-check"))
        .timeout(timeout)
        .send()
        .await
        .map_err(|e| format!("no answer to /health-check: {e}"))?;
    let body = r.bytes().await.map_err(|e| format!("/health-check broke off: {e}"))?;
    serde_json::from_slice(&body)
        .map_err(|e| format!("/health-check answered something else than cog's JSON: {e}"))
}

/// Asks a cog server at `base_url` to shut down (`POST /shutdown`); it
/// exits shortly after answering.
pub async fn shutdown(client: &reqwest::Client, base_url: &str, timeout: Duration) -> Result<(), String> {
    let r = client
        .post(format!("{base_url}/shutdown"))
        .timeout(timeout)
        .send()
        .await
        .map_err(|e| format!("no answer to /shutdown: {e}"))?;
    if !r.status().is_success() {
        return Err(format!("/shutdown answered {}", r.status()));
    }
    Ok(())
}

/// A prediction's status as cog reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CogStatus {
    /// Accepted, not yet running.
    Starting,
    /// Running.
    Processing,
    /// Ended with its output.
    Succeeded,
    /// Ended with an error.
    Failed,
    /// Ended by a cancel.
    Canceled,
}

/// The prediction object cog posts to the webhook (the fields Hangar uses).
#[derive(Debug, Clone, Deserialize)]
pub struct CogPrediction {
    /// Where it is.
    pub status: CogStatus,
    /// The output so far: the list of items for an iterator output; the
    /// value once ended for any other.
    #[serde(default)]
    pub output: Option<Value>,
    /// All the logs so far.
    #[serde(default)]
    pub logs: Option<String>,
    /// Why it failed.
    #[serde(default)]
    pub error: Option<String>,
}

/// What of a prediction's cumulative state has been passed on: turns each
/// webhook object into the output items and complete log lines that are
/// new since the previous one.
#[derive(Debug, Default)]
pub struct Progress {
    outputs: usize,
    log_bytes: usize,
}

impl Progress {
    /// New output items and log lines in `p`. Log text after the last
    /// newline is held back until the line ends, or until `p` is the last
    /// object (`ended`).
    pub fn update(&mut self, p: &CogPrediction, ended: bool) -> (Vec<Value>, Vec<String>) {
        let mut items = Vec::new();
        if let Some(Value::Array(all)) = &p.output {
            items.extend(all.iter().skip(self.outputs).cloned());
            self.outputs = self.outputs.max(all.len());
        }
        let mut lines = Vec::new();
        let logs = p.logs.as_deref().unwrap_or("");
        if let Some(new) = logs.get(self.log_bytes..) {
            let complete = if ended { new.len() } else { new.rfind('\n').map_or(0, |i| i + 1) };
            lines.extend(new[..complete].lines().map(str::to_owned));
            self.log_bytes += complete;
        }
        (items, lines)
    }
}

/// How a prediction on a cog server ended, when not with its output.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CogError {
    /// The model failed, rejected the input, or the server went away.
    #[error("{0}")]
    Failed(String),
    /// The server reports it canceled.
    #[error("canceled")]
    Canceled,
}

/// One prediction to run on a cog server.
#[derive(Debug, Clone)]
pub struct CogJob<'a> {
    /// The server's base URL.
    pub base_url: &'a str,
    /// Prediction or training.
    pub mode: CogMode,
    /// The id it gets on the server (Hangar's prediction id).
    pub id: &'a str,
    /// The model's input.
    pub input: &'a Value,
    /// The job's `context` (a procedure's: its source's hash and the
    /// caller's credentials), sent as is but for `procedure_source_url`,
    /// added when `source` is given; none for predictions and trainings.
    pub context: Option<&'a Value>,
    /// A file served to the server for the run's length (a procedure's
    /// source archive), at the URL the context names as
    /// `procedure_source_url`.
    pub source: Option<&'a Path>,
}

/// Runs `job` on its cog server and returns its output; each new output
/// item and log line goes to `progress` as it arrives. Waits while the
/// server is busy (409) with an earlier prediction.
///
/// # Cancel safety
/// Dropping the future before the end cancels the prediction on the
/// server (`POST …/cancel`, sent in the background) and closes the webhook
/// port.
pub async fn run(
    client: &reqwest::Client,
    job: CogJob<'_>,
    mut progress: impl FnMut(Vec<Value>, Vec<String>),
) -> Result<Value, CogError> {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let receiver =
        webhook_receiver(tx, job.base_url, job.source.map(Path::to_path_buf)).await.map_err(|e| {
            CogError::Failed(format!("no webhook port for the cog server at {}: {e}", job.base_url))
        })?;
    let mut body = json!({
        "id": job.id,
        "input": job.input,
        "webhook": receiver.url("webhook"),
        "webhook_events_filter": ["start", "output", "logs", "completed"],
    });
    if let Some(context) = job.context {
        body["context"] = context.clone();
        if job.source.is_some() {
            body["context"]["procedure_source_url"] = receiver.url("source").into();
        }
        // A server listening on every address (`0.0.0.0:8080`, no
        // `public_url`) is reached from the node at the address its
        // webhooks go to.
        if let Some(api) =
            body["context"]["replicate_api_base_url"].as_str().and_then(|u| on_ip(u, receiver.ip))
        {
            body["context"]["replicate_api_base_url"] = api.into();
        }
    }
    let mut cancel = CancelOnDrop { client: client.clone(), url: None, receiver: Some(receiver) };
    let url = format!("{}/{}/{}", job.base_url, job.mode.collection(), job.id);
    let body = body.to_string();
    // From here a drop cancels: the PUT may reach the server after all.
    cancel.url = Some(format!("{}/{}/{}/cancel", job.base_url, job.mode.cancel_collection(), job.id));
    loop {
        let answer = client
            .put(&url)
            .header("Prefer", "respond-async")
            .header(header::CONTENT_TYPE, "application/json")
            .body(body.clone())
            .send()
            .await
            .map_err(|e| CogError::Failed(format!("the cog server did not answer: {e}")))?;
        let status = answer.status();
        if status == StatusCode::CONFLICT {
            tokio::time::sleep(BUSY_RETRY).await;
            continue;
        }
        if !status.is_success() {
            let text = answer.text().await.unwrap_or_default();
            return Err(CogError::Failed(rejection(status, &text)));
        }
        break;
    }
    let mut seen = Progress::default();
    let mut liveness = tokio::time::interval(LIVENESS_INTERVAL);
    liveness.tick().await;
    let mut missed = 0;
    loop {
        tokio::select! {
            p = rx.recv() => {
                let p: CogPrediction = p.expect("the receiver lives as long as this loop");
                let ended = matches!(p.status, CogStatus::Succeeded | CogStatus::Failed | CogStatus::Canceled);
                let (items, lines) = seen.update(&p, ended);
                if !items.is_empty() || !lines.is_empty() {
                    progress(items, lines);
                }
                if ended {
                    cancel.url = None;
                }
                match p.status {
                    CogStatus::Succeeded => return Ok(p.output.unwrap_or(Value::Null)),
                    CogStatus::Failed => {
                        return Err(CogError::Failed(p.error.unwrap_or_else(|| "the model failed".into())))
                    }
                    CogStatus::Canceled => return Err(CogError::Canceled),
                    CogStatus::Starting | CogStatus::Processing => {}
                }
            }
            _ = liveness.tick() => {
                match health(client, job.base_url, LIVENESS_INTERVAL).await {
                    Err(e) if missed + 1 >= LIVENESS_MISSES => {
                        cancel.url = None;
                        return Err(CogError::Failed(format!("the cog server went away while running it ({e})")));
                    }
                    Err(_) => missed += 1,
                    Ok(h) if h.status == HealthStatus::Defunct => {
                        cancel.url = None;
                        return Err(CogError::Failed("the cog server became DEFUNCT while running it".into()));
                    }
                    Ok(_) => missed = 0,
                }
            }
        }
    }
}

/// A cog server's refusal in plain words: for 422, the fields it rejected
/// (FastAPI's `detail` list of `{loc, msg}`).
fn rejection(status: StatusCode, body: &str) -> String {
    let detail = serde_json::from_str::<Value>(body).ok().and_then(|v| v.get("detail").cloned());
    match detail {
        Some(Value::Array(items)) => {
            let fields: Vec<String> = items
                .iter()
                .map(|d| {
                    let loc = d.get("loc").and_then(Value::as_array).map(|l| {
                        l.iter()
                            .skip_while(|p| p.as_str() == Some("body"))
                            .map(|p| p.to_string().replace('"', ""))
                            .collect::<Vec<_>>()
                            .join(".")
                    });
                    let msg = d.get("msg").and_then(Value::as_str).unwrap_or("invalid");
                    format!("{}: {msg}", loc.unwrap_or_default())
                })
                .collect();
            format!("the model rejected the input ({status}): {}", fields.join("; "))
        }
        Some(Value::String(s)) => format!("the cog server answered {status}: {s}"),
        _ => format!("the cog server answered {status}: {body}"),
    }
}

/// Sends the cancel of a prediction that is still running on the server
/// when its driver goes away, and keeps the webhook port open a while for
/// the server's last webhook: cog retries an undelivered `completed`
/// webhook for minutes and stays BUSY meanwhile.
struct CancelOnDrop {
    client: reqwest::Client,
    url: Option<String>,
    receiver: Option<WebhookReceiver>,
}

/// Cancels sent while the server does not know the prediction yet.
const CANCEL_ATTEMPTS: u32 = 10;
/// How long the webhook port outlives a cancel.
const CANCEL_LINGER: Duration = Duration::from_secs(30);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        let (Some(url), Ok(rt)) = (self.url.take(), tokio::runtime::Handle::try_current()) else { return };
        let (client, receiver) = (self.client.clone(), self.receiver.take());
        rt.spawn(async move {
            // 404 while a PUT sent just before may still be on its way.
            for _ in 0..CANCEL_ATTEMPTS {
                match client.post(&url).send().await {
                    Ok(r) if r.status() == StatusCode::NOT_FOUND => tokio::time::sleep(BUSY_RETRY).await,
                    Ok(_) => break,
                    Err(e) => {
                        tracing::warn!(%url, "could not cancel a prediction on its cog server: {e}");
                        break;
                    }
                }
            }
            tokio::time::sleep(CANCEL_LINGER).await;
            drop(receiver);
        });
    }
}

/// The run's own HTTP port: the prediction objects posted to
/// `/{token}/webhook` are passed on, and `/{token}/source` serves the
/// run's source file, if it has one. It closes when dropped.
struct WebhookReceiver {
    /// `http://ADDRESS:PORT/TOKEN`.
    base: String,
    /// `ADDRESS`: this machine's, as the server reaches it.
    ip: IpAddr,
    task: tokio::task::JoinHandle<()>,
}

impl WebhookReceiver {
    /// The URL of `what` (`webhook`, `source`).
    fn url(&self, what: &str) -> String {
        format!("{}/{what}", self.base)
    }
}

impl Drop for WebhookReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// This machine's address that the server at `base_url` reaches it back
/// on: the local end of the route to it (a UDP socket is connected, which
/// sends nothing).
async fn callback_ip(base_url: &str) -> std::io::Result<IpAddr> {
    let invalid = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, why);
    let url = reqwest::Url::parse(base_url).map_err(|e| invalid(format!("`{base_url}`: {e}")))?;
    let host = url.host_str().ok_or_else(|| invalid(format!("`{base_url}` names no host")))?;
    let host = crate::engine::bare_host(host);
    let port = url.port_or_known_default().unwrap_or(80);
    let server = tokio::net::lookup_host((host, port))
        .await?
        .next()
        .ok_or_else(|| invalid(format!("`{host}` resolves to no address")))?;
    let any: SocketAddr = if server.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { ([0u16; 8], 0).into() };
    let probe = std::net::UdpSocket::bind(any)?;
    probe.connect(server)?;
    Ok(probe.local_addr()?.ip())
}

/// `url` with its host made `ip`, if its host is the unspecified address
/// (`0.0.0.0`, `::`): a listener on every address, named by one of them.
fn on_ip(url: &str, ip: IpAddr) -> Option<String> {
    let mut url = reqwest::Url::parse(url).ok()?;
    let host: IpAddr = crate::engine::bare_host(url.host_str()?).parse().ok()?;
    if !host.is_unspecified() {
        return None;
    }
    url.set_ip_host(ip).ok()?;
    Some(url.as_str().trim_end_matches('/').to_owned())
}

async fn webhook_receiver(
    tx: mpsc::UnboundedSender<CogPrediction>,
    base_url: &str,
    source: Option<PathBuf>,
) -> std::io::Result<WebhookReceiver> {
    let ip = callback_ip(base_url).await?;
    let listener = tokio::net::TcpListener::bind((ip, 0)).await?;
    let token: String = {
        let mut rng = rand::rng();
        (0..32).map(|_| char::from_digit(rng.random_range(0..16), 16).expect("a hex digit")).collect()
    };
    let base = format!("http://{}/{token}", listener.local_addr()?);
    let app = axum::Router::new()
        .route(&format!("/{token}/webhook"), post(receive))
        .with_state(tx)
        .route(&format!("/{token}/source"), get(move || serve_source(source.clone())));
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!("the cog webhook port failed: {e}");
        }
    });
    Ok(WebhookReceiver { base, ip, task })
}

/// The run's source file, whole (a procedure's archive: a few MiB at
/// most, bounded by `max_archive_bytes`).
async fn serve_source(source: Option<PathBuf>) -> axum::response::Response {
    let Some(path) = source else { return (StatusCode::NOT_FOUND, "this run has no source").into_response() };
    match tokio::task::spawn_blocking(move || std::fs::read(path)).await {
        Ok(Ok(bytes)) => ([(header::CONTENT_TYPE, "application/gzip")], bytes).into_response(),
        Ok(Err(e)) => {
            tracing::warn!("a run's source could not be read: {e}");
            (StatusCode::GONE, format!("the source is gone from the gateway's cache: {e}")).into_response()
        }
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn receive(State(tx): State<mpsc::UnboundedSender<CogPrediction>>, body: Bytes) -> StatusCode {
    match serde_json::from_slice::<CogPrediction>(&body) {
        Ok(p) => {
            let _ = tx.send(p);
            StatusCode::OK
        }
        Err(e) => {
            tracing::warn!("a cog server posted an unreadable prediction: {e}");
            StatusCode::BAD_REQUEST
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(status: &str, output: Value, logs: &str) -> CogPrediction {
        serde_json::from_value(json!({"status": status, "output": output, "logs": logs})).unwrap()
    }

    #[test]
    fn progress_passes_on_only_what_is_new() {
        let mut p = Progress::default();
        assert_eq!(p.update(&object("processing", Value::Null, ""), false), (vec![], vec![]));
        let (items, lines) = p.update(&object("processing", json!(["a"]), "one\ntw"), false);
        assert_eq!((items, lines), (vec![json!("a")], vec!["one".to_owned()]));
        let (items, lines) = p.update(&object("processing", json!(["a", "b", "c"]), "one\ntwo\n"), false);
        assert_eq!((items, lines), (vec![json!("b"), json!("c")], vec!["two".to_owned()]));
        let (items, lines) = p.update(&object("succeeded", json!(["a", "b", "c"]), "one\ntwo\nend"), true);
        assert_eq!((items, lines), (vec![], vec!["end".to_owned()]));
    }

    #[test]
    fn health_and_objects_parse_as_cog_sends_them() {
        let h: Health = serde_json::from_str(
            r#"{"status":"SETUP_FAILED","setup":{"started_at":"x","logs":"boom\n","status":"failed"}}"#,
        )
        .unwrap();
        assert_eq!((h.status, h.setup_logs(), h.serves()), (HealthStatus::SetupFailed, "boom\n", false));
        let h: Health = serde_json::from_str(r#"{"status":"SOMETHING_NEW"}"#).unwrap();
        assert_eq!(h.status, HealthStatus::Unknown);
        let p: CogPrediction = serde_json::from_str(
            r#"{"input":{},"output":"x","id":"p","status":"failed","error":"bad","metrics":{"predict_time":1}}"#,
        )
        .unwrap();
        assert_eq!((p.status, p.error.as_deref()), (CogStatus::Failed, Some("bad")));
    }

    /// A cog server that, given a procedure, fetches its source, tries the
    /// webhook port without its token, then posts `succeeded` with what it
    /// saw as the output.
    async fn fetching_server(ip: IpAddr) -> String {
        async fn put_run(axum::Json(body): axum::Json<Value>) -> StatusCode {
            tokio::spawn(async move {
                let c = reqwest::Client::new();
                let source =
                    c.get(body["context"]["procedure_source_url"].as_str().unwrap()).send().await.unwrap();
                let source = String::from_utf8(source.bytes().await.unwrap().to_vec()).unwrap();
                let hook = reqwest::Url::parse(body["webhook"].as_str().unwrap()).unwrap();
                let forged = c.post(hook.join("/webhook").unwrap()).json(&json!({"status": "failed"})).send();
                let forged = forged.await.unwrap().status().as_u16();
                let output = json!({"source": source, "hook_host": hook.host_str(), "forged": forged,
                                    "context": body["context"]});
                c.post(hook).json(&json!({"status": "succeeded", "output": output})).send().await.unwrap();
            });
            StatusCode::ACCEPTED
        }
        let app = axum::Router::new().route("/procedures/{id}", axum::routing::put(put_run));
        let listener = tokio::net::TcpListener::bind((ip, 0)).await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        url
    }

    #[tokio::test]
    async fn a_server_elsewhere_is_given_a_webhook_and_its_source_on_the_address_that_reaches_back() {
        // This machine's address on its default route, as a fleet's node
        // would see it (loopback on a machine with no route out).
        let ip = std::net::UdpSocket::bind("0.0.0.0:0")
            .and_then(|s| s.connect("198.51.100.1:9").and_then(|()| s.local_addr()))
            .map_or(IpAddr::from([127, 0, 0, 1]), |a| a.ip());
        let base = fetching_server(ip).await;
        let dir = tempfile::tempdir().unwrap();
        let archive = dir.path().join("source.tar.gz");
        std::fs::write(&archive, "the archive's bytes").unwrap();
        let job = CogJob {
            base_url: &base,
            mode: CogMode::Procedure,
            id: "p1",
            input: &json!({}),
            context: Some(&json!({"procedure_source_sha256": "abc"})),
            source: Some(&archive),
        };
        let out = run(&reqwest::Client::new(), job, |_, _| {}).await.unwrap();
        assert_eq!(out["source"], "the archive's bytes");
        assert_eq!(
            out["hook_host"],
            ip.to_string(),
            "the port is on the address the route to {base} leaves from"
        );
        assert_eq!(out["forged"], 404, "a post without the run's token reaches nothing");
        assert_eq!(out["context"]["procedure_source_sha256"], "abc", "the context is passed on");
        assert!(out["context"]["procedure_source_url"].as_str().unwrap().ends_with("/source"), "{out}");
        assert_eq!(callback_ip("http://127.0.0.1:9").await.unwrap(), IpAddr::from([127, 0, 0, 1]));
        assert!(callback_ip("http://no-such-host.invalid:9").await.is_err());
    }

    #[test]
    fn an_api_url_on_every_address_is_named_by_the_address_the_node_reaches() {
        let ip = IpAddr::from([10, 0, 0, 7]);
        assert_eq!(on_ip("http://0.0.0.0:8080", ip).as_deref(), Some("http://10.0.0.7:8080"));
        assert_eq!(on_ip("http://[::]:8080/api", ip).as_deref(), Some("http://10.0.0.7:8080/api"));
        assert_eq!(on_ip("http://127.0.0.1:8080", ip), None, "a real address stays");
        assert_eq!(on_ip("https://api.example.com", ip), None);
        assert_eq!(on_ip("not a url", ip), None);
    }

    #[test]
    fn rejections_name_the_fields() {
        let body =
            r#"{"detail":[{"type":"missing","loc":["body","input","prompt"],"msg":"Field required"}]}"#;
        assert_eq!(
            rejection(StatusCode::UNPROCESSABLE_ENTITY, body),
            "the model rejected the input (422 Unprocessable Entity): input.prompt: Field required"
        );
        assert_eq!(rejection(StatusCode::BAD_GATEWAY, "x"), "the cog server answered 502 Bad Gateway: x");
    }
}
