//! [`FieldError`]: a configuration value refused, named by its path, and
//! the line of a TOML file that path points at.

use toml::de::{DeArray, DeTable, DeValue};

/// A configuration value that parsed but is refused: which field (a path
/// such as `models[2].queue.capacity`) and why.
///
/// Validation code names the field relative to the table it checks; the
/// caller that knows where that table sits puts its own path in front
/// ([`FieldError::within`]), and the loader that holds the file turns the
/// full path into a line number.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct FieldError {
    /// The field's path: keys joined by `.`, array items as `[i]`.
    pub field: String,
    /// What is wrong with its value, and what would be accepted.
    pub message: String,
}

impl FieldError {
    /// `field` is refused because of `message`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        FieldError { field: field.into(), message: message.into() }
    }

    /// The same error seen from the table that holds `prefix`: `queue.capacity`
    /// within `models[2]` is `models[2].queue.capacity`.
    pub fn within(self, prefix: &str) -> Self {
        let field = match self.field.starts_with('[') {
            true => format!("{prefix}{}", self.field),
            false => format!("{prefix}.{}", self.field),
        };
        FieldError { field, ..self }
    }
}

/// One step of a field path.
#[derive(Debug, PartialEq)]
enum Step<'a> {
    Key(&'a str),
    Index(usize),
}

/// `models[2].queue.capacity` → `models`, `[2]`, `queue`, `capacity`.
fn steps(path: &str) -> Vec<Step<'_>> {
    let mut out = Vec::new();
    for part in path.split('.') {
        let (key, mut rest) = part.split_once('[').map_or((part, ""), |(k, r)| (k, r));
        if !key.is_empty() {
            out.push(Step::Key(key));
        }
        while let Some((index, after)) = rest.split_once(']') {
            if let Ok(i) = index.parse() {
                out.push(Step::Index(i));
            }
            rest = after.strip_prefix('[').unwrap_or(after);
        }
    }
    out
}

/// The 1-based line of `path` in `text`: the field's own line if it is
/// written there, else the line of the deepest entry on its path that is
/// (line 1 if none is).
fn line_of(text: &str, path: &str) -> usize {
    let Ok(root) = DeTable::parse(text) else { return 1 };
    let mut offset = 0;
    let mut table: Option<&DeTable<'_>> = Some(root.get_ref());
    let mut array: Option<&DeArray<'_>> = None;
    for step in steps(path) {
        let found = match (step, table, array) {
            (Step::Key(k), Some(t), _) => t.get(k),
            (Step::Index(i), _, Some(a)) => a.get(i),
            _ => None,
        };
        let Some(value) = found else { break };
        offset = value.span().start;
        (table, array) = match value.get_ref() {
            DeValue::Table(t) => (Some(t), None),
            DeValue::Array(a) => (None, Some(a)),
            _ => (None, None),
        };
    }
    text[..offset.min(text.len())].matches('\n').count() + 1
}

impl FieldError {
    /// The 1-based line of this field in the TOML `text` it was read from:
    /// the field's own line if it is written there, else the line of the
    /// deepest entry on its path that is (line 1 if none is).
    pub fn line_in(&self, text: &str) -> usize {
        line_of(text, &self.field)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "listen = \"127.0.0.1:0\"\n\
        timeout_ceiling_s = 99999999999\n\
        [[nodes]]\n\
        id = \"n\"\n\
        gpus = 1\n\
        [[models]]\n\
        key = \"a\"\n\
        [[models]]\n\
        key = \"b\"\n\
        engine = { kind = \"external\", url = \"not a url\" }\n\
        queue = { capacity = 5000 }\n";

    #[test]
    fn paths_split_into_keys_and_indices() {
        assert_eq!(
            steps("models[2].queue.capacity"),
            [Step::Key("models"), Step::Index(2), Step::Key("queue"), Step::Key("capacity")]
        );
        assert_eq!(steps("a[1][0]"), [Step::Key("a"), Step::Index(1), Step::Index(0)]);
    }

    #[test]
    fn a_field_is_found_on_its_line_or_its_entry() {
        let line = |path: &str| FieldError::new(path, "x").line_in(TEXT);
        assert_eq!(line("timeout_ceiling_s"), 2);
        assert_eq!(line("nodes[0].gpus"), 5);
        assert_eq!(line("models[1].engine.url"), 10);
        assert_eq!(line("models[1].queue.capacity"), 11);
        // Left to its default: the line of the model's entry.
        assert!((8..=9).contains(&line("models[1].min_replicas")));
        assert_eq!(line("nowhere.at.all"), 1);
        assert_eq!(FieldError::new("x", "y").line_in("not toml ["), 1);
    }

    #[test]
    fn within_prefixes_keys_and_indices() {
        let e = FieldError::new("capacity", "must be at least 1").within("queue").within("models[2]");
        assert_eq!(e.to_string(), "models[2].queue.capacity: must be at least 1");
        assert_eq!(FieldError::new("[0]", "bad").within("nodes").field, "nodes[0]");
    }
}
