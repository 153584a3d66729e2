//! What a run found: its records turned into figures, each beside its
//! target, and the list of everything that broke a rule.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use serde::Serialize;

use super::judge::{Mismatch, Violation};
use super::redis::Topology;
use super::schedule::{Kind, Schedule, REDIS_QUIET_MS};
use super::traffic::{CreateOutcome, CreateRecord, Hooks, SyncOutcome, SyncRecord};

/// The longest the fleet may take to be whole after the last fault, ms.
pub const WHOLE_TARGET_MS: u64 = 15_000;

/// One fault as it was carried out.
#[derive(Debug, Clone, Serialize)]
pub struct Injected {
    /// Its step in the schedule.
    pub step: usize,
    /// Its kind.
    pub kind: Kind,
    /// Injected, ms into the run.
    pub start_ms: u64,
    /// Over (what it took down back), ms into the run.
    pub end_ms: u64,
    /// The gateway it killed, if it killed one.
    pub gateway: Option<usize>,
    /// What it hit, resolved when injected (the leader, the engine).
    pub note: String,
    /// Not injected (no leader, no engine to kill), and why.
    pub skipped: Option<String>,
    /// A hung engine ([`Kind::EngineHang`]) its agent had not killed
    /// within the checker's allowance (the run then kills it).
    pub hung_left: bool,
}

/// A Redis fault's replicas compared before and after.
#[derive(Debug, Clone, Serialize)]
pub struct RedisCheck {
    /// Its step in the schedule.
    pub step: usize,
    /// Down or paused.
    pub kind: Kind,
    /// Engines running before it (with a process id).
    pub engines_before: usize,
    /// Those whose engine was restarted or replaced, with how.
    pub restarted: Vec<String>,
    /// Another gateway led after it than before (the lease did not
    /// survive the blip), from which to which.
    pub leader_moved: Option<String>,
}

/// What a prediction came to.
#[derive(Debug, Clone, Serialize)]
pub struct FinalState {
    /// Its status as the API said at the end (when asked).
    pub status: Option<String>,
    /// Its error.
    pub error: Option<String>,
}

/// Everything the run recorded.
#[derive(Debug)]
pub struct Records {
    /// The schedule.
    pub schedule: Schedule,
    /// The faults as carried out.
    pub injected: Vec<Injected>,
    /// The sync requests.
    pub syncs: Vec<SyncRecord>,
    /// The creates.
    pub creates: Vec<CreateRecord>,
    /// The webhooks, by prediction.
    pub hooks: HashMap<String, Hooks>,
    /// Predictions without a terminal webhook at the end, as the API
    /// showed them.
    pub finals: HashMap<String, FinalState>,
    /// What the checker found.
    pub violations: Vec<Violation>,
    /// Samples taken, and those with two leaders.
    pub samples: u64,
    /// Samples in which more than one gateway said it leads.
    pub split_leaders: u64,
    /// Each sample's time and whether every model was whole.
    pub whole: Vec<(u64, bool)>,
    /// The calm time each difference from placement took to go, of those
    /// that went within the allowance, ms.
    pub converged: Vec<u64>,
    /// The Redis faults' checks.
    pub redis: Vec<RedisCheck>,
    /// Engine processes still alive after their agents were killed at the
    /// end.
    pub leftover: Vec<u32>,
    /// Agent starts refused because the name was still held.
    pub refused_starts: u32,
    /// Length of the run, ms.
    pub run_ms: u64,
    /// The Redis the fleet ran on.
    pub topology: Topology,
}

/// One figure beside its target.
#[derive(Debug, Clone, Serialize)]
pub struct Figure {
    /// What it measures.
    pub name: String,
    /// Its value, as printed.
    pub value: String,
    /// The target, if it has one.
    pub target: Option<String>,
    /// Whether the target is met (`None`: no target).
    pub met: Option<bool>,
}

/// The figures of a run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The Redis the fleet ran on.
    pub topology: Topology,
    /// The schedule.
    pub schedule: Schedule,
    /// Faults injected, by kind.
    pub faults: BTreeMap<String, u32>,
    /// Faults of the schedule not injected, and why.
    pub skipped: Vec<String>,
    /// Sync requests.
    pub sync: SyncFigures,
    /// Predictions.
    pub predictions: PredictionFigures,
    /// The checker's figures.
    pub fleet: FleetFigures,
    /// The Redis faults' figures.
    pub redis: RedisFigures,
    /// Every model whole after the last fault, ms (`None`: not within the
    /// wait).
    pub whole_after_last_ms: Option<u64>,
    /// Every model whole after each fault (those not cut short by the
    /// next): p50 and max, ms; and how many never were before the next.
    pub whole_after_each_ms: (Option<u64>, Option<u64>, usize),
    /// The figures beside their targets.
    pub figures: Vec<Figure>,
    /// Everything that broke a rule, in words.
    pub failures: Vec<String>,
    /// The checker's violations.
    pub violations: Vec<Violation>,
    /// Where the processes' logs were kept (a failed run's).
    pub logs: Option<String>,
    /// Length of the run, s.
    pub run_s: f64,
}

/// Sync requests' figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SyncFigures {
    /// Sent.
    pub sent: usize,
    /// Refused at connect (their gateway was down): never accepted.
    pub refused: usize,
    /// Accepted (sent on a connection).
    pub accepted: usize,
    /// Answered 200.
    pub ok: usize,
    /// Answered otherwise, by status.
    pub errors: BTreeMap<u16, usize>,
    /// An example body per error status.
    pub error_examples: BTreeMap<u16, String>,
    /// When the requests of each error status were sent, s into the run
    /// (the first ten to end).
    pub error_times: BTreeMap<u16, Vec<f64>>,
    /// Cut in flight by their gateway's kill.
    pub cut: usize,
    /// Accepted and never answered, with no kill of their gateway: lost.
    pub lost: usize,
    /// Of the accepted, those for a LoRA adapter (`BASE:ADAPTER`) not cut
    /// by their gateway's kill.
    pub adapter_accepted: usize,
    /// Those answered an error a request for the base model would not
    /// have had: anything but 200 and the fleet's own load shedding (429
    /// with the line full, 503 `Retry-After` while the model cannot run),
    /// which its base's requests get alike.
    pub adapter_failed: usize,
}

/// Predictions' figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PredictionFigures {
    /// Creates sent.
    pub creates: usize,
    /// Refused at connect.
    pub refused: usize,
    /// Answered with another status than 201, by status (`503+retry`:
    /// 503 with `Retry-After`).
    pub not_accepted: BTreeMap<String, usize>,
    /// Creates cut before their answer (stored or not: unknown).
    pub cut: usize,
    /// Accepted (201).
    pub accepted: usize,
    /// Accepted and terminal, by status.
    pub terminal: BTreeMap<String, usize>,
    /// Accepted and never terminal: lost.
    pub lost: usize,
    /// With no terminal webhook.
    pub no_webhook: usize,
    /// With more than one terminal webhook.
    pub webhooks_twice: usize,
    /// Run more than once (more than one `start` webhook), with a fault
    /// that docs/cluster.md says re-runs (a gateway, node or engine lost)
    /// during their life.
    pub reran_explained: usize,
    /// Run more than once with no such fault.
    pub reran_unexplained: usize,
    /// Failed with such a fault during their life.
    pub failed_explained: usize,
    /// Failed with none.
    pub failed_unexplained: usize,
    /// Failure texts, with counts.
    pub failure_texts: BTreeMap<String, usize>,
}

/// The checker's figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FleetFigures {
    /// Samples taken.
    pub samples: u64,
    /// Engines nobody placed, past the allowance (ghosts).
    pub ghost_engines: usize,
    /// Placed replicas short of their engine, past the allowance.
    pub stuck_replicas: usize,
    /// GPU over-commits by engines (episodes).
    pub over_commit: usize,
    /// Over-commits in placement's books.
    pub placement_over_commit: usize,
    /// Samples in which two gateways said they lead.
    pub split_leader_samples: u64,
    /// Differences from placement seen that went within the allowance.
    pub converged: usize,
    /// The longest of them, in calm time, ms.
    pub converged_max_ms: Option<u64>,
    /// Engine processes alive after their agents were killed at the end.
    pub leftover_engines: usize,
    /// Agent starts refused because the name was still held.
    pub refused_agent_starts: u32,
}

/// The Redis faults' figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RedisFigures {
    /// Redis faults injected.
    pub faults: usize,
    /// Engines running before them, compared after (summed over faults).
    pub engines_compared: usize,
    /// Replicas whose engine was restarted or replaced across them.
    pub replicas_restarted: usize,
    /// Accepted predictions that failed, their life overlapping one.
    pub predictions_failed: usize,
    /// Sync requests during one (or its quiet after) not answered 200.
    pub sync_failed: usize,
    /// Creates answered 500 (rather than 503 with `Retry-After`) during
    /// one.
    pub creates_500: usize,
    /// Redis faults after which another gateway led than before.
    pub lease_moved: usize,
}

/// A failure line for the sync request `r`: `what`, its model, when it
/// was sent and how it ended.
fn failed_sync(what: &str, r: &SyncRecord) -> String {
    format!("{what}: {} at t={:.1} s: {:?}", r.model, r.start_ms as f64 / 1e3, r.outcome)
}

/// How long after a fault ends what it took down may still be sent work:
/// a gateway learns that an engine died from its node's report (the
/// agent's health check runs every second, reports every 250 ms) or from
/// a request that fails there.
pub const FAULT_REACH_MS: u64 = 5_000;

/// Kinds after which docs/cluster.md lets a prediction run again (or fail,
/// for a model that is not idempotent; or after two losses). A drain is
/// not one: a leaving replica finishes what it runs before it stops.
fn disrupts_runs(kind: Kind) -> bool {
    !kind.is_redis() && !matches!(kind, Kind::StrayEngine | Kind::NodeDrain)
}

impl Records {
    /// Whether a fault of a kind `pick` takes was under way, or within
    /// [`FAULT_REACH_MS`] of its end, at some time in `from_ms..=to_ms`.
    fn overlaps(&self, from_ms: u64, to_ms: u64, pick: impl Fn(Kind) -> bool) -> bool {
        self.injected
            .iter()
            .filter(|f| f.skipped.is_none() && pick(f.kind))
            .any(|f| f.start_ms <= to_ms && f.end_ms + FAULT_REACH_MS >= from_ms)
    }

    /// The Redis faults' windows: from the fault to the end of its quiet.
    fn redis_windows(&self) -> Vec<(u64, u64)> {
        self.injected
            .iter()
            .filter(|f| f.skipped.is_none() && f.kind.is_redis())
            .map(|f| (f.start_ms, f.end_ms + REDIS_QUIET_MS))
            .collect()
    }

    /// Turns the records into the report (`logs`: where the logs are
    /// kept, if they are).
    pub fn report(self, logs: Option<String>) -> Report {
        let mut failures = Vec::new();
        let mut faults: BTreeMap<String, u32> = BTreeMap::new();
        for f in self.injected.iter().filter(|f| f.skipped.is_none()) {
            *faults.entry(f.kind.name().to_owned()).or_default() += 1;
        }
        let skipped: Vec<String> = self
            .injected
            .iter()
            .filter_map(|f| f.skipped.as_ref().map(|why| format!("#{} {}: {why}", f.step, f.kind.name())))
            .collect();
        let injected_count: u32 = faults.values().sum();
        let redis_windows = self.redis_windows();
        let in_redis = |a: u64, b: u64| redis_windows.iter().any(|(s, e)| *s <= b && *e >= a);

        // Sync requests.
        let mut sync = SyncFigures { sent: self.syncs.len(), ..SyncFigures::default() };
        let mut redis = RedisFigures {
            faults: self.injected.iter().filter(|f| f.skipped.is_none() && f.kind.is_redis()).count(),
            engines_compared: self.redis.iter().map(|c| c.engines_before).sum(),
            lease_moved: self.redis.iter().filter(|c| c.leader_moved.is_some()).count(),
            replicas_restarted: self.redis.iter().map(|c| c.restarted.len()).sum(),
            ..RedisFigures::default()
        };
        for r in &self.syncs {
            match &r.outcome {
                SyncOutcome::Refused => sync.refused += 1,
                SyncOutcome::Answered { status: 200, .. } => sync.ok += 1,
                SyncOutcome::Answered { status, body } => {
                    *sync.errors.entry(*status).or_default() += 1;
                    sync.error_examples.entry(*status).or_insert_with(|| body.clone());
                    let times = sync.error_times.entry(*status).or_default();
                    if times.len() < 10 {
                        times.push((r.start_ms / 100) as f64 / 10.0);
                    }
                }
                SyncOutcome::Cut { error } => {
                    let killed = self.injected.iter().any(|f| {
                        f.skipped.is_none()
                            && f.gateway == Some(r.gateway)
                            && f.start_ms <= r.end_ms + 200
                            && f.start_ms + 200 >= r.start_ms
                    });
                    if killed {
                        sync.cut += 1;
                    } else {
                        sync.lost += 1;
                        failures.push(format!(
                            "sync request lost: {} through gateway {} at t={:.1}–{:.1} s: {error}",
                            r.model,
                            r.gateway,
                            r.start_ms as f64 / 1e3,
                            r.end_ms as f64 / 1e3
                        ));
                    }
                }
            }
            let failed = !matches!(r.outcome, SyncOutcome::Answered { status: 200, .. });
            if let (true, SyncOutcome::Answered { status, .. }) = (r.model.contains(':'), &r.outcome) {
                sync.adapter_accepted += 1;
                if !matches!(status, 200 | 429 | 503) {
                    sync.adapter_failed += 1;
                    failures.push(failed_sync("adapter request failed", r));
                }
            }
            if failed && in_redis(r.start_ms, r.end_ms) && !self.overlaps(r.start_ms, r.end_ms, disrupts_runs)
            {
                redis.sync_failed += 1;
                failures.push(failed_sync("sync request failed during a Redis fault", r));
            }
        }
        sync.accepted = sync.sent - sync.refused;

        // Predictions.
        let mut p = PredictionFigures { creates: self.creates.len(), ..PredictionFigures::default() };
        for c in &self.creates {
            match &c.outcome {
                CreateOutcome::Refused => p.refused += 1,
                CreateOutcome::Cut { .. } => p.cut += 1,
                CreateOutcome::Answered { status, retry_after, body } => {
                    let key = if *retry_after { format!("{status}+retry-after") } else { status.to_string() };
                    *p.not_accepted.entry(key).or_default() += 1;
                    if *status >= 500 && !*retry_after && in_redis(c.start_ms, c.end_ms) {
                        redis.creates_500 += 1;
                        failures.push(format!(
                            "create answered {status} without Retry-After during a Redis fault at t={:.1} s: {body}",
                            c.start_ms as f64 / 1e3
                        ));
                    }
                }
                CreateOutcome::Accepted { id } => {
                    p.accepted += 1;
                    let hooks = self.hooks.get(id).cloned().unwrap_or_default();
                    let end_ms = hooks.terminal_ms.unwrap_or(self.run_ms);
                    let disrupted = self.overlaps(c.start_ms, end_ms, disrupts_runs);
                    let terminal: Option<(String, Option<String>)> = match hooks.terminals.values().next() {
                        Some(t) => Some(t.clone()),
                        None => self.finals.get(id).and_then(|f| {
                            f.status
                                .clone()
                                .filter(|s| !matches!(s.as_str(), "starting" | "processing"))
                                .map(|s| (s, f.error.clone()))
                        }),
                    };
                    match &terminal {
                        None => {
                            p.lost += 1;
                            let status = self.finals.get(id).and_then(|f| f.status.clone());
                            failures.push(format!(
                                "prediction {id} ({}) accepted at t={:.1} s never ended (last status {status:?})",
                                c.model,
                                c.start_ms as f64 / 1e3
                            ));
                        }
                        Some((status, error)) => {
                            *p.terminal.entry(status.clone()).or_default() += 1;
                            if status == "failed" {
                                let text = error.clone().unwrap_or_default();
                                *p.failure_texts.entry(text.clone()).or_default() += 1;
                                if disrupted {
                                    p.failed_explained += 1;
                                } else {
                                    p.failed_unexplained += 1;
                                    failures.push(format!(
                                        "prediction {id} ({}) failed with no gateway, node or engine lost during its life (t={:.1}–{:.1} s): {text}",
                                        c.model,
                                        c.start_ms as f64 / 1e3,
                                        end_ms as f64 / 1e3
                                    ));
                                }
                                if in_redis(c.start_ms, end_ms) && !disrupted {
                                    redis.predictions_failed += 1;
                                }
                            }
                        }
                    }
                    match hooks.terminals.len() {
                        0 => {
                            p.no_webhook += 1;
                            if terminal.is_some() {
                                failures.push(format!("prediction {id} ended with no terminal webhook"));
                            }
                        }
                        1 => {}
                        n => {
                            p.webhooks_twice += 1;
                            failures.push(format!(
                                "prediction {id}: {n} terminal webhooks: {:?}",
                                hooks.terminals
                            ));
                        }
                    }
                    if hooks.starts.len() > 1 {
                        if disrupted {
                            p.reran_explained += 1;
                        } else {
                            p.reran_unexplained += 1;
                            failures.push(format!(
                                "prediction {id} ({}) ran {} times with no gateway, node or engine lost during its life (t={:.1}–{:.1} s)",
                                c.model,
                                hooks.starts.len(),
                                c.start_ms as f64 / 1e3,
                                end_ms as f64 / 1e3
                            ));
                        }
                    }
                }
            }
        }

        // The checker.
        let mut fleet = FleetFigures {
            samples: self.samples,
            split_leader_samples: self.split_leaders,
            leftover_engines: self.leftover.len(),
            refused_agent_starts: self.refused_starts,
            converged: self.converged.len(),
            converged_max_ms: self.converged.iter().max().copied(),
            ..FleetFigures::default()
        };
        for v in &self.violations {
            match v {
                Violation::OverCommit { placement: false, .. } => fleet.over_commit += 1,
                Violation::OverCommit { placement: true, .. } => fleet.placement_over_commit += 1,
                Violation::Diverged { mismatch, .. } if mismatch.is_ghost() => fleet.ghost_engines += 1,
                Violation::Diverged { .. } => fleet.stuck_replicas += 1,
            }
            failures.push(v.to_string());
        }
        for pid in &self.leftover {
            failures.push(format!("engine process {pid} was still alive after its agent was killed"));
        }
        for c in &self.redis {
            for r in &c.restarted {
                failures.push(format!(
                    "Redis fault #{} ({}) restarted a replica: {r}",
                    c.step,
                    c.kind.name()
                ));
            }
            if let Some(moved) = &c.leader_moved {
                failures.push(format!(
                    "Redis fault #{} ({}): the lease did not survive it, another gateway leads ({moved})",
                    c.step,
                    c.kind.name()
                ));
            }
        }

        // Whole after each fault and after the last.
        let whole_after = |from: u64, until: u64| {
            self.whole.iter().find(|(t, w)| *t >= from && *t <= until && *w).map(|(t, _)| t - from)
        };
        let done: Vec<&Injected> = self.injected.iter().filter(|f| f.skipped.is_none()).collect();
        let mut each = Vec::new();
        let mut never = 0;
        for (i, f) in done.iter().enumerate() {
            let next = done.get(i + 1).map_or(self.run_ms, |n| n.start_ms);
            match whole_after(f.end_ms, next) {
                Some(ms) => each.push(ms),
                None => never += 1,
            }
        }
        each.sort_unstable();
        let whole_after_last_ms = match done.last() {
            Some(f) => whole_after(f.end_ms, self.run_ms),
            None => whole_after(0, self.run_ms),
        };
        match whole_after_last_ms {
            Some(ms) if ms <= WHOLE_TARGET_MS => {}
            Some(ms) => failures.push(format!(
                "every model whole {:.1} s after the last fault (target ≤ 15 s)",
                ms as f64 / 1e3
            )),
            None => failures.push("the models were never all whole after the last fault".into()),
        }

        let figure = |name: &str, value: String, target: Option<&str>, met: Option<bool>| Figure {
            name: name.into(),
            value,
            target: target.map(str::to_owned),
            met,
        };
        let zero = |name: &str, n: usize| figure(name, n.to_string(), Some("0"), Some(n == 0));
        let planned_30min = self.schedule.planned_ms() >= 29 * 60_000;
        let mut figures = vec![
            figure(
                "faults injected",
                injected_count.to_string(),
                planned_30min.then_some("≥ 100 in 30 minutes"),
                planned_30min.then_some(injected_count >= 100),
            ),
            figure("requests sent (sync + creates)", (sync.sent + p.creates).to_string(), None, None),
            figure(
                "requests accepted (sync accepted + predictions 201)",
                (sync.accepted + p.accepted).to_string(),
                None,
                None,
            ),
            figure(
                "requests answered (sync: an HTTP answer; predictions: terminal)",
                (sync.ok + sync.errors.values().sum::<usize>() + p.terminal.values().sum::<usize>())
                    .to_string(),
                None,
                None,
            ),
            figure(
                "sync requests cut in flight by their gateway's kill",
                sync.cut.to_string(),
                Some("allowed (docs)"),
                None,
            ),
            zero("accepted requests lost", sync.lost + p.lost),
            figure(
                "adapter requests answered an error their base's would not have had (of those answered)",
                format!("{} of {}", sync.adapter_failed, sync.adapter_accepted),
                Some("0"),
                Some(sync.adapter_failed == 0),
            ),
            zero("predictions without exactly one terminal webhook", p.no_webhook + p.webhooks_twice),
            figure(
                "predictions run twice (a gateway, node or engine lost meanwhile)",
                p.reran_explained.to_string(),
                Some("allowed (docs)"),
                None,
            ),
            zero("predictions run twice otherwise", p.reran_unexplained),
            figure(
                "predictions failed (a gateway, node or engine lost meanwhile)",
                p.failed_explained.to_string(),
                Some("allowed (docs)"),
                None,
            ),
            zero("predictions failed otherwise", p.failed_unexplained),
            figure(
                "differences from placement that converged (count; longest, calm time)",
                format!(
                    "{}; {}",
                    fleet.converged,
                    fleet.converged_max_ms.map_or("-".into(), |ms| format!("{:.1} s", ms as f64 / 1e3))
                ),
                Some("≤ 15 s each"),
                None,
            ),
            zero("ghost engines", fleet.ghost_engines),
            zero("replicas stuck short of their placement", fleet.stuck_replicas),
            zero("GPU over-commit events (engines)", fleet.over_commit),
            zero("GPU over-commit events (placement)", fleet.placement_over_commit),
            zero("engines outliving their agent", fleet.leftover_engines),
            zero(
                "hung engines their agent had not killed within 15 s",
                self.injected.iter().filter(|f| f.hung_left).count(),
            ),
            figure("Redis faults", redis.faults.to_string(), None, None),
            figure(
                "replicas restarted by Redis faults (of the engines running before them)",
                format!("{} of {}", redis.replicas_restarted, redis.engines_compared),
                Some("0"),
                Some(redis.replicas_restarted == 0),
            ),
            zero("accepted predictions failed across Redis faults", redis.predictions_failed),
            zero("sync requests failed across Redis faults", redis.sync_failed),
            zero("creates answered 5xx without Retry-After during Redis faults", redis.creates_500),
            zero(
                "Redis faults after which another gateway leads (the lease lost in a blip)",
                redis.lease_moved,
            ),
            figure(
                "every model whole after the last fault",
                whole_after_last_ms.map_or("never".into(), |ms| format!("{:.1} s", ms as f64 / 1e3)),
                Some("≤ 15 s"),
                Some(whole_after_last_ms.is_some_and(|ms| ms <= WHOLE_TARGET_MS)),
            ),
            figure(
                "every model whole after each fault (p50 / max; not before the next)",
                format!(
                    "{} / {}; {never}",
                    pct(&each, 0.5).map_or("-".into(), |ms| format!("{:.1} s", ms as f64 / 1e3)),
                    each.last().map_or("-".into(), |ms| format!("{:.1} s", *ms as f64 / 1e3)),
                ),
                None,
                None,
            ),
        ];
        if fleet.split_leader_samples > 0 {
            figures.push(figure(
                "samples with two leading gateways",
                fleet.split_leader_samples.to_string(),
                None,
                None,
            ));
        }
        Report {
            schedule: self.schedule,
            faults,
            skipped,
            sync,
            predictions: p,
            fleet,
            redis,
            whole_after_last_ms,
            whole_after_each_ms: (pct(&each, 0.5), each.last().copied(), never),
            figures,
            failures,
            violations: self.violations,
            logs,
            run_s: self.run_ms as f64 / 1e3,
            topology: self.topology,
        }
    }
}

fn pct(sorted: &[u64], q: f64) -> Option<u64> {
    (!sorted.is_empty()).then(|| sorted[((sorted.len() - 1) as f64 * q).round() as usize])
}

impl Report {
    /// Whether every target was met and nothing broke a rule.
    pub fn passed(&self) -> bool {
        self.failures.is_empty() && self.figures.iter().all(|f| f.met != Some(false))
    }

    /// The checker's findings of one kind.
    pub fn mismatches(&self, kind: Mismatch) -> usize {
        self.violations
            .iter()
            .filter(|v| matches!(v, Violation::Diverged { mismatch, .. } if *mismatch == kind))
            .count()
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "hangar bench chaos: {:.0} s, {} faults injected, Redis: {}",
            self.run_s,
            self.faults.values().sum::<u32>(),
            self.topology
        )?;
        for (kind, n) in &self.faults {
            writeln!(f, "  {n:>4}  {kind}")?;
        }
        for s in &self.skipped {
            writeln!(f, "  skipped: {s}")?;
        }
        let s = &self.sync;
        writeln!(
            f,
            "sync        {} sent: {} refused at connect (gateway down), {} accepted: {} answered 200, {} answered otherwise {:?}, {} cut by their gateway's kill, {} lost",
            s.sent,
            s.refused,
            s.accepted,
            s.ok,
            s.errors.values().sum::<usize>(),
            s.errors,
            s.cut,
            s.lost
        )?;
        for (status, body) in &s.error_examples {
            let times = s.error_times.get(status).map(|t| format!("{t:?}")).unwrap_or_default();
            writeln!(f, "            {status} sent at t = {times} s…, e.g.: {body}")?;
        }
        let p = &self.predictions;
        writeln!(
            f,
            "predictions {} creates: {} refused at connect, {} answered otherwise {:?}, {} cut, {} accepted: terminal {:?}, {} lost; {} without a terminal webhook, {} with two",
            p.creates, p.refused, p.not_accepted.values().sum::<usize>(), p.not_accepted, p.cut, p.accepted, p.terminal, p.lost, p.no_webhook, p.webhooks_twice
        )?;
        for (text, n) in &p.failure_texts {
            writeln!(f, "            failed ×{n}: {text}")?;
        }
        writeln!(f, "{:<68} {:>14}  {:<20} ", "figure", "measured", "target")?;
        for fig in &self.figures {
            let verdict = match fig.met {
                Some(true) => "meets",
                Some(false) => "MISSES",
                None => "",
            };
            writeln!(
                f,
                "{:<68} {:>14}  {:<20} {verdict}",
                fig.name,
                fig.value,
                fig.target.as_deref().unwrap_or("")
            )?;
        }
        if self.passed() {
            writeln!(f, "PASSED")?;
        } else {
            writeln!(f, "FAILED: {} findings", self.failures.len())?;
            for line in self.failures.iter().take(40) {
                writeln!(f, "  - {line}")?;
            }
            if self.failures.len() > 40 {
                writeln!(f, "  … and {} more (--json lists them all)", self.failures.len() - 40)?;
            }
            write!(f, "{}", self.schedule)?;
        }
        if let Some(dir) = &self.logs {
            writeln!(f, "the processes' logs are kept in {dir}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chaos::schedule::Fault;
    use crate::chaos::traffic::Hooks;

    fn records(injected: Vec<Injected>) -> Records {
        Records {
            schedule: Schedule::fixed(vec![super::super::schedule::Step {
                gap_ms: 1_000,
                fault: Fault::RedisPause { ms: 1_000 },
            }]),
            injected,
            syncs: Vec::new(),
            creates: Vec::new(),
            hooks: HashMap::new(),
            finals: HashMap::new(),
            violations: Vec::new(),
            samples: 0,
            split_leaders: 0,
            whole: (0..=120).map(|t| (t * 500, true)).collect(),
            converged: Vec::new(),
            redis: Vec::new(),
            leftover: Vec::new(),
            refused_starts: 0,
            run_ms: 60_000,
            topology: Topology::Single,
        }
    }

    fn fault(kind: Kind, start_ms: u64, end_ms: u64, gateway: Option<usize>) -> Injected {
        Injected {
            step: 0,
            kind,
            start_ms,
            end_ms,
            gateway,
            note: String::new(),
            skipped: None,
            hung_left: false,
        }
    }

    fn sync(gateway: usize, start_ms: u64, end_ms: u64, outcome: SyncOutcome) -> SyncRecord {
        SyncRecord { gateway, model: "m/a".into(), start_ms, end_ms, outcome }
    }

    fn accepted(id: &str, start_ms: u64) -> CreateRecord {
        CreateRecord {
            gateway: 0,
            model: "m/a".into(),
            start_ms,
            end_ms: start_ms + 5,
            outcome: CreateOutcome::Accepted { id: id.into() },
        }
    }

    fn hooks(starts: &[&str], terminals: &[(&str, &str)], at: u64) -> Hooks {
        Hooks {
            starts: starts.iter().map(|s| s.to_string()).collect(),
            terminals: terminals.iter().map(|(id, st)| (id.to_string(), (st.to_string(), None))).collect(),
            terminal_ms: (!terminals.is_empty()).then_some(at),
        }
    }

    #[test]
    fn a_sync_request_cut_is_lost_unless_its_gateway_was_killed_meanwhile() {
        let mut r = records(vec![fault(Kind::GatewayKill, 10_000, 12_000, Some(1))]);
        let cut = || SyncOutcome::Cut { error: "connection closed".into() };
        r.syncs = vec![
            sync(1, 9_500, 10_050, cut()),
            sync(0, 9_500, 10_050, cut()),
            sync(1, 30_000, 30_100, cut()),
        ];
        let report = r.report(None);
        assert_eq!((report.sync.cut, report.sync.lost), (1, 2));
        assert!(!report.passed());
    }

    #[test]
    fn an_adapter_request_answered_an_error_its_base_would_not_have_had_fails_the_run() {
        let mut r = records(vec![fault(Kind::EngineKill, 10_000, 10_000, None)]);
        let answered = |status| SyncOutcome::Answered { status, body: String::new() };
        let adapter = |start_ms, outcome| SyncRecord {
            model: "m/a:acme/x".into(),
            ..sync(0, start_ms, start_ms + 5, outcome)
        };
        // Load shedding (429, 503) is the base's answer too.
        r.syncs = vec![
            adapter(9_000, answered(200)),
            adapter(9_100, answered(503)),
            adapter(9_200, answered(429)),
            sync(0, 10_000, 10_005, answered(502)),
        ];
        let report = r.report(None);
        assert_eq!((report.sync.adapter_accepted, report.sync.adapter_failed), (3, 0));
        assert!(report.passed(), "a base request's 502 is not an adapter's");
        let mut r = records(vec![fault(Kind::EngineKill, 10_000, 10_000, None)]);
        r.syncs = vec![adapter(9_000, answered(200)), adapter(10_000, answered(502))];
        let report = r.report(None);
        assert_eq!((report.sync.adapter_accepted, report.sync.adapter_failed), (2, 1));
        assert!(!report.passed());
    }

    #[test]
    fn a_rerun_is_allowed_only_near_a_lost_gateway_node_or_engine() {
        let mut r = records(vec![fault(Kind::EngineKill, 10_000, 10_000, None)]);
        r.creates = vec![accepted("near", 13_000), accepted("far", 40_000), accepted("once", 41_000)];
        r.hooks = HashMap::from([
            ("near".into(), hooks(&["s1", "s2"], &[("t1", "succeeded")], 14_000)),
            ("far".into(), hooks(&["s3", "s4"], &[("t2", "succeeded")], 42_000)),
            ("once".into(), hooks(&["s5"], &[("t3", "succeeded"), ("t3b", "succeeded")], 42_000)),
        ]);
        let report = r.report(None);
        let p = &report.predictions;
        assert_eq!((p.reran_explained, p.reran_unexplained, p.webhooks_twice), (1, 1, 1));
        assert_eq!(report.failures.len(), 2, "{:?}", report.failures);
    }

    #[test]
    fn the_redis_figures_count_what_overlaps_a_redis_fault() {
        let mut r = records(vec![fault(Kind::RedisDown, 10_000, 16_000, None)]);
        r.syncs = vec![
            sync(0, 12_000, 12_100, SyncOutcome::Answered { status: 503, body: "x".into() }),
            sync(0, 40_000, 40_100, SyncOutcome::Answered { status: 503, body: "x".into() }),
        ];
        r.creates = vec![
            accepted("p", 9_000),
            CreateRecord {
                gateway: 0,
                model: "m/a".into(),
                start_ms: 12_000,
                end_ms: 12_010,
                outcome: CreateOutcome::Answered { status: 500, retry_after: false, body: "store".into() },
            },
            CreateRecord {
                gateway: 0,
                model: "m/a".into(),
                start_ms: 12_000,
                end_ms: 12_010,
                outcome: CreateOutcome::Answered { status: 503, retry_after: true, body: "retry".into() },
            },
        ];
        r.hooks = HashMap::from([("p".into(), hooks(&["s"], &[("t", "failed")], 17_000))]);
        r.redis = vec![RedisCheck {
            step: 0,
            kind: Kind::RedisDown,
            engines_before: 3,
            restarted: vec!["m/a:r".into()],
            leader_moved: Some("Some(\"gw-0\") → Some(\"gw-1\")".into()),
        }];
        let report = r.report(None);
        let x = &report.redis;
        assert_eq!(
            (
                x.faults,
                x.sync_failed,
                x.creates_500,
                x.predictions_failed,
                x.replicas_restarted,
                x.lease_moved
            ),
            (1, 1, 1, 1, 1, 1)
        );
        assert!(!report.passed());
    }

    #[test]
    fn the_fleet_must_be_whole_within_15_s_of_the_last_fault() {
        let mut r = records(vec![fault(Kind::AgentStop, 10_000, 20_000, None)]);
        r.whole = vec![(0, true), (15_000, false), (30_000, false), (36_000, true)];
        let report = r.report(None);
        assert_eq!(report.whole_after_last_ms, Some(16_000));
        assert!(!report.passed());
        let mut r = records(vec![fault(Kind::AgentStop, 10_000, 20_000, None)]);
        r.whole = vec![(0, true), (15_000, false), (30_000, true)];
        let report = r.report(None);
        assert_eq!(report.whole_after_last_ms, Some(10_000));
        assert!(report.passed(), "{report}");
    }
}
