//! One inference event: what a synchronous request or a prediction did,
//! who it was for and what it costs.

use hangar_core::{AccountId, ErrorCode, RequestKind, StepAt};
use serde::{Deserialize, Serialize};

use super::billing::{BillingConfig, Cost};

/// One request's or one prediction's record, as the sink writes it (one
/// JSON object per line, or one Redis stream entry's `e` field).
///
/// Its words are the ones `/metrics` uses: `kind` is a
/// [`RequestKind`], `code` an [`ErrorCode`] (none when it succeeded), and
/// `status` the HTTP status it is counted under there — a prediction's
/// is the one a synchronous request ending the same way gets.
///
/// Times are milliseconds. `queue_ms` runs from arrival (a prediction's
/// creation) to the permit (its start), `inference_ms` from the permit to
/// the end, `total_ms` from arrival to the end. Token counts are the
/// engine's `usage` when the model's `trust_usage` holds and the engine
/// gave one, else estimated as words × 4/3 (seed 001: Replicate's
/// estimate), which `tokens_estimated` says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InferenceEvent {
    /// When it ended, Unix ms.
    pub ts_ms: u64,
    /// A synchronous request, a prediction or a training.
    pub kind: RequestKind,
    /// The request id (`x-request-id`) or the prediction id.
    pub id: String,
    /// The account it ran for.
    pub account: AccountId,
    /// The model key.
    pub model: String,
    /// The replica that served it (`<model>:<replica_id>`), if one did.
    pub replica: Option<String>,
    /// The node of that replica, when known.
    pub node: Option<String>,
    /// The HTTP status it is counted under (499: the client left).
    pub status: u16,
    /// Why it did not succeed; none when it did.
    pub code: Option<ErrorCode>,
    /// Arrival to permit.
    pub queue_ms: u64,
    /// Permit to the end of the answer (0 without a permit).
    pub inference_ms: u64,
    /// Arrival to the end.
    pub total_ms: u64,
    /// Arrival to the first byte (requests) or first output (predictions).
    pub ttft_ms: Option<u64>,
    /// Prompt tokens.
    pub input_tokens: u64,
    /// Generated tokens.
    pub output_tokens: u64,
    /// The token counts are words × 4/3, not the engine's.
    pub tokens_estimated: bool,
    /// Images produced (0 for text).
    pub images: u64,
    /// The billing units of the model's prices (zero without prices).
    pub cost: Cost,
    /// Its position in its model's line when it joined it; none when a
    /// permit was free on arrival (and for predictions, whose logs show
    /// it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_position: Option<u32>,
    /// Where it went, step by step (a synchronous request's; a
    /// prediction's are in its logs): received, queued, dispatched,
    /// running, completed or error.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steps: Vec<StepAt>,
}

impl InferenceEvent {
    /// Fills `cost` from the event's own figures and `billing`.
    pub fn price(&mut self, billing: &BillingConfig) {
        self.cost = billing.cost(self.inference_ms, self.input_tokens, self.output_tokens, self.images);
    }
}

/// Replicate's token estimate: whitespace-separated words × 4/3, rounded up.
pub fn estimate_tokens(text: &str) -> u64 {
    let words = text.split_whitespace().count() as u64;
    (words * 4).div_ceil(3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_words_times_four_thirds_rounded_up() {
        assert_eq!(estimate_tokens(""), 0);
        assert_eq!(estimate_tokens("  \n "), 0);
        assert_eq!(estimate_tokens("one"), 2);
        assert_eq!(estimate_tokens("one two three"), 4);
        assert_eq!(estimate_tokens("a b c d e f"), 8);
    }
}
