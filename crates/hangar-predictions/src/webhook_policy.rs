//! Which webhooks to send and when, as a sans-IO policy.
//!
//! A prediction's [`Throttle`] is fed each event with `now` and answers
//! whether to send it at once, send it later (at [`Throttle::poll_timeout`])
//! or not at all. `output` and `logs` events are coalesced to at most one
//! per [`COALESCE_MS`] — the latest state wins, as Replicate's preempting
//! webhook sender drops superseded intermediate updates. `start` and
//! `completed` are never coalesced; `completed` is sent even when the
//! filter leaves it out, so a client always learns the end.
//!
//! [`retry_delay`] is the capped exponential back-off between delivery
//! attempts of the events that must arrive (`start`, `completed`).

use hangar_core::Millis;
use serde::{Deserialize, Serialize};

/// At most one `output`/`logs` webhook per this many milliseconds.
pub const COALESCE_MS: Millis = 500;

/// A webhook event type (`webhook_events_filter` entries).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Event {
    /// The prediction started running.
    Start,
    /// New output.
    Output,
    /// New log lines.
    Logs,
    /// The prediction reached a terminal status.
    Completed,
}

impl Event {
    /// Every event.
    pub const ALL: [Event; 4] = [Event::Start, Event::Output, Event::Logs, Event::Completed];

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Event::Start => "start",
            Event::Output => "output",
            Event::Logs => "logs",
            Event::Completed => "completed",
        }
    }

    /// The event called `s`.
    pub fn parse(s: &str) -> Option<Event> {
        Event::ALL.into_iter().find(|e| e.as_str() == s)
    }

    /// Whether this event must be delivered (persisted, retried).
    pub fn is_durable(self) -> bool {
        matches!(self, Event::Start | Event::Completed)
    }
}

/// The set of events a prediction's webhook receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Filter(u8);

impl Filter {
    /// Every event (the default when the request gives no filter).
    pub const ALL: Filter = Filter(0b1111);

    /// The filter of exactly `events`.
    pub fn of(events: &[Event]) -> Filter {
        Filter(events.iter().fold(0, |acc, e| acc | 1 << *e as u8))
    }

    /// Whether `event` passes.
    pub fn allows(self, event: Event) -> bool {
        event == Event::Completed || self.0 & (1 << event as u8) != 0
    }

    /// The stored form.
    pub fn bits(self) -> u8 {
        self.0
    }

    /// The filter stored as `bits` (unknown bits ignored).
    pub fn from_bits(bits: u8) -> Filter {
        Filter(bits & Filter::ALL.0)
    }

    /// The events in the filter, for storage.
    pub fn events(self) -> Vec<Event> {
        Event::ALL.into_iter().filter(|e| self.0 & (1 << *e as u8) != 0).collect()
    }
}

/// What to do with one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Send it now (with the prediction's current state).
    Send,
    /// Nothing now: a send is due at [`Throttle::poll_timeout`].
    Deferred,
    /// Not sent: filtered out, or superseded.
    Drop,
}

/// One prediction's webhook throttle.
#[derive(Debug, Clone)]
pub struct Throttle {
    filter: Filter,
    /// When the last intermediate (`output`/`logs`) webhook went out.
    last_intermediate: Option<Millis>,
    /// An intermediate webhook is owed at `last_intermediate + COALESCE_MS`.
    pending: Option<Event>,
    done: bool,
}

impl Throttle {
    /// A throttle for a webhook with `filter`.
    pub fn new(filter: Filter) -> Self {
        Throttle { filter, last_intermediate: None, pending: None, done: false }
    }

    /// Feeds one event at `now`.
    pub fn handle(&mut self, now: Millis, event: Event) -> Decision {
        if self.done || !self.filter.allows(event) {
            return Decision::Drop;
        }
        match event {
            Event::Start => Decision::Send,
            Event::Completed => {
                // The terminal webhook carries the final state: anything
                // pending is superseded.
                self.done = true;
                self.pending = None;
                Decision::Send
            }
            Event::Output | Event::Logs => match self.last_intermediate {
                Some(last) if now < last + COALESCE_MS => {
                    // Output outranks logs: the payload is the whole state
                    // either way, and the event name says what changed most.
                    if self.pending != Some(Event::Output) {
                        self.pending = Some(event);
                    }
                    Decision::Deferred
                }
                _ => {
                    self.last_intermediate = Some(now);
                    Decision::Send
                }
            },
        }
    }

    /// When a deferred webhook is due.
    pub fn poll_timeout(&self) -> Option<Millis> {
        self.pending.and(self.last_intermediate).map(|t| t + COALESCE_MS)
    }

    /// At or after [`Throttle::poll_timeout`]: the event to send now, if
    /// one is due. Early calls return `None` and change nothing.
    pub fn handle_timeout(&mut self, now: Millis) -> Option<Event> {
        let due = self.poll_timeout()?;
        if now < due {
            return None;
        }
        self.last_intermediate = Some(now);
        self.pending.take()
    }
}

/// Back-off settings of durable deliveries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retry {
    /// Delay after the first failure.
    pub base_ms: Millis,
    /// Largest delay.
    pub cap_ms: Millis,
    /// Attempts before giving up.
    pub max_attempts: u32,
}

impl Default for Retry {
    fn default() -> Self {
        Retry { base_ms: 1_000, cap_ms: 60_000, max_attempts: 12 }
    }
}

/// When to try again after `failures` failed attempts (≥ 1), or `None`
/// when the delivery is given up.
pub fn retry_delay(retry: &Retry, failures: u32) -> Option<Millis> {
    if failures >= retry.max_attempts {
        return None;
    }
    let exp = failures.saturating_sub(1).min(40);
    Some(retry.base_ms.saturating_mul(1 << exp).min(retry.cap_ms))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn output_is_coalesced_and_completed_supersedes() {
        let mut t = Throttle::new(Filter::ALL);
        assert_eq!(t.handle(0, Event::Start), Decision::Send);
        assert_eq!(t.handle(10, Event::Output), Decision::Send);
        assert_eq!(t.handle(20, Event::Output), Decision::Deferred);
        assert_eq!(t.handle(30, Event::Logs), Decision::Deferred);
        assert_eq!(t.poll_timeout(), Some(510));
        assert_eq!(t.handle_timeout(509), None);
        assert_eq!(t.handle_timeout(510), Some(Event::Output));
        assert_eq!(t.poll_timeout(), None);
        assert_eq!(t.handle(600, Event::Output), Decision::Deferred);
        assert_eq!(t.handle(700, Event::Completed), Decision::Send);
        assert_eq!(t.poll_timeout(), None);
        assert_eq!(t.handle(800, Event::Output), Decision::Drop);
    }

    #[test]
    fn filter_drops_but_never_completed() {
        let mut t = Throttle::new(Filter::of(&[Event::Start]));
        assert_eq!(t.handle(0, Event::Output), Decision::Drop);
        assert_eq!(t.handle(0, Event::Logs), Decision::Drop);
        assert_eq!(t.handle(0, Event::Start), Decision::Send);
        assert_eq!(t.handle(1, Event::Completed), Decision::Send);
        assert_eq!(Filter::of(&[Event::Logs, Event::Output]).events(), vec![Event::Output, Event::Logs]);
    }

    #[test]
    fn backoff_doubles_to_the_cap_then_gives_up() {
        let r = Retry { base_ms: 100, cap_ms: 1000, max_attempts: 6 };
        let d: Vec<_> = (1..=6).map(|f| retry_delay(&r, f)).collect();
        assert_eq!(d, vec![Some(100), Some(200), Some(400), Some(800), Some(1000), None]);
    }

    proptest! {
        /// Whatever the event stream, intermediate webhooks go out at
        /// least COALESCE_MS apart, and nothing intermediate follows the
        /// terminal one.
        #[test]
        fn intermediate_sends_are_spaced(
            steps in proptest::collection::vec((0u64..400, 0usize..4), 1..200),
        ) {
            let mut t = Throttle::new(Filter::ALL);
            let mut now = 0;
            let mut sent: Vec<(Millis, Event)> = Vec::new();
            for (dt, e) in steps {
                now += dt;
                if let Some(due) = t.poll_timeout() {
                    if due <= now {
                        prop_assert!(t.handle_timeout(now).is_some());
                        sent.push((now, Event::Output));
                    }
                }
                let event = Event::ALL[e];
                if t.handle(now, event) == Decision::Send {
                    sent.push((now, event));
                }
            }
            let inter: Vec<Millis> = sent.iter().filter(|(_, e)| !e.is_durable()).map(|(t, _)| *t).collect();
            for w in inter.windows(2) {
                prop_assert!(w[1] - w[0] >= COALESCE_MS);
            }
            if let Some(pos) = sent.iter().position(|(_, e)| *e == Event::Completed) {
                prop_assert_eq!(pos, sent.len() - 1);
            }
        }

        #[test]
        fn delays_are_capped_and_non_decreasing(base in 1u64..10_000, cap in 1u64..1_000_000, n in 1u32..64) {
            let r = Retry { base_ms: base, cap_ms: cap, max_attempts: 64 };
            let mut prev = 0;
            for f in 1..n {
                let d = retry_delay(&r, f).unwrap();
                prop_assert!(d <= cap && d >= prev);
                prev = d;
            }
        }
    }
}
