//! Bounds every API applies alike, so that a request the OpenAI gateway
//! refuses is refused by the predictions API too, with the same words.

/// The most output tokens one request may ask for (`max_tokens`,
/// `max_completion_tokens` in the OpenAI API; `max_tokens`,
/// `max_new_tokens` in a prediction's input): 2^20, above any model's
/// output length and far inside the 32-bit integer engines parse it into.
/// A request within it may still be refused by its engine, for exceeding
/// the model's context.
pub const MAX_OUTPUT_TOKENS: u64 = 1 << 20;

/// Whether `value` — a request's count of output tokens, `None` when it is
/// not a non-negative integer — is one a request may ask for: 1 to
/// [`MAX_OUTPUT_TOKENS`]. The error is what the caller puts after the
/// field's name.
pub fn check_output_tokens(value: Option<u64>) -> Result<u64, String> {
    match value {
        Some(n) if (1..=MAX_OUTPUT_TOKENS).contains(&n) => Ok(n),
        Some(n) if n > MAX_OUTPUT_TOKENS => {
            Err(format!("{n} is above {MAX_OUTPUT_TOKENS}, the most output tokens a request may ask for"))
        }
        _ => Err(format!("must be an integer from 1 to {MAX_OUTPUT_TOKENS}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_tokens_are_one_to_the_bound() {
        assert_eq!(check_output_tokens(Some(1)), Ok(1));
        assert_eq!(check_output_tokens(Some(MAX_OUTPUT_TOKENS)), Ok(MAX_OUTPUT_TOKENS));
        let e = check_output_tokens(Some(MAX_OUTPUT_TOKENS + 1)).unwrap_err();
        assert_eq!(e, "1048577 is above 1048576, the most output tokens a request may ask for");
        assert_eq!(check_output_tokens(Some(0)).unwrap_err(), "must be an integer from 1 to 1048576");
        assert!(check_output_tokens(None).is_err());
    }
}
