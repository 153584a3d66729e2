//! How long the store has answered this process without a break, and
//! what follows from it for claims: when this process may sweep other
//! processes' claims, and when it must renew its own at once.
//!
//! A claim is swept once it has gone a lease without renewal. After the
//! store was unreachable — Redis down, restarting or paused — every
//! claim has gone that long, its owner alive or not: live owners simply
//! could not renew. Sweeping then would take back predictions that are
//! running, and run them twice. So:
//!
//! - a process sweeps only once it has had the store **continuously for
//!   a lease**: every call in that window answered;
//! - an owner **renews its claims at once** when the store answers again.
//!
//! An owner's renewal comes with its first answer after an outage, a
//! sweeper's first sweep a whole lease after its own first answer, so
//! owners renew before anyone may sweep them. A process that really died
//! renews nothing, and its claims are swept a lease later, as before.
//!
//! [`Reachability`] is that bookkeeping, sans-IO: the driver feeds it
//! each call's outcome with `now` (milliseconds on a monotonic clock,
//! never going back), and asks it [`Reachability::may_sweep`] and
//! [`Reachability::poll_renew`]. It judges answers, not their content: a
//! call the store refused (a corrupt row, a script error) still
//! answered; only [`StoreError::Unavailable`] is a break.
//!
//! ```
//! use hangar_predictions::reachability::Reachability;
//!
//! let mut r = Reachability::new(2_000);
//! r.handle_answer(0);
//! assert!(!r.may_sweep(1_999) && r.may_sweep(2_000));
//! r.handle_unreachable(2_500); // Redis went away
//! assert!(!r.may_sweep(9_000));
//! r.handle_answer(9_000); // and came back
//! assert!(r.poll_renew(), "renew at once");
//! assert!(!r.poll_renew(), "once");
//! assert!(!r.may_sweep(10_999) && r.may_sweep(11_000));
//! ```
//!
//! [`StoreError::Unavailable`]: crate::store::StoreError::Unavailable

use hangar_core::Millis;

/// Whether, and since when, the store has answered without a break.
/// See the module docs.
#[derive(Debug, Clone)]
pub struct Reachability {
    /// How long the store must have answered before sweeping: the lease.
    hold_ms: Millis,
    /// The first answer after the last break; `None` while the store
    /// does not answer (and before its first answer).
    since: Option<Millis>,
    /// The last break, if any.
    broken_at: Option<Millis>,
    /// The store answered again since the last [`Reachability::poll_renew`].
    renew: bool,
}

impl Reachability {
    /// Nothing known yet: no sweeping until the store has answered for
    /// `hold_ms` (the lease).
    pub fn new(hold_ms: Millis) -> Self {
        Reachability { hold_ms, since: None, broken_at: None, renew: false }
    }

    // ---- handle_* (facts) ---------------------------------------------

    /// A call got the store's answer at `now` (success, or a refusal of
    /// the call itself). Returns whether this ends a break: the store
    /// answers again.
    pub fn handle_answer(&mut self, now: Millis) -> bool {
        if self.since.is_some() {
            return false;
        }
        self.since = Some(now);
        self.renew = true;
        self.broken_at.is_some()
    }

    /// A call failed at `now` because the store was unreachable. Returns
    /// whether this starts a break (the store answered until now).
    pub fn handle_unreachable(&mut self, now: Millis) -> bool {
        self.broken_at = Some(now);
        self.since.take().is_some()
    }

    // ---- getters -------------------------------------------------------

    /// Since when the store has answered without a break; `None` while
    /// it does not answer.
    pub fn reachable_since(&self) -> Option<Millis> {
        self.since
    }

    /// The last break, if there was one.
    pub fn broken_at(&self) -> Option<Millis> {
        self.broken_at
    }

    /// Whether this process may sweep others' claims at `now`: the store
    /// has answered every call for at least the lease.
    pub fn may_sweep(&self, now: Millis) -> bool {
        self.since.is_some_and(|since| now.saturating_sub(since) >= self.hold_ms)
    }

    // ---- poll_* (outputs) ----------------------------------------------

    /// Whether this process must renew its claims now: `true` once after
    /// each time the store starts answering (the first time included).
    pub fn poll_renew(&mut self) -> bool {
        std::mem::take(&mut self.renew)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn sweeping_waits_a_lease_of_answers_after_the_start_and_after_every_break() {
        let mut r = Reachability::new(1_000);
        assert!(!r.may_sweep(0) && !r.may_sweep(1_000_000), "nothing known: no sweeping");
        assert!(!r.handle_answer(10), "the first answer ends no break");
        assert!(r.poll_renew());
        assert!(!r.may_sweep(1_009));
        assert!(r.may_sweep(1_010));
        assert!(!r.handle_answer(1_500), "answers in a row change nothing");
        assert!(!r.poll_renew());
        assert!(r.handle_unreachable(1_600), "a break starts");
        assert!(!r.handle_unreachable(2_000), "…once");
        assert!(!r.may_sweep(5_000));
        assert_eq!((r.reachable_since(), r.broken_at()), (None, Some(2_000)));
        assert!(r.handle_answer(6_000), "the store is back");
        assert!(r.poll_renew(), "renew at once");
        assert!(!r.may_sweep(6_999));
        assert!(r.may_sweep(7_000));
    }

    #[derive(Debug, Clone)]
    enum Event {
        Answer(Millis),
        Unreachable(Millis),
        Renew,
    }

    fn event() -> impl Strategy<Value = Event> {
        prop_oneof![
            4 => (0u64..400).prop_map(Event::Answer),
            1 => (0u64..400).prop_map(Event::Unreachable),
            1 => Just(Event::Renew),
        ]
    }

    proptest! {
        /// Noisy answers and breaks (each event after a random delay):
        /// sweeping is allowed exactly when an answer came at least a
        /// lease ago after the last break (so never within a lease of a
        /// break); a renewal is asked after every return of the store,
        /// and only then.
        #[test]
        fn sweeps_only_after_a_lease_without_a_break(
            hold in 1u64..1_000,
            events in proptest::collection::vec(event(), 1..200),
        ) {
            let mut r = Reachability::new(hold);
            let mut now = 0;
            let mut history: Vec<(Millis, bool)> = Vec::new();
            // The store came back since the last poll.
            let mut returned = false;
            let mut up = false;
            for e in events {
                match e {
                    Event::Answer(dt) => {
                        now += dt;
                        r.handle_answer(now);
                        history.push((now, true));
                        returned |= !up;
                        up = true;
                    }
                    Event::Unreachable(dt) => {
                        now += dt;
                        r.handle_unreachable(now);
                        history.push((now, false));
                        up = false;
                    }
                    Event::Renew => prop_assert_eq!(r.poll_renew(), std::mem::take(&mut returned)),
                }
                // The model: the first answer after the last break.
                let last_break = history.iter().rposition(|(_, ok)| !ok);
                let since = history[last_break.map_or(0, |i| i + 1)..].first().map(|(t, _)| *t);
                prop_assert_eq!(r.reachable_since(), since);
                for probe in [now, now + hold / 2, now + hold, now + 2 * hold] {
                    let may = r.may_sweep(probe);
                    prop_assert_eq!(may, since.is_some_and(|s| probe >= s + hold));
                    if may {
                        prop_assert!(
                            history.iter().all(|(t, ok)| *ok || *t + hold <= probe),
                            "a sweep within a lease of a break"
                        );
                    }
                }
            }
            prop_assert_eq!(r.poll_renew(), returned);
        }
    }
}
