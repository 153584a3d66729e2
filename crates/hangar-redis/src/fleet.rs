//! What the leader wants and what the nodes and gateways report, on
//! Redis.
//!
//! - `hangar:desired:NODE`: the node's [`DesiredState`], written whole by
//!   the leader on every change, only while it holds the lease in the
//!   epoch it writes (checked in the same script: a leader that lost the
//!   lease without knowing writes nothing).
//! - `hangar:reported:NODE`: the node's [`NodeReport`], written whole by
//!   its agent several times a second, living [`REPORT_TTL`] (it goes
//!   with its agent).
//! - `hangar:load:GATEWAY`: a gateway's [`GatewayLoad`], living
//!   [`REPORT_TTL`], indexed by `hangar:gateways`.
//! - `hangar:unavailable`: the models no replica can serve now, each with
//!   the reason sync requests are told (a JSON object), written whole by
//!   the leader as `desired` is; every other gateway answers as it does.
//! - `hangar:hotswap-closed`: the hotswap models an operator closed to
//!   swapping in (a set), the operator's intent: it outlives leaders, and
//!   each new leader pins those models at zero again.
//! - `hangar:scaling-overrides`: each model an operator froze or pinned
//!   (a hash, model → JSON [`ScalingOverride`]), also the operator's
//!   intent, which each new leader applies again.
//! - `hangar:draining`: the nodes an operator drained (a set): the leader
//!   moves their replicas elsewhere and places nothing new there, until
//!   the operator calls the drain off.
//! - `hangar:adapters:NODE`: the LoRA adapters registered in the node's
//!   weight store ([`NodeAdapters`]), written by its agent when they
//!   change, living [`ADAPTERS_TTL`] (kept alive while the agent runs);
//!   the node's report carries its digest, so a gateway reads the list
//!   only when it changed.

use std::time::Duration;

use hangar_core::{DesiredState, GatewayLoad, NodeAdapters, NodeReport};
use redis::Script;
use serde::de::DeserializeOwned;

use crate::{Redis, RedisError};

/// How long a report outlives the last write of its writer.
pub const REPORT_TTL: Duration = Duration::from_secs(3);

/// How long a node's adapters outlive the last time its agent kept them
/// alive: long beside the agent's period (they are a few hundred bytes an
/// adapter, written only when they change), short enough that a node gone
/// without leaving does not leave them behind for long.
pub const ADAPTERS_TTL: Duration = Duration::from_secs(30);

/// Sets `PREFIX:KEY` only while `me` leads in `epoch`. ARGV: prefix, me,
/// epoch, key (below the prefix), json. 1 written, 0 not the leader.
const WRITE_AS_LEADER: &str = r#"
local lease = ARGV[1] .. ':leader'
if redis.call('GET', lease) ~= ARGV[2] or redis.call('GET', lease .. ':epoch') ~= ARGV[3] then
  return 0
end
redis.call('SET', ARGV[1] .. ':' .. ARGV[4], ARGV[5])
return 1
"#;

/// An operator's override of one model's scaler, as recorded for the
/// leaders to come: `"freeze"` (keep the count it has) or `{"pin": N}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScalingOverride {
    /// Frozen at the count it has.
    Freeze,
    /// Held at this many replicas.
    Pin(u32),
}

/// The models no replica can serve now, each with the reason sync
/// requests are told: what the leader decided, which every gateway
/// answers with.
pub type Unavailable = std::collections::BTreeMap<String, String>;

/// The fleet's shared state on one Redis.
#[derive(Clone)]
pub struct FleetState {
    redis: Redis,
    write_as_leader: std::sync::Arc<Script>,
    named: std::sync::Arc<Named>,
}

impl std::fmt::Debug for FleetState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FleetState").field("redis", &self.redis).finish()
    }
}

fn ttl_ms() -> u64 {
    REPORT_TTL.as_millis() as u64
}

/// Keys already named as unreadable, with what was wrong: each is logged
/// once, not at every read (several times a second).
#[derive(Debug, Default)]
struct Named(std::sync::Mutex<std::collections::HashSet<(String, String)>>);

impl Named {
    /// Logs `key` as unreadable for `why`, once per key and reason.
    fn warn(&self, key: &str, why: &str) {
        let mut seen = self.0.lock().expect("named keys lock");
        if seen.len() > 10_000 {
            seen.clear();
        }
        if seen.insert((key.to_owned(), why.to_owned())) {
            tracing::warn!(key, "unreadable, skipped (fix or delete the key): {why}");
        }
    }
}

impl FleetState {
    /// `PREFIX:kind:name`.
    fn key(&self, kind: &str, name: &str) -> String {
        self.redis.key(&format!("{kind}:{name}"))
    }

    /// The state on `redis`.
    pub fn new(redis: Redis) -> FleetState {
        FleetState {
            redis,
            write_as_leader: std::sync::Arc::new(Script::new(WRITE_AS_LEADER)),
            named: Default::default(),
        }
    }

    /// Writes `node`'s desired state as leader `me` in `state.epoch`;
    /// `false` (nothing written) if `me` no longer leads in that epoch.
    pub fn write_desired(&self, me: &str, node: &str, state: &DesiredState) -> Result<bool, RedisError> {
        let json = serde_json::to_string(state).expect("a desired state serializes");
        self.write_as_leader(me, state.epoch, &format!("desired:{node}"), &json)
    }

    /// Writes which models are unavailable, as leader `me` in `epoch`;
    /// `false` (nothing written) if `me` no longer leads in that epoch.
    pub fn write_unavailable(&self, me: &str, epoch: u64, models: &Unavailable) -> Result<bool, RedisError> {
        let json = serde_json::to_string(models).expect("a map of strings serializes");
        self.write_as_leader(me, epoch, "unavailable", &json)
    }

    fn write_as_leader(&self, me: &str, epoch: u64, key: &str, json: &str) -> Result<bool, RedisError> {
        let written: i64 = self.redis.run(|c| {
            self.redis.script(&self.write_as_leader).arg(me).arg(epoch).arg(key).arg(json).invoke(c)
        })?;
        Ok(written == 1)
    }

    /// Records that an operator closed (`true`) or opened the hotswap
    /// model `model` to swapping in.
    pub fn close_hotswap(&self, model: &str, closed: bool) -> Result<(), RedisError> {
        self.mark("hotswap-closed", model, closed)
    }

    /// Adds `member` to the set `PREFIX:key` (`on`) or takes it out.
    fn mark(&self, key: &str, member: &str, on: bool) -> Result<(), RedisError> {
        let set = self.redis.key(key);
        let verb = if on { "SADD" } else { "SREM" };
        self.redis.run(|c| redis::cmd(verb).arg(&set).arg(member).query::<()>(c))
    }

    /// The hotswap models an operator closed to swapping in.
    pub fn closed_hotswap(&self) -> Result<std::collections::BTreeSet<String>, RedisError> {
        self.members(&self.redis.key("hotswap-closed"), None)
    }

    /// Records that an operator drained (`true`) node `node`, or called
    /// the drain off.
    pub fn drain_node(&self, node: &str, draining: bool) -> Result<(), RedisError> {
        self.mark("draining", node, draining)
    }

    /// The nodes an operator drained.
    pub fn drained_nodes(&self) -> Result<std::collections::BTreeSet<String>, RedisError> {
        self.members(&self.redis.key("draining"), None)
    }

    /// Whether `key` is of type `want` (or absent: `false`), its type read
    /// unless the caller has it (`kind`); a key of another type, written
    /// by hand, is named in the log once and read as absent rather than
    /// failing every read of the fleet's state.
    fn is(&self, key: &str, want: &str, kind: Option<String>) -> Result<bool, RedisError> {
        let kind = match kind {
            Some(kind) => kind,
            None => self.redis.run(|c| redis::cmd("TYPE").arg(key).query(c))?,
        };
        if kind != want && kind != "none" {
            self.named.warn(key, &format!("a {kind}, not a {want}"));
        }
        Ok(kind == want)
    }

    /// The members of the set `key` (`kind`: its type, if read already).
    fn members(
        &self,
        key: &str,
        kind: Option<String>,
    ) -> Result<std::collections::BTreeSet<String>, RedisError> {
        if !self.is(key, "set", kind)? {
            return Ok(Default::default());
        }
        self.redis.run(|c| redis::cmd("SMEMBERS").arg(key).query(c))
    }

    /// Records `model`'s scaling override (`None`: the operator released
    /// it).
    pub fn set_override(&self, model: &str, o: Option<ScalingOverride>) -> Result<(), RedisError> {
        let hash = self.redis.key("scaling-overrides");
        match o {
            Some(o) => {
                let json = serde_json::to_string(&o).expect("an override serializes");
                self.redis.run(|c| redis::cmd("HSET").arg(&hash).arg(model).arg(&json).query::<()>(c))
            }
            None => self.redis.run(|c| redis::cmd("HDEL").arg(&hash).arg(model).query::<()>(c)),
        }
    }

    /// Every model's recorded scaling override (one that cannot be read
    /// is named in the log once and left out).
    pub fn overrides(&self) -> Result<std::collections::BTreeMap<String, ScalingOverride>, RedisError> {
        let hash = self.redis.key("scaling-overrides");
        if !self.is(&hash, "hash", None)? {
            return Ok(Default::default());
        }
        let all: std::collections::BTreeMap<String, String> =
            self.redis.run(|c| redis::cmd("HGETALL").arg(&hash).query(c))?;
        Ok(all
            .into_iter()
            .filter_map(|(model, json)| {
                let o = self.parse(&format!("{hash} {model}"), Some(json))?;
                Some((model, o))
            })
            .collect())
    }

    /// `model`'s recorded scaling override, if any (one that cannot be
    /// read is named in the log once and read as none).
    pub fn override_of(&self, model: &str) -> Result<Option<ScalingOverride>, RedisError> {
        let hash = self.redis.key("scaling-overrides");
        if !self.is(&hash, "hash", None)? {
            return Ok(None);
        }
        let json: Option<String> = self.redis.run(|c| redis::cmd("HGET").arg(&hash).arg(model).query(c))?;
        Ok(self.parse(&format!("{hash} {model}"), json))
    }

    /// What every gateway answers for: the models the leader last wrote
    /// as unavailable (none if it wrote nothing, or something unreadable,
    /// which is named in the log once) and the closed hotswap models — in
    /// one round trip while none is closed.
    pub fn gates(&self) -> Result<(Unavailable, std::collections::BTreeSet<String>), RedisError> {
        let (key, set) = (self.redis.key("unavailable"), self.redis.key("hotswap-closed"));
        let mut pipe = redis::pipe();
        // MGET reads a key of another type as nil rather than failing.
        pipe.cmd("MGET").arg(&key).cmd("TYPE").arg(&set);
        let (json, kind): (Vec<Option<String>>, String) = self.redis.run(|c| pipe.query(c))?;
        let unavailable = self.parse(&key, json.into_iter().next().flatten()).unwrap_or_default();
        Ok((unavailable, self.members(&set, Some(kind))?))
    }

    /// Reads JSON `json` of `key`, an unreadable one as absent (named in
    /// the log once): a writer of another version, or a key written by
    /// hand, must not stop the fleet.
    fn parse<T: DeserializeOwned>(&self, key: &str, json: Option<String>) -> Option<T> {
        match serde_json::from_str(&json?) {
            Ok(v) => Some(v),
            Err(e) => {
                self.named.warn(key, &e.to_string());
                None
            }
        }
    }

    /// `node`'s desired state, if the leader wrote one (a key that holds
    /// something else is named in the log and read as none).
    pub fn desired(&self, node: &str) -> Result<Option<DesiredState>, RedisError> {
        let key = self.key("desired", node);
        // MGET reads a key of another type as nil rather than failing.
        let json: Vec<Option<String>> = self.redis.run(|c| redis::cmd("MGET").arg(&key).query(c))?;
        let json = json.into_iter().next().flatten();
        if json.is_none() {
            let kind: String = self.redis.run(|c| redis::cmd("TYPE").arg(&key).query(c))?;
            if kind != "none" {
                self.named.warn(&key, &format!("a {kind}, not a desired state (a JSON string)"));
            }
        }
        Ok(self.parse(&key, json))
    }

    /// Writes `node`'s report (an agent, several times a second).
    pub fn report(&self, node: &str, report: &NodeReport) -> Result<(), RedisError> {
        let json = serde_json::to_string(report).expect("a report serializes");
        self.redis.run(|c| {
            redis::cmd("SET")
                .arg(self.key("reported", node))
                .arg(&json)
                .arg("PX")
                .arg(ttl_ms())
                .query::<()>(c)
        })
    }

    /// The reports of `nodes`, in order (`None`: none, or expired).
    pub fn reports(&self, nodes: &[String]) -> Result<Vec<Option<NodeReport>>, RedisError> {
        if nodes.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = nodes.iter().map(|n| self.key("reported", n)).collect();
        let json: Vec<Option<String>> = self.redis.run(|c| redis::cmd("MGET").arg(&keys).query(c))?;
        Ok(nodes.iter().zip(json).map(|(n, j)| self.parse(&self.key("reported", n), j)).collect())
    }

    /// Forgets a node that is gone: its desired state, its report and its
    /// adapters.
    pub fn forget(&self, node: &str) -> Result<(), RedisError> {
        self.redis.run(|c| {
            redis::cmd("DEL")
                .arg(self.key("desired", node))
                .arg(self.key("reported", node))
                .arg(self.key("adapters", node))
                .query::<()>(c)
        })
    }

    /// Publishes `node`'s adapters (an agent, when they changed): an empty
    /// list removes them.
    pub fn publish_adapters(&self, node: &str, adapters: &NodeAdapters) -> Result<(), RedisError> {
        let key = self.key("adapters", node);
        if adapters.adapters.is_empty() {
            return self.redis.run(|c| redis::cmd("DEL").arg(&key).query::<()>(c));
        }
        let json = serde_json::to_string(adapters).expect("adapters serialize");
        let ttl = ADAPTERS_TTL.as_millis() as u64;
        self.redis.run(|c| redis::cmd("SET").arg(&key).arg(&json).arg("PX").arg(ttl).query::<()>(c))
    }

    /// Keeps `node`'s published adapters alive another [`ADAPTERS_TTL`];
    /// `false` when they are gone (Redis lost them, or they lapsed during
    /// an outage): the agent publishes them again.
    pub fn keep_adapters(&self, node: &str) -> Result<bool, RedisError> {
        let ttl = ADAPTERS_TTL.as_millis() as u64;
        self.redis.run(|c| redis::cmd("PEXPIRE").arg(self.key("adapters", node)).arg(ttl).query(c))
    }

    /// `node`'s adapters as its agent last published them (`None`: none,
    /// lapsed, or a value that does not parse, named in the log once).
    pub fn adapters(&self, node: &str) -> Result<Option<NodeAdapters>, RedisError> {
        let key = self.key("adapters", node);
        let json: Vec<Option<String>> = self.redis.run(|c| redis::cmd("MGET").arg(&key).query(c))?;
        Ok(self.parse(&key, json.into_iter().next().flatten()))
    }

    /// Publishes a gateway's load.
    pub fn publish_load(&self, load: &GatewayLoad, now_ms: u64) -> Result<(), RedisError> {
        let json = serde_json::to_string(load).expect("a load serializes");
        let mut pipe = redis::pipe();
        pipe.cmd("SET").arg(self.key("load", &load.gateway)).arg(&json).arg("PX").arg(ttl_ms()).ignore();
        pipe.zadd(self.redis.key("gateways"), &load.gateway, now_ms).ignore();
        self.redis.run(|c| pipe.query::<()>(c))
    }

    /// Every live gateway's load (gateways silent past the TTL drop out).
    pub fn loads(&self) -> Result<Vec<GatewayLoad>, RedisError> {
        let entries = self.redis.live_in_index(&self.redis.key("gateways"), |name| self.key("load", name))?;
        Ok(entries
            .into_iter()
            .filter_map(|(n, json)| self.parse(&self.key("load", &n), Some(json)))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use hangar_core::{DesiredReplica, ReplicaId};

    use super::*;
    use crate::lease::{LeaderLease, Leadership};
    use crate::LocalRedis;

    #[test]
    fn only_the_leader_in_its_epoch_writes_desired_state() {
        let Some(server) = LocalRedis::for_test() else { return };
        only_the_leader_writes(Redis::connect(&server.url()).unwrap());
    }

    /// On a cluster too, reports and loads (pipelines, `MGET` of several
    /// keys) included: every key is in the prefix's slot.
    #[test]
    fn on_a_cluster_only_the_leader_writes_and_reports_read_back() {
        let Some(cluster) = crate::LocalRedisCluster::for_test() else { return };
        let redis = Redis::connect(&cluster.url()).unwrap();
        only_the_leader_writes(redis.clone());
        let fleet = FleetState::new(redis.clone());
        let report = NodeReport::default();
        fleet.report("n1", &report).unwrap();
        fleet.report("n2", &report).unwrap();
        let names = ["n1".to_owned(), "n3".to_owned(), "n2".to_owned()];
        assert_eq!(fleet.reports(&names).unwrap(), [Some(report.clone()), None, Some(report)]);
        let load = GatewayLoad { gateway: "gw-a".into(), ..GatewayLoad::default() };
        fleet.publish_load(&load, 1).unwrap();
        assert_eq!(fleet.loads().unwrap(), [load]);
        let keys: Vec<String> = redis.run(|c| redis::cmd("KEYS").arg("*").query(c)).unwrap();
        assert!(keys.iter().all(|k| k.starts_with("{hangar}:")), "{keys:?}");
    }

    /// A node's adapters read back as published, are kept alive while
    /// they exist (and not once Redis lost them, which tells the agent to
    /// publish again), go when the list empties or the node is forgotten,
    /// and a value that does not parse reads as none.
    #[test]
    fn a_nodes_adapters_read_back_until_they_are_withdrawn() {
        let Some(server) = LocalRedis::for_test() else { return };
        let redis = Redis::connect(&server.url()).unwrap();
        let fleet = FleetState::new(redis.clone());
        let adapters = NodeAdapters {
            digest: "d1".into(),
            adapters: vec![hangar_core::RegisteredAdapter {
                adapter: "t/base:acme/a1".parse().unwrap(),
                artifact: "hg1:aa:bb".into(),
                bytes: 42,
            }],
        };
        assert_eq!(fleet.adapters("n1").unwrap(), None);
        assert!(!fleet.keep_adapters("n1").unwrap());
        fleet.publish_adapters("n1", &adapters).unwrap();
        assert_eq!(fleet.adapters("n1").unwrap().as_ref(), Some(&adapters));
        let ttl: i64 = redis.run(|c| redis::cmd("PTTL").arg(fleet.key("adapters", "n1")).query(c)).unwrap();
        assert!(ttl > 25_000 && ttl <= ADAPTERS_TTL.as_millis() as i64, "{ttl}");
        assert!(fleet.keep_adapters("n1").unwrap());
        fleet.publish_adapters("n1", &NodeAdapters::default()).unwrap();
        assert_eq!(fleet.adapters("n1").unwrap(), None);
        fleet.publish_adapters("n1", &adapters).unwrap();
        fleet.forget("n1").unwrap();
        assert_eq!(fleet.adapters("n1").unwrap(), None);
        redis
            .run(|c| redis::cmd("SET").arg(fleet.key("adapters", "n2")).arg("{not json").query::<()>(c))
            .unwrap();
        assert_eq!(fleet.adapters("n2").unwrap(), None);
    }

    fn only_the_leader_writes(redis: Redis) {
        let fleet = FleetState::new(redis.clone());
        let lease = LeaderLease::new(redis, "gw-a", Duration::from_secs(5));
        let Leadership::Leader { epoch, .. } = lease.tick().unwrap() else { panic!("leads") };
        let state = DesiredState {
            epoch,
            agent: "run-1".into(),
            replicas: vec![DesiredReplica {
                replica: ReplicaId::from_u128(7),
                model: "t/m".parse().unwrap(),
                warm: false,
                gpus: [(0, 10)].into(),
                gpu_fraction: Some(0.5),
                dedicated: false,
            }],
        };
        assert!(fleet.write_desired("gw-a", "n1", &state).unwrap());
        assert_eq!(fleet.desired("n1").unwrap(), Some(state.clone()));
        assert!(!fleet.write_desired("gw-b", "n1", &DesiredState::default()).unwrap(), "not the leader");
        let stale = DesiredState { epoch: epoch + 1, ..state.clone() };
        assert!(!fleet.write_desired("gw-a", "n1", &stale).unwrap(), "not its epoch");
        fleet.forget("n1").unwrap();
        assert_eq!(fleet.desired("n1").unwrap(), None);
    }

    #[test]
    fn only_the_leader_writes_which_models_are_unavailable_and_the_operators_word_outlives_it() {
        let Some(server) = LocalRedis::for_test() else { return };
        let redis = Redis::connect(&server.url()).unwrap();
        let fleet = FleetState::new(redis.clone());
        assert_eq!(fleet.gates().unwrap(), Default::default(), "nothing written yet");
        let lease = LeaderLease::new(redis.clone(), "gw-a", Duration::from_secs(5));
        let Leadership::Leader { epoch, .. } = lease.tick().unwrap() else { panic!("leads") };
        let down: Unavailable = [("t/big".to_owned(), "no replica of `t/big` can run now".to_owned())].into();
        assert!(fleet.write_unavailable("gw-a", epoch, &down).unwrap());
        assert!(!fleet.write_unavailable("gw-b", epoch, &Unavailable::new()).unwrap(), "not the leader");
        assert!(!fleet.write_unavailable("gw-a", epoch + 1, &Unavailable::new()).unwrap(), "not its epoch");
        fleet.close_hotswap("t/swap", true).unwrap();
        fleet.close_hotswap("t/other", true).unwrap();
        fleet.close_hotswap("t/other", false).unwrap();
        let closed: std::collections::BTreeSet<String> = ["t/swap".to_owned()].into();
        assert_eq!(fleet.gates().unwrap(), (down.clone(), closed.clone()));
        fleet.set_override("t/a", Some(ScalingOverride::Pin(3))).unwrap();
        fleet.set_override("t/b", Some(ScalingOverride::Freeze)).unwrap();
        fleet.set_override("t/c", Some(ScalingOverride::Freeze)).unwrap();
        fleet.set_override("t/c", None).unwrap();
        redis
            .run(|c| {
                redis::cmd("HSET").arg(redis.key("scaling-overrides")).arg("t/d").arg("{").query::<()>(c)
            })
            .unwrap();
        let overrides: std::collections::BTreeMap<String, ScalingOverride> =
            [("t/a".to_owned(), ScalingOverride::Pin(3)), ("t/b".to_owned(), ScalingOverride::Freeze)].into();
        assert_eq!(fleet.overrides().unwrap(), overrides, "the unreadable one left out");
        assert_eq!(fleet.override_of("t/a").unwrap(), Some(ScalingOverride::Pin(3)));
        assert_eq!(fleet.override_of("t/c").unwrap(), None, "released");
        assert_eq!(fleet.override_of("t/d").unwrap(), None, "unreadable");
        // Keys of another type, written by hand, read as none.
        for key in ["hotswap-closed", "scaling-overrides"] {
            redis.run(|c| redis::cmd("SET").arg(redis.key(key)).arg("x").query::<()>(c)).unwrap();
        }
        assert_eq!(fleet.overrides().unwrap(), Default::default());
        assert_eq!(fleet.override_of("t/a").unwrap(), None);
        assert_eq!(fleet.closed_hotswap().unwrap(), Default::default());
        assert_eq!(fleet.gates().unwrap(), (down.clone(), Default::default()));
        fleet.close_hotswap("t/swap", true).unwrap_err();
        redis.run(|c| redis::cmd("DEL").arg(redis.key("hotswap-closed")).query::<()>(c)).unwrap();
        fleet.close_hotswap("t/swap", true).unwrap();
        // A key written by hand that is not a JSON object reads as none.
        redis.run(|c| redis::cmd("SET").arg(redis.key("unavailable")).arg("[1]").query::<()>(c)).unwrap();
        assert_eq!(fleet.gates().unwrap(), (Unavailable::new(), closed));
    }

    #[test]
    fn drained_nodes_read_back_and_a_key_of_another_type_reads_as_none() {
        let Some(server) = LocalRedis::for_test() else { return };
        let redis = Redis::connect(&server.url()).unwrap();
        let fleet = FleetState::new(redis.clone());
        assert!(fleet.drained_nodes().unwrap().is_empty());
        fleet.drain_node("n1", true).unwrap();
        fleet.drain_node("n2", true).unwrap();
        fleet.drain_node("n2", false).unwrap();
        assert_eq!(fleet.drained_nodes().unwrap(), ["n1".to_owned()].into());
        redis.run(|c| redis::cmd("DEL").arg(redis.key("draining")).query::<()>(c)).unwrap();
        redis.run(|c| redis::cmd("SET").arg(redis.key("draining")).arg("x").query::<()>(c)).unwrap();
        assert!(fleet.drained_nodes().unwrap().is_empty(), "named in the log and read as none");
        fleet.drain_node("n1", true).unwrap_err();
    }
}
