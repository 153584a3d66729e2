//! Durable predictions: the [`PredictionQueue`] contract and its two
//! implementations, [`SqliteQueue`] (one machine, the default) and
//! [`RedisQueue`] (Redis Streams, shared by every gateway of a fleet).
//!
//! The contract is shaped after Redis Streams with a consumer group:
//! [`PredictionQueue::enqueue`] is `XADD` to the model's stream (plus the
//! record write), [`claim`] is `XREADGROUP` by a consumer (`owner`) with a
//! lease, [`heartbeat`] is the claimer's periodic `XCLAIM` of its own
//! pending entries, [`finish`] is `XACK`+`XDEL`, and
//! [`sweep_expired_claims`] is `XAUTOCLAIM` of idle entries.
//!
//! Every state change is a compare-and-set on the status, so a prediction
//! reaches exactly one terminal state however cancel, the cordon loop,
//! the worker and recovery race — across processes too, with Redis.
//!
//! [`claim`]: PredictionQueue::claim
//! [`heartbeat`]: PredictionQueue::heartbeat
//! [`finish`]: PredictionQueue::finish
//! [`sweep_expired_claims`]: PredictionQueue::sweep_expired_claims

#[cfg(test)]
mod contract;
mod redis;
mod sqlite;
mod watched;

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

use hangar_core::Millis;

pub use self::redis::{RedisQueue, Shards};
pub use self::sqlite::SqliteQueue;
pub(crate) use self::watched::Watched;
use crate::deployments::DeploymentRecord;
use crate::procedures::Procedure;
use crate::record::{JobKind, Record};
use crate::webhook_policy::Event;

/// A store failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store cannot be reached, or cannot serve now: Redis down,
    /// restarting, paused or timing out; SQLite locked by another
    /// process beyond its busy timeout (5 s). Nothing is wrong with the
    /// call, which may succeed when repeated later: the API answers 503
    /// with `Retry-After`, and the driver waits it out. What the call
    /// would have written was not written — unless Redis ran it in the
    /// instant its reply was lost, and then repeating it finds it done
    /// (every store call is safe to repeat).
    #[error("the prediction store ({store}) is unreachable: {cause}")]
    Unavailable {
        /// Which store, as a client may be told it: `redis at
        /// redis://HOST:PORT` (no credentials), `sqlite predictions.sqlite3`.
        store: String,
        /// What failed, for the log.
        cause: String,
    },
    /// SQLite failed (disk full, corrupt file).
    #[error("prediction store: {0}")]
    Sqlite(rusqlite::Error),
    /// Redis refused a command.
    #[error("prediction store: {0}")]
    Redis(hangar_redis::RedisError),
    /// A stored row could not be read back.
    #[error("prediction store: corrupt row for `{id}`: {what}")]
    Corrupt {
        /// The prediction id.
        id: String,
        /// What was wrong.
        what: String,
    },
    /// The batch holding this write failed to commit (nothing of it was
    /// stored).
    #[error("prediction store: commit failed: {0}")]
    Commit(String),
    /// The writer thread is gone (the store is shutting down).
    #[error("prediction store: closed")]
    Closed,
    /// The data directory could not be created.
    #[error("prediction store: cannot create {path}: {source}")]
    Dir {
        /// The directory.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
}

/// How the SQLite store is named to clients: the file, not where it is.
const SQLITE_STORE: &str = "sqlite predictions.sqlite3";

impl StoreError {
    /// Whether the store was unreachable ([`StoreError::Unavailable`]):
    /// the call may succeed when repeated.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, StoreError::Unavailable { .. })
    }

    /// A Redis failure of the store at `address` ([`hangar_redis::Redis::address`]):
    /// [`StoreError::Unavailable`] when Redis could not serve
    /// ([`hangar_redis::RedisError::is_unavailable`]).
    pub(crate) fn redis(e: hangar_redis::RedisError, address: &str) -> Self {
        if e.is_unavailable() {
            StoreError::redis_unavailable(address, e.to_string())
        } else {
            StoreError::Redis(e)
        }
    }

    /// The Redis store at `address` could not serve, `cause` for the log.
    pub(crate) fn redis_unavailable(address: &str, cause: String) -> Self {
        StoreError::Unavailable { store: format!("redis at {address}"), cause }
    }

    /// A failed commit of the SQLite writer's batch, for each write in it.
    pub(crate) fn commit(e: &rusqlite::Error) -> Self {
        match sqlite_busy(e) {
            true => StoreError::Unavailable { store: SQLITE_STORE.into(), cause: e.to_string() },
            false => StoreError::Commit(e.to_string()),
        }
    }
}

/// Whether SQLite gave up waiting for a lock another connection holds
/// (`SQLITE_BUSY`, `SQLITE_LOCKED`, after the busy timeout).
fn sqlite_busy(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
    )
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        match sqlite_busy(&e) {
            true => StoreError::Unavailable { store: SQLITE_STORE.into(), cause: e.to_string() },
            false => StoreError::Sqlite(e),
        }
    }
}

/// A durable webhook delivery (`start` or `completed`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// The `webhook-id` header, the same on every attempt.
    pub id: String,
    /// The prediction it is about.
    pub prediction: String,
    /// The event.
    pub event: Event,
    /// Where it goes.
    pub url: String,
    /// The JSON body, fixed when the event happened.
    pub body: String,
    /// Failed attempts so far.
    pub attempts: u32,
    /// Not before this time.
    pub next_at: Millis,
    /// The account of its prediction, whose secret signs it (read back
    /// from the prediction, not stored with the delivery).
    pub account: String,
}

/// A rotated webhook signing secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rotation {
    /// The new secret.
    pub key: String,
    /// Until when the secret it replaced stays valid (webhooks carry both
    /// signatures until then); `None` when there was none.
    pub previous_valid_until: Option<Millis>,
}

/// What recovery did when the store was opened.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recovery {
    /// Predictions that were processing and are now failed.
    pub failed: Vec<String>,
    /// Predictions put back in their queue (idempotent models, or claimed
    /// but not yet started).
    pub requeued: Vec<String>,
}

/// A page of predictions, newest first.
#[derive(Debug, Clone, Default)]
pub struct Page {
    /// The predictions.
    pub results: Vec<Record>,
    /// Whether older ones exist after the last.
    pub more_after: bool,
    /// Whether newer ones exist before the first.
    pub more_before: bool,
}

impl Page {
    /// The page a listing from `cursor` makes of `rows`: up to `limit + 1`
    /// records in the order the store read them (newest first, or oldest
    /// first after `Cursor::After`), the extra one only telling that more
    /// follow. `exists(newer, seq)` says whether any record is newer
    /// (`true`) or older (`false`) than `seq`; each store answers it its
    /// own way.
    pub(crate) fn from_rows(
        cursor: Cursor,
        mut results: Vec<Record>,
        limit: usize,
        exists: impl Fn(bool, i64) -> Result<bool, StoreError>,
    ) -> Result<Page, StoreError> {
        let more = results.len() > limit;
        results.truncate(limit);
        Ok(match cursor {
            Cursor::After(_) => {
                results.reverse();
                let more_after = match results.last() {
                    Some(r) => exists(false, r.seq)?,
                    None => false,
                };
                Page { results, more_after, more_before: more }
            }
            _ => {
                let more_before = match results.first() {
                    Some(r) => exists(true, r.seq)?,
                    None => false,
                };
                Page { results, more_after: more, more_before }
            }
        })
    }
}

/// Where a listing starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cursor {
    /// The newest.
    Start,
    /// Those created before `seq` (next page).
    Before(i64),
    /// Those created after `seq` (previous page).
    After(i64),
}

/// The durable queue and record store behind the predictions API.
///
/// All methods are synchronous and short; they may block on disk or on a
/// round trip to Redis (inside a multi-threaded tokio runtime they do so
/// in `block_in_place`, see [`blocking`]).
pub trait PredictionQueue: Send + Sync {
    /// Persists a new record (status `starting`) and appends it to its
    /// model's queue, atomically. Returns the record's sequence number.
    /// When this returns, the prediction survives a crash (of this
    /// process; see each implementation for the machine and the server).
    /// A record whose id exists already is left as it is, and its
    /// sequence number returned: a create repeated (a retry after a lost
    /// answer, an `Idempotency-Key`'s) stores and queues one prediction.
    fn enqueue(&self, record: &Record) -> Result<i64, StoreError>;

    /// [`PredictionQueue::enqueue`] for async callers (the create path).
    /// By default it blocks in place; the SQLite store joins its next
    /// group commit without holding a thread.
    ///
    /// # Cancel safety
    /// Dropping the future does not withdraw the write: the prediction may
    /// still be stored.
    fn enqueue_async<'a>(&'a self, record: &'a Record) -> EnqueueFuture<'a> {
        Box::pin(async move { self.enqueue(record) })
    }

    /// Whether other processes share this store (a prediction may then
    /// be run, or end, in another gateway).
    fn shared(&self) -> bool {
        false
    }

    /// What a previous run of this process left behind, handled when the
    /// service starts: claims that can have no live owner any more.
    /// Entries claimed but not started go back to their queue; processing
    /// ones are re-queued when `idempotent(model)`, failed otherwise, with
    /// `now` as their end and a `completed` webhook from
    /// `completed(record)`.
    fn recover(
        &self,
        now: Millis,
        idempotent: &dyn Fn(&str) -> bool,
        completed: &dyn Fn(&Record) -> Option<Delivery>,
    ) -> Result<Recovery, StoreError>;

    /// The record with `id`.
    fn get(&self, id: &str) -> Result<Option<Record>, StoreError>;

    /// Up to `limit` records of `kind` of `account` (all accounts if
    /// `None`), newest first, from `cursor`.
    fn list(
        &self,
        account: Option<&str>,
        kind: JobKind,
        cursor: Cursor,
        limit: usize,
    ) -> Result<Page, StoreError>;

    /// Claims an unclaimed entry of `queue` for `owner` until `now +
    /// lease_ms`, returning its record: the oldest entry of the account
    /// whose turn it is, accounts with waiting work taking turns (one
    /// claim each, a newcomer at the back of the rotation), so one
    /// account's backlog does not hold up another's predictions.
    fn claim(
        &self,
        queue: &str,
        owner: &str,
        now: Millis,
        lease_ms: Millis,
    ) -> Result<Option<Record>, StoreError>;

    /// Extends every lease `owner` holds to `now + lease_ms`.
    fn heartbeat(&self, owner: &str, now: Millis, lease_ms: Millis) -> Result<usize, StoreError>;

    /// Stops renewing `owner`'s claim of `id` (its run failed on a store
    /// error): once its lease passes, a sweep handles it as a dead
    /// owner's. Best effort, and never fails: the store may be what is
    /// failing.
    fn abandon(&self, owner: &str, id: &str);

    /// Moves a `starting` record to `processing` at `now` and records
    /// `deliveries` (its `start` webhook) in the same transaction. `false`
    /// (and nothing written) if it was no longer `starting` (canceled or
    /// ended meanwhile).
    fn start(&self, id: &str, now: Millis, deliveries: &[Delivery]) -> Result<bool, StoreError>;

    /// Saves a running record's output and logs so far.
    fn save_progress(&self, id: &str, output: &serde_json::Value, logs: &str) -> Result<(), StoreError>;

    /// Ends a record: writes its terminal fields if it is not terminal yet,
    /// removes its queue entry, and records `deliveries` — all in one
    /// transaction. `false` (and nothing written) if it had already ended.
    fn finish(&self, record: &Record, deliveries: &[Delivery]) -> Result<bool, StoreError>;

    /// Deliveries due at `now`, oldest first.
    fn due_deliveries(&self, now: Millis, limit: usize) -> Result<Vec<Delivery>, StoreError>;

    /// The soonest pending delivery time.
    fn next_delivery_at(&self) -> Result<Option<Millis>, StoreError>;

    /// After an attempt: delivered (`next_at = None` and `delivered`), to
    /// retry at `next_at`, or given up.
    fn delivery_attempted(
        &self,
        id: &str,
        delivered: bool,
        next_at: Option<Millis>,
    ) -> Result<(), StoreError>;

    /// Records waiting in a queue (unclaimed, `starting`) whose deadline or
    /// lifetime passed by `now` (the cordon loop's query).
    fn expired_waiting(&self, now: Millis, limit: usize) -> Result<Vec<Record>, StoreError>;

    /// Handles claims whose lease expired by `now`: entries not started
    /// go back to their queue; started ones are returned for the caller
    /// to fail or re-queue (see [`PredictionQueue::requeue`]).
    fn sweep_expired_claims(&self, now: Millis) -> Result<Vec<Record>, StoreError>;

    /// Puts a processing record back in its queue as `starting` (an
    /// idempotent model's prediction whose worker died).
    fn requeue(&self, id: &str) -> Result<bool, StoreError>;

    /// Deletes queue entries enqueued before `before` (stuck entries; the
    /// cordon loop or lifetime normally ends them first). Their records
    /// fail. Returns the ids.
    fn prune_queue(&self, before: Millis, now: Millis) -> Result<Vec<String>, StoreError>;

    /// Removes input, output and logs of records that ended before
    /// `before` (`data_removed: true`). Returns how many.
    fn remove_data(&self, before: Millis) -> Result<usize, StoreError>;

    /// The webhook signing secrets of `account` valid at `now`, newest
    /// first: its current secret (created with `create` on first use and
    /// kept), then rotated-out ones still in their grace period.
    fn webhook_secrets(
        &self,
        account: &str,
        now: Millis,
        create: &dyn Fn() -> String,
    ) -> Result<Vec<String>, StoreError>;

    /// Makes a new current secret for `account` (with `create`); the one
    /// it replaces stays valid until `now + grace_ms`.
    fn rotate_webhook_secret(
        &self,
        account: &str,
        now: Millis,
        grace_ms: Millis,
        create: &dyn Fn() -> String,
    ) -> Result<Rotation, StoreError>;

    /// Writes `deployment` if the stored one of its name is at release
    /// `expected` (`None`: if there is none): a compare-and-set, so two
    /// updates racing from two gateways cannot both win. Returns whether
    /// it was written; repeating a write that was made (its reply lost)
    /// reports `true`.
    fn put_deployment(
        &self,
        deployment: &DeploymentRecord,
        expected: Option<u32>,
    ) -> Result<bool, StoreError>;

    /// Removes the deployment `name`; whether there was one.
    fn delete_deployment(&self, name: &str) -> Result<bool, StoreError>;

    /// Every stored deployment, by name.
    fn deployments(&self) -> Result<Vec<DeploymentRecord>, StoreError>;

    /// Adds `procedure` under its `owner/name` unless one of that name is
    /// stored: whether it was written. Repeating a write that was made
    /// (its reply lost) reports `true`.
    fn create_procedure(&self, procedure: &Procedure) -> Result<bool, StoreError>;

    /// Removes the procedure `key` (`owner/name`); whether there was one.
    fn delete_procedure(&self, key: &str) -> Result<bool, StoreError>;

    /// The procedure `key`, if stored.
    fn procedure(&self, key: &str) -> Result<Option<Procedure>, StoreError>;

    /// Every stored procedure, by key.
    fn procedures(&self) -> Result<Vec<Procedure>, StoreError>;
}

/// What [`PredictionQueue::enqueue_async`] returns.
pub type EnqueueFuture<'a> = Pin<Box<dyn Future<Output = Result<i64, StoreError>> + Send + 'a>>;

/// Where the predictions live.
#[derive(Debug, Clone)]
pub enum Backend {
    /// `predictions.sqlite3` in this data directory (one machine).
    Sqlite(PathBuf),
    /// One Redis that every gateway of the fleet shares.
    Redis(hangar_redis::Redis),
}

impl Backend {
    /// Opens the store. `lease_ms` is how long a claim lives without a
    /// heartbeat; `grace_ms` how long a retired webhook secret stays
    /// valid, from `now`; `durable_replicas` the Redis replicas that must
    /// hold a create ([`RedisQueue::durable`]; a SQLite store has none:
    /// `Service::start` refuses to ask it for any).
    pub fn open(
        &self,
        lease_ms: Millis,
        grace_ms: Millis,
        now: Millis,
        durable_replicas: u32,
    ) -> Result<Arc<dyn PredictionQueue>, StoreError> {
        Ok(match self {
            Backend::Sqlite(dir) => {
                let store = SqliteQueue::open(dir)?;
                store.retire_shared_webhook_secret(now, grace_ms)?;
                Arc::new(store)
            }
            Backend::Redis(redis) => Arc::new(
                RedisQueue::open(redis.clone(), Shards::default(), lease_ms)?.durable(durable_replicas),
            ),
        })
    }
}

/// A stored procedure's JSON read back (`key` names it when it is not one).
fn parse_procedure(key: &str, body: &str) -> Result<Procedure, StoreError> {
    serde_json::from_str(body).map_err(|e| StoreError::Corrupt { id: key.to_owned(), what: e.to_string() })
}

/// Runs `f`, a call that blocks on I/O, in `block_in_place` when on a
/// multi-threaded tokio runtime (other tasks keep running), else plainly.
pub(crate) fn blocking<T>(f: impl FnOnce() -> T) -> T {
    let in_multi_thread = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if in_multi_thread {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}
