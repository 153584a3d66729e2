//! The fleet's store: predictions on Redis Streams, shared by every
//! gateway.
//!
//! Each model's queue is split into [`Shards`] streams
//! (`hangar:q:QUEUE:N`), each with the consumer group `workers`. An
//! account is given two of the shards by its name (shuffle sharding) and
//! each of its predictions goes to the shorter of the two, so an
//! account's backlog fills at most two shards; claims take the shards
//! with waiting entries in turns (`hangar:q:QUEUE:turns`), so another
//! account, whose pair differs in at least one shard with probability
//! 1 − 1/C(32,2) = 99.8 %, is served within a rotation of the busy
//! shards whatever the backlog (an account whose pair is the backlog's
//! waits behind it: shuffle sharding bounds how many accounts one
//! account can hold up, it does not make that number zero). A claim is `XREADGROUP` by the gateway's
//! consumer; the claimer renews it by `XCLAIM`ing its own pending
//! entries (a heartbeat every third of the lease); a claim left idle
//! for the lease (its gateway died) is taken by another gateway's
//! `XAUTOCLAIM` sweep, on Redis's clock, so gateways' clocks do not need
//! to agree. Each change is one Lua script, so it is atomic.
//!
//! Records are hashes (`hangar:p:ID`, one field per column of the SQLite
//! table, a missing field being NULL); listings are sorted sets by
//! sequence number. Every key is listed in `docs/cluster.md`.
//!
//! Durability is Redis's: with `appendonly yes` and `appendfsync
//! everysec` a Redis crash loses at most the last second of writes, a
//! restart loses nothing; with `appendfsync always` nothing
//! acknowledged is lost.

use std::collections::HashMap;
use std::sync::Mutex;

use hangar_core::Millis;
use hangar_redis::redis::{self, Script};
use hangar_redis::{Link, Redis};
use sha2::{Digest, Sha256};

use super::{
    blocking, parse_procedure, Cursor, Delivery, Page, PredictionQueue, Recovery, Rotation, StoreError,
};
use crate::deployments::DeploymentRecord;
use crate::lifecycle::Status;
use crate::procedures::Procedure;
use crate::record::{JobKind, Record};
use crate::webhook_policy::{Event, Filter};

/// How a queue is sharded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shards {
    /// Streams per queue.
    pub count: u32,
}

impl Default for Shards {
    fn default() -> Self {
        Shards { count: 32 }
    }
}

impl Shards {
    /// The two shards of `account`: fixed by its name, distinct.
    pub fn of(&self, account: &str) -> (u32, u32) {
        let digest = Sha256::digest(account.as_bytes());
        let h = u64::from_le_bytes(digest[..8].try_into().expect("8 bytes"));
        let n = u64::from(self.count.max(2));
        let a = h % n;
        let mut b = (h / n) % (n - 1);
        if b >= a {
            b += 1;
        }
        (a as u32, b as u32)
    }
}

/// How long a webhook delivery handed to one gateway is hidden from the
/// others (it is retried after that if the gateway never reports back).
const DELIVERY_CLAIM_MS: Millis = 60_000;

/// A consumer with nothing pending and idle this long is removed from
/// its group (each gateway run has its own consumer name).
const CONSUMER_IDLE_MS: Millis = 3_600_000;

/// The predictions store on Redis.
pub struct RedisQueue {
    redis: Redis,
    shards: Shards,
    lease_ms: Millis,
    /// The claims this process holds, by owner: prediction id → (stream,
    /// entry). Only these are renewed, so a claim whose reply was lost
    /// (Redis or the network failed after running it) is left to expire
    /// and is swept back into its queue instead of being renewed forever.
    claims: Mutex<HashMap<String, Held>>,
    scripts: Scripts,
    /// Replicas that must hold a create before it is acknowledged
    /// ([`RedisQueue::durable`]); 0: the primary's word.
    durable_replicas: u32,
}

/// How long a create waits for its replicas (`WAIT`) before it is
/// answered as unavailable: a healthy replica acknowledges within a
/// round trip; one that has not within a second is lagging or gone.
pub const DURABLE_WAIT_MS: u64 = 1_000;

/// One owner's claims: prediction id → (stream, entry).
type Held = HashMap<String, (String, String)>;

struct Scripts {
    enqueue: Script,
    claim: Script,
    heartbeat: Script,
    start: Script,
    save_progress: Script,
    finish: Script,
    requeue: Script,
    sweep: Script,
    due_deliveries: Script,
    remove_data: Script,
    rotate_secret: Script,
    put_deployment: Script,
}

/// Lua helpers the scripts share (prepended to those that use them).
const HELPERS: &str = r#"
local P = ARGV[1]
local function add_deliveries(from)
  local n = tonumber(ARGV[from])
  for i = 0, n - 1 do
    local b = from + 1 + i * 7
    local key = P .. ':d:' .. ARGV[b]
    if redis.call('EXISTS', key) == 0 then
      redis.call('HSET', key, 'prediction', ARGV[b + 1], 'event', ARGV[b + 2], 'url', ARGV[b + 3],
        'body', ARGV[b + 4], 'attempts', ARGV[b + 5], 'next_at', ARGV[b + 6])
      redis.call('ZADD', P .. ':deliveries', ARGV[b + 6], ARGV[b])
    end
  end
  return from + 1 + n * 7
end
local function waiting_less(base, shard)
  if redis.call('HINCRBY', base .. ':waiting', shard, -1) <= 0 then
    redis.call('HDEL', base .. ':waiting', shard)
    redis.call('LREM', base .. ':turns', 0, shard)
  end
end
local function waiting_more(base, shard)
  if redis.call('HINCRBY', base .. ':waiting', shard, 1) == 1 then
    redis.call('RPUSH', base .. ':turns', shard)
  end
end
local function back_to_queue(id, pkey)
  local f = redis.call('HMGET', pkey, 'queue', 'shard', 'entry', 'expiry')
  local base = P .. ':q:' .. f[1]
  local stream = base .. ':' .. f[2]
  if f[3] then
    redis.call('XACK', stream, 'workers', f[3])
    redis.call('XDEL', stream, f[3])
  end
  redis.call('HSET', pkey, 'entry', redis.call('XADD', stream, '*', 'id', id))
  redis.call('HDEL', pkey, 'owner')
  if f[4] then redis.call('ZADD', P .. ':expiry', f[4], id) end
  waiting_more(base, f[2])
end
"#;

/// ARGV: P, id, queue, kind, account, expiry ('' for none), created_at,
/// shard a, shard b, then field/value pairs. Idempotent by id (a retry
/// after a lost reply returns the first sequence number); a repeat counts
/// itself in `P:creates:repeated`, a write, so that a `WAIT` behind it
/// covers the first create too (a replica's stream is in order).
const ENQUEUE: &str = r#"
local id, queue, kind, account = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local pkey = P .. ':p:' .. id
local seq = redis.call('HGET', pkey, 'seq')
if seq then
  redis.call('INCR', P .. ':creates:repeated')
  return tonumber(seq)
end
local base = P .. ':q:' .. queue
local a, b = ARGV[8], ARGV[9]
local shard = a
if tonumber(redis.call('HGET', base .. ':waiting', b) or '0') < tonumber(redis.call('HGET', base .. ':waiting', a) or '0') then
  shard = b
end
local stream = base .. ':' .. shard
if redis.call('EXISTS', stream) == 0 then
  redis.call('XGROUP', 'CREATE', stream, 'workers', '0', 'MKSTREAM')
end
local entry = redis.call('XADD', stream, '*', 'id', id)
seq = redis.call('INCR', P .. ':seq')
redis.call('HSET', pkey, 'seq', seq, 'queue', queue, 'shard', shard, 'entry', entry, unpack(ARGV, 10))
if ARGV[6] ~= '' then
  redis.call('HSET', pkey, 'expiry', ARGV[6])
  redis.call('ZADD', P .. ':expiry', ARGV[6], id)
end
redis.call('ZADD', P .. ':list:' .. kind, seq, id)
redis.call('ZADD', P .. ':list:' .. kind .. ':' .. account, seq, id)
redis.call('ZADD', P .. ':queued', ARGV[7], id)
redis.call('SADD', P .. ':queues', queue)
waiting_more(base, shard)
return seq
"#;

/// ARGV: P, queue, owner. Returns {stream, entry, HGETALL} or false.
const CLAIM: &str = r#"
local base = P .. ':q:' .. ARGV[2]
local turns = base .. ':turns'
for i = 1, redis.call('LLEN', turns) do
  local shard = redis.call('LPOP', turns)
  local stream = base .. ':' .. shard
  local got = redis.call('XREADGROUP', 'GROUP', 'workers', ARGV[3], 'COUNT', '1', 'STREAMS', stream, '>')
  if got then
    if redis.call('HINCRBY', base .. ':waiting', shard, -1) > 0 then
      redis.call('RPUSH', turns, shard)
    else
      redis.call('HDEL', base .. ':waiting', shard)
    end
    local entry = got[1][2][1]
    local id = entry[2][2]
    local pkey = P .. ':p:' .. id
    redis.call('ZREM', P .. ':expiry', id)
    redis.call('HSET', pkey, 'owner', ARGV[3])
    return {stream, entry[1], redis.call('HGETALL', pkey)}
  end
  redis.call('HDEL', base .. ':waiting', shard)
end
return false
"#;

/// ARGV: P, owner, then stream/entry pairs. Renews those still pending
/// for `owner`; returns how many.
const HEARTBEAT: &str = r#"
local renewed = 0
for i = 3, #ARGV, 2 do
  local p = redis.call('XPENDING', ARGV[i], 'workers', ARGV[i + 1], ARGV[i + 1], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', ARGV[i], 'workers', ARGV[2], 0, ARGV[i + 1], 'JUSTID')
    renewed = renewed + 1
  end
end
return renewed
"#;

/// ARGV: P, id, now, deliveries. Run twice, the second reports the
/// first's success (same `now`).
const START: &str = r#"
local pkey = P .. ':p:' .. ARGV[2]
local f = redis.call('HMGET', pkey, 'status', 'started_at')
if f[1] == 'processing' and f[2] == ARGV[3] then return 1 end
if f[1] ~= 'starting' then return 0 end
redis.call('HSET', pkey, 'status', 'processing', 'started_at', ARGV[3])
redis.call('ZREM', P .. ':expiry', ARGV[2])
add_deliveries(4)
return 1
"#;

/// ARGV: P, id, output, logs.
const SAVE_PROGRESS: &str = r#"
local pkey = P .. ':p:' .. ARGV[2]
if redis.call('HGET', pkey, 'status') == 'processing' then
  redis.call('HSET', pkey, 'output', ARGV[3], 'logs', ARGV[4])
end
return 0
"#;

/// ARGV: P, id, status, completed_at, n set, field/value pairs, n del,
/// fields, deliveries. Run twice, the second reports the first's
/// success (same status and end).
const FINISH: &str = r#"
local id, new = ARGV[2], ARGV[3]
local pkey = P .. ':p:' .. id
local was = redis.call('HMGET', pkey, 'status', 'completed_at')
local cur = was[1]
if cur == new and was[2] == ARGV[4] then return 1 end
if not (cur == 'processing' or (cur == 'starting' and new ~= 'succeeded')) then return 0 end
local i = 5
local nset = tonumber(ARGV[i])
for j = 1, nset do
  redis.call('HSET', pkey, ARGV[i + 2 * j - 1], ARGV[i + 2 * j])
end
i = i + 2 * nset + 1
local ndel = tonumber(ARGV[i])
for j = 1, ndel do
  redis.call('HDEL', pkey, ARGV[i + j])
end
i = i + ndel + 1
local f = redis.call('HMGET', pkey, 'queue', 'shard', 'entry', 'owner')
if f[3] then
  local base = P .. ':q:' .. f[1]
  local stream = base .. ':' .. f[2]
  redis.call('XACK', stream, 'workers', f[3])
  if redis.call('XDEL', stream, f[3]) == 1 and not f[4] then
    waiting_less(base, f[2])
  end
  redis.call('HDEL', pkey, 'entry', 'owner')
end
redis.call('ZREM', P .. ':expiry', id)
redis.call('ZREM', P .. ':queued', id)
redis.call('ZADD', P .. ':ended', ARGV[4], id)
add_deliveries(i)
return 1
"#;

/// ARGV: P, id.
const REQUEUE: &str = r#"
local pkey = P .. ':p:' .. ARGV[2]
if redis.call('HGET', pkey, 'status') ~= 'processing' then return 0 end
redis.call('HSET', pkey, 'status', 'starting', 'logs', '')
redis.call('HDEL', pkey, 'started_at', 'output')
back_to_queue(ARGV[2], pkey)
return 1
"#;

/// ARGV: P, consumer, min idle ms (the lease), shards, consumer idle ms,
/// stall ms. Entries idle past the lease: not started ones go back to
/// their queue, processing ones are taken by `consumer` and returned,
/// ended ones are dropped.
///
/// Unless Redis itself was stalled: sweeps come from every gateway every
/// third of a lease, so when the last one ran more than `stall ms` (half
/// a lease) ago on Redis's clock, Redis was down, paused or hung (or
/// every gateway was) — and every claim's idle time has grown with the
/// stall, its owner alive or not. Then nothing is taken until a lease
/// after this sweep (`hangar:sweep:hold`), time for live owners to renew.
/// This is what catches a sweep that was sent before a pause and ran
/// after it, which no gateway could have held back.
const SWEEP: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local last = tonumber(redis.call('GET', P .. ':sweep:last') or '0')
redis.call('SET', P .. ':sweep:last', now)
if now - last > tonumber(ARGV[6]) then
  redis.call('SET', P .. ':sweep:hold', now + tonumber(ARGV[3]))
  return {}
end
if now < tonumber(redis.call('GET', P .. ':sweep:hold') or '0') then return {} end
local out = {}
for _, queue in ipairs(redis.call('SMEMBERS', P .. ':queues')) do
  for shard = 0, tonumber(ARGV[4]) - 1 do
    local stream = P .. ':q:' .. queue .. ':' .. shard
    if redis.call('EXISTS', stream) == 1 then
      local cursor = '0-0'
      repeat
        local r = redis.call('XAUTOCLAIM', stream, 'workers', ARGV[2], ARGV[3], cursor, 'COUNT', 100)
        cursor = r[1]
        for _, e in ipairs(r[2]) do
          local id = e[2][2]
          local pkey = P .. ':p:' .. id
          local status = redis.call('HGET', pkey, 'status')
          if status == 'starting' then
            back_to_queue(id, pkey)
          elseif status == 'processing' then
            redis.call('HSET', pkey, 'owner', ARGV[2])
            table.insert(out, id)
          else
            redis.call('XACK', stream, 'workers', e[1])
            redis.call('XDEL', stream, e[1])
          end
        end
      until cursor == '0-0'
      for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', stream, 'workers')) do
        local info = {}
        for k = 1, #c, 2 do info[c[k]] = c[k + 1] end
        if info['pending'] == 0 and info['idle'] > tonumber(ARGV[5]) then
          redis.call('XGROUP', 'DELCONSUMER', stream, 'workers', info['name'])
        end
      end
    end
  end
end
return out
"#;

/// ARGV: P, now, limit, claim until. Due deliveries, hidden from other
/// gateways until `claim until`; each as HGETALL plus id and account.
const DUE_DELIVERIES: &str = r#"
local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. ':deliveries', '-inf', ARGV[2], 'LIMIT', 0, ARGV[3])) do
  local d = redis.call('HGETALL', P .. ':d:' .. id)
  if #d > 0 then
    redis.call('ZADD', P .. ':deliveries', ARGV[4], id)
    local fields = {}
    for k = 1, #d, 2 do fields[d[k]] = d[k + 1] end
    table.insert(d, 'id')
    table.insert(d, id)
    table.insert(d, 'account')
    table.insert(d, redis.call('HGET', P .. ':p:' .. fields['prediction'], 'account') or '')
    table.insert(out, d)
  else
    redis.call('ZREM', P .. ':deliveries', id)
  end
end
return out
"#;

/// ARGV: P, before, limit. Returns how many records lost their data.
const REMOVE_DATA: &str = r#"
local ids = redis.call('ZRANGEBYSCORE', P .. ':ended', '-inf', '(' .. ARGV[2], 'LIMIT', 0, ARGV[3])
for _, id in ipairs(ids) do
  local pkey = P .. ':p:' .. id
  redis.call('HDEL', pkey, 'input', 'output')
  redis.call('HSET', pkey, 'logs', '', 'data_removed', '1')
  redis.call('ZREM', P .. ':ended', id)
end
return #ids
"#;

/// ARGV: P, account, now, valid until, new secret. Returns whether a
/// current secret was retired.
const ROTATE_SECRET: &str = r#"
local cur_key = P .. ':secret:' .. ARGV[2]
local old_key = P .. ':secret-old:' .. ARGV[2]
redis.call('ZREMRANGEBYSCORE', old_key, '-inf', ARGV[3])
local cur = redis.call('GET', cur_key)
if cur == ARGV[5] then return redis.call('ZCARD', old_key) > 0 and 1 or 0 end
if cur then redis.call('ZADD', old_key, ARGV[4], cur) end
redis.call('SET', cur_key, ARGV[5])
if cur then return 1 end
return 0
"#;

/// ARGV: P, name, the release expected stored ('' for none), the JSON to
/// store. Returns 1 if it was written — or already was (a retry after a
/// lost reply) — and 0 if the stored release is not the one expected.
const PUT_DEPLOYMENT: &str = r#"
local key = P .. ':deployments'
local cur = redis.call('HGET', key, ARGV[2])
if cur == ARGV[4] then return 1 end
if ARGV[3] == '' then
  if cur then return 0 end
elseif not cur or tostring(cjson.decode(cur).release) ~= ARGV[3] then
  return 0
end
redis.call('HSET', key, ARGV[2], ARGV[4])
return 1
"#;

impl RedisQueue {
    /// The store on `redis`. `lease_ms` is how long a claim lives without
    /// a heartbeat (the sweep's idle time).
    pub fn open(redis: Redis, shards: Shards, lease_ms: Millis) -> Result<RedisQueue, StoreError> {
        let with = |body: &str| Script::new(&format!("{HELPERS}{body}"));
        let queue = RedisQueue {
            redis,
            shards,
            lease_ms,
            claims: Mutex::default(),
            durable_replicas: 0,
            scripts: Scripts {
                enqueue: with(ENQUEUE),
                claim: with(CLAIM),
                heartbeat: with(HEARTBEAT),
                start: with(START),
                save_progress: with(SAVE_PROGRESS),
                finish: with(FINISH),
                requeue: with(REQUEUE),
                sweep: with(SWEEP),
                due_deliveries: with(DUE_DELIVERIES),
                remove_data: with(REMOVE_DATA),
                rotate_secret: with(ROTATE_SECRET),
                put_deployment: with(PUT_DEPLOYMENT),
            },
        };
        Ok(queue)
    }

    /// The store, acknowledging a create only once `replicas` of Redis's
    /// replicas hold it (`WAIT replicas` in the same pipeline as the
    /// create, on its node, within [`DURABLE_WAIT_MS`]); a create they did
    /// not acknowledge in time is [`StoreError::Unavailable`] — stored on
    /// the primary, perhaps lost at a failover: the client repeats it
    /// under its `Idempotency-Key`. Redis replicates asynchronously, so
    /// without this a primary that dies right after answering may take an
    /// acknowledged create with it.
    pub fn durable(mut self, replicas: u32) -> RedisQueue {
        self.durable_replicas = replicas;
        self
    }

    /// Runs `f` on a pooled connection (blocking in place on a tokio
    /// runtime), naming the server in its error
    /// ([`StoreError::Unavailable`] when Redis could not serve). `f` runs
    /// again on a fresh connection if Redis dropped the first
    /// ([`Redis::run`]): every script here is idempotent or reports a
    /// repeated success.
    fn with<T>(&self, f: impl FnMut(&mut Link) -> redis::RedisResult<T>) -> Result<T, StoreError> {
        blocking(|| self.redis.run(f).map_err(|e| StoreError::redis(e, self.redis.address())))
    }

    fn key(&self, what: &str) -> String {
        self.redis.key(what)
    }

    fn forget_claim(&self, id: &str) {
        for claims in self.claims.lock().unwrap_or_else(|e| e.into_inner()).values_mut() {
            claims.remove(id);
        }
    }

    fn records(&self, ids: &[String]) -> Result<Vec<Record>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for id in ids {
            pipe.hgetall(self.key(&format!("p:{id}")));
        }
        let rows: Vec<HashMap<String, String>> = self.with(|c| pipe.query(c))?;
        rows.into_iter().filter(|f| !f.is_empty()).map(from_fields).collect()
    }
}

/// The hash fields of a new record (NULL columns are left out).
fn fields(r: &Record) -> Vec<(&'static str, String)> {
    let mut f = vec![
        ("id", r.id.clone()),
        ("kind", r.kind.as_str().to_owned()),
        ("model", r.model.clone()),
        ("version", r.version.clone()),
        ("account", r.account.clone()),
        ("input", r.input.to_string()),
        ("logs", r.logs.clone()),
        ("status", r.status.as_str().to_owned()),
        ("created_at", r.created_at.to_string()),
        ("webhook_events", r.webhook_events.bits().to_string()),
        ("stream", u8::from(r.stream).to_string()),
        ("data_removed", u8::from(r.data_removed).to_string()),
    ];
    let optional = [
        ("deployment", r.deployment.clone()),
        ("output", r.output.as_ref().map(|o| o.to_string())),
        ("error", r.error.clone()),
        ("started_at", r.started_at.map(|t| t.to_string())),
        ("completed_at", r.completed_at.map(|t| t.to_string())),
        ("deadline", r.deadline.map(|t| t.to_string())),
        ("lifetime_deadline", r.lifetime_deadline.map(|t| t.to_string())),
        ("webhook", r.webhook.clone()),
        ("destination", r.destination.clone()),
    ];
    f.extend(optional.into_iter().filter_map(|(k, v)| Some((k, v?))));
    f
}

/// A record from its hash.
fn from_fields(mut f: HashMap<String, String>) -> Result<Record, StoreError> {
    let id = f.remove("id").unwrap_or_default();
    let corrupt = |what: String| StoreError::Corrupt { id: id.clone(), what };
    let mut take = |k: &str| f.remove(k);
    let ms = |v: Option<String>, k: &str| -> Result<Option<Millis>, StoreError> {
        v.map(|s| s.parse::<Millis>().map_err(|e| corrupt(format!("{k} `{s}`: {e}")))).transpose()
    };
    let json = |v: Option<String>, k: &str| -> Result<Option<serde_json::Value>, StoreError> {
        v.map(|s| serde_json::from_str(&s).map_err(|e| corrupt(format!("{k}: {e}")))).transpose()
    };
    let kind = take("kind").unwrap_or_default();
    let status = take("status").unwrap_or_default();
    let (Some(kind), Some(status)) = (JobKind::parse(&kind), Status::parse(&status)) else {
        return Err(corrupt(format!("kind `{kind}` / status `{status}`")));
    };
    let flag = |v: Option<String>| v.as_deref() == Some("1");
    Ok(Record {
        seq: take("seq").and_then(|s| s.parse().ok()).unwrap_or(0),
        kind,
        model: take("model").unwrap_or_default(),
        version: take("version").unwrap_or_default(),
        deployment: take("deployment"),
        account: take("account").unwrap_or_default(),
        input: json(take("input"), "input")?.unwrap_or(serde_json::Value::Null),
        output: json(take("output"), "output")?,
        logs: take("logs").unwrap_or_default(),
        error: take("error"),
        status,
        created_at: ms(take("created_at"), "created_at")?.unwrap_or(0),
        started_at: ms(take("started_at"), "started_at")?,
        completed_at: ms(take("completed_at"), "completed_at")?,
        deadline: ms(take("deadline"), "deadline")?,
        lifetime_deadline: ms(take("lifetime_deadline"), "lifetime_deadline")?,
        webhook: take("webhook"),
        webhook_events: Filter::from_bits(take("webhook_events").and_then(|s| s.parse().ok()).unwrap_or(0)),
        stream: flag(take("stream")),
        destination: take("destination"),
        data_removed: flag(take("data_removed")),
        id: id.clone(),
    })
}

/// Appends `deliveries` to a script invocation: their count, then seven
/// arguments each.
fn push_deliveries(inv: &mut redis::ScriptInvocation<'_>, deliveries: &[Delivery]) {
    inv.arg(deliveries.len());
    for d in deliveries {
        inv.arg(&d.id)
            .arg(&d.prediction)
            .arg(d.event.as_str())
            .arg(&d.url)
            .arg(&d.body)
            .arg(d.attempts)
            .arg(d.next_at);
    }
}

impl PredictionQueue for RedisQueue {
    fn enqueue(&self, r: &Record) -> Result<i64, StoreError> {
        let expiry = match (r.deadline, r.lifetime_deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let (a, b) = self.shards.of(&r.account);
        let mut inv = self.redis.script(&self.scripts.enqueue);
        inv.arg(&r.id)
            .arg(r.kind.queue(&r.model))
            // The listing it is in: a procedure's run is listed with the
            // predictions (its own `kind` is among the fields).
            .arg(r.kind.shown_as().as_str())
            .arg(&r.account)
            .arg(expiry.map(|t| t.to_string()).unwrap_or_default())
            .arg(r.created_at)
            .arg(a)
            .arg(b);
        for (k, v) in fields(r) {
            inv.arg(k).arg(v);
        }
        let wanted = self.durable_replicas;
        if wanted == 0 {
            return self.with(|c| inv.invoke(c));
        }
        // One pipeline: a cluster sends it whole to the node of its first
        // command's key, so the `WAIT` is the create's connection's.
        let mut pipe = redis::pipe();
        pipe.invoke_script(&inv).cmd("WAIT").arg(wanted).arg(DURABLE_WAIT_MS);
        let (seq, acked): (i64, u32) = self.with(|c| match pipe.query(c) {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                inv.load(c)?;
                pipe.query(c)
            }
            answer => answer,
        })?;
        if acked < wanted {
            return Err(StoreError::redis_unavailable(
                self.redis.address(),
                format!(
                    "prediction {} reached {acked} of the {wanted} replicas it must reach within {DURABLE_WAIT_MS} ms",
                    r.id
                ),
            ));
        }
        Ok(seq)
    }

    fn shared(&self) -> bool {
        true
    }

    fn recover(
        &self,
        _now: Millis,
        _idempotent: &dyn Fn(&str) -> bool,
        _completed: &dyn Fn(&Record) -> Option<Delivery>,
    ) -> Result<Recovery, StoreError> {
        // Claims belong to consumers (one per gateway run), not to a file
        // this process owns: a previous run's claims go idle and the
        // sweep takes them like any dead gateway's, within one lease.
        Ok(Recovery::default())
    }

    fn get(&self, id: &str) -> Result<Option<Record>, StoreError> {
        Ok(self.records(&[id.to_owned()])?.pop())
    }

    fn list(
        &self,
        account: Option<&str>,
        kind: JobKind,
        cursor: Cursor,
        limit: usize,
    ) -> Result<Page, StoreError> {
        let key = match account {
            Some(a) => self.key(&format!("list:{}:{a}", kind.as_str())),
            None => self.key(&format!("list:{}", kind.as_str())),
        };
        // Newest first below the cursor, or oldest first above it; `(`
        // makes a bound exclusive.
        let (command, from, to) = match cursor {
            Cursor::Start => ("ZREVRANGEBYSCORE", "+inf".to_owned(), "-inf"),
            Cursor::Before(s) => ("ZREVRANGEBYSCORE", format!("({s}"), "-inf"),
            Cursor::After(s) => ("ZRANGEBYSCORE", format!("({s}"), "+inf"),
        };
        let ids: Vec<String> = self.with(|c| {
            redis::cmd(command).arg(&key).arg(&from).arg(to).arg("LIMIT").arg(0).arg(limit + 1).query(c)
        })?;
        let results = self.records(&ids)?;
        Page::from_rows(cursor, results, limit, |newer, seq| {
            let (min, max) = if newer {
                (format!("({seq}"), "+inf".to_owned())
            } else {
                ("-inf".to_owned(), format!("({seq}"))
            };
            let count: u64 = self.with(|c| redis::cmd("ZCOUNT").arg(&key).arg(&min).arg(&max).query(c))?;
            Ok(count > 0)
        })
    }

    fn claim(
        &self,
        queue: &str,
        owner: &str,
        _now: Millis,
        _lease_ms: Millis,
    ) -> Result<Option<Record>, StoreError> {
        let got: Option<(String, String, HashMap<String, String>)> =
            self.with(|c| self.redis.script(&self.scripts.claim).arg(queue).arg(owner).invoke(c))?;
        let Some((stream, entry, fields)) = got else { return Ok(None) };
        let record = from_fields(fields)?;
        self.claims
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(owner.to_owned())
            .or_default()
            .insert(record.id.clone(), (stream, entry));
        Ok(Some(record))
    }

    fn heartbeat(&self, owner: &str, _now: Millis, _lease_ms: Millis) -> Result<usize, StoreError> {
        let held: Vec<(String, String)> = self
            .claims
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(owner)
            .map(|c| c.values().cloned().collect())
            .unwrap_or_default();
        if held.is_empty() {
            return Ok(0);
        }
        let mut inv = self.redis.script(&self.scripts.heartbeat);
        inv.arg(owner);
        for (stream, entry) in &held {
            inv.arg(stream).arg(entry);
        }
        self.with(|c| inv.invoke(c))
    }

    fn abandon(&self, owner: &str, id: &str) {
        if let Some(claims) = self.claims.lock().unwrap_or_else(|e| e.into_inner()).get_mut(owner) {
            claims.remove(id);
        }
    }

    fn start(&self, id: &str, now: Millis, deliveries: &[Delivery]) -> Result<bool, StoreError> {
        let mut inv = self.redis.script(&self.scripts.start);
        inv.arg(id).arg(now);
        push_deliveries(&mut inv, deliveries);
        self.with(|c| inv.invoke::<i64>(c)).map(|n| n == 1)
    }

    fn save_progress(&self, id: &str, output: &serde_json::Value, logs: &str) -> Result<(), StoreError> {
        self.with(|c| {
            self.redis
                .script(&self.scripts.save_progress)
                .arg(id)
                .arg(output.to_string())
                .arg(logs)
                .invoke::<i64>(c)
        })
        .map(drop)
    }

    fn finish(&self, r: &Record, deliveries: &[Delivery]) -> Result<bool, StoreError> {
        if !r.status.is_terminal() {
            return Ok(false);
        }
        let values = [
            ("status", Some(r.status.as_str().to_owned())),
            ("output", r.output.as_ref().map(|o| o.to_string())),
            ("logs", Some(r.logs.clone())),
            ("error", r.error.clone()),
            ("started_at", r.started_at.map(|t| t.to_string())),
            ("completed_at", r.completed_at.map(|t| t.to_string())),
        ];
        let (set, del): (Vec<_>, Vec<_>) = values.into_iter().partition(|(_, v)| v.is_some());
        let mut inv = self.redis.script(&self.scripts.finish);
        inv.arg(&r.id).arg(r.status.as_str()).arg(r.completed_at.unwrap_or(0)).arg(set.len());
        for (k, v) in set {
            inv.arg(k).arg(v);
        }
        inv.arg(del.len());
        for (k, _) in del {
            inv.arg(k);
        }
        push_deliveries(&mut inv, deliveries);
        let done = self.with(|c| inv.invoke::<i64>(c))? == 1;
        self.forget_claim(&r.id);
        Ok(done)
    }

    fn due_deliveries(&self, now: Millis, limit: usize) -> Result<Vec<Delivery>, StoreError> {
        let rows: Vec<HashMap<String, String>> = self.with(|c| {
            self.redis
                .script(&self.scripts.due_deliveries)
                .arg(now)
                .arg(limit)
                .arg(now + DELIVERY_CLAIM_MS)
                .invoke(c)
        })?;
        rows.into_iter()
            .map(|mut f| {
                let mut take = |k: &str| f.remove(k).unwrap_or_default();
                let id = take("id");
                let event = take("event");
                let number = |s: String| s.parse::<Millis>().unwrap_or(0);
                Ok(Delivery {
                    prediction: take("prediction"),
                    event: Event::parse(&event).unwrap_or(Event::Completed),
                    url: take("url"),
                    body: take("body"),
                    attempts: number(take("attempts")) as u32,
                    next_at: number(take("next_at")),
                    account: take("account"),
                    id,
                })
            })
            .collect()
    }

    fn next_delivery_at(&self) -> Result<Option<Millis>, StoreError> {
        let first: Vec<(String, f64)> = self.with(|c| {
            redis::cmd("ZRANGE").arg(self.key("deliveries")).arg(0).arg(0).arg("WITHSCORES").query(c)
        })?;
        Ok(first.first().map(|(_, at)| *at as Millis))
    }

    fn delivery_attempted(
        &self,
        id: &str,
        delivered: bool,
        next_at: Option<Millis>,
    ) -> Result<(), StoreError> {
        let (key, due) = (self.key(&format!("d:{id}")), self.key("deliveries"));
        let mut pipe = redis::pipe();
        pipe.atomic();
        match next_at {
            Some(at) => {
                pipe.hincr(&key, "attempts", i64::from(!delivered)).ignore();
                pipe.hset(&key, "next_at", at).ignore();
                pipe.zadd(&due, id, at).ignore();
            }
            // Delivered or given up: nothing reads it again.
            None => {
                pipe.del(&key).ignore();
                pipe.zrem(&due, id).ignore();
            }
        }
        self.with(|c| pipe.query::<()>(c))
    }

    fn expired_waiting(&self, now: Millis, limit: usize) -> Result<Vec<Record>, StoreError> {
        let ids: Vec<String> = self.with(|c| {
            redis::cmd("ZRANGEBYSCORE")
                .arg(self.key("expiry"))
                .arg("-inf")
                .arg(now)
                .arg("LIMIT")
                .arg(0)
                .arg(limit)
                .query(c)
        })?;
        Ok(self.records(&ids)?.into_iter().filter(|r| r.status == Status::Starting).collect())
    }

    fn sweep_expired_claims(&self, _now: Millis) -> Result<Vec<Record>, StoreError> {
        // Idle time is Redis's own clock: the lease given at open.
        let sweeper = format!("sweep-{}", std::process::id());
        let ids: Vec<String> = self.with(|c| {
            self.redis
                .script(&self.scripts.sweep)
                .arg(&sweeper)
                .arg(self.lease_ms)
                .arg(self.shards.count)
                .arg(CONSUMER_IDLE_MS)
                .arg(self.lease_ms / 2)
                .invoke(c)
        })?;
        self.records(&ids)
    }

    fn requeue(&self, id: &str) -> Result<bool, StoreError> {
        let done = self.with(|c| self.redis.script(&self.scripts.requeue).arg(id).invoke::<i64>(c))? == 1;
        self.forget_claim(id);
        Ok(done)
    }

    fn prune_queue(&self, before: Millis, now: Millis) -> Result<Vec<String>, StoreError> {
        let ids: Vec<String> = self.with(|c| {
            redis::cmd("ZRANGEBYSCORE").arg(self.key("queued")).arg("-inf").arg(format!("({before}")).query(c)
        })?;
        if ids.is_empty() {
            return Ok(ids);
        }
        for mut r in self.records(&ids)? {
            if !r.status.is_terminal() {
                r.status = Status::Failed;
                r.completed_at = Some(now);
                r.error =
                    Some("the prediction stayed in the queue for more than 24 hours and was pruned".into());
                self.finish(&r, &[])?;
            }
        }
        self.with(|c| {
            let mut pipe = redis::pipe();
            for id in &ids {
                pipe.zrem(self.key("queued"), id).ignore();
            }
            pipe.query::<()>(c)
        })?;
        Ok(ids)
    }

    fn remove_data(&self, before: Millis) -> Result<usize, StoreError> {
        let mut total = 0;
        loop {
            let n: usize =
                self.with(|c| self.redis.script(&self.scripts.remove_data).arg(before).arg(1000).invoke(c))?;
            total += n;
            if n < 1000 {
                return Ok(total);
            }
        }
    }

    fn webhook_secrets(
        &self,
        account: &str,
        now: Millis,
        create: &dyn Fn() -> String,
    ) -> Result<Vec<String>, StoreError> {
        let current = self.key(&format!("secret:{account}"));
        let mut secret: Option<String> = self.with(|c| redis::cmd("GET").arg(&current).query(c))?;
        if secret.is_none() {
            // Another gateway may create it at the same moment: NX keeps
            // the first, which both then read.
            let fresh = create();
            secret =
                self.with(|c| redis::cmd("SET").arg(&current).arg(&fresh).arg("NX").arg("GET").query(c))?;
            secret = Some(secret.unwrap_or(fresh));
        }
        let old: Vec<String> = self.with(|c| {
            let old = self.key(&format!("secret-old:{account}"));
            redis::cmd("ZREVRANGEBYSCORE").arg(old).arg("+inf").arg(format!("({now}")).query(c)
        })?;
        Ok(secret.into_iter().chain(old).collect())
    }

    fn rotate_webhook_secret(
        &self,
        account: &str,
        now: Millis,
        grace_ms: Millis,
        create: &dyn Fn() -> String,
    ) -> Result<Rotation, StoreError> {
        let (fresh, until) = (create(), now.saturating_add(grace_ms));
        let retired: i64 = self.with(|c| {
            self.redis
                .script(&self.scripts.rotate_secret)
                .arg(account)
                .arg(now)
                .arg(until)
                .arg(&fresh)
                .invoke(c)
        })?;
        Ok(Rotation { key: fresh, previous_valid_until: (retired == 1).then_some(until) })
    }

    fn put_deployment(
        &self,
        deployment: &DeploymentRecord,
        expected: Option<u32>,
    ) -> Result<bool, StoreError> {
        let body = serde_json::to_string(deployment).expect("a deployment serializes");
        let expected = expected.map_or_else(String::new, |r| r.to_string());
        let written: i64 = self.with(|c| {
            self.redis
                .script(&self.scripts.put_deployment)
                .arg(&deployment.name)
                .arg(&expected)
                .arg(&body)
                .invoke(c)
        })?;
        Ok(written == 1)
    }

    fn delete_deployment(&self, name: &str) -> Result<bool, StoreError> {
        let removed: i64 =
            self.with(|c| redis::cmd("HDEL").arg(self.key("deployments")).arg(name).query(c))?;
        Ok(removed == 1)
    }

    fn deployments(&self) -> Result<Vec<DeploymentRecord>, StoreError> {
        let all: Vec<(String, String)> =
            self.with(|c| redis::cmd("HGETALL").arg(self.key("deployments")).query(c))?;
        let mut records = all
            .into_iter()
            .map(|(name, body)| {
                serde_json::from_str(&body).map_err(|e| StoreError::Corrupt { id: name, what: e.to_string() })
            })
            .collect::<Result<Vec<DeploymentRecord>, _>>()?;
        records.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(records)
    }

    fn create_procedure(&self, procedure: &Procedure) -> Result<bool, StoreError> {
        let body = serde_json::to_string(procedure).expect("a procedure serializes");
        let key = procedure.key();
        let written: bool =
            self.with(|c| redis::cmd("HSETNX").arg(self.key("procedures")).arg(&key).arg(&body).query(c))?;
        // Not written: another's, or ours with its reply lost.
        Ok(written || self.procedure_body(&key)?.is_some_and(|stored| stored == body))
    }

    fn delete_procedure(&self, key: &str) -> Result<bool, StoreError> {
        let removed: i64 = self.with(|c| redis::cmd("HDEL").arg(self.key("procedures")).arg(key).query(c))?;
        Ok(removed == 1)
    }

    fn procedure(&self, key: &str) -> Result<Option<Procedure>, StoreError> {
        self.procedure_body(key)?.map(|b| parse_procedure(key, &b)).transpose()
    }

    fn procedures(&self) -> Result<Vec<Procedure>, StoreError> {
        let all: Vec<(String, String)> =
            self.with(|c| redis::cmd("HGETALL").arg(self.key("procedures")).query(c))?;
        let mut procedures =
            all.iter().map(|(key, body)| parse_procedure(key, body)).collect::<Result<Vec<_>, _>>()?;
        procedures.sort_by_key(Procedure::key);
        Ok(procedures)
    }
}

impl RedisQueue {
    /// The stored JSON of procedure `key`.
    fn procedure_body(&self, key: &str) -> Result<Option<String>, StoreError> {
        self.with(|c| redis::cmd("HGET").arg(self.key("procedures")).arg(key).query(c))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::sync::Arc;
    use std::time::Duration;

    use hangar_redis::LocalRedis;

    use super::super::contract::{contract_tests, record};
    use super::*;

    fn open(server: &LocalRedis, lease_ms: Millis) -> RedisQueue {
        RedisQueue::open(Redis::connect(&server.url()).unwrap(), Shards::default(), lease_ms).unwrap()
    }

    fn local() -> Option<(LocalRedis, RedisQueue)> {
        let server = LocalRedis::for_test()?;
        let q = open(&server, 30_000);
        Some((server, q))
    }

    contract_tests!(local());

    /// The same contract on a Redis Cluster of three nodes, where every key
    /// is `{hangar}:…` — one slot, on one node — and each script, pipeline
    /// and transaction is sent to it.
    mod on_a_cluster {
        use hangar_redis::{LocalRedisCluster, Redis};

        use super::super::super::contract::contract_tests;
        use super::{RedisQueue, Shards};

        fn local() -> Option<(LocalRedisCluster, RedisQueue)> {
            let cluster = LocalRedisCluster::for_test()?;
            let redis = Redis::connect(&cluster.url()).unwrap();
            assert_eq!(redis.prefix(), "{hangar}");
            let q = RedisQueue::open(redis, Shards::default(), 30_000).unwrap();
            Some((cluster, q))
        }

        contract_tests!(local());

        /// `durable(1)` on a cluster whose primary has a replica: a create
        /// is acknowledged once the replica holds it; with the replica
        /// down it is stored on the primary but answered unavailable,
        /// naming the replicas, after `DURABLE_WAIT_MS`; repeated (the
        /// same id) once the replica is back, it is acknowledged — the
        /// replica holds it then, the first create included.
        #[test]
        fn a_durable_create_is_acknowledged_only_once_a_replica_holds_it() {
            use super::super::super::contract::record;
            use super::PredictionQueue;
            let Some(mut cluster) = LocalRedisCluster::for_test_with_replicas() else { return };
            let redis = Redis::connect(&cluster.url()).unwrap();
            let q = RedisQueue::open(redis.clone(), Shards::default(), 30_000).unwrap().durable(1);
            q.enqueue(&record("p1", "a/x", 0)).unwrap();
            let primary = cluster.primary_for(&redis.key("seq")).unwrap();
            let replica = cluster.replica_of(primary).unwrap();
            cluster.nodes()[replica].stop();
            let asked = std::time::Instant::now();
            let e = q.enqueue(&record("p2", "a/x", 1)).unwrap_err();
            assert!(e.is_unavailable() && e.to_string().contains("p2"), "{e}");
            assert!(asked.elapsed().as_millis() >= u128::from(super::DURABLE_WAIT_MS));
            assert!(q.get("p2").unwrap().is_some(), "stored on the primary");
            cluster.nodes()[replica].start_again().unwrap();
            cluster.wait_rejoined(replica, std::time::Duration::from_secs(30)).unwrap();
            let seq = q.enqueue(&record("p2", "a/x", 1)).unwrap();
            assert_eq!(q.get("p2").unwrap().unwrap().seq, seq, "the same prediction");
        }
    }

    fn of(id: &str, account: &str, t: Millis) -> Record {
        Record { account: account.into(), ..record(id, "a/x", t) }
    }

    /// Behind another account's backlog of 2,000, each of 50 accounts'
    /// first prediction is claimed within a rotation of the busy shards
    /// (the backlog holds two), unless its shard pair is the backlog's.
    #[test]
    fn a_backlog_fills_two_shards_and_others_are_served_in_turn() {
        let Some((_server, q)) = local() else { return };
        let big = Shards::default().of("big");
        for i in 0..2_000 {
            q.enqueue(&of(&format!("big{i}"), "big", i)).unwrap();
        }
        let queue = JobKind::Prediction.queue("a/x");
        for n in 0..50 {
            let account = format!("small{n}");
            let pair = Shards::default().of(&account);
            let same = pair == big || pair == (big.1, big.0);
            q.enqueue(&of(&format!("s{n}"), &account, 10_000)).unwrap();
            let claimed: Vec<String> =
                (0..3).map(|_| q.claim(&queue, "w", 0, 0).unwrap().unwrap().account).collect();
            // Its pair is the backlog's (1 in 496): it waits behind it.
            assert_eq!(claimed.contains(&account), !same, "{account}: {claimed:?}");
        }
    }

    /// Two gateways claiming from 8 threads each take every prediction
    /// exactly once.
    #[test]
    fn claims_are_exclusive_across_gateways() {
        let Some((server, a)) = local() else { return };
        let b = open(&server, 30_000);
        for i in 0..400 {
            a.enqueue(&of(&format!("p{i}"), &format!("acct{}", i % 7), i)).unwrap();
        }
        let (a, b) = (Arc::new(a), Arc::new(b));
        let queue = JobKind::Prediction.queue("a/x");
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let q = if t % 2 == 0 { a.clone() } else { b.clone() };
                let queue = queue.clone();
                std::thread::spawn(move || {
                    let mut got = Vec::new();
                    while let Some(r) = q.claim(&queue, &format!("w{t}"), 0, 0).unwrap() {
                        got.push(r.id);
                    }
                    got
                })
            })
            .collect();
        let all: Vec<String> = threads.into_iter().flat_map(|t| t.join().unwrap()).collect();
        let unique: HashSet<&String> = all.iter().collect();
        assert_eq!((all.len(), unique.len()), (400, 400));
    }

    /// A claim renewed by its heartbeat stays; one left idle past the
    /// lease is swept: back to the queue if it had not started, returned
    /// (for the caller to fail or requeue) if it had. The first sweep
    /// Redis sees (no sweep before it) takes nothing for a lease.
    #[test]
    fn idle_claims_are_swept_and_renewed_ones_stay() {
        let Some(server) = LocalRedis::for_test() else { return };
        let q = open(&server, 300);
        for i in 0..3 {
            q.enqueue(&of(&format!("p{i}"), "acme", i)).unwrap();
        }
        let queue = JobKind::Prediction.queue("a/x");
        let dead = |n| q.claim(&queue, "dead", 0, 0).unwrap().unwrap().id == n;
        assert!(dead("p0"));
        assert!(q.start("p0", 1, &[]).unwrap());
        assert!(dead("p1"));
        let alive = q.claim(&queue, "alive", 0, 0).unwrap().unwrap();
        assert!(q.sweep_expired_claims(0).unwrap().is_empty(), "the first sweep holds");
        let mut stale = Vec::new();
        for _ in 0..8 {
            std::thread::sleep(Duration::from_millis(100));
            assert_eq!(q.heartbeat("alive", 0, 0).unwrap(), 1);
            stale = q.sweep_expired_claims(0).unwrap();
            if !stale.is_empty() {
                break;
            }
        }
        assert_eq!(stale.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), ["p0"]);
        assert_eq!(q.claim(&queue, "other", 0, 0).unwrap().unwrap().id, "p1");
        assert!(q.sweep_expired_claims(0).unwrap().is_empty(), "taken claims are not swept twice at once");
        assert_eq!(q.heartbeat("alive", 0, 0).unwrap(), 1, "{} still held", alive.id);
    }

    /// After Redis served no sweep for more than half a lease (a stall),
    /// the next sweeps take nothing for a lease, even claims idle past
    /// it; then they take the dead owner's claim.
    #[test]
    fn a_gap_between_sweeps_holds_the_next_for_a_lease() {
        let Some(server) = LocalRedis::for_test() else { return };
        let q = open(&server, 400);
        q.enqueue(&of("p0", "acme", 0)).unwrap();
        let queue = JobKind::Prediction.queue("a/x");
        assert_eq!(q.claim(&queue, "dead", 0, 0).unwrap().unwrap().id, "p0");
        assert!(q.start("p0", 1, &[]).unwrap());
        q.sweep_expired_claims(0).unwrap();
        std::thread::sleep(Duration::from_millis(600));
        assert!(q.sweep_expired_claims(0).unwrap().is_empty(), "idle 600 ms > the lease, but after a gap");
        let mut sweeps = 0;
        let taken = loop {
            std::thread::sleep(Duration::from_millis(100));
            sweeps += 1;
            let stale = q.sweep_expired_claims(0).unwrap();
            if !stale.is_empty() {
                break stale;
            }
            assert!(sweeps < 20, "never swept");
        };
        assert!(sweeps >= 3, "swept {sweeps} sweeps after the gap, within the lease's hold");
        assert_eq!(taken[0].id, "p0");
    }

    /// Redis paused for longer than the lease while a sweep waits in it:
    /// the sweep runs when the pause ends — with every claim idle past
    /// the lease — and takes nothing; the owner, renewing after the pause
    /// as before it, keeps its claim.
    #[test]
    fn a_sweep_held_in_a_paused_redis_takes_no_live_claim() {
        let Some(server) = LocalRedis::for_test() else { return };
        let q = Arc::new(open(&server, 1_000));
        q.enqueue(&of("p0", "acme", 0)).unwrap();
        let queue = JobKind::Prediction.queue("a/x");
        assert_eq!(q.claim(&queue, "alive", 0, 0).unwrap().unwrap().id, "p0");
        assert!(q.start("p0", 1, &[]).unwrap());
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let owner = {
            let (q, stop) = (q.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = q.heartbeat("alive", 0, 0);
                    std::thread::sleep(Duration::from_millis(300));
                }
            })
        };
        let sweeper = {
            let (q, stop) = (q.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut taken = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    taken.extend(q.sweep_expired_claims(0).into_iter().flatten().map(|r| r.id));
                    std::thread::sleep(Duration::from_millis(300));
                }
                taken
            })
        };
        std::thread::sleep(Duration::from_millis(1_200));
        // Past the lease, under the 5 s command timeout: every call waits.
        server.pause(Duration::from_millis(2_500)).unwrap();
        std::thread::sleep(Duration::from_millis(5_000));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        owner.join().unwrap();
        assert_eq!(sweeper.join().unwrap(), Vec::<String>::new(), "a live owner's claim was swept");
        assert_eq!(q.heartbeat("alive", 0, 0).unwrap(), 1, "still its claim");
    }

    /// Records, queue entries, claims, deliveries and secrets survive a
    /// restart of Redis, and a crash (SIGKILL) more than a second after
    /// the writes (AOF fsyncs every second).
    #[test]
    fn everything_survives_a_redis_restart_and_crash() {
        let Some(mut server) = LocalRedis::for_test() else { return };
        let q = open(&server, 30_000);
        for i in 0..5 {
            q.enqueue(&of(&format!("p{i}"), "acme", i)).unwrap();
        }
        let queue = JobKind::Prediction.queue("a/x");
        let first = q.claim(&queue, "w", 0, 0).unwrap().unwrap();
        let secret = q.webhook_secrets("acme", 0, &|| "whsec_1".into()).unwrap();
        server.restart().unwrap();
        let check = |q: &RedisQueue| {
            assert_eq!(q.get("p4").unwrap().unwrap().status, Status::Starting);
            assert_eq!(q.webhook_secrets("acme", 0, &|| "whsec_2".into()).unwrap(), secret);
            assert!(
                q.start(&first.id, 1, &[]).unwrap()
                    || q.get(&first.id).unwrap().unwrap().status == Status::Processing
            );
        };
        // The pool's connections died with the server: the first command
        // finds out and runs again on a fresh one, unseen by the caller.
        check(&q);
        std::thread::sleep(Duration::from_millis(1_200));
        server.crash_and_restart().unwrap();
        let q = open(&server, 30_000);
        check(&q);
        let ids: HashSet<String> =
            std::iter::from_fn(|| q.claim(&queue, "w", 0, 0).unwrap()).map(|r| r.id).collect();
        assert_eq!(ids.len(), 4, "the four unclaimed ones are still queued: {ids:?}");
        assert!(!ids.contains(&first.id));
    }
}
