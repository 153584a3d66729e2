//! The instance monitor: what each replica is doing, accounted in windows
//! of [`WINDOW_MS`] (seed 001's Director reports the same every 15 s).
//!
//! A replica is in one [`InstanceState`] at a time:
//!
//! | state | when |
//! |---|---|
//! | `boot` | its engine is starting (or waking) and holds no request |
//! | `idle` | its engine serves, and no request is in flight on it |
//! | `active` | at least one request is in flight on it |
//! | `off` | no engine is serving or starting: asleep in the warm cache, stopping, failed, or waiting for room (not in the seed, which has no warm cache: it keeps a window's four times adding up to its length) |
//!
//! An [`InstanceMonitor`] is fed the replica's phase
//! ([`InstanceMonitor::handle_phase`]) and the requests it holds
//! ([`InstanceMonitor::request_started`] / [`request_ended`], exact, on
//! the path that grants and gives back permits; or
//! [`InstanceMonitor::set_in_flight`], sampled, where only the engine's
//! own gauges say it), and at the end of each window closes a
//! [`InstanceWindow`]: the milliseconds spent in each state, the
//! *utilization* (active time / window length, 0 to 1) and the *mean
//! concurrency* (requests in flight, weighted by how long each count
//! lasted).
//!
//! It is sans-IO: every call carries `now` (milliseconds on the caller's
//! clock), it never reads a clock itself, and windows close on the first
//! call at or after their end (or [`InstanceMonitor::handle_timeout`],
//! whose deadline [`InstanceMonitor::poll_timeout`] gives); a call with an
//! earlier `now` than the last is taken as the last. Each call is a few
//! additions: no allocation, whatever the traffic.
//!
//! [`request_ended`]: InstanceMonitor::request_ended
//!
//! ```
//! use hangar_core::instance::{InstanceMonitor, InstanceState, WINDOW_MS};
//! use hangar_core::ReplicaPhase;
//!
//! let mut m = InstanceMonitor::new(0);
//! m.handle_phase(0, ReplicaPhase::Starting);
//! m.handle_phase(3_000, ReplicaPhase::Ready); // booted for 3 s
//! m.request_started(5_000);
//! m.request_started(6_000);
//! m.request_ended(9_000);
//! m.request_ended(12_000); // active from 5 s to 12 s, two in flight from 6 s to 9 s
//! assert_eq!(m.state(), InstanceState::Idle);
//! m.handle_timeout(WINDOW_MS);
//! let w = m.last_window().unwrap();
//! assert_eq!((w.boot_ms, w.idle_ms, w.active_ms, w.off_ms), (3_000, 5_000, 7_000, 0));
//! assert!((w.utilization - 7.0 / 15.0).abs() < 1e-9);
//! assert!((w.mean_concurrency - 10.0 / 15.0).abs() < 1e-9);
//! ```

use serde::{Deserialize, Serialize};

use crate::{Millis, ReplicaPhase};

/// The length of a window, ms: seed 001's `DefaultUtilizationInterval`.
pub const WINDOW_MS: Millis = 15_000;

/// What a replica is doing (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InstanceState {
    /// Starting (or waking), no request yet.
    Boot,
    /// Serving, no request in flight.
    Idle,
    /// At least one request in flight.
    Active,
    /// No engine serving or starting.
    Off,
}

impl InstanceState {
    /// Every state, in order.
    pub const ALL: [Self; 4] = [Self::Boot, Self::Idle, Self::Active, Self::Off];

    /// Its name in reports and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Boot => "boot",
            Self::Idle => "idle",
            Self::Active => "active",
            Self::Off => "off",
        }
    }
}

/// One closed window of a replica's activity.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct InstanceWindow {
    /// Its length, ms (seed 001's `metric_duration`).
    pub window_ms: Millis,
    /// Time starting, ms.
    pub boot_ms: Millis,
    /// Time serving with nothing in flight, ms.
    pub idle_ms: Millis,
    /// Time with at least one request in flight, ms.
    pub active_ms: Millis,
    /// Time with no engine serving or starting, ms.
    pub off_ms: Millis,
    /// `active_ms / window_ms`, 0 to 1.
    pub utilization: f64,
    /// Requests in flight, averaged over the window weighted by time (at
    /// least `utilization`, since an active replica holds one or more).
    pub mean_concurrency: f64,
}

/// What a replica is doing now, and its last closed window: what
/// `/admin/status` shows of each replica and a fleet's agent reports.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct InstanceReport {
    /// Its state now.
    pub state: InstanceState,
    /// Requests in flight on it now.
    pub in_flight: u32,
    /// The last window closed (none during the first [`WINDOW_MS`]).
    #[serde(flatten, default, skip_serializing_if = "Option::is_none")]
    pub window: Option<InstanceWindow>,
}

/// Whether the replica has an engine starting, serving, or neither.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Boot,
    Serving,
    Off,
}

impl Mode {
    fn of(phase: ReplicaPhase) -> Mode {
        match phase {
            ReplicaPhase::Starting | ReplicaPhase::Waking => Mode::Boot,
            ReplicaPhase::Ready | ReplicaPhase::Draining => Mode::Serving,
            ReplicaPhase::Pending
            | ReplicaPhase::Sleeping
            | ReplicaPhase::Stopping
            | ReplicaPhase::Failed
            | ReplicaPhase::Cold => Mode::Off,
        }
    }
}

/// Times accumulated in the window under way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Times {
    boot: Millis,
    idle: Millis,
    active: Millis,
    off: Millis,
    /// Σ in flight × ms.
    busy: u128,
}

/// One replica's instance monitor (see the module docs).
#[derive(Debug, Clone)]
pub struct InstanceMonitor {
    window_ms: Millis,
    /// Start of the window under way.
    start: Millis,
    /// Up to when the window's times are accounted.
    since: Millis,
    mode: Mode,
    in_flight: u32,
    times: Times,
    last: Option<InstanceWindow>,
}

impl InstanceMonitor {
    /// A monitor whose first window starts at `now`, the replica `off`
    /// until told its phase.
    pub fn new(now: Millis) -> Self {
        Self::with_window(now, WINDOW_MS)
    }

    /// [`new`](Self::new) with windows of `window_ms` (at least 1).
    pub fn with_window(now: Millis, window_ms: Millis) -> Self {
        InstanceMonitor {
            window_ms: window_ms.max(1),
            start: now,
            since: now,
            mode: Mode::Off,
            in_flight: 0,
            times: Times::default(),
            last: None,
        }
    }

    // ---- getters -------------------------------------------------------

    /// The state as of the last call.
    pub fn state(&self) -> InstanceState {
        match (self.in_flight, self.mode) {
            (1.., _) => InstanceState::Active,
            (0, Mode::Boot) => InstanceState::Boot,
            (0, Mode::Serving) => InstanceState::Idle,
            (0, Mode::Off) => InstanceState::Off,
        }
    }

    /// Requests in flight as of the last call.
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// The last window closed, if one has.
    pub fn last_window(&self) -> Option<&InstanceWindow> {
        self.last.as_ref()
    }

    /// The state now and the last closed window.
    pub fn report(&self) -> InstanceReport {
        InstanceReport { state: self.state(), in_flight: self.in_flight, window: self.last }
    }

    // ---- handle_* (facts) ---------------------------------------------

    /// The replica's phase changed (or is confirmed): starting and waking
    /// are `boot`, ready and draining serve, the rest are `off`.
    pub fn handle_phase(&mut self, now: Millis, phase: ReplicaPhase) {
        self.advance(now);
        self.mode = Mode::of(phase);
    }

    /// A request took a permit on the replica.
    pub fn request_started(&mut self, now: Millis) {
        self.advance(now);
        self.in_flight = self.in_flight.saturating_add(1);
    }

    /// A request gave its permit back (one that started before the
    /// monitor did is ignored: the count never goes below 0).
    pub fn request_ended(&mut self, now: Millis) {
        self.advance(now);
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// The requests in flight are `in_flight` (a sample of the engine's
    /// own count; the count is taken to have held since the last call).
    pub fn set_in_flight(&mut self, now: Millis, in_flight: u32) {
        self.advance(now);
        self.in_flight = in_flight;
    }

    /// Closes every window that ended at or before `now`. Calling it
    /// early or twice does nothing.
    pub fn handle_timeout(&mut self, now: Millis) {
        self.advance(now);
    }

    // ---- poll_* (outputs) ---------------------------------------------

    /// When the window under way ends.
    pub fn poll_timeout(&self) -> Millis {
        self.start + self.window_ms
    }

    // ---- internals ----------------------------------------------------

    /// Accounts the time from `since` to `now` in the state that held,
    /// closing windows on the way.
    fn advance(&mut self, now: Millis) {
        let now = now.max(self.since);
        let end = self.start + self.window_ms;
        if now < end {
            self.accrue(now);
            return;
        }
        self.accrue(end);
        self.close();
        // Every further window that ended before `now` held one state
        // throughout: account the latest of them whole.
        let skipped = (now - end) / self.window_ms;
        if skipped > 0 {
            self.start = end + (skipped - 1) * self.window_ms;
            self.since = self.start;
            self.accrue(self.start + self.window_ms);
            self.close();
        }
        self.accrue(now);
    }

    fn accrue(&mut self, to: Millis) {
        let dt = to - self.since;
        let state = self.state();
        let t = &mut self.times;
        match state {
            InstanceState::Boot => t.boot += dt,
            InstanceState::Idle => t.idle += dt,
            InstanceState::Active => t.active += dt,
            InstanceState::Off => t.off += dt,
        }
        t.busy += u128::from(self.in_flight) * u128::from(dt);
        self.since = to;
    }

    /// Ends the window under way at `since` (its end) and starts the next.
    fn close(&mut self) {
        let t = std::mem::take(&mut self.times);
        let length = self.window_ms as f64;
        self.last = Some(InstanceWindow {
            window_ms: self.window_ms,
            boot_ms: t.boot,
            idle_ms: t.idle,
            active_ms: t.active,
            off_ms: t.off,
            utilization: t.active as f64 / length,
            mean_concurrency: t.busy as f64 / length,
        });
        self.start = self.since;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_window_accounts_boot_idle_active_and_off() {
        let mut m = InstanceMonitor::with_window(1_000, 10_000);
        m.handle_phase(1_000, ReplicaPhase::Starting);
        assert_eq!(m.state(), InstanceState::Boot);
        m.handle_phase(3_000, ReplicaPhase::Ready);
        m.request_started(4_000);
        m.request_started(4_500);
        m.request_ended(5_000);
        m.request_ended(6_000);
        m.handle_phase(8_000, ReplicaPhase::Sleeping);
        assert_eq!(m.state(), InstanceState::Off);
        assert!(m.last_window().is_none(), "nothing closed before the window's end");
        assert_eq!(m.poll_timeout(), 11_000);
        m.handle_timeout(10_999);
        assert!(m.last_window().is_none(), "an early timeout does nothing");
        m.handle_timeout(11_000);
        let w = *m.last_window().unwrap();
        assert_eq!((w.boot_ms, w.idle_ms, w.active_ms, w.off_ms), (2_000, 3_000, 2_000, 3_000));
        assert_eq!(w.utilization, 0.2);
        // 1 in flight for 1.5 s, 2 for 0.5 s.
        assert_eq!(w.mean_concurrency, 0.25);
        m.handle_timeout(11_000);
        assert_eq!(m.last_window(), Some(&w), "a repeated timeout does nothing");
        assert_eq!(m.poll_timeout(), 21_000);
    }

    #[test]
    fn a_long_silence_closes_the_latest_window_in_the_state_that_held() {
        let mut m = InstanceMonitor::with_window(0, 1_000);
        m.handle_phase(0, ReplicaPhase::Ready);
        m.request_started(500);
        // Nobody calls for ten windows: the request ran throughout.
        m.handle_timeout(10_250);
        let w = *m.last_window().unwrap();
        assert_eq!((w.active_ms, w.idle_ms, w.utilization, w.mean_concurrency), (1_000, 0, 1.0, 1.0));
        assert_eq!(m.poll_timeout(), 11_000);
        m.request_ended(10_500);
        m.handle_timeout(11_000);
        let w = *m.last_window().unwrap();
        assert_eq!((w.active_ms, w.idle_ms), (500, 500));
    }

    #[test]
    fn time_never_runs_backwards_and_counts_never_go_below_zero() {
        let mut m = InstanceMonitor::with_window(0, 1_000);
        m.handle_phase(0, ReplicaPhase::Ready);
        m.request_ended(100); // began before the monitor knew it
        m.request_started(600);
        m.request_ended(400); // an earlier clock reading: taken as 600
        m.handle_timeout(1_000);
        let w = m.last_window().unwrap();
        assert_eq!((w.idle_ms, w.active_ms), (1_000, 0));
    }

    #[test]
    fn sampled_counts_hold_until_the_next_sample() {
        let mut m = InstanceMonitor::with_window(0, 1_000);
        m.handle_phase(0, ReplicaPhase::Ready);
        m.set_in_flight(250, 3);
        m.set_in_flight(500, 0);
        m.handle_timeout(1_000);
        let w = m.last_window().unwrap();
        assert_eq!((w.active_ms, w.mean_concurrency), (250, 0.75));
    }

    #[test]
    fn the_report_is_flat_json_with_the_window_once_there_is_one() {
        let mut m = InstanceMonitor::with_window(0, 1_000);
        m.handle_phase(0, ReplicaPhase::Ready);
        let early = serde_json::to_value(m.report()).unwrap();
        assert_eq!(early, serde_json::json!({"state": "idle", "in_flight": 0}));
        assert_eq!(serde_json::from_value::<InstanceReport>(early).unwrap(), m.report(), "no window yet");
        m.request_started(500);
        m.handle_timeout(1_000);
        let v = serde_json::to_value(m.report()).unwrap();
        assert_eq!(v["state"], "active");
        assert_eq!(v["utilization"], 0.5);
        assert_eq!(v["window_ms"], 1_000);
        assert_eq!(serde_json::from_value::<InstanceReport>(v).unwrap(), m.report());
    }

    /// A replica's life: boot, then Poisson arrivals with exponential
    /// service times and an unbounded number in flight, with a sleep in the
    /// middle; every event time an integer ms.
    #[derive(Debug, Clone)]
    struct Life {
        window: Millis,
        boot_until: Millis,
        /// (start, end) of each request, while serving.
        requests: Vec<(Millis, Millis)>,
        /// The replica sleeps over this span (no request in it).
        asleep: (Millis, Millis),
        horizon: Millis,
    }

    /// An exponential draw of mean `mean` from a uniform `u` in (0, 1].
    fn exponential(u: f64, mean: f64) -> Millis {
        (-mean * u.ln()).round() as Millis
    }

    fn life() -> impl Strategy<Value = Life> {
        (
            500u64..5_000,
            0u64..20_000,
            1.0f64..2_000.0,
            1.0f64..5_000.0,
            prop::collection::vec((f64::MIN_POSITIVE..=1.0, f64::MIN_POSITIVE..=1.0), 1..300),
        )
            .prop_map(|(window, boot, mean_gap, mean_service, draws)| {
                let boot_until = boot;
                let mut t = boot_until;
                let mut requests = Vec::new();
                for (gap, service) in draws {
                    t += exponential(gap, mean_gap);
                    // At least 1 ms: a request ends after it starts.
                    requests.push((t, t + exponential(service, mean_service).max(1)));
                }
                let last_end = requests.iter().map(|r| r.1).max().unwrap_or(t);
                // A sleep after every request ended, then a wake.
                let asleep = (last_end + 100, last_end + 100 + window * 2 + 37);
                Life { window, boot_until, requests, asleep, horizon: asleep.1 + window * 3 }
            })
    }

    /// Requests in flight at each millisecond of `life`, counted one
    /// request at a time.
    fn in_flight_by_ms(life: &Life) -> Vec<u64> {
        let mut diff = vec![0i64; life.horizon as usize + 1];
        for (s, e) in &life.requests {
            diff[*s as usize] += 1;
            diff[*e as usize] -= 1;
        }
        diff.iter()
            .scan(0i64, |n, d| {
                *n += d;
                Some(*n as u64)
            })
            .collect()
    }

    /// The same figures counted one millisecond at a time.
    fn brute_force(
        life: &Life,
        counts: &[u64],
        from: Millis,
        to: Millis,
    ) -> (Millis, Millis, Millis, Millis, u64) {
        let (mut boot, mut idle, mut active, mut off, mut busy) = (0, 0, 0, 0, 0u64);
        for ms in from..to {
            let in_flight = counts[ms as usize];
            busy += in_flight;
            if in_flight > 0 {
                active += 1;
            } else if ms < life.boot_until {
                boot += 1;
            } else if life.asleep.0 <= ms && ms < life.asleep.1 {
                off += 1;
            } else {
                idle += 1;
            }
        }
        (boot, idle, active, off, busy)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

        /// Fed every event in time order (ends before starts at one
        /// instant), each closed window equals the count made one
        /// millisecond at a time, and its times add up to its length.
        #[test]
        fn windows_match_a_millisecond_count_on_poisson_load(life in life()) {
            let mut events: Vec<(Millis, u8)> = Vec::new();
            for (s, e) in &life.requests {
                events.push((*s, 2));
                events.push((*e, 1));
            }
            events.push((life.boot_until, 0));
            events.push((life.asleep.0, 3));
            events.push((life.asleep.1, 4));
            events.sort_unstable();
            let mut m = InstanceMonitor::with_window(0, life.window);
            m.handle_phase(0, ReplicaPhase::Starting);
            let counts = in_flight_by_ms(&life);
            let mut closed = 0;
            let check = |m: &InstanceMonitor, closed: &mut u64| -> Result<(), TestCaseError> {
                let Some(w) = m.last_window() else { return Ok(()) };
                let end = m.poll_timeout() - life.window;
                let index = end / life.window;
                if index == *closed {
                    return Ok(());
                }
                *closed = index;
                let (boot, idle, active, off, busy) = brute_force(&life, &counts, end - life.window, end);
                prop_assert_eq!((w.boot_ms, w.idle_ms, w.active_ms, w.off_ms), (boot, idle, active, off));
                prop_assert_eq!(w.boot_ms + w.idle_ms + w.active_ms + w.off_ms, w.window_ms);
                prop_assert!((w.mean_concurrency - busy as f64 / life.window as f64).abs() < 1e-9);
                prop_assert!((0.0..=1.0).contains(&w.utilization));
                prop_assert!(w.mean_concurrency >= w.utilization - 1e-12);
                Ok(())
            };
            for (at, what) in events {
                while m.poll_timeout() <= at {
                    let due = m.poll_timeout();
                    m.handle_timeout(due);
                    check(&m, &mut closed)?;
                }
                match what {
                    0 => m.handle_phase(at, ReplicaPhase::Ready),
                    1 => m.request_ended(at),
                    2 => m.request_started(at),
                    3 => m.handle_phase(at, ReplicaPhase::Sleeping),
                    _ => m.handle_phase(at, ReplicaPhase::Waking),
                }
                check(&m, &mut closed)?;
                if what == 4 {
                    // Woken at once.
                    m.handle_phase(at, ReplicaPhase::Ready);
                }
            }
            while m.poll_timeout() <= life.horizon {
                let due = m.poll_timeout();
                m.handle_timeout(due);
                check(&m, &mut closed)?;
            }
            prop_assert_eq!(m.state(), InstanceState::Idle);
            prop_assert_eq!(m.in_flight(), 0);
        }

        /// Called only now and then (a reader, not every event), the
        /// monitor reports the same last window as one called at every
        /// window's end: skipping windows loses nothing.
        #[test]
        fn reading_late_gives_the_same_window(life in life(), late in 0u64..100_000) {
            let mut exact = InstanceMonitor::with_window(0, life.window);
            let mut lazy = InstanceMonitor::with_window(0, life.window);
            for m in [&mut exact, &mut lazy] {
                m.handle_phase(0, ReplicaPhase::Ready);
            }
            let mut events: Vec<(Millis, bool)> =
                life.requests.iter().flat_map(|(s, e)| [(*s, true), (*e, false)]).collect();
            events.sort_unstable_by_key(|(at, start)| (*at, *start));
            for (at, start) in events {
                while exact.poll_timeout() <= at {
                    let due = exact.poll_timeout();
                    exact.handle_timeout(due);
                }
                for m in [&mut exact, &mut lazy] {
                    if start { m.request_started(at) } else { m.request_ended(at) }
                }
            }
            let read = life.horizon + late;
            while exact.poll_timeout() <= read {
                let due = exact.poll_timeout();
                exact.handle_timeout(due);
            }
            lazy.handle_timeout(read);
            prop_assert_eq!(exact.last_window(), lazy.last_window());
            prop_assert_eq!(exact.poll_timeout(), lazy.poll_timeout());
        }

        /// On a long Poisson run the mean concurrency over the windows
        /// follows Little's law: arrival rate × mean service time, within
        /// the noise of the draws.
        #[test]
        fn mean_concurrency_follows_littles_law(seed in any::<u64>()) {
            // A seeded xorshift: thousands of draws, reproducible.
            let mut x = seed | 1;
            let mut uniform = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x >> 11) as f64 + 1.0) / (1u64 << 53) as f64
            };
            let (mean_gap, mean_service, window) = (100.0, 250.0, 15_000);
            let mut m = InstanceMonitor::with_window(0, window);
            m.handle_phase(0, ReplicaPhase::Ready);
            let mut events: Vec<(Millis, bool)> = Vec::new();
            let mut t = 0;
            let mut service_sum = 0;
            let mut n = 0u64;
            while t < 3_000_000 {
                t += exponential(uniform(), mean_gap);
                let s = exponential(uniform(), mean_service).max(1);
                service_sum += s;
                n += 1;
                events.push((t, true));
                events.push((t + s, false));
            }
            events.sort_unstable_by_key(|(at, start)| (*at, *start));
            let mut sum = 0.0;
            let mut windows = 0;
            for (at, start) in events {
                while m.poll_timeout() <= at {
                    let due = m.poll_timeout();
                    m.handle_timeout(due);
                    sum += m.last_window().unwrap().mean_concurrency;
                    windows += 1;
                }
                if start { m.request_started(at) } else { m.request_ended(at) }
            }
            let measured = sum / windows as f64;
            let expected = n as f64 / t as f64 * (service_sum as f64 / n as f64);
            // About 2.5 in flight; the windows' mean over 200 windows is
            // within a few percent of λ·E[S].
            prop_assert!((measured - expected).abs() / expected < 0.08, "{measured} vs {expected}");
        }
    }
}
