//! Settings: every environment variable of llm-d's PVC evictor (same names,
//! same defaults) plus a few of our own, each also reachable as a CLI flag.
//!
//! [`VARIABLES`] is the single table of names, defaults and help texts; the
//! binary derives its `--flags` from it, and [`Config::from_lookup`] parses
//! whatever a lookup (environment, flags, a test map) returns for each name.
//! A value that does not parse or is out of range is rejected with a
//! [`ConfigError`] naming the variable, so a typo in a deployment fails at
//! start instead of running with a surprising default.

use std::path::{Component, Path, PathBuf};
use std::time::Duration;

/// One setting: its environment variable name, default and meaning.
#[derive(Debug, Clone, Copy)]
pub struct Variable {
    /// Environment variable name, e.g. `CLEANUP_THRESHOLD`.
    pub name: &'static str,
    /// Default as written in the environment; empty means unset.
    pub default: &'static str,
    /// One-line meaning, shown in `--help`.
    pub help: &'static str,
}

impl Variable {
    /// The CLI flag for this variable: `CLEANUP_THRESHOLD` → `cleanup-threshold`.
    pub fn flag(&self) -> String {
        self.name.to_ascii_lowercase().replace('_', "-")
    }
}

macro_rules! variables {
    ($($ident:ident = $name:literal, $default:literal, $help:literal;)*) => {
        $(
            #[doc = concat!("`", $name, "`: ", $help)]
            pub const $ident: &str = $name;
        )*
        /// Every setting, in the order `--help` lists them.
        pub const VARIABLES: &[Variable] = &[
            $(Variable { name: $name, default: $default, help: $help },)*
        ];
    };
}

variables! {
    PVC_MOUNT_PATH = "PVC_MOUNT_PATH", "/kv-cache", "mount path of the KV-cache volume; usage is measured here";
    CACHE_DIRECTORY = "CACHE_DIRECTORY", "kv/model-cache/models", "directory under PVC_MOUNT_PATH holding the FileMapper trees (relative, no '..')";
    CLEANUP_THRESHOLD = "CLEANUP_THRESHOLD", "85.0", "disk usage % (as df reports it) at which deletion turns ON";
    TARGET_THRESHOLD = "TARGET_THRESHOLD", "70.0", "disk usage % at which deletion turns OFF; below CLEANUP_THRESHOLD";
    NUM_CRAWLER_PROCESSES = "NUM_CRAWLER_PROCESSES", "8", "crawler threads listing the tree in parallel (1-256)";
    LOGGER_INTERVAL_SECONDS = "LOGGER_INTERVAL_SECONDS", "0.05", "seconds between disk usage checks while not deleting (the Python evictor's default is 0.5)";
    FILE_QUEUE_MAXSIZE = "FILE_QUEUE_MAXSIZE", "10000", "candidates in flight from crawlers to the selector; crawlers block when it is full";
    FILE_QUEUE_MIN_SIZE = "FILE_QUEUE_MIN_SIZE", "1000", "fewest candidates a sweep keeps, so a small overshoot still yields a useful batch";
    DELETION_BATCH_SIZE = "DELETION_BATCH_SIZE", "100", "files unlinked between two usage checks";
    FILE_ACCESS_TIME_THRESHOLD_MINUTES = "FILE_ACCESS_TIME_THRESHOLD_MINUTES", "60.0", "never delete a file used (read or written) within this many minutes";
    HEX_BUCKET_LEN = "HEX_BUCKET_LEN", "3", "hex digits of the first bucket level in the current FileMapper layout (1-4)";
    ENABLE_DIR_CLEANUP = "ENABLE_DIR_CLEANUP", "true", "remove empty bucket directories";
    DIR_CLEANUP_TTL_SECONDS = "DIR_CLEANUP_TTL_SECONDS", "120", "an empty directory is removed only when unchanged for this many seconds";
    DRY_RUN = "DRY_RUN", "false", "report each file that would be deleted once, delete nothing";
    LOG_LEVEL = "LOG_LEVEL", "INFO", "DEBUG, INFO, WARNING or ERROR (RUST_LOG, when set, wins)";
    LOG_FILE_PATH = "LOG_FILE_PATH", "", "also append logs to this file";
    STORAGE_EVENTS_ENDPOINT = "STORAGE_EVENTS_ENDPOINT", "", "ZMQ PUB endpoint (tcp://host:port) to bind for BlockRemoved events";
    STATUS_INTERVAL_SECONDS = "STATUS_INTERVAL_SECONDS", "10", "seconds between aggregated status lines";
    METRICS_PORT = "METRICS_PORT", "", "serve Prometheus metrics on this port at /metrics (0 picks a free port)";
    METRICS_ADDRESS = "METRICS_ADDRESS", "0.0.0.0", "address the metrics server binds";
    MAX_CANDIDATES = "MAX_CANDIDATES", "262144", "most candidates remembered at once, deletion queue and sweep in progress together (40 bytes each); bounds memory";
    DELETION_MAX_FILES_PER_SECOND = "DELETION_MAX_FILES_PER_SECOND", "0", "deletion rate limit; 0 means unlimited";
    TMP_FILE_TTL_SECONDS = "TMP_FILE_TTL_SECONDS", "3600", "remove leftover <hash>*.tmp files older than this; 0 disables";
    PREFILL_INTERVAL_SECONDS = "PREFILL_INTERVAL_SECONDS", "1800", "pre-fill the deletion queue while OFF: at start, after a deletion that thinned it, and again this many seconds after the last sweep; 0 disables pre-fill";
}

/// A setting that could not be used, naming the variable and the value.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The value does not parse or is out of range.
    #[error("invalid {var}={value:?}: {reason}")]
    Invalid {
        /// Environment variable (its flag is the lower-case, dashed form).
        var: &'static str,
        /// The offending value.
        value: String,
        /// What was expected.
        reason: String,
    },
}

/// Log verbosity, spelled the way the Python evictor accepts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    /// `DEBUG`
    Debug,
    /// `INFO`
    Info,
    /// `WARNING` (or `WARN`)
    Warning,
    /// `ERROR`
    Error,
}

impl LogLevel {
    /// The `tracing` filter directive for this level.
    pub fn directive(self) -> &'static str {
        match self {
            LogLevel::Debug => "debug",
            LogLevel::Info => "info",
            LogLevel::Warning => "warn",
            LogLevel::Error => "error",
        }
    }
}

/// Validated settings of one evictor.
#[derive(Debug, Clone)]
pub struct Config {
    /// Mount point whose usage is measured.
    pub pvc_mount_path: PathBuf,
    /// Cache root relative to the mount point.
    pub cache_directory: PathBuf,
    /// Usage % that turns deletion ON.
    pub cleanup_threshold: f64,
    /// Usage % that turns deletion OFF.
    pub target_threshold: f64,
    /// Crawler threads.
    pub crawler_threads: usize,
    /// Usage check interval while not deleting.
    pub logger_interval: Duration,
    /// Bound on candidates in flight between crawlers and the selector.
    pub file_queue_maxsize: usize,
    /// Fewest candidates a sweep keeps.
    pub file_queue_min_size: usize,
    /// Files per deletion batch.
    pub deletion_batch_size: usize,
    /// Files used more recently than this are never deleted.
    pub access_time_threshold: Duration,
    /// Hex digits of the current layout's first bucket level.
    pub hex_bucket_len: usize,
    /// Remove empty bucket directories.
    pub enable_dir_cleanup: bool,
    /// Age an empty directory must reach before removal.
    pub dir_cleanup_ttl: Duration,
    /// Report instead of delete.
    pub dry_run: bool,
    /// Log verbosity.
    pub log_level: LogLevel,
    /// Optional log file.
    pub log_file_path: Option<PathBuf>,
    /// Optional ZMQ endpoint for `BlockRemoved` events.
    pub storage_events_endpoint: Option<String>,
    /// Interval between status lines.
    pub status_interval: Duration,
    /// Optional Prometheus port.
    pub metrics_port: Option<u16>,
    /// Address for the metrics server.
    pub metrics_address: std::net::IpAddr,
    /// Most candidates remembered at once: the deletion queue and the
    /// selection of a sweep in progress together.
    pub max_candidates: usize,
    /// Deletion rate limit in files per second; `None` is unlimited.
    pub max_files_per_second: Option<f64>,
    /// Age after which leftover `.tmp` files are removed; `None` disables.
    pub tmp_file_ttl: Option<Duration>,
    /// Pre-fill interval: the deletion queue is filled while OFF and
    /// re-filled this long after the last sweep; `None` disables pre-fill.
    pub prefill_interval: Option<Duration>,
}

impl Default for Config {
    fn default() -> Self {
        Config::from_lookup(|_| None).expect("the documented defaults are valid")
    }
}

impl Config {
    /// Reads every variable from the process environment.
    pub fn from_env() -> Result<Config, ConfigError> {
        Config::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads every variable through `lookup`; a `None` or empty value takes
    /// the default. Errors name the first invalid variable.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let get = |name: &'static str| Raw::get(&lookup, name);
        let cleanup_threshold = get(CLEANUP_THRESHOLD).percent()?;
        let target_threshold = get(TARGET_THRESHOLD).percent()?;
        if target_threshold >= cleanup_threshold {
            let raw = get(TARGET_THRESHOLD);
            return Err(raw.invalid(format!("must be below CLEANUP_THRESHOLD ({cleanup_threshold})")));
        }
        let rate = get(DELETION_MAX_FILES_PER_SECOND).float(0.0, f64::MAX)?;
        let tmp_ttl = get(TMP_FILE_TTL_SECONDS).seconds()?;
        let prefill = get(PREFILL_INTERVAL_SECONDS).seconds()?;
        Ok(Config {
            pvc_mount_path: get(PVC_MOUNT_PATH).absolute_path()?,
            cache_directory: get(CACHE_DIRECTORY).relative_path()?,
            cleanup_threshold,
            target_threshold,
            crawler_threads: get(NUM_CRAWLER_PROCESSES).integer(1, 256)?,
            logger_interval: get(LOGGER_INTERVAL_SECONDS).positive_seconds()?,
            file_queue_maxsize: get(FILE_QUEUE_MAXSIZE).integer(1, 10_000_000)?,
            file_queue_min_size: get(FILE_QUEUE_MIN_SIZE).integer(1, 10_000_000)?,
            deletion_batch_size: get(DELETION_BATCH_SIZE).integer(1, 1_000_000)?,
            access_time_threshold: get(FILE_ACCESS_TIME_THRESHOLD_MINUTES)
                .float(0.0, 1e9)
                .map(|m| Duration::from_secs_f64(m * 60.0))?,
            hex_bucket_len: get(HEX_BUCKET_LEN).integer(1, 4)?,
            enable_dir_cleanup: get(ENABLE_DIR_CLEANUP).boolean()?,
            dir_cleanup_ttl: get(DIR_CLEANUP_TTL_SECONDS).seconds()?,
            dry_run: get(DRY_RUN).boolean()?,
            log_level: get(LOG_LEVEL).log_level()?,
            log_file_path: get(LOG_FILE_PATH).optional().map(PathBuf::from),
            storage_events_endpoint: get(STORAGE_EVENTS_ENDPOINT).endpoint()?,
            status_interval: get(STATUS_INTERVAL_SECONDS).positive_seconds()?,
            metrics_port: match get(METRICS_PORT).optional() {
                None => None,
                Some(_) => Some(get(METRICS_PORT).integer(0, u16::MAX as usize)? as u16),
            },
            metrics_address: get(METRICS_ADDRESS).parsed("an IP address")?,
            max_candidates: get(MAX_CANDIDATES).integer(1, 1 << 26)?,
            max_files_per_second: (rate > 0.0).then_some(rate),
            tmp_file_ttl: (!tmp_ttl.is_zero()).then_some(tmp_ttl),
            prefill_interval: (!prefill.is_zero()).then_some(prefill),
        })
    }

    /// The directory the evictor manages: `PVC_MOUNT_PATH/CACHE_DIRECTORY`.
    pub fn cache_root(&self) -> PathBuf {
        self.pvc_mount_path.join(&self.cache_directory)
    }
}

/// One raw value on its way to a typed field.
struct Raw {
    var: &'static str,
    value: String,
}

impl Raw {
    fn get(lookup: &impl Fn(&str) -> Option<String>, var: &'static str) -> Raw {
        let value = lookup(var)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| default_of(var).to_owned());
        Raw { var, value }
    }

    fn invalid(&self, reason: impl Into<String>) -> ConfigError {
        ConfigError::Invalid { var: self.var, value: self.value.clone(), reason: reason.into() }
    }

    fn optional(&self) -> Option<String> {
        (!self.value.is_empty()).then(|| self.value.clone())
    }

    fn parsed<T: std::str::FromStr>(&self, what: &str) -> Result<T, ConfigError> {
        self.value.parse().map_err(|_| self.invalid(format!("expected {what}")))
    }

    fn float(&self, min: f64, max: f64) -> Result<f64, ConfigError> {
        let v: f64 = self.parsed("a number")?;
        if !v.is_finite() || v < min || v > max {
            return Err(self.invalid(format!("expected a number from {min} to {max}")));
        }
        Ok(v)
    }

    fn percent(&self) -> Result<f64, ConfigError> {
        self.float(0.0, 100.0)
    }

    fn integer(&self, min: usize, max: usize) -> Result<usize, ConfigError> {
        let v: usize = self.parsed("a whole number")?;
        if v < min || v > max {
            return Err(self.invalid(format!("expected a whole number from {min} to {max}")));
        }
        Ok(v)
    }

    fn seconds(&self) -> Result<Duration, ConfigError> {
        self.float(0.0, 1e9).map(Duration::from_secs_f64)
    }

    fn positive_seconds(&self) -> Result<Duration, ConfigError> {
        let d = self.seconds()?;
        if d.is_zero() {
            return Err(self.invalid("expected a number of seconds above 0"));
        }
        Ok(d)
    }

    fn boolean(&self) -> Result<bool, ConfigError> {
        match self.value.to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" => Ok(true),
            "false" | "0" | "no" | "off" => Ok(false),
            _ => Err(self.invalid("expected true or false")),
        }
    }

    fn log_level(&self) -> Result<LogLevel, ConfigError> {
        match self.value.to_ascii_uppercase().as_str() {
            "DEBUG" | "TRACE" => Ok(LogLevel::Debug),
            "INFO" => Ok(LogLevel::Info),
            "WARNING" | "WARN" => Ok(LogLevel::Warning),
            "ERROR" | "CRITICAL" => Ok(LogLevel::Error),
            _ => Err(self.invalid("expected DEBUG, INFO, WARNING or ERROR")),
        }
    }

    fn absolute_path(&self) -> Result<PathBuf, ConfigError> {
        let p = PathBuf::from(&self.value);
        if !p.is_absolute() {
            return Err(self.invalid("expected an absolute path"));
        }
        Ok(p)
    }

    fn relative_path(&self) -> Result<PathBuf, ConfigError> {
        let p = PathBuf::from(&self.value);
        let escapes = Path::new(&self.value)
            .components()
            .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir));
        if escapes {
            return Err(self.invalid("expected a path relative to PVC_MOUNT_PATH without '..'"));
        }
        Ok(p)
    }

    fn endpoint(&self) -> Result<Option<String>, ConfigError> {
        let Some(v) = self.optional() else {
            return Ok(None);
        };
        let valid = v
            .strip_prefix("tcp://")
            .and_then(|rest| rest.rsplit_once(':'))
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        if !valid {
            return Err(self.invalid("expected tcp://<host>:<port>, e.g. tcp://*:5557"));
        }
        Ok(Some(v))
    }
}

fn default_of(var: &str) -> &'static str {
    VARIABLES.iter().find(|v| v.name == var).map(|v| v.default).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn with(pairs: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let map: HashMap<String, String> =
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Config::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn defaults_match_the_python_evictor() {
        let c = Config::default();
        assert_eq!(c.pvc_mount_path, PathBuf::from("/kv-cache"));
        assert_eq!(c.cache_root(), PathBuf::from("/kv-cache/kv/model-cache/models"));
        assert_eq!((c.cleanup_threshold, c.target_threshold), (85.0, 70.0));
        assert_eq!(c.crawler_threads, 8);
        // The one default changed on purpose: a crossing is seen within
        // 50 ms (a check costs about 30 µs), so pre-filled deletion starts
        // within 100 ms of it.
        assert_eq!(c.logger_interval, Duration::from_millis(50));
        assert_eq!((c.file_queue_maxsize, c.file_queue_min_size), (10_000, 1_000));
        assert_eq!(c.deletion_batch_size, 100);
        assert_eq!(c.access_time_threshold, Duration::from_secs(3600));
        assert_eq!(c.hex_bucket_len, 3);
        assert!(c.enable_dir_cleanup && !c.dry_run);
        assert_eq!(c.log_level, LogLevel::Info);
        assert_eq!(c.log_file_path, None);
        assert_eq!(c.storage_events_endpoint, None);
        assert_eq!(c.metrics_port, None);
        assert_eq!(c.prefill_interval, Some(Duration::from_secs(1800)));
        assert_eq!(with(&[("PREFILL_INTERVAL_SECONDS", "0")]).unwrap().prefill_interval, None);
    }

    #[test]
    fn every_original_variable_is_known() {
        for name in [
            "PVC_MOUNT_PATH",
            "CACHE_DIRECTORY",
            "CLEANUP_THRESHOLD",
            "TARGET_THRESHOLD",
            "NUM_CRAWLER_PROCESSES",
            "LOGGER_INTERVAL_SECONDS",
            "FILE_QUEUE_MAXSIZE",
            "FILE_QUEUE_MIN_SIZE",
            "DELETION_BATCH_SIZE",
            "FILE_ACCESS_TIME_THRESHOLD_MINUTES",
            "HEX_BUCKET_LEN",
            "ENABLE_DIR_CLEANUP",
            "DIR_CLEANUP_TTL_SECONDS",
            "DRY_RUN",
            "LOG_LEVEL",
            "LOG_FILE_PATH",
            "STORAGE_EVENTS_ENDPOINT",
        ] {
            assert!(VARIABLES.iter().any(|v| v.name == name), "{name}");
        }
    }

    #[test]
    fn values_override_defaults() {
        let c = with(&[
            ("CLEANUP_THRESHOLD", "90"),
            ("TARGET_THRESHOLD", "50.5"),
            ("DRY_RUN", "True"),
            ("LOG_LEVEL", "warning"),
            ("STORAGE_EVENTS_ENDPOINT", "tcp://*:5557"),
            ("METRICS_PORT", "9100"),
            ("FILE_ACCESS_TIME_THRESHOLD_MINUTES", "0.5"),
        ])
        .unwrap();
        assert_eq!((c.cleanup_threshold, c.target_threshold), (90.0, 50.5));
        assert!(c.dry_run);
        assert_eq!(c.log_level, LogLevel::Warning);
        assert_eq!(c.storage_events_endpoint.as_deref(), Some("tcp://*:5557"));
        assert_eq!(c.metrics_port, Some(9100));
        assert_eq!(c.access_time_threshold, Duration::from_secs(30));
    }

    #[test]
    fn invalid_values_name_the_variable() {
        for (var, value) in [
            ("CLEANUP_THRESHOLD", "abc"),
            ("CLEANUP_THRESHOLD", "101"),
            ("TARGET_THRESHOLD", "90"),
            ("NUM_CRAWLER_PROCESSES", "0"),
            ("LOGGER_INTERVAL_SECONDS", "0"),
            ("DELETION_BATCH_SIZE", "-3"),
            ("HEX_BUCKET_LEN", "9"),
            ("DRY_RUN", "maybe"),
            ("LOG_LEVEL", "LOUD"),
            ("PVC_MOUNT_PATH", "relative/path"),
            ("CACHE_DIRECTORY", "../../etc"),
            ("CACHE_DIRECTORY", "/abs"),
            ("STORAGE_EVENTS_ENDPOINT", "localhost:5557"),
            ("METRICS_PORT", "70000"),
            ("PREFILL_INTERVAL_SECONDS", "-1"),
            ("PREFILL_INTERVAL_SECONDS", "soon"),
        ] {
            let err = with(&[(var, value)]).unwrap_err();
            let ConfigError::Invalid { var: named, .. } = &err;
            assert_eq!(*named, var, "{err}");
            assert!(err.to_string().contains(var), "{err}");
        }
    }

    #[test]
    fn flags_are_derived_from_names() {
        let v = VARIABLES.iter().find(|v| v.name == DRY_RUN).unwrap();
        assert_eq!(v.flag(), "dry-run");
    }
}
