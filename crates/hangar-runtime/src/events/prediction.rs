//! A prediction's (or training's) event, made when it ends — from its
//! stored record, which `Executor::ended` hands over, and from what its
//! last run learned in this process ([`Runs`]) — with Replicate's
//! estimates of its billing metrics (seed 001, "Director-Estimated"
//! counts): input tokens from the input's string fields whose name holds
//! `prompt`, output tokens and images from the output.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hangar_core::{AccountId, ErrorCode, Millis, ReplicaId, RequestKind};
use hangar_predictions::record::{JobKind, Record};
use serde_json::Value;

use super::{estimate_tokens, InferenceEvent};
use crate::serve::{replica_name, ModelRuntime};

/// Replicate's input-token estimate: words × 4/3 of every string value
/// whose key contains `prompt` (`prompt`, `system_prompt`, …).
pub fn input_tokens(input: &Value) -> u64 {
    let Some(fields) = input.as_object() else { return 0 };
    fields
        .iter()
        .filter(|(k, _)| k.contains("prompt"))
        .filter_map(|(_, v)| v.as_str())
        .map(estimate_tokens)
        .sum()
}

/// Replicate's output-token estimate: a string's words × 4/3, an array's
/// length (a streamed item is a token).
pub fn output_tokens(output: &Value) -> u64 {
    match output {
        Value::String(s) => estimate_tokens(s),
        Value::Array(items) => items.len() as u64,
        _ => 0,
    }
}

/// Images in an output: its strings (alone or in an array) that are image
/// data URLs or name an image file. Replicate's Director counts any
/// string; reading the string keeps text models at 0. Only a string's
/// ends are read (a data URL may be megabytes).
pub fn images(output: &Value) -> u64 {
    let is_image = |v: &Value| {
        v.as_str().is_some_and(|s| {
            let s = s.trim().as_bytes();
            let starts = |p: &[u8]| s.len() >= p.len() && s[..p.len()].eq_ignore_ascii_case(p);
            let path = s.split(|b| *b == b'?' || *b == b'#').next().unwrap_or_default();
            let ends = |ext: &[u8]| {
                path.len() >= ext.len() && path[path.len() - ext.len()..].eq_ignore_ascii_case(ext)
            };
            starts(b"data:image/")
                || [&b".png"[..], b".jpg", b".jpeg", b".webp", b".gif"].iter().any(|e| ends(e))
        })
    };
    match output {
        Value::Array(items) => items.iter().filter(|v| is_image(v)).count() as u64,
        v => u64::from(is_image(v)),
    }
}

/// What a prediction's run learned in this process, for its event.
#[derive(Debug, Clone, Default)]
pub struct RunFacts {
    /// The replica it ran on and that replica's node.
    pub replica: Option<(ReplicaId, Option<String>)>,
    /// Its first output, Unix ms.
    pub first_output: Option<Millis>,
    /// Its position in the line when it joined it, if it waited there.
    pub queued_at: Option<NonZeroU32>,
    /// When its run here ended (for pruning: an end written by another
    /// gateway is never told here).
    over: Option<Instant>,
}

/// Facts of the predictions run in this process, by id, from their run to
/// their end ([`Runs::take`]). Facts of a run whose end another gateway
/// wrote are pruned [`Runs::KEEP`] after the run.
#[derive(Default)]
pub struct Runs(Mutex<HashMap<String, RunFacts>>);

impl Runs {
    /// How long facts of a run that ended wait to be taken.
    pub const KEEP: Duration = Duration::from_secs(600);

    fn with<T>(&self, id: &str, f: impl FnOnce(&mut RunFacts) -> T) -> T {
        let mut runs = self.0.lock().expect("never poisoned: no panics while held");
        match runs.get_mut(id) {
            Some(facts) => f(facts),
            None => f(runs.entry(id.to_owned()).or_default()),
        }
    }

    /// Prediction `id` runs on `replica` of `node` now, having joined the
    /// line at `queued_at` or not.
    pub fn admitted(
        &self,
        id: &str,
        replica: ReplicaId,
        node: Option<String>,
        queued_at: Option<NonZeroU32>,
    ) {
        self.with(id, |f| {
            f.replica = Some((replica, node));
            f.queued_at = f.queued_at.or(queued_at);
            f.over = None;
        });
    }

    /// Prediction `id` gave its first output at `at` (Unix ms).
    pub fn first_output(&self, id: &str, at: Millis) {
        self.with(id, |f| {
            f.first_output.get_or_insert(at);
        });
    }

    /// Prediction `id`'s run here ended at `now` (its end may be told
    /// next); facts of runs over for longer than [`Runs::KEEP`] go.
    pub fn run_over(&self, id: &str, now: Instant) {
        let mut runs = self.0.lock().expect("never poisoned: no panics while held");
        if let Some(f) = runs.get_mut(id) {
            f.over = Some(now);
        }
        runs.retain(|_, f| f.over.is_none_or(|over| now.saturating_duration_since(over) < Self::KEEP));
    }

    /// The facts of prediction `id`, which ended.
    pub fn take(&self, id: &str) -> Option<RunFacts> {
        self.0.lock().expect("never poisoned: no panics while held").remove(id)
    }

    /// Predictions with facts kept.
    pub fn len(&self) -> usize {
        self.0.lock().expect("never poisoned: no panics while held").len()
    }

    /// Whether none are.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The kind of request a job is counted as.
pub(crate) fn request_kind(kind: JobKind) -> RequestKind {
    match kind {
        JobKind::Prediction | JobKind::Request | JobKind::Procedure => RequestKind::Prediction,
        JobKind::Training => RequestKind::Training,
    }
}

/// The event of `record`, which ended with `code` (none: it succeeded),
/// on `rt`'s model, with what its run here learned; `None` for a record
/// whose account does not parse (stored accounts are checked when made).
pub fn prediction_event(
    rt: &ModelRuntime,
    record: &Record,
    code: Option<ErrorCode>,
    facts: Option<RunFacts>,
) -> Option<InferenceEvent> {
    let account: AccountId = record.account.parse().ok()?;
    let facts = facts.unwrap_or_default();
    let end = record.completed_at.unwrap_or_else(crate::serve::wall_ms);
    let since = |from: Millis, to: Millis| to.saturating_sub(from);
    let started = record.started_at;
    let output = record.output.as_ref().filter(|_| code.is_none());
    let key = &rt.config().key;
    let mut event = InferenceEvent {
        ts_ms: end,
        kind: request_kind(record.kind),
        id: record.id.clone(),
        account,
        model: record.model.clone(),
        replica: facts.replica.as_ref().map(|(r, _)| replica_name(key, *r)),
        node: facts.replica.and_then(|(_, node)| node),
        status: code.map_or(200, ErrorCode::http_status),
        code,
        queue_ms: since(record.created_at, started.unwrap_or(end)),
        inference_ms: started.map_or(0, |s| since(s, end)),
        total_ms: since(record.created_at, end),
        ttft_ms: facts.first_output.map(|f| since(record.created_at, f)),
        input_tokens: input_tokens(&record.input),
        output_tokens: output.map_or(0, output_tokens),
        tokens_estimated: true,
        images: output.map_or(0, images),
        cost: Default::default(),
        queue_position: facts.queued_at.map(NonZeroU32::get),
        steps: Vec::new(),
    };
    event.price(&rt.config().billing);
    Some(event)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn replicates_estimates_read_prompt_keys_arrays_and_images() {
        let input =
            json!({"prompt": "a cat on a mat", "system_prompt": "be kind", "seed": 3, "image": "x y z"});
        assert_eq!(input_tokens(&input), 7 + 3);
        assert_eq!(output_tokens(&json!(["a", "b", "c"])), 3);
        assert_eq!(output_tokens(&json!("one two three")), 4);
        assert_eq!(output_tokens(&json!({"x": 1})), 0);
        let pictures = json!(["https://x/o/0.png?sig=1", "data:image/webp;base64,AAAA", "a caption"]);
        assert_eq!(images(&pictures), 2);
        assert_eq!(images(&json!("https://x/out.JPG")), 1);
        assert_eq!(images(&json!(" DATA:IMAGE/png;base64,AA")), 1);
        assert_eq!(images(&json!(["Hello", " world", ".png is a name"])), 0);
        assert_eq!(images(&Value::Null), 0);
    }

    #[test]
    fn facts_wait_for_their_end_and_those_never_told_are_pruned() {
        let runs = Runs::default();
        let t0 = Instant::now();
        runs.admitted("p1", ReplicaId::from_u128(1), Some("n1".to_owned()), None);
        runs.first_output("p1", 1_000);
        runs.first_output("p1", 2_000);
        runs.admitted("p2", ReplicaId::from_u128(2), None, None);
        runs.run_over("p1", t0);
        runs.run_over("p2", t0);
        let facts = runs.take("p1").unwrap();
        assert_eq!(facts.first_output, Some(1_000), "the first output counts");
        assert_eq!(facts.replica.unwrap().1.as_deref(), Some("n1"));
        assert!(runs.take("p1").is_none());
        // p2's end was written elsewhere: its facts go after KEEP.
        runs.admitted("p3", ReplicaId::from_u128(3), None, None);
        runs.run_over("p3", t0 + Runs::KEEP);
        assert!(runs.take("p2").is_none());
        assert_eq!(runs.len(), 1);
    }
}
