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
//! Being settled is a claim about the moment the ask *runs*, not the one
//! it was sent: an ask sent just before Redis stalled (paused, or a
//! cluster's primary gone while the client retries toward its
//! replacement) can be held for the whole outage and run first when it
//! ends, the lease lapsed meanwhile. So a settled ask carries a deadline
//! in Redis's own clock — a period after it was sent, reckoned from the
//! server time of this gateway's last answer plus the time since — and
//! the script counts it settled only before that deadline.
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

/// ARGV: prefix, me, ttl ms, settled until (Redis's clock, ms; 0 when
/// unsettled). Returns {1, epoch, took, repaired, now} or {0, holder,
/// repaired, now} (`repaired`: what was fixed, or empty; `now`: Redis's
/// clock, ms); an unsettled ask (or one run past its deadline) that finds
/// the lease lapsed but claimed by another last holder answers {0, that
/// holder, repaired, now}.
const TICK: &str = r#"
local key = ARGV[1] .. ':leader'
local ekey = key .. ':epoch'
local last = key .. ':last'
local repaired = ''
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local settled = now <= tonumber(ARGV[4])
for _, k in ipairs({key, ekey, last}) do
  local kind = redis.call('TYPE', k).ok
  if kind ~= 'none' and kind ~= 'string' then
    redis.call('DEL', k)
    repaired = repaired .. k .. ' was a ' .. kind .. '; '
  end
end
local epoch = redis.call('GET', ekey)
if epoch and not string.match(epoch, '^%d+$') then
  redis.call('SET', ekey, string.format('%d', now))
  repaired = repaired .. ekey .. ' held `' .. string.sub(epoch, 1, 40) .. '`, not an integer; '
end
local holder = redis.call('GET', key)
if holder == ARGV[2] then
  redis.call('PEXPIRE', key, ARGV[3])
  return {1, redis.call('GET', ekey) or '0', 0, repaired, now}
end
if holder then return {0, holder, repaired, now} end
local previous = redis.call('GET', last)
if previous and previous ~= ARGV[2] and not settled then return {0, previous, repaired, now} end
redis.call('SET', key, ARGV[2], 'PX', ARGV[3])
if previous == ARGV[2] and redis.call('GET', ekey) then
  return {1, redis.call('GET', ekey), 0, repaired, now}
end
redis.call('SET', last, ARGV[2])
return {1, redis.call('INCR', ekey), 1, repaired, now}
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
    /// Redis's clock (ms) in this gateway's last answer, and when that
    /// answer came: what a settled ask's deadline is reckoned from.
    clock: Mutex<Option<(Instant, u64)>>,
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
            clock: Mutex::new(None),
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
        let answer = self.settled_until(asked).and_then(|until| {
            self.redis.run(|c| self.redis.script(&self.tick).arg(&self.me).arg(ttl).arg(until).invoke(c))
        });
        if answer.is_err() || asked.elapsed() > self.period() {
            *self.trouble.lock().expect("trouble lock") = Some(Instant::now());
        }
        let answer: Vec<redis::Value> = answer?;
        let text = |v: &redis::Value| redis::from_redis_value::<String>(v.clone()).unwrap_or_default();
        let number = |v: &redis::Value| redis::from_redis_value::<u64>(v.clone()).unwrap_or(0);
        // Every answer ends with what was repaired and Redis's clock.
        let (leadership, tail) = match answer.as_slice() {
            [flag, epoch, took, tail @ ..] if number(flag) == 1 => {
                (Leadership::Leader { epoch: number(epoch), took: number(took) == 1 }, tail)
            }
            [_, holder, tail @ ..] => (Leadership::Follower { leader: text(holder) }, tail),
            _ => (Leadership::Follower { leader: String::new() }, &[][..]),
        };
        let (repaired, now) = match tail {
            [repaired, now] => (text(repaired), number(now)),
            _ => (String::new(), 0),
        };
        if now > 0 {
            *self.clock.lock().expect("clock lock") = Some((Instant::now(), now));
        }
        if !repaired.is_empty() {
            tracing::warn!("leader lease: repaired bad data in Redis: {}", repaired.trim_end_matches("; "));
        }
        Ok(leadership)
    }

    /// The deadline, in Redis's clock (ms), before which an ask sent at
    /// `asked` counts as settled; 0 while this gateway is unsettled (see
    /// the module's docs). Before its first answer a gateway asks Redis
    /// for its clock.
    fn settled_until(&self, asked: Instant) -> Result<u64, RedisError> {
        if self.trouble.lock().expect("trouble lock").is_some_and(|t| t.elapsed() < self.ttl) {
            return Ok(0);
        }
        let known = *self.clock.lock().expect("clock lock");
        let (at, server_ms) = match known {
            Some(clock) => clock,
            None => {
                let (s, us): (u64, u64) = self.redis.run(|c| redis::cmd("TIME").query(c))?;
                (Instant::now(), s * 1000 + us / 1000)
            }
        };
        let since = asked.saturating_duration_since(at);
        Ok(server_ms + (since + self.period()).as_millis() as u64)
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

    /// Gateways `gw-a` and `gw-b` asking for a lease of `ttl` on
    /// `server`, `gw-a` holding it.
    fn a_leads(server: &LocalRedis, ttl: Duration) -> (LeaderLease, LeaderLease) {
        let redis = Redis::connect(&server.url()).unwrap();
        let (a, b) = (LeaderLease::new(redis.clone(), "gw-a", ttl), LeaderLease::new(redis, "gw-b", ttl));
        assert_eq!(a.tick().unwrap(), Leadership::Leader { epoch: 1, took: true });
        (a, b)
    }

    #[test]
    fn a_leader_that_lost_redis_for_a_while_keeps_its_epoch_unless_another_took_over() {
        let Some(server) = LocalRedis::for_test() else { return };
        let ttl = Duration::from_millis(200);
        let (a, b) = a_leads(&server, ttl);
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
        let ttl = Duration::from_millis(1_000);
        let (a, b) = a_leads(&server, ttl);
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

    /// An ask sent settled just as Redis stalls (`CLIENT PAUSE`, as a
    /// cluster's slot without a primary holds a retrying client) is held
    /// for the whole stall and runs when it ends, the lease lapsed
    /// meanwhile: past its deadline it counts as unsettled, and leaves the
    /// lease to its last holder, which continues in its epoch.
    #[test]
    fn an_ask_held_through_a_stall_leaves_the_lapsed_lease_to_its_last_holder() {
        let Some(server) = LocalRedis::for_test() else { return };
        let ttl = Duration::from_millis(600);
        let (a, b) = a_leads(&server, ttl);
        assert_eq!(b.tick().unwrap(), Leadership::Follower { leader: "gw-a".into() });
        server.pause(Duration::from_millis(1_500)).unwrap();
        let paused = Instant::now();
        let held = std::thread::spawn(move || b.tick());
        let answer = held.join().unwrap().unwrap();
        assert!(paused.elapsed() >= ttl * 2, "the ask was held past the TTL");
        assert_eq!(answer, Leadership::Follower { leader: "gw-a".into() });
        assert_eq!(a.tick().unwrap(), Leadership::Leader { epoch: 1, took: false });
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
