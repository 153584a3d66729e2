//! `hangar bench queue`: the durable predictions queue on its own, the
//! embedded SQLite store and the fleet's Redis Streams store side by side
//! in one run (Redis: a private `redis-server` started for the bench, or
//! `--redis URL` of a scratch server). With `--durable`, also on a private
//! Redis Cluster with a replica per primary, without and with
//! `durable_replicas = 1` (each create acknowledged only once a replica
//! holds it: `WAIT 1 1000` in the create's pipeline).
//!
//! Three figures per backend, in-process, on a fresh store:
//! 1. **Create → claim per second**: producers create predictions (each
//!    create committed before it returns, up to 256 in flight) while
//!    `slots` workers claim them; the rate is the predictions over the time
//!    from the first create to the last claim.
//! 2. **Fairness**: one account holds a backlog of `backlog` predictions;
//!    then each of `probes` other accounts creates one, and a worker
//!    claims until it gets it. The claims that went to the backlog first
//!    are what it waited; with `slots` workers each claim frees one slot,
//!    so it starts within `ceil((claims before + 1) / slots)` slot waits.
//!    Target: one.
//! 3. **Create latency**: [`LATENCY_CREATES`] creates one after another,
//!    each committed before the next is sent: p50 and p99. What a client
//!    waits for its `201`, less the HTTP around it — and with
//!    `durable_replicas` the replica's acknowledgement too.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use hangar_predictions::lifecycle::Deadlines;
use hangar_predictions::record::{JobKind, Record};
use hangar_predictions::store::{PredictionQueue, RedisQueue, Shards, SqliteQueue};
use hangar_redis::{LocalRedis, LocalRedisCluster, Redis, ServerError};
use serde::Serialize;

use crate::BenchError;

/// The models of the two figures (separate queues, so one Redis holds
/// both).
const THROUGHPUT_MODEL: &str = "bench/throughput";
const FAIRNESS_MODEL: &str = "bench/fairness";
const LATENCY_MODEL: &str = "bench/latency";

/// Creates of figure 3.
pub const LATENCY_CREATES: usize = 2_000;

/// How to run it.
#[derive(Debug, Clone)]
pub struct Options {
    /// Predictions created and claimed in figure 1.
    pub requests: usize,
    /// Workers claiming (replica slots).
    pub slots: usize,
    /// The first account's backlog in figure 2.
    pub backlog: usize,
    /// Other accounts' predictions in figure 2.
    pub probes: usize,
    /// A scratch Redis to use instead of starting one (it must hold no
    /// Hangar keys).
    pub redis: Option<String>,
    /// Also on a private Redis Cluster with replicas, without and with
    /// `durable_replicas = 1`.
    pub durable: bool,
}

/// The figures.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The queue's backend.
    pub backend: String,
    /// Predictions in figure 1.
    pub requests: usize,
    /// Claiming workers.
    pub slots: usize,
    /// Creates per second while claims ran.
    pub creates_per_s: f64,
    /// Predictions created and claimed per second, first create to last claim.
    pub create_claim_per_s: f64,
    /// The first account's backlog in figure 2.
    pub backlog: usize,
    /// Other accounts' predictions in figure 2.
    pub probes: usize,
    /// Claims that went to the backlog before the second account's
    /// prediction: p50, p99, max.
    pub claims_before: [usize; 3],
    /// Slot waits before it started: p50, p99, max.
    pub slot_waits: [usize; 3],
    /// One create at a time, committed before the next: p50 and p99, ms.
    pub create_ms: [f64; 2],
}

/// Both backends' figures, SQLite first; Redis's when a server could be
/// had (`redis` says why not otherwise).
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    /// One report per backend measured.
    pub reports: Vec<Report>,
    /// Why Redis was not measured, if it was not.
    pub redis_skipped: Option<String>,
    /// With `--durable`: the cluster without, then with
    /// `durable_replicas = 1`.
    pub durable: Vec<Report>,
    /// Why the durable rows were not measured, if `--durable` asked: no
    /// `redis-server` (any other failure fails the bench).
    pub durable_skipped: Option<String>,
}

/// Runs both figures on each backend.
///
/// # Cancel safety
/// Dropping the future leaves blocking claim threads to finish their
/// current claim; the stores are removed with their directories (a
/// private Redis is killed).
pub async fn run(options: &Options) -> Result<Comparison, BenchError> {
    if options.requests == 0 || options.slots == 0 || options.backlog == 0 || options.probes == 0 {
        return Err(BenchError::Options(
            "--requests, --slots, --backlog and --probes must be positive".into(),
        ));
    }
    let (_dir, sqlite) = sqlite()?;
    let mut reports = vec![measure("sqlite".into(), sqlite, options).await?];
    let mut redis_skipped = None;
    match &options.redis {
        Some(url) => {
            let queue = scratch_redis(url)?;
            reports.push(measure(format!("redis streams at {url}"), queue, options).await?);
        }
        None => match LocalRedis::start() {
            Ok(server) => {
                let queue = scratch_redis(&server.url())?;
                reports.push(
                    measure("redis streams (private redis-server, AOF everysec)".into(), queue, options)
                        .await?,
                );
            }
            Err(e @ ServerError::NotInstalled) => redis_skipped = Some(format!("{e}; or pass --redis URL")),
            Err(e) => return Err(BenchError::Options(e.to_string())),
        },
    }
    let (mut durable_rows, mut durable_skipped) = (Vec::new(), None);
    if options.durable {
        let started = tokio::task::spawn_blocking(LocalRedisCluster::start_with_replicas);
        match started.await.expect("starting a cluster does not panic") {
            Ok(mut cluster) => durable_rows = durable(&mut cluster, options).await?,
            Err(e @ ServerError::NotInstalled) => durable_skipped = Some(e.to_string()),
            Err(e) => return Err(BenchError::Options(e.to_string())),
        }
    }
    Ok(Comparison { reports, redis_skipped, durable: durable_rows, durable_skipped })
}

/// The durable rows on `cluster` (a Redis Cluster with a replica per
/// primary): measured with `durable_replicas` 0 and then 1, the slot's
/// primary flushed between the two (every Hangar key is in one slot).
async fn durable(cluster: &mut LocalRedisCluster, options: &Options) -> Result<Vec<Report>, BenchError> {
    let mut rows = Vec::with_capacity(2);
    for replicas in [0, 1] {
        let redis = Redis::connect(&cluster.url()).map_err(store_error)?;
        let primary = cluster.primary_for(&redis.key("seq")).map_err(store_error)?;
        let node = Redis::connect(&cluster.nodes()[primary].url()).map_err(store_error)?;
        node.run(|c| hangar_redis::redis::cmd("FLUSHALL").query::<()>(c)).map_err(store_error)?;
        let queue =
            RedisQueue::open(redis, Shards::default(), 60_000).map_err(store_error)?.durable(replicas);
        let backend = format!("redis cluster (3 primaries, a replica each), durable_replicas = {replicas}");
        rows.push(measure(backend, Arc::new(queue), options).await?);
    }
    Ok(rows)
}

async fn measure(
    backend: String,
    queue: Arc<dyn PredictionQueue>,
    options: &Options,
) -> Result<Report, BenchError> {
    let (creates_per_s, create_claim_per_s) = throughput(&queue, options).await?;
    let (claims_before, slot_waits) = fairness(&queue, options).await?;
    let create_ms = create_latency(&queue).await?;
    Ok(Report {
        backend,
        requests: options.requests,
        slots: options.slots,
        creates_per_s,
        create_claim_per_s,
        backlog: options.backlog,
        probes: options.probes,
        claims_before,
        slot_waits,
        create_ms,
    })
}

fn store_error(e: impl fmt::Display) -> BenchError {
    BenchError::Options(format!("the predictions store failed: {e}"))
}

fn sqlite() -> Result<(tempfile::TempDir, Arc<dyn PredictionQueue>), BenchError> {
    let dir = tempfile::tempdir()?;
    let queue = SqliteQueue::open(dir.path()).map_err(store_error)?;
    Ok((dir, Arc::new(queue)))
}

/// The Redis store on `url`, refused if the server holds Hangar data
/// (the bench's predictions would mix with it).
fn scratch_redis(url: &str) -> Result<Arc<dyn PredictionQueue>, BenchError> {
    let redis = Redis::connect(url).map_err(store_error)?;
    let used: bool = redis
        .run(|c| hangar_redis::redis::cmd("EXISTS").arg(redis.key("seq")).query(c))
        .map_err(store_error)?;
    if used {
        return Err(BenchError::Options(format!(
            "the redis at {url} holds Hangar data; give the bench a scratch server"
        )));
    }
    Ok(Arc::new(RedisQueue::open(redis, Shards::default(), 60_000).map_err(store_error)?))
}

fn record(id: String, model: &str, account: &str) -> Record {
    let deadlines = Deadlines { per_prediction: None, lifetime: None };
    Record::starting(id, model, "v", account, serde_json::json!({"n": 1}), 0, deadlines)
}

/// Figure 1: (creates per second, create → claim per second).
async fn throughput(queue: &Arc<dyn PredictionQueue>, options: &Options) -> Result<(f64, f64), BenchError> {
    let claimed = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let workers: Vec<_> = (0..options.slots)
        .map(|w| {
            let (queue, claimed, total) = (queue.clone(), claimed.clone(), options.requests);
            tokio::task::spawn_blocking(move || -> Result<(), BenchError> {
                let queue_name = JobKind::Prediction.queue(THROUGHPUT_MODEL);
                let owner = format!("w{w}");
                while claimed.load(Ordering::Relaxed) < total {
                    match queue.claim(&queue_name, &owner, 0, 60_000).map_err(store_error)? {
                        Some(_) => {
                            claimed.fetch_add(1, Ordering::Relaxed);
                        }
                        None => std::thread::yield_now(),
                    }
                }
                Ok(())
            })
        })
        .collect();
    let queue = queue.clone();
    let mut in_flight: tokio::task::JoinSet<Result<(), hangar_predictions::store::StoreError>> =
        tokio::task::JoinSet::new();
    for n in 0..options.requests {
        if in_flight.len() >= 256 {
            in_flight.join_next().await.expect("not empty").expect("no panic").map_err(store_error)?;
        }
        let queue = queue.clone();
        in_flight.spawn(async move {
            queue.enqueue_async(&record(format!("t{n}"), THROUGHPUT_MODEL, "a")).await.map(drop)
        });
    }
    while let Some(done) = in_flight.join_next().await {
        done.expect("no panic").map_err(store_error)?;
    }
    let created = start.elapsed().as_secs_f64();
    for w in workers {
        w.await.expect("no panic")?;
    }
    let all = start.elapsed().as_secs_f64();
    Ok((options.requests as f64 / created, options.requests as f64 / all))
}

/// Figure 2: claims before, and slot waits, each as p50, p99, max.
async fn fairness(
    queue: &Arc<dyn PredictionQueue>,
    options: &Options,
) -> Result<([usize; 3], [usize; 3]), BenchError> {
    let mut creates: tokio::task::JoinSet<Result<(), hangar_predictions::store::StoreError>> =
        tokio::task::JoinSet::new();
    for n in 0..options.backlog {
        let queue = queue.clone();
        creates.spawn(async move {
            queue.enqueue_async(&record(format!("b{n}"), FAIRNESS_MODEL, "big")).await.map(drop)
        });
        if creates.len() >= 256 {
            creates.join_next().await.expect("not empty").expect("no panic").map_err(store_error)?;
        }
    }
    while let Some(done) = creates.join_next().await {
        done.expect("no panic").map_err(store_error)?;
    }
    let queue_name = JobKind::Prediction.queue(FAIRNESS_MODEL);
    let mut before = Vec::with_capacity(options.probes);
    for probe in 0..options.probes {
        let id = format!("s{probe}");
        let account = format!("small{probe}");
        queue.enqueue_async(&record(id.clone(), FAIRNESS_MODEL, &account)).await.map_err(store_error)?;
        let mut claims: usize = 0;
        loop {
            let got = queue.claim(&queue_name, "w", 0, 60_000).map_err(store_error)?;
            match got {
                Some(r) if r.id == id => break,
                Some(_) => claims += 1,
                None => return Err(BenchError::Options(format!("{id} was never claimed"))),
            }
        }
        before.push(claims);
    }
    before.sort_unstable();
    let pick = |v: &[usize], q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    let waits: Vec<usize> = before.iter().map(|&c: &usize| (c + 1).div_ceil(options.slots)).collect();
    Ok((
        [pick(&before, 0.5), pick(&before, 0.99), *before.last().expect("probes > 0")],
        [pick(&waits, 0.5), pick(&waits, 0.99), *waits.last().expect("probes > 0")],
    ))
}

/// Figure 3: [`LATENCY_CREATES`] creates one at a time; p50 and p99, ms.
async fn create_latency(queue: &Arc<dyn PredictionQueue>) -> Result<[f64; 2], BenchError> {
    let mut took = Vec::with_capacity(LATENCY_CREATES);
    for n in 0..LATENCY_CREATES {
        let sent = Instant::now();
        queue.enqueue_async(&record(format!("l{n}"), LATENCY_MODEL, "a")).await.map_err(store_error)?;
        took.push(sent.elapsed().as_secs_f64() * 1000.0);
    }
    took.sort_by(f64::total_cmp);
    let pick = |q: f64| took[((took.len() - 1) as f64 * q).round() as usize];
    Ok([pick(0.5), pick(0.99)])
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.backend)?;
        writeln!(
            f,
            "  create -> claim   {} predictions: {:.0} creates/s, {:.0} created and claimed/s",
            self.requests, self.creates_per_s, self.create_claim_per_s
        )?;
        let [c50, c99, cmax] = self.claims_before;
        let [w50, w99, wmax] = self.slot_waits;
        writeln!(
            f,
            "  fairness          {} other accounts' predictions behind a {}-prediction backlog: \
             claims before p50 {c50}, p99 {c99}, max {cmax}; slot waits p50 {w50}, p99 {w99}, max {wmax} \
             (target p99 <= 1: {})",
            self.probes,
            self.backlog,
            if w99 <= 1 { "meets" } else { "MISSES" }
        )?;
        let [c50, c99] = self.create_ms;
        writeln!(
            f,
            "  create latency    {LATENCY_CREATES} creates one at a time: p50 {c50:.3} ms, p99 {c99:.3} ms"
        )
    }
}

impl fmt::Display for Comparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let slots = self.reports.first().map_or(0, |r| r.slots);
        writeln!(f, "hangar bench queue: the durable predictions queue, {slots} claiming workers")?;
        for r in &self.reports {
            write!(f, "{r}")?;
        }
        if let [sqlite, redis] = &self.reports[..] {
            writeln!(
                f,
                "redis / sqlite: create -> claim {:.2}x (target: redis >= 5000/s: {})",
                redis.create_claim_per_s / sqlite.create_claim_per_s,
                if redis.create_claim_per_s >= 5000.0 { "meets" } else { "MISSES" }
            )?;
        }
        if let Some(why) = &self.redis_skipped {
            writeln!(f, "redis streams: not measured: {why}")?;
        }
        for r in &self.durable {
            write!(f, "{r}")?;
        }
        if let [fast, durable] = &self.durable[..] {
            writeln!(
                f,
                "durable_replicas = 1 adds to a create: p50 {:+.3} ms, p99 {:+.3} ms; creates/s {:.2}x",
                durable.create_ms[0] - fast.create_ms[0],
                durable.create_ms[1] - fast.create_ms[1],
                durable.creates_per_s / fast.creates_per_s
            )?;
        }
        if let Some(why) = &self.durable_skipped {
            writeln!(f, "durable_replicas: not measured: {why}")?;
        }
        Ok(())
    }
}
