//! Artifact identity: content-derived ids and human keys that point at them.
//!
//! An [`ArtifactId`] is `hg1:<blake3 of the canonical index>:<data root>`
//! (64 lowercase hex digits each, see [`crate::chunks`] for the data root).
//! Two imports of the same tensors get the same id whatever the file split
//! or file names were. A view of an artifact (a tensor-parallel shard) gets
//! `hg1v:<blake3 of parent id and view spec>`. A [`StoreKey`] (`name:tag`) is
//! a mutable pointer to an id; many keys may point to one id.
//!
//! Both are validated at parse time so that every later use can put them into
//! file names, URLs and metric labels: the only way to reach a path on disk is
//! through the hex digests, never through user text.

use std::fmt;
use std::str::FromStr;

use hangar_core::ModelKey;
use serde::{Deserialize, Serialize};

/// Why a string is not an artifact id or a key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdParseError {
    /// The string does not have the `hg1:<64 hex>:<64 hex>` / `hg1v:<64 hex>` shape.
    #[error("`{0}` is not an artifact id; expected `hg1:<64 hex>:<64 hex>` or `hg1v:<64 hex>`")]
    BadId(String),
    /// The key's name part is not a valid model key.
    #[error("key `{key}`: {source}")]
    BadKeyName {
        /// The key as given.
        key: String,
        /// What is wrong with its name.
        source: hangar_core::IdError,
    },
    /// The tag is empty, too long or has characters outside `[A-Za-z0-9._-]`.
    #[error("key `{0}` has an invalid tag; a tag is 1 to 64 of ASCII letters, digits and `._-`")]
    BadTag(String),
}

/// Serializes a type through its `Display` and deserializes through its
/// `FromStr`, so JSON carries exactly the validated text form.
macro_rules! serde_as_text {
    ($t:ty) => {
        impl Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

/// A 32-byte BLAKE3 digest printed as 64 lowercase hex digits.
pub type Digest = [u8; 32];

/// The content-derived id of an artifact or of a view of one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ArtifactId {
    /// A stored artifact: hash of its canonical index and root hash of its data.
    Full {
        /// BLAKE3 of the canonical index bytes.
        index: Digest,
        /// Root hash of the canonical data layout ([`crate::chunks::data_root`]).
        data: Digest,
    },
    /// A view derived from a parent artifact and a view spec.
    View(Digest),
}

impl ArtifactId {
    /// The id of a view: BLAKE3 over the parent id and the canonical view spec.
    pub fn view_of(parent: &ArtifactId, canonical_spec: &str) -> ArtifactId {
        let mut h = blake3::Hasher::new();
        h.update(b"hg1v\0");
        h.update(parent.to_string().as_bytes());
        h.update(b"\0");
        h.update(canonical_spec.as_bytes());
        ArtifactId::View(*h.finalize().as_bytes())
    }

    /// A name for this id that is safe as one file-name component
    /// (`:` replaced by `-`).
    pub fn file_name(&self) -> String {
        self.to_string().replace(':', "-")
    }

    /// The data root, for full artifacts.
    pub fn data_root(&self) -> Option<&Digest> {
        match self {
            ArtifactId::Full { data, .. } => Some(data),
            ArtifactId::View(_) => None,
        }
    }
}

fn parse_hex(s: &str) -> Option<Digest> {
    if s.len() != 64 || !s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Lowercase hex of a digest.
pub fn hex(d: &Digest) -> String {
    blake3::Hash::from_bytes(*d).to_hex().to_string()
}

impl FromStr for ArtifactId {
    type Err = IdParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || IdParseError::BadId(s.chars().take(200).collect());
        let mut parts = s.split(':');
        match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some("hg1"), Some(i), Some(d), None) => Ok(ArtifactId::Full {
                index: parse_hex(i).ok_or_else(bad)?,
                data: parse_hex(d).ok_or_else(bad)?,
            }),
            (Some("hg1v"), Some(v), None, None) => Ok(ArtifactId::View(parse_hex(v).ok_or_else(bad)?)),
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for ArtifactId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ArtifactId::Full { index, data } => write!(f, "hg1:{}:{}", hex(index), hex(data)),
            ArtifactId::View(v) => write!(f, "hg1v:{}", hex(v)),
        }
    }
}

serde_as_text!(ArtifactId);

/// A human key `name:tag` (tag defaults to `latest`); `name` is a
/// [`ModelKey`], so none of its segments is empty, `.` or `..`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StoreKey {
    name: ModelKey,
    tag: String,
}

impl StoreKey {
    /// The name part.
    pub fn name(&self) -> &ModelKey {
        &self.name
    }
    /// The tag part.
    pub fn tag(&self) -> &str {
        &self.tag
    }
}

impl FromStr for StoreKey {
    type Err = IdParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (name, tag) = s.rsplit_once(':').unwrap_or((s, "latest"));
        let name: ModelKey =
            name.parse().map_err(|source| IdParseError::BadKeyName { key: s.to_owned(), source })?;
        let tag_ok = !tag.is_empty()
            && tag.len() <= 64
            && tag.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if !tag_ok {
            return Err(IdParseError::BadTag(s.to_owned()));
        }
        Ok(StoreKey { name, tag: tag.to_owned() })
    }
}

impl fmt::Display for StoreKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.name, self.tag)
    }
}

serde_as_text!(StoreKey);

/// What a user typed where either an id or a key is accepted (`stat`, `get`, `rm`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdOrKey {
    /// A content id.
    Id(ArtifactId),
    /// A key to resolve.
    Key(StoreKey),
}

impl FromStr for IdOrKey {
    type Err = IdParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.starts_with("hg1:") || s.starts_with("hg1v:") {
            s.parse().map(IdOrKey::Id)
        } else {
            s.parse().map(IdOrKey::Key)
        }
    }
}

impl fmt::Display for IdOrKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IdOrKey::Id(id) => id.fmt(f),
            IdOrKey::Key(k) => k.fmt(f),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_round_trips_and_rejects_hostile_text() {
        let id = ArtifactId::Full { index: [1; 32], data: [0xab; 32] };
        let s = id.to_string();
        assert_eq!(s.parse::<ArtifactId>().unwrap(), id);
        assert!(!id.file_name().contains(':'));
        for bad in ["hg1:../../etc:passwd", "hg1:", "hg2:aa:bb", &s[..s.len() - 1], &s.to_uppercase()] {
            assert!(bad.parse::<ArtifactId>().is_err(), "{bad}");
        }
    }

    #[test]
    fn keys_validate_name_and_tag() {
        let k: StoreKey = "meta/llama:v1".parse().unwrap();
        assert_eq!((k.name().as_str(), k.tag()), ("meta/llama", "v1"));
        assert_eq!("m".parse::<StoreKey>().unwrap().to_string(), "m:latest");
        for bad in ["../etc:x", "a//b:x", "a/./b", "a:", "a:b/c", "a b:c", ""] {
            assert!(bad.parse::<StoreKey>().is_err(), "{bad}");
        }
    }
}
