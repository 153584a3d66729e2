//! The embedded store: one SQLite file (WAL), group-committed writes.

use std::path::Path;
use std::sync::Mutex;

use hangar_core::Millis;
use rusqlite::{params, Connection, OptionalExtension, Row};

use super::{
    blocking, parse_procedure, Cursor, Delivery, Page, PredictionQueue, Recovery, Rotation, StoreError,
};
use crate::deployments::DeploymentRecord;
use crate::lifecycle::Status;
use crate::procedures::Procedure;
use crate::record::{JobKind, Record};
use crate::webhook_policy::{Event, Filter};

/// The SQLite store (one file, WAL journal).
///
/// Writes go to one writer thread that **group-commits**: it takes every
/// write waiting, runs each in its own savepoint (a failing write rolls
/// back alone), commits them in one transaction and only then answers
/// each caller — so a write has returned only once it is durable, and N
/// concurrent writes cost one commit instead of N. Reads use their own
/// connection (WAL readers do not block the writer).
///
/// Write methods block the calling thread until the commit; inside a
/// multi-threaded tokio runtime they do so in `block_in_place`, so other
/// tasks keep running meanwhile.
pub struct SqliteQueue {
    read: Mutex<Connection>,
    writer: Mutex<std::sync::mpsc::Sender<WriteOp>>,
    /// Dropped with the store, which ends the checkpointer thread.
    _checkpointer: std::sync::mpsc::Sender<()>,
}

/// How often the WAL is checkpointed into the database file.
const CHECKPOINT_EVERY: std::time::Duration = std::time::Duration::from_millis(200);

/// Runs one write inside the current batch (given its connection; `None`
/// when the batch could not begin, and the write must not run); returns
/// what to do once the batch's commit is known (`None`: committed;
/// `Some(e)`: it failed).
type WriteOp =
    Box<dyn FnOnce(Option<&Connection>) -> Box<dyn FnOnce(Option<&rusqlite::Error>) + Send> + Send>;

/// The most writes one commit takes.
const MAX_BATCH: usize = 1024;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS predictions (
    seq INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    model TEXT NOT NULL,
    version TEXT NOT NULL,
    deployment TEXT,
    account TEXT NOT NULL,
    input TEXT,
    output TEXT,
    logs TEXT NOT NULL DEFAULT '',
    error TEXT,
    status TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    started_at INTEGER,
    completed_at INTEGER,
    deadline INTEGER,
    lifetime_deadline INTEGER,
    webhook TEXT,
    webhook_events INTEGER NOT NULL,
    stream INTEGER NOT NULL,
    destination TEXT,
    data_removed INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS predictions_account ON predictions(account, seq);
CREATE INDEX IF NOT EXISTS predictions_ended ON predictions(completed_at) WHERE data_removed = 0;
CREATE TABLE IF NOT EXISTS queue (
    seq INTEGER PRIMARY KEY,
    queue TEXT NOT NULL,
    prediction TEXT NOT NULL UNIQUE,
    enqueued_at INTEGER NOT NULL,
    expires_at INTEGER,
    owner TEXT,
    lease_until INTEGER,
    account TEXT
);
CREATE INDEX IF NOT EXISTS queue_free ON queue(queue, seq) WHERE owner IS NULL;
CREATE TABLE IF NOT EXISTS queue_turns (
    queue TEXT NOT NULL,
    account TEXT NOT NULL,
    turn INTEGER NOT NULL,
    PRIMARY KEY (queue, account)
);
CREATE INDEX IF NOT EXISTS queue_turns_next ON queue_turns(queue, turn);
CREATE INDEX IF NOT EXISTS queue_expiry ON queue(expires_at) WHERE owner IS NULL;
CREATE INDEX IF NOT EXISTS queue_owner ON queue(owner);
CREATE TABLE IF NOT EXISTS deliveries (
    id TEXT PRIMARY KEY,
    prediction TEXT NOT NULL,
    event TEXT NOT NULL,
    url TEXT NOT NULL,
    body TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_at INTEGER,
    delivered INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS deliveries_due ON deliveries(next_at) WHERE next_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS webhook_secrets (
    seq INTEGER PRIMARY KEY,
    account TEXT NOT NULL,
    secret TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER
);
CREATE INDEX IF NOT EXISTS webhook_secrets_account ON webhook_secrets(account, seq);
CREATE UNIQUE INDEX IF NOT EXISTS webhook_secrets_current ON webhook_secrets(account) WHERE expires_at IS NULL;
CREATE TABLE IF NOT EXISTS deployments (
    name TEXT PRIMARY KEY,
    release INTEGER NOT NULL,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS procedures (
    key TEXT PRIMARY KEY,
    body TEXT NOT NULL
);
";

// Schema history. Every statement of `SCHEMA` is `IF NOT EXISTS`, so
// opening a file of an older version adds what it lacks:
// - v2 (issue 17): `webhook_secrets`, one signing secret per account,
//   replacing the one shared secret of `meta.webhook_secret`. That shared
//   secret, if the file has one, is retired rather than dropped: when the
//   server starts it gets an end (`meta.webhook_secret_retired_until`,
//   start + the grace period, see [`SqliteQueue::retire_shared_webhook_secret`]),
//   and until then each account's webhooks carry its signature too, so
//   receivers configured with it keep verifying while they move to their
//   account's own secret.
// - v3 (issue 19): queue entries carry their `account`, and `queue_turns`
//   holds, per queue, each account with waiting work and its place in the
//   rotation claims follow ([`migrate_fair_queue`] adds the column to an
//   older file and fills both from `predictions`).
// - v4 (issue 29): `deployments`, those made through the API, each its
//   JSON ([`DeploymentRecord`]) under its name with its release number.
// - v5 (issue 31): `procedures`, each its JSON ([`Procedure`]) under its
//   `owner/name` (before, each server kept them in `procedures.json`,
//   which the service moves in: `procedures::adopt_legacy`).

const COLUMNS: &str =
    "seq, id, kind, model, version, deployment, account, input, output, logs, error, status, \
     created_at, started_at, completed_at, deadline, lifetime_deadline, webhook, webhook_events, stream, \
     destination, data_removed";

impl SqliteQueue {
    /// Opens (creating) `dir/predictions.sqlite3` and starts its writer
    /// thread (it ends when the store is dropped).
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        std::fs::create_dir_all(dir)
            .map_err(|source| StoreError::Dir { path: dir.display().to_string(), source })?;
        let path = dir.join("predictions.sqlite3");
        let connect = || -> Result<Connection, StoreError> {
            let conn = Connection::open(&path)?;
            // WAL with synchronous=NORMAL: a committed transaction survives
            // the process being killed (the WAL is in the OS's hands); only
            // an OS crash or power loss can lose the last commits.
            conn.pragma_update(None, "journal_mode", "WAL")?;
            conn.pragma_update(None, "synchronous", "NORMAL")?;
            conn.pragma_update(None, "busy_timeout", 5000)?;
            conn.set_prepared_statement_cache_capacity(64);
            Ok(conn)
        };
        let write = connect()?;
        write.execute_batch(SCHEMA)?;
        migrate_fair_queue(&write)?;
        // Checkpoints (which fsync) run on their own thread, not inside a
        // commit that callers wait for.
        write.pragma_update(None, "wal_autocheckpoint", 0)?;
        let read = connect()?;
        let checkpoint = connect()?;
        let spawn_error = |source| StoreError::Dir { path: dir.display().to_string(), source };
        let (tx, rx) = std::sync::mpsc::channel::<WriteOp>();
        std::thread::Builder::new()
            .name("predictions-writer".into())
            .spawn(move || write_batches(write, rx))
            .map_err(spawn_error)?;
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        std::thread::Builder::new()
            .name("predictions-checkpoint".into())
            .spawn(move || {
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    stopped.recv_timeout(CHECKPOINT_EVERY)
                {
                    if let Err(e) = checkpoint.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
                        tracing::warn!("prediction store checkpoint: {e}");
                    }
                }
            })
            .map_err(spawn_error)?;
        Ok(SqliteQueue { read: Mutex::new(read), writer: Mutex::new(tx), _checkpointer: stop })
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.read.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `f` to run on the writer connection in the next batch, in
    /// its own savepoint; `reply` gets its result once the batch's commit
    /// is known.
    fn submit<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
        reply: impl FnOnce(Result<T, StoreError>) + Send + 'static,
    ) -> Result<(), StoreError> {
        let op: WriteOp = Box::new(move |conn| {
            let result = conn.map(|conn| in_savepoint(conn, f));
            Box::new(move |commit_error: Option<&rusqlite::Error>| {
                reply(match (commit_error, result) {
                    (Some(e), _) => Err(StoreError::commit(e)),
                    (None, Some(result)) => result,
                    (None, None) => Err(StoreError::Commit("the write did not run".into())),
                })
            })
        });
        self.writer.lock().unwrap_or_else(|e| e.into_inner()).send(op).map_err(|_| StoreError::Closed)
    }

    /// Runs `f` in the next batch and returns its result once the batch
    /// has committed, blocking (in `block_in_place` on a multi-threaded
    /// tokio runtime).
    fn write<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.submit(f, move |r| {
            let _ = tx.send(r);
        })?;
        blocking(move || rx.recv().map_err(|_| StoreError::Closed))?
    }
}

/// The writer thread: batches of writes, one commit each, until every
/// sender is gone.
fn write_batches(conn: Connection, ops: std::sync::mpsc::Receiver<WriteOp>) {
    while let Ok(first) = ops.recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match ops.try_recv() {
                Ok(op) => batch.push(op),
                Err(_) => break,
            }
        }
        if let Err(e) = conn.execute_batch("BEGIN IMMEDIATE") {
            // Not run (outside a transaction each write's savepoint would
            // commit on its own): report the failure to every caller.
            for op in batch {
                op(None)(Some(&e));
            }
            continue;
        }
        let replies: Vec<_> = batch.into_iter().map(|op| op(Some(&conn))).collect();
        let committed = conn.execute_batch("COMMIT").inspect_err(|_| {
            let _ = conn.execute_batch("ROLLBACK");
        });
        let error = committed.err();
        for reply in replies {
            reply(error.as_ref());
        }
    }
}

/// Runs `f` in a savepoint: its writes are kept if it succeeds and undone
/// if it fails, without touching the rest of the batch.
fn in_savepoint<T>(
    conn: &Connection,
    f: impl FnOnce(&Connection) -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    conn.prepare_cached("SAVEPOINT op")?.execute([])?;
    let result = f(conn);
    let end = match &result {
        Ok(_) => conn.execute_batch("RELEASE op"),
        Err(_) => conn.execute_batch("ROLLBACK TO op; RELEASE op"),
    };
    match (result, end) {
        (Ok(v), Ok(())) => Ok(v),
        (Err(e), _) => Err(e),
        (Ok(_), Err(e)) => Err(e.into()),
    }
}

/// Inserts a new record and its queue entry.
fn insert_new(conn: &Connection, r: &Record) -> Result<i64, StoreError> {
    let inserted = conn
        .prepare_cached(
            "INSERT INTO predictions (id, kind, model, version, deployment, account, input, status, created_at, \
             deadline, lifetime_deadline, webhook, webhook_events, stream, destination) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15) ON CONFLICT (id) DO NOTHING",
        )?
        .execute(params![
        r.id,
        r.kind.as_str(),
        r.model,
        r.version,
        r.deployment,
        r.account,
        r.input.to_string(),
        r.status.as_str(),
        r.created_at as i64,
        r.deadline.map(|t| t as i64),
        r.lifetime_deadline.map(|t| t as i64),
        r.webhook,
        r.webhook_events.bits(),
        r.stream,
        r.destination,
    ])?;
    if inserted == 0 {
        // The id exists (a create repeated): it stays as it is.
        return Ok(conn
            .prepare_cached("SELECT seq FROM predictions WHERE id = ?1")?
            .query_row([&r.id], |row| row.get(0))?);
    }
    let seq = conn.last_insert_rowid();
    let expires = match (r.deadline, r.lifetime_deadline) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let queue = r.kind.queue(&r.model);
    conn.prepare_cached(
        "INSERT INTO queue (queue, prediction, enqueued_at, expires_at, account) VALUES (?1, ?2, ?3, ?4, ?5)",
    )?
    .execute(params![queue, r.id, r.created_at as i64, expires.map(|t| t as i64), r.account])?;
    take_turn(conn, &queue, &r.account, false)?;
    Ok(seq)
}

/// The entry of `queue` to claim next: the oldest of the account first in
/// the rotation that still has one waiting (accounts with none leave it),
/// else — an entry no account's turn covers — the oldest of all.
fn next_fair(conn: &Connection, queue: &str) -> Result<Option<(i64, String, Option<String>)>, StoreError> {
    loop {
        let first: Option<String> = conn
            .prepare_cached("SELECT account FROM queue_turns WHERE queue = ?1 ORDER BY turn LIMIT 1")?
            .query_row([queue], |r| r.get(0))
            .optional()?;
        let Some(account) = first else { break };
        let entry: Option<(i64, String)> = conn
            .prepare_cached(
                "SELECT seq, prediction FROM queue WHERE queue = ?1 AND account = ?2 AND owner IS NULL \
                 ORDER BY seq LIMIT 1",
            )?
            .query_row(params![queue, account], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?;
        match entry {
            Some((seq, id)) => return Ok(Some((seq, id, Some(account)))),
            None => {
                conn.prepare_cached("DELETE FROM queue_turns WHERE queue = ?1 AND account = ?2")?
                    .execute(params![queue, account])?;
            }
        }
    }
    Ok(conn
        .prepare_cached(
            "SELECT seq, prediction, account FROM queue WHERE queue = ?1 AND owner IS NULL ORDER BY seq LIMIT 1",
        )?
        .query_row([queue], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .optional()?)
}

/// Puts `account` in `queue`'s rotation: at its back if `again` (it was
/// just served) or if it was not in it; left where it is otherwise.
fn take_turn(conn: &Connection, queue: &str, account: &str, again: bool) -> Result<(), StoreError> {
    let sql = if again {
        "INSERT INTO queue_turns (queue, account, turn) \
         VALUES (?1, ?2, (SELECT COALESCE(MAX(turn), 0) + 1 FROM queue_turns WHERE queue = ?1)) \
         ON CONFLICT (queue, account) DO UPDATE SET turn = excluded.turn"
    } else {
        "INSERT OR IGNORE INTO queue_turns (queue, account, turn) \
         VALUES (?1, ?2, (SELECT COALESCE(MAX(turn), 0) + 1 FROM queue_turns WHERE queue = ?1))"
    };
    conn.prepare_cached(sql)?.execute(params![queue, account])?;
    Ok(())
}

/// Gives every account with unclaimed entries a place in its queue's
/// rotation: after claims are released (a restart, an expired lease, a
/// requeue), whose accounts may have left it when they had nothing
/// waiting.
fn rejoin_turns(conn: &Connection) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT OR IGNORE INTO queue_turns (queue, account, turn) \
         SELECT queue, account, (SELECT COALESCE(MAX(turn), 0) FROM queue_turns) + MIN(seq) \
         FROM queue WHERE owner IS NULL AND account IS NOT NULL GROUP BY queue, account",
    )?
    .execute([])?;
    Ok(())
}

/// Schema v3 on a file of an older version: the queue's `account` column
/// (filled from each entry's prediction), its index, and the rotation.
fn migrate_fair_queue(conn: &Connection) -> Result<(), StoreError> {
    let has_account =
        conn.prepare("SELECT 1 FROM pragma_table_info('queue') WHERE name = 'account'")?.exists([])?;
    if !has_account {
        conn.execute_batch(
            "ALTER TABLE queue ADD COLUMN account TEXT;
             UPDATE queue SET account = (SELECT account FROM predictions WHERE id = queue.prediction);",
        )?;
    }
    conn.execute_batch(
        "CREATE INDEX IF NOT EXISTS queue_fair ON queue(queue, account, seq) WHERE owner IS NULL;",
    )?;
    rejoin_turns(conn)
}

fn insert_delivery(conn: &Connection, d: &Delivery) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT OR IGNORE INTO deliveries (id, prediction, event, url, body, attempts, next_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )?
    .execute(params![d.id, d.prediction, d.event.as_str(), d.url, d.body, d.attempts, d.next_at as i64])?;
    Ok(())
}

type RowResult = Result<Record, StoreError>;

fn read_row(row: &Row<'_>) -> rusqlite::Result<RowResult> {
    let id: String = row.get(1)?;
    let corrupt = |what: &str| StoreError::Corrupt { id: id.clone(), what: what.to_owned() };
    let json = |i: usize| -> rusqlite::Result<Result<Option<serde_json::Value>, StoreError>> {
        let s: Option<String> = row.get(i)?;
        Ok(s.map(|s| serde_json::from_str(&s)).transpose().map_err(|e| corrupt(&format!("column {i}: {e}"))))
    };
    let kind: String = row.get(2)?;
    let status: String = row.get(11)?;
    let input = match json(7)? {
        Ok(v) => v.unwrap_or(serde_json::Value::Null),
        Err(e) => return Ok(Err(e)),
    };
    let output = match json(8)? {
        Ok(v) => v,
        Err(e) => return Ok(Err(e)),
    };
    let (Some(kind), Some(status)) = (JobKind::parse(&kind), Status::parse(&status)) else {
        return Ok(Err(corrupt(&format!("kind `{kind}` / status `{status}`"))));
    };
    let ms = |i: usize| -> rusqlite::Result<Option<Millis>> {
        Ok(row.get::<_, Option<i64>>(i)?.map(|v| v as Millis))
    };
    let events: u8 = row.get(18)?;
    Ok(Ok(Record {
        seq: row.get(0)?,
        id: id.clone(),
        kind,
        model: row.get(3)?,
        version: row.get(4)?,
        deployment: row.get(5)?,
        account: row.get(6)?,
        input,
        output,
        logs: row.get(9)?,
        error: row.get(10)?,
        status,
        created_at: row.get::<_, i64>(12)? as Millis,
        started_at: ms(13)?,
        completed_at: ms(14)?,
        deadline: ms(15)?,
        lifetime_deadline: ms(16)?,
        webhook: row.get(17)?,
        webhook_events: Filter::from_bits(events),
        stream: row.get(19)?,
        destination: row.get(20)?,
        data_removed: row.get(21)?,
    }))
}

fn collect(
    rows: rusqlite::MappedRows<'_, impl FnMut(&Row<'_>) -> rusqlite::Result<RowResult>>,
) -> Result<Vec<Record>, StoreError> {
    let mut out = Vec::new();
    for r in rows {
        out.push(r??);
    }
    Ok(out)
}

impl PredictionQueue for SqliteQueue {
    fn enqueue_async<'a>(&'a self, record: &'a Record) -> super::EnqueueFuture<'a> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let r = record.clone();
        let submitted = self.submit(
            move |conn| insert_new(conn, &r),
            move |result| {
                let _ = tx.send(result);
            },
        );
        Box::pin(async move {
            submitted?;
            rx.await.map_err(|_| StoreError::Closed)?
        })
    }

    /// Recovery after a restart: every claim in the file belongs to a dead
    /// process (a data directory belongs to one server). Claimed entries
    /// that never started go back to their queue; processing ones are
    /// re-queued when `idempotent(model)`, failed otherwise, with `now` as
    /// their end and a `completed` webhook from `completed(record)`.
    fn recover(
        &self,
        now: Millis,
        idempotent: &dyn Fn(&str) -> bool,
        completed: &dyn Fn(&Record) -> Option<Delivery>,
    ) -> Result<Recovery, StoreError> {
        let orphans: Vec<Record> = self.write(|conn| {
            conn.execute(
                "UPDATE queue SET owner = NULL, lease_until = NULL WHERE owner IS NOT NULL \
                 AND prediction IN (SELECT id FROM predictions WHERE status = 'starting')",
                [],
            )?;
            rejoin_turns(conn)?;
            let mut stmt = conn.prepare(&format!(
                "SELECT {COLUMNS} FROM predictions WHERE status = 'processing' ORDER BY seq"
            ))?;
            let rows = collect(stmt.query_map([], read_row)?);
            rows
        })?;
        let mut out = Recovery::default();
        for mut r in orphans {
            if idempotent(&r.model) {
                if self.requeue(&r.id)? {
                    out.requeued.push(r.id);
                }
                continue;
            }
            r.status = Status::Failed;
            r.error = Some("the server stopped while this prediction was running; it was not retried because the model is not marked idempotent".into());
            r.completed_at = Some(now);
            if self.finish(&r, &completed(&r).into_iter().collect::<Vec<_>>())? {
                out.failed.push(r.id);
            }
        }
        Ok(out)
    }

    fn enqueue(&self, r: &Record) -> Result<i64, StoreError> {
        let r = r.clone();
        self.write(move |conn| insert_new(conn, &r))
    }

    fn get(&self, id: &str) -> Result<Option<Record>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(&format!("SELECT {COLUMNS} FROM predictions WHERE id = ?1"))?;
        stmt.query_row([id], read_row).optional()?.transpose()
    }

    fn list(
        &self,
        account: Option<&str>,
        kind: JobKind,
        cursor: Cursor,
        limit: usize,
    ) -> Result<Page, StoreError> {
        let conn = self.conn();
        // A procedure's run is listed with the predictions.
        let also = if kind == JobKind::Prediction { JobKind::Procedure } else { kind }.as_str();
        let kind = kind.as_str();
        let (cmp, order) = match cursor {
            Cursor::Start => ("seq < ?2", "DESC"),
            Cursor::Before(_) => ("seq < ?2", "DESC"),
            Cursor::After(_) => ("seq > ?2", "ASC"),
        };
        let pivot = match cursor {
            Cursor::Start => i64::MAX,
            Cursor::Before(s) | Cursor::After(s) => s,
        };
        let sql = format!(
            "SELECT {COLUMNS} FROM predictions WHERE (?1 IS NULL OR account = ?1) AND kind IN (?4, ?5) AND {cmp} \
             ORDER BY seq {order} LIMIT ?3"
        );
        let mut stmt = conn.prepare_cached(&sql)?;
        let results =
            collect(stmt.query_map(params![account, pivot, limit as i64 + 1, kind, also], read_row)?)?;
        Page::from_rows(cursor, results, limit, |newer, seq| {
            let cmp = if newer { ">" } else { "<" };
            let sql = format!(
                "SELECT EXISTS (SELECT 1 FROM predictions WHERE (?1 IS NULL OR account = ?1) AND kind IN (?3, ?4) AND seq {cmp} ?2)"
            );
            Ok(conn.prepare_cached(&sql)?.query_row(params![account, seq, kind, also], |r| r.get(0))?)
        })
    }

    fn claim(
        &self,
        queue: &str,
        owner: &str,
        now: Millis,
        lease_ms: Millis,
    ) -> Result<Option<Record>, StoreError> {
        let (queue, owner) = (queue.to_owned(), owner.to_owned());
        self.write(move |conn| {
            let Some((seq, id, account)) = next_fair(conn, &queue)? else { return Ok(None) };
            conn.prepare_cached("UPDATE queue SET owner = ?2, lease_until = ?3 WHERE seq = ?1")?
                .execute(params![seq, owner, (now + lease_ms) as i64])?;
            if let Some(account) = account {
                take_turn(conn, &queue, &account, true)?;
            }
            conn.prepare_cached(&format!("SELECT {COLUMNS} FROM predictions WHERE id = ?1"))?
                .query_row([&id], read_row)
                .optional()?
                .transpose()
        })
    }

    fn heartbeat(&self, owner: &str, now: Millis, lease_ms: Millis) -> Result<usize, StoreError> {
        let owner = owner.to_owned();
        self.write(move |conn| {
            Ok(conn
                .prepare_cached("UPDATE queue SET lease_until = ?2 WHERE owner = ?1")?
                .execute(params![owner, (now + lease_ms) as i64])?)
        })
    }

    fn abandon(&self, owner: &str, id: &str) {
        let (owner, id) = (owner.to_owned(), id.to_owned());
        let expired = self.write(move |conn| {
            conn.prepare_cached("UPDATE queue SET lease_until = 0 WHERE prediction = ?1 AND owner = ?2")?
                .execute(params![id, owner])?;
            Ok(())
        });
        if let Err(e) = expired {
            tracing::warn!("prediction store: cannot expire an abandoned claim: {e}");
        }
    }

    fn start(&self, id: &str, now: Millis, deliveries: &[Delivery]) -> Result<bool, StoreError> {
        let (id, deliveries) = (id.to_owned(), deliveries.to_vec());
        self.write(move |conn| {
            let started = conn
                .prepare_cached(
                    "UPDATE predictions SET status = 'processing', started_at = ?2 WHERE id = ?1 AND status = 'starting'",
                )?
                .execute(params![id, now as i64])?
                == 1;
            if started {
                for d in &deliveries {
                    insert_delivery(conn, d)?;
                }
            }
            Ok(started)
        })
    }

    fn save_progress(&self, id: &str, output: &serde_json::Value, logs: &str) -> Result<(), StoreError> {
        let (id, output, logs) = (id.to_owned(), output.to_string(), logs.to_owned());
        self.write(move |conn| {
            conn.prepare_cached(
                "UPDATE predictions SET output = ?2, logs = ?3 WHERE id = ?1 AND status = 'processing'",
            )?
            .execute(params![id, output, logs])?;
            Ok(())
        })
    }

    fn finish(&self, r: &Record, deliveries: &[Delivery]) -> Result<bool, StoreError> {
        if !r.status.is_terminal() {
            return Ok(false);
        }
        let (r, deliveries) = (r.clone(), deliveries.to_vec());
        self.write(move |conn| {
            // Compare-and-set: only from a state that may become this one.
            let changed = conn
                .prepare_cached(
                    "UPDATE predictions SET status = ?2, output = ?3, logs = ?4, error = ?5, started_at = ?6, \
                     completed_at = ?7 WHERE id = ?1 AND (status = 'processing' OR (status = 'starting' AND ?2 != 'succeeded'))",
                )?
                .execute(params![
                    r.id,
                    r.status.as_str(),
                    r.output.as_ref().map(|o| o.to_string()),
                    r.logs,
                    r.error,
                    r.started_at.map(|t| t as i64),
                    r.completed_at.map(|t| t as i64),
                ])?;
            if changed == 0 {
                return Ok(false);
            }
            conn.prepare_cached("DELETE FROM queue WHERE prediction = ?1")?.execute([&r.id])?;
            for d in &deliveries {
                insert_delivery(conn, d)?;
            }
            Ok(true)
        })
    }

    fn due_deliveries(&self, now: Millis, limit: usize) -> Result<Vec<Delivery>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(
            "SELECT d.id, d.prediction, d.event, d.url, d.body, d.attempts, d.next_at, COALESCE(p.account, '') \
             FROM deliveries d LEFT JOIN predictions p ON p.id = d.prediction \
             WHERE d.next_at IS NOT NULL AND d.next_at <= ?1 ORDER BY d.next_at LIMIT ?2",
        )?;
        let rows = stmt.query_map(params![now as i64, limit as i64], |r| {
            let event: String = r.get(2)?;
            Ok(Delivery {
                id: r.get(0)?,
                prediction: r.get(1)?,
                event: Event::parse(&event).unwrap_or(Event::Completed),
                url: r.get(3)?,
                body: r.get(4)?,
                attempts: r.get(5)?,
                next_at: r.get::<_, i64>(6)? as Millis,
                account: r.get(7)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    fn next_delivery_at(&self) -> Result<Option<Millis>, StoreError> {
        let conn = self.conn();
        let at: Option<i64> = conn
            .prepare_cached("SELECT MIN(next_at) FROM deliveries WHERE next_at IS NOT NULL")?
            .query_row([], |r| r.get(0))?;
        Ok(at.map(|t| t as Millis))
    }

    fn delivery_attempted(
        &self,
        id: &str,
        delivered: bool,
        next_at: Option<Millis>,
    ) -> Result<(), StoreError> {
        let id = id.to_owned();
        self.write(move |conn| {
            conn.prepare_cached(
                "UPDATE deliveries SET attempts = attempts + ?2, delivered = ?3, next_at = ?4 WHERE id = ?1",
            )?
            .execute(params![
                id,
                i64::from(!delivered),
                delivered,
                next_at.map(|t| t as i64)
            ])?;
            Ok(())
        })
    }

    fn expired_waiting(&self, now: Millis, limit: usize) -> Result<Vec<Record>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT {COLUMNS} FROM predictions WHERE id IN \
             (SELECT prediction FROM queue WHERE owner IS NULL AND expires_at <= ?1 ORDER BY expires_at LIMIT ?2)"
        ))?;
        let rows = collect(stmt.query_map(params![now as i64, limit as i64], read_row)?)?;
        Ok(rows.into_iter().filter(|r| r.status == Status::Starting).collect())
    }

    fn sweep_expired_claims(&self, now: Millis) -> Result<Vec<Record>, StoreError> {
        self.write(move |conn| {
            conn.prepare_cached(
                "UPDATE queue SET owner = NULL, lease_until = NULL WHERE owner IS NOT NULL AND lease_until <= ?1 \
                 AND prediction IN (SELECT id FROM predictions WHERE status = 'starting')",
            )?
            .execute([now as i64])?;
            rejoin_turns(conn)?;
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {COLUMNS} FROM predictions WHERE id IN \
                 (SELECT prediction FROM queue WHERE owner IS NOT NULL AND lease_until <= ?1)"
            ))?;
            let rows = collect(stmt.query_map([now as i64], read_row)?);
            rows
        })
    }

    fn requeue(&self, id: &str) -> Result<bool, StoreError> {
        let id = id.to_owned();
        self.write(move |conn| {
            let changed = conn
                .prepare_cached(
                    "UPDATE predictions SET status = 'starting', started_at = NULL, output = NULL, logs = '' \
                     WHERE id = ?1 AND status = 'processing'",
                )?
                .execute([&id])?;
            if changed == 1 {
                conn.prepare_cached(
                    "UPDATE queue SET owner = NULL, lease_until = NULL WHERE prediction = ?1",
                )?
                .execute([&id])?;
                rejoin_turns(conn)?;
            }
            Ok(changed == 1)
        })
    }

    fn prune_queue(&self, before: Millis, now: Millis) -> Result<Vec<String>, StoreError> {
        self.write(move |conn| {
            let ids: Vec<String> = conn
                .prepare_cached("SELECT prediction FROM queue WHERE enqueued_at < ?1")?
                .query_map([before as i64], |r| r.get(0))?
                .collect::<Result<_, _>>()?;
            for id in &ids {
                conn.prepare_cached(
                    "UPDATE predictions SET status = 'failed', completed_at = ?2, \
                     error = 'the prediction stayed in the queue for more than 24 hours and was pruned' \
                     WHERE id = ?1 AND status IN ('starting', 'processing')",
                )?
                .execute(params![id, now as i64])?;
                conn.prepare_cached("DELETE FROM queue WHERE prediction = ?1")?.execute([id])?;
            }
            Ok(ids)
        })
    }

    fn remove_data(&self, before: Millis) -> Result<usize, StoreError> {
        self.write(move |conn| {
            Ok(conn
                .prepare_cached(
                    "UPDATE predictions SET input = NULL, output = NULL, logs = '', data_removed = 1 \
                     WHERE data_removed = 0 AND completed_at IS NOT NULL AND completed_at < ?1",
                )?
                .execute([before as i64])?)
        })
    }

    fn webhook_secrets(
        &self,
        account: &str,
        now: Millis,
        create: &dyn Fn() -> String,
    ) -> Result<Vec<String>, StoreError> {
        let valid = valid_secrets(&self.conn(), account, now)?;
        if valid.iter().any(|(_, current)| *current) {
            return Ok(valid.into_iter().map(|(s, _)| s).collect());
        }
        let (account, fresh) = (account.to_owned(), create());
        let valid = self.write(move |conn| {
            // Another caller may have created it since the read: the
            // partial unique index keeps one current secret either way.
            if !has_secret(conn, &account, true)? {
                adopt_shared_secret(conn, &account, now)?;
                conn.prepare_cached(
                    "INSERT OR IGNORE INTO webhook_secrets (account, secret, created_at) VALUES (?1, ?2, ?3)",
                )?
                .execute(params![account, fresh, now as i64])?;
            }
            valid_secrets(conn, &account, now)
        })?;
        Ok(valid.into_iter().map(|(s, _)| s).collect())
    }

    fn rotate_webhook_secret(
        &self,
        account: &str,
        now: Millis,
        grace_ms: Millis,
        create: &dyn Fn() -> String,
    ) -> Result<Rotation, StoreError> {
        let (account, fresh) = (account.to_owned(), create());
        let until = now.saturating_add(grace_ms);
        self.write(move |conn| {
            adopt_shared_secret(conn, &account, now)?;
            conn.prepare_cached(
                "DELETE FROM webhook_secrets WHERE account = ?1 AND expires_at IS NOT NULL AND expires_at <= ?2",
            )?
            .execute(params![account, now as i64])?;
            let retired = conn
                .prepare_cached(
                    "UPDATE webhook_secrets SET expires_at = ?2 WHERE account = ?1 AND expires_at IS NULL",
                )?
                .execute(params![account, until as i64])?;
            conn.prepare_cached("INSERT INTO webhook_secrets (account, secret, created_at) VALUES (?1, ?2, ?3)")?
                .execute(params![account, fresh, now as i64])?;
            Ok(Rotation { key: fresh, previous_valid_until: (retired > 0).then_some(until) })
        })
    }

    fn put_deployment(
        &self,
        deployment: &DeploymentRecord,
        expected: Option<u32>,
    ) -> Result<bool, StoreError> {
        let body = serde_json::to_string(deployment).expect("a deployment serializes");
        let (name, release) = (deployment.name.clone(), deployment.release);
        self.write(move |conn| {
            let stored: Option<(u32, String)> = conn
                .prepare_cached("SELECT release, body FROM deployments WHERE name = ?1")?
                .query_row([&name], |r| Ok((r.get(0)?, r.get(1)?)))
                .optional()?;
            match (stored, expected) {
                (Some((_, stored)), _) if stored == body => Ok(true),
                (None, None) => {
                    conn.prepare_cached("INSERT INTO deployments (name, release, body) VALUES (?1, ?2, ?3)")?
                        .execute(params![name, release, body])?;
                    Ok(true)
                }
                (Some((at, _)), Some(expected)) if at == expected => {
                    conn.prepare_cached("UPDATE deployments SET release = ?2, body = ?3 WHERE name = ?1")?
                        .execute(params![name, release, body])?;
                    Ok(true)
                }
                _ => Ok(false),
            }
        })
    }

    fn delete_deployment(&self, name: &str) -> Result<bool, StoreError> {
        let name = name.to_owned();
        self.write(move |conn| {
            Ok(conn.prepare_cached("DELETE FROM deployments WHERE name = ?1")?.execute([name])? > 0)
        })
    }

    fn deployments(&self) -> Result<Vec<DeploymentRecord>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached("SELECT name, body FROM deployments ORDER BY name")?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?;
        rows.map(|row| {
            let (name, body) = row?;
            serde_json::from_str(&body).map_err(|e| StoreError::Corrupt { id: name, what: e.to_string() })
        })
        .collect()
    }

    fn create_procedure(&self, procedure: &Procedure) -> Result<bool, StoreError> {
        let body = serde_json::to_string(procedure).expect("a procedure serializes");
        let key = procedure.key();
        self.write(move |conn| {
            let stored: Option<String> = conn
                .prepare_cached("SELECT body FROM procedures WHERE key = ?1")?
                .query_row([&key], |r| r.get(0))
                .optional()?;
            match stored {
                Some(stored) => Ok(stored == body),
                None => {
                    conn.prepare_cached("INSERT INTO procedures (key, body) VALUES (?1, ?2)")?
                        .execute(params![key, body])?;
                    Ok(true)
                }
            }
        })
    }

    fn delete_procedure(&self, key: &str) -> Result<bool, StoreError> {
        let key = key.to_owned();
        self.write(move |conn| {
            Ok(conn.prepare_cached("DELETE FROM procedures WHERE key = ?1")?.execute([key])? > 0)
        })
    }

    fn procedure(&self, key: &str) -> Result<Option<Procedure>, StoreError> {
        let conn = self.conn();
        let body: Option<String> = conn
            .prepare_cached("SELECT body FROM procedures WHERE key = ?1")?
            .query_row([key], |r| r.get(0))
            .optional()?;
        body.map(|b| parse_procedure(key, &b)).transpose()
    }

    fn procedures(&self) -> Result<Vec<Procedure>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached("SELECT key, body FROM procedures ORDER BY key")?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?;
        rows.map(|row| {
            let (key, body) = row?;
            parse_procedure(&key, &body)
        })
        .collect()
    }
}

impl SqliteQueue {
    /// Gives the one shared signing secret of older versions
    /// (`meta.webhook_secret`), if the file has one, its end: `now +
    /// grace_ms`, fixed the first time this runs on the file. Until then
    /// each account's webhooks are signed with it as well as with the
    /// account's own secret. The end, if there is a shared secret.
    pub fn retire_shared_webhook_secret(
        &self,
        now: Millis,
        grace_ms: Millis,
    ) -> Result<Option<Millis>, StoreError> {
        let until = now.saturating_add(grace_ms);
        self.write(move |conn| {
            let shared: bool = conn
                .prepare_cached("SELECT EXISTS (SELECT 1 FROM meta WHERE key = 'webhook_secret')")?
                .query_row([], |r| r.get(0))?;
            if !shared {
                return Ok(None);
            }
            conn.prepare_cached(
                "INSERT OR IGNORE INTO meta (key, value) VALUES ('webhook_secret_retired_until', ?1)",
            )?
            .execute([until.to_string()])?;
            let until: String = conn
                .prepare_cached("SELECT value FROM meta WHERE key = 'webhook_secret_retired_until'")?
                .query_row([], |r| r.get(0))?;
            Ok(until.parse().ok())
        })
    }
}

/// `account`'s secrets valid at `now`, newest first, each with whether
/// it is the current one.
fn valid_secrets(conn: &Connection, account: &str, now: Millis) -> Result<Vec<(String, bool)>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT secret, expires_at IS NULL FROM webhook_secrets \
         WHERE account = ?1 AND (expires_at IS NULL OR expires_at > ?2) ORDER BY seq DESC",
    )?;
    let rows = stmt.query_map(params![account, now as i64], |r| Ok((r.get(0)?, r.get(1)?)))?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// Whether `account` has a current secret (`current`), or any secret.
fn has_secret(conn: &Connection, account: &str, current: bool) -> Result<bool, StoreError> {
    let sql = match current {
        true => "SELECT EXISTS (SELECT 1 FROM webhook_secrets WHERE account = ?1 AND expires_at IS NULL)",
        false => "SELECT EXISTS (SELECT 1 FROM webhook_secrets WHERE account = ?1)",
    };
    Ok(conn.prepare_cached(sql)?.query_row([account], |r| r.get(0))?)
}

/// The first time `account` gets a secret of its own: the shared secret
/// of older versions joins it as a rotated-out one, while its retirement
/// (see [`SqliteQueue::retire_shared_webhook_secret`]) has not come.
fn adopt_shared_secret(conn: &Connection, account: &str, now: Millis) -> Result<(), StoreError> {
    if has_secret(conn, account, false)? {
        return Ok(());
    }
    let shared: Option<(String, String)> = conn
        .prepare_cached(
            "SELECT s.value, u.value FROM meta s JOIN meta u \
             ON s.key = 'webhook_secret' AND u.key = 'webhook_secret_retired_until'",
        )?
        .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?;
    if let Some((secret, until)) = shared {
        let until: Millis = until.parse().unwrap_or(0);
        if until > now {
            conn.prepare_cached(
                "INSERT INTO webhook_secrets (account, secret, created_at, expires_at) VALUES (?1, ?2, ?3, ?4)",
            )?
            .execute(params![account, secret, now as i64, until as i64])?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::contract::{contract_tests, record};
    use super::*;

    contract_tests!(Some(open()));

    fn open() -> (tempfile::TempDir, SqliteQueue) {
        let dir = tempfile::tempdir().unwrap();
        let q = SqliteQueue::open(dir.path()).unwrap();
        (dir, q)
    }

    /// Another process holding the write lock past the busy timeout makes
    /// a write fail as unavailable, naming the store — and store nothing:
    /// once the lock is let go, the prediction is not there, and the same
    /// write succeeds.
    #[test]
    fn a_write_locked_out_past_the_busy_timeout_is_unavailable_and_stores_nothing() {
        let (dir, q) = open();
        let other = Connection::open(dir.path().join("predictions.sqlite3")).unwrap();
        other.execute_batch("BEGIN IMMEDIATE").unwrap();
        let e = q.enqueue(&record("p", "a/x", 0)).unwrap_err();
        match &e {
            StoreError::Unavailable { store, .. } => assert_eq!(store, "sqlite predictions.sqlite3"),
            other => panic!("not unavailable: {other}"),
        }
        other.execute_batch("ROLLBACK").unwrap();
        assert!(q.get("p").unwrap().is_none(), "nothing of the refused write was stored");
        q.enqueue(&record("p", "a/x", 0)).unwrap();
        assert!(q.get("p").unwrap().is_some());
    }

    /// One account's backlog does not hold up another's prediction: the
    /// accounts with work take turns, a newcomer at the back of the
    /// rotation, each account's own entries in order; an account whose
    /// claim is released (its lease expired) rejoins the rotation.
    #[test]
    fn accounts_take_turns_so_a_backlog_does_not_hold_up_others() {
        let (_d, q) = open();
        let of =
            |id: &str, account: &str, t: Millis| Record { account: account.into(), ..record(id, "a/x", t) };
        for i in 0..200 {
            q.enqueue(&of(&format!("a{i}"), "big", i)).unwrap();
        }
        q.enqueue(&of("b0", "small", 300)).unwrap();
        q.enqueue(&of("b1", "small", 301)).unwrap();
        q.enqueue(&of("c0", "other", 302)).unwrap();
        let queue = JobKind::Prediction.queue("a/x");
        let claimed: Vec<String> =
            (0..7).map(|_| q.claim(&queue, "w", 1_000, 100).unwrap().unwrap().id).collect();
        assert_eq!(claimed, ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]);
        // An expired claim goes back to its account's turn.
        assert_eq!(
            q.sweep_expired_claims(2_000).unwrap().len(),
            0,
            "starting records are requeued, not returned"
        );
        q.enqueue(&of("c1", "other", 2_001)).unwrap();
        let next: Vec<String> =
            (0..3).map(|_| q.claim(&queue, "w", 2_002, 100).unwrap().unwrap().id).collect();
        assert!(next.contains(&"b0".to_string()) && next.contains(&"c0".to_string()), "{next:?}");
    }

    #[test]
    fn leases_expire_and_recovery_handles_orphans() {
        let dir = tempfile::tempdir().unwrap();
        {
            let q = SqliteQueue::open(dir.path()).unwrap();
            for i in 0..3 {
                q.enqueue(&record(&format!("p{i}"), "a/x", i)).unwrap();
            }
            let queue = JobKind::Prediction.queue("a/x");
            q.claim(&queue, "w", 0, 100).unwrap();
            q.start("p0", 1, &[]).unwrap();
            q.claim(&queue, "w", 0, 100).unwrap();
            assert_eq!(q.heartbeat("w", 50, 100).unwrap(), 2);
            assert!(q.sweep_expired_claims(100).unwrap().is_empty());
            let stale = q.sweep_expired_claims(150).unwrap();
            // p1 (claimed, not started) went back; p0 is returned.
            assert_eq!(stale.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), ["p0"]);
        }
        let q = SqliteQueue::open(dir.path()).unwrap();
        let rec = q
            .recover(200, &|_| false, &|r| {
                Some(Delivery {
                    id: format!("msg_{}", r.id),
                    prediction: r.id.clone(),
                    event: Event::Completed,
                    url: "http://x".into(),
                    body: "{}".into(),
                    attempts: 0,
                    next_at: 200,
                    account: r.account.clone(),
                })
            })
            .unwrap();
        assert_eq!(rec.failed, ["p0"]);
        assert_eq!(q.get("p0").unwrap().unwrap().status, Status::Failed);
        assert_eq!(q.due_deliveries(200, 10).unwrap().len(), 1);
        let queue = JobKind::Prediction.queue("a/x");
        assert_eq!(q.claim(&queue, "w2", 300, 100).unwrap().unwrap().id, "p1");
    }

    #[test]
    fn idempotent_models_are_requeued() {
        let (_d, q) = open();
        q.enqueue(&record("p", "a/x", 0)).unwrap();
        q.claim(&JobKind::Prediction.queue("a/x"), "w", 0, 10).unwrap();
        q.start("p", 1, &[]).unwrap();
        let rec = q.recover(5, &|m| m == "a/x", &|_| None).unwrap();
        assert_eq!(rec.requeued, ["p"]);
        assert_eq!(q.get("p").unwrap().unwrap().status, Status::Starting);
        assert!(q.claim(&JobKind::Prediction.queue("a/x"), "w", 0, 10).unwrap().is_some());
    }

    #[test]
    fn each_account_has_its_own_secret_kept_across_restarts() {
        let dir = tempfile::tempdir().unwrap();
        {
            let q = SqliteQueue::open(dir.path()).unwrap();
            assert_eq!(q.webhook_secrets("a", 0, &|| "whsec_a".into()).unwrap(), ["whsec_a"]);
            assert_eq!(q.webhook_secrets("b", 0, &|| "whsec_b".into()).unwrap(), ["whsec_b"]);
            assert_eq!(q.webhook_secrets("a", 1, &|| "whsec_other".into()).unwrap(), ["whsec_a"]);
        }
        let q = SqliteQueue::open(dir.path()).unwrap();
        assert_eq!(q.webhook_secrets("a", 2, &|| "whsec_other".into()).unwrap(), ["whsec_a"]);
        assert_eq!(q.webhook_secrets("b", 2, &|| "whsec_other".into()).unwrap(), ["whsec_b"]);
    }

    /// The schema of the version before per-account secrets.
    const V1_SCHEMA: &str = "
CREATE TABLE predictions (
    seq INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE, kind TEXT NOT NULL, model TEXT NOT NULL,
    version TEXT NOT NULL, deployment TEXT, account TEXT NOT NULL, input TEXT, output TEXT,
    logs TEXT NOT NULL DEFAULT '', error TEXT, status TEXT NOT NULL, created_at INTEGER NOT NULL,
    started_at INTEGER, completed_at INTEGER, deadline INTEGER, lifetime_deadline INTEGER,
    webhook TEXT, webhook_events INTEGER NOT NULL, stream INTEGER NOT NULL, destination TEXT,
    data_removed INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX predictions_account ON predictions(account, seq);
CREATE INDEX predictions_ended ON predictions(completed_at) WHERE data_removed = 0;
CREATE TABLE queue (
    seq INTEGER PRIMARY KEY, queue TEXT NOT NULL, prediction TEXT NOT NULL UNIQUE,
    enqueued_at INTEGER NOT NULL, expires_at INTEGER, owner TEXT, lease_until INTEGER
);
CREATE INDEX queue_free ON queue(queue, seq) WHERE owner IS NULL;
CREATE INDEX queue_expiry ON queue(expires_at) WHERE owner IS NULL;
CREATE INDEX queue_owner ON queue(owner);
CREATE TABLE deliveries (
    id TEXT PRIMARY KEY, prediction TEXT NOT NULL, event TEXT NOT NULL, url TEXT NOT NULL,
    body TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, next_at INTEGER,
    delivered INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX deliveries_due ON deliveries(next_at) WHERE next_at IS NOT NULL;
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO predictions (id, kind, model, version, account, input, status, created_at, webhook,
    webhook_events, stream) VALUES ('p_old', 'prediction', 'a/x', 'v', 'acme', '{}', 'starting', 5,
    'http://x', 15, 0);
INSERT INTO queue (queue, prediction, enqueued_at) VALUES ('input:prediction:a/x', 'p_old', 5);
INSERT INTO deliveries (id, prediction, event, url, body, next_at) VALUES ('msg_old', 'p_old', 'start', 'http://x', '{}', 7);
INSERT INTO meta (key, value) VALUES ('webhook_secret', 'whsec_shared');
";

    #[test]
    fn a_file_of_the_previous_version_opens_and_retires_its_shared_secret() {
        let dir = tempfile::tempdir().unwrap();
        Connection::open(dir.path().join("predictions.sqlite3")).unwrap().execute_batch(V1_SCHEMA).unwrap();
        let q = SqliteQueue::open(dir.path()).unwrap();
        assert_eq!(q.get("p_old").unwrap().unwrap().account, "acme");
        assert_eq!(q.due_deliveries(10, 10).unwrap()[0].account, "acme");
        assert_eq!(q.claim(&JobKind::Prediction.queue("a/x"), "w", 10, 100).unwrap().unwrap().id, "p_old");
        // The shared secret ends 1000 ms after the first start, and keeps
        // that end across restarts.
        assert_eq!(q.retire_shared_webhook_secret(100, 1000).unwrap(), Some(1100));
        assert_eq!(q.retire_shared_webhook_secret(500, 1000).unwrap(), Some(1100));
        let signing = q.webhook_secrets("acme", 200, &|| "whsec_acme".into()).unwrap();
        assert_eq!(signing, ["whsec_acme", "whsec_shared"]);
        assert_eq!(q.webhook_secrets("acme", 1100, &|| unreachable!()).unwrap(), ["whsec_acme"]);
        // An account first seen after the end never gets it.
        assert_eq!(q.webhook_secrets("late", 1200, &|| "whsec_late".into()).unwrap(), ["whsec_late"]);
        // A file without a shared secret has nothing to retire.
        let (_d, fresh) = open();
        assert_eq!(fresh.retire_shared_webhook_secret(0, 1000).unwrap(), None);
    }
}
