//! The node registry: each `hangar agent` holds its node's name with a
//! heartbeat; the leader reads which nodes are alive.
//!
//! A node is the hash `hangar:node:NAME` (`agent`: the run holding it,
//! `record`: its [`NodeRecord`] as JSON) with a time to live, renewed by
//! every heartbeat; a node whose agent is silent for the TTL is gone the
//! moment the TTL passes (Redis treats an expired key as absent on
//! access). `hangar:nodes` indexes the names so the leader needs no
//! `SCAN`; it drops names whose node is gone when it reads them.
//!
//! Each step is one Lua script, so two agents asking for one name at once
//! cannot both get it.

use std::time::Duration;

use hangar_core::NodeRecord;
use redis::Script;

use crate::{Redis, RedisError, PREFIX};

/// How long a node stays registered without a heartbeat. The leader
/// declares it dead at once after (target: within 10 s of its last
/// heartbeat).
pub const NODE_TTL: Duration = Duration::from_secs(8);

/// How often an agent renews its registration: four chances before the
/// TTL runs out.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(2);

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
    /// A stored record could not be read.
    #[error("node registry: the record of `{name}` is unreadable: {why}")]
    Corrupt {
        /// The node.
        name: String,
        /// The parse error.
        why: String,
    },
}

/// What a heartbeat found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Heartbeat {
    /// Renewed.
    Renewed,
    /// The registration was gone (a Redis that lost its data, or this
    /// agent silent past the TTL and declared dead) and has been made
    /// again: the leader sees a node join.
    Reregistered,
    /// Another agent holds the name now (this one was declared dead and
    /// replaced): this agent must stop its engines and exit.
    Taken {
        /// The agent run that holds it.
        holder: String,
    },
}

/// ARGV: prefix, name, agent, record json, ttl ms, now ms. Returns
/// {1} registered / {0, holder record json}.
const REGISTER: &str = r#"
local key = ARGV[1] .. ':node:' .. ARGV[2]
local holder = redis.call('HGET', key, 'agent')
if holder and holder ~= ARGV[3] then
  return {0, redis.call('HGET', key, 'record')}
end
redis.call('HSET', key, 'agent', ARGV[3], 'record', ARGV[4])
redis.call('PEXPIRE', key, ARGV[5])
redis.call('ZADD', ARGV[1] .. ':nodes', ARGV[6], ARGV[2])
return {1}
"#;

/// ARGV as REGISTER. Returns 1 renewed, 2 re-registered, or the holder.
const HEARTBEAT: &str = r#"
local key = ARGV[1] .. ':node:' .. ARGV[2]
local holder = redis.call('HGET', key, 'agent')
if holder and holder ~= ARGV[3] then return holder end
redis.call('HSET', key, 'agent', ARGV[3], 'record', ARGV[4])
redis.call('PEXPIRE', key, ARGV[5])
redis.call('ZADD', ARGV[1] .. ':nodes', ARGV[6], ARGV[2])
if holder then return 1 end
return 2
"#;

/// ARGV: prefix, name, agent. Deletes the node if this agent holds it.
const DEREGISTER: &str = r#"
local key = ARGV[1] .. ':node:' .. ARGV[2]
if redis.call('HGET', key, 'agent') ~= ARGV[3] then return 0 end
redis.call('DEL', key)
redis.call('ZREM', ARGV[1] .. ':nodes', ARGV[2])
return 1
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
    /// The registry on `redis`, nodes living `ttl` past their last
    /// heartbeat ([`NODE_TTL`] in production; tests shorten it).
    pub fn new(redis: Redis, ttl: Duration) -> Registry {
        let scripts = Scripts {
            register: Script::new(REGISTER),
            heartbeat: Script::new(HEARTBEAT),
            deregister: Script::new(DEREGISTER),
        };
        Registry { redis, ttl, scripts: std::sync::Arc::new(scripts) }
    }

    /// Registers `record` under its name for its agent run; refused if
    /// another live agent run holds the name. `now` (ms since the epoch)
    /// orders the index.
    pub fn register(&self, record: &NodeRecord, now: u64) -> Result<(), RegistryError> {
        let json = serde_json::to_string(record).expect("a node record serializes");
        let (ttl, name, agent) = (millis(self.ttl), &record.name, &record.agent);
        let answer: Vec<String> = self.redis.run(|c| {
            self.scripts.register.arg(PREFIX).arg(name).arg(agent).arg(&json).arg(ttl).arg(now).invoke(c)
        })?;
        match answer.as_slice() {
            [ok] if ok == "1" => Ok(()),
            [_, holder] => {
                let holder: NodeRecord = serde_json::from_str(holder)
                    .map_err(|e| RegistryError::Corrupt { name: name.clone(), why: e.to_string() })?;
                Err(RegistryError::NameTaken { name: name.clone(), holder: holder.agent, url: holder.url })
            }
            other => Err(RegistryError::Corrupt {
                name: name.clone(),
                why: format!("register answered {other:?}"),
            }),
        }
    }

    /// Renews `record`'s registration (and updates what it says).
    pub fn heartbeat(&self, record: &NodeRecord, now: u64) -> Result<Heartbeat, RegistryError> {
        let json = serde_json::to_string(record).expect("a node record serializes");
        let (ttl, name, agent) = (millis(self.ttl), &record.name, &record.agent);
        let answer: redis::Value = self.redis.run(|c| {
            self.scripts.heartbeat.arg(PREFIX).arg(name).arg(agent).arg(&json).arg(ttl).arg(now).invoke(c)
        })?;
        Ok(match answer {
            redis::Value::Int(1) => Heartbeat::Renewed,
            redis::Value::Int(_) => Heartbeat::Reregistered,
            other => Heartbeat::Taken {
                holder: redis::from_redis_value(other).unwrap_or_else(|_| "an unknown agent".into()),
            },
        })
    }

    /// Removes `record`'s registration if its agent run still holds it
    /// (an agent leaving on purpose: the leader need not wait for the
    /// TTL). Whether it did.
    pub fn deregister(&self, record: &NodeRecord) -> Result<bool, RegistryError> {
        let (name, agent) = (&record.name, &record.agent);
        let removed: i64 =
            self.redis.run(|c| self.scripts.deregister.arg(PREFIX).arg(name).arg(agent).invoke(c))?;
        Ok(removed == 1)
    }

    /// Every live node, by name; names whose node is gone leave the index.
    pub fn live(&self) -> Result<Vec<NodeRecord>, RegistryError> {
        let entries = self.redis.live_in_index(&format!("{PREFIX}:nodes"), |name| {
            let mut read = redis::cmd("HGET");
            read.arg(format!("{PREFIX}:node:{name}")).arg("record");
            read
        })?;
        entries
            .into_iter()
            .map(|(name, json)| {
                serde_json::from_str(&json).map_err(|e| RegistryError::Corrupt { name, why: e.to_string() })
            })
            .collect()
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
            artifacts: vec!["hg1:abc".into()],
            url: format!("http://{name}:9400"),
            draining: false,
        }
    }

    #[test]
    fn a_live_name_is_refused_to_another_agent_and_free_once_it_expires() {
        let Some(server) = LocalRedis::for_test() else { return };
        let registry = Registry::new(Redis::connect(&server.url()).unwrap(), Duration::from_millis(300));
        let a = record("gpu-a", "run-1");
        registry.register(&a, 1).unwrap();
        // The same run registering again (a retry) is fine.
        registry.register(&a, 2).unwrap();
        let err = registry.register(&record("gpu-a", "run-2"), 3).unwrap_err();
        assert!(
            err.to_string().contains("`gpu-a` is held by another live agent (run-1 at http://gpu-a:9400)"),
            "{err}"
        );
        assert_eq!(registry.live().unwrap(), vec![a.clone()]);
        // Heartbeats keep it; silence past the TTL frees the name.
        for t in 0..4 {
            std::thread::sleep(Duration::from_millis(100));
            assert_eq!(registry.heartbeat(&a, 10 + t).unwrap(), Heartbeat::Renewed);
        }
        std::thread::sleep(Duration::from_millis(400));
        assert!(registry.live().unwrap().is_empty());
        let b = record("gpu-a", "run-2");
        registry.register(&b, 20).unwrap();
        // The old run comes back: it has been replaced and must stop.
        assert_eq!(registry.heartbeat(&a, 21).unwrap(), Heartbeat::Taken { holder: "run-2".into() });
        assert!(!registry.deregister(&a).unwrap(), "the old run cannot remove the new one");
        assert!(registry.deregister(&b).unwrap());
        assert!(registry.live().unwrap().is_empty());
    }

    #[test]
    fn an_agent_registers_again_after_redis_loses_its_data() {
        let Some(mut server) = LocalRedis::for_test() else { return };
        let redis = Redis::connect(&server.url()).unwrap();
        let registry = Registry::new(redis.clone(), Duration::from_secs(8));
        let a = record("gpu-a", "run-1");
        registry.register(&a, 1).unwrap();
        // A restart keeps it (AOF keeps keys and their expiry).
        server.restart().unwrap();
        assert_eq!(registry.heartbeat(&a, 2).unwrap(), Heartbeat::Renewed);
        // A Redis that lost everything (a fresh replica promoted, say).
        redis.run(|c| redis::cmd("FLUSHALL").query::<()>(c)).unwrap();
        assert_eq!(registry.heartbeat(&a, 3).unwrap(), Heartbeat::Reregistered);
        assert_eq!(registry.live().unwrap(), vec![a]);
    }
}
