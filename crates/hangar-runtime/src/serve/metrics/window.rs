//! A model's line and permits over the last five minutes: the rolling
//! window behind `hangar_queue_full_fraction_5m`,
//! `hangar_queue_depth_mean_5m` and `hangar_permits_used_mean_5m`.
//!
//! Seed 001's Workers AI keeps the same figures from a buffer of 600
//! samples taken 500 ms apart; so does [`PermitWindow`]. It is sans-IO:
//! the driver (a task of `hangar serve`, [`SAMPLE_EVERY`]) reads each
//! model's processor and hands the sample in; the window never reads a
//! clock, so a sample missed (a busy runtime) shortens the window's span
//! instead of skewing its figures.

use std::collections::VecDeque;
use std::time::Duration;

/// How often the driver samples every model.
pub(crate) const SAMPLE_EVERY: Duration = Duration::from_millis(500);

/// Samples kept: five minutes of [`SAMPLE_EVERY`].
pub(crate) const WINDOW_SAMPLES: usize = 600;

/// One look at a model's line and permits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Sample {
    /// Requests waiting for a permit.
    pub waiting: usize,
    /// Permits held.
    pub in_use: u32,
    /// Permits of ready replicas.
    pub permits: u32,
}

impl Sample {
    /// No permit is free, and that matters: a model with permits that are
    /// all held, or with none while requests wait. (A model scaled to zero
    /// that nobody asks for is idle, not full.)
    pub fn is_full(&self) -> bool {
        self.in_use >= self.permits && (self.permits > 0 || self.waiting > 0)
    }
}

/// The last [`WINDOW_SAMPLES`] samples of one model, with running sums.
///
/// Invariants after every call: `samples.len() <= WINDOW_SAMPLES`, and
/// the sums equal those of the samples held.
#[derive(Debug, Default)]
pub(crate) struct PermitWindow {
    samples: VecDeque<Sample>,
    full: usize,
    waiting: u64,
    in_use: u64,
}

impl PermitWindow {
    /// Adds `sample`, dropping the oldest once the window holds
    /// [`WINDOW_SAMPLES`].
    pub fn record(&mut self, sample: Sample) {
        if self.samples.len() == WINDOW_SAMPLES {
            if let Some(old) = self.samples.pop_front() {
                self.full -= usize::from(old.is_full());
                self.waiting -= old.waiting as u64;
                self.in_use -= u64::from(old.in_use);
            }
        }
        self.full += usize::from(sample.is_full());
        self.waiting += sample.waiting as u64;
        self.in_use += u64::from(sample.in_use);
        self.samples.push_back(sample);
    }

    /// The share of samples in which the model was full (0 with none yet).
    pub fn full_fraction(&self) -> f64 {
        self.mean(self.full as u64)
    }

    /// The mean number of requests waiting.
    pub fn mean_waiting(&self) -> f64 {
        self.mean(self.waiting)
    }

    /// The mean number of permits held.
    pub fn mean_in_use(&self) -> f64 {
        self.mean(self.in_use)
    }

    fn mean(&self, sum: u64) -> f64 {
        match self.samples.len() {
            0 => 0.0,
            n => sum as f64 / n as f64,
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn full_means_no_permit_free_while_it_matters() {
        let s = |waiting, in_use, permits| Sample { waiting, in_use, permits };
        assert!(s(0, 4, 4).is_full());
        assert!(s(3, 4, 4).is_full());
        assert!(s(1, 0, 0).is_full(), "requests waiting for a model with no replica");
        assert!(!s(0, 0, 0).is_full(), "scaled to zero and not asked for: idle");
        assert!(!s(0, 3, 4).is_full());
        // Permits taken away while held (a replica leaving).
        assert!(s(0, 2, 1).is_full());
    }

    #[test]
    fn an_empty_window_reads_zero() {
        let w = PermitWindow::default();
        assert_eq!((w.full_fraction(), w.mean_waiting(), w.mean_in_use()), (0.0, 0.0, 0.0));
    }

    fn sample() -> impl Strategy<Value = Sample> {
        // Mostly small numbers, as a line is; now and then a burst.
        (prop_oneof![4 => 0usize..4, 1 => 0usize..1_000], 0u32..10, 0u32..10)
            .prop_map(|(waiting, in_use, permits)| Sample { waiting, in_use, permits })
    }

    proptest! {
        // Each case recomputes up to 600 samples after each of up to 1500
        // steps: fewer cases than the default keep it quick.
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Against a model that recomputes from the last 600 samples after
        /// every step.
        #[test]
        fn the_figures_are_those_of_the_last_600_samples(samples in prop::collection::vec(sample(), 0..1_500)) {
            let mut w = PermitWindow::default();
            for (i, s) in samples.iter().enumerate() {
                w.record(*s);
                let held = &samples[(i + 1).saturating_sub(WINDOW_SAMPLES)..=i];
                prop_assert!(w.samples.len() <= WINDOW_SAMPLES);
                let n = held.len() as f64;
                let full = held.iter().filter(|s| s.is_full()).count() as f64 / n;
                let waiting = held.iter().map(|s| s.waiting as f64).sum::<f64>() / n;
                let in_use = held.iter().map(|s| f64::from(s.in_use)).sum::<f64>() / n;
                prop_assert!((w.full_fraction() - full).abs() < 1e-9);
                prop_assert!((w.mean_waiting() - waiting).abs() < 1e-9);
                prop_assert!((w.mean_in_use() - in_use).abs() < 1e-9);
                prop_assert!((0.0..=1.0).contains(&w.full_fraction()));
            }
        }
    }
}
