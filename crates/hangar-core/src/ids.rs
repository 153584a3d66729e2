//! Identifiers shared across crates.
//!
//! Keys that come from users ([`ModelKey`], [`AccountId`]) are validated when
//! parsed so that every later use can print them into logs, metric labels and
//! URLs without escaping. Ids the platform mints ([`ReplicaId`],
//! [`RequestId`]) are opaque.
//!
//! A user's key is shared, not owned (`Arc<str>`): the request path clones
//! the account of every request several times (admission, its inference
//! event), and a clone is a reference count, not an allocation.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Why a string is not a valid identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdError {
    /// The string was empty.
    #[error("{kind} is empty")]
    Empty {
        /// Which kind of identifier was being parsed.
        kind: &'static str,
    },
    /// The string was longer than allowed.
    #[error("{kind} `{value}` is {len} bytes long; the limit is {max}")]
    TooLong {
        /// Which kind of identifier was being parsed.
        kind: &'static str,
        /// The offending value.
        value: String,
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The string held a character outside the allowed set.
    #[error("{kind} `{value}` has the character {ch:?} at byte {at}; allowed are ASCII letters, digits and {allowed}")]
    BadChar {
        /// Which kind of identifier was being parsed.
        kind: &'static str,
        /// The offending value.
        value: String,
        /// The first disallowed character.
        ch: char,
        /// Its byte offset.
        at: usize,
        /// The punctuation that is allowed.
        allowed: &'static str,
    },
    /// A `/`-separated segment of the key is not a name: the key starts
    /// or ends with `/`, holds `//`, or a segment is `.` or `..`.
    #[error(
        "{kind} `{value}` {problem}; its `/`-separated segments must each be a name (not empty, `.` or \
         `..`), since keys become paths, URLs and Redis keys"
    )]
    PathComponent {
        /// Which kind of identifier was being parsed.
        kind: &'static str,
        /// The offending value.
        value: String,
        /// Where it goes wrong (`has the segment `..` at byte 2`).
        problem: String,
    },
    /// A replica id was not 32 lowercase hex digits.
    #[error("replica id `{0}` is not 32 lowercase hex digits")]
    BadReplicaId(String),
}

fn validate(kind: &'static str, value: &str, max: usize, punct: &'static str) -> Result<(), IdError> {
    if value.is_empty() {
        return Err(IdError::Empty { kind });
    }
    if value.len() > max {
        return Err(IdError::TooLong { kind, value: value.to_owned(), len: value.len(), max });
    }
    if let Some((at, ch)) =
        value.char_indices().find(|&(_, c)| !(c.is_ascii_alphanumeric() || punct.contains(c)))
    {
        return Err(IdError::BadChar { kind, value: value.to_owned(), ch, at, allowed: punct });
    }
    Ok(())
}

/// A model key's `/`-separated segments are names: none empty (a leading,
/// trailing or doubled `/`), none `.` or `..`. Keys name directories,
/// URL paths (`/v1/models/{owner}/{name}`) and Redis keys; a key that
/// passes cannot climb out of the directory or route it is put under.
/// (Backslashes, NUL and every other separator are refused before, by the
/// character set.)
fn path_segments(kind: &'static str, value: &str) -> Result<(), IdError> {
    let mut at = 0;
    for segment in value.split('/') {
        let problem = match segment {
            "" if at == 0 => Some("starts with `/`".to_owned()),
            "" if at == value.len() => Some("ends with `/`".to_owned()),
            "" => Some(format!("has `//` at byte {}", at - 1)),
            "." | ".." => Some(format!("has the segment `{segment}` at byte {at}")),
            _ => None,
        };
        if let Some(problem) = problem {
            return Err(IdError::PathComponent { kind, value: value.to_owned(), problem });
        }
        at += segment.len() + 1;
    }
    Ok(())
}

/// Accepts anything the character set does.
fn any_segments(_: &'static str, _: &str) -> Result<(), IdError> {
    Ok(())
}

macro_rules! string_id {
    ($(#[$doc:meta])* $name:ident, $kind:literal, $max:literal, $punct:literal, $segments:path) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
        #[serde(try_from = "String")]
        pub struct $name(Arc<str>);

        // Written as the string it is, without the copy `into = "String"`
        // would make (events write an account per line).
        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(&self.0)
            }
        }

        impl $name {
            /// The identifier as a string slice.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl FromStr for $name {
            type Err = IdError;
            fn from_str(s: &str) -> Result<Self, IdError> {
                validate($kind, s, $max, $punct)?;
                $segments($kind, s)?;
                Ok(Self(s.into()))
            }
        }

        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(s: String) -> Result<Self, IdError> {
                validate($kind, &s, $max, $punct)?;
                $segments($kind, &s)?;
                Ok(Self(s.into()))
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0.to_string()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

string_id!(
    /// The key a model is served under, e.g. `meta/llama-3-8b`: ASCII letters,
    /// digits and `._-/`, at most 128 bytes, whose `/`-separated segments
    /// are names — none empty, `.` or `..` — so that the key used as a path
    /// (under a directory, in a URL, in a Redis key) stays under it.
    ModelKey,
    "model key",
    128,
    "._-/",
    path_segments
);

string_id!(
    /// A LoRA adapter's name under its base model, e.g. `acme/support-v2`:
    /// the same rules as a [`ModelKey`] (ASCII letters, digits and `._-/`,
    /// at most 128 bytes, `/`-separated segments that are names), since
    /// the name becomes a store key, the engine's `lora_name` and a path.
    /// It holds no `:`, which separates it from its base in
    /// [`AdapterRef`](crate::AdapterRef)'s `BASE:ADAPTER`.
    AdapterName,
    "adapter name",
    128,
    "._-/",
    path_segments
);

string_id!(
    /// An account (tenant) on whose behalf requests are made: ASCII letters,
    /// digits and `._-@`, at most 128 bytes.
    AccountId,
    "account id",
    128,
    "._-@",
    any_segments
);

/// A replica's id: an opaque 128-bit value printed as 32 lowercase hex digits
/// (a uuid without dashes). Unique cluster-wide; the placement policy mints
/// them from its seeded rng so simulated runs are reproducible.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ReplicaId(u128);

impl ReplicaId {
    /// Wraps raw bits, e.g. drawn from a seeded rng.
    pub const fn from_u128(bits: u128) -> Self {
        Self(bits)
    }

    /// The raw bits.
    pub const fn as_u128(self) -> u128 {
        self.0
    }
}

impl fmt::Display for ReplicaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl FromStr for ReplicaId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, IdError> {
        let ok = s.len() == 32 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        if !ok {
            return Err(IdError::BadReplicaId(s.to_owned()));
        }
        u128::from_str_radix(s, 16).map(Self).map_err(|_| IdError::BadReplicaId(s.to_owned()))
    }
}

impl TryFrom<String> for ReplicaId {
    type Error = IdError;
    fn try_from(s: String) -> Result<Self, IdError> {
        s.parse()
    }
}

impl From<ReplicaId> for String {
    fn from(id: ReplicaId) -> String {
        id.to_string()
    }
}

/// A request's id, unique within one server or one simulation run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "req-{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_key_validation_names_the_problem() {
        assert!("org/model-1.5b_v2".parse::<ModelKey>().is_ok());
        let err = "bad key".parse::<ModelKey>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "model key `bad key` has the character ' ' at byte 3; allowed are ASCII letters, digits and ._-/"
        );
        assert!(matches!("".parse::<ModelKey>(), Err(IdError::Empty { .. })));
        assert!(matches!("a".repeat(129).parse::<ModelKey>(), Err(IdError::TooLong { len: 129, .. })));
    }

    #[test]
    fn a_model_key_with_path_components_is_refused_naming_it() {
        for (key, problem) in [
            ("../etc/passwd", "has the segment `..` at byte 0"),
            ("a/../b", "has the segment `..` at byte 2"),
            ("a/..", "has the segment `..` at byte 2"),
            ("./a", "has the segment `.` at byte 0"),
            ("a/./b", "has the segment `.` at byte 2"),
            ("..", "has the segment `..` at byte 0"),
            (".", "has the segment `.` at byte 0"),
            ("/etc/passwd", "starts with `/`"),
            ("/", "starts with `/`"),
            ("org/", "ends with `/`"),
            ("org//model", "has `//` at byte 3"),
        ] {
            let e = key.parse::<ModelKey>().unwrap_err();
            assert!(matches!(e, IdError::PathComponent { .. }), "{key}: {e}");
            let text = e.to_string();
            assert!(text.starts_with(&format!("model key `{key}` {problem};")), "{text}");
            // Through serde (config files, API bodies) alike.
            assert!(serde_json::from_str::<ModelKey>(&format!("\"{key}\"")).is_err(), "{key}");
        }
        for key in ["a\\..\\b", "a\0b", "c:/x"] {
            assert!(matches!(key.parse::<ModelKey>(), Err(IdError::BadChar { .. })), "{key:?}");
        }
        // Dots inside a segment are a name.
        for key in ["org/model-1.5b_v2", ".hidden/m", "a/..b", "a.../b", "v1.0"] {
            key.parse::<ModelKey>().unwrap_or_else(|e| panic!("{key}: {e}"));
        }
        // Account ids have no segments.
        assert!("..".parse::<AccountId>().is_ok());
    }

    proptest::proptest! {
        /// Whatever a model key is, once accepted it joins under a
        /// directory as exactly its segments, every one a plain name, and a
        /// Redis key or URL built from it has no segment that climbs.
        #[test]
        fn an_accepted_model_key_stays_under_the_directory_it_is_put_in(
            key in "[a-z./_-]{1,3}(/[a-z./_-]{0,3}){0,3}",
        ) {
            let Ok(parsed) = key.parse::<ModelKey>() else { return Ok(()) };
            let root = std::path::Path::new("/var/lib/hangar");
            let joined = root.join(parsed.as_str());
            let below: Vec<_> = joined.strip_prefix(root).unwrap().components().collect();
            proptest::prop_assert_eq!(below.len(), key.split('/').count(), "{}", key);
            for c in below {
                proptest::prop_assert!(matches!(c, std::path::Component::Normal(_)), "{}: {:?}", key, c);
            }
            let url = format!("http://h/v1/models/{parsed}/predictions");
            proptest::prop_assert!(!url.split('/').any(|s| s == ".." || s == "."), "{}", url);
        }
    }

    #[test]
    fn replica_id_round_trips_through_hex_and_serde() {
        let id = ReplicaId::from_u128(0xdead_beef);
        let s = id.to_string();
        assert_eq!(s.len(), 32);
        assert_eq!(s.parse::<ReplicaId>().unwrap(), id);
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(serde_json::from_str::<ReplicaId>(&json).unwrap(), id);
        assert!("DEADBEEF".parse::<ReplicaId>().is_err());
        assert!(serde_json::from_str::<ModelKey>("\"a b\"").is_err());
    }
}
