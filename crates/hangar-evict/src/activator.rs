//! The activator: when to measure usage, when to sweep and when to delete.
//! Sans-IO: it is fed `now` and usage readings, and what the driver did
//! with its last step; it never reads a clock or touches the disk.
//!
//! # The deletion queue and pre-fill
//!
//! Deleting takes files from the *deletion queue*: the oldest files one
//! sweep selected, least recently used first (the Python evictor's bounded
//! queue, here a sorted selection). Without pre-fill the queue is filled
//! only once usage has crossed `CLEANUP_THRESHOLD`, so the first deletion
//! waits for a whole sweep. With *pre-fill* (the seed's "crawlers pre-fill
//! the queue while deletion is OFF") the queue is filled while OFF — by a
//! sweep at start, again every `PREFILL_INTERVAL_SECONDS`, and again after
//! a deletion has left it too thin to serve a crossing — so deleting starts
//! at the first usage check after the crossing.
//!
//! A queue filled earlier never breaks least-recently-used order: a file's
//! last use only moves forward, so every file older than the newest queued
//! one is in the queue unless it was used since (the deleter re-checks each
//! file with `fstatat` and spares it). Staleness only thins the queue; when
//! it runs out before the target, a sweep finds the rest.
//!
//! # Steps
//!
//! After each input call [`Activator::poll_step`] and carry out the
//! [`Step`]; then measure usage again at [`Activator::poll_timeout`]. At
//! most one sweep is in flight: after [`Step::Prefill`] or [`Step::Sweep`]
//! the driver reports its end with [`Activator::handle_swept`], after
//! [`Step::Evict`] with [`Activator::handle_evicted`]. A pre-fill may run in
//! the background while usage is still checked; if usage crosses
//! meanwhile and the queue holds files, the step is [`Step::CancelPrefill`]
//! and, once the driver reports the sweep cancelled, [`Step::Evict`].
//!
//! ```
//! use hangar_evict::{Activator, ActivatorConfig, QueueInfo, Step, SweepEnd, Usage};
//! let mut a = Activator::new(ActivatorConfig {
//!     cleanup_threshold: 85.0,
//!     target_threshold: 70.0,
//!     check_interval_ms: 50,
//!     prefill_interval_ms: Some(1_800_000),
//! });
//! let at = |p: u64| Usage { used_bytes: p, avail_bytes: 100 - p };
//! a.handle_usage(0, at(80));
//! let Step::Prefill { budget_bytes } = a.poll_step(0) else { panic!() };
//! assert_eq!(budget_bytes, 31); // everything above 70 % and a 1 % margin
//! a.handle_swept(4_000, QueueInfo { files: 31, bytes: 31 }, SweepEnd::Complete);
//! a.handle_usage(4_050, at(86));
//! assert_eq!(a.poll_step(4_050), Step::Evict); // no sweep after the crossing
//! ```

use hangar_core::Millis;

use crate::hysteresis::{Hysteresis, Mode};
use crate::usage::Usage;

/// Share of the volume a sweep selects beyond what must go, so that
/// rounding and metadata blocks do not force another sweep.
pub const BUDGET_MARGIN: f64 = 0.01;

/// What the activator decides with.
#[derive(Debug, Clone, PartialEq)]
pub struct ActivatorConfig {
    /// Usage % turning deletion ON.
    pub cleanup_threshold: f64,
    /// Usage % turning it OFF; below `cleanup_threshold`.
    pub target_threshold: f64,
    /// Interval between usage checks while not deleting.
    pub check_interval_ms: Millis,
    /// Pre-fill, re-done this long after the last one; `None`: no pre-fill.
    pub prefill_interval_ms: Option<Millis>,
}

impl ActivatorConfig {
    /// The activator settings of an evictor's configuration.
    pub fn from_config(config: &crate::Config) -> ActivatorConfig {
        ActivatorConfig {
            cleanup_threshold: config.cleanup_threshold,
            target_threshold: config.target_threshold,
            check_interval_ms: (config.logger_interval.as_millis() as Millis).max(1),
            prefill_interval_ms: config.prefill_interval.map(|d| (d.as_millis() as Millis).max(1)),
        }
    }
}

/// What the driver does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Nothing until [`Activator::poll_timeout`]; then measure usage again.
    Wait,
    /// Deletion is OFF: sweep, keeping measuring usage meanwhile, and make
    /// the oldest files covering `budget_bytes` the deletion queue.
    Prefill {
        /// Bytes the selection should cover.
        budget_bytes: u64,
    },
    /// Usage crossed during a pre-fill and the queue holds files: abandon
    /// the pre-fill (what it found is discarded) and report it cancelled.
    CancelPrefill,
    /// Deletion is ON and the queue is empty: sweep (no need to measure
    /// meanwhile) and make what it selects the queue.
    Sweep {
        /// Bytes the selection should cover.
        budget_bytes: u64,
    },
    /// Deletion is ON: delete from the queue until usage reaches the target.
    Evict,
    /// Pre-fill is off and deletion is OFF: forget the queue, holding
    /// nothing while idle (the behaviour without pre-fill).
    DropQueue,
}

/// What the deletion queue holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueInfo {
    /// Files queued.
    pub files: usize,
    /// Bytes they occupy.
    pub bytes: u64,
}

/// How a sweep ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepEnd {
    /// It listed the whole tree; its selection is the queue.
    Complete,
    /// It was cancelled (or stopped): the queue is what was there before,
    /// possibly shortened to make room for the abandoned selection.
    Cancelled,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sweeping {
    No,
    Prefill,
    Cancelling,
    OnDemand,
}

/// The activator of one evictor. Starts OFF with an empty queue.
#[derive(Debug, Clone)]
pub struct Activator {
    config: ActivatorConfig,
    hysteresis: Hysteresis,
    usage: Option<Usage>,
    queue: QueueInfo,
    sweeping: Sweeping,
    /// When the last complete sweep ended.
    filled_at: Option<Millis>,
    /// Whether deletion took from the queue since it was last filled.
    consumed: bool,
    next_check: Millis,
}

impl Activator {
    /// An activator deciding with `config`.
    pub fn new(config: ActivatorConfig) -> Activator {
        let hysteresis = Hysteresis::new(config.cleanup_threshold, config.target_threshold);
        Activator {
            config,
            hysteresis,
            usage: None,
            queue: QueueInfo::default(),
            sweeping: Sweeping::No,
            filled_at: None,
            consumed: false,
            next_check: 0,
        }
    }

    // ---- inputs ----

    /// Feeds one usage reading taken at `now`; returns the mode it leaves.
    pub fn handle_usage(&mut self, now: Millis, usage: Usage) -> Mode {
        self.usage = Some(usage);
        self.next_check = now.saturating_add(self.config.check_interval_ms);
        self.hysteresis.observe(usage.percent())
    }

    /// A sweep (pre-fill or on demand) ended at `now`; `queue` is what the
    /// deletion queue holds now.
    pub fn handle_swept(&mut self, now: Millis, queue: QueueInfo, end: SweepEnd) {
        self.queue = queue;
        self.sweeping = Sweeping::No;
        if end == SweepEnd::Complete {
            self.filled_at = Some(now);
            self.consumed = false;
        }
    }

    /// A deletion from the queue ended; `queue` is what it left.
    pub fn handle_evicted(&mut self, _now: Millis, queue: QueueInfo) {
        self.queue = queue;
        self.consumed = true;
    }

    // ---- outputs ----

    /// The next step at `now`. Returning [`Step::Prefill`] or
    /// [`Step::Sweep`] commits the driver to report the sweep's end.
    pub fn poll_step(&mut self, now: Millis) -> Step {
        let Some(usage) = self.usage else {
            return Step::Wait;
        };
        match (self.hysteresis.mode(), self.sweeping) {
            (Mode::On, Sweeping::Prefill) if self.queue.files > 0 => {
                self.sweeping = Sweeping::Cancelling;
                Step::CancelPrefill
            }
            // A pre-fill with nothing queued before it is a sweep: its
            // selection will serve the crossing.
            (_, Sweeping::Prefill | Sweeping::Cancelling | Sweeping::OnDemand) => Step::Wait,
            (Mode::On, Sweeping::No) if self.queue.files > 0 => Step::Evict,
            (Mode::On, Sweeping::No) => {
                self.sweeping = Sweeping::OnDemand;
                Step::Sweep { budget_bytes: self.budget(usage) }
            }
            (Mode::Off, Sweeping::No) if self.config.prefill_interval_ms.is_none() => {
                if self.queue.files > 0 {
                    self.queue = QueueInfo::default();
                    Step::DropQueue
                } else {
                    Step::Wait
                }
            }
            (Mode::Off, Sweeping::No) if self.prefill_due(now, usage) => {
                self.sweeping = Sweeping::Prefill;
                Step::Prefill { budget_bytes: self.budget(usage) }
            }
            (Mode::Off, Sweeping::No) => Step::Wait,
        }
    }

    /// When to measure usage next.
    pub fn poll_timeout(&self) -> Millis {
        self.next_check
    }

    // ---- getters ----

    /// Whether deletion is ON.
    pub fn mode(&self) -> Mode {
        self.hysteresis.mode()
    }

    /// What the queue holds, as last reported.
    pub fn queue(&self) -> QueueInfo {
        self.queue
    }

    /// Whether a sweep is in flight.
    pub fn is_sweeping(&self) -> bool {
        self.sweeping != Sweeping::No
    }

    /// Bytes a sweep selects. With pre-fill, everything that could ever
    /// have to go — what is above the target at 100 % usage, plus the
    /// margin — so a queue filled while OFF serves a crossing from any
    /// usage without a sweep (within `MAX_CANDIDATES`). Without, what the
    /// current usage is above the target plus the margin, as before.
    pub fn budget(&self, usage: Usage) -> u64 {
        let capacity = usage.capacity_bytes() as f64;
        let margin = (capacity * BUDGET_MARGIN) as u64;
        match self.config.prefill_interval_ms {
            Some(_) => Usage { used_bytes: usage.capacity_bytes(), avail_bytes: 0 }
                .bytes_above(self.config.target_threshold)
                .saturating_add(margin),
            None => usage.bytes_above(self.config.target_threshold).saturating_add(margin),
        }
    }

    /// Bytes a crossing at the cleanup threshold needs, plus the margin: a
    /// queue holding less is *thin*.
    fn crossing_bytes(&self, usage: Usage) -> u64 {
        let capacity = usage.capacity_bytes() as f64;
        let share = (self.config.cleanup_threshold - self.config.target_threshold) / 100.0 + BUDGET_MARGIN;
        (capacity * share) as u64
    }

    /// A pre-fill is due at start, once the interval has passed since the
    /// last complete sweep, and at once when a deletion has left the queue
    /// thin (a queue thin for want of old files waits for the interval).
    fn prefill_due(&self, now: Millis, usage: Usage) -> bool {
        let Some(interval) = self.config.prefill_interval_ms else {
            return false;
        };
        match self.filled_at {
            None => true,
            Some(at) => {
                now >= at.saturating_add(interval)
                    || (self.consumed && self.queue.bytes < self.crossing_bytes(usage))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const CAP: u64 = 1_000_000;

    fn at(percent: f64) -> Usage {
        let used = (CAP as f64 * percent / 100.0) as u64;
        Usage { used_bytes: used, avail_bytes: CAP - used }
    }

    fn config(prefill: Option<Millis>) -> ActivatorConfig {
        ActivatorConfig {
            cleanup_threshold: 85.0,
            target_threshold: 70.0,
            check_interval_ms: 50,
            prefill_interval_ms: prefill,
        }
    }

    #[test]
    fn prefills_at_start_and_deletes_from_the_queue_at_the_crossing() {
        let mut a = Activator::new(config(Some(600_000)));
        assert_eq!(a.poll_step(0), Step::Wait, "nothing before a first reading");
        a.handle_usage(0, at(80.0));
        assert_eq!(a.poll_step(0), Step::Prefill { budget_bytes: 310_000 });
        assert_eq!(a.poll_step(10), Step::Wait, "one sweep at a time");
        a.handle_swept(4_000, QueueInfo { files: 310, bytes: 310_000 }, SweepEnd::Complete);
        a.handle_usage(4_050, at(84.9));
        assert_eq!(a.poll_step(4_050), Step::Wait);
        assert_eq!(a.poll_timeout(), 4_100);
        a.handle_usage(4_100, at(85.0));
        assert_eq!(a.poll_step(4_100), Step::Evict);
    }

    #[test]
    fn a_crossing_during_a_prefill_cancels_it_when_the_queue_holds_files() {
        let mut a = Activator::new(config(Some(600_000)));
        a.handle_usage(0, at(75.0));
        assert!(matches!(a.poll_step(0), Step::Prefill { .. }));
        a.handle_swept(1_000, QueueInfo { files: 5, bytes: 200_000 }, SweepEnd::Complete);
        a.handle_usage(700_000, at(75.0));
        assert!(matches!(a.poll_step(700_000), Step::Prefill { .. }), "interval passed");
        a.handle_usage(700_050, at(90.0));
        assert_eq!(a.poll_step(700_050), Step::CancelPrefill);
        assert_eq!(a.poll_step(700_060), Step::Wait, "until the cancel is reported");
        a.handle_swept(700_070, QueueInfo { files: 3, bytes: 120_000 }, SweepEnd::Cancelled);
        assert_eq!(a.poll_step(700_070), Step::Evict);
    }

    #[test]
    fn a_crossing_during_the_first_prefill_waits_for_it() {
        let mut a = Activator::new(config(Some(600_000)));
        a.handle_usage(0, at(75.0));
        assert!(matches!(a.poll_step(0), Step::Prefill { .. }));
        a.handle_usage(50, at(90.0));
        assert_eq!(a.poll_step(50), Step::Wait);
        a.handle_swept(3_000, QueueInfo { files: 9, bytes: 300_000 }, SweepEnd::Complete);
        assert_eq!(a.poll_step(3_000), Step::Evict);
    }

    #[test]
    fn a_thin_queue_is_refilled_after_a_deletion_not_before() {
        let mut a = Activator::new(config(Some(600_000)));
        a.handle_usage(0, at(80.0));
        a.poll_step(0);
        // Few old files: the pre-fill found less than a crossing needs.
        a.handle_swept(100, QueueInfo { files: 2, bytes: 50_000 }, SweepEnd::Complete);
        a.handle_usage(200, at(80.0));
        assert_eq!(a.poll_step(200), Step::Wait, "thin for want of old files: wait for the interval");
        a.handle_usage(300, at(86.0));
        assert_eq!(a.poll_step(300), Step::Evict);
        a.handle_evicted(400, QueueInfo { files: 1, bytes: 1_000 });
        a.handle_usage(400, at(60.0));
        assert!(matches!(a.poll_step(400), Step::Prefill { .. }), "consumed and thin");
        a.handle_swept(500, QueueInfo { files: 9, bytes: 300_000 }, SweepEnd::Complete);
        a.handle_usage(600, at(80.0));
        assert_eq!(a.poll_step(600), Step::Wait);
    }

    #[test]
    fn without_prefill_nothing_is_swept_or_held_while_off() {
        let mut a = Activator::new(config(None));
        a.handle_usage(0, at(80.0));
        assert_eq!(a.poll_step(0), Step::Wait);
        a.handle_usage(50, at(90.0));
        assert_eq!(a.poll_step(50), Step::Sweep { budget_bytes: 210_000 });
        a.handle_swept(90, QueueInfo { files: 10, bytes: 210_000 }, SweepEnd::Complete);
        assert_eq!(a.poll_step(90), Step::Evict);
        a.handle_evicted(100, QueueInfo { files: 1, bytes: 10_000 });
        a.handle_usage(100, at(69.0));
        assert_eq!(a.poll_step(100), Step::DropQueue);
        assert_eq!(a.queue(), QueueInfo::default());
        assert_eq!(a.poll_step(150), Step::Wait);
    }

    /// One input the model driver may give.
    #[derive(Debug, Clone)]
    enum Input {
        /// Time passes by this many ms, then usage is read.
        Reading(Millis, f64),
        /// The sweep in flight (if any) ends, holding this many files.
        SweepEnds(usize),
        /// The deletion in flight (if any) ends, leaving this share of the queue.
        EvictEnds(f64),
    }

    fn input() -> impl Strategy<Value = Input> {
        prop_oneof![
            4 => (1u64..200_000, 0.0f64..100.0).prop_map(|(d, p)| Input::Reading(d, p)),
            // Usage noise around the thresholds.
            3 => (1u64..200, 68.0f64..88.0).prop_map(|(d, p)| Input::Reading(d, p)),
            2 => (0usize..400).prop_map(Input::SweepEnds),
            2 => (0.0f64..1.0).prop_map(Input::EvictEnds),
        ]
    }

    proptest! {
        /// Whatever the readings and however long sweeps and deletions
        /// take: one sweep at a time, deletion only while ON and from a
        /// non-empty queue, pre-fill only while OFF and at most once per
        /// interval plus once per deletion or cancellation (a cancelled
        /// pre-fill is started again), and with a queue a crossing
        /// turns into a deletion at the first check after it.
        #[test]
        fn steps_respect_mode_queue_and_rate(
            inputs in proptest::collection::vec(input(), 1..300),
            prefill in prop_oneof![Just(None), (1_000u64..900_000).prop_map(Some)],
        ) {
            let mut a = Activator::new(config(prefill));
            let mut now: Millis = 0;
            // What the model driver is doing: a sweep (and whether it may be
            // cancelled) or a deletion.
            let mut sweep: Option<bool> = None;
            let mut deleting = false;
            let mut queue = QueueInfo::default();
            let (mut prefills, mut deletions, mut cancels) = (0u64, 0u64, 0u64);
            let mut last_reading = 0.0;
            for i in inputs {
                match i {
                    Input::Reading(d, p) => {
                        if deleting { continue } // the deleter measures for itself
                        now += d;
                        a.handle_usage(now, at(p));
                        last_reading = p;
                        prop_assert_eq!(a.poll_timeout(), now + 50);
                    }
                    Input::SweepEnds(files) => {
                        let Some(cancelling) = sweep.take() else { continue };
                        let end = if cancelling { SweepEnd::Cancelled } else { SweepEnd::Complete };
                        if end == SweepEnd::Complete {
                            queue = QueueInfo { files, bytes: files as u64 * 1_000 };
                        }
                        a.handle_swept(now, queue, end);
                    }
                    Input::EvictEnds(left) => {
                        if !deleting { continue }
                        deleting = false;
                        let files = (queue.files as f64 * left) as usize;
                        queue = QueueInfo { files, bytes: files as u64 * 1_000 };
                        a.handle_evicted(now, queue);
                    }
                }
                if deleting { continue }
                let mode = a.mode();
                let crossed_with_queue = mode == Mode::On && queue.files > 0;
                let step = a.poll_step(now);
                match step {
                    Step::Wait => {
                        prop_assert!(!(crossed_with_queue && sweep.is_none()), "a queue and ON, yet waiting");
                    }
                    Step::Prefill { budget_bytes } => {
                        prop_assert!(prefill.is_some() && mode == Mode::Off && sweep.is_none());
                        prop_assert!(budget_bytes >= at(100.0).bytes_above(70.0), "covers any crossing");
                        sweep = Some(false);
                        prefills += 1;
                        if let Some(interval) = prefill {
                            prop_assert!(prefills <= now / interval + 1 + deletions + cancels, "pre-fill too often");
                        }
                    }
                    Step::CancelPrefill => {
                        prop_assert!(mode == Mode::On && queue.files > 0 && sweep == Some(false));
                        sweep = Some(true);
                        cancels += 1;
                    }
                    Step::Sweep { budget_bytes } => {
                        prop_assert!(mode == Mode::On && queue.files == 0 && sweep.is_none());
                        prop_assert!(budget_bytes >= at(last_reading).bytes_above(70.0));
                        sweep = Some(false);
                    }
                    Step::Evict => {
                        prop_assert!(mode == Mode::On && queue.files > 0 && sweep.is_none());
                        deleting = true;
                        deletions += 1;
                    }
                    Step::DropQueue => {
                        prop_assert!(prefill.is_none() && mode == Mode::Off && sweep.is_none());
                        queue = QueueInfo::default();
                    }
                }
                if prefill.is_none() && mode == Mode::Off && sweep.is_none() {
                    prop_assert_eq!(a.queue(), QueueInfo::default(), "held a queue while OFF without pre-fill");
                }
            }
        }
    }
}
