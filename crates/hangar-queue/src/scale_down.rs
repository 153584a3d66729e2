//! When a model may give back replicas it no longer needs.
//!
//! Scaling up is immediate (demand that does not fit starts replicas at
//! once); scaling down waits. A model's replicas are *in excess* while the
//! demand — replicas needed for everything running and waiting, at least
//! the replicas it must keep — is below the replicas it has. Once the
//! excess has lasted a whole quiet period, [`ScaleDown`] says how many to
//! keep: the highest demand seen during that period, so a burst in the
//! middle of it is still served by warm replicas. Any moment the demand
//! reaches the replicas up starts the period again.
//!
//! With a quiet period of `after` and demand that falls to zero, a model
//! with no replicas to keep scales to zero `after` its last request;
//! Replicate's and Workers AI's idle timeouts behave the same way.
//!
//! Like [`crate::Admission`], the machine takes `now` with every call and
//! never reads a clock; the driver calls [`ScaleDown::observe`] whenever it
//! learns the demand (on arrivals and on a periodic tick).

use hangar_core::Millis;

/// The quiet-period scale-down policy of one model.
#[derive(Debug, Clone)]
pub struct ScaleDown {
    after: Millis,
    /// Since when the model has been in excess, and the peak demand since.
    excess: Option<(Millis, u32)>,
}

impl ScaleDown {
    /// A policy that keeps excess replicas for `after` milliseconds of
    /// excess before giving them back. `after == 0` never scales down.
    pub fn new(after: Millis) -> Self {
        ScaleDown { after, excess: None }
    }

    /// The demand at `now` was `demand` replicas and `up` replicas were
    /// starting or serving. Returns how many replicas to keep when the
    /// excess has lasted the quiet period (always fewer than `up`); the
    /// period then starts over.
    pub fn observe(&mut self, now: Millis, demand: u32, up: u32) -> Option<u32> {
        if self.after == 0 || demand >= up {
            self.excess = None;
            return None;
        }
        let (since, peak) = self.excess.get_or_insert((now, demand));
        *peak = (*peak).max(demand);
        if now.saturating_sub(*since) < self.after {
            return None;
        }
        let keep = *peak;
        self.excess = None;
        // Replicas may have gone meanwhile (evicted, failed): the period's
        // peak may need every one left.
        (keep < up).then_some(keep)
    }

    /// When, if the excess goes on, replicas may next be given back.
    pub fn poll_timeout(&self) -> Option<Millis> {
        self.excess.map(|(since, _)| since.saturating_add(self.after))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_model_scales_to_zero_after_the_quiet_period() {
        let mut s = ScaleDown::new(1_000);
        assert_eq!(s.observe(0, 1, 1), None, "busy");
        assert_eq!(s.observe(100, 0, 1), None, "quiet period starts");
        assert_eq!(s.poll_timeout(), Some(1_100));
        assert_eq!(s.observe(1_099, 0, 1), None);
        assert_eq!(s.observe(1_100, 0, 1), Some(0));
        assert_eq!(s.poll_timeout(), None);
    }

    #[test]
    fn a_burst_inside_the_period_is_kept_and_full_use_restarts_it() {
        let mut s = ScaleDown::new(1_000);
        assert_eq!(s.observe(0, 1, 3), None);
        assert_eq!(s.observe(500, 2, 3), None, "burst");
        assert_eq!(s.observe(1_000, 0, 3), Some(2), "the burst's peak is kept");
        assert_eq!(s.observe(1_100, 0, 2), None);
        assert_eq!(s.observe(1_500, 2, 2), None, "every replica needed: the period starts over");
        assert_eq!(s.observe(2_400, 0, 2), None);
        assert_eq!(s.observe(3_400, 0, 2), Some(0));
    }

    #[test]
    fn zero_never_scales_down() {
        let mut s = ScaleDown::new(0);
        assert_eq!(s.observe(u64::MAX, 0, 5), None);
        assert_eq!(s.poll_timeout(), None);
    }
}
