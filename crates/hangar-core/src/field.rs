//! [`FieldError`]: a configuration value refused, named by its path.

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn within_prefixes_keys_and_indices() {
        let e = FieldError::new("capacity", "must be at least 1").within("queue").within("models[2]");
        assert_eq!(e.to_string(), "models[2].queue.capacity: must be at least 1");
        assert_eq!(FieldError::new("[0]", "bad").within("nodes").field, "nodes[0]");
    }
}
