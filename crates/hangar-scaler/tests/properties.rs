//! Property tests for every policy: the rules the issue names.
//!
//! - never outside [min, max], also when they change while it serves;
//! - no reversal (up then down, or down then up) under constant load;
//! - from zero within one decision of a waiting request;
//! - more load never yields fewer replicas.
//!
//! Load is modelled as a driver would observe it: `load` requests in the
//! model at once, as many running as the ready replicas' permits allow,
//! the rest waiting; busy time, arrivals and completions accumulate at
//! the rate that load implies; replicas become ready `start_ms` after
//! they are wanted, and the scaler is told how long they took; TTFT is
//! above the model's 2 s objective while requests wait and well under it
//! otherwise.

use hangar_core::Millis;
use hangar_scaler::{
    Bounds, HangarSettings, Observation, ReplicaCounts, ReplicateSettings, Scaler, ScalingConfig, StartTier,
    WorkersAiAlgorithm, WorkersAiSettings,
};
use proptest::prelude::*;

/// Every policy, with windows short enough for a test to cross them.
fn policies() -> Vec<ScalingConfig> {
    vec![
        ScalingConfig::Replicate(ReplicateSettings {
            scale_out_window_s: 3,
            scale_in_window_s: 10,
            scale_out_period_s: 5,
            scale_to_zero_delay_s: 20,
            ..ReplicateSettings::default()
        }),
        ScalingConfig::WorkersAi(WorkersAiSettings {
            interval_s: 5,
            window_s: 15,
            ..WorkersAiSettings::default()
        }),
        // Workers AI's older algorithms, the forecast looking 30 s back.
        ScalingConfig::WorkersAi(WorkersAiSettings {
            interval_s: 5,
            window_s: 15,
            algorithm: WorkersAiAlgorithm::Utilization,
            forecast_offset_s: 30,
            ..WorkersAiSettings::default()
        }),
        ScalingConfig::WorkersAi(WorkersAiSettings {
            interval_s: 5,
            window_s: 15,
            algorithm: WorkersAiAlgorithm::RequestCount,
            ..WorkersAiSettings::default()
        }),
        ScalingConfig::Hangar(HangarSettings { scale_down_after_s: 20, ..HangarSettings::default() }),
        ScalingConfig::Fixed,
    ]
}

fn policy() -> impl Strategy<Value = ScalingConfig> {
    prop::sample::select(policies())
}

fn bounds() -> impl Strategy<Value = Bounds> {
    (0u32..4, 1u32..12).prop_map(|(min, extra)| Bounds { min, max: min + extra })
}

/// A simulated model around one scaler, stepped once a second.
struct Model {
    scaler: Scaler,
    now: Millis,
    permits: u32,
    /// (time it becomes ready) of each replica up, in order.
    up: Vec<Millis>,
    start_ms: Millis,
    counters: (u64, u64, u64),
}

impl Model {
    fn new(config: &ScalingConfig, bounds: Bounds, permits: u32, start_ms: Millis) -> Self {
        let scaler = Scaler::new(config, bounds, 0).with_objective(Some(2_000));
        let up = vec![0; scaler.desired() as usize];
        Model { scaler, now: 0, permits, up, start_ms, counters: (0, 0, 0) }
    }

    fn observation(&self, load: u32) -> Observation {
        let ready = self.up.iter().filter(|t| **t <= self.now).count() as u32;
        let starting = self.up.len() as u32 - ready;
        let in_flight = load.min(ready * self.permits);
        Observation {
            waiting: load - in_flight,
            in_flight,
            permits_per_replica: self.permits,
            replicas: ReplicaCounts { starting, ready, ..ReplicaCounts::default() },
            arrivals: self.counters.0,
            completions: self.counters.1,
            rejected: 0,
            busy_ms: self.counters.2,
            ttft_p99_ms: Some(if load > in_flight { 5_000 } else { 300 }),
        }
    }

    /// One second at `load`: observe, decide, follow the decision.
    fn step(&mut self, load: u32) -> u32 {
        let before = self.now;
        self.now += 1_000;
        for _ in self.up.iter().filter(|t| **t > before && **t <= self.now) {
            self.scaler.handle_start(StartTier::Cold, self.start_ms);
        }
        let obs = self.observation(load);
        // A second of `load`: each running request holds its permit all second.
        self.counters.0 += u64::from(load);
        self.counters.1 += u64::from(obs.in_flight);
        self.counters.2 += u64::from(obs.in_flight) * 1_000;
        let obs = Observation {
            arrivals: self.counters.0,
            completions: self.counters.1,
            busy_ms: self.counters.2,
            ..obs
        };
        self.scaler.observe(self.now, obs);
        while self.scaler.poll_timeout() <= self.now {
            self.scaler.handle_timeout(self.now);
        }
        let desired = self.scaler.desired() as usize;
        while self.up.len() < desired {
            self.up.push(self.now + self.start_ms);
        }
        self.up.truncate(desired);
        desired as u32
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn never_outside_the_bounds(
        config in policy(), bounds in bounds(), permits in 1u32..16,
        loads in prop::collection::vec(0u32..200, 1..240),
    ) {
        let mut m = Model::new(&config, bounds, permits, 3_000);
        for load in loads {
            let d = m.step(load);
            prop_assert!((bounds.min..=bounds.max).contains(&d), "{} wants {d} outside {bounds:?}", config.name());
        }
    }

    /// Bounds changed while the model serves (a deployment's updates), at
    /// random moments under random load, with or without an operator's
    /// pin: from each change on, every count is within the new bounds.
    #[test]
    fn never_outside_bounds_that_change(
        config in policy(), first in bounds(), permits in 1u32..16, pin in prop::option::of(0u32..16),
        steps in prop::collection::vec((0u32..200, prop::option::weighted(0.05, bounds())), 1..240),
    ) {
        let mut m = Model::new(&config, first, permits, 3_000);
        if let Some(n) = pin {
            m.scaler.pin(0, n);
        }
        let mut current = first;
        for (load, change) in steps {
            if let Some(b) = change {
                m.scaler.set_bounds(m.now, b);
                current = b;
                let d = m.scaler.desired();
                prop_assert!((b.min..=b.max).contains(&d), "{} wants {d} at once outside {b:?}", config.name());
            }
            let d = m.step(load);
            prop_assert!((current.min..=current.max).contains(&d), "{} wants {d} outside {current:?}", config.name());
        }
    }

    /// After the ramp (replicas loading, windows filling), a constant load
    /// moves the count in one direction at most.
    #[test]
    fn no_reversal_under_constant_load(
        config in policy(), bounds in bounds(), permits in 1u32..16, load in 0u32..120,
        start_ms in 0u64..10_000,
    ) {
        let mut m = Model::new(&config, bounds, permits, start_ms);
        let counts: Vec<u32> = (0..600).map(|_| m.step(load)).collect();
        let moves: Vec<i64> = counts
            .windows(2)
            .map(|w| i64::from(w[1]) - i64::from(w[0]))
            .filter(|d| *d != 0)
            .collect();
        let reversal = moves.windows(2).any(|w| w[0].signum() != w[1].signum());
        prop_assert!(!reversal, "{} reversed under a constant load of {load}: {counts:?}", config.name());
    }

    #[test]
    fn from_zero_within_one_decision_of_a_waiting_request(
        config in policy(), max in 1u32..8, permits in 1u32..16, quiet in 0u32..400,
    ) {
        // min 0, quiet long enough to reach zero (or not), then one request.
        let mut m = Model::new(&config, Bounds { min: 0, max }, permits, 1_000);
        for _ in 0..quiet {
            m.step(0);
        }
        if m.scaler.desired() == 0 {
            m.now += 1_000;
            let obs = m.observation(1);
            m.scaler.observe(m.now, obs);
            prop_assert_eq!(m.scaler.poll_timeout(), m.now, "the decision is due at once");
            m.scaler.handle_timeout(m.now);
            let fixed = matches!(config, ScalingConfig::Fixed);
            prop_assert!(fixed || m.scaler.desired() >= 1, "{} stays at zero with a waiting request", config.name());
        }
    }

    /// Two models with the same history: the one that then sees more load
    /// wants at least as many replicas.
    #[test]
    fn more_load_never_yields_fewer_replicas(
        config in policy(), bounds in bounds(), permits in 1u32..16,
        loads in prop::collection::vec(0u32..100, 1..200), low in 0u32..100, extra in 1u32..100,
    ) {
        let mut m = Model::new(&config, bounds, permits, 2_000);
        for load in loads {
            m.step(load);
        }
        let mut a = Model { scaler: m.scaler.clone(), up: m.up.clone(), ..m };
        let mut b = Model { scaler: a.scaler.clone(), up: a.up.clone(), counters: a.counters, ..a };
        let (da, db) = (a.step(low), b.step(low + extra));
        prop_assert!(db >= da, "{}: load {} → {da}, load {} → {db}", config.name(), low, low + extra);
    }
}

#[test]
fn the_decision_log_keeps_the_last_120_with_reasons() {
    let config = ScalingConfig::Hangar(HangarSettings { scale_down_after_s: 1, ..HangarSettings::default() });
    let mut m = Model::new(&config, Bounds { min: 0, max: 50 }, 1, 0);
    // A surge of 40 requests for 2 s every 40 s.
    for i in 0..3_000 {
        m.step(if i % 40 < 2 { 40 } else { 0 });
    }
    let log = m.scaler.decisions();
    assert_eq!(log.iter().len(), hangar_scaler::DECISIONS_KEPT);
    assert!(log.iter().zip(log.iter().skip(1)).all(|(a, b)| a.at <= b.at && a.desired == b.previous));
    assert!(log.iter().any(|d| d.reason.to_string().contains("quiet period over")));
}
