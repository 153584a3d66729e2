//! Dedicated schedules: windows of time in which a model keeps a number of
//! dedicated replicas.

use std::collections::BTreeMap;

use hangar_core::{Millis, ModelKey};
use serde::{Deserialize, Serialize};

use crate::error::ScheduleError;
use crate::outcome::ReplicaRequest;

/// "Keep `replicas` dedicated replicas of `model` from `start_ms` until
/// `end_ms`" (half-open: active when `start_ms <= now < end_ms`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Window {
    /// The model.
    #[serde(rename = "model")]
    pub model_key: ModelKey,
    /// Dedicated replicas during the window (default 1).
    #[serde(default = "one")]
    pub replicas: u32,
    /// First instant of the window.
    pub start_ms: Millis,
    /// First instant after it.
    pub end_ms: Millis,
}

fn one() -> u32 {
    1
}

/// A set of windows, validated.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Schedule {
    windows: Vec<Window>,
}

impl Schedule {
    /// Validates the windows: each must end after it starts and ask for at
    /// least one replica.
    pub fn new(windows: Vec<Window>) -> Result<Self, ScheduleError> {
        for (index, w) in windows.iter().enumerate() {
            let why = if w.end_ms <= w.start_ms {
                format!("end_ms {} must be after start_ms {}", w.end_ms, w.start_ms)
            } else if w.replicas == 0 {
                "replicas must be at least 1 (drop the window to stop dedicating)".to_owned()
            } else {
                continue;
            };
            return Err(ScheduleError { index, model: w.model_key.clone(), why });
        }
        Ok(Self { windows })
    }

    /// The windows.
    pub fn windows(&self) -> &[Window] {
        &self.windows
    }

    /// The dedicated requests in force at `now`, one per model (overlapping
    /// windows of one model take the largest replica count), by model key.
    pub fn requests_at(&self, now: Millis) -> Vec<ReplicaRequest> {
        let mut active: BTreeMap<&ModelKey, u32> = BTreeMap::new();
        for w in self.windows.iter().filter(|w| w.start_ms <= now && now < w.end_ms) {
            let n = active.entry(&w.model_key).or_default();
            *n = (*n).max(w.replicas);
        }
        active
            .into_iter()
            .map(|(k, replicas)| ReplicaRequest { model_key: k.clone(), replicas, dedicated: true })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(model: &str, replicas: u32, start_ms: Millis, end_ms: Millis) -> Window {
        Window { model_key: model.parse().unwrap(), replicas, start_ms, end_ms }
    }

    #[test]
    fn windows_are_half_open_and_overlaps_take_the_max() {
        let s = Schedule::new(vec![w("a", 1, 0, 10), w("a", 3, 5, 20), w("b", 2, 10, 20)]).unwrap();
        let at = |t| {
            s.requests_at(t).into_iter().map(|r| (r.model_key.to_string(), r.replicas)).collect::<Vec<_>>()
        };
        assert_eq!(at(0), vec![("a".into(), 1)]);
        assert_eq!(at(5), vec![("a".into(), 3)]);
        assert_eq!(at(10), vec![("a".into(), 3), ("b".into(), 2)]);
        assert_eq!(at(20), vec![]);
        assert!(s.requests_at(7).iter().all(|r| r.dedicated));
    }

    #[test]
    fn bad_windows_are_named() {
        let e = Schedule::new(vec![w("a", 1, 0, 10), w("b", 1, 10, 10)]).unwrap_err();
        assert_eq!(e.index, 1);
        assert!(e.to_string().contains("schedule[1] (`b`)"), "{e}");
        assert!(Schedule::new(vec![w("a", 0, 0, 10)]).is_err());
    }
}
