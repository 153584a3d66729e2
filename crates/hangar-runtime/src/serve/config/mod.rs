//! `hangar serve`'s configuration file: the types ([`ServeConfig`] and
//! what it holds), the rules a parsed file must also meet ([`validate`]),
//! and loading with errors that name the file, line and field ([`load`]).

mod load;
mod trainers;
mod validate;

pub use load::ConfigError;
pub use trainers::trainer_key;
pub use validate::check_queue_capacity;
pub use validate::{MAX_DURATION_S, MAX_QUEUE_CAPACITY};

use std::time::{Duration, SystemTime};

use hangar_core::{AccountId, ByteSize, Millis, ModelKey};
use hangar_placement::{ClusterConfig, ModelSpec, NodeConfig, ParamCount, PlacementConfig};
use hangar_queue::{AdmissionConfig, QueueAlgorithm};
use hangar_router::{AdapterConfig, ApproxKvConfig, ReplicaChooser, RouterPolicy};
use hangar_scaler::{HangarSettings, ScalingConfig};
use serde::{Deserialize, Serialize};

use hangar_agent::engine::EngineSpec;
use hangar_agent::weights::{StoreSettings, WeightsSource};

/// The whole file. Every field has a default except `models` (and `nodes`
/// without `redis`).
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
    /// The least time any request is given, in seconds: a model's
    /// `timeout_s` can extend it, never shorten it.
    #[serde(default = "default_timeout_floor")]
    pub timeout_floor_s: u64,
    /// The most time any request is given, in seconds, whatever its model
    /// asks for.
    #[serde(default = "default_timeout_ceiling")]
    pub timeout_ceiling_s: u64,
    /// Placement knobs.
    #[serde(default)]
    pub placement: PlacementConfig,
    /// The machine's GPUs, as nodes. Left out in a fleet's file (with
    /// `redis`): the nodes are then the agents that register.
    #[serde(default)]
    pub nodes: Vec<NodeConfig>,
    /// The models served.
    pub models: Vec<ModelConfig>,
    /// API keys. With none, the gateway is open and every request is the
    /// account `anonymous`; with some, a request must carry one as
    /// `Authorization: Bearer KEY` (401 otherwise).
    #[serde(default)]
    pub api_keys: Vec<ApiKey>,
    /// A bearer key `GET /metrics` then requires (an admin API key also
    /// works). Its labels name every model, private ones included; default
    /// none: open, for a scraper on a trusted network.
    #[serde(default)]
    pub metrics_key: Option<String>,
    /// Where durable state lives (the predictions database). Relative
    /// paths are resolved against the configuration file's directory;
    /// default: `hangar-data` beside the file (or the user's data
    /// directory for the built-in demo).
    #[serde(default)]
    pub data_dir: Option<std::path::PathBuf>,
    /// The Redis a fleet of gateways shares (`redis://host:6379/0`,
    /// `unix:///run/redis.sock`): the predictions queue then lives there
    /// on Redis Streams, so a prediction created through one gateway is
    /// run, read and cancelled through any (docs/cluster.md). Default
    /// none: SQLite in `data_dir`, one machine.
    #[serde(default)]
    pub redis: Option<String>,
    /// Async predictions settings (docs/predictions.md).
    #[serde(default)]
    pub predictions: hangar_predictions::PredictionsConfig,
    /// Dedicated windows (seed 000): a model keeps `replicas` dedicated
    /// replicas from `start` until `end` (docs/serve.md).
    #[serde(default)]
    pub schedule: Vec<DedicatedWindow>,
    /// The node's weight store, for models with `weights`.
    #[serde(default)]
    pub store: StoreSettings,
    /// Where inference events go (docs/observability.md).
    #[serde(default)]
    pub events: crate::events::EventsConfig,
}

/// `[[schedule]]`: keep `replicas` dedicated replicas of `model` from
/// `start` until `end`, both RFC 3339 times in UTC
/// (`2026-11-24T18:00:00Z`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DedicatedWindow {
    /// The model.
    pub model: ModelKey,
    /// Dedicated replicas during the window (default 1).
    #[serde(default = "one")]
    pub replicas: u32,
    /// When the window opens.
    #[serde(with = "rfc3339")]
    pub start: SystemTime,
    /// When it closes.
    #[serde(with = "rfc3339")]
    pub end: SystemTime,
}

fn one() -> u32 {
    1
}

/// RFC 3339 times as strings.
mod rfc3339 {
    use std::time::SystemTime;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&humantime::format_rfc3339_seconds(*t))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SystemTime, D::Error> {
        let text = String::deserialize(d)?;
        humantime::parse_rfc3339_weak(&text).map_err(|e| {
            serde::de::Error::custom(format!(
                "`{text}` is not an RFC 3339 time such as 2026-11-24T18:00:00Z: {e}"
            ))
        })
    }
}

impl DedicatedWindow {
    /// The window on the server's clock, which reads `now_ms` at the wall
    /// time `wall`: `None` once it has ended (or when it is shorter than a
    /// millisecond); a window already open starts at `now_ms`.
    pub fn on_clock(&self, wall: SystemTime, now_ms: Millis) -> Option<hangar_placement::Window> {
        let at = |t: SystemTime| match t.duration_since(wall) {
            Ok(ahead) => now_ms.saturating_add(ahead.as_millis() as Millis),
            Err(_) => now_ms,
        };
        let (start_ms, end_ms) = (at(self.start), at(self.end));
        (end_ms > start_ms).then(|| hangar_placement::Window {
            model_key: self.model.clone(),
            replicas: self.replicas,
            start_ms,
            end_ms,
        })
    }
}

/// One API key and the account it stands for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKey {
    /// The secret clients send.
    pub key: String,
    /// The account its requests count against (fair queuing, access).
    pub account: AccountId,
    /// Whether the key may use the admin API (`/admin/...`).
    #[serde(default)]
    pub admin: bool,
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
    /// The hardware label its replicas need: only nodes whose `gpu_kind`
    /// is this (e.g. `a100-80gb`) take them.
    #[serde(default)]
    pub gpu_kind: Option<String>,
    /// The least memory each GPU of a node taking its replicas must have.
    #[serde(default)]
    pub min_gpu_memory: Option<ByteSize>,
    /// Replicas started with the server and kept (0: start on first request).
    #[serde(default)]
    pub min_replicas: u32,
    /// The most replicas demand may start (default: `min_replicas`, at
    /// least 1).
    #[serde(default)]
    pub max_replicas: Option<u32>,
    /// Concurrent requests per replica (permits).
    #[serde(default = "default_concurrency")]
    pub concurrency: u32,
    /// The waiting line.
    #[serde(default)]
    pub queue: QueueConfig,
    /// Seconds a request may take, waiting included, before 504 (0: the
    /// server's `timeout_floor_s`; always within the floor and ceiling).
    #[serde(default)]
    pub timeout_s: u64,
    /// The model's time-to-first-token objective, ms: the `hangar` scaling
    /// policy adds replicas while the recent p99 TTFT misses it under load,
    /// and gives none back while it does. Default: none.
    #[serde(default)]
    pub slo_ttft_ms: Option<u64>,
    /// How the model's replica count follows its load (docs/scaling.md):
    /// `[models.scaling] policy = "hangar" | "replicate" | "workers-ai" |
    /// "fixed"` and the policy's knobs. Default: `hangar`, whose quiet
    /// period is 300 s, or never for `external` engines (their life is not
    /// Hangar's to manage).
    #[serde(default)]
    pub scaling: Option<ScalingConfig>,
    /// How a request's replica is chosen among those with a free permit.
    #[serde(default)]
    pub router: RouterPolicy,
    /// Settings of the `kv` router.
    #[serde(default)]
    pub kv: ApproxKvConfig,
    /// Accounts allowed to use the model (default: every account; a
    /// request of another account gets 403).
    #[serde(default)]
    pub access: Option<Vec<AccountId>>,
    /// Async predictions limits: `max_run_lifetime_s`, `predict_timeout_s`,
    /// `idempotent` (docs/predictions.md).
    #[serde(default)]
    pub predictions: hangar_predictions::ModelSettings,
    /// The keep-alive connections requests are forwarded to its replicas on.
    #[serde(default)]
    pub connections: ConnectionPool,
    /// Its weights: `store:KEY` (an artifact of the weight store) or a
    /// file path (imported into the store on first use), materialized by
    /// the store before each replica starts and handed to the engine as
    /// `{weights}` (docs/store.md).
    #[serde(default)]
    pub weights: Option<WeightsSource>,
    /// How its usage is counted and priced: the trust flag, Replicate's
    /// prices, Workers AI's neurons (docs/observability.md).
    #[serde(default)]
    pub billing: crate::events::BillingConfig,
    /// Whether, and how, its engine takes WebSocket connections, which
    /// `GET /v1/ws?model=KEY` relays (docs/serve.md). Default: it does not.
    #[serde(default)]
    pub websocket: Option<WebSocketConfig>,
    /// Whether its replicas load LoRA adapters for requests that name one
    /// (`BASE:ADAPTER` or Workers AI's `lora`), and how many each holds:
    /// `[models.adapters]`, the fleet file's table (`slots`, `memory`,
    /// `default_size`, `request_ms`; docs/adapters.md). Default: it serves
    /// none.
    #[serde(default)]
    pub adapters: Option<AdapterConfig>,
    /// Which of the adapters registered under it in the weight store it
    /// serves, and to whom: `[[models.adapter_access]]` rules, each an
    /// adapter name or `prefix*` pattern and the accounts that may use
    /// those (default: every account that may use the model). Without
    /// rules it serves every adapter registered under it; with rules, only
    /// those some rule matches.
    #[serde(default)]
    pub adapter_access: Vec<AdapterAccess>,
    /// In the *hotswap tier* (seed 000's gate on which models may be
    /// swapped in on demand): it holds no replicas of its own
    /// (`min_replicas = 0`); placement swaps its replicas in by demand
    /// behind the models that do — they take its GPUs whatever its age,
    /// it never takes theirs, and it takes another hotswap model's only
    /// once that one is `placement.hotswap_min_age_ms` old — and a copy
    /// swapped out goes to the warm cache first, so the next swap in is a
    /// WARM wake. While an operator closes it (`PUT
    /// /admin/models/{key}/hotswap {"swappable": false}`), it is held at 0
    /// replicas and synchronous requests get 503 (docs/placement.md).
    #[serde(default)]
    pub hotswap: bool,
    /// Whether a request to its OpenAI routes may ask to be queued —
    /// Workers AI's async mode (seed 001, "Async Queue"): with this set, a
    /// body with `"options": {"queueRequest": true}` becomes a durable job
    /// in the model's prediction queue, answered `200` if it ends within
    /// `predictions.queue_request_wait_ms`, else `202` with a `request_id`
    /// to poll with (`"inputs": {"request_id": ID}`; docs/serve.md).
    /// Without it such a request is served synchronously, as every other.
    /// Default false. Left out of the serialized configuration while
    /// false, so a model's prediction version does not change for it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub use_async_queue: bool,
    /// On a *trainer* — the model Hangar derives from each cog model to
    /// run its trainings, `KEY/trainer` — the model it trains; never read
    /// from a file, and no client may name a trainer (docs/predictions.md,
    /// "Trainings").
    #[serde(skip)]
    pub trains: Option<ModelKey>,
}

/// One `[[models.adapter_access]]` rule: adapters by name or pattern, and
/// who may use them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdapterAccess {
    /// An adapter name (`acme/support-v2`), or a prefix ending in `*`
    /// (`acme/*`; `*` alone: every adapter).
    pub adapters: String,
    /// The accounts that may use them (default: every account that may use
    /// the model).
    #[serde(default)]
    pub accounts: Option<Vec<AccountId>>,
}

impl AdapterAccess {
    /// Whether the rule covers the adapter `name`.
    pub fn matches(&self, name: &str) -> bool {
        match self.adapters.strip_suffix('*') {
            Some(prefix) => name.starts_with(prefix),
            None => self.adapters == name,
        }
    }
}

/// A model whose engine speaks WebSocket: where, and the relay's limits
/// (seed 001: Workers AI's maximum connection duration).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WebSocketConfig {
    /// The engine's WebSocket path. Default `/v1/ws` (the mock engine's
    /// token stream).
    pub path: String,
    /// The longest a connection may last, seconds; then it is closed (code
    /// 1008). Default 600.
    pub max_duration_s: u64,
    /// The largest message either way; a larger one closes the connection
    /// (code 1009). Default 1 MiB.
    pub max_message_bytes: ByteSize,
}

impl Default for WebSocketConfig {
    fn default() -> Self {
        WebSocketConfig {
            path: "/v1/ws".to_owned(),
            max_duration_s: 600,
            max_message_bytes: ByteSize::new(1 << 20),
        }
    }
}

/// A model's pool of keep-alive connections to its replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConnectionPool {
    /// An idle connection is closed after this many ms. Keep it below the
    /// engine's own keep-alive timeout (llama.cpp's server and uvicorn
    /// close idle connections after 5 s), so Hangar closes a connection
    /// before the engine does rather than sending on one the engine is
    /// closing. 0: no connection is kept idle. Default 2000.
    pub idle_timeout_ms: u64,
    /// The most idle connections kept per replica. Default 64.
    pub max_idle: usize,
    /// A connection to a replica not made within this many ms fails, and
    /// the request is tried on another replica. On a working network a
    /// connection is made in well under a millisecond; a node cut off from
    /// the gateway answers nothing, and without this bound the request
    /// would wait out its deadline. Default 2000.
    pub connect_timeout_ms: u64,
    /// A connection whose replica's host has acknowledged nothing for this
    /// many ms is closed (the socket's `TCP_USER_TIMEOUT`; while an answer
    /// is silent, keep-alive probes go out every second for the host to
    /// acknowledge). A slow engine's host still acknowledges: only a host
    /// that is gone or cut off trips it, and the request, if nothing of
    /// its answer came yet, is tried on another replica. Default 5000.
    pub unacked_timeout_ms: u64,
}

impl Default for ConnectionPool {
    fn default() -> Self {
        ConnectionPool {
            idle_timeout_ms: 2_000,
            max_idle: 64,
            connect_timeout_ms: 2_000,
            unacked_timeout_ms: 5_000,
        }
    }
}

/// A model's waiting line as configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct QueueConfig {
    /// `fifo` or `fair`.
    pub algorithm: QueueAlgorithm,
    /// Requests that may wait (per account when fair), 1 to 1,000 (seed
    /// 001's bound; a larger value is refused). Default: 4 × the model's
    /// permits at `max_replicas`, at most 1,000.
    pub capacity: Option<usize>,
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

fn default_timeout_floor() -> u64 {
    30
}

fn default_timeout_ceiling() -> u64 {
    240
}

impl ModelConfig {
    /// The scaling policy and its knobs, the default resolved for the
    /// engine kind.
    pub fn scaling(&self) -> ScalingConfig {
        match (&self.scaling, &self.engine) {
            (Some(s), _) => s.clone(),
            (None, EngineSpec::External { .. }) => {
                ScalingConfig::Hangar(HangarSettings { scale_down_after_s: 0, ..HangarSettings::default() })
            }
            (None, _) => ScalingConfig::default(),
        }
    }

    /// The most replicas the model may have.
    pub fn max_replicas(&self) -> u32 {
        self.max_replicas.unwrap_or(self.min_replicas.max(1))
    }

    /// The chooser implementing `router`, with the model's adapter slots;
    /// `seed` fixes the router's tie-breaking.
    pub fn chooser(&self, seed: u64) -> Box<dyn crate::processor::ProcessorChooser> {
        let chooser = ReplicaChooser::new(self.router, &self.kv, seed);
        Box::new(match &self.adapters {
            Some(adapters) => chooser.with_adapters(adapters.clone()),
            None => chooser,
        })
    }

    /// Whether its `adapter_access` rules serve the adapter `name` to
    /// anyone (every adapter when it has none).
    pub fn serves_adapter(&self, name: &str) -> bool {
        self.adapter_access.is_empty() || self.adapter_access.iter().any(|r| r.matches(name))
    }

    /// Whether `account` may use the adapter `name` of this model (one it
    /// serves, by [`adapter_access`](Self::adapter_access)): `None` when the
    /// model does not serve it at all, else whether the account may.
    pub fn adapter_allowed(&self, name: &str, account: &AccountId) -> Option<bool> {
        let lets_in =
            |r: &AdapterAccess| r.matches(name) && r.accounts.as_ref().is_none_or(|a| a.contains(account));
        self.serves_adapter(name)
            .then(|| self.adapter_access.is_empty() || self.adapter_access.iter().any(lets_in))
    }

    /// Requests one replica serves at once: `concurrency`, but 1 for a
    /// `cog` engine (a cog server runs one prediction at a time).
    pub fn permits(&self) -> u32 {
        match self.engine.is_cog() {
            true => 1,
            false => self.concurrency,
        }
    }

    /// The admission settings, with the capacity resolved.
    pub fn admission(&self) -> AdmissionConfig {
        let permits = self.permits() as usize * self.max_replicas() as usize;
        let capacity = self.queue.capacity.unwrap_or(AdmissionConfig::default_capacity(permits));
        AdmissionConfig { algorithm: self.queue.algorithm, capacity }
    }
}

impl ServeConfig {
    /// The built-in demo: one node with two virtual 80 GB GPUs and two mock
    /// chat models, the small one started at once, the large one on its
    /// first request.
    pub fn demo() -> Self {
        toml::from_str(DEMO).expect("the built-in demo configuration parses")
    }

    /// How long a request for `model` may take: its `timeout_s`, at least
    /// the floor, at most the ceiling (Workers AI's rule).
    pub fn timeout(&self, model: &ModelConfig) -> Duration {
        Duration::from_secs(model.timeout_s.max(self.timeout_floor_s).min(self.timeout_ceiling_s))
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
                        ModelSpec {
                            size: m.size,
                            parameters: m.parameters,
                            gpu_kind: m.gpu_kind.clone(),
                            min_gpu_memory: m.min_gpu_memory,
                            adapter_memory: m.adapters.as_ref().map(|a| a.memory),
                            hotswap: m.hotswap,
                            ..ModelSpec::default()
                        },
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
max_replicas = 2
concurrency = 8
# The mock engine's token stream: GET /v1/ws?model=demo/chat-small.
websocket = {}

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
        let doc = include_str!("../../../../../docs/config.md");
        let example = doc.split("```toml").nth(1).and_then(|s| s.split("```").next()).expect("an example");
        let parsed: ServeConfig = toml::from_str(example).unwrap();
        assert_eq!(parsed.models, demo.models);
        assert_eq!(parsed.max_body_bytes.bytes(), 16 << 20);
    }

    #[test]
    fn capacity_timeout_and_scaling_defaults_follow_the_documented_rules() {
        let config: ServeConfig = toml::from_str(
            "timeout_floor_s = 10\ntimeout_ceiling_s = 100\n\
             [[nodes]]\nid = \"n\"\ngpus = 1\ngpu_memory = \"80GB\"\n\
             [[models]]\nkey = \"a\"\nengine = { kind = \"mock\" }\nsize = \"1GB\"\nconcurrency = 4\nmax_replicas = 3\n\
             [[models]]\nkey = \"b\"\nengine = { kind = \"mock\" }\nsize = \"1GB\"\nconcurrency = 300\ntimeout_s = 500\n\
             [[models]]\nkey = \"c\"\nengine = { kind = \"mock\" }\nsize = \"1GB\"\ntimeout_s = 50\nqueue = { capacity = 7 }\n",
        )
        .unwrap();
        config.validate().unwrap();
        let [a, b, c] = &config.models[..] else { panic!() };
        assert_eq!(a.admission().capacity, 4 * 4 * 3, "four waiting per permit at max_replicas");
        assert_eq!(b.admission().capacity, 1_000, "clamped");
        assert_eq!(c.admission().capacity, 7, "as configured");
        assert_eq!(config.timeout(a).as_secs(), 10, "unset: the floor");
        assert_eq!(config.timeout(b).as_secs(), 100, "capped by the ceiling");
        assert_eq!(config.timeout(c).as_secs(), 50);
        assert_eq!(a.scaling(), ScalingConfig::default(), "engines Hangar runs: the hangar policy");

        let config: ServeConfig = toml::from_str(
            "nodes = []
             [[models]]
key = \"x\"
engine = { kind = \"external\", url = \"http://h:1\" }
             [[models]]
key = \"y\"
engine = { kind = \"external\", url = \"http://h:1\" }
scaling = { policy = \"hangar\", scale_down_after_s = 60 }
             [[models]]
key = \"z\"
engine = { kind = \"mock\" }
[models.scaling]
policy = \"replicate\"
",
        )
        .unwrap();
        let quiet = |s: ScalingConfig| match s {
            ScalingConfig::Hangar(h) => Some(h.scale_down_after_s),
            _ => None,
        };
        let after: Vec<_> = config.models.iter().map(|m| quiet(m.scaling())).collect();
        assert_eq!(after, [Some(0), Some(60), None], "external: never unless asked");

        let bad: ServeConfig = toml::from_str(
            "[[nodes]]\nid = \"n\"\ngpus = 1\ngpu_memory = \"80GB\"\n\
             [[models]]\nkey = \"a\"\nengine = { kind = \"mock\" }\nmin_replicas = 3\nmax_replicas = 2\n",
        )
        .unwrap();
        assert!(bad.validate().unwrap_err().to_string().contains("max_replicas (2) must be at least"));
        let bad: ServeConfig =
            toml::from_str("timeout_floor_s = 50\ntimeout_ceiling_s = 40\nnodes = []\nmodels = []\n")
                .unwrap();
        assert!(bad.validate().unwrap_err().to_string().contains("timeout_floor_s (50)"));
    }

    #[test]
    fn the_router_is_hangar_routers_one_policy_type() {
        let parse = |router: &str| {
            let text = format!("nodes = []\n[[models]]\nkey = \"m\"\nengine = {{ kind = \"mock\" }}\nrouter = \"{router}\"\n");
            toml::from_str::<ServeConfig>(&text).map(|c| c.models[0].router)
        };
        for policy in RouterPolicy::ALL {
            assert_eq!(parse(policy.name()).unwrap(), policy);
        }
        assert_eq!(parse("round_robin").unwrap(), RouterPolicy::RoundRobin);
        assert!(parse("random").is_err());
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
        assert!(e.to_string().contains("random") && e.to_string().contains("round-robin"), "{e}");
    }
}
