//! The prediction lifecycle as a sans-IO policy: statuses, the legal
//! transitions between them, and the deadline rules.
//!
//! Nothing here reads a clock: every decision takes `now` (milliseconds
//! since the Unix epoch) from the caller, so the same inputs always give
//! the same answer and the rules can be property-tested.
//!
//! # Deadlines
//! A prediction can carry up to three limits, as Replicate's Director
//! computes them:
//! - the **per-prediction deadline** (`deadline` in the API object): the
//!   request's `Cancel-After` (minimum 5 s) from creation, capped by the
//!   model's `max_run_lifetime`;
//! - the **lifetime deadline**: creation + the model's `max_run_lifetime`
//!   (default 24 h; 0 disables it);
//! - the **predict timeout**: start + `predict_timeout` (default 30 min).
//!
//! One of them applies, chosen by priority as Director's
//! `getEffectiveDeadline` does: the per-prediction deadline if the
//! prediction has one; else the lifetime deadline if the model has a
//! lifetime; else — only then — the predict timeout from the start, the
//! fallback for a prediction without any deadline. (The per-prediction
//! deadline is capped by the lifetime when created, so it is never the
//! later of the two.) A deadline already passed when the prediction would
//! start (dequeue, or the cordon loop while it waits) ends it as
//! `aborted` (per-prediction) or `failed` (lifetime); one that passes
//! while it runs ends it as `canceled` (per-prediction) or `failed`
//! (lifetime, predict timeout).

use hangar_core::{ErrorCode, Millis};
use serde::{Deserialize, Serialize};

/// Where a prediction is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Accepted and waiting for capacity.
    Starting,
    /// Running on a replica.
    Processing,
    /// Finished with output.
    Succeeded,
    /// Finished with an error.
    Failed,
    /// Stopped by the user or by its own deadline while running.
    Canceled,
    /// Its own deadline passed before it started; it never ran.
    Aborted,
}

impl Status {
    /// Every status, in lifecycle order.
    pub const ALL: [Status; 6] = [
        Status::Starting,
        Status::Processing,
        Status::Succeeded,
        Status::Failed,
        Status::Canceled,
        Status::Aborted,
    ];

    /// The name used on the wire and in the store.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Starting => "starting",
            Status::Processing => "processing",
            Status::Succeeded => "succeeded",
            Status::Failed => "failed",
            Status::Canceled => "canceled",
            Status::Aborted => "aborted",
        }
    }

    /// The status called `s`, if any.
    pub fn parse(s: &str) -> Option<Status> {
        Status::ALL.into_iter().find(|st| st.as_str() == s)
    }

    /// Whether the prediction is finished (no transition leaves it).
    pub fn is_terminal(self) -> bool {
        !matches!(self, Status::Starting | Status::Processing)
    }

    /// Whether moving from `self` to `to` is allowed: `starting →
    /// processing → terminal`, or `starting → terminal` (canceled or
    /// aborted before it ran, failed at dequeue). Terminal states are final.
    pub fn can_become(self, to: Status) -> bool {
        match (self, to) {
            (Status::Starting, Status::Processing) => true,
            (Status::Starting, t) => t.is_terminal() && t != Status::Succeeded,
            (Status::Processing, t) => t.is_terminal(),
            _ => false,
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A model's time limits, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Whole life from creation (queue + setup + run); 0 disables it.
    pub max_run_lifetime: Millis,
    /// Run time from start; 0 means the 30-minute default (as Director
    /// enforces a minimum when misconfigured).
    pub predict_timeout: Millis,
}

/// Default `max_run_lifetime`: 24 hours.
pub const DEFAULT_MAX_RUN_LIFETIME: Millis = 24 * 3600 * 1000;
/// Default `predict_timeout`: 30 minutes.
pub const DEFAULT_PREDICT_TIMEOUT: Millis = 30 * 60 * 1000;
/// Default timeout of a training: 24 hours.
pub const DEFAULT_TRAIN_TIMEOUT: Millis = 24 * 3600 * 1000;
/// The smallest `Cancel-After` accepted.
pub const MIN_CANCEL_AFTER: Millis = 5_000;

impl Default for Limits {
    fn default() -> Self {
        Limits { max_run_lifetime: DEFAULT_MAX_RUN_LIFETIME, predict_timeout: DEFAULT_PREDICT_TIMEOUT }
    }
}

impl Limits {
    fn predict_timeout(&self) -> Millis {
        if self.predict_timeout == 0 {
            DEFAULT_PREDICT_TIMEOUT
        } else {
            self.predict_timeout
        }
    }

    /// The per-prediction deadline of a prediction created at `created_at`
    /// with `cancel_after`: the shorter of it and the model's lifetime,
    /// from creation; `None` without `Cancel-After`.
    pub fn deadline(&self, created_at: Millis, cancel_after: Option<Millis>) -> Option<Millis> {
        let after = cancel_after?;
        let after = if self.max_run_lifetime > 0 { after.min(self.max_run_lifetime) } else { after };
        Some(created_at.saturating_add(after))
    }

    /// The lifetime deadline of a prediction created at `created_at`.
    pub fn lifetime_deadline(&self, created_at: Millis) -> Option<Millis> {
        (self.max_run_lifetime > 0).then(|| created_at.saturating_add(self.max_run_lifetime))
    }
}

/// Why a deadline applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeadlineSource {
    /// The request's `Cancel-After`.
    PerPrediction,
    /// The model's `max_run_lifetime`.
    Lifetime,
    /// The model's `predict_timeout`.
    PredictTimeout,
}

/// The deadlines fixed when a prediction is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// The per-prediction deadline (absolute).
    pub per_prediction: Option<Millis>,
    /// The lifetime deadline (absolute).
    pub lifetime: Option<Millis>,
}

impl Deadlines {
    /// The deadlines of a prediction created at `created_at`.
    pub fn new(limits: &Limits, created_at: Millis, cancel_after: Option<Millis>) -> Self {
        Deadlines {
            per_prediction: limits.deadline(created_at, cancel_after),
            lifetime: limits.lifetime_deadline(created_at),
        }
    }

    /// The deadline of the prediction, by priority: the per-prediction
    /// deadline if set, else the lifetime deadline; `None` when it has
    /// neither (then only the predict timeout bounds its run).
    pub fn before_start(&self) -> Option<(Millis, DeadlineSource)> {
        match (self.per_prediction, self.lifetime) {
            (Some(at), _) => Some((at, DeadlineSource::PerPrediction)),
            (None, Some(at)) => Some((at, DeadlineSource::Lifetime)),
            (None, None) => None,
        }
    }

    /// The deadline of a prediction that started at `started_at`: its
    /// deadline ([`Deadlines::before_start`]) if it has one, else the
    /// predict timeout from the start (the fallback; it does not apply
    /// to a prediction that has a deadline).
    pub fn while_running(&self, limits: &Limits, started_at: Millis) -> (Millis, DeadlineSource) {
        self.before_start().unwrap_or_else(|| {
            (started_at.saturating_add(limits.predict_timeout()), DeadlineSource::PredictTimeout)
        })
    }

    /// What happens to a prediction about to start (or waiting) at `now`:
    /// `None` if it may run, otherwise how it ends.
    pub fn at_dequeue(&self, now: Millis) -> Option<Ending> {
        let (at, source) = self.before_start()?;
        (at <= now).then(|| Ending::expired_before_start(source))
    }
}

/// How and why a prediction ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ending {
    /// The terminal status.
    pub status: Status,
    /// Why it did not succeed, as `/metrics` counts it (`None` when it
    /// succeeded).
    pub code: Option<ErrorCode>,
    /// The `error` recorded.
    pub error: String,
}

impl Ending {
    /// It ran and produced its output.
    pub fn succeeded() -> Self {
        Ending { status: Status::Succeeded, code: None, error: String::new() }
    }

    /// It ends as `status` for the reason `code`, with `error` recorded.
    pub fn new(status: Status, code: ErrorCode, error: impl Into<String>) -> Self {
        Ending { status, code: Some(code), error: error.into() }
    }

    /// A deadline that passed before the prediction started.
    pub fn expired_before_start(source: DeadlineSource) -> Self {
        match source {
            DeadlineSource::PerPrediction => Ending::new(
                Status::Aborted,
                ErrorCode::Timeout,
                "the prediction's deadline (Cancel-After) passed before it started",
            ),
            DeadlineSource::Lifetime => Ending::new(
                Status::Failed,
                ErrorCode::Timeout,
                "the model's max_run_lifetime passed before the prediction started",
            ),
            DeadlineSource::PredictTimeout => {
                Ending::new(Status::Failed, ErrorCode::Timeout, "the prediction timed out before it started")
            }
        }
    }

    /// A deadline that passed while the prediction ran.
    pub fn expired_while_running(source: DeadlineSource) -> Self {
        match source {
            DeadlineSource::PerPrediction => Ending::new(
                Status::Canceled,
                ErrorCode::Timeout,
                "the prediction's deadline (Cancel-After) passed while it ran",
            ),
            DeadlineSource::Lifetime => Ending::new(
                Status::Failed,
                ErrorCode::Timeout,
                "the model's max_run_lifetime passed while the prediction ran",
            ),
            DeadlineSource::PredictTimeout => Ending::new(
                Status::Failed,
                ErrorCode::Timeout,
                "the prediction exceeded the model's predict_timeout",
            ),
        }
    }
}

/// Why a `Cancel-After` value was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CancelAfterError {
    /// Not a duration.
    #[error(
        "Cancel-After `{0}` is not a duration: use seconds (`300`) or a Go duration (`5m`, `1h30m`, `90s`)"
    )]
    Malformed(String),
    /// Shorter than the 5 s minimum.
    #[error("Cancel-After `{0}` is shorter than the minimum of 5s")]
    TooShort(String),
}

/// Parses a `Cancel-After` header: bare seconds (`300`, `2.5`) or a Go
/// duration (`5m`, `1h30m`, `1.5s`, `250ms`); at least 5 s. Returns
/// milliseconds.
pub fn parse_cancel_after(value: &str) -> Result<Millis, CancelAfterError> {
    let v = value.trim();
    let bad = || CancelAfterError::Malformed(value.to_owned());
    let ms = if let Ok(secs) = v.parse::<f64>() {
        if !secs.is_finite() || secs < 0.0 {
            return Err(bad());
        }
        secs * 1000.0
    } else {
        parse_go_duration(v).ok_or_else(bad)?
    };
    if !(ms.is_finite() && ms < 1e15) {
        return Err(bad());
    }
    let ms = ms.round() as Millis;
    if ms < MIN_CANCEL_AFTER {
        return Err(CancelAfterError::TooShort(value.to_owned()));
    }
    Ok(ms)
}

/// Go's `time.ParseDuration` grammar (no sign): one or more
/// `<decimal><unit>` with units ns, us, µs, ms, s, m, h. Milliseconds.
fn parse_go_duration(s: &str) -> Option<f64> {
    if s.is_empty() {
        return None;
    }
    let mut rest = s;
    let mut total = 0.0;
    while !rest.is_empty() {
        let num_len = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        if num_len == 0 {
            return None;
        }
        let n: f64 = rest[..num_len].parse().ok()?;
        rest = &rest[num_len..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(rest.len());
        let per_ms = match &rest[..unit_len] {
            "ns" => 1e-6,
            "us" | "µs" | "μs" => 1e-3,
            "ms" => 1.0,
            "s" => 1e3,
            "m" => 60e3,
            "h" => 3600e3,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += n * per_ms;
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn cancel_after_forms() {
        assert_eq!(parse_cancel_after("300"), Ok(300_000));
        assert_eq!(parse_cancel_after("5"), Ok(5_000));
        assert_eq!(parse_cancel_after("5m"), Ok(300_000));
        assert_eq!(parse_cancel_after("1h30m"), Ok(5_400_000));
        assert_eq!(parse_cancel_after("1.5s").unwrap_err(), CancelAfterError::TooShort("1.5s".into()));
        assert_eq!(parse_cancel_after("7500ms"), Ok(7_500));
        assert!(matches!(parse_cancel_after("4s"), Err(CancelAfterError::TooShort(_))));
        for bad in ["", "soon", "5 m", "-10", "5x", "m5", "1e400", "NaN", "inf"] {
            assert!(matches!(parse_cancel_after(bad), Err(CancelAfterError::Malformed(_))), "{bad}");
        }
    }

    /// The three worked scenarios of the reference (Replicate's Director,
    /// seed 001, "Timeout Behavior Examples").
    #[test]
    fn the_seed_scenarios() {
        // Scenario 1: lifetime 300 s, predict timeout 1800 s, dequeued at
        // 60 s: it runs until 300 s (240 s remain), not 60 + 1800 s.
        let limits = Limits { max_run_lifetime: 300_000, predict_timeout: 1_800_000 };
        let d = Deadlines::new(&limits, 0, None);
        assert_eq!(d.at_dequeue(60_000), None);
        assert_eq!(d.while_running(&limits, 60_000), (300_000, DeadlineSource::Lifetime));
        // Scenario 2: per-prediction 180 s under a 600 s lifetime, dequeued
        // at 30 s: 180 s (150 s remain).
        let limits = Limits { max_run_lifetime: 600_000, predict_timeout: 1_800_000 };
        let d = Deadlines::new(&limits, 0, Some(180_000));
        assert_eq!(d.at_dequeue(30_000), None);
        assert_eq!(d.while_running(&limits, 30_000), (180_000, DeadlineSource::PerPrediction));
        // Scenario 3: lifetime 0, no per-prediction deadline: no deadline;
        // the predict timeout, 1800 s from the start.
        let limits = Limits { max_run_lifetime: 0, predict_timeout: 1_800_000 };
        let d = Deadlines::new(&limits, 0, None);
        assert_eq!(d.before_start(), None);
        assert_eq!(d.at_dequeue(u64::MAX / 2), None);
        assert_eq!(d.while_running(&limits, 10_000), (1_810_000, DeadlineSource::PredictTimeout));
    }

    /// Where the priority order differs from "the earliest of the three":
    /// a lifetime longer than start + predict timeout still wins, since
    /// the predict timeout is only the fallback for no deadline at all.
    #[test]
    fn the_predict_timeout_applies_only_without_a_deadline() {
        // The defaults: a 24 h lifetime and a 30 min predict timeout.
        let limits = Limits::default();
        let d = Deadlines::new(&limits, 0, None);
        assert_eq!(d.while_running(&limits, 1_000), (DEFAULT_MAX_RUN_LIFETIME, DeadlineSource::Lifetime));
        // A Cancel-After of 2 h, started at once: 2 h, not 30 min.
        let d = Deadlines::new(&limits, 0, Some(7_200_000));
        assert_eq!(d.while_running(&limits, 0), (7_200_000, DeadlineSource::PerPrediction));
        // Without a lifetime and a Cancel-After, the per-prediction deadline
        // still replaces the predict timeout.
        let no_lifetime = Limits { max_run_lifetime: 0, predict_timeout: 60_000 };
        let d = Deadlines::new(&no_lifetime, 0, Some(600_000));
        assert_eq!(d.while_running(&no_lifetime, 0), (600_000, DeadlineSource::PerPrediction));
        // 0 is the 30 min default of the fallback.
        let d = Deadlines::new(&Limits { max_run_lifetime: 0, predict_timeout: 0 }, 0, None);
        assert_eq!(
            d.while_running(&Limits { max_run_lifetime: 0, predict_timeout: 0 }, 5),
            (5 + DEFAULT_PREDICT_TIMEOUT, DeadlineSource::PredictTimeout)
        );
    }

    #[test]
    fn expiry_outcomes() {
        let limits = Limits { max_run_lifetime: 60_000, predict_timeout: 0 };
        let d = Deadlines::new(&limits, 1000, Some(10_000));
        assert_eq!(d.at_dequeue(11_000).unwrap().status, Status::Aborted);
        let d = Deadlines::new(&limits, 1000, None);
        assert_eq!(d.at_dequeue(61_000).unwrap().status, Status::Failed);
        assert_eq!(Ending::expired_while_running(DeadlineSource::PerPrediction).status, Status::Canceled);
        assert_eq!(Ending::expired_while_running(DeadlineSource::PredictTimeout).status, Status::Failed);
        // Cancel-After above the lifetime is capped by it.
        assert_eq!(limits.deadline(0, Some(3_600_000)), Some(60_000));
    }

    proptest! {
        #[test]
        fn deadline_is_capped_and_never_before_creation(
            created in 0u64..1 << 45, after in 5_000u64..1 << 30, lifetime in 0u64..1 << 30,
        ) {
            let limits = Limits { max_run_lifetime: lifetime, predict_timeout: 0 };
            let d = limits.deadline(created, Some(after)).unwrap();
            prop_assert!(d >= created);
            prop_assert!(d - created <= after);
            if lifetime > 0 { prop_assert!(d - created <= lifetime); }
        }

        #[test]
        fn dequeue_decision_is_monotone_in_time(
            created in 0u64..1 << 40, after in proptest::option::of(5_000u64..1 << 25),
            lifetime in 0u64..1 << 25, t1 in 0u64..1 << 26, dt in 0u64..1 << 26,
        ) {
            let limits = Limits { max_run_lifetime: lifetime, predict_timeout: 0 };
            let d = Deadlines::new(&limits, created, after);
            let early = d.at_dequeue(created + t1);
            let late = d.at_dequeue(created + t1 + dt);
            // Once expired, always expired, and for the same reason.
            if let Some(e) = early { prop_assert_eq!(Some(e), late); }
            if let Some(e) = d.at_dequeue(created + t1) {
                prop_assert!(matches!(e.status, Status::Aborted | Status::Failed));
                prop_assert_eq!(e.status == Status::Aborted, after.is_some() && d.before_start().unwrap().1 == DeadlineSource::PerPrediction);
            }
        }

        /// The running deadline never passes the lifetime or the
        /// `Cancel-After` the prediction was created with, and the predict
        /// timeout decides it exactly when there is neither.
        #[test]
        fn running_deadline_follows_the_priority(
            created in 0u64..1 << 40, after in proptest::option::of(5_000u64..1 << 25),
            lifetime in 0u64..1 << 25, wait in 0u64..1 << 25, timeout in 0u64..1 << 25,
            other_timeout in 0u64..1 << 25,
        ) {
            let limits = Limits { max_run_lifetime: lifetime, predict_timeout: timeout };
            let d = Deadlines::new(&limits, created, after);
            let started = created + wait;
            let (at, source) = d.while_running(&limits, started);
            if lifetime > 0 { prop_assert!(at <= created + lifetime); }
            if let Some(after) = after { prop_assert!(at <= created + after); }
            // The running deadline is the same deadline that applied while
            // it waited, when it had one.
            prop_assert_eq!(d.before_start().is_some(), source != DeadlineSource::PredictTimeout);
            if let Some(before) = d.before_start() { prop_assert_eq!((at, source), before); }
            if source == DeadlineSource::PredictTimeout {
                prop_assert!(after.is_none() && lifetime == 0);
                prop_assert_eq!(at, started + limits.predict_timeout());
            } else {
                // With a deadline the predict timeout plays no part.
                let other = Limits { predict_timeout: other_timeout, ..limits };
                prop_assert_eq!(d.while_running(&other, started), (at, source));
            }
        }

        #[test]
        fn transitions_only_move_forward(a in 0usize..6, b in 0usize..6) {
            let (from, to) = (Status::ALL[a], Status::ALL[b]);
            if from.can_become(to) {
                prop_assert!(!from.is_terminal());
                prop_assert!(b > a);
            }
            prop_assert_eq!(Status::parse(from.as_str()), Some(from));
        }

        #[test]
        fn cancel_after_seconds_round_trip(secs in 5u64..10_000_000) {
            prop_assert_eq!(parse_cancel_after(&secs.to_string()), Ok(secs * 1000));
            prop_assert_eq!(parse_cancel_after(&format!("{secs}s")), Ok(secs * 1000));
        }
    }
}
