//! The leader lease: of all the gateways sharing a Redis, the one holding
//! `hangar:leader` runs placement and scaling for the fleet.
//!
//! The lease is a key holding the holder's id with a time to live; the
//! holder renews it every third of the TTL. When the holder dies, the key
//! expires and the next gateway to ask takes it: a new leader within one
//! TTL (plus one renewal period). Each taking increments
//! `hangar:leader:epoch`, the fencing token: what a leader writes in the
//! fleet's name carries its epoch, and a write of an older epoch than the
//! current one comes from a leader that lost the lease without knowing.

use std::time::Duration;

use redis::Script;

use crate::{Redis, RedisError, PREFIX};

/// How long the lease outlives its holder's last renewal.
pub const LEASE_TTL: Duration = Duration::from_secs(5);

/// What asking for the lease found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leadership {
    /// This gateway leads, in `epoch` (new when it just took the lease).
    Leader {
        /// The fencing token of this tenure.
        epoch: u64,
        /// Whether this ask took it (a tenure begins).
        took: bool,
    },
    /// Another gateway leads.
    Follower {
        /// Its id.
        leader: String,
    },
}

/// ARGV: prefix, me, ttl ms. Returns {1, epoch, took} or {0, holder}.
const TICK: &str = r#"
local key = ARGV[1] .. ':leader'
local holder = redis.call('GET', key)
if holder == ARGV[2] then
  redis.call('PEXPIRE', key, ARGV[3])
  return {1, tonumber(redis.call('GET', key .. ':epoch') or '0'), 0}
end
if holder then return {0, holder} end
redis.call('SET', key, ARGV[2], 'PX', ARGV[3])
return {1, redis.call('INCR', key .. ':epoch'), 1}
"#;

/// ARGV: prefix, me. Gives the lease up if held.
const RESIGN: &str = r#"
local key = ARGV[1] .. ':leader'
if redis.call('GET', key) == ARGV[2] then return redis.call('DEL', key) end
return 0
"#;

/// One gateway's claim on the lease.
pub struct LeaderLease {
    redis: Redis,
    me: String,
    ttl: Duration,
    tick: Script,
    resign: Script,
}

impl std::fmt::Debug for LeaderLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaderLease").field("me", &self.me).field("ttl", &self.ttl).finish()
    }
}

impl LeaderLease {
    /// The lease as gateway `me` asks for it ([`LEASE_TTL`] in
    /// production).
    pub fn new(redis: Redis, me: impl Into<String>, ttl: Duration) -> LeaderLease {
        LeaderLease { redis, me: me.into(), ttl, tick: Script::new(TICK), resign: Script::new(RESIGN) }
    }

    /// The id this gateway asks as.
    pub fn holder(&self) -> &str {
        &self.me
    }

    /// How often to call [`LeaderLease::tick`]: a third of the TTL.
    pub fn period(&self) -> Duration {
        self.ttl / 3
    }

    /// Renews the lease if this gateway holds it, takes it if nobody
    /// does. A leader whose tick fails (Redis unreachable) must act as a
    /// follower until a tick succeeds: its lease may have passed.
    pub fn tick(&self) -> Result<Leadership, RedisError> {
        let ttl = self.ttl.as_millis() as u64;
        let answer: Vec<redis::Value> =
            self.redis.run(|c| self.tick.arg(PREFIX).arg(&self.me).arg(ttl).invoke(c))?;
        let text = |v: &redis::Value| redis::from_redis_value::<String>(v.clone()).unwrap_or_default();
        let number = |v: &redis::Value| redis::from_redis_value::<u64>(v.clone()).unwrap_or(0);
        Ok(match answer.as_slice() {
            [flag, epoch, took] if number(flag) == 1 => {
                Leadership::Leader { epoch: number(epoch), took: number(took) == 1 }
            }
            [_, holder] => Leadership::Follower { leader: text(holder) },
            _ => Leadership::Follower { leader: String::new() },
        })
    }

    /// Gives the lease up at once (a gateway stopping on purpose), so
    /// another need not wait for the TTL.
    pub fn resign(&self) -> Result<bool, RedisError> {
        let n: i64 = self.redis.run(|c| self.resign.arg(PREFIX).arg(&self.me).invoke(c))?;
        Ok(n == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LocalRedis;

    #[test]
    fn one_leader_at_a_time_and_a_silent_one_is_replaced_within_the_ttl() {
        let Some(server) = LocalRedis::for_test() else { return };
        let redis = Redis::connect(&server.url()).unwrap();
        let ttl = Duration::from_millis(300);
        let (a, b) = (LeaderLease::new(redis.clone(), "gw-a", ttl), LeaderLease::new(redis, "gw-b", ttl));
        assert_eq!(a.tick().unwrap(), Leadership::Leader { epoch: 1, took: true });
        assert_eq!(b.tick().unwrap(), Leadership::Follower { leader: "gw-a".into() });
        for _ in 0..5 {
            std::thread::sleep(a.period());
            assert_eq!(a.tick().unwrap(), Leadership::Leader { epoch: 1, took: false });
            assert_eq!(b.tick().unwrap(), Leadership::Follower { leader: "gw-a".into() });
        }
        // A stops renewing (it died): B takes over once the TTL passes.
        let silent = std::time::Instant::now();
        let took = loop {
            if let Leadership::Leader { epoch, took } = b.tick().unwrap() {
                break (epoch, took);
            }
            assert!(silent.elapsed() < ttl * 2, "no takeover within the TTL");
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(took, (2, true));
        // A comes back: a follower now, in a later epoch than its own.
        assert_eq!(a.tick().unwrap(), Leadership::Follower { leader: "gw-b".into() });
        assert!(!a.resign().unwrap());
        assert!(b.resign().unwrap());
        assert_eq!(a.tick().unwrap(), Leadership::Leader { epoch: 3, took: true });
    }
}
