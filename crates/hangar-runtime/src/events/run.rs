//! A prediction run's event, with Replicate's estimates of its billing
//! metrics (seed 001, "Director-Estimated" counts): input tokens from the
//! input's string fields whose name holds `prompt`, output tokens and
//! images from the output.

use std::borrow::Cow;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use hangar_predictions::record::JobKind;
use hangar_predictions::Job;
use serde_json::Value;

use super::{estimate_tokens, BillingConfig, EventKind, InferenceEvent, Outcome};

/// What a run learned on its way, for its event.
#[derive(Debug)]
pub struct RunFacts {
    /// When the run began.
    pub start: Instant,
    /// When it got its permit.
    pub admitted: Option<Instant>,
    /// When its first output came.
    pub first_output: Option<Instant>,
    /// The replica's name and node.
    pub replica: Option<(String, Option<String>)>,
}

impl RunFacts {
    /// A run beginning now.
    pub fn new() -> Self {
        RunFacts { start: Instant::now(), admitted: None, first_output: None, replica: None }
    }
}

impl Default for RunFacts {
    fn default() -> Self {
        Self::new()
    }
}

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
/// string; reading the string keeps text models at 0.
pub fn images(output: &Value) -> u64 {
    let is_image = |v: &Value| {
        v.as_str().is_some_and(|s| {
            let lower = s.trim().to_ascii_lowercase();
            let path = lower.split(['?', '#']).next().unwrap_or("");
            lower.starts_with("data:image/")
                || [".png", ".jpg", ".jpeg", ".webp", ".gif"].iter().any(|ext| path.ends_with(ext))
        })
    };
    match output {
        Value::Array(items) => items.iter().filter(|v| is_image(v)).count() as u64,
        v => u64::from(is_image(v)),
    }
}

/// How a run ended, for its event.
pub enum RunEnd<'a> {
    /// With this output.
    Succeeded(&'a Value),
    /// Failed (`lost`: its replica went away; it is run once more).
    Failed(&'static str),
    /// Cancelled.
    Canceled,
}

/// The event of one run of `job`.
pub fn run_event(job: &Job, facts: RunFacts, end: RunEnd<'_>, billing: &BillingConfig) -> InferenceEvent {
    let kind = match job.kind {
        JobKind::Prediction => EventKind::Prediction,
        JobKind::Training => EventKind::Training,
    };
    let now = Instant::now();
    let ms = |d: std::time::Duration| d.as_millis() as u64;
    let admitted = facts.admitted.unwrap_or(now);
    let (outcome, error_code, output) = match end {
        RunEnd::Succeeded(output) => (Outcome::Succeeded, None, Some(output)),
        RunEnd::Failed(code) => (Outcome::Failed, Some(Cow::Borrowed(code)), None),
        RunEnd::Canceled => (Outcome::Canceled, Some(Cow::Borrowed("canceled")), None),
    };
    let (replica, node) = facts.replica.unzip();
    let mut event = InferenceEvent {
        ts_ms: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
        kind,
        id: job.id.clone(),
        account: job.account.clone(),
        model: job.model.clone(),
        replica,
        node: node.flatten(),
        outcome,
        status: 0,
        error_code,
        queue_ms: ms(admitted - facts.start),
        inference_ms: facts.admitted.map_or(0, |a| ms(now - a)),
        total_ms: ms(now - facts.start),
        ttft_ms: facts.first_output.map(|f| ms(f - facts.start)),
        input_tokens: input_tokens(&job.input),
        output_tokens: output.map_or(0, output_tokens),
        tokens_estimated: true,
        images: output.map_or(0, images),
        cost: Default::default(),
    };
    event.price(billing);
    event
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
        assert_eq!(images(&json!(["Hello", " world"])), 0);
        assert_eq!(images(&Value::Null), 0);
    }
}
