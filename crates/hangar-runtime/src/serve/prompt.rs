//! The prompt text of an OpenAI request, for KV-aware routing.
//!
//! The gateway does not run the model's tokenizer or chat template; it
//! only needs text in which equal prompts (and equal prefixes: the same
//! system prompt, the same earlier turns) read the same, so the
//! approximate KV router can hash it in blocks.

use serde_json::Value;

/// The prompt of a chat (`messages`), completion (`prompt`) or embedding
/// (`input`) request, as one string; empty if there is none.
pub(crate) fn prompt_text(body: &Value) -> String {
    text_of(body, true)
}

/// The prompt's words alone (no `role: ` before each message), for a
/// token estimate.
pub(crate) fn prompt_words(body: &Value) -> String {
    text_of(body, false)
}

fn text_of(body: &Value, roles: bool) -> String {
    let mut text = String::new();
    if let Some(messages) = body.get("messages").and_then(Value::as_array) {
        for m in messages {
            if roles {
                text.push_str(m.get("role").and_then(Value::as_str).unwrap_or(""));
                text.push_str(": ");
            }
            push_content(&mut text, m.get("content"));
            text.push('\n');
        }
    } else {
        push_content(&mut text, body.get("prompt").or_else(|| body.get("input")));
    }
    text
}

/// A string, or the strings (and `text` parts) of an array, in order.
fn push_content(text: &mut String, content: Option<&Value>) {
    match content {
        Some(Value::String(s)) => text.push_str(s),
        Some(Value::Array(parts)) => {
            for p in parts {
                match p {
                    Value::String(s) => text.push_str(s),
                    Value::Object(_) => text.push_str(p.get("text").and_then(Value::as_str).unwrap_or("")),
                    _ => {}
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn chat_completion_and_embedding_prompts_read_as_text() {
        let chat = json!({"messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]}
        ]});
        assert_eq!(prompt_text(&chat), "system: be brief\nuser: hi\n");
        assert_eq!(prompt_text(&json!({"prompt": "once upon"})), "once upon");
        assert_eq!(prompt_text(&json!({"input": ["a", "b"]})), "ab");
        assert_eq!(prompt_text(&json!({"prompt": [1, 2, 3]})), "");
        assert_eq!(prompt_words(&chat).split_whitespace().count(), 3);
    }
}
