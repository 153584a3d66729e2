//! The leader lease: of all the gateways sharing a Redis, the one holding
//! `hangar:leader` runs placement and scaling for the fleet.
//!
//! The lease is a key holding the holder's id with a time to live; the
//! holder renews it every third of the TTL. When the holder dies, the key
//! expires and the next gateway to ask takes it: a new leader within one
//! TTL (plus one renewal period). Each taking increments
//! `hangar:leader:epoch`, the fencing token: what a leader writes in the
//! fleet's name carries its epoch, and a write in another epoch than the
//! current one comes from a leader that lost the lease without knowing.
//!
//! **A blip is not a new tenure.** `hangar:leader:last` names the last
//! holder. When the lease lapsed only because Redis could not be reached
//! (down, paused, restarted) and nobody took it meanwhile, the last holder
//! asking again gets it back *in the same epoch*: it keeps leading with
//! what it knows instead of a new tenure rebuilding the fleet. For that to
//! hold after an outage longer than the TTL, the others must not race it
//! for the lapsed key the moment Redis answers again: a gateway whose own
//! asks failed or stalled within the last TTL is *unsettled* and takes a
//! lapsed lease only if it names no other last holder. The last holder
//! (which had the same outage) asks again within a period and continues;
//! a holder that really died is replaced once its lapsed key meets a
//! settled gateway — at most one TTL later than without the rule, and not
//! at all later when Redis answered throughout.
//!
//! **Bad data is repaired, and named.** A lease key of the wrong type is
//! deleted; an epoch that is not an integer is replaced by Redis's clock in
//! milliseconds (larger than any count of tenures, so the fence still only
//! moves forward), and [`LeaderLease::tick`] logs which key held what.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use redis::Script;

use crate::{Redis, RedisError};

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

/// ARGV: prefix, me, ttl ms, settled (1 or 0). Returns {1, epoch, took,
/// repaired} or {0, holder, repaired} (`repaired`: what was fixed, or
/// empty); an unsettled ask that finds the lease lapsed but claimed by
/// another last holder answers {0, that holder, repaired}.
const TICK: &str = r#"
local key = ARGV[1] .. ':leader'
local ekey = key .. ':epoch'
local last = key .. ':last'
local repaired = ''
for _, k in ipairs({key, ekey, last}) do
  local kind = redis.call('TYPE', k).ok
  if kind ~= 'none' and kind ~= 'string' then
    redis.call('DEL', k)
    repaired = repaired .. k .. ' was a ' .. kind .. '; '
  end
end
local epoch = redis.call('GET', ekey)
if epoch and not string.match(epoch, '^%d+$') then
  local t = redis.call('TIME')
  redis.call('SET', ekey, string.format('%d', t[1] * 1000 + math.floor(t[2] / 1000)))
  repaired = repaired .. ekey .. ' held `' .. string.sub(epoch, 1, 40) .. '`, not an integer; '
end
local holder = redis.call('GET', key)
if holder == ARGV[2] then
  redis.call('PEXPIRE', key, ARGV[3])
  return {1, redis.call('GET', ekey) or '0', 0, repaired}
end
if holder then return {0, holder, repaired} end
local previous = redis.call('GET', last)
if previous and previous ~= ARGV[2] and ARGV[4] ~= '1' then return {0, previous, repaired} end
redis.call('SET', key, ARGV[2], 'PX', ARGV[3])
if previous == ARGV[2] and redis.call('GET', ekey) then
  return {1, redis.call('GET', ekey), 0, repaired}
end
redis.call('SET', last, ARGV[2])
return {1, redis.call('INCR', ekey), 1, repaired}
"#;

/// ARGV: prefix, me. Gives the lease up if held (and the claim to it
/// across a blip).
const RESIGN: &str = r#"
local key = ARGV[1] .. ':leader'
if redis.call('GET', key .. ':last') == ARGV[2] then redis.call('DEL', key .. ':last') end
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
    /// When this gateway's last ask failed or took longer than a period
    /// (Redis down or paused): it is unsettled for a TTL after.
    trouble: Mutex<Option<Instant>>,
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
        LeaderLease {
            redis,
            me: me.into(),
            ttl,
            tick: Script::new(TICK),
            resign: Script::new(RESIGN),
            trouble: Mutex::new(None),
        }
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
    /// does — unless this gateway is unsettled (see the module's docs)
    /// and another was the last holder. A leader whose tick fails (Redis
    /// unreachable) must act as a follower until a tick succeeds: its
    /// lease may have passed.
    pub fn tick(&self) -> Result<Leadership, RedisError> {
        let ttl = self.ttl.as_millis() as u64;
        let asked = Instant::now();
        let settled = self.trouble.lock().expect("trouble lock").is_none_or(|t| t.elapsed() >= self.ttl);
        let answer: Result<Vec<redis::Value>, RedisError> = self
            .redis
            .run(|c| self.redis.script(&self.tick).arg(&self.me).arg(ttl).arg(u8::from(settled)).invoke(c));
        if answer.is_err() || asked.elapsed() > self.period() {
            *self.trouble.lock().expect("trouble lock") = Some(Instant::now());
        }
        let answer = answer?;
        let text = |v: &redis::Value| redis::from_redis_value::<String>(v.clone()).unwrap_or_default();
        let number = |v: &redis::Value| redis::from_redis_value::<u64>(v.clone()).unwrap_or(0);
        let repaired = answer.last().map(text).unwrap_or_default();
        if !repaired.is_empty() {
            tracing::warn!("leader lease: repaired bad data in Redis: {}", repaired.trim_end_matches("; "));
        }
        Ok(match answer.as_slice() {
            [flag, epoch, took, _] if number(flag) == 1 => {
                Leadership::Leader { epoch: number(epoch), took: number(took) == 1 }
            }
            [_, holder, _] => Leadership::Follower { leader: text(holder) },
            _ => Leadership::Follower { leader: String::new() },
        })
    }

    /// Gives the lease up at once (a gateway stopping on purpose), so
    /// another need not wait for the TTL.
    pub fn resign(&self) -> Result<bool, RedisError> {
        let n: i64 = self.redis.run(|c| self.redis.script(&self.resign).arg(&self.me).invoke(c))?;
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
        one_leader_at_a_time(Redis::connect(&server.url()).unwrap());
    }

    #[test]
    fn on_a_cluster_one_leader_at_a_time() {
        let Some(cluster) = crate::LocalRedisCluster::for_test() else { return };
        one_leader_at_a_time(Redis::connect(&cluster.url()).unwrap());
    }

    fn one_leader_at_a_time(redis: Redis) {
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

    #[test]
    fn a_leader_that_lost_redis_for_a_while_keeps_its_epoch_unless_another_took_over() {
        let Some(server) = LocalRedis::for_test() else { return };
        let redis = Redis::connect(&server.url()).unwrap();
        let ttl = Duration::from_millis(200);
        let (a, b) = (LeaderLease::new(redis.clone(), "gw-a", ttl), LeaderLease::new(redis, "gw-b", ttl));
        assert_eq!(a.tick().unwrap(), Leadership::Leader { epoch: 1, took: true });
        // A could not renew (Redis unreachable) and the lease lapsed; nobody
        // took it: A's next ask continues its tenure.
        std::thread::sleep(ttl * 2);
        assert_eq!(a.tick().unwrap(), Leadership::Leader { epoch: 1, took: false });
        // B takes it while A is cut off: A's tenure is over for good.
        std::thread::sleep(ttl * 2);
        assert_eq!(b.tick().unwrap(), Leadership::Leader { epoch: 2, took: true });
        assert_eq!(a.tick().unwrap(), Leadership::Follower { leader: "gw-b".into() });
        std::thread::sleep(ttl * 2);
        assert_eq!(a.tick().unwrap(), Leadership::Leader { epoch: 3, took: true });
    }

    /// Redis down longer than the TTL: when it answers again the lease has
    /// lapsed, and a gateway that saw the outage itself leaves it to the
    /// last holder, which continues in its epoch — whoever asks first.
    #[test]
    fn after_an_outage_the_last_holder_gets_the_lease_back_before_the_others() {
        let Some(mut server) = LocalRedis::for_test() else { return };
        let redis = Redis::connect(&server.url()).unwrap();
        let ttl = Duration::from_millis(1_000);
        let (a, b) = (LeaderLease::new(redis.clone(), "gw-a", ttl), LeaderLease::new(redis, "gw-b", ttl));
        assert_eq!(a.tick().unwrap(), Leadership::Leader { epoch: 1, took: true });
        assert_eq!(b.tick().unwrap(), Leadership::Follower { leader: "gw-a".into() });
        server.stop();
        let down = Instant::now();
        // (An ask of a server that is down fails only after the
        // connection's retries: longer than the TTL here.)
        while down.elapsed() < ttl + ttl / 5 {
            assert!(b.tick().is_err(), "Redis is down");
        }
        server.start_again().unwrap();
        // B asks first, and finds the lease lapsed: not its to take.
        assert_eq!(b.tick().unwrap(), Leadership::Follower { leader: "gw-a".into() });
        assert_eq!(a.tick().unwrap(), Leadership::Leader { epoch: 1, took: false });
        assert_eq!(b.tick().unwrap(), Leadership::Follower { leader: "gw-a".into() });
        // A dies for real: B, settled once a TTL of answers has passed,
        // takes over.
        std::thread::sleep(ttl + ttl / 5);
        assert_eq!(b.tick().unwrap(), Leadership::Leader { epoch: 2, took: true });
    }

    #[test]
    fn bad_lease_data_is_repaired_and_the_fence_only_moves_forward() {
        let Some(server) = LocalRedis::for_test() else { return };
        let redis = Redis::connect(&server.url()).unwrap();
        let lease = LeaderLease::new(redis.clone(), "gw-a", Duration::from_secs(5));
        redis.run(|c| redis::cmd("SET").arg("hangar:leader:epoch").arg("seven").query::<()>(c)).unwrap();
        redis.run(|c| redis::cmd("HSET").arg("hangar:leader").arg("x").arg("y").query::<()>(c)).unwrap();
        let Leadership::Leader { epoch, took: true } = lease.tick().unwrap() else { panic!("leads") };
        assert!(epoch > 1_000_000_000_000, "an epoch past any count of tenures: {epoch}");
        let again = LeaderLease::new(redis.clone(), "gw-b", Duration::from_secs(5));
        assert_eq!(again.tick().unwrap(), Leadership::Follower { leader: "gw-a".into() });
    }
}
