//! Units: time on a logical or real clock, and byte sizes written the way
//! operators write them in config files.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Milliseconds on whichever clock the caller drives: the wall clock in the
/// live runtime, the logical clock in the simulator. Policies never read a
/// clock themselves; they are handed a `Millis`.
pub type Millis = u64;

/// A number of bytes. Parses `"80GB"`, `"80 GiB"`, `"512MiB"`, `"1.5TB"` or a
/// bare integer; decimal suffixes (`KB`, `MB`, `GB`, `TB`) are powers of 1000
/// and binary ones (`KiB` … `TiB`) powers of 1024. In TOML and JSON it is
/// either an integer or such a string.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
#[serde(try_from = "ByteSizeRepr", into = "u64")]
pub struct ByteSize(u64);

/// Why a byte size did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{input}` is not a byte size: {why} (write e.g. 80GB, 512MiB or 1048576)")]
pub struct ByteSizeError {
    input: String,
    why: &'static str,
}

impl ByteSize {
    /// Wraps a byte count.
    pub const fn new(bytes: u64) -> Self {
        Self(bytes)
    }

    /// The byte count.
    pub const fn bytes(self) -> u64 {
        self.0
    }
}

impl From<ByteSize> for u64 {
    fn from(b: ByteSize) -> u64 {
        b.0
    }
}

impl FromStr for ByteSize {
    type Err = ByteSizeError;
    fn from_str(input: &str) -> Result<Self, ByteSizeError> {
        let err = |why| ByteSizeError { input: input.to_owned(), why };
        let s = input.trim();
        let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
        let (num, unit) = s.split_at(split);
        if num.is_empty() {
            return Err(err("no number"));
        }
        let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kb" => 1_000,
            "m" | "mb" => 1_000_000,
            "g" | "gb" => 1_000_000_000,
            "t" | "tb" => 1_000_000_000_000,
            "kib" => 1 << 10,
            "mib" => 1 << 20,
            "gib" => 1 << 30,
            "tib" => 1 << 40,
            _ => return Err(err("unknown unit")),
        };
        if let Ok(n) = num.parse::<u64>() {
            return n.checked_mul(mult).map(Self).ok_or_else(|| err("too large"));
        }
        let f: f64 = num.parse().map_err(|_| err("malformed number"))?;
        let total = f * mult as f64;
        if !total.is_finite() || total >= u64::MAX as f64 {
            return Err(err("too large"));
        }
        Ok(Self(total.round() as u64))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u64); 4] =
            [("TB", 1_000_000_000_000), ("GB", 1_000_000_000), ("MB", 1_000_000), ("KB", 1_000)];
        for (name, size) in UNITS {
            if self.0 >= size {
                return write!(f, "{:.1}{name}", self.0 as f64 / size as f64);
            }
        }
        write!(f, "{}B", self.0)
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum ByteSizeRepr {
    Int(u64),
    Str(String),
}

impl TryFrom<ByteSizeRepr> for ByteSize {
    type Error = ByteSizeError;
    fn try_from(r: ByteSizeRepr) -> Result<Self, ByteSizeError> {
        match r {
            ByteSizeRepr::Int(n) => Ok(Self(n)),
            ByteSizeRepr::Str(s) => s.parse(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_decimal_binary_and_fractional_sizes() {
        assert_eq!("80GB".parse::<ByteSize>().unwrap().bytes(), 80_000_000_000);
        assert_eq!("80 GiB".parse::<ByteSize>().unwrap().bytes(), 80 << 30);
        assert_eq!("1.5TB".parse::<ByteSize>().unwrap().bytes(), 1_500_000_000_000);
        assert_eq!("4096".parse::<ByteSize>().unwrap().bytes(), 4096);
        let e = "12 parsecs".parse::<ByteSize>().unwrap_err();
        assert!(e.to_string().contains("unknown unit"), "{e}");
        assert!("GB".parse::<ByteSize>().is_err());
        assert!("99999999999999TB".parse::<ByteSize>().is_err());
    }

    #[test]
    fn deserializes_from_integer_or_string() {
        let a: ByteSize = serde_json::from_str("1024").unwrap();
        let b: ByteSize = serde_json::from_str("\"1KiB\"").unwrap();
        assert_eq!(a, b);
        assert!(serde_json::from_str::<ByteSize>("\"lots\"").is_err());
    }
}
