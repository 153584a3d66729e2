//! The controller on a logical clock: placement steps from scaling
//! decisions, unplaceable models backed off, failures restored, start
//! failures backed off until a replica is ready, evictions that stick,
//! engines that cannot sleep evicted COLD.

use std::collections::BTreeMap;

use hangar_core::{Millis, ModelKey, ReplicaId};
use hangar_placement::{Action as Step, Cluster, ClusterConfig, Level};
use hangar_scaler::{
    Action, BlockCause, Bounds, Controller, HangarSettings, ModelSpec, Observation, ReplicaCounts,
    ScalingConfig, StartTier,
};
use proptest::prelude::*;

fn cluster(gpus: u32, models: &[(&str, &str)]) -> Cluster {
    let mut text =
        format!("[[nodes]]\nid = \"n\"\ngpus = {gpus}\ngpu_memory = \"80GB\"\ncpu_cache = \"200GB\"\n");
    for (key, size) in models {
        text.push_str(&format!("[models.\"{key}\"]\nsize = \"{size}\"\n"));
    }
    Cluster::new(toml::from_str::<ClusterConfig>(&text).unwrap()).unwrap()
}

fn key(k: &str) -> ModelKey {
    k.parse().unwrap()
}

fn hangar(after_s: u64) -> ScalingConfig {
    ScalingConfig::Hangar(HangarSettings { scale_down_after_s: after_s, ..HangarSettings::default() })
}

fn spec(k: &str, scaling: ScalingConfig, min: u32, max: u32) -> ModelSpec {
    ModelSpec { key: key(k), scaling, bounds: Bounds { min, max }, slo_ttft_ms: None }
}

fn drain(c: &mut Controller) -> Vec<Action> {
    std::iter::from_fn(|| c.poll_action()).collect()
}

/// Creates (and deletes) in the actions' deltas, by model.
fn steps(actions: &[Action], kind: Step) -> usize {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Apply(d) => Some(d.steps().filter(|s| s.action == kind).count()),
            _ => None,
        })
        .sum()
}

fn load(work: u32, ready: u32) -> Observation {
    Observation {
        in_flight: work.min(ready * 4),
        waiting: work.saturating_sub(ready * 4),
        permits_per_replica: 4,
        replicas: ReplicaCounts { ready, ..ReplicaCounts::default() },
        ..Observation::default()
    }
}

#[test]
fn min_replicas_are_placed_at_once_and_demand_adds_more() {
    let mut c = Controller::new(cluster(2, &[("m", "10GB")]), 1, vec![spec("m", hangar(300), 1, 4)], 0);
    assert_eq!(steps(&drain(&mut c), Step::Create), 1);
    c.observe(1_000, &key("m"), load(10, 1), &[]);
    c.handle_timeout(1_000);
    let actions = drain(&mut c);
    assert_eq!(steps(&actions, Step::Create), 2, "10 requests at 4 per replica: 3");
    assert!(actions.iter().any(|a| matches!(a, Action::Decided { decision, .. } if decision.desired == 3)));
}

/// One 80 GB GPU cannot hold two 60 GB replicas: the model is unplaceable
/// once, retried with back-off, and never spins.
#[test]
fn an_unplaceable_count_is_reported_once_and_retried_with_backoff() {
    let scaling = ScalingConfig::Fixed;
    let mut c = Controller::new(cluster(1, &[("big", "60GB")]), 1, vec![spec("big", scaling, 2, 2)], 0);
    let first = drain(&mut c);
    assert_eq!(steps(&first, Step::Create), 1, "one fits");
    assert_eq!(
        first.iter().filter(|a| matches!(a, Action::Unplaceable { cause: BlockCause::NoRoom, .. })).count(),
        1,
        "placement's refusal, not a start failure"
    );
    let blocked = c.blocked(&key("big")).unwrap().clone();
    assert!(blocked.reason.contains("room") || blocked.reason.contains("GPU"), "{blocked:?}");
    let mut wakeups = 0;
    let mut now: Millis = 0;
    let mut later = Vec::new();
    while now < 120_000 {
        now = c.poll_timeout().max(now + 1);
        c.observe(now, &key("big"), load(0, 1), &[]);
        c.handle_timeout(now);
        later.extend(drain(&mut c));
        wakeups += 1;
    }
    assert!(later.iter().all(|a| !matches!(a, Action::Unplaceable { .. } | Action::Apply(_))), "{later:?}");
    // Decisions every second (the fixed policy's tick), retries doubling:
    // nothing like a busy loop.
    assert!(wakeups <= 130, "{wakeups} wake-ups in two minutes");
    assert!(c.blocked(&key("big")).unwrap().backoff >= 32_000);
}

#[test]
fn a_failed_replica_is_replaced_and_one_that_does_not_start_is_backed_off() {
    let mut c = Controller::new(cluster(2, &[("m", "10GB")]), 1, vec![spec("m", hangar(300), 1, 1)], 0);
    drain(&mut c);
    let id = c.cluster().replicas_of(&key("m"), Level::Hot)[0].replica_id;
    c.handle_failed(5_000, &key("m"), id, "its engine process exited", false);
    let actions = drain(&mut c);
    assert_eq!(steps(&actions, Step::Create), 1, "{actions:?}");
    assert_eq!(
        steps(&actions, Step::Delete),
        1,
        "the failed one leaves its node's desired state: {actions:?}"
    );
    let replacement = c.cluster().replicas_of(&key("m"), Level::Hot)[0].replica_id;
    assert_ne!(replacement, id);

    c.handle_failed(6_000, &key("m"), replacement, "exited before it was ready", true);
    let actions = drain(&mut c);
    assert_eq!(steps(&actions, Step::Create), 0, "not at once: {actions:?}");
    assert!(actions
        .iter()
        .any(|a| matches!(a, Action::Unplaceable { reason, cause: BlockCause::StartFailed, .. }
        if reason.contains("did not start"))));
    let retry = c.blocked(&key("m")).unwrap().retry_at;
    c.observe(retry, &key("m"), load(0, 0), &[]);
    c.handle_timeout(retry);
    let actions = drain(&mut c);
    assert_eq!(steps(&actions, Step::Create), 1, "after the back-off: {actions:?}");
    assert!(actions.iter().any(|a| matches!(a, Action::Placeable { .. })));
}

#[test]
fn an_admin_eviction_lowers_the_count_so_the_replica_stays_out() {
    let mut c = Controller::new(cluster(2, &[("m", "10GB")]), 1, vec![spec("m", hangar(300), 0, 2)], 0);
    c.observe(1_000, &key("m"), load(8, 0), &[]);
    c.handle_timeout(1_000);
    drain(&mut c);
    assert_eq!(c.cluster().replicas_of(&key("m"), Level::Hot).len(), 2);
    let id = c.cluster().replicas_of(&key("m"), Level::Hot)[0].replica_id;
    assert_eq!(c.evict(2_000, &key("m"), Some(id)).unwrap(), 1);
    let actions = drain(&mut c);
    assert_eq!(steps(&actions, Step::ToCache), 1);
    assert_eq!(c.scaler(&key("m")).unwrap().desired(), 1);
    // Quiet: no decision brings it straight back.
    for t in (3..60).map(|s| s * 1_000) {
        c.observe(t, &key("m"), load(0, 1), &[]);
        c.handle_timeout(t);
    }
    let later = drain(&mut c);
    assert_eq!(steps(&later, Step::FromCache) + steps(&later, Step::Create), 0, "{later:?}");
    assert_eq!(c.cluster().replicas_of(&key("m"), Level::Hot).len(), 1);
    assert!(c.evict(0, &key("m"), Some(ReplicaId::from_u128(7))).is_err());
}

#[test]
fn scaling_down_evicts_the_least_busy_and_pins_hold() {
    let mut c = Controller::new(cluster(2, &[("m", "10GB")]), 1, vec![spec("m", hangar(10), 0, 3)], 0);
    c.observe(1_000, &key("m"), load(12, 0), &[]);
    c.handle_timeout(1_000);
    drain(&mut c);
    let hot: Vec<ReplicaId> =
        c.cluster().replicas_of(&key("m"), Level::Hot).iter().map(|d| d.replica_id).collect();
    assert_eq!(hot.len(), 3);
    // Demand for 2; the busy ones stay.
    let busy = [(hot[0], 4), (hot[1], 0), (hot[2], 4)];
    let mut t = 2_000;
    while c.cluster().replicas_of(&key("m"), Level::Hot).len() == 3 && t < 60_000 {
        c.observe(t, &key("m"), load(8, 3), &busy);
        c.handle_timeout(t);
        t += 1_000;
    }
    let left: Vec<ReplicaId> =
        c.cluster().replicas_of(&key("m"), Level::Hot).iter().map(|d| d.replica_id).collect();
    assert_eq!(left.len(), 2, "after the quiet period");
    assert!(!left.contains(&hot[1]), "the idle one went");
    drain(&mut c);
    c.pin(t, &key("m"), 3).unwrap();
    assert_eq!(c.cluster().replicas_of(&key("m"), Level::Hot).len(), 3);
    assert!(c.pin(t, &key("m"), 4).is_err(), "beyond max_replicas");
    c.release(t, &key("m")).unwrap();
}

/// New bounds (a deployment's `min_instances` / `max_instances`) take
/// effect at once: a raised minimum places replicas of an idle model, a
/// lowered maximum takes the surplus away and clamps a pin, the same
/// bounds twice decide nothing, and bounds no model runs within are
/// refused without a change.
#[test]
fn new_bounds_move_the_model_at_once_and_repeating_them_changes_nothing() {
    let mut c = Controller::new(cluster(4, &[("m", "10GB")]), 1, vec![spec("m", hangar(600), 0, 4)], 0);
    let hot = |c: &Controller| c.cluster().replicas_of(&key("m"), Level::Hot).len();
    c.observe(1_000, &key("m"), load(0, 0), &[]);
    c.handle_timeout(1_000);
    assert_eq!(hot(&c), 0);
    c.set_bounds(2_000, &key("m"), Bounds { min: 2, max: 4 }).unwrap();
    assert_eq!(hot(&c), 2, "a raised minimum is placed at once");
    drain(&mut c);
    c.set_bounds(2_500, &key("m"), Bounds { min: 2, max: 4 }).unwrap();
    assert!(drain(&mut c).is_empty(), "the same bounds again decide nothing");
    c.pin(3_000, &key("m"), 4).unwrap();
    assert_eq!(hot(&c), 4);
    c.set_bounds(4_000, &key("m"), Bounds { min: 1, max: 3 }).unwrap();
    assert_eq!(hot(&c), 3, "a lowered maximum clamps the pin");
    assert_eq!(c.scaler(&key("m")).unwrap().override_(), Some(hangar_scaler::Override::Pinned(3)));
    for bad in [Bounds { min: 0, max: 0 }, Bounds { min: 3, max: 2 }] {
        assert!(c.set_bounds(5_000, &key("m"), bad).is_err(), "{bad:?}");
        assert_eq!(c.scaler(&key("m")).unwrap().bounds(), Bounds { min: 1, max: 3 });
    }
    assert!(c.set_bounds(5_000, &key("nope"), Bounds { min: 0, max: 1 }).is_err());
}

/// Two 60 GB models on one 80 GB GPU: placing one evicts the other, which
/// then wants nothing until its own demand asks — no ping-pong.
#[test]
fn a_preempted_model_does_not_take_its_gpu_straight_back() {
    let mut text = String::from("[placement]\nmin_deployment_age_ms = 0\n");
    text.push_str("[[nodes]]\nid = \"n\"\ngpus = 1\ngpu_memory = \"80GB\"\ncpu_cache = \"200GB\"\n");
    text.push_str("[models.\"a\"]\nsize = \"60GB\"\n[models.\"b\"]\nsize = \"60GB\"\n");
    let cluster = Cluster::new(toml::from_str::<ClusterConfig>(&text).unwrap()).unwrap();
    let models = vec![spec("a", hangar(300), 0, 1), spec("b", hangar(300), 0, 1)];
    let mut c = Controller::new(cluster, 1, models, 0);
    c.observe(1_000, &key("a"), load(1, 0), &[]);
    c.handle_timeout(1_000);
    c.observe(2_000, &key("a"), load(0, 1), &[]);
    c.observe(2_000, &key("b"), load(1, 0), &[]);
    c.handle_timeout(2_000);
    drain(&mut c);
    assert_eq!(c.cluster().replicas_of(&key("b"), Level::Hot).len(), 1);
    assert_eq!(c.cluster().replicas_of(&key("a"), Level::Warm).len(), 1, "a went WARM for b");
    assert_eq!(c.scaler(&key("a")).unwrap().desired(), 0, "a wants only what it kept");
    for t in (3..30).map(|s| s * 1_000) {
        c.observe(t, &key("a"), load(0, 0), &[]);
        c.observe(t, &key("b"), load(0, 1), &[]);
        c.handle_timeout(t);
    }
    let later = drain(&mut c);
    assert!(later.iter().all(|a| !matches!(a, Action::Apply(_))), "{later:?}");
    // a's own demand brings it back (waking its warm copy).
    c.observe(31_000, &key("a"), load(1, 0), &[]);
    c.handle_timeout(31_000);
    assert_eq!(steps(&drain(&mut c), Step::FromCache), 1);
}

/// Two GPUs, both held by `busy` (too young for placement to evict) after
/// a burst; `starved` then has requests waiting and no room. When `busy`'s
/// demand needs one replica, `starved` gets the other after the
/// starvation patience (60 s), not after `busy`'s 300 s quiet period; when
/// `busy` needs both, `starved` keeps waiting (age guards churn).
#[test]
fn a_waiting_model_gets_what_another_holds_beyond_its_demand_within_a_minute() {
    let start_of_starved = |busy_work: u32| -> Option<Millis> {
        let models = vec![spec("busy", hangar(300), 0, 2), spec("starved", hangar(300), 0, 1)];
        let mut c = Controller::new(cluster(2, &[("busy", "60GB"), ("starved", "60GB")]), 1, models, 0);
        c.observe(1_000, &key("busy"), load(8, 0), &[]);
        c.handle_timeout(1_000);
        assert_eq!(c.scaler(&key("busy")).unwrap().desired(), 2);
        drain(&mut c);
        // `busy` serves `busy_work` requests of a second each, one arriving
        // and one finishing every 1/busy_work s.
        let busy = |t: Millis| Observation {
            arrivals: t / 1_000 * u64::from(busy_work),
            completions: t / 1_000 * u64::from(busy_work),
            busy_ms: t * u64::from(busy_work),
            ..load(busy_work, 2)
        };
        for t in (2..=400).map(|s| s * 1_000) {
            c.observe(t, &key("busy"), busy(t), &[]);
            if t >= 10_000 {
                let placed = c.cluster().replicas_of(&key("starved"), Level::Hot).len() as u32;
                c.observe(t, &key("starved"), load(3, placed), &[]);
            }
            while c.poll_timeout() <= t {
                c.handle_timeout(t);
            }
            let actions = drain(&mut c);
            if steps(&actions, Step::Create) > 0
                && !c.cluster().replicas_of(&key("starved"), Level::Hot).is_empty()
            {
                let why = c.scaler(&key("busy")).unwrap().decisions().last().unwrap().reason.to_string();
                assert!(why.contains("waiting for room"), "{why}");
                return Some(t);
            }
        }
        None
    };
    let started = start_of_starved(2).expect("starved got a GPU");
    // Blocked at 10 s; the patience is 60 s; a decision or two after.
    assert!((70_000..=72_000).contains(&started), "at {started} ms");
    assert_eq!(start_of_starved(8), None, "busy needs both GPUs: no churn");
}

/// A model blocked while growing, whose scaler then wants fewer: it is no
/// longer blocked, and nothing is due again at the same instant (a
/// simulator driving the controller would otherwise spin there).
#[test]
fn shrinking_clears_a_block_so_nothing_stays_due() {
    let mut c = Controller::new(cluster(1, &[("big", "60GB")]), 1, vec![spec("big", hangar(1), 0, 2)], 0);
    c.observe(1_000, &key("big"), load(8, 0), &[]);
    c.handle_timeout(1_000);
    assert!(c.blocked(&key("big")).is_some(), "two 60 GB replicas do not fit one GPU");
    let mut t = 1_000;
    while c.blocked(&key("big")).is_some() && t < 120_000 {
        t += 1_000;
        c.observe(t, &key("big"), load(0, 1), &[]);
        // As a driver does: handle what is due until nothing is.
        let mut rounds = 0;
        while c.poll_timeout() <= t {
            c.handle_timeout(t);
            rounds += 1;
            assert!(rounds < 10, "something stays due at {t}: {:?}", c.blocked(&key("big")));
        }
    }
    assert!(c.blocked(&key("big")).is_none(), "still blocked at {t}");
}

/// A dedicated window places its replicas when it starts, keeps them
/// (dedicated, so another model cannot take them) while it lasts, and
/// frees them to the policy when it ends.
#[test]
fn a_dedicated_window_starts_and_ends_on_time() {
    use hangar_placement::{Schedule, Window};
    let mut c = Controller::new(cluster(4, &[("m", "10GB")]), 1, vec![spec("m", hangar(5), 0, 4)], 0);
    let window = Window { model_key: key("m"), replicas: 2, start_ms: 10_000, end_ms: 20_000 };
    c.set_schedule(0, Schedule::new(vec![window]).unwrap());
    assert!(drain(&mut c).is_empty(), "nothing before the window");
    assert_eq!(c.poll_timeout(), 1_000, "the scaler's tick comes first");
    while c.poll_timeout() < 10_000 {
        let now = c.poll_timeout();
        c.observe(now, &key("m"), load(0, 0), &[]);
        c.handle_timeout(now);
        assert!(drain(&mut c).is_empty(), "at {now}: the schedule is due at its start");
    }
    c.observe(10_000, &key("m"), load(0, 0), &[]);
    c.handle_timeout(10_000);
    let actions = drain(&mut c);
    assert_eq!(steps(&actions, Step::Create), 2, "{actions:?}");
    assert_eq!(c.scaler(&key("m")).unwrap().desired(), 2);
    let hot = c.cluster().replicas_of(&key("m"), Level::Hot);
    assert!(hot.len() == 2 && hot.iter().all(|d| d.dedicated));
    // Idle all window long: the replicas stay.
    for t in (11..20).map(|s| s * 1_000) {
        c.observe(t, &key("m"), load(0, 2), &[]);
        c.handle_timeout(t);
        assert_eq!(steps(&drain(&mut c), Step::Delete), 0, "at {t} ms");
    }
    // At its end they are ordinary again, and the idle model gives them
    // back after its quiet period.
    c.observe(20_000, &key("m"), load(0, 2), &[]);
    c.handle_timeout(20_000);
    drain(&mut c);
    assert!(c.cluster().replicas_of(&key("m"), Level::Hot).iter().all(|d| !d.dedicated));
    for t in (21..40).map(|s| s * 1_000) {
        c.observe(t, &key("m"), load(0, 2), &[]);
        c.handle_timeout(t);
    }
    assert_eq!(c.scaler(&key("m")).unwrap().desired(), 0);
}

/// A model waiting for room, with a WARM replica in the warm cache, comes
/// back the moment another model frees the GPU — not at the end of its
/// back-off.
#[test]
fn a_warm_replica_comes_back_as_soon_as_gpus_are_freed() {
    let models = vec![spec("a", hangar(1), 0, 1), spec("b", hangar(1), 0, 1)];
    let mut c = Controller::new(cluster(1, &[("a", "60GB"), ("b", "60GB")]), 1, models, 0);
    // Steps the clock a second at a time with each model's load, as a
    // driver does, and returns what happened at each second.
    let run = |c: &mut Controller, from: u64, to: u64, a: (u32, u32), b: (u32, u32)| {
        let mut seen = Vec::new();
        for t in (from..to).map(|s| s * 1_000) {
            let retry_before = c.blocked(&key("b")).map(|b| b.retry_at);
            c.observe(t, &key("a"), load(a.0, a.1), &[]);
            c.observe(t, &key("b"), load(b.0, b.1), &[]);
            while c.poll_timeout() <= t {
                c.handle_timeout(t);
            }
            seen.push((t, retry_before, drain(c)));
        }
        seen
    };
    run(&mut c, 1, 2, (0, 0), (1, 0));
    run(&mut c, 2, 20, (0, 0), (0, 1));
    assert_eq!(c.cluster().replicas_of(&key("b"), Level::Warm).len(), 1, "b went WARM when idle");
    run(&mut c, 20, 21, (1, 0), (0, 0));
    assert_eq!(c.cluster().replicas_of(&key("a"), Level::Hot).len(), 1);
    // b wants its replica back, but a is young and holds the only GPU.
    run(&mut c, 21, 40, (1, 1), (1, 0));
    let blocked = c.blocked(&key("b")).expect("b waits for room").clone();
    assert!(blocked.backoff >= 8_000, "{blocked:?}");
    // a goes idle and gives its GPU back: b wakes its WARM copy then.
    let seen = run(&mut c, 40, 60, (0, 1), (1, 0));
    let freed = seen.iter().find(|(_, _, acts)| steps(acts, Step::ToCache) == 1).expect("a shrinks");
    assert_eq!(steps(&freed.2, Step::FromCache), 1, "b wakes at {} as a leaves: {:?}", freed.0, freed.2);
    assert!(freed.1.is_some_and(|retry| retry > freed.0), "b's back-off would have waited: {freed:?}");
    assert!(c.blocked(&key("b")).is_none());
    assert_eq!(c.cluster().replicas_of(&key("b"), Level::Hot).len(), 1);
}

fn hot_ids(c: &Controller, m: &str) -> Vec<ReplicaId> {
    c.cluster().replicas_of(&key(m), Level::Hot).iter().map(|d| d.replica_id).collect()
}

/// An engine that cannot sleep, once the controller heard so from a ready
/// replica, is evicted COLD (deleted, not sent to the warm cache), and the
/// WARM replica of another model in that cache stays; one that can sleep
/// takes the cache, pushing the other out.
#[test]
fn an_engine_that_cannot_sleep_is_evicted_cold_and_leaves_the_warm_cache_alone() {
    for sleeps in [true, false] {
        // Both take the two GPUs; the 200 GB cache holds one of them.
        let models = &[("w", "120GB"), ("s", "100GB")];
        let specs = vec![spec("w", hangar(300), 0, 1), spec("s", hangar(300), 0, 1)];
        let mut c = Controller::new(cluster(2, models), 1, specs, 0);
        c.observe(1_000, &key("w"), load(1, 0), &[]);
        c.handle_timeout(1_000);
        c.evict(2_000, &key("w"), None).unwrap();
        assert_eq!(c.cluster().replicas_of(&key("w"), Level::Warm).len(), 1);
        c.observe(3_000, &key("w"), load(0, 0), &[]);
        c.observe(3_000, &key("s"), load(1, 0), &[]);
        c.handle_timeout(3_000);
        assert_eq!(hot_ids(&c, "s").len(), 1);
        c.handle_ready(4_000, &key("s"), StartTier::Cold, 1_000, sleeps);
        assert_eq!(c.cluster().sleeps(&key("s")), sleeps);
        drain(&mut c);

        c.evict(5_000, &key("s"), None).unwrap();
        let actions = drain(&mut c);
        let delta = actions
            .iter()
            .find_map(|a| match a {
                Action::Apply(d) => Some(d),
                _ => None,
            })
            .expect("the eviction's steps");
        let of = |list: &[hangar_placement::Deployment]| -> Vec<String> {
            list.iter().map(|d| d.model_key.to_string()).collect()
        };
        if sleeps {
            assert_eq!((of(&delta.to_cache), of(&delta.delete)), (vec!["s".into()], vec!["w".into()]));
        } else {
            assert_eq!((of(&delta.to_cache), of(&delta.delete)), (vec![], vec!["s".into()]));
            assert_eq!(c.cluster().replicas_of(&key("w"), Level::Warm).len(), 1, "w stays WARM");
        }
    }
}

/// Runs the driver's loop from `now` until `m` gets a replica placed again
/// (retrying as soon as `poll_timeout` says, every model observed idle
/// first), and returns when that was.
fn next_create(c: &mut Controller, mut now: Millis, m: &str) -> Millis {
    loop {
        now = c.poll_timeout().max(now);
        assert!(now < 3_600_000, "no retry within an hour");
        for model in c.cluster().models().keys().cloned().collect::<Vec<_>>() {
            c.observe(now, &model, load(0, 0), &[]);
        }
        while c.poll_timeout() <= now {
            c.handle_timeout(now);
        }
        let actions = drain(c);
        let created = actions.iter().any(|a| match a {
            Action::Apply(d) => d.create.iter().any(|d| d.model_key == key(m)),
            _ => false,
        });
        if created {
            return now;
        }
    }
}

/// A replica that never starts, retried by a driver as soon as the
/// controller lets it: the retries come 1, 2, 4 … 60 s apart and stay at
/// 60 s, although each retry is placed (placing it does not reset the
/// back-off); once a replica is ready the next failure waits 1 s again.
#[test]
fn start_failures_back_off_1_2_4_to_60_s_until_a_replica_is_ready() {
    let mut c =
        Controller::new(cluster(2, &[("m", "10GB")]), 1, vec![spec("m", ScalingConfig::Fixed, 1, 1)], 0);
    assert_eq!(steps(&drain(&mut c), Step::Create), 1);
    let mut at = 0;
    let mut gaps = Vec::new();
    for _ in 0..10 {
        let id = hot_ids(&c, "m")[0];
        c.handle_failed(at, &key("m"), id, "exited before it was ready", true);
        let blocked = c.blocked(&key("m")).unwrap().clone();
        assert_eq!(blocked.cause, BlockCause::StartFailed);
        let retry = next_create(&mut c, at, "m");
        assert_eq!(retry, blocked.retry_at);
        gaps.push((retry - at) / 1_000);
        at = retry;
    }
    assert_eq!(gaps, [1, 2, 4, 8, 16, 32, 60, 60, 60, 60]);

    // It starts: the next failure is a first one again.
    c.handle_ready(at + 5_000, &key("m"), StartTier::Cold, 5_000, true);
    at += 20_000;
    let id = hot_ids(&c, "m")[0];
    c.handle_failed(at, &key("m"), id, "exited before it was ready", true);
    assert_eq!(next_create(&mut c, at, "m") - at, 1_000);
}

/// Two replicas started together that both fail are one failed round: the
/// wait doubles once per round, not once per replica.
#[test]
fn replicas_that_fail_together_count_as_one_start_failure() {
    let mut c =
        Controller::new(cluster(2, &[("m", "10GB")]), 1, vec![spec("m", ScalingConfig::Fixed, 2, 2)], 0);
    assert_eq!(steps(&drain(&mut c), Step::Create), 2);
    let mut at = 0;
    let mut gaps = Vec::new();
    for _ in 0..3 {
        let ids = hot_ids(&c, "m");
        assert_eq!(ids.len(), 2);
        c.handle_failed(at + 100, &key("m"), ids[0], "exited", true);
        c.handle_failed(at + 200, &key("m"), ids[1], "exited", true);
        let retry = next_create(&mut c, at + 200, "m");
        assert_eq!(hot_ids(&c, "m").len(), 2, "both placed again at the retry");
        gaps.push(retry - (at + 100));
        at = retry;
    }
    assert_eq!(gaps, [1_000, 2_000, 4_000]);
}

/// What becomes of one start of the model under test: it fails, or is
/// ready, `delay_ms` after it was placed; a ready one may crash later.
#[derive(Debug, Clone)]
struct Start {
    fails: bool,
    delay_ms: Millis,
    crash_after_ms: Option<Millis>,
}

/// Something else that happens to the fleet meanwhile.
#[derive(Debug, Clone)]
enum Noise {
    /// A replica of the other model dies (GPUs freed, a replacement placed).
    CrashOther(usize),
    /// A replica of the other model does not start (its own back-off).
    OtherStartFails(usize),
    /// A node joins (room: backed-off models retried at once).
    Join,
}

#[derive(Debug, Clone)]
enum Event {
    Outcome(ReplicaId, Start),
    Crash(ReplicaId),
    Noise(Noise),
}

/// What the driver saw of the model under test.
#[derive(Debug, Clone, Copy)]
enum Seen {
    Create(Millis),
    StartFailed(Millis),
    Ready,
    Crash(Millis),
}

fn noisy_world() -> impl Strategy<Value = (Vec<Start>, Vec<(Millis, Noise)>)> {
    let start = (prop::bool::weighted(0.7), 0u64..5_000, prop::option::weighted(0.5, 0u64..20_000))
        .prop_map(|(fails, delay_ms, crash_after_ms)| Start { fails, delay_ms, crash_after_ms });
    let noise = prop_oneof![
        3 => (0usize..4).prop_map(Noise::CrashOther),
        1 => (0usize..4).prop_map(Noise::OtherStartFails),
        1 => Just(Noise::Join),
    ];
    (prop::collection::vec(start, 1..30), prop::collection::vec((0u64..900_000, noise), 0..40))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// A model whose starts fail or succeed at random, after random delays,
    /// while another model's replicas crash or fail to start and nodes join
    /// (freed GPUs and new room, which bring placement retries forward),
    /// driven as a driver does (timeouts as soon as due, facts as they
    /// come): after its k-th start failure in a row it is placed again
    /// exactly min(2^(k-1), 60) s later — never sooner, whatever else
    /// happened — and a ready replica starts the count over; a replica
    /// that dies after it was ready is replaced at once.
    #[test]
    fn start_failures_wait_their_back_off_whatever_else_happens((starts, noise) in noisy_world()) {
        let models = &[("m", "10GB"), ("o", "10GB")];
        let specs = vec![spec("m", ScalingConfig::Fixed, 1, 1), spec("o", ScalingConfig::Fixed, 2, 2)];
        let mut c = Controller::new(cluster(4, models), 7, specs, 0);
        let mut queue: BTreeMap<(Millis, usize), Event> = BTreeMap::new();
        for (i, (at, n)) in noise.into_iter().enumerate() {
            queue.insert((at, i), Event::Noise(n));
        }
        let mut seq = queue.len();
        let mut starts = starts.into_iter();
        let mut seen = Vec::new();
        let mut joined = 0;
        let mut now = 0;
        let mut rounds = 0;
        loop {
            // Carry out what the controller asked, scheduling each new
            // replica's outcome.
            for action in drain(&mut c) {
                let Action::Apply(delta) = action else { continue };
                for step in delta.steps().filter(|s| matches!(s.action, Step::Create | Step::FromCache)) {
                    let d = step.deployment;
                    if d.model_key == key("m") {
                        seen.push(Seen::Create(now));
                        let start = starts.next().unwrap_or(Start { fails: false, delay_ms: 0, crash_after_ms: None });
                        queue.insert((now + start.delay_ms, seq), Event::Outcome(d.replica_id, start));
                        seq += 1;
                    } else {
                        c.handle_ready(now, &d.model_key, StartTier::Cold, 0, true);
                    }
                }
            }
            let next_event = queue.keys().next().map(|k| k.0);
            let waiting = c.blocked(&key("m")).is_some() || c.blocked(&key("o")).is_some();
            if next_event.is_none() && !waiting {
                break;
            }
            now = c.poll_timeout().min(next_event.unwrap_or(Millis::MAX));
            prop_assert!(now < 4 * 3_600_000, "the run does not end");
            rounds += 1;
            prop_assert!(rounds < 100_000, "stuck at {}", now);
            if c.poll_timeout() <= now {
                for model in [key("m"), key("o")] {
                    c.observe(now, &model, load(0, 0), &[]);
                }
                c.handle_timeout(now);
                continue;
            }
            let (_, event) = queue.pop_first().expect("an event is next");
            let alive = |c: &Controller, id: ReplicaId| c.cluster().deployment(&id).is_some();
            match event {
                Event::Outcome(id, start) if alive(&c, id) => {
                    if start.fails {
                        seen.push(Seen::StartFailed(now));
                        c.handle_failed(now, &key("m"), id, "exited before it was ready", true);
                    } else {
                        seen.push(Seen::Ready);
                        c.handle_ready(now, &key("m"), StartTier::Cold, start.delay_ms, true);
                        if let Some(after) = start.crash_after_ms {
                            queue.insert((now + after, seq), Event::Crash(id));
                            seq += 1;
                        }
                    }
                }
                Event::Crash(id) if alive(&c, id) => {
                    seen.push(Seen::Crash(now));
                    c.handle_failed(now, &key("m"), id, "its engine process exited", false);
                }
                Event::Noise(Noise::CrashOther(pick)) | Event::Noise(Noise::OtherStartFails(pick)) if !hot_ids(&c, "o").is_empty() => {
                    let others = hot_ids(&c, "o");
                    let start_failed = matches!(event, Event::Noise(Noise::OtherStartFails(_)));
                    c.handle_failed(now, &key("o"), others[pick % others.len()], "noise", start_failed);
                }
                Event::Noise(Noise::Join) => {
                    joined += 1;
                    let text = format!("[[nodes]]\nid = \"j{joined}\"\ngpus = 1\ngpu_memory = \"80GB\"\n");
                    let config: ClusterConfig = toml::from_str(&text).unwrap();
                    c.handle_node_joined(now, config.nodes[0].clone(), &[]).unwrap();
                }
                _ => {}
            }
        }

        // The oracle: when each placement of `m` was due.
        let mut wait: Option<Millis> = None;
        let mut due = Some(0);
        let mut failures = 0;
        for s in &seen {
            match *s {
                Seen::Create(t) => {
                    prop_assert_eq!(Some(t), due, "placed at {} in {:?}", t, seen);
                    due = None;
                }
                Seen::StartFailed(t) => {
                    let w = wait.map_or(1_000, |w| (w * 2).min(60_000));
                    wait = Some(w);
                    due = Some(t + w);
                    failures += 1;
                }
                Seen::Ready => wait = None,
                Seen::Crash(t) => due = Some(t),
            }
        }
        prop_assert!(failures == 0 || seen.iter().filter(|s| matches!(s, Seen::Create(_))).count() > failures);
    }
}

/// Three models of a whole GPU each on two GPUs, Poisson traffic of
/// clearly different rates; the busiest starts 30 s after the others, so
/// the two GPUs first go to the least busy and the middle one. Within a
/// few minutes the busiest holds a GPU in place of the least busy — the
/// starving model takes a replica whose traffic is surely less than its
/// own — and then nobody trades back: three creates in all, the least
/// busy at zero at the end.
fn gpus_go_to_the_busier_models(seed: u64, rates: [f64; 3]) -> Result<(), TestCaseError> {
    use rand::{Rng, SeedableRng};
    let names = ["low", "mid", "high"];
    let models = names.iter().map(|n| spec(n, hangar(300), 0, 1)).collect();
    let sizes: Vec<(&str, &str)> = names.iter().map(|n| (*n, "60GB")).collect();
    let mut c = Controller::new(cluster(2, &sizes), 1, models, 0);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    // Knuth's product of uniforms: the arrivals of a 250 ms step.
    let mut poisson = |mean: f64| {
        let (limit, mut product, mut n) = ((-mean).exp(), rng.random::<f64>(), 0u64);
        while product > limit {
            product *= rng.random::<f64>();
            n += 1;
        }
        n
    };
    // Per model: arrivals, completions, busy ms, waiting.
    let mut counters = [(0u64, 0u64, 0u64, 0u64); 3];
    let mut creates = 0;
    for t in (1..=3_600u64).map(|i| i * 250) {
        for (i, name) in names.iter().enumerate() {
            let hot = c.cluster().count_of(&key(name), Level::Hot) as u32;
            let (arrivals, completions, busy_ms, waiting) = &mut counters[i];
            let n = if i == 2 && t < 30_000 { 0 } else { poisson(rates[i] * 0.25) };
            *arrivals += n;
            *waiting += n;
            if hot > 0 {
                // A replica serves 20 requests a second: nothing queues.
                (*completions, *busy_ms, *waiting) = (*completions + *waiting, *busy_ms + *waiting * 200, 0);
            }
            // Requests that waited past their timeout leave the line.
            *waiting = (*waiting).min(50);
            let obs = Observation {
                arrivals: *arrivals,
                completions: *completions,
                busy_ms: *busy_ms,
                waiting: *waiting as u32,
                permits_per_replica: 4,
                replicas: ReplicaCounts { ready: hot, ..ReplicaCounts::default() },
                ..Observation::default()
            };
            c.observe(t, &key(name), obs, &[]);
        }
        while c.poll_timeout() <= t {
            c.handle_timeout(t);
        }
        let actions = drain(&mut c);
        creates += steps(&actions, Step::Create) + steps(&actions, Step::FromCache);
    }
    let hot: Vec<usize> = names.iter().map(|n| c.cluster().count_of(&key(n), Level::Hot)).collect();
    prop_assert_eq!(&hot, &vec![0, 1, 1], "rates {:?}", rates);
    prop_assert!(creates <= 3, "{} starts: the GPUs were traded back and forth (rates {:?})", creates, rates);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]
    #[test]
    fn a_gpu_goes_to_the_model_whose_traffic_is_surely_more(
        seed in any::<u64>(),
        low in 0.1f64..0.5,
        mid in 1.5f64..2.5,
        high in 3.0f64..5.0,
    ) {
        gpus_go_to_the_busier_models(seed, [low, mid, high])?;
    }
}
