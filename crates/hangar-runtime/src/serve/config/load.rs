//! Loading a configuration file: parse, validate, and point at the line.
//!
//! TOML syntax and type errors come from the parser with their line and
//! column. A value that parses but is refused ([`ServeConfig::validate`])
//! comes back as a field path; this module finds that path in the file's
//! spanned tree so the error names the line too — or the line of the
//! nearest enclosing entry when the field was left to its default.

use hangar_core::FieldError;

use super::ServeConfig;

/// A configuration file that cannot be served, naming the file, the line
/// and the field.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// Not TOML, or a field of the wrong type, unknown or missing (the
    /// parser's message names the line, column and field).
    #[error("invalid configuration {origin}: {source}")]
    Syntax {
        /// The file (or `the built-in demo`).
        origin: String,
        /// The parser's error.
        source: toml::de::Error,
    },
    /// A value out of range or inconsistent with another.
    #[error("invalid configuration {origin}:{line}: {error}")]
    Invalid {
        /// The file.
        origin: String,
        /// 1-based line of the field, or of its nearest enclosing entry.
        line: usize,
        /// The field and what is wrong with it.
        error: FieldError,
    },
}

impl ServeConfig {
    /// Parses and validates the configuration `text` read from `origin`
    /// (a path, for messages).
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, ConfigError> {
        Self::from_toml_with_redis(text, origin, None)
    }

    /// [`ServeConfig::from_toml`] with `redis`, when given, in place of
    /// the file's (a `--redis` flag): checked as the file's would be, so a
    /// fleet's file needs no `redis` of its own.
    pub fn from_toml_with_redis(
        text: &str,
        origin: &str,
        redis: Option<String>,
    ) -> Result<Self, ConfigError> {
        let mut config: ServeConfig =
            toml::from_str(text).map_err(|source| ConfigError::Syntax { origin: origin.into(), source })?;
        if redis.is_some() {
            config.redis = redis;
        }
        config.validate().map_err(|error| ConfigError::Invalid {
            origin: origin.into(),
            line: error.line_in(text),
            error,
        })?;
        Ok(config)
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
        gpu_memory = \"80GB\"\n\
        [[models]]\n\
        key = \"a\"\n\
        engine = { kind = \"mock\" }\n\
        size = \"1GB\"\n\
        [[models]]\n\
        key = \"b\"\n\
        engine = { kind = \"external\", url = \"not a url\" }\n\
        queue = { capacity = 5000 }\n";

    #[test]
    fn errors_name_the_file_the_line_and_the_field() {
        let e = ServeConfig::from_toml(TEXT, "serve.toml").unwrap_err().to_string();
        assert_eq!(e, "invalid configuration serve.toml:2: timeout_ceiling_s: 99999999999 is out of range: 1 to 2592000 seconds (30 days)");
        let fixed = TEXT.replace("timeout_ceiling_s = 99999999999\n", "");
        let e = ServeConfig::from_toml(&fixed, "serve.toml").unwrap_err().to_string();
        assert!(e.starts_with("invalid configuration serve.toml:13: models[1].queue.capacity:"), "{e}");
        let e = ServeConfig::from_toml("listen = 5\n", "x.toml").unwrap_err().to_string();
        assert!(e.contains("x.toml") && e.contains("line 1") && e.contains("listen"), "{e}");
    }

    /// The CA files of `rediss` and `https` webhooks are read at load: a
    /// missing one names its setting, its path and its line.
    #[test]
    fn a_ca_file_that_cannot_be_read_is_named_at_load() {
        let node_and_model = "[[nodes]]\nid = \"n\"\ngpus = 1\ngpu_memory = \"80GB\"\n\
            [[models]]\nkey = \"a\"\nengine = { kind = \"mock\" }\nsize = \"1GB\"\n";
        let redis = "redis = \"rediss://redis.example.com:6380/0?ca_file=/nonexistent/redis-ca.pem\"\n";
        let e = ServeConfig::from_toml(&format!("{redis}{node_and_model}"), "serve.toml")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(
                "invalid configuration serve.toml:1: redis: `rediss://redis.example.com:6380/0?ca_file="
            ) && e.contains("cannot read the CA file `/nonexistent/redis-ca.pem`"),
            "{e}"
        );
        let hooks = "[predictions]\nwebhook_ca_file = \"/nonexistent/hooks-ca.pem\"\n";
        let e = ServeConfig::from_toml(&format!("{node_and_model}{hooks}"), "serve.toml")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(
                "invalid configuration serve.toml:10: predictions.webhook_ca_file: \
                 cannot read the CA file `/nonexistent/hooks-ca.pem`"
            ),
            "{e}"
        );
    }
}
