//! The `[predictions]` settings of `hangar serve` and each model's
//! `predictions` settings.

use serde::{Deserialize, Serialize};

use hangar_core::FieldError;
use hangar_redis::tls::CaFile;

use crate::lifecycle::{Limits, DEFAULT_MAX_RUN_LIFETIME, DEFAULT_PREDICT_TIMEOUT, DEFAULT_TRAIN_TIMEOUT};
use crate::webhook_policy::Retry;
use crate::webhook_target::AllowList;

/// The longest run duration accepted (`max_run_lifetime_s`,
/// `predict_timeout_s`, `train_timeout_s`): 30 days. Far below anything
/// that could overflow `Millis` or `Instant` arithmetic.
pub const MAX_RUN_S: u64 = 30 * 86_400;
/// The longest `retention_s`: 365 days.
pub const MAX_RETENTION_S: u64 = 365 * 86_400;
/// `lease_s` bounds: 1 s to 1 h (the heartbeat is a third of it).
pub const LEASE_S: std::ops::RangeInclusive<u64> = 1..=3600;
/// `async_slots` bounds.
pub const ASYNC_SLOTS: std::ops::RangeInclusive<u32> = 1..=1024;
/// The smallest `webhook_retry_base_ms`: 100 ms, so a failing receiver
/// gets at most ten attempts a second of one webhook.
pub const MIN_RETRY_BASE_MS: u64 = 100;
/// The largest `webhook_retry_cap_ms` (and base): 1 h.
pub const MAX_RETRY_CAP_MS: u64 = 3_600_000;
/// `webhook_max_attempts` bounds.
pub const MAX_ATTEMPTS: std::ops::RangeInclusive<u32> = 1..=50;
/// The longest `webhook_secret_grace_s`: 7 days.
pub const MAX_SECRET_GRACE_S: u64 = 7 * 86_400;
/// The most `durable_replicas`.
pub const MAX_DURABLE_REPLICAS: u32 = 16;
/// The longest `queue_request_wait_ms`: 60 s, the longest `Prefer: wait`.
pub const MAX_QUEUE_REQUEST_WAIT_MS: u64 = 60_000;

/// Server-wide predictions settings. Every field has a default.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PredictionsConfig {
    /// Base of the URLs in prediction objects and webhooks
    /// (`urls.get`, `urls.stream`); default: the address the server
    /// listens on.
    #[serde(default)]
    pub public_url: Option<String>,
    /// Seconds after its end that a prediction's input, output and logs
    /// are kept (then `data_removed: true`). Default 3600.
    #[serde(default = "default_retention")]
    pub retention_s: u64,
    /// Seconds a worker's claim on a queued prediction lasts without a
    /// heartbeat. Default 30.
    #[serde(default = "default_lease")]
    pub lease_s: u64,
    /// Predictions of one model that may be admitted or running at once
    /// (the async class's share of the model's line). Default 4.
    #[serde(default = "default_slots")]
    pub async_slots: u32,
    /// Webhook retry back-off: first delay in ms (default 1000).
    #[serde(default = "default_retry_base")]
    pub webhook_retry_base_ms: u64,
    /// Largest delay in ms (default 60000).
    #[serde(default = "default_retry_cap")]
    pub webhook_retry_cap_ms: u64,
    /// Attempts before a webhook is given up (default 12).
    #[serde(default = "default_retry_attempts")]
    pub webhook_max_attempts: u32,
    /// What webhooks may reach beyond public addresses: CIDRs
    /// (`127.0.0.0/8`, `::1/128`, a bare address), host names
    /// (`hooks.example.com`) and `*.example.com` (every name under it).
    /// Default: nothing (see [`crate::webhook_target`]).
    #[serde(default)]
    pub webhook_allow: Vec<String>,
    /// A PEM file (absolute path) of CAs that `https` webhook receivers'
    /// certificates may chain to, in addition to the default roots (the
    /// Mozilla CAs; see [`hangar_redis::tls`]). Read and checked at load.
    /// Default: none.
    #[serde(default)]
    pub webhook_ca_file: Option<std::path::PathBuf>,
    /// The HTTP proxy webhooks and procedure sources go through, for a
    /// network whose only way out is one (`http://proxy.corp:3128`;
    /// credentials in the URL are sent to it). Every destination is still
    /// checked, resolved and vetted before the send
    /// ([`crate::webhook_target::Outbound::check`]). Default: none — and
    /// never the environment's `HTTP_PROXY`.
    #[serde(default)]
    pub webhook_proxy: Option<String>,
    /// Seconds a rotated-out webhook signing secret stays valid (webhooks
    /// carry both signatures meanwhile). Default 86400.
    #[serde(default = "default_secret_grace")]
    pub webhook_secret_grace_s: u64,
    /// Named deployments (`POST /v1/deployments/{owner}/{name}/predictions`).
    #[serde(default)]
    pub deployments: Vec<Deployment>,
    /// How long a request queued in Workers AI's async mode
    /// (`options.queueRequest`) is waited for before the client is told
    /// `202` and its `request_id`: one that ends sooner is answered `200`
    /// with its answer at once (docs/serve.md). 0 to 60,000 ms; default
    /// 1000.
    #[serde(default = "default_queue_request_wait")]
    pub queue_request_wait_ms: u64,
    /// On a Redis store: how many of Redis's replicas must hold a create
    /// before it is answered (`WAIT`, up to a second; else 503 with
    /// `Retry-After`, to be repeated under an `Idempotency-Key`), so that
    /// a failover never loses an acknowledged prediction. 0 to
    /// [`MAX_DURABLE_REPLICAS`]; default 0, the primary's word (docs/cluster.md).
    #[serde(default)]
    pub durable_replicas: u32,
    /// `[predictions.procedures]`: procedures, run on the runtime model it
    /// names (docs/predictions.md). Default: off.
    #[serde(default)]
    pub procedures: crate::procedures::ProceduresConfig,
}

/// A deployment: a name bound to a model, with its own settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Deployment {
    /// `owner/name` of the deployment.
    pub name: String,
    /// The model it runs.
    pub model: String,
    /// Its own limits (default: the model's).
    #[serde(default)]
    pub settings: Option<ModelSettings>,
}

/// A model's predictions settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSettings {
    /// Seconds from creation a prediction may live, queue time included
    /// (default 86400; 0 disables).
    #[serde(default = "default_lifetime")]
    pub max_run_lifetime_s: u64,
    /// Seconds a prediction may run once started (default 1800).
    #[serde(default = "default_predict_timeout")]
    pub predict_timeout_s: u64,
    /// Seconds a training may run (default 86400).
    #[serde(default = "default_train_timeout")]
    pub train_timeout_s: u64,
    /// Whether a prediction interrupted by a crash may run again
    /// (re-queued on restart instead of failed).
    #[serde(default)]
    pub idempotent: bool,
}

impl Default for ModelSettings {
    fn default() -> Self {
        ModelSettings {
            max_run_lifetime_s: default_lifetime(),
            predict_timeout_s: default_predict_timeout(),
            train_timeout_s: default_train_timeout(),
            idempotent: false,
        }
    }
}

impl ModelSettings {
    /// Refuses durations over [`MAX_RUN_S`] (30 days). 0 keeps its
    /// meaning: no lifetime, the default predict timeout, a training
    /// bounded by the predict timeout alone. Field paths are relative to
    /// the settings table (`predict_timeout_s`).
    pub fn validate(&self) -> Result<(), FieldError> {
        for (field, value) in [
            ("max_run_lifetime_s", self.max_run_lifetime_s),
            ("predict_timeout_s", self.predict_timeout_s),
            ("train_timeout_s", self.train_timeout_s),
        ] {
            if value > MAX_RUN_S {
                return Err(FieldError::new(
                    field,
                    format!("{value} s is over the limit of {MAX_RUN_S} s (30 days)"),
                ));
            }
        }
        Ok(())
    }

    /// The limits of a prediction (`training: false`) or training. A
    /// training's run timeout is the larger of the two, as Replicate's.
    pub fn limits(&self, training: bool) -> Limits {
        let predict = self.predict_timeout_s.saturating_mul(1000);
        Limits {
            max_run_lifetime: self.max_run_lifetime_s.saturating_mul(1000),
            predict_timeout: if training {
                predict.max(self.train_timeout_s.saturating_mul(1000))
            } else {
                predict
            },
        }
    }
}

impl Default for PredictionsConfig {
    fn default() -> Self {
        serde_json::from_str("{}").expect("every field has a default")
    }
}

impl PredictionsConfig {
    /// Refuses values that parse but must not run (bounds in
    /// docs/predictions.md and the constants of this module). Field
    /// paths are relative to the `[predictions]` table:
    /// `webhook_retry_base_ms`, `webhook_allow[0]`,
    /// `deployments[1].settings.predict_timeout_s`.
    pub fn validate(&self) -> Result<(), FieldError> {
        let err = FieldError::new;
        if let Some(url) = &self.public_url {
            let ok = url::Url::parse(url).is_ok_and(|u| {
                matches!(u.scheme(), "http" | "https")
                    && u.has_host()
                    && u.username().is_empty()
                    && u.password().is_none()
                    && u.query().is_none()
                    && u.fragment().is_none()
            });
            if !ok {
                return Err(err(
                    "public_url",
                    format!("`{url}` is not an http(s) URL without credentials, query or fragment"),
                ));
            }
        }
        if self.retention_s > MAX_RETENTION_S {
            return Err(err(
                "retention_s",
                format!("{} s is over the limit of {MAX_RETENTION_S} s (365 days)", self.retention_s),
            ));
        }
        if !LEASE_S.contains(&self.lease_s) {
            return Err(err("lease_s", format!("{} s is outside 1 to 3600 s", self.lease_s)));
        }
        if self.durable_replicas > MAX_DURABLE_REPLICAS {
            return Err(err(
                "durable_replicas",
                format!("{} is over the limit of {MAX_DURABLE_REPLICAS}", self.durable_replicas),
            ));
        }
        if !ASYNC_SLOTS.contains(&self.async_slots) {
            return Err(err("async_slots", format!("{} is outside 1 to 1024", self.async_slots)));
        }
        let (base, cap) = (self.webhook_retry_base_ms, self.webhook_retry_cap_ms);
        if !(MIN_RETRY_BASE_MS..=MAX_RETRY_CAP_MS).contains(&base) {
            return Err(err(
                "webhook_retry_base_ms",
                format!(
                    "{base} ms is outside {MIN_RETRY_BASE_MS} to {MAX_RETRY_CAP_MS} ms: \
                     a shorter first delay floods a failing receiver"
                ),
            ));
        }
        if !(base..=MAX_RETRY_CAP_MS).contains(&cap) {
            return Err(err(
                "webhook_retry_cap_ms",
                format!("{cap} ms is outside webhook_retry_base_ms ({base}) to {MAX_RETRY_CAP_MS} ms"),
            ));
        }
        if !MAX_ATTEMPTS.contains(&self.webhook_max_attempts) {
            return Err(err(
                "webhook_max_attempts",
                format!("{} is outside 1 to 50", self.webhook_max_attempts),
            ));
        }
        if self.webhook_secret_grace_s > MAX_SECRET_GRACE_S {
            return Err(err(
                "webhook_secret_grace_s",
                format!(
                    "{} s is over the limit of {MAX_SECRET_GRACE_S} s (7 days)",
                    self.webhook_secret_grace_s
                ),
            ));
        }
        if self.queue_request_wait_ms > MAX_QUEUE_REQUEST_WAIT_MS {
            return Err(err(
                "queue_request_wait_ms",
                format!(
                    "{} ms is over the limit of {MAX_QUEUE_REQUEST_WAIT_MS} ms (60 s): a client told to \
                     wait longer should poll instead",
                    self.queue_request_wait_ms
                ),
            ));
        }
        AllowList::parse(&self.webhook_allow).map_err(|e| e.within("webhook_allow"))?;
        self.procedures.validate().map_err(|e| e.within("procedures"))?;
        self.webhook_ca()?;
        self.webhook_proxy()?;
        let mut names = std::collections::HashSet::new();
        for (i, d) in self.deployments.iter().enumerate() {
            let at = format!("deployments[{i}]");
            let owner_name = d.name.split_once('/').is_some_and(|(o, n)| {
                !o.is_empty()
                    && !n.is_empty()
                    && !n.contains('/')
                    && d.name.parse::<hangar_core::ModelKey>().is_ok()
            });
            if !owner_name {
                return Err(err("name", format!("`{}` is not `owner/name`", d.name)).within(&at));
            }
            if !names.insert(d.name.as_str()) {
                return Err(
                    err("name", format!("`{}` names an earlier deployment again", d.name)).within(&at)
                );
            }
            if d.model.is_empty() {
                return Err(FieldError::new("model", "is empty").within(&at));
            }
            if let Some(settings) = &d.settings {
                settings.validate().map_err(|e| e.within(&format!("{at}.settings")))?;
            }
        }
        Ok(())
    }

    /// The CAs of `webhook_ca_file`, read and checked, if it is set.
    pub fn webhook_ca(&self) -> Result<Option<CaFile>, FieldError> {
        let Some(path) = &self.webhook_ca_file else { return Ok(None) };
        CaFile::load(path).map(Some).map_err(|e| FieldError::new("webhook_ca_file", e.to_string()))
    }

    /// `webhook_proxy`, parsed and checked, if it is set.
    pub fn webhook_proxy(&self) -> Result<Option<url::Url>, FieldError> {
        let Some(proxy) = &self.webhook_proxy else { return Ok(None) };
        let bad = |why: &str| FieldError::new("webhook_proxy", format!("`{proxy}` {why}"));
        let url = url::Url::parse(proxy).map_err(|e| bad(&format!("is not a URL: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(bad("must be an http:// or https:// proxy URL"));
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(bad("names no host"));
        }
        Ok(Some(url))
    }

    /// The webhook back-off.
    pub fn retry(&self) -> Retry {
        Retry {
            base_ms: self.webhook_retry_base_ms.max(1),
            cap_ms: self.webhook_retry_cap_ms.max(1),
            max_attempts: self.webhook_max_attempts.max(1),
        }
    }
}

fn default_retention() -> u64 {
    3600
}
fn default_lease() -> u64 {
    30
}
fn default_slots() -> u32 {
    4
}
fn default_retry_base() -> u64 {
    1000
}
fn default_retry_cap() -> u64 {
    60_000
}
fn default_retry_attempts() -> u32 {
    12
}
fn default_secret_grace() -> u64 {
    86_400
}
fn default_queue_request_wait() -> u64 {
    1000
}
fn default_lifetime() -> u64 {
    DEFAULT_MAX_RUN_LIFETIME / 1000
}
fn default_predict_timeout() -> u64 {
    DEFAULT_PREDICT_TIMEOUT / 1000
}
fn default_train_timeout() -> u64 {
    DEFAULT_TRAIN_TIMEOUT / 1000
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn defaults_and_training_limits() {
        let c = PredictionsConfig::default();
        assert_eq!((c.retention_s, c.lease_s, c.async_slots), (3600, 30, 4));
        let m = ModelSettings::default();
        assert_eq!(m.limits(false), Limits { max_run_lifetime: 86_400_000, predict_timeout: 1_800_000 });
        // A training runs up to the larger of the two timeouts.
        assert_eq!(m.limits(true).predict_timeout, 86_400_000);
        let e = serde_json::from_str::<ModelSettings>(r#"{"idempotnt": true}"#).unwrap_err();
        assert!(e.to_string().contains("idempotnt"), "{e}");
        assert_eq!(c.webhook_secret_grace_s, 86_400);
        assert!(c.webhook_allow.is_empty());
        assert_eq!(c.validate(), Ok(()), "the defaults are valid");
    }

    #[test]
    fn a_webhook_ca_file_is_read_at_load_and_a_bad_one_is_named_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("hooks-ca.pem");
        hangar_redis::tls::TestCa::new("hooks CA").write(&good).unwrap();
        let c = config(json!({"webhook_ca_file": good}));
        assert_eq!(c.validate(), Ok(()));
        assert_eq!(c.webhook_ca().unwrap().unwrap().certificates().len(), 1);
        let missing = dir.path().join("missing.pem");
        let not_pem = dir.path().join("not.pem");
        std::fs::write(&not_pem, "hello").unwrap();
        for (path, says) in [
            (missing.clone(), "cannot read the CA file"),
            (not_pem.clone(), "holds no PEM certificate"),
            ("hooks-ca.pem".into(), "relative path"),
        ] {
            let e = config(json!({"webhook_ca_file": path})).validate().unwrap_err();
            assert_eq!(e.field, "webhook_ca_file", "{e}");
            assert!(e.message.contains(says) && e.message.contains(&*path.to_string_lossy()), "{e}");
        }
    }

    fn config(toml_json: serde_json::Value) -> PredictionsConfig {
        serde_json::from_value(toml_json).unwrap()
    }

    /// The flood of issue 17: no first delay, no attempt limit.
    #[test]
    fn retry_settings_that_could_flood_are_refused() {
        for (c, field) in [
            (json!({"webhook_retry_base_ms": 0, "webhook_max_attempts": 1000000}), "webhook_retry_base_ms"),
            (json!({"webhook_retry_base_ms": 99}), "webhook_retry_base_ms"),
            (
                json!({"webhook_retry_base_ms": 3_600_001, "webhook_retry_cap_ms": 3_600_001}),
                "webhook_retry_base_ms",
            ),
            (json!({"webhook_retry_base_ms": 1000, "webhook_retry_cap_ms": 999}), "webhook_retry_cap_ms"),
            (json!({"webhook_retry_cap_ms": 3_600_001}), "webhook_retry_cap_ms"),
            (json!({"webhook_max_attempts": 0}), "webhook_max_attempts"),
            (json!({"webhook_max_attempts": 51}), "webhook_max_attempts"),
            (json!({"webhook_secret_grace_s": 604_801}), "webhook_secret_grace_s"),
        ] {
            let e = config(c.clone()).validate().unwrap_err();
            assert_eq!(e.field, field, "{c}: {e}");
        }
        for ok in [
            json!({"webhook_retry_base_ms": 100, "webhook_retry_cap_ms": 100, "webhook_max_attempts": 1}),
            json!({
                "webhook_retry_base_ms": 3_600_000, "webhook_retry_cap_ms": 3_600_000, "webhook_max_attempts": 50
            }),
            json!({"webhook_secret_grace_s": 0}),
        ] {
            assert_eq!(config(ok.clone()).validate(), Ok(()), "{ok}");
        }
    }

    #[test]
    fn durations_out_of_bounds_are_refused_and_zero_keeps_its_meaning() {
        for (c, field) in [
            (json!({"lease_s": 0}), "lease_s"),
            (json!({"lease_s": 3601}), "lease_s"),
            (json!({"retention_s": 365 * 86_400 + 1}), "retention_s"),
            (json!({"async_slots": 0}), "async_slots"),
            (json!({"async_slots": 1025}), "async_slots"),
            (json!({"queue_request_wait_ms": 60_001}), "queue_request_wait_ms"),
        ] {
            assert_eq!(config(c.clone()).validate().unwrap_err().field, field, "{c}");
        }
        assert_eq!(config(json!({"retention_s": 0})).validate(), Ok(()));
        assert_eq!(PredictionsConfig::default().queue_request_wait_ms, 1000);
        for wait in [0, 60_000] {
            assert_eq!(config(json!({"queue_request_wait_ms": wait})).validate(), Ok(()), "{wait} ms");
        }
        let max = ModelSettings {
            max_run_lifetime_s: MAX_RUN_S,
            predict_timeout_s: MAX_RUN_S,
            train_timeout_s: MAX_RUN_S,
            idempotent: false,
        };
        assert_eq!(max.validate(), Ok(()));
        let zero = ModelSettings {
            max_run_lifetime_s: 0,
            predict_timeout_s: 0,
            train_timeout_s: 0,
            idempotent: false,
        };
        assert_eq!(zero.validate(), Ok(()));
        for field in ["max_run_lifetime_s", "predict_timeout_s", "train_timeout_s"] {
            let mut s = serde_json::to_value(ModelSettings::default()).unwrap();
            s[field] = json!(MAX_RUN_S + 1);
            let e = serde_json::from_value::<ModelSettings>(s).unwrap().validate().unwrap_err();
            assert_eq!(e.field, field);
        }
        // u64::MAX seconds would overflow the milliseconds of `limits`.
        let huge = ModelSettings { predict_timeout_s: u64::MAX, ..ModelSettings::default() };
        assert_eq!(huge.validate().unwrap_err().field, "predict_timeout_s");
    }

    #[test]
    fn public_url_allow_list_and_deployments_are_checked_with_their_paths() {
        for (c, field) in [
            (json!({"public_url": "ftp://example.com"}), "public_url".to_owned()),
            (json!({"public_url": "not a url"}), "public_url".to_owned()),
            (json!({"public_url": "https://u:p@example.com"}), "public_url".to_owned()),
            (json!({"webhook_allow": ["127.0.0.0/8", "10.0.0.0/40"]}), "webhook_allow[1]".to_owned()),
            (json!({"webhook_allow": ["hooks example"]}), "webhook_allow[0]".to_owned()),
            (
                json!({"deployments": [{"name": "a/b", "model": "m/x"}, {"name": "ab", "model": "m/x"}]}),
                "deployments[1].name".to_owned(),
            ),
            (json!({"deployments": [{"name": "a/b/c", "model": "m/x"}]}), "deployments[0].name".to_owned()),
            (json!({"deployments": [{"name": "/b", "model": "m/x"}]}), "deployments[0].name".to_owned()),
            (json!({"deployments": [{"name": "a b/c", "model": "m/x"}]}), "deployments[0].name".to_owned()),
            (
                json!({"deployments": [{"name": "a/b", "model": "m/x"}, {"name": "a/b", "model": "m/y"}]}),
                "deployments[1].name".to_owned(),
            ),
            (
                json!({"deployments": [
                    {"name": "a/b", "model": "m/x"},
                    {"name": "a/c", "model": "m/x", "settings": {"predict_timeout_s": 2_600_000}},
                ]}),
                "deployments[1].settings.predict_timeout_s".to_owned(),
            ),
        ] {
            let e = config(c.clone()).validate().unwrap_err();
            assert_eq!(e.field, field, "{c}: {e}");
        }
        let ok = json!({
            "public_url": "https://api.example.com/base",
            "webhook_allow": [
                "127.0.0.0/8", "::1/128", "10.1.2.3", "hooks.example.com", "*.corp.example.com"
            ],
            "deployments": [
                {"name": "acme/chat-prod", "model": "demo/chat-small", "settings": {"max_run_lifetime_s": 0}}
            ],
        });
        assert_eq!(config(ok).validate(), Ok(()));
    }
}
