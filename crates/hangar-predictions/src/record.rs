//! A prediction as stored, and its API rendering.

use hangar_core::Millis;
use serde_json::{json, Value};

use crate::lifecycle::Status;
use crate::webhook_policy::Filter;

/// What kind of job a record is. Predictions and queued requests share
/// their model's queue; trainings have their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum JobKind {
    /// A prediction (the default).
    Prediction,
    /// A training: own queue, 24 h default timeout, one at a time per model,
    /// carries a `destination`.
    Training,
    /// A request of the synchronous OpenAI API queued in Workers AI's
    /// async mode (`options.queueRequest`, [`crate::request`]): its input
    /// is a [`QueuedRequest`](crate::request::QueuedRequest), its output
    /// the engine's answer ([`Answer`](crate::request::Answer)). It is
    /// not a prediction to the predictions API (not listed, not found).
    Request,
    /// A run of a procedure ([`crate::procedures`]): its `model` is the
    /// procedure's `owner/name`; it waits in the one shared queue
    /// `input:procedure` and runs on the procedures runtime. The API shows
    /// it as a prediction ([`JobKind::shown_as`]), as Replicate's does.
    Procedure,
}

impl JobKind {
    /// The name used in queue names and the store.
    pub fn as_str(self) -> &'static str {
        match self {
            JobKind::Prediction => "prediction",
            JobKind::Training => "training",
            JobKind::Request => "request",
            JobKind::Procedure => "procedure",
        }
    }

    /// The kind the API shows it as: a procedure's run is a prediction.
    pub fn shown_as(self) -> JobKind {
        match self {
            JobKind::Procedure => JobKind::Prediction,
            k => k,
        }
    }

    /// The kind called `s`.
    pub fn parse(s: &str) -> Option<JobKind> {
        [JobKind::Prediction, JobKind::Training, JobKind::Request, JobKind::Procedure]
            .into_iter()
            .find(|k| k.as_str() == s)
    }

    /// The queue of this kind for `model` (Replicate: `input:prediction:…`).
    /// A queued request waits in its model's prediction queue: one
    /// `async_slots` bound on what the async class puts in the model's
    /// line, one rotation between accounts, whichever API they came in by.
    /// Every procedure's run waits in one queue, `input:procedure`,
    /// whatever its `model`: the runtime's replicas serve them all.
    pub fn queue(self, model: &str) -> String {
        let queue = match self {
            JobKind::Prediction | JobKind::Request => "prediction",
            JobKind::Training => "training",
            JobKind::Procedure => return "input:procedure".to_owned(),
        };
        format!("input:{queue}:{model}")
    }
}

/// One prediction (or training), every field of the API object plus what
/// the server needs to run it.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// Position in creation order (assigned by the store; 0 before).
    pub seq: i64,
    /// The public id.
    pub id: String,
    /// Prediction or training.
    pub kind: JobKind,
    /// `owner/name` of the model.
    pub model: String,
    /// The model version id.
    pub version: String,
    /// The deployment it was created through, if any.
    pub deployment: Option<String>,
    /// The account that created it.
    pub account: String,
    /// The input object.
    pub input: Value,
    /// The output (a list of tokens for language models).
    pub output: Option<Value>,
    /// Log text.
    pub logs: String,
    /// Why it failed.
    pub error: Option<String>,
    /// Where it is.
    pub status: Status,
    /// Creation time (ms since the Unix epoch).
    pub created_at: Millis,
    /// Start time.
    pub started_at: Option<Millis>,
    /// End time.
    pub completed_at: Option<Millis>,
    /// The per-prediction deadline (`Cancel-After`).
    pub deadline: Option<Millis>,
    /// The model lifetime deadline.
    pub lifetime_deadline: Option<Millis>,
    /// Webhook URL.
    pub webhook: Option<String>,
    /// Events sent to it.
    pub webhook_events: Filter,
    /// Whether the client asked for streaming.
    pub stream: bool,
    /// A training's destination model.
    pub destination: Option<String>,
    /// Input, output and logs were removed after the retention period.
    pub data_removed: bool,
}

/// How a status is shown to a client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusView {
    /// Every status as it is.
    Exact,
    /// For clients that reject `aborted` (the stable `replicate` Python
    /// client 1.0.x validates the status against the five it knows):
    /// `aborted` shows as `canceled`; the `error` still says it was aborted.
    NoAborted,
}

impl StatusView {
    /// The view for a request with this `User-Agent`.
    pub fn for_user_agent(ua: Option<&str>) -> StatusView {
        match ua.and_then(|ua| ua.strip_prefix("replicate-python/")) {
            Some(v) if v.starts_with("0.") || v.starts_with("1.") => StatusView::NoAborted,
            _ => StatusView::Exact,
        }
    }

    fn show(self, s: Status) -> Status {
        match (self, s) {
            (StatusView::NoAborted, Status::Aborted) => Status::Canceled,
            _ => s,
        }
    }
}

impl Record {
    /// A new prediction of `model` (version `version`) for `account`, as
    /// created at `created_at` with `deadlines`: status `starting`, no
    /// webhook, nothing run yet.
    pub fn starting(
        id: String,
        model: &str,
        version: &str,
        account: &str,
        input: Value,
        created_at: Millis,
        deadlines: crate::lifecycle::Deadlines,
    ) -> Self {
        Record {
            seq: 0,
            id,
            kind: JobKind::Prediction,
            model: model.to_owned(),
            version: version.to_owned(),
            deployment: None,
            account: account.to_owned(),
            input,
            output: None,
            logs: String::new(),
            error: None,
            status: Status::Starting,
            created_at,
            started_at: None,
            completed_at: None,
            deadline: deadlines.per_prediction,
            lifetime_deadline: deadlines.lifetime,
            webhook: None,
            webhook_events: Filter::ALL,
            stream: false,
            destination: None,
            data_removed: false,
        }
    }

    /// The API object, with URLs under `base` (`http://host:port`).
    pub fn to_json(&self, base: &str, view: StatusView) -> Value {
        let get = format!("{base}/v1/predictions/{}", self.id);
        let predict_time = match (self.started_at, self.completed_at) {
            (Some(s), Some(c)) => Some(c.saturating_sub(s) as f64 / 1000.0),
            _ => None,
        };
        let total_time = self.completed_at.map(|c| c.saturating_sub(self.created_at) as f64 / 1000.0);
        let mut metrics = serde_json::Map::new();
        if let Some(p) = predict_time {
            metrics.insert("predict_time".into(), json!(p));
        }
        if let Some(t) = total_time {
            metrics.insert("total_time".into(), json!(t));
        }
        if let Some(Value::Array(tokens)) = &self.output {
            metrics.insert("output_token_count".into(), json!(tokens.len()));
        }
        let mut v = json!({
            "id": self.id,
            "model": self.model,
            "version": self.version,
            "input": if self.data_removed { Value::Null } else { self.input.clone() },
            "output": if self.data_removed { Value::Null } else { self.output.clone().unwrap_or(Value::Null) },
            "logs": if self.data_removed { Value::Null } else { json!(self.logs) },
            "error": self.error,
            "status": view.show(self.status).as_str(),
            "source": "api",
            "created_at": rfc3339(self.created_at),
            "started_at": self.started_at.map(rfc3339),
            "completed_at": self.completed_at.map(rfc3339),
            "urls": {
                "get": get,
                "cancel": format!("{get}/cancel"),
                "stream": format!("{base}/v1/predictions/{}/stream", self.id),
                "web": format!("{base}/p/{}", self.id),
            },
            "metrics": metrics,
            "deadline": self.deadline.map(rfc3339),
            "data_removed": self.data_removed,
        });
        if let Some(d) = &self.deployment {
            v["deployment"] = json!(d);
        }
        if let Some(w) = &self.webhook {
            v["webhook"] = json!(w);
            let events: Vec<&str> = self.webhook_events.events().iter().map(|e| e.as_str()).collect();
            v["webhook_events_filter"] = json!(events);
        }
        if self.kind == JobKind::Training {
            v["destination"] = json!(self.destination);
            v["urls"]["get"] = json!(format!("{base}/v1/trainings/{}", self.id));
            v["urls"]["cancel"] = json!(format!("{base}/v1/trainings/{}/cancel", self.id));
        }
        v
    }
}

/// `ms` since the Unix epoch as an RFC 3339 UTC timestamp with
/// microseconds, as Replicate writes them (`2026-11-22T20:43:18.123000Z`).
pub fn rfc3339(ms: Millis) -> String {
    let secs = ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}000Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

/// Howard Hinnant's `civil_from_days`: the date `days` after 1970-01-01.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000000Z");
        assert_eq!(rfc3339(1_795_380_198_123), "2026-11-22T20:43:18.123000Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00.000000Z");
    }

    #[test]
    fn status_view_by_client() {
        assert_eq!(StatusView::for_user_agent(Some("replicate-python/1.0.7")), StatusView::NoAborted);
        assert_eq!(StatusView::for_user_agent(Some("replicate-python/2.0.0")), StatusView::Exact);
        assert_eq!(StatusView::for_user_agent(Some("curl/8")), StatusView::Exact);
        assert_eq!(StatusView::NoAborted.show(Status::Aborted), Status::Canceled);
        assert_eq!(StatusView::NoAborted.show(Status::Failed), Status::Failed);
    }
}
