//! Field paths (`deployments[2].node`) and finding their line in TOML source.

use std::fmt;

use serde::Serialize;

use super::ScenarioError;

/// One step of a [`FieldPath`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Segment {
    /// A table key or struct field.
    Key(String),
    /// An array position.
    Index(usize),
}

/// Where in a scenario a value sits, printed `models."meta/llama".size` or
/// `deployments[2].node`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct FieldPath(Vec<Segment>);

impl FieldPath {
    /// The whole document.
    pub fn root() -> Self {
        Self(Vec::new())
    }

    /// This path, then `key`.
    pub fn key(mut self, key: &str) -> Self {
        self.0.push(Segment::Key(key.to_owned()));
        self
    }

    /// This path, then array position `i`.
    pub fn index(mut self, i: usize) -> Self {
        self.0.push(Segment::Index(i));
        self
    }

    /// The segments.
    pub fn segments(&self) -> &[Segment] {
        &self.0
    }

    pub(super) fn from_serde(path: &serde_path_to_error::Path) -> Self {
        use serde_path_to_error::Segment as S;
        Self(
            path.iter()
                .filter_map(|s| match s {
                    S::Seq { index } => Some(Segment::Index(*index)),
                    S::Map { key } | S::Enum { variant: key } => Some(Segment::Key(key.clone())),
                    S::Unknown => None,
                })
                .collect(),
        )
    }
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("(scenario)");
        }
        for (i, seg) in self.0.iter().enumerate() {
            match seg {
                Segment::Index(n) => write!(f, "[{n}]")?,
                Segment::Key(k) => {
                    if i > 0 {
                        f.write_str(".")?;
                    }
                    let bare = !k.is_empty()
                        && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
                    if bare {
                        f.write_str(k)?;
                    } else {
                        write!(f, "{k:?}")?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// 1-based line and column of byte `offset` in `text`.
pub(super) fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

/// Fills in `e`'s line from where its path sits in the TOML `text` (the
/// deepest part of the path that exists there).
pub(super) fn with_toml_line(mut e: ScenarioError, text: &str) -> ScenarioError {
    if e.line.is_some() {
        return e;
    }
    let Ok(doc) = toml::de::DeTable::parse(text) else { return e };
    let mut span = None;
    let mut value: Option<&toml::Spanned<toml::de::DeValue<'_>>> = None;
    for seg in e.path.segments() {
        let next = match (seg, value) {
            (Segment::Key(k), None) => doc.get_ref().get(k.as_str()),
            (Segment::Key(k), Some(v)) => v.get_ref().get(k.as_str()),
            (Segment::Index(i), Some(v)) => v.get_ref().get(*i),
            (Segment::Index(_), None) => None,
        };
        let Some(next) = next else { break };
        span = Some(next.span());
        value = Some(next);
    }
    if let Some(span) = span {
        e.line = Some(line_col(text, span.start).0);
    }
    e
}
