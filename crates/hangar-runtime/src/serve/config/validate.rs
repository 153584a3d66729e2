//! The rules a parsed configuration must also meet: ranges, bounds and
//! cross-field checks the field types cannot express.
//!
//! Each rule answers with a [`FieldError`] naming the field by its path
//! (`models[1].queue.capacity`), which [`super::load`] turns into the
//! file's line. A configuration that passes can run: every duration fits
//! in the clock's arithmetic, every URL parses, every model has a place on
//! the nodes for the replicas it must keep.

use std::collections::{BTreeMap, HashMap};

use hangar_core::FieldError;
use hangar_placement::{Cluster, ConfigError as PlacementError};

use super::{ConnectionPool, ModelConfig, ServeConfig};
use hangar_agent::engine::EngineSpec;

/// The longest duration any `*_s` setting may hold: 30 days. It keeps
/// every deadline (`Instant` + duration, milliseconds since the epoch) far
/// from overflow; nothing Hangar waits for legitimately takes longer.
pub const MAX_DURATION_S: u64 = 30 * 24 * 3600;

/// The most requests one model's line may hold (per account when fair):
/// `hangar-queue`'s bound, seed 001's. A larger configured value is
/// refused rather than clamped, so what runs is what was written.
pub const MAX_QUEUE_CAPACITY: usize = hangar_queue::MAX_CAPACITY;

/// The most concurrent requests one replica may be given.
pub const MAX_CONCURRENCY: u32 = 4_096;

/// The smallest and largest `max_body_bytes`: 1 KiB (a chat request
/// must fit) to 1 GiB.
pub const BODY_LIMIT_RANGE: std::ops::RangeInclusive<u64> = 1 << 10..=1 << 30;

/// Whether `capacity` may be a line's length (also checked when the admin
/// API switches a queue).
pub fn check_queue_capacity(capacity: usize) -> Result<(), String> {
    match capacity {
        0 => Err("must be at least 1 (a line that holds nobody refuses every request)".into()),
        c if c > MAX_QUEUE_CAPACITY => {
            Err(format!("{c} is above {MAX_QUEUE_CAPACITY}, the most a line may hold (seed 001)"))
        }
        _ => Ok(()),
    }
}

/// `value` seconds is a usable duration for `field` (`min` is 0 or 1).
fn seconds(field: &str, value: u64, min: u64) -> Result<(), FieldError> {
    if value < min || value > MAX_DURATION_S {
        return Err(FieldError::new(
            field,
            format!("{value} is out of range: {min} to {MAX_DURATION_S} seconds (30 days)"),
        ));
    }
    Ok(())
}

impl ConnectionPool {
    fn validate(&self) -> Result<(), FieldError> {
        if !(1..=60_000).contains(&self.connect_timeout_ms) {
            return Err(FieldError::new(
                "connect_timeout_ms",
                format!("{} is out of range: 1 to 60000 ms", self.connect_timeout_ms),
            ));
        }
        // Keep-alive probes go out every second: a bound below it would
        // close a silent answer's connection before its host was asked.
        if !(1_000..=600_000).contains(&self.unacked_timeout_ms) {
            return Err(FieldError::new(
                "unacked_timeout_ms",
                format!("{} is out of range: 1000 to 600000 ms", self.unacked_timeout_ms),
            ));
        }
        Ok(())
    }
}

impl ServeConfig {
    /// Checks what the field types cannot: ranges, bounds, duplicates,
    /// URLs, and that every model's `min_replicas` can be placed on the
    /// nodes. The error names the first offending field by its path.
    pub fn validate(&self) -> Result<(), FieldError> {
        let body = self.max_body_bytes.bytes();
        if !BODY_LIMIT_RANGE.contains(&body) {
            return Err(FieldError::new(
                "max_body_bytes",
                format!("{} is out of range: 1KiB to 1GiB", self.max_body_bytes),
            ));
        }
        seconds("timeout_floor_s", self.timeout_floor_s, 1)?;
        seconds("timeout_ceiling_s", self.timeout_ceiling_s, 1)?;
        if self.timeout_ceiling_s < self.timeout_floor_s {
            return Err(FieldError::new(
                "timeout_ceiling_s",
                format!(
                    "{} is below timeout_floor_s ({}): the ceiling must be at least the floor",
                    self.timeout_ceiling_s, self.timeout_floor_s
                ),
            ));
        }
        if self.nodes.is_empty() && self.redis.is_none() {
            return Err(FieldError::new(
                "nodes",
                "at least one `[[nodes]]` entry is required (or `redis`, for a fleet whose nodes are the agents \
                 that register there)",
            ));
        }
        if let Some(i) = self.nodes.iter().position(|n| n.gpus == 0) {
            return Err(FieldError::new(
                format!("nodes[{i}].gpus"),
                "must be at least 1: a node without GPUs can host no replica (use `virtual_gpus = true` \
                 on a machine without accelerators)",
            ));
        }
        if self.models.is_empty() {
            return Err(FieldError::new("models", "at least one `[[models]]` entry is required"));
        }
        let mut keys = HashMap::new();
        for (i, m) in self.models.iter().enumerate() {
            if let Some(first) = keys.insert(m.key.as_str(), i) {
                return Err(FieldError::new(
                    format!("models[{i}].key"),
                    format!("model `{}` is already declared at models[{first}]", m.key),
                ));
            }
            m.validate().map_err(|e| e.within(&format!("models[{i}]")))?;
        }
        self.check_trainer_keys()?;
        self.check_api_keys()?;
        if self.events.channel == 0 || self.events.channel > 1 << 20 {
            return Err(FieldError::new(
                "events.channel",
                format!("{} is out of range: 1 to 1048576", self.events.channel),
            ));
        }
        if self.events.max_file_bytes.bytes() < 1024 {
            return Err(FieldError::new(
                "events.max_file_bytes",
                format!("{} is below 1KiB: every file would hold a few events", self.events.max_file_bytes),
            ));
        }
        self.predictions.validate().map_err(|e| e.within("predictions"))?;
        for (i, d) in self.predictions.deployments.iter().enumerate() {
            if !keys.contains_key(d.model.as_str()) {
                return Err(FieldError::new(
                    format!("predictions.deployments[{i}].model"),
                    format!("deployment `{}` names `{}`, which is not a served model", d.name, d.model),
                ));
            }
        }
        if let Some(runtime) = &self.predictions.procedures.runtime {
            let field = "predictions.procedures.runtime";
            match self.models.iter().find(|m| m.key.as_str() == runtime) {
                None => {
                    return Err(FieldError::new(field, format!("`{runtime}` is not a served model")));
                }
                Some(m) if !matches!(m.engine, EngineSpec::Procedures { .. }) => {
                    return Err(FieldError::new(
                        field,
                        format!(
                            "`{runtime}` runs on an engine that is not the procedures runtime; give it \
                             `engine = {{ kind = \"procedures\" }}`"
                        ),
                    ));
                }
                Some(_) => {}
            }
        }
        for (i, w) in self.schedule.iter().enumerate() {
            let at = format!("schedule[{i}]");
            let Some(m) = self.models.iter().find(|m| m.key == w.model) else {
                return Err(FieldError::new(
                    format!("{at}.model"),
                    format!("`{}` is not a served model", w.model),
                ));
            };
            if w.end <= w.start {
                return Err(FieldError::new(format!("{at}.end"), "must be after start"));
            }
            if w.replicas == 0 || w.replicas > m.max_replicas() {
                return Err(FieldError::new(
                    format!("{at}.replicas"),
                    format!("{} must be 1 to the model's max_replicas ({})", w.replicas, m.max_replicas()),
                ));
            }
        }
        self.check_placement()
    }

    fn check_api_keys(&self) -> Result<(), FieldError> {
        if let Some(url) = &self.redis {
            hangar_redis::check_url(url).map_err(|e| FieldError::new("redis", e))?;
        }
        self.check_keys()
    }

    /// `metrics_key` and `api_keys`, wherever they were read from (the
    /// file, or a keys file of their own).
    pub(super) fn check_keys(&self) -> Result<(), FieldError> {
        if self.metrics_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
            return Err(FieldError::new("metrics_key", "is empty (leave it out for an open /metrics)"));
        }
        let mut seen = HashMap::new();
        for (i, k) in self.api_keys.iter().enumerate() {
            if k.key.trim().is_empty() {
                return Err(FieldError::new(format!("api_keys[{i}].key"), "is empty"));
            }
            if let Some(first) = seen.insert(k.key.as_str(), i) {
                return Err(FieldError::new(
                    format!("api_keys[{i}].key"),
                    format!("repeats the key of api_keys[{first}]"),
                ));
            }
        }
        Ok(())
    }

    /// The nodes and model sizes make a cluster, and each model alone on
    /// it can hold its `min_replicas` (at least one replica): a model that
    /// can never be placed is refused here instead of waiting forever.
    ///
    /// A fleet's file (`redis` and no `[[nodes]]`) is checked only for
    /// placement's own settings and model sizes: its nodes are the agents
    /// that register, known only when they do.
    fn check_placement(&self) -> Result<(), FieldError> {
        let cluster = Cluster::new(self.cluster()).map_err(|e| self.placement_error(e))?;
        if self.nodes.is_empty() {
            return Ok(());
        }
        for (i, m) in self.models.iter().enumerate() {
            let wanted = m.min_replicas.max(1);
            let room = cluster.room_for(&m.key, wanted, self.seed);
            // What to blame: the hardware asked for, when no node has it.
            let size_field = match cluster.missing_hardware(&m.key) {
                Some(r) => r.field(),
                None if m.size.is_some() => "size",
                None => "parameters",
            };
            if room.placed == 0 {
                return Err(FieldError::new(
                    format!("models[{i}].{size_field}"),
                    format!(
                        "model `{}` fits on no node: {}",
                        m.key,
                        room.reason.unwrap_or_else(|| "no room".into())
                    ),
                ));
            }
            if room.placed < wanted {
                return Err(FieldError::new(
                    format!("models[{i}].min_replicas"),
                    format!(
                        "{wanted} replicas of `{}` are wanted, but the nodes can hold at most {} \
                         even with nothing else on them",
                        m.key, room.placed
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Placement's own configuration error, named by its path in this file.
    fn placement_error(&self, e: PlacementError) -> FieldError {
        let message = e.to_string();
        let field = match &e {
            PlacementError::Placement { field, .. } => format!("placement.{field}"),
            PlacementError::Node { index, field, .. } => format!("nodes[{index}].{field}"),
            PlacementError::DuplicateNode { second, .. } => format!("nodes[{second}].id"),
            PlacementError::Model { model, .. } => {
                let index: BTreeMap<_, _> =
                    self.models.iter().enumerate().map(|(i, m)| (m.key.as_str(), i)).collect();
                match index.get(model.as_str()) {
                    Some(i) => format!("models[{i}]"),
                    None => "models".into(),
                }
            }
            _ => "nodes".into(),
        };
        // The message already starts with placement's own path; keep only
        // what it says after it.
        let message = message.split_once(": ").map_or(message.clone(), |(_, why)| why.to_owned());
        FieldError::new(field, message)
    }
}

impl ModelConfig {
    /// Whether the model can run between `bounds` by its scaling policy
    /// (`fixed` needs at least one) and its tier (a `hotswap` model holds
    /// none of its own): its config's bounds, and those a deployment made
    /// through the API gives it.
    pub fn check_bounds(&self, bounds: hangar_scaler::Bounds) -> Result<(), FieldError> {
        self.scaling().check_bounds(bounds)?;
        let tier = hangar_placement::ModelSpec { hotswap: self.hotswap, ..Default::default() };
        tier.check_tier(bounds.min)
    }

    /// The model's own ranges; paths are relative to its `[[models]]` entry.
    fn validate(&self) -> Result<(), FieldError> {
        if !(1..=MAX_CONCURRENCY).contains(&self.concurrency) {
            return Err(FieldError::new(
                "concurrency",
                format!("{} is out of range: 1 to {MAX_CONCURRENCY}", self.concurrency),
            ));
        }
        let max = self.max_replicas();
        if max == 0 || max < self.min_replicas {
            return Err(FieldError::new(
                "max_replicas",
                format!(
                    "max_replicas ({max}) must be at least 1 and at least min_replicas ({})",
                    self.min_replicas
                ),
            ));
        }
        if let Some(capacity) = self.queue.capacity {
            check_queue_capacity(capacity).map_err(|m| FieldError::new("queue.capacity", m))?;
        }
        seconds("timeout_s", self.timeout_s, 0)?;
        if let Some(slo) = self.slo_ttft_ms {
            if !(1..=MAX_DURATION_S * 1000).contains(&slo) {
                return Err(FieldError::new("slo_ttft_ms", format!("{slo} must be 1 ms to 30 days")));
            }
        }
        self.scaling().validate().map_err(|e| e.within("scaling"))?;
        self.check_bounds(hangar_scaler::Bounds { min: self.min_replicas, max })?;
        self.check_adapters()?;
        if self.use_async_queue && self.engine.is_cog() {
            return Err(FieldError::new(
                "use_async_queue",
                "a cog engine serves predictions, not the OpenAI routes whose requests this queues; \
                 use the predictions API (POST /v1/models/{key}/predictions), which queues them already",
            ));
        }
        self.connections.validate().map_err(|e| e.within("connections"))?;
        if self.kv.block_chars == 0 {
            return Err(FieldError::new("kv.block_chars", "must be at least 1"));
        }
        if self.kv.cache_blocks == 0 {
            return Err(FieldError::new("kv.cache_blocks", "must be at least 1"));
        }
        if self.access.as_ref().is_some_and(Vec::is_empty) {
            return Err(FieldError::new(
                "access",
                "is empty, so no account could use the model: remove `access` to let every account use it, \
                 or name the accounts that may (`access = [\"acme\"]`)",
            ));
        }
        check_engine(&self.engine).map_err(|e| e.within("engine"))?;
        self.check_weights()?;
        for (field, rate) in self.billing.rates() {
            if !(rate.is_finite() && rate >= 0.0) {
                return Err(FieldError::new(
                    format!("billing.{field}"),
                    format!("{rate} is not a price: give a finite number, 0 or more"),
                ));
            }
        }
        if let Some(ws) = &self.websocket {
            if !ws.path.starts_with('/') || ws.path.contains(['?', '#', ' ']) {
                return Err(FieldError::new(
                    "websocket.path",
                    format!("`{}` is not a path: give one that starts with `/`, without a query", ws.path),
                ));
            }
            seconds("websocket.max_duration_s", ws.max_duration_s, 1)?;
            let bytes = ws.max_message_bytes.bytes();
            if !(MIN_WS_MESSAGE..=MAX_WS_MESSAGE).contains(&bytes) {
                return Err(FieldError::new(
                    "websocket.max_message_bytes",
                    format!("{bytes} bytes is out of range: {MIN_WS_MESSAGE} (1 KiB) to {MAX_WS_MESSAGE} (64 MiB)"),
                ));
            }
        }
        self.predictions.validate().map_err(|e| e.within("predictions"))
    }
}

/// The smallest WebSocket message limit: room for a JSON request.
const MIN_WS_MESSAGE: u64 = 1 << 10;
/// The largest: a message is held whole in memory on its way through.
const MAX_WS_MESSAGE: u64 = 64 << 20;

impl ModelConfig {
    /// Adapters need the `adapter` router's table to be there and an engine
    /// that speaks the OpenAI API (a cog engine does not); access rules
    /// need adapters and name them as adapter names are written.
    fn check_adapters(&self) -> Result<(), FieldError> {
        let Some(adapters) = &self.adapters else {
            if self.router == hangar_router::RouterPolicy::Adapter {
                return Err(FieldError::new(
                    "router",
                    "`adapter` routes requests by their LoRA adapter, and this model loads none: add \
                     `[models.adapters]` (docs/adapters.md) or choose `least-outstanding`, `round-robin` or `kv`",
                ));
            }
            if !self.adapter_access.is_empty() {
                return Err(FieldError::new(
                    "adapter_access",
                    "names adapters, and this model loads none: add `[models.adapters]` (docs/adapters.md)",
                ));
            }
            return Ok(());
        };
        adapters.validate().map_err(|e| e.within("adapters"))?;
        if self.engine.is_cog() {
            return Err(FieldError::new(
                "adapters",
                "a cog engine serves predictions of its own model and loads no LoRA adapters; serve the base \
                 model with an OpenAI-compatible engine that does (vLLM, the mock)",
            ));
        }
        for (i, rule) in self.adapter_access.iter().enumerate() {
            let at = |field: &str| format!("adapter_access[{i}].{field}");
            let name =
                rule.adapters.strip_suffix('*').map_or(&rule.adapters[..], |p| p.trim_end_matches('/'));
            if !(name.is_empty() && rule.adapters.ends_with('*')) {
                if let Err(e) = name.parse::<hangar_core::AdapterName>() {
                    return Err(FieldError::new(
                        at("adapters"),
                        format!("`{}` is not an adapter name or `prefix*` pattern: {e}", rule.adapters),
                    ));
                }
            }
            if rule.accounts.as_ref().is_some_and(Vec::is_empty) {
                return Err(FieldError::new(
                    at("accounts"),
                    "is empty, so no account could use these adapters: remove the rule's `accounts` to let \
                     every account of the model use them, or name the accounts",
                ));
            }
        }
        Ok(())
    }

    /// `weights` and `{weights}` go together: an `openai` command uses
    /// `{weights}` exactly when the model has weights; a mock reads them;
    /// `cog` and `external` engines load their own.
    fn check_weights(&self) -> Result<(), FieldError> {
        let uses =
            matches!(&self.engine, EngineSpec::Openai { command, .. } if command.contains("{weights}"));
        match (&self.weights, &self.engine) {
            (None, _) if uses => Err(FieldError::new(
                "engine.command",
                "uses {weights} but the model has no `weights` (`store:KEY` or a file path)",
            )),
            (Some(w), EngineSpec::Openai { .. }) if !uses => Err(FieldError::new(
                "weights",
                format!("`{w}` is never handed to the engine: put {{weights}} in its command where it takes the model file"),
            )),
            (Some(_), EngineSpec::Cog { .. } | EngineSpec::External { .. } | EngineSpec::Procedures { .. }) => {
                Err(FieldError::new(
                    "weights",
                    "only `openai` and `mock` engines take weights; `cog`, `procedures` and `external` engines \
                     load their own",
                ))
            }
            _ => Ok(()),
        }
    }
}

/// What can be known of an engine before it runs: a mock's preset is one
/// the mock engine has, an `external` URL parses as http(s) with a host, a
/// command template is not empty, a readiness path is a path, setup
/// timeouts are in range.
fn check_engine(engine: &EngineSpec) -> Result<(), FieldError> {
    match engine {
        EngineSpec::Mock { preset, .. } => {
            hangar_engine::preset::named(preset).map_err(|e| FieldError::new("preset", e.to_string()))?;
            Ok(())
        }
        EngineSpec::External { url } => {
            let parsed = reqwest::Url::parse(url)
                .map_err(|e| FieldError::new("url", format!("`{url}` is not a URL: {e}")))?;
            if !matches!(parsed.scheme(), "http" | "https") || !parsed.has_host() {
                return Err(FieldError::new("url", format!("`{url}` is not an http(s) URL with a host")));
            }
            if !parsed.username().is_empty() || parsed.password().is_some() {
                return Err(FieldError::new("url", "credentials in the URL are not supported"));
            }
            Ok(())
        }
        EngineSpec::Openai { command, readiness_path, setup_timeout_s } => {
            if command.split_whitespace().next().is_none() {
                return Err(FieldError::new("command", "is empty"));
            }
            if !readiness_path.starts_with('/') {
                return Err(FieldError::new(
                    "readiness_path",
                    format!("`{readiness_path}` must be a path starting with `/`"),
                ));
            }
            seconds("setup_timeout_s", *setup_timeout_s, 1)
        }
        EngineSpec::Cog { setup_timeout_s, .. } | EngineSpec::Procedures { setup_timeout_s, .. } => {
            seconds("setup_timeout_s", *setup_timeout_s, 1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A configuration of one node with one virtual 80 GB GPU and `models`.
    fn config(models: &str) -> String {
        format!("[[nodes]]\nid = \"n\"\ngpus = 1\ngpu_memory = \"80GB\"\nvirtual_gpus = true\n{models}")
    }

    fn refused(text: &str) -> FieldError {
        toml::from_str::<ServeConfig>(text).unwrap().validate().unwrap_err()
    }

    const MOCK: &str = "[[models]]\nkey = \"m\"\nengine = { kind = \"mock\" }\nsize = \"10GB\"\n";

    #[test]
    fn the_demo_is_valid() {
        ServeConfig::demo().validate().unwrap();
    }

    #[test]
    fn websocket_limits_and_the_adapter_router_name_what_is_wrong() {
        let model = |extra: &str| config(&format!("{MOCK}{extra}\n"));
        toml::from_str::<ServeConfig>(&model("websocket = {}")).unwrap().validate().unwrap();
        assert_eq!(refused(&model("websocket = { path = \"ws\" }")).field, "models[0].websocket.path");
        assert_eq!(
            refused(&model("websocket = { max_duration_s = 0 }")).field,
            "models[0].websocket.max_duration_s"
        );
        let e = refused(&model("websocket = { max_message_bytes = \"100B\" }"));
        assert_eq!(e.field, "models[0].websocket.max_message_bytes");
        let e = refused(&model("router = \"adapter\""));
        assert_eq!(e.field, "models[0].router");
        assert!(e.to_string().contains("[models.adapters]"), "{e}");
        let with = |extra: &str| model(&format!("router = \"adapter\"\nadapters = {{}}\n{extra}"));
        toml::from_str::<ServeConfig>(&with("")).unwrap().validate().unwrap();
        let rule = |r: &str| with(&format!("[[models.adapter_access]]\n{r}"));
        toml::from_str::<ServeConfig>(&rule("adapters = \"acme/*\"\naccounts = [\"acme\"]"))
            .unwrap()
            .validate()
            .unwrap();
        toml::from_str::<ServeConfig>(&rule("adapters = \"*\"")).unwrap().validate().unwrap();
        assert_eq!(refused(&rule("adapters = \"../x\"")).field, "models[0].adapter_access[0].adapters");
        assert_eq!(
            refused(&rule("adapters = \"a\"\naccounts = []")).field,
            "models[0].adapter_access[0].accounts"
        );
        assert_eq!(
            refused(&with("adapters = { slots = 0 }").replace("adapters = {}\n", "")).field,
            "models[0].adapters.slots"
        );
        let e = refused(&model("[[models.adapter_access]]\nadapters = \"a\""));
        assert_eq!(e.field, "models[0].adapter_access");
    }

    #[test]
    fn the_async_queue_is_off_by_default_and_refused_on_cog_engines() {
        let model = |extra: &str| config(&format!("{MOCK}{extra}\n"));
        let off: ServeConfig = toml::from_str(&model("")).unwrap();
        assert!(!off.models[0].use_async_queue);
        let on: ServeConfig = toml::from_str(&model("use_async_queue = true")).unwrap();
        on.validate().unwrap();
        assert!(on.models[0].use_async_queue);
        let version = |c: &ServeConfig| serde_json::to_string(&c.models[0]).unwrap();
        assert!(!version(&off).contains("use_async_queue"), "off, the version is unchanged");
        let cog = config(
            "[[models]]\nkey = \"m\"\nengine = { kind = \"cog\", dir = \"x\" }\nsize = \"1GB\"\nuse_async_queue = true\n",
        );
        let e = refused(&cog);
        assert_eq!(e.field, "models[0].use_async_queue");
        assert!(e.to_string().contains("predictions"), "{e}");
    }

    #[test]
    fn a_hotswap_model_holds_no_replicas_of_its_own() {
        let model = |extra: &str| config(&format!("{MOCK}{extra}\n"));
        let ok: ServeConfig = toml::from_str(&model("hotswap = true")).unwrap();
        ok.validate().unwrap();
        assert!(ok.cluster().models.values().all(|m| m.hotswap), "placement hears of the tier");
        let e = refused(&model("hotswap = true\nmin_replicas = 1"));
        assert_eq!(e.field, "models[0].min_replicas");
        assert!(e.to_string().contains("swapped in by demand"), "{e}");
    }

    #[test]
    fn schedule_windows_name_what_is_wrong() {
        let window = |body: &str| config(&format!("{MOCK}[[schedule]]\n{body}\n"));
        let ok = "model = \"m\"\nstart = \"2026-11-24T10:00:00Z\"\nend = \"2026-11-24T11:00:00Z\"";
        toml::from_str::<ServeConfig>(&window(ok)).unwrap().validate().unwrap();
        assert_eq!(refused(&window(&ok.replace("\"m\"", "\"x\""))).field, "schedule[0].model");
        assert_eq!(refused(&window(&ok.replace("11:00", "09:00"))).field, "schedule[0].end");
        assert_eq!(refused(&window(&format!("{ok}\nreplicas = 2"))).field, "schedule[0].replicas");
        let e = toml::from_str::<ServeConfig>(&window(&ok.replace("2026-11-24T10:00:00Z", "at ten")))
            .unwrap_err();
        assert!(e.to_string().contains("`at ten` is not an RFC 3339 time"), "{e}");
    }

    #[test]
    fn scaling_knobs_and_connection_pools_name_what_is_wrong() {
        let e = refused(&config(&format!("{MOCK}scaling = {{ policy = \"hangar\", noise_z = 11 }}\n")));
        assert_eq!(e.field, "models[0].scaling.noise_z");
        let pool = |body: &str| {
            toml::from_str::<ServeConfig>(&config(&format!("{MOCK}connections = {{ {body} }}\n")))
        };
        pool("idle_timeout_ms = 0, max_idle = 8").unwrap().validate().unwrap();
        let e = pool("idle_timeout = 5").unwrap_err().to_string();
        assert!(e.contains("idle_timeout") && e.contains("idle_timeout_ms"), "{e}");
        let e = pool("max_idle = -1").unwrap_err().to_string();
        assert!(e.contains("max_idle"), "{e}");
        let e = pool("connect_timeout_ms = 0").unwrap().validate().unwrap_err();
        assert_eq!(e.field, "models[0].connections.connect_timeout_ms");
        assert!(e.to_string().contains("1 to 60000 ms"), "{e}");
        let e = pool("unacked_timeout_ms = 500").unwrap().validate().unwrap_err();
        assert_eq!(e.field, "models[0].connections.unacked_timeout_ms");
    }

    #[test]
    fn timeouts_near_u64_max_are_refused_by_their_bound() {
        let e = refused(&format!("timeout_ceiling_s = 18446744073709551615\n{}", config(MOCK)));
        assert_eq!(e.field, "timeout_ceiling_s");
        assert!(e.message.contains("30 days"), "{e}");
        let e = refused(&config(&format!("{MOCK}timeout_s = 18446744073709551000\n")));
        assert_eq!(e.field, "models[0].timeout_s");
        let e = refused(&config(&format!(
            "{MOCK}scaling = {{ policy = \"hangar\", scale_down_after_s = 99999999999 }}\n"
        )));
        assert_eq!(e.field, "models[0].scaling.scale_down_after_s");
        let e = refused(&config(&format!("{MOCK}slo_ttft_ms = 0\n")));
        assert_eq!(e.field, "models[0].slo_ttft_ms");
    }

    #[test]
    fn an_external_url_that_does_not_parse_is_refused_at_load() {
        for url in ["not a url", "ftp://h/", "http://", "http://u:p@h:1"] {
            let model =
                format!("[[models]]\nkey = \"m\"\nengine = {{ kind = \"external\", url = \"{url}\" }}\n");
            let e = refused(&config(&model));
            assert_eq!(e.field, "models[0].engine.url", "{url}: {e}");
        }
    }

    #[test]
    fn duplicate_model_keys_are_refused_naming_both() {
        let e = refused(&config(&format!("{MOCK}{MOCK}")));
        assert_eq!(e.field, "models[1].key");
        assert!(e.message.contains("models[0]"), "{e}");
    }

    #[test]
    fn no_nodes_no_gpus_and_no_models_are_refused() {
        assert_eq!(refused(&format!("nodes = []\n{MOCK}")).field, "nodes");
        let zero = format!("[[nodes]]\nid = \"n\"\ngpus = 0\n{MOCK}");
        assert_eq!(refused(&zero).field, "nodes[0].gpus");
        let no_models = format!("models = []\n{}", config(""));
        assert_eq!(refused(&no_models).field, "models");
    }

    #[test]
    fn a_fixed_model_that_keeps_no_replica_is_refused() {
        let e = refused(&config(
            "[[models]]\nkey = \"m\"\nengine = { kind = \"mock\" }\nsize = \"10GB\"\nmax_replicas = 2\n\
             scaling = { policy = \"fixed\" }\n",
        ));
        assert_eq!(e.field, "models[0].min_replicas");
        assert!(e.message.contains("would never run"), "{e}");
    }

    #[test]
    fn min_replicas_beyond_what_the_nodes_can_hold_is_refused() {
        // One 80 GB GPU holds one 60 GB replica (a whole GPU), not two.
        let e = refused(&config(
            "[[models]]\nkey = \"big\"\nengine = { kind = \"mock\" }\nsize = \"60GB\"\n\
             min_replicas = 2\nmax_replicas = 2\n",
        ));
        assert_eq!(e.field, "models[0].min_replicas");
        assert!(e.message.contains("at most 1"), "{e}");
        // Larger than any node: refused whatever min_replicas says.
        let e =
            refused(&config("[[models]]\nkey = \"huge\"\nengine = { kind = \"mock\" }\nsize = \"200GB\"\n"));
        assert_eq!(e.field, "models[0].size");
        assert!(e.message.contains("needs 3 GPUs"), "{e}");
        // Hardware no node has: the requirement is named, with what it asks.
        let e = refused(&config(
            "[[models]]\nkey = \"h\"\nengine = { kind = \"mock\" }\nsize = \"5GB\"\ngpu_kind = \"a100-80gb\"\n",
        ));
        assert_eq!(e.field, "models[0].gpu_kind");
        assert!(e.message.contains("no node has GPUs of kind `a100-80gb`"), "{e}");
        let e = refused(&config(
            "[[models]]\nkey = \"h\"\nengine = { kind = \"mock\" }\nsize = \"5GB\"\nmin_gpu_memory = \"100GB\"\n",
        ));
        assert_eq!(e.field, "models[0].min_gpu_memory");
        // The test node's virtual GPUs are of kind `virtual`, with 80 GB.
        toml::from_str::<ServeConfig>(&config(
            "[[models]]\nkey = \"v\"\nengine = { kind = \"mock\" }\nsize = \"5GB\"\n\
             gpu_kind = \"virtual\"\nmin_gpu_memory = \"80GB\"\n",
        ))
        .unwrap()
        .validate()
        .unwrap();
        // Three small replicas share the GPU.
        toml::from_str::<ServeConfig>(&config(
            "[[models]]\nkey = \"s\"\nengine = { kind = \"mock\" }\nsize = \"5GB\"\nmin_replicas = 3\n",
        ))
        .unwrap()
        .validate()
        .unwrap();
    }

    #[test]
    fn queue_capacity_is_one_to_a_thousand() {
        for (capacity, ok) in [(0, false), (1, true), (1000, true), (5000, false)] {
            let text = config(&format!("{MOCK}queue = {{ capacity = {capacity} }}\n"));
            let result = toml::from_str::<ServeConfig>(&text).unwrap().validate();
            assert_eq!(result.is_ok(), ok, "{capacity}: {result:?}");
            if let Err(e) = result {
                assert_eq!(e.field, "models[0].queue.capacity");
            }
        }
    }

    #[test]
    fn api_keys_and_deployments_are_checked() {
        let keys = "[[api_keys]]\nkey = \"k\"\naccount = \"a\"\n[[api_keys]]\nkey = \"k\"\naccount = \"b\"\n";
        assert_eq!(refused(&format!("{keys}{}", config(MOCK))).field, "api_keys[1].key");
        let deployment = "[[predictions.deployments]]\nname = \"o/d\"\nmodel = \"nope\"\n";
        assert_eq!(
            refused(&config(&format!("{MOCK}{deployment}"))).field,
            "predictions.deployments[0].model"
        );
    }

    #[test]
    fn the_procedures_runtime_must_be_a_served_model_of_the_procedures_engine() {
        let runtime = |key: &str| format!("[predictions.procedures]\nruntime = \"{key}\"\n");
        let procedures =
            "[[models]]\nkey = \"hangar/procedures\"\nengine = { kind = \"procedures\" }\nsize = \"1GB\"\n";
        let ok = config(&format!("{MOCK}{procedures}{}", runtime("hangar/procedures")));
        toml::from_str::<ServeConfig>(&ok).unwrap().validate().unwrap();
        let e = refused(&config(&format!("{MOCK}{procedures}{}", runtime("nope/x"))));
        assert_eq!(e.field, "predictions.procedures.runtime");
        assert!(e.to_string().contains("`nope/x` is not a served model"), "{e}");
        let mock_key = toml::from_str::<ServeConfig>(&config(MOCK)).unwrap().models[0].key.to_string();
        let e = refused(&config(&format!("{MOCK}{}", runtime(&mock_key))));
        assert!(e.to_string().contains("kind = \"procedures\""), "{e}");
        let weights = "[[models]]\nkey = \"p/w\"\nengine = { kind = \"procedures\" }\nsize = \"1GB\"\nweights = \"/x.gguf\"\n";
        assert_eq!(refused(&config(weights)).field, "models[0].weights");
    }

    #[test]
    fn an_unknown_mock_preset_is_refused_at_load_naming_the_known_ones() {
        let model = |preset: &str| {
            format!("[[models]]\nkey = \"m{preset}\"\nengine = {{ kind = \"mock\", preset = \"{preset}\" }}\nsize = \"1GB\"\n")
        };
        let text = config(&format!("{}{}", model("fast"), model("gpt-5")));
        let e = ServeConfig::from_toml(&text, "serve.toml").unwrap_err().to_string();
        assert_eq!(
            e,
            "invalid configuration serve.toml:12: models[1].engine.preset: unknown preset `gpt-5`; \
             choose one of default, fast, instant, sglang"
        );
        for p in hangar_engine::presets() {
            toml::from_str::<ServeConfig>(&config(&model(p.name))).unwrap().validate().unwrap();
        }
    }

    #[test]
    fn an_empty_access_list_is_refused_with_what_to_do() {
        let e = refused(&config(&format!("{MOCK}access = []\n")));
        assert_eq!(e.field, "models[0].access");
        assert!(e.message.contains("remove `access`") && e.message.contains("name the accounts"), "{e}");
        toml::from_str::<ServeConfig>(&config(&format!("{MOCK}access = [\"acme\"]\n")))
            .unwrap()
            .validate()
            .unwrap();
    }

    #[test]
    fn engine_templates_are_checked() {
        let openai =
            "[[models]]\nkey = \"m\"\nsize = \"1GB\"\nengine = { kind = \"openai\", command = \" \" }\n";
        assert_eq!(refused(&config(openai)).field, "models[0].engine.command");
        let openai = "[[models]]\nkey = \"m\"\nsize = \"1GB\"\n\
                      engine = { kind = \"openai\", command = \"x {port}\", readiness_path = \"health\" }\n";
        assert_eq!(refused(&config(openai)).field, "models[0].engine.readiness_path");
    }

    #[test]
    fn weights_and_the_weights_placeholder_go_together() {
        let model = |weights: &str, engine: &str| {
            config(&format!("[[models]]\nkey = \"m\"\nsize = \"1GB\"\n{weights}engine = {engine}\n"))
        };
        let llama = "{ kind = \"openai\", command = \"llama-server -m {weights} --port {port}\" }";
        let e = refused(&model("", llama));
        assert_eq!(e.field, "models[0].engine.command");
        assert!(e.message.contains("{weights}"), "{e}");
        let unused = "{ kind = \"openai\", command = \"llama-server --port {port}\" }";
        let e = refused(&model("weights = \"store:smol:q4\"\n", unused));
        assert_eq!(e.field, "models[0].weights");
        assert!(e.message.contains("store:smol:q4"), "{e}");
        let external = "{ kind = \"external\", url = \"http://10.0.0.7:8000\" }";
        assert_eq!(refused(&model("weights = \"w.gguf\"\n", external)).field, "models[0].weights");
        let ok = |text: &str| toml::from_str::<ServeConfig>(text).unwrap().validate().unwrap();
        ok(&model("weights = \"store:smol:q4\"\n", llama));
        ok(&model("weights = \"w.gguf\"\n", "{ kind = \"mock\" }"));
        let bad_key = model("weights = \"store:a/../b\"\n", llama);
        let e = ServeConfig::from_toml(&bad_key, "serve.toml").unwrap_err().to_string();
        assert!(e.contains("weights") && e.contains("store:a/../b"), "{e}");
    }
}
