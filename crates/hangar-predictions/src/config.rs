//! The `[predictions]` settings of `hangar serve` and each model's
//! `predictions` settings.

use serde::{Deserialize, Serialize};

use crate::lifecycle::{Limits, DEFAULT_MAX_RUN_LIFETIME, DEFAULT_PREDICT_TIMEOUT, DEFAULT_TRAIN_TIMEOUT};
use crate::webhook_policy::Retry;

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
    /// Named deployments (`POST /v1/deployments/{owner}/{name}/predictions`).
    #[serde(default)]
    pub deployments: Vec<Deployment>,
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
    /// The limits of a prediction (`training: false`) or training. A
    /// training's run timeout is the larger of the two, as Replicate's.
    pub fn limits(&self, training: bool) -> Limits {
        let predict = self.predict_timeout_s * 1000;
        Limits {
            max_run_lifetime: self.max_run_lifetime_s * 1000,
            predict_timeout: if training { predict.max(self.train_timeout_s * 1000) } else { predict },
        }
    }
}

impl Default for PredictionsConfig {
    fn default() -> Self {
        serde_json::from_str("{}").expect("every field has a default")
    }
}

impl PredictionsConfig {
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
    }
}
