//! `hangar serve`'s configuration file.

use std::time::Duration;

use hangar_core::{AccountId, ByteSize, ModelKey};
use hangar_placement::{ClusterConfig, ModelSpec, NodeConfig, ParamCount, PlacementConfig};
use hangar_queue::AdmissionConfig;
use serde::{Deserialize, Serialize};

use crate::engine::EngineSpec;

/// The whole file. Every field has a default except `nodes` and `models`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeConfig {
    /// Address the gateway listens on (port 0: any free port).
    #[serde(default = "default_listen")]
    pub listen: String,
    /// Largest request body accepted (413 beyond).
    #[serde(default = "default_body")]
    pub max_body_bytes: ByteSize,
    /// Seed of the placement policy's random choices.
    #[serde(default)]
    pub seed: u64,
    /// Placement knobs.
    #[serde(default)]
    pub placement: PlacementConfig,
    /// The fleet (this release runs one node: the machine itself).
    pub nodes: Vec<NodeConfig>,
    /// The models served.
    pub models: Vec<ModelConfig>,
    /// API keys. With none, the gateway is open and every request is the
    /// account `anonymous`; with some, a request must carry one as
    /// `Authorization: Bearer KEY` (401 otherwise).
    #[serde(default)]
    pub api_keys: Vec<ApiKey>,
    /// Where durable state lives (the predictions database). Relative
    /// paths are resolved against the configuration file's directory;
    /// default: `hangar-data` beside the file (or the user's data
    /// directory for the built-in demo).
    #[serde(default)]
    pub data_dir: Option<std::path::PathBuf>,
    /// Async predictions settings (docs/predictions.md).
    #[serde(default)]
    pub predictions: hangar_predictions::PredictionsConfig,
}

/// One API key and the account it stands for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKey {
    /// The secret clients send.
    pub key: String,
    /// The account its requests count against (fair queuing, access).
    pub account: AccountId,
}

/// One served model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The key clients put in `model`.
    pub key: ModelKey,
    /// What runs its replicas.
    pub engine: EngineSpec,
    /// Footprint in GPU memory (or give `parameters`).
    #[serde(default)]
    pub size: Option<ByteSize>,
    /// Parameter count, to estimate the footprint (bf16 + 15 %).
    #[serde(default)]
    pub parameters: Option<ParamCount>,
    /// Replicas started with the server and kept (0: start on first request).
    #[serde(default)]
    pub min_replicas: u32,
    /// Concurrent requests per replica (permits).
    #[serde(default = "default_concurrency")]
    pub concurrency: u32,
    /// The waiting line.
    #[serde(default)]
    pub queue: AdmissionConfig,
    /// Seconds a request may wait for a replica before 504.
    #[serde(default = "default_timeout")]
    pub timeout_s: u64,
    /// How a request's replica is chosen among those with a free permit.
    #[serde(default)]
    pub router: ReplicaRouting,
    /// Accounts allowed to use the model (default: every account; a
    /// request of another account gets 403).
    #[serde(default)]
    pub access: Option<Vec<AccountId>>,
    /// Async predictions limits: `max_run_lifetime_s`, `predict_timeout_s`,
    /// `idempotent` (docs/predictions.md).
    #[serde(default)]
    pub predictions: hangar_predictions::ModelSettings,
}

/// How the replica for a request is chosen among those with a free permit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ReplicaRouting {
    /// The replica with the fewest requests in flight.
    #[default]
    LeastOutstanding,
    /// Replicas in turn.
    RoundRobin,
}

impl ReplicaRouting {
    /// The chooser implementing it.
    pub fn chooser(self) -> Box<dyn hangar_queue::Chooser + Send> {
        match self {
            Self::LeastOutstanding => Box::new(hangar_queue::LeastOutstanding),
            Self::RoundRobin => Box::new(hangar_queue::RoundRobin::default()),
        }
    }
}

fn default_listen() -> String {
    "127.0.0.1:8080".into()
}

fn default_body() -> ByteSize {
    ByteSize::new(16 << 20)
}

fn default_concurrency() -> u32 {
    8
}

fn default_timeout() -> u64 {
    60
}

impl ModelConfig {
    /// How long a request may wait.
    pub fn timeout(&self) -> Duration {
        Duration::from_secs(self.timeout_s)
    }
}

impl ServeConfig {
    /// The built-in demo: one node with two virtual 80 GB GPUs and two mock
    /// chat models, the small one started at once, the large one on its
    /// first request.
    pub fn demo() -> Self {
        toml::from_str(DEMO).expect("the built-in demo configuration parses")
    }

    /// The placement policy's view: nodes and model sizes.
    pub fn cluster(&self) -> ClusterConfig {
        ClusterConfig {
            placement: self.placement.clone(),
            nodes: self.nodes.clone(),
            models: self
                .models
                .iter()
                .map(|m| {
                    (
                        m.key.clone(),
                        ModelSpec { size: m.size, parameters: m.parameters, dtype: None, padding: None },
                    )
                })
                .collect(),
        }
    }
}

/// The demo, as a user would write it.
pub const DEMO: &str = r#"
listen = "127.0.0.1:8080"

[[nodes]]
id = "local"
gpus = 2
gpu_memory = "80GB"
virtual_gpus = true
cpu_cache = "64GB"

[[models]]
key = "demo/chat-small"
engine = { kind = "mock", preset = "fast" }
size = "16GB"
min_replicas = 1
concurrency = 8

[[models]]
key = "demo/chat-large"
engine = { kind = "mock", preset = "default", startup_delay_ms = 500 }
size = "60GB"
concurrency = 4
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_demo_and_the_documented_example_parse() {
        let demo = ServeConfig::demo();
        assert_eq!(demo.models.len(), 2);
        assert_eq!(demo.listen, "127.0.0.1:8080");
        let doc = include_str!("../../../../docs/config.md");
        let example = doc.split("```toml").nth(1).and_then(|s| s.split("```").next()).expect("an example");
        let parsed: ServeConfig = toml::from_str(example).unwrap();
        assert_eq!(parsed.models, demo.models);
        assert_eq!(parsed.max_body_bytes.bytes(), 16 << 20);
    }

    #[test]
    fn errors_name_the_field() {
        let e =
            toml::from_str::<ServeConfig>("nodes = []\n[[models]]\nkey = \"m\"\nengin = 1\n").unwrap_err();
        assert!(e.to_string().contains("engin"), "{e}");
        let e = toml::from_str::<ServeConfig>("nodes = []\nmodels = []\nlisten = 5\n").unwrap_err();
        assert!(e.to_string().contains("listen"), "{e}");
        let e = toml::from_str::<ServeConfig>(
            "nodes = []\n[[models]]\nkey = \"m\"\nengine = { kind = \"mock\" }\nrouter = \"random\"\n",
        )
        .unwrap_err();
        assert!(e.to_string().contains("random") && e.to_string().contains("round_robin"), "{e}");
    }
}
