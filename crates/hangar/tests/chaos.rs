//! The fault-injection suite's CI set (`hangar bench chaos`, docs/cluster.md):
//! a loopback fleet of real processes — Redis with AOF, 2 gateways, 3
//! agents — under mixed load and faults, held to what must survive them.
//!
//! Three short random seeds (chosen so that together they stop an agent
//! past its TTL, kill engines, the leader and an agent restarted at once,
//! and make one leave and rejoin), the Redis targets asserted exactly on a
//! dedicated schedule — Redis paused under load, then down for 6 s; and on
//! a Redis Cluster, paused, failed over and failed back — two
//! nodes drained by an operator under load, an engine hung on each node
//! under load, and a test of the checker
//! itself: an engine process no agent owns must be
//! found as a ghost. A
//! failing case prints the report, which names every finding and the
//! schedule (so the seed replays: `hangar bench chaos --seed N --minutes
//! M`), and keeps the processes' logs. Every process a case starts is
//! killed when it ends, failed or not (the fleet's drop kills whatever
//! carries the run's mark, engines included).

use std::time::Duration;

use hangar_bench::chaos::{self, Fault, Mismatch, Report, Schedule, Step, Topology};

fn run(seed: u64, duration: Duration, schedule: Option<Schedule>) -> Option<Report> {
    run_on(Topology::Single, seed, duration, schedule)
}

fn run_on(redis: Topology, seed: u64, duration: Duration, schedule: Option<Schedule>) -> Option<Report> {
    if hangar_redis::LocalRedis::binary().is_none() && std::env::var_os("CI").is_none() {
        eprintln!("skipped: no redis-server");
        return None;
    }
    let options = chaos::Options {
        seed,
        duration,
        schedule,
        clients: 6,
        rate: 6.0,
        redis,
        hangar_exe: env!("CARGO_BIN_EXE_hangar").into(),
        keep_logs: false,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    let report = runtime.block_on(chaos::run(&options)).expect("the fleet runs");
    eprintln!("{report}");
    Some(report)
}

fn random_seed(seed: u64) {
    let Some(report) = run(seed, Duration::from_secs(40), None) else { return };
    assert!(report.faults.values().sum::<u32>() >= 1, "no fault was injected:\n{report}");
    assert!(report.passed(), "seed {seed} failed:\n{report}");
}

/// SIGSTOP of an agent for 14.1 s (past its 8 s TTL: declared dead, its
/// replicas placed elsewhere, its engines to stop when it wakes), then an
/// engine kill on it — skipped when, as placement may, nothing was placed
/// on it again.
#[test]
fn chaos_seed_28() {
    random_seed(28);
}

/// Two engine kills, an agent leaving and rejoining under its name, an
/// agent stopped for 10.2 s.
#[test]
fn chaos_seed_29() {
    random_seed(29);
}

/// An agent stopped for 5.2 s, the leader killed, an agent killed and
/// restarted at once while its name is still held.
#[test]
fn chaos_seed_35() {
    random_seed(35);
}

/// An operator drains each of two nodes in turn under the mixed load, the
/// leader killed between the two: every replica moves make-before-break,
/// and the checker holds the fleet to everything it holds it to under
/// faults — no request or prediction lost, none run twice (a drain is no
/// excuse for a re-run), no GPU over-committed, engines == placed
/// replicas once calm.
#[test]
fn nodes_drained_under_load_lose_nothing() {
    let schedule = Schedule::fixed(vec![
        Step { gap_ms: 3_000, fault: Fault::NodeDrain { agent: 0, ms: 12_000 } },
        Step { gap_ms: 3_000, fault: Fault::LeaderKill { restart_after_ms: 1_000 } },
        Step { gap_ms: 5_000, fault: Fault::NodeDrain { agent: 1, ms: 12_000 } },
    ]);
    let Some(report) = run(0, Duration::ZERO, Some(schedule)) else { return };
    assert_eq!(report.faults.values().sum::<u32>(), 3, "{report}");
    assert!(report.sync.ok > 0 && report.predictions.accepted > 0, "no load ran:\n{report}");
    assert!(report.passed(), "{report}");
}

/// An engine hangs (SIGSTOP: alive, answering nothing) on each node in
/// turn under the mixed load, adapters included: each agent finds its hung
/// engine by its health checks and kills it (the run fails one left alive
/// 15 s), the replica's GPUs held until it is gone, and nothing accepted is
/// lost — sync requests waiting on it retried, predictions run again.
#[test]
fn hung_engines_under_load_are_killed_and_lose_nothing() {
    let schedule = Schedule::fixed(vec![
        Step { gap_ms: 3_000, fault: Fault::EngineHang { agent: 0, pick: 0 } },
        Step { gap_ms: 3_000, fault: Fault::EngineHang { agent: 1, pick: 1 } },
        Step { gap_ms: 3_000, fault: Fault::EngineHang { agent: 2, pick: 2 } },
    ]);
    let Some(report) = run(0, Duration::ZERO, Some(schedule)) else { return };
    assert_eq!(report.faults.values().sum::<u32>(), 3, "{report}");
    assert!(report.sync.ok > 0 && report.predictions.accepted > 0, "no load ran:\n{report}");
    assert!(report.passed(), "{report}");
}

/// The checker finds what it is there to find: an engine process of the
/// run that no agent owns is a ghost, and the run fails.
#[test]
fn the_checker_finds_a_planted_ghost_engine() {
    let schedule = Schedule::fixed(vec![Step { gap_ms: 2_000, fault: Fault::StrayEngine }]);
    let Some(report) = run(0, Duration::ZERO, Some(schedule)) else { return };
    assert_eq!(report.fleet.ghost_engines, 1, "{report}");
    assert_eq!(report.mismatches(Mismatch::Orphan), 1, "{report}");
    assert!(!report.passed(), "{report}");
    // A failed run keeps its logs for whoever reads the report; this one
    // failed on purpose.
    if let Some(logs) = &report.logs {
        std::fs::remove_dir_all(logs).unwrap();
    }
}

/// Redis paused for 8 s under load, then (after the fleet settles) killed
/// and down for 6 s: no replica restarted (every engine's process the
/// same), no accepted prediction failed, no sync request failed, no create
/// answered 5xx without `Retry-After`, and the same gateway leads after
/// each blip (docs/cluster.md: "a blip is not a new tenure").
#[test]
fn redis_paused_then_down_under_load_restarts_nothing_and_fails_nothing() {
    let schedule = Schedule::fixed(vec![
        Step { gap_ms: 3_000, fault: Fault::RedisPause { ms: 8_000 } },
        Step { gap_ms: 15_000, fault: Fault::RedisDown { ms: 6_000 } },
    ]);
    let Some(report) = run(0, Duration::ZERO, Some(schedule)) else { return };
    assert_redis_faults_harmless(&report, 2);
}

/// The same on a Redis Cluster with replicas (`--redis cluster`): the
/// primary of Hangar's slot paused for 8 s under load, then killed — its
/// replica takes over after the cluster's 2 s node timeout and an election
/// — and, once the killed node is back as the new primary's replica, the
/// new primary killed in turn, failing back. Held to the same: nothing
/// restarted, failed or answered 5xx without `Retry-After`, the same
/// gateway leading throughout.
#[test]
fn a_redis_cluster_failing_over_and_back_under_load_restarts_nothing_and_fails_nothing() {
    let schedule = Schedule::fixed(vec![
        Step { gap_ms: 3_000, fault: Fault::RedisPause { ms: 8_000 } },
        Step { gap_ms: 15_000, fault: Fault::RedisDown { ms: 6_000 } },
        Step { gap_ms: 15_000, fault: Fault::RedisDown { ms: 6_000 } },
    ]);
    let Some(report) = run_on(Topology::Cluster, 0, Duration::ZERO, Some(schedule)) else { return };
    assert_redis_faults_harmless(&report, 3);
}

/// What a run whose faults were all `faults` Redis faults must show: none
/// restarted a replica, failed an accepted prediction or a sync request,
/// answered a create 5xx without `Retry-After` or moved the lease, under
/// load, and the run passed every other check.
fn assert_redis_faults_harmless(report: &Report, faults: usize) {
    let r = &report.redis;
    assert_eq!(r.faults, faults, "{report}");
    assert_eq!(r.replicas_restarted, 0, "{report}");
    assert_eq!(r.predictions_failed, 0, "{report}");
    assert_eq!(r.sync_failed, 0, "{report}");
    assert_eq!(r.creates_500, 0, "{report}");
    assert_eq!(r.lease_moved, 0, "{report}");
    assert!(report.sync.ok > 0 && report.predictions.accepted > 0, "no load ran:\n{report}");
    assert!(report.passed(), "{report}");
}
