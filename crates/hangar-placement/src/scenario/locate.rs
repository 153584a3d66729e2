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

/// Fills in `e`'s line from where its path sits in the JSON `text` (the
/// deepest part of the path that exists there). `text` has already parsed
/// as a scenario, so it is valid JSON.
pub(super) fn with_json_line(mut e: ScenarioError, text: &str) -> ScenarioError {
    if e.line.is_some() {
        return e;
    }
    let mut scan = JsonScan { text: text.as_bytes(), pos: 0 };
    let mut found = None;
    scan.skip_ws();
    for seg in e.path.segments() {
        let Some(start) = scan.enter(seg) else { break };
        found = Some(start);
    }
    if let Some(offset) = found {
        e.line = Some(line_col(text, offset).0);
    }
    e
}

/// A cursor over valid JSON that can step into a member or element and
/// skip values.
struct JsonScan<'a> {
    text: &'a [u8],
    pos: usize,
}

impl JsonScan<'_> {
    fn skip_ws(&mut self) {
        while self.text.get(self.pos).is_some_and(u8::is_ascii_whitespace) {
            self.pos += 1;
        }
    }

    /// From the start of an object or array, moves to the start of the
    /// value `seg` names and returns its offset.
    fn enter(&mut self, seg: &Segment) -> Option<usize> {
        let (open, close) = match seg {
            Segment::Key(_) => (b'{', b'}'),
            Segment::Index(_) => (b'[', b']'),
        };
        if self.text.get(self.pos) != Some(&open) {
            return None;
        }
        self.pos += 1;
        let mut index = 0;
        loop {
            self.skip_ws();
            match self.text.get(self.pos)? {
                b',' => {
                    self.pos += 1;
                    continue;
                }
                c if *c == close => return None,
                _ => {}
            }
            let hit = match seg {
                Segment::Key(want) => {
                    let start = self.pos;
                    self.skip_string()?;
                    let key: String = serde_json::from_slice(&self.text[start..self.pos]).ok()?;
                    self.skip_ws();
                    self.pos += 1; // ':'
                    self.skip_ws();
                    key == *want
                }
                Segment::Index(want) => {
                    index += 1;
                    index - 1 == *want
                }
            };
            if hit {
                return Some(self.pos);
            }
            self.skip_value()?;
        }
    }

    fn skip_string(&mut self) -> Option<()> {
        self.pos += 1; // opening quote
        loop {
            match self.text.get(self.pos)? {
                b'\\' => self.pos += 2,
                b'"' => {
                    self.pos += 1;
                    return Some(());
                }
                _ => self.pos += 1,
            }
        }
    }

    fn skip_value(&mut self) -> Option<()> {
        match self.text.get(self.pos)? {
            b'"' => self.skip_string(),
            b'{' | b'[' => {
                let mut depth = 0usize;
                loop {
                    match self.text.get(self.pos)? {
                        b'"' => {
                            self.skip_string()?;
                            continue;
                        }
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => {
                            depth -= 1;
                            if depth == 0 {
                                self.pos += 1;
                                return Some(());
                            }
                        }
                        _ => {}
                    }
                    self.pos += 1;
                }
            }
            // A number, `true`, `false` or `null`.
            _ => {
                while self
                    .text
                    .get(self.pos)
                    .is_some_and(|c| !matches!(c, b',' | b'}' | b']') && !c.is_ascii_whitespace())
                {
                    self.pos += 1;
                }
                Some(())
            }
        }
    }
}
