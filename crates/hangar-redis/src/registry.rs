//! The node registry: each `hangar agent` holds its node's name with a
//! heartbeat; gateways read which nodes are registered, and how recently
//! each has beaten.
//!
//! A node is the hash `hangar:node:NAME`: `agent`, the run holding it;
//! `record`, its [`NodeRecord`] as JSON; `beat`, a counter every heartbeat
//! raises; `beat_at`, Redis's clock (ms) at the last one; `left` once its
//! agent left on purpose. `hangar:nodes` indexes the names so readers need
//! no `SCAN`.
//!
//! **Death is not decided here.** A registration does not expire when its
//! agent falls silent for a few seconds — a Redis outage silences every
//! agent at once, and a fleet that concluded "dead" from that would
//! restart everything. Readers see each node's `beat` and decide with a
//! [`crate::liveness::Liveness`]: silence counts only while Redis answers.
//! The leader removes a node it declared dead ([`Registry::declare_dead`]);
//! a registration nobody removes lapses after [`FORGET_AFTER`] without a
//! heartbeat, so a fleet with no leader does not keep names forever.
//!
//! Who may hold a name is decided on Redis's clock: another run may take a
//! name whose holder left, or has not beaten for the registry's TTL
//! (8 s in production). Each step is one Lua script, so two agents asking
//! for one name at once cannot both get it; a key of the wrong type where
//! a node's registration belongs is named, and replaced by the agent whose
//! name it is.

use std::time::Duration;

use hangar_core::NodeRecord;
use redis::Script;

use crate::{Redis, RedisError};

/// How long an agent may go without a heartbeat before another run may
/// take its name, and (observed while Redis answers) before the leader
/// declares its node dead. Target: dead within 10 s of its last heartbeat.
pub const NODE_TTL: Duration = Duration::from_secs(8);

/// How often an agent renews its registration: four chances before the
/// TTL runs out.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(2);

/// How long a registration nobody renews or removes is kept (a fleet with
/// no leader to declare its nodes dead).
pub const FORGET_AFTER: Duration = Duration::from_secs(3600);

/// How long a node that left on purpose stays listed as left (so every
/// gateway sees it leave, rather than fall silent).
const LEFT_FOR: Duration = Duration::from_secs(60);

/// Why a registration failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// Another live agent holds the name.
    #[error(
        "node name `{name}` is held by another live agent ({holder} at {url}); stop it, or give this agent another --name"
    )]
    NameTaken {
        /// The name.
        name: String,
        /// The holder's agent run id.
        holder: String,
        /// The holder's URL.
        url: String,
    },
    /// Redis failed.
    #[error(transparent)]
    Redis(#[from] RedisError),
    /// A stored value could not be read.
    #[error("node registry: `{key}` is unreadable ({why}); delete the key, its agent registers again")]
    Corrupt {
        /// The Redis key.
        key: String,
        /// What is wrong with it.
        why: String,
    },
}

/// What a heartbeat found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Heartbeat {
    /// Renewed.
    Renewed,
    /// The registration was gone (a Redis that lost its data, or this
    /// agent declared dead by the leader) and has been made again: the
    /// leader sees the node join, with what it runs.
    Reregistered,
    /// Another agent holds the name now (this one was silent past the TTL
    /// and replaced): this agent must stop its engines and exit.
    Taken {
        /// The agent run that holds it.
        holder: String,
    },
}

/// One registered node as a reader sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// What its agent registered.
    pub record: NodeRecord,
    /// Its heartbeat counter: a reader that sees it unchanged saw silence.
    pub beat: u64,
    /// Its agent left on purpose (SIGTERM).
    pub left: bool,
}

/// Every registration, and the keys that could not be read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Registrations {
    /// The readable ones, by name.
    pub nodes: Vec<Registration>,
    /// `(key, what is wrong)` for each one that is not a registration.
    pub bad: Vec<(String, String)>,
}

/// ARGV: prefix, name, agent, record json, ttl ms, forget ms. Returns
/// {1} registered, {2} registered after replacing a key of another type,
/// or {0, holder record json}.
const REGISTER: &str = r#"
local key = ARGV[1] .. ':node:' .. ARGV[2]
local now = redis.call('TIME')
now = now[1] * 1000 + math.floor(now[2] / 1000)
local kind = redis.call('TYPE', key).ok
local answer = 1
if kind ~= 'none' and kind ~= 'hash' then
  redis.call('DEL', key)
  answer = 2
elseif kind == 'hash' then
  local v = redis.call('HMGET', key, 'agent', 'beat_at', 'left', 'record')
  local at = tonumber(v[2]) or 0
  if v[1] and v[1] ~= ARGV[3] and not v[3] and now - at < tonumber(ARGV[5]) then
    return {0, v[4] or ''}
  end
  if v[1] ~= ARGV[3] then redis.call('DEL', key) end
end
redis.call('HSET', key, 'agent', ARGV[3], 'record', ARGV[4], 'beat_at', now)
redis.call('HDEL', key, 'left')
redis.call('HINCRBY', key, 'beat', 1)
redis.call('PEXPIRE', key, ARGV[6])
redis.call('ZADD', ARGV[1] .. ':nodes', now, ARGV[2])
return {answer}
"#;

/// ARGV as REGISTER. Returns {1} renewed, {2} re-registered, {3}
/// re-registered over a key of another type, or {0, holder}.
const HEARTBEAT: &str = r#"
local key = ARGV[1] .. ':node:' .. ARGV[2]
local kind = redis.call('TYPE', key).ok
local holder = nil
if kind == 'hash' then holder = redis.call('HGET', key, 'agent') end
if holder and holder ~= ARGV[3] then return {0, holder} end
local now = redis.call('TIME')
now = now[1] * 1000 + math.floor(now[2] / 1000)
local answer = 1
if kind ~= 'none' and kind ~= 'hash' then
  redis.call('DEL', key)
  answer = 3
elseif not holder then
  answer = 2
end
redis.call('HSET', key, 'agent', ARGV[3], 'record', ARGV[4], 'beat_at', now)
redis.call('HINCRBY', key, 'beat', 1)
redis.call('PEXPIRE', key, ARGV[6])
redis.call('ZADD', ARGV[1] .. ':nodes', now, ARGV[2])
return {answer}
"#;

/// ARGV: prefix, name, agent, left ms. Marks the node left if this agent
/// holds it.
const DEREGISTER: &str = r#"
local key = ARGV[1] .. ':node:' .. ARGV[2]
if redis.call('TYPE', key).ok ~= 'hash' or redis.call('HGET', key, 'agent') ~= ARGV[3] then return 0 end
redis.call('HSET', key, 'left', 1)
redis.call('PEXPIRE', key, ARGV[4])
return 1
"#;

/// ARGV: prefix, name, agent. Removes the node, its desired state and its
/// report, if that run still holds it.
const DECLARE_DEAD: &str = r#"
local key = ARGV[1] .. ':node:' .. ARGV[2]
if redis.call('TYPE', key).ok == 'hash' and redis.call('HGET', key, 'agent') ~= ARGV[3] then return 0 end
redis.call('DEL', key, ARGV[1] .. ':desired:' .. ARGV[2], ARGV[1] .. ':reported:' .. ARGV[2])
redis.call('ZREM', ARGV[1] .. ':nodes', ARGV[2])
return 1
"#;

/// ARGV: prefix. Every indexed name: {name, kind, agent, record, beat,
/// left} (the last four empty unless kind is hash); names whose key is gone
/// leave the index.
const READ_ALL: &str = r#"
local index = ARGV[1] .. ':nodes'
local out = {}
for _, name in ipairs(redis.call('ZRANGE', index, 0, -1)) do
  local key = ARGV[1] .. ':node:' .. name
  local kind = redis.call('TYPE', key).ok
  if kind == 'none' then
    redis.call('ZREM', index, name)
  elseif kind == 'hash' then
    local v = redis.call('HMGET', key, 'agent', 'record', 'beat', 'left')
    table.insert(out, {name, kind, v[1] or '', v[2] or '', v[3] or '0', v[4] or ''})
  else
    table.insert(out, {name, kind, '', '', '0', ''})
  end
end
return out
"#;

/// The registry on one Redis.
#[derive(Clone)]
pub struct Registry {
    redis: Redis,
    ttl: Duration,
    scripts: std::sync::Arc<Scripts>,
}

struct Scripts {
    register: Script,
    heartbeat: Script,
    deregister: Script,
    declare_dead: Script,
    read_all: Script,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").field("redis", &self.redis).field("ttl", &self.ttl).finish()
    }
}

fn millis(d: Duration) -> u64 {
    d.as_millis() as u64
}

impl Registry {
    /// Runs `script` (registering or renewing) for `record`: name, agent,
    /// the record, the TTL and how long a left node is kept.
    fn write_record(&self, script: &Script, record: &NodeRecord) -> Result<Vec<String>, RedisError> {
        let json = serde_json::to_string(record).expect("a node record serializes");
        let (ttl, forget) = (millis(self.ttl), millis(FORGET_AFTER));
        self.redis.run(|c| {
            self.redis
                .script(script)
                .arg(&record.name)
                .arg(&record.agent)
                .arg(&json)
                .arg(ttl)
                .arg(forget)
                .invoke(c)
        })
    }

    /// The Redis key of node `name`'s registration.
    fn node_key(&self, name: &str) -> String {
        self.redis.key(&format!("node:{name}"))
    }

    /// The registry on `redis`: a name whose holder has not beaten for
    /// `ttl` may be taken by another run ([`NODE_TTL`] in production; tests
    /// shorten it).
    pub fn new(redis: Redis, ttl: Duration) -> Registry {
        let scripts = Scripts {
            register: Script::new(REGISTER),
            heartbeat: Script::new(HEARTBEAT),
            deregister: Script::new(DEREGISTER),
            declare_dead: Script::new(DECLARE_DEAD),
            read_all: Script::new(READ_ALL),
        };
        Registry { redis, ttl, scripts: std::sync::Arc::new(scripts) }
    }

    /// The silence after which a node may be declared dead and its name
    /// taken.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Registers `record` under its name for its agent run; refused if
    /// another run holds the name and beat within the TTL (on Redis's
    /// clock). A key of another type in its place is replaced, and named
    /// in the log.
    pub fn register(&self, record: &NodeRecord) -> Result<(), RegistryError> {
        let name = &record.name;
        let answer = self.write_record(&self.scripts.register, record)?;
        match answer.as_slice() {
            [ok] if ok == "1" => Ok(()),
            [ok] if ok == "2" => {
                tracing::warn!(key = %self.node_key(name), "the key held something other than a node registration; replaced it");
                Ok(())
            }
            [_, holder] => {
                let key = self.node_key(name);
                let holder: NodeRecord = serde_json::from_str(holder)
                    .map_err(|e| RegistryError::Corrupt { key, why: e.to_string() })?;
                Err(RegistryError::NameTaken { name: name.clone(), holder: holder.agent, url: holder.url })
            }
            other => Err(RegistryError::Corrupt {
                key: self.node_key(name),
                why: format!("register answered {other:?}"),
            }),
        }
    }

    /// Renews `record`'s registration (and updates what it says).
    pub fn heartbeat(&self, record: &NodeRecord) -> Result<Heartbeat, RegistryError> {
        let name = &record.name;
        let answer = self.write_record(&self.scripts.heartbeat, record)?;
        Ok(match answer.as_slice() {
            [ok] if ok == "1" => Heartbeat::Renewed,
            [ok] if ok == "3" => {
                tracing::warn!(key = %self.node_key(name), "the key held something other than a node registration; registered again over it");
                Heartbeat::Reregistered
            }
            [_] => Heartbeat::Reregistered,
            [_, holder] => Heartbeat::Taken { holder: holder.clone() },
            other => {
                return Err(RegistryError::Corrupt {
                    key: self.node_key(name),
                    why: format!("heartbeat answered {other:?}"),
                })
            }
        })
    }

    /// Marks `record`'s registration left, if its agent run still holds it
    /// (an agent leaving on purpose: the leader places its replicas
    /// elsewhere at once, and another run may take the name). Whether it
    /// did.
    pub fn deregister(&self, record: &NodeRecord) -> Result<bool, RegistryError> {
        let (name, agent, left) = (&record.name, &record.agent, millis(LEFT_FOR));
        let marked: i64 = self
            .redis
            .run(|c| self.redis.script(&self.scripts.deregister).arg(name).arg(agent).arg(left).invoke(c))?;
        Ok(marked == 1)
    }

    /// Removes node `name` — its registration, desired state and report —
    /// if run `agent` still holds it (the leader, which declared it dead).
    /// Whether it did: a run that registered meanwhile is left alone.
    pub fn declare_dead(&self, name: &str, agent: &str) -> Result<bool, RegistryError> {
        let removed: i64 = self
            .redis
            .run(|c| self.redis.script(&self.scripts.declare_dead).arg(name).arg(agent).invoke(c))?;
        Ok(removed == 1)
    }

    /// Every registration, and every key where one belongs that is not one
    /// (of another type, or with a record that does not parse) — to be
    /// named and skipped, never to stop the reader.
    pub fn registered(&self) -> Result<Registrations, RegistryError> {
        let rows: Vec<Vec<String>> =
            self.redis.run(|c| self.redis.script(&self.scripts.read_all).invoke(c))?;
        let mut out = Registrations::default();
        for row in rows {
            let [name, kind, agent, record, beat, left] = <[String; 6]>::try_from(row).map_err(|r| {
                RegistryError::Corrupt { key: self.redis.key("nodes"), why: format!("read {r:?}") }
            })?;
            let key = self.node_key(&name);
            if kind != "hash" {
                out.bad.push((key, format!("a {kind}, not a node registration (a hash)")));
                continue;
            }
            match serde_json::from_str::<NodeRecord>(&record) {
                Ok(r) if r.name == name && r.agent == agent => out.nodes.push(Registration {
                    record: r,
                    beat: beat.parse().unwrap_or(0),
                    left: !left.is_empty(),
                }),
                Ok(r) => {
                    out.bad.push((key, format!("its record names node `{}` of run `{}`", r.name, r.agent)))
                }
                Err(e) => out.bad.push((key, format!("its record is not a node record: {e}"))),
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LocalRedis;

    fn record(name: &str, agent: &str) -> NodeRecord {
        NodeRecord {
            name: name.into(),
            agent: agent.into(),
            gpus: 8,
            gpu_memory: "80GB".parse().unwrap(),
            virtual_gpus: false,
            gpu_kind: Some("a100-80gb".into()),
            cpu_memory: "512GB".parse().unwrap(),
            url: format!("http://{name}:9400"),
            draining: false,
        }
    }

    fn names(r: &Registrations) -> Vec<(&str, u64, bool)> {
        r.nodes.iter().map(|n| (n.record.name.as_str(), n.beat, n.left)).collect()
    }

    #[test]
    fn a_live_name_is_refused_to_another_run_and_free_once_its_holder_is_silent() {
        let Some(server) = LocalRedis::for_test() else { return };
        a_live_name_is_held(Redis::connect(&server.url()).unwrap());
    }

    #[test]
    fn on_a_cluster_a_live_name_is_held() {
        let Some(cluster) = crate::LocalRedisCluster::for_test() else { return };
        a_live_name_is_held(Redis::connect(&cluster.url()).unwrap());
    }

    fn a_live_name_is_held(redis: Redis) {
        let registry = Registry::new(redis, Duration::from_millis(300));
        let a = record("gpu-a", "run-1");
        registry.register(&a).unwrap();
        // The same run registering again (a retry) is fine.
        registry.register(&a).unwrap();
        let err = registry.register(&record("gpu-a", "run-2")).unwrap_err();
        assert!(
            err.to_string().contains("`gpu-a` is held by another live agent (run-1 at http://gpu-a:9400)"),
            "{err}"
        );
        assert_eq!(names(&registry.registered().unwrap()), vec![("gpu-a", 2, false)]);
        // Heartbeats raise the beat; silence past the TTL frees the name
        // for another run, though the registration is still there (death
        // is the readers' to decide).
        for expected in 3..7 {
            std::thread::sleep(Duration::from_millis(100));
            assert_eq!(registry.heartbeat(&a).unwrap(), Heartbeat::Renewed);
            assert_eq!(names(&registry.registered().unwrap()), vec![("gpu-a", expected, false)]);
        }
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(names(&registry.registered().unwrap()), vec![("gpu-a", 6, false)]);
        let b = record("gpu-a", "run-2");
        registry.register(&b).unwrap();
        assert_eq!(registry.registered().unwrap().nodes[0].record, b);
        // The old run comes back: it has been replaced and must stop.
        assert_eq!(registry.heartbeat(&a).unwrap(), Heartbeat::Taken { holder: "run-2".into() });
        assert!(!registry.deregister(&a).unwrap(), "the old run cannot remove the new one");
        assert!(!registry.declare_dead("gpu-a", "run-1").unwrap(), "nor can its death");
        // Leaving marks it left, and the name is free at once.
        assert!(registry.deregister(&b).unwrap());
        assert_eq!(names(&registry.registered().unwrap()), vec![("gpu-a", 1, true)]);
        let c = record("gpu-a", "run-3");
        registry.register(&c).unwrap();
        assert!(registry.declare_dead("gpu-a", "run-3").unwrap());
        assert!(registry.registered().unwrap().nodes.is_empty());
    }

    #[test]
    fn an_agent_registers_again_after_redis_loses_its_data() {
        let Some(mut server) = LocalRedis::for_test() else { return };
        let redis = Redis::connect(&server.url()).unwrap();
        let registry = Registry::new(redis.clone(), Duration::from_secs(8));
        let a = record("gpu-a", "run-1");
        registry.register(&a).unwrap();
        // A restart keeps it (AOF keeps keys and their expiry).
        server.restart().unwrap();
        assert_eq!(registry.heartbeat(&a).unwrap(), Heartbeat::Renewed);
        // A Redis that lost everything (a fresh replica promoted, say).
        redis.run(|c| redis::cmd("FLUSHALL").query::<()>(c)).unwrap();
        assert_eq!(registry.heartbeat(&a).unwrap(), Heartbeat::Reregistered);
        assert_eq!(registry.registered().unwrap().nodes[0].record, a);
    }

    #[test]
    fn keys_that_are_not_registrations_are_named_and_skipped() {
        let Some(server) = LocalRedis::for_test() else { return };
        let redis = Redis::connect(&server.url()).unwrap();
        let registry = Registry::new(redis.clone(), Duration::from_secs(8));
        registry.register(&record("good", "run-1")).unwrap();
        let raw = |args: &[&str]| redis.run(|c| redis::cmd(args[0]).arg(&args[1..]).query::<()>(c)).unwrap();
        raw(&["ZADD", "hangar:nodes", "1", "str", "2", "json", "3", "other"]);
        raw(&["SET", "hangar:node:str", "hello"]);
        raw(&["HSET", "hangar:node:json", "agent", "run-9", "record", "{not json"]);
        raw(&[
            "HSET",
            "hangar:node:other",
            "agent",
            "run-9",
            "record",
            &serde_json::to_string(&record("else", "run-9")).unwrap(),
        ]);
        let read = registry.registered().unwrap();
        assert_eq!(names(&read), vec![("good", 1, false)]);
        let bad: Vec<&str> = read.bad.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(bad, ["hangar:node:str", "hangar:node:json", "hangar:node:other"], "{:?}", read.bad);
        assert!(read.bad[0].1.contains("a string, not a node registration"), "{:?}", read.bad);
        assert!(read.bad[1].1.contains("not a node record"), "{:?}", read.bad);
        assert!(read.bad[2].1.contains("names node `else`"), "{:?}", read.bad);
        // The agent whose name it is replaces what is there.
        registry.register(&record("str", "run-2")).unwrap();
        assert_eq!(registry.heartbeat(&record("json", "run-9")).unwrap(), Heartbeat::Renewed);
        let read = registry.registered().unwrap();
        let mut now = names(&read);
        now.sort();
        assert_eq!(now, vec![("good", 1, false), ("json", 1, false), ("str", 1, false)]);
    }
}
