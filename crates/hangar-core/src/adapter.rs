//! LoRA adapters: which one a request names, and what is known of it.
//!
//! Most models a platform serves are fine-tunes of a few base models. A
//! fine-tune shipped as a LoRA *adapter* runs on a replica of its base
//! model once the adapter is loaded there, so one base replica serves
//! many fine-tunes. An adapter is named under its base: an
//! [`AdapterRef`] is the base's [`ModelKey`] and the adapter's
//! [`AdapterName`], written `BASE:ADAPTER` — the spelling of OpenAI's
//! `"model"` field for a fine-tune (`"meta/llama-3-8b:acme/support-v2"`).
//! Workers AI names it in a separate `lora` field instead;
//! [`parse_model_field`] reads both spellings into one answer.
//!
//! An [`Adapter`] is a reference and its size in bytes where known (the
//! weight store knows it; a request alone does not): what a replica's
//! adapter slots count against their memory.
//!
//! ```
//! use hangar_core::{parse_model_field, AdapterRef};
//!
//! let a: AdapterRef = "meta/llama-3-8b:acme/support-v2".parse().unwrap();
//! assert_eq!(a.base().as_str(), "meta/llama-3-8b");
//! assert_eq!(a.name().as_str(), "acme/support-v2");
//! assert_eq!(a.to_string(), "meta/llama-3-8b:acme/support-v2");
//!
//! // The OpenAI and the Workers AI spellings name the same adapter.
//! let (base, adapter) = parse_model_field("meta/llama-3-8b", Some("acme/support-v2")).unwrap();
//! assert_eq!(AdapterRef::new(base, adapter.unwrap()), a);
//! let (_, none) = parse_model_field("meta/llama-3-8b", None).unwrap();
//! assert!(none.is_none());
//!
//! let e = "meta/llama-3-8b:".parse::<AdapterRef>().unwrap_err();
//! assert_eq!(e.to_string(), "`meta/llama-3-8b:` has no adapter name after `:`; write BASE:ADAPTER");
//! ```

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::{AdapterName, ByteSize, IdError, ModelKey};

/// An adapter named under its base model: `BASE:ADAPTER`.
///
/// Two references are the same adapter exactly when both parts are equal:
/// the same name under two bases is two adapters (an adapter's weights fit
/// one base's layers only).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct AdapterRef {
    base: ModelKey,
    name: AdapterName,
}

impl AdapterRef {
    /// The adapter `name` of the model `base`.
    pub fn new(base: ModelKey, name: AdapterName) -> Self {
        Self { base, name }
    }

    /// The base model it runs on.
    pub fn base(&self) -> &ModelKey {
        &self.base
    }

    /// Its name under the base.
    pub fn name(&self) -> &AdapterName {
        &self.name
    }
}

impl fmt::Display for AdapterRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.base, self.name)
    }
}

/// Why a model field does not name a model, or an adapter of one.
///
/// Each message quotes the value and says what is wrong with it, so the
/// gateway can put it in a 400 as it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AdapterRefError {
    /// An adapter was expected and the value names only a model.
    #[error("`{value}` names no adapter; write BASE:ADAPTER (e.g. meta/llama-3-8b:acme/support-v2)")]
    NoAdapter {
        /// The value.
        value: String,
    },
    /// Nothing before the `:`.
    #[error("`{value}` has no base model before `:`; write BASE:ADAPTER")]
    EmptyBase {
        /// The value.
        value: String,
    },
    /// Nothing after the `:`.
    #[error("`{value}` has no adapter name after `:`; write BASE:ADAPTER")]
    EmptyAdapter {
        /// The value.
        value: String,
    },
    /// A second `:`: a model is `BASE` or `BASE:ADAPTER`, no more.
    #[error("`{value}` has a second `:` at byte {at}; a model is BASE or BASE:ADAPTER")]
    SecondColon {
        /// The value.
        value: String,
        /// The second colon's byte offset.
        at: usize,
    },
    /// The part before the `:` is not a model key.
    #[error("the base model of `{value}`: {source}")]
    Base {
        /// The value.
        value: String,
        /// What is wrong with the base.
        source: IdError,
    },
    /// The part after the `:` (or the `lora` field) is not an adapter name.
    #[error("the adapter of `{value}`: {source}")]
    Adapter {
        /// The value.
        value: String,
        /// What is wrong with the name.
        source: IdError,
    },
    /// `model` names one adapter and `lora` another.
    #[error("`model` names the adapter `{in_model}` and `lora` names `{lora}`; name it once")]
    Conflict {
        /// The adapter in `model`.
        in_model: String,
        /// The `lora` field.
        lora: String,
    },
}

/// Reads a request's model: `"BASE"` or `"BASE:ADAPTER"` (OpenAI's
/// spelling of a fine-tune), with Workers AI's `lora` field if the request
/// has one. Answers the base and the adapter, if any.
///
/// A `lora` naming the adapter `model` names too is accepted; naming two
/// different ones is [`AdapterRefError::Conflict`]. `lora` is a bare
/// adapter name (its base is the request's model).
pub fn parse_model_field(
    model: &str,
    lora: Option<&str>,
) -> Result<(ModelKey, Option<AdapterName>), AdapterRefError> {
    let (base, in_model) = match model.split_once(':') {
        None => (parse_base(model, model)?, None),
        Some((base, name)) => {
            let r = parse_ref(model, base, name)?;
            (r.base, Some(r.name))
        }
    };
    let adapter = match (in_model, lora) {
        (a, None) => a,
        (None, Some(lora)) => Some(
            lora.parse::<AdapterName>()
                .map_err(|source| AdapterRefError::Adapter { value: lora.to_owned(), source })?,
        ),
        (Some(a), Some(lora)) if a.as_str() == lora => Some(a),
        (Some(a), Some(lora)) => {
            return Err(AdapterRefError::Conflict { in_model: a.to_string(), lora: lora.to_owned() })
        }
    };
    Ok((base, adapter))
}

fn parse_base(value: &str, base: &str) -> Result<ModelKey, AdapterRefError> {
    base.parse().map_err(|source| AdapterRefError::Base { value: value.to_owned(), source })
}

fn parse_ref(value: &str, base: &str, name: &str) -> Result<AdapterRef, AdapterRefError> {
    let owned = || value.to_owned();
    if base.is_empty() {
        return Err(AdapterRefError::EmptyBase { value: owned() });
    }
    if name.is_empty() {
        return Err(AdapterRefError::EmptyAdapter { value: owned() });
    }
    if let Some(k) = name.find(':') {
        return Err(AdapterRefError::SecondColon { value: owned(), at: base.len() + 1 + k });
    }
    let base = parse_base(value, base)?;
    let name = name.parse().map_err(|source| AdapterRefError::Adapter { value: owned(), source })?;
    Ok(AdapterRef { base, name })
}

impl FromStr for AdapterRef {
    type Err = AdapterRefError;

    /// Parses `BASE:ADAPTER`; a value without `:` is
    /// [`AdapterRefError::NoAdapter`].
    fn from_str(s: &str) -> Result<Self, AdapterRefError> {
        match s.split_once(':') {
            None => Err(AdapterRefError::NoAdapter { value: s.to_owned() }),
            Some((base, name)) => parse_ref(s, base, name),
        }
    }
}

impl TryFrom<String> for AdapterRef {
    type Error = AdapterRefError;
    fn try_from(s: String) -> Result<Self, AdapterRefError> {
        s.parse()
    }
}

impl From<AdapterRef> for String {
    fn from(a: AdapterRef) -> String {
        a.to_string()
    }
}

/// An adapter and its size where known: what a replica's adapter slots
/// (`hangar-router`'s `AdapterSlots`) hold and count against their memory.
///
/// The weight store knows every registered adapter's size; a trace row or
/// a request naming an adapter the store was not asked about may not. A
/// driver resolves an unknown size to its configured default before it
/// asks a replica to hold the adapter.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Adapter {
    /// Which adapter.
    pub id: AdapterRef,
    /// Its weights' size, if known.
    pub size: Option<ByteSize>,
}

impl Adapter {
    /// An adapter of known size.
    pub fn sized(id: AdapterRef, size: ByteSize) -> Self {
        Self { id, size: Some(size) }
    }

    /// Its size, or `default` when unknown.
    pub fn size_or(&self, default: ByteSize) -> ByteSize {
        self.size.unwrap_or(default)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_malformed_model_field_is_named_with_what_is_wrong() {
        let e = |s: &str| s.parse::<AdapterRef>().unwrap_err().to_string();
        assert_eq!(
            e("meta/llama"),
            "`meta/llama` names no adapter; write BASE:ADAPTER (e.g. meta/llama-3-8b:acme/support-v2)"
        );
        assert_eq!(e(":acme/x"), "`:acme/x` has no base model before `:`; write BASE:ADAPTER");
        assert_eq!(e("m:"), "`m:` has no adapter name after `:`; write BASE:ADAPTER");
        assert_eq!(e("m:a:b"), "`m:a:b` has a second `:` at byte 3; a model is BASE or BASE:ADAPTER");
        assert_eq!(
            e("m m:a"),
            "the base model of `m m:a`: model key `m m` has the character ' ' at byte 1; allowed are ASCII \
             letters, digits and ._-/"
        );
        assert!(e("m:../x").starts_with("the adapter of `m:../x`: adapter name `../x` has the segment `..`"));
        assert!(e(&format!("m:{}", "a".repeat(129))).contains("adapter name"));
        let both = parse_model_field("m:a", Some("b")).unwrap_err();
        assert_eq!(both.to_string(), "`model` names the adapter `a` and `lora` names `b`; name it once");
        let bad_lora = parse_model_field("m", Some("a b")).unwrap_err();
        assert!(matches!(bad_lora, AdapterRefError::Adapter { .. }), "{bad_lora}");
        let bad_base = parse_model_field("m m", None).unwrap_err();
        assert!(matches!(bad_base, AdapterRefError::Base { .. }), "{bad_base}");
    }

    #[test]
    fn both_spellings_read_alike_and_references_round_trip() {
        let a: AdapterRef = "org/base-7b:acme/support.v2".parse().unwrap();
        assert_eq!(
            parse_model_field("org/base-7b:acme/support.v2", None).unwrap().1.as_ref(),
            Some(a.name())
        );
        assert_eq!(
            parse_model_field("org/base-7b", Some("acme/support.v2")).unwrap().1.as_ref(),
            Some(a.name())
        );
        assert_eq!(
            parse_model_field("org/base-7b:acme/support.v2", Some("acme/support.v2")).unwrap().0,
            *a.base()
        );
        assert_eq!(parse_model_field("org/base-7b", None).unwrap(), ("org/base-7b".parse().unwrap(), None));
        let json = serde_json::to_string(&a).unwrap();
        assert_eq!(json, "\"org/base-7b:acme/support.v2\"");
        assert_eq!(serde_json::from_str::<AdapterRef>(&json).unwrap(), a);
        assert!(serde_json::from_str::<AdapterRef>("\"org/base-7b\"").is_err());
        let sized = Adapter::sized(a.clone(), ByteSize::new(5));
        assert_eq!(sized.size_or(ByteSize::new(9)).bytes(), 5);
        assert_eq!(Adapter { id: a, size: None }.size_or(ByteSize::new(9)).bytes(), 9);
    }

    proptest::proptest! {
        /// Whatever the text: a reference that parses prints back as the
        /// same text, and `parse_model_field` agrees with it.
        #[test]
        fn an_accepted_reference_prints_as_it_was_written(s in "[a-z:/.]{0,4}(:[a-z/.:]{0,4})?") {
            if let Ok(r) = s.parse::<AdapterRef>() {
                proptest::prop_assert_eq!(r.to_string(), s.clone());
                let (base, name) = parse_model_field(&s, None).unwrap();
                proptest::prop_assert_eq!(AdapterRef::new(base, name.unwrap()), r);
            }
        }
    }
}
