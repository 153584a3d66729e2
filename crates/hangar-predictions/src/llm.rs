//! Language-model inputs, as Replicate's language models take them, and
//! their mapping onto an OpenAI-style completion call.

use hangar_core::limits::{check_output_tokens, MAX_OUTPUT_TOKENS};
use serde_json::{json, Map, Value};

/// A field of the input that is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("input.{field}: {message}")]
pub struct InvalidField {
    /// The field (`prompt`, `max_tokens`…).
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

/// A validated language-model input.
#[derive(Debug, Clone, PartialEq)]
pub struct LlmInput {
    /// The prompt.
    pub prompt: String,
    /// Prepended to the prompt.
    pub system_prompt: Option<String>,
    /// Output tokens (`max_tokens` or `max_new_tokens`).
    pub max_tokens: Option<u64>,
    /// Sampling temperature.
    pub temperature: Option<f64>,
    /// Nucleus sampling.
    pub top_p: Option<f64>,
    /// Stop sequences (a string or a list).
    pub stop: Vec<String>,
    /// The LoRA adapter of the model to run with (Workers AI's `lora`).
    pub lora: Option<String>,
}

fn invalid(field: &str, message: &str) -> InvalidField {
    InvalidField { field: field.into(), message: message.into() }
}

impl LlmInput {
    /// Validates `input` (an object; unknown fields are refused so a typo
    /// does not silently change nothing).
    pub fn parse(input: &Value) -> Result<LlmInput, InvalidField> {
        let Value::Object(map) = input else { return Err(invalid("", "input must be an object")) };
        const KNOWN: [&str; 8] = [
            "prompt",
            "system_prompt",
            "max_tokens",
            "max_new_tokens",
            "temperature",
            "top_p",
            "stop",
            "lora",
        ];
        if let Some(k) = map.keys().find(|k| !KNOWN.contains(&k.as_str())) {
            return Err(invalid(k, &format!("unknown field; this model takes {}", KNOWN.join(", "))));
        }
        let string = |f: &str| -> Result<Option<String>, InvalidField> {
            match map.get(f) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(invalid(f, "must be a string")),
            }
        };
        let number = |f: &str, lo: f64, hi: f64| -> Result<Option<f64>, InvalidField> {
            match map.get(f) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Number(n)) => {
                    let v = n.as_f64().unwrap_or(f64::NAN);
                    if (lo..=hi).contains(&v) {
                        Ok(Some(v))
                    } else {
                        Err(invalid(f, &format!("must be between {lo} and {hi}")))
                    }
                }
                Some(_) => Err(invalid(f, "must be a number")),
            }
        };
        // Bounded as the OpenAI API's `max_tokens` is.
        let count = |f: &str| -> Result<Option<u64>, InvalidField> {
            match map.get(f) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => check_output_tokens(v.as_u64()).map(Some).map_err(|m| invalid(f, &m)),
            }
        };
        let prompt = string("prompt")?.ok_or_else(|| invalid("prompt", "is required"))?;
        let stop = match map.get("stop") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) if s.is_empty() => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(items)) => items
                .iter()
                .map(|i| {
                    i.as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| invalid("stop", "must be a string or a list of strings"))
                })
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(invalid("stop", "must be a string or a list of strings")),
        };
        Ok(LlmInput {
            prompt,
            system_prompt: string("system_prompt")?,
            max_tokens: count("max_tokens")?.or(count("max_new_tokens")?),
            temperature: number("temperature", 0.0, 2.0)?,
            top_p: number("top_p", 0.0, 1.0)?,
            stop,
            lora: string("lora")?,
        })
    }

    /// The streaming `/v1/completions` body for the engine serving `model`.
    pub fn completion_body(&self, model: &str) -> Value {
        let prompt = match &self.system_prompt {
            Some(s) if !s.is_empty() => format!("{s}\n\n{}", self.prompt),
            _ => self.prompt.clone(),
        };
        let mut body = Map::new();
        body.insert("model".into(), json!(model));
        body.insert("prompt".into(), json!(prompt));
        body.insert("stream".into(), json!(true));
        if let Some(n) = self.max_tokens {
            body.insert("max_tokens".into(), json!(n));
        }
        if let Some(t) = self.temperature {
            body.insert("temperature".into(), json!(t));
        }
        if let Some(p) = self.top_p {
            body.insert("top_p".into(), json!(p));
        }
        if !self.stop.is_empty() {
            body.insert("stop".into(), json!(self.stop));
        }
        Value::Object(body)
    }
}

/// The OpenAPI schema of a language-model version, in cog's shape
/// (`components.schemas.Input` / `Output`).
pub fn openapi_schema() -> Value {
    json!({
        "openapi": "3.0.2",
        "info": {"title": "Cog", "version": "0.1.0"},
        "paths": {},
        "components": {"schemas": {
            "Input": {
                "type": "object",
                "title": "Input",
                "required": ["prompt"],
                "properties": {
                    "prompt": {"type": "string", "title": "Prompt", "x-order": 0},
                    "system_prompt": {"type": "string", "title": "System Prompt", "x-order": 1},
                    "max_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_OUTPUT_TOKENS, "title": "Max Tokens", "x-order": 2},
                    "max_new_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_OUTPUT_TOKENS, "title": "Max New Tokens", "x-order": 3},
                    "temperature": {"type": "number", "minimum": 0, "maximum": 2, "title": "Temperature", "x-order": 4},
                    "top_p": {"type": "number", "minimum": 0, "maximum": 1, "title": "Top P", "x-order": 5},
                    "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}], "title": "Stop", "x-order": 6}
                }
            },
            "Output": {
                "type": "array",
                "items": {"type": "string"},
                "title": "Output",
                "x-cog-array-type": "iterator",
                "x-cog-array-display": "concatenate"
            }
        }}
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_replicate_fields_to_a_completion() {
        let i = LlmInput::parse(&json!({"prompt": "hi", "system_prompt": "be brief", "max_new_tokens": 8, "temperature": 0.5, "stop": "\n"})).unwrap();
        let b = i.completion_body("m/x");
        assert_eq!(b["prompt"], "be brief\n\nhi");
        assert_eq!(b["max_tokens"], 8);
        assert_eq!(b["stop"], json!(["\n"]));
        assert_eq!(b["stream"], true);
    }

    #[test]
    fn output_tokens_are_bounded_as_the_openai_apis_are() {
        let at = |n: u64| LlmInput::parse(&json!({"prompt": "x", "max_new_tokens": n}));
        assert_eq!(at(MAX_OUTPUT_TOKENS).unwrap().max_tokens, Some(MAX_OUTPUT_TOKENS));
        let e = at(MAX_OUTPUT_TOKENS + 1).unwrap_err();
        assert_eq!(e.field, "max_new_tokens");
        assert_eq!(
            e.to_string(),
            "input.max_new_tokens: 1048577 is above 1048576, the most output tokens a request may ask for"
        );
    }

    #[test]
    fn errors_name_the_field() {
        for (input, field) in [
            (json!({}), "prompt"),
            (json!({"prompt": 3}), "prompt"),
            (json!({"prompt": "x", "max_tokens": "8"}), "max_tokens"),
            (json!({"prompt": "x", "max_tokens": 0}), "max_tokens"),
            (json!({"prompt": "x", "max_tokens": MAX_OUTPUT_TOKENS + 1}), "max_tokens"),
            (json!({"prompt": "x", "max_new_tokens": u64::MAX}), "max_new_tokens"),
            (json!({"prompt": "x", "max_tokens": 8, "max_new_tokens": 1e30}), "max_new_tokens"),
            (json!({"prompt": "x", "top_p": 3}), "top_p"),
            (json!({"prompt": "x", "stop": [1]}), "stop"),
            (json!({"prompt": "x", "promt": "y"}), "promt"),
        ] {
            assert_eq!(LlmInput::parse(&input).unwrap_err().field, field, "{input}");
        }
    }
}
