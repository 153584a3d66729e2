//! The activator's decision: deletion ON at or above the cleanup threshold,
//! OFF at or below the target, unchanged in between. Sans-IO: it takes a
//! usage figure and returns the mode.

/// Whether the evictor is deleting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Usage is acceptable; only the usage check runs.
    Off,
    /// Usage crossed the cleanup threshold and has not yet reached the target.
    On,
}

/// Two-threshold switch that cannot flap between one check and the next.
#[derive(Debug, Clone)]
pub struct Hysteresis {
    cleanup: f64,
    target: f64,
    mode: Mode,
}

impl Hysteresis {
    /// Starts OFF. `target` must be below `cleanup` (the config ensures it).
    pub fn new(cleanup: f64, target: f64) -> Hysteresis {
        debug_assert!(target < cleanup);
        Hysteresis { cleanup, target, mode: Mode::Off }
    }

    /// Feeds one usage percentage and returns the mode it leaves.
    pub fn observe(&mut self, percent: f64) -> Mode {
        self.mode = match self.mode {
            Mode::Off if percent >= self.cleanup => Mode::On,
            Mode::On if percent <= self.target => Mode::Off,
            m => m,
        };
        self.mode
    }

    /// The current mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn switches_at_the_thresholds() {
        let mut h = Hysteresis::new(85.0, 70.0);
        assert_eq!(h.observe(84.9), Mode::Off);
        assert_eq!(h.observe(85.0), Mode::On);
        assert_eq!(h.observe(75.0), Mode::On);
        assert_eq!(h.observe(70.1), Mode::On);
        assert_eq!(h.observe(70.0), Mode::Off);
        assert_eq!(h.observe(80.0), Mode::Off);
    }

    proptest! {
        /// The mode is ON exactly when the last reading outside the dead band
        /// was at or above the cleanup threshold.
        #[test]
        fn mode_follows_last_crossing(readings in proptest::collection::vec(0.0f64..100.0, 1..200)) {
            let mut h = Hysteresis::new(85.0, 70.0);
            let mut expected = Mode::Off;
            for r in readings {
                if r >= 85.0 { expected = Mode::On } else if r <= 70.0 { expected = Mode::Off }
                prop_assert_eq!(h.observe(r), expected);
            }
        }
    }
}
