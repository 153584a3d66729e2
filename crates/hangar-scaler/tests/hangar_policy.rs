//! The `hangar` policy's own rules: a quiet period sized by the measured
//! restart, and the TTFT objective.

use hangar_core::Millis;
use hangar_scaler::{Bounds, HangarSettings, Observation, ReplicaCounts, Scaler, ScalingConfig, StartTier};

fn scaler(slo_ttft_ms: Option<Millis>) -> Scaler {
    let config = ScalingConfig::Hangar(HangarSettings::default());
    Scaler::new(&config, Bounds { min: 0, max: 8 }, 0).with_objective(slo_ttft_ms)
}

/// `work` requests on `ready` replicas of 4 permits each.
fn load(work: u32, ready: u32, starting: u32, ttft_p99_ms: Option<Millis>) -> Observation {
    let in_flight = work.min(ready * 4);
    Observation {
        waiting: work - in_flight,
        in_flight,
        permits_per_replica: 4,
        replicas: ReplicaCounts { ready, starting, ..ReplicaCounts::default() },
        ttft_p99_ms,
        ..Observation::default()
    }
}

/// Observes `obs` at `now` and takes every decision due.
fn at(s: &mut Scaler, now: Millis, obs: Observation) -> u32 {
    s.observe(now, obs);
    while s.poll_timeout() <= now {
        s.handle_timeout(now);
    }
    s.desired()
}

/// Seconds from the end of a burst to the first replica given back.
fn seconds_to_give_back(s: &mut Scaler) -> u64 {
    assert_eq!(at(s, 1_000, load(12, 0, 0, None)), 3);
    for t in 2..=1_000 {
        if at(s, t * 1_000, load(4, 3, 0, None)) < 3 {
            return t - 2;
        }
    }
    panic!("never gave a replica back");
}

#[test]
fn the_quiet_period_is_the_longest_until_a_restart_is_measured() {
    assert_eq!(seconds_to_give_back(&mut scaler(None)), 300);
}

#[test]
fn a_fast_restart_shortens_the_quiet_period_to_a_multiple_of_it() {
    // WARM wakes of 4 s: idle replicas go after 2 × 4 s.
    let mut s = scaler(None);
    for _ in 0..3 {
        s.handle_start(StartTier::Warm, 4_000);
    }
    assert_eq!(seconds_to_give_back(&mut s), 8);
    // Sub-second wakes: never below the 5 s floor.
    let mut s = scaler(None);
    s.handle_start(StartTier::Warm, 300);
    assert_eq!(seconds_to_give_back(&mut s), 5);
    // A minute-long COLD load among them: the weighted mean decides.
    let mut s = scaler(None);
    s.handle_start(StartTier::Warm, 4_000);
    s.handle_start(StartTier::Cold, 60_000);
    assert_eq!(seconds_to_give_back(&mut s), 64);
}

#[test]
fn a_missed_objective_adds_one_replica_at_a_time_while_requests_wait() {
    let mut s = scaler(Some(2_000));
    assert_eq!(at(&mut s, 1_000, load(8, 0, 0, None)), 2);
    // Demand fits two replicas, but requests wait and TTFT misses: one more.
    let waiting = Observation { waiting: 1, ..load(7, 2, 0, Some(3_500)) };
    assert_eq!(at(&mut s, 2_000, waiting), 3);
    let why = s.decisions().last().unwrap().reason.to_string();
    assert!(why.contains("3500 ms above the 2000 ms objective"), "{why}");
    // Not another while that one loads…
    assert_eq!(at(&mut s, 3_000, Observation { waiting: 1, ..load(7, 2, 1, Some(3_500)) }), 3);
    // …and not with nobody waiting: a slow prompt is not a want of replicas.
    assert_eq!(at(&mut s, 4_000, load(8, 3, 0, Some(3_500))), 3);
    // Once it is up and requests still wait, the next.
    assert_eq!(at(&mut s, 5_000, Observation { waiting: 1, ..load(7, 3, 0, Some(3_500)) }), 4);
}

#[test]
fn nothing_is_given_back_while_the_objective_is_missed() {
    let mut s = scaler(Some(2_000));
    s.handle_start(StartTier::Warm, 300);
    assert_eq!(at(&mut s, 1_000, load(12, 0, 0, None)), 3);
    for t in 2..100 {
        assert_eq!(at(&mut s, t * 1_000, load(4, 3, 0, Some(2_500))), 3, "at {t} s");
    }
    // Back under the objective: the quiet period runs, then one goes.
    let gone = (100..200).find(|t| at(&mut s, t * 1_000, load(4, 3, 0, Some(900))) < 3);
    assert_eq!(gone, Some(105));
}

/// A model whose replicas wake in 20 s (a quiet period of 40 s) under
/// demand that surges for a second every 60 s — 40 arrivals at once
/// against 2 a second otherwise, three replicas' worth of work against
/// two — takes a replica straight back after each give-back: the quiet
/// period doubles until it outlasts the gaps, so the count stops flapping;
/// with damping off it flaps all along.
#[test]
fn flap_damping_stops_giving_back_what_noisy_demand_takes_back() {
    let reversals = |flap_damping: u32| {
        let settings = HangarSettings { flap_damping, ..HangarSettings::default() };
        let mut s = Scaler::new(&ScalingConfig::Hangar(settings), Bounds { min: 0, max: 8 }, 0);
        s.handle_start(StartTier::Warm, 20_000);
        let (mut late, mut arrivals) = (0, 0);
        for t in 1..=600u64 {
            let surge = t % 60 == 0;
            let work = if surge { 12 } else { 8 };
            arrivals += if surge { 40 } else { 2 };
            let before = s.reversals();
            let ready = s.desired();
            at(&mut s, t * 1_000, Observation { arrivals, ..load(work, ready, 0, None) });
            if t > 300 {
                late += s.reversals() - before;
            }
        }
        (s.reversals(), late)
    };
    let (off, off_late) = reversals(0);
    let (on, on_late) = reversals(3);
    assert!(off_late >= 8, "without damping it keeps flapping: {off} reversals, {off_late} late");
    assert_eq!(on_late, 0, "damped, the second five minutes hold steady ({on} reversals in all)");
    assert!(on < off / 4, "{on} vs {off}");
}
