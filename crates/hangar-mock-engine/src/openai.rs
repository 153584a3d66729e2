//! The parts of the OpenAI API the mock speaks, as typed requests.
//!
//! Unknown fields are ignored (clients send many sampling options the mock
//! has no use for); known fields are type-checked, and a wrong one is
//! reported with its path (`messages[1].content`).

use serde::Deserialize;

use crate::error::ApiError;

/// Parses a JSON body, naming the field at fault on error.
pub fn parse<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            ApiError::bad_request(format!("the body is not valid JSON: {inner}"), None)
        } else if path == "." {
            ApiError::bad_request(format!("invalid request body: {inner}"), None)
        } else {
            ApiError::bad_request(format!("invalid field `{path}`: {inner}"), Some(path))
        }
    })
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    /// The served model's name.
    pub model: String,
    /// The conversation.
    pub messages: Vec<Message>,
    /// Output tokens (legacy name).
    pub max_tokens: Option<u32>,
    /// Output tokens (current name; wins over `max_tokens`).
    pub max_completion_tokens: Option<u32>,
    /// Stream chunks as server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Number of choices; only 1 is supported.
    pub n: Option<u32>,
}

/// One chat message.
#[derive(Debug, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, `tool`, `developer`.
    pub role: String,
    /// Text, or a list of content parts (text parts are used).
    #[serde(default)]
    pub content: Option<Content>,
}

/// A message's content.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content parts.
    Parts(Vec<Part>),
}

/// One content part; non-text parts count as no text.
#[derive(Debug, Deserialize)]
pub struct Part {
    /// The part's type (`text`, `image_url`, …).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    pub text: Option<String>,
}

/// `stream_options`.
#[derive(Debug, Deserialize, Default)]
pub struct StreamOptions {
    /// Send a last chunk with token usage.
    #[serde(default)]
    pub include_usage: bool,
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    /// The served model's name.
    pub model: String,
    /// Text, token ids, or a one-element list of either.
    pub prompt: PromptInput,
    /// Output tokens (default 16, as OpenAI's).
    pub max_tokens: Option<u32>,
    /// Stream chunks as server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Number of choices; only 1 is supported.
    pub n: Option<u32>,
}

/// `POST /v1/embeddings`.
#[derive(Debug, Deserialize)]
pub struct EmbeddingRequest {
    /// The served model's name.
    pub model: String,
    /// What to embed.
    pub input: PromptInput,
    /// `float` (default) or `base64` (little-endian f32s).
    pub encoding_format: Option<String>,
    /// Fewer dimensions than the model's, if wanted.
    pub dimensions: Option<usize>,
}

/// A prompt or embedding input as OpenAI accepts it.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    /// One text.
    Text(String),
    /// One sequence of token ids.
    Tokens(Vec<u32>),
    /// Several texts.
    Texts(Vec<String>),
    /// Several token sequences.
    TokenLists(Vec<Vec<u32>>),
}

/// An input as text or as token ids.
#[derive(Debug, Clone)]
pub enum Input {
    /// Text, to be tokenized.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
}

impl PromptInput {
    /// The inputs, in order.
    pub fn into_inputs(self) -> Vec<Input> {
        match self {
            Self::Text(t) => vec![Input::Text(t)],
            Self::Tokens(t) => vec![Input::Tokens(t)],
            Self::Texts(ts) => ts.into_iter().map(Input::Text).collect(),
            Self::TokenLists(ts) => ts.into_iter().map(Input::Tokens).collect(),
        }
    }
}

impl ChatRequest {
    /// The prompt text: each message as `<|role|>content`, then the
    /// assistant's turn marker, as chat templates render conversations.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for m in &self.messages {
            out.push_str("<|");
            out.push_str(&m.role);
            out.push_str("|>\n");
            match &m.content {
                Some(Content::Text(t)) => out.push_str(t),
                Some(Content::Parts(parts)) => {
                    for p in parts.iter().filter(|p| p.kind == "text") {
                        out.push_str(p.text.as_deref().unwrap_or(""));
                    }
                }
                None => {}
            }
            out.push('\n');
        }
        out.push_str("<|assistant|>\n");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrong_fields_are_named_with_their_path() {
        let e = parse::<ChatRequest>(br#"{"model": "m", "messages": [{"role": "user", "content": 5}]}"#)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content"));
        let e = parse::<ChatRequest>(br#"{"model": "m"}"#).unwrap_err();
        assert!(e.message.contains("missing field `messages`"), "{}", e.message);
        let e = parse::<ChatRequest>(br#"{"model": "m", "messages": [], "max_tokens": "ten"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = parse::<ChatRequest>(b"{\"model\": ").unwrap_err();
        assert!(e.message.starts_with("the body is not valid JSON"), "{}", e.message);
    }

    #[test]
    fn chat_renders_roles_and_text_parts() {
        let r: ChatRequest = parse(
            br#"{"model": "m", "messages": [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]}]}"#,
        )
        .unwrap();
        assert_eq!(r.render(), "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n");
    }
}
