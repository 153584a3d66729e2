//! The `hangar` policy on noisy traffic: Poisson arrivals around a
//! constant rate, each request holding a permit for an exponential time,
//! queued FIFO for the permits of the replicas that are ready — a small
//! M/M/c queue the scaler drives, stepped every 250 ms. Constant loads
//! (tests/properties.rs) cannot show flapping; this can.

use hangar_core::{mix64, Millis};
use hangar_scaler::{Bounds, HangarSettings, Observation, ReplicaCounts, Scaler, ScalingConfig, StartTier};
use proptest::prelude::*;

const STEP_MS: Millis = 250;

/// The queue around one scaler.
struct Queue {
    scaler: Scaler,
    now: Millis,
    rng: u64,
    /// Arrivals per second, mean permit time, permits per replica.
    rate: f64,
    service_ms: f64,
    permits: u32,
    start_ms: Millis,
    /// When each replica wanted is (or was) ready, in order.
    up: Vec<Millis>,
    /// Arrival times of the requests waiting, FIFO.
    waiting: std::collections::VecDeque<Millis>,
    /// Finish times (and permit time) of the requests running.
    running: Vec<(Millis, u64)>,
    arrivals: u64,
    completions: u64,
    busy_ms: u64,
    /// The last 200 waits for a permit, ms (TTFT = wait + 200 ms).
    waits: std::collections::VecDeque<Millis>,
}

impl Queue {
    fn new(seed: u64, rate: f64, service_ms: f64, permits: u32, start_ms: Millis, min: u32) -> Queue {
        let config = ScalingConfig::Hangar(HangarSettings::default());
        let scaler = Scaler::new(&config, Bounds { min, max: 64 }, 0).with_objective(Some(2_000));
        let up = vec![0; scaler.desired() as usize];
        Queue {
            scaler,
            now: 0,
            rng: seed,
            rate,
            service_ms,
            permits,
            start_ms,
            up,
            waiting: Default::default(),
            running: Vec::new(),
            arrivals: 0,
            completions: 0,
            busy_ms: 0,
            waits: Default::default(),
        }
    }

    /// A uniform draw in (0, 1).
    fn uniform(&mut self) -> f64 {
        self.rng = mix64(self.rng, 0x9e37_79b9);
        ((self.rng >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// A Poisson draw of mean `mean` (Knuth's product of uniforms; means
    /// here are a few at most).
    fn poisson(&mut self, mean: f64) -> u32 {
        let (limit, mut product, mut n) = ((-mean).exp(), self.uniform(), 0);
        while product > limit {
            product *= self.uniform();
            n += 1;
        }
        n
    }

    fn ready(&self) -> u32 {
        self.up.iter().filter(|t| **t <= self.now).count() as u32
    }

    /// 250 ms of traffic, then an observation and whatever decision is due;
    /// returns the count wanted.
    fn step(&mut self) -> u32 {
        let before = self.now;
        self.now += STEP_MS;
        for _ in self.up.iter().filter(|t| **t > before && **t <= self.now) {
            self.scaler.handle_start(StartTier::Cold, self.start_ms);
        }
        for _ in 0..self.poisson(self.rate * STEP_MS as f64 / 1e3) {
            self.arrivals += 1;
            self.waiting.push_back(self.now);
        }
        let now = self.now;
        let (done, running): (Vec<_>, Vec<_>) = self.running.drain(..).partition(|(end, _)| *end <= now);
        self.running = running;
        for (_, held) in done {
            self.completions += 1;
            self.busy_ms += held;
        }
        let capacity = (self.ready() * self.permits) as usize;
        while self.running.len() < capacity {
            let Some(arrived) = self.waiting.pop_front() else { break };
            let held = (-self.uniform().ln() * self.service_ms).max(1.0) as u64;
            self.running.push((now + held, held));
            self.waits.push_back(now - arrived);
            if self.waits.len() > 200 {
                self.waits.pop_front();
            }
        }
        let mut waits: Vec<Millis> = self.waits.iter().copied().collect();
        waits.sort_unstable();
        let ttft_p99_ms = waits.get(waits.len() * 99 / 100).map(|w| w + 200);
        let ready = self.ready();
        let obs = Observation {
            waiting: self.waiting.len() as u32,
            in_flight: self.running.len() as u32,
            permits_per_replica: self.permits,
            replicas: ReplicaCounts {
                ready,
                starting: self.up.len() as u32 - ready,
                ..ReplicaCounts::default()
            },
            arrivals: self.arrivals,
            completions: self.completions,
            rejected: 0,
            busy_ms: self.busy_ms,
            ttft_p99_ms,
        };
        self.scaler.observe(now, obs);
        while self.scaler.poll_timeout() <= now {
            self.scaler.handle_timeout(now);
        }
        let desired = self.scaler.desired() as usize;
        while self.up.len() < desired {
            self.up.push(now + self.start_ms);
        }
        self.up.truncate(desired);
        desired as u32
    }
}

/// Reversals in a series of counts.
fn reversals(counts: &[u32]) -> usize {
    let moves: Vec<i64> =
        counts.windows(2).map(|w| i64::from(w[1]) - i64::from(w[0])).filter(|d| *d != 0).collect();
    moves.windows(2).filter(|w| w[0].signum() != w[1].signum()).count()
}

/// Reversals after the first ten minutes of 40 of steady traffic.
fn late_reversals(q: &mut Queue) -> (usize, Vec<String>) {
    let counts: Vec<u32> = (0..40 * 60 * 1_000 / STEP_MS).map(|_| q.step()).collect();
    let late = &counts[(10 * 60 * 1_000 / STEP_MS) as usize..];
    let decisions = q.scaler.decisions().iter().filter(|d| d.at >= 600_000);
    (
        reversals(late),
        decisions.map(|d| format!("{}s {}→{} {}", d.at / 1000, d.previous, d.desired, d.reason)).collect(),
    )
}

/// A case the property test once drew: 29.8 requests a second of 2.4 s
/// each on replicas of 2 permits (about 36 replicas). Its mean permit time,
/// measured 4 % low on one decision and high on another, read as demand
/// falling beyond its noise and released a missed objective's floor: four
/// reversals in 30 minutes, until the permit time's own noise was counted.
#[test]
fn a_permit_time_measured_low_is_no_change_of_demand() {
    let mut q = Queue::new(10351964228856393927, 29.847729722210627, 2370.759549111183, 2, 10501, 1);
    let (reversals, decisions) = late_reversals(&mut q);
    assert!(reversals <= 3, "{reversals} reversals in 30 minutes: {decisions:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    /// Steady Poisson traffic, any rate, any request length, any start
    /// time: after the first ten minutes, at most one reversal per ten
    /// minutes (docs/scaling.md).
    #[test]
    fn steady_poisson_traffic_reverses_at_most_once_per_ten_minutes(
        seed in any::<u64>(), rate in 0.5f64..30.0, service_ms in 300f64..8_000.0,
        permits in 1u32..32, start_ms in 500u64..60_000,
    ) {
        let mut q = Queue::new(seed, rate, service_ms, permits, start_ms, 1);
        let (reversals, decisions) = late_reversals(&mut q);
        prop_assert!(
            reversals <= 3,
            "{reversals} reversals in 30 minutes at {rate:.2}/s × {service_ms:.0} ms on {permits} permits: {decisions:?}"
        );
    }

    /// A slow load under traffic one replica serves (issue 28's case: up
    /// to 1.5 requests a second): the queue that piles up while it loads
    /// calls for at most one replica more, before and after it is ready.
    #[test]
    fn a_queue_piled_up_during_a_slow_load_is_no_runaway(
        seed in any::<u64>(), rate in 0.2f64..1.5, service_ms in 200f64..3_000.0,
        start_ms in 30_000u64..200_000,
    ) {
        let permits = 16;
        // One replica's worth of traffic at most: up to 80 % of its permits.
        let rate = rate.min(0.8 * f64::from(permits) * 1e3 / service_ms);
        let mut q = Queue::new(seed, rate, service_ms, permits, start_ms, 0);
        let most = (0..(start_ms + 300_000) / STEP_MS).map(|_| q.step()).max().unwrap();
        prop_assert!(
            most <= 2,
            "wanted {most} for {rate:.2}/s × {service_ms:.0} ms on {permits} permits, loading {start_ms} ms: {:?}",
            q.scaler.decisions().iter().map(|d| format!("{}s {}→{} {}", d.at / 1000, d.previous, d.desired, d.reason)).collect::<Vec<_>>()
        );
    }
}
