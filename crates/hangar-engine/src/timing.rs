//! How long a scheduler pass takes.
//!
//! The schedulers decide *what* runs in a pass; a [`TimingModel`] decides how
//! long that pass takes on the modelled hardware. A pass runs its prefill work
//! and then its decode step, so its duration is
//! `(prefill_ms + decode_ms) / speedup_ratio`.
//!
//! Three models ship:
//! - [`Polynomial`]: the published default of Dynamo's mocker, so reports can
//!   be compared with it: `prefill_ms = 4.209989e-7·T² + 1.518344e-2·T +
//!   16.50142` with `T` the new (uncached) prompt tokens in the pass, and
//!   `decode_ms = max(1, −25.74·p² + 54.01·p + 5.74)` with `p = min(1, context
//!   tokens of the decoding requests / KV capacity in tokens)`.
//! - [`Fixed`]: constant milliseconds per pass with prefill work and per pass
//!   with decode work.
//! - [`Table`]: piecewise-linear interpolation through measured points read
//!   from a CSV file (see [`Table::from_csv`]).

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// The prefill work of one pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefillShape {
    /// Requests that computed prompt tokens in this pass.
    pub batch: u32,
    /// Prompt tokens computed in this pass (cache hits excluded).
    pub new_tokens: u32,
}

/// The decode work of one pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DecodeShape {
    /// Requests that decoded one token in this pass.
    pub batch: u32,
    /// The sum of those requests' context lengths (prompt + generated).
    pub context_tokens: u64,
    /// The engine's KV capacity in tokens (`num_gpu_blocks × block_size`).
    pub capacity_tokens: u64,
}

/// Predicts pass durations. Implementations must be pure functions of their
/// inputs so that simulations are reproducible.
pub trait TimingModel: fmt::Debug + Send + Sync {
    /// Milliseconds of prefill work; only called with `new_tokens > 0`.
    fn prefill_ms(&self, shape: PrefillShape) -> f64;
    /// Milliseconds of decode work; only called with `batch > 0`.
    fn decode_ms(&self, shape: DecodeShape) -> f64;
}

/// Dynamo mocker's default polynomial fit (see the module docs).
#[derive(Debug, Clone, Copy, Default)]
pub struct Polynomial;

impl TimingModel for Polynomial {
    fn prefill_ms(&self, shape: PrefillShape) -> f64 {
        let t = f64::from(shape.new_tokens);
        4.209989e-7 * t * t + 1.518344e-2 * t + 16.50142
    }

    fn decode_ms(&self, shape: DecodeShape) -> f64 {
        let p = if shape.capacity_tokens == 0 {
            1.0
        } else {
            (shape.context_tokens as f64 / shape.capacity_tokens as f64).min(1.0)
        };
        (-25.74 * p * p + 54.01 * p + 5.74).max(1.0)
    }
}

/// Constant per-pass costs.
#[derive(Debug, Clone, Copy)]
pub struct Fixed {
    /// Milliseconds added by any prefill work in a pass.
    pub prefill_ms: f64,
    /// Milliseconds added by any decode work in a pass.
    pub decode_ms: f64,
}

impl TimingModel for Fixed {
    fn prefill_ms(&self, _: PrefillShape) -> f64 {
        self.prefill_ms
    }
    fn decode_ms(&self, _: DecodeShape) -> f64 {
        self.decode_ms
    }
}

/// Piecewise-linear curves through measured points: prefill milliseconds by
/// new tokens in the pass, decode milliseconds by context tokens of the
/// decoding requests. Between points it interpolates; beyond the ends it
/// extends the end segments linearly (a single point is a constant), and it
/// never returns less than zero.
#[derive(Debug, Clone)]
pub struct Table {
    prefill: Vec<(f64, f64)>,
    decode: Vec<(f64, f64)>,
}

/// Why a timing table did not load; names the source and the line.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{source_name}:{line}: {why}")]
pub struct TableError {
    /// The file (or other source) the table came from.
    pub source_name: String,
    /// 1-based line number; 0 when the problem is with the table as a whole.
    pub line: usize,
    /// What was wrong.
    pub why: String,
}

impl Table {
    /// Parses a CSV with the header `phase,tokens,ms` and one point per line:
    /// `phase` is `prefill` (tokens = new prompt tokens in the pass) or
    /// `decode` (tokens = context tokens of the decoding requests), `ms` the
    /// measured pass time. Blank lines and lines starting with `#` are
    /// ignored. Each phase needs at least one point and no token count twice.
    pub fn from_csv(text: &str, source_name: &str) -> Result<Self, TableError> {
        let err = |line: usize, why: String| TableError { source_name: source_name.to_owned(), line, why };
        let mut lines = text.lines().enumerate().filter(|(_, l)| {
            let t = l.trim();
            !t.is_empty() && !t.starts_with('#')
        });
        let (hline, header) = lines.next().ok_or_else(|| err(0, "the table is empty".into()))?;
        let cols: Vec<&str> = header.split(',').map(str::trim).collect();
        if cols != ["phase", "tokens", "ms"] {
            return Err(err(hline + 1, format!("expected the header `phase,tokens,ms`, found `{header}`")));
        }
        let (mut prefill, mut decode) = (Vec::new(), Vec::new());
        for (i, line) in lines {
            let n = i + 1;
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            let [phase, tokens, ms] = fields[..] else {
                return Err(err(n, format!("expected 3 fields, found {}", fields.len())));
            };
            let tokens: f64 =
                tokens.parse().ok().filter(|t: &f64| t.is_finite() && *t >= 0.0).ok_or_else(|| {
                    err(n, format!("field `tokens`: `{tokens}` is not a non-negative number"))
                })?;
            let ms: f64 = ms
                .parse()
                .ok()
                .filter(|t: &f64| t.is_finite() && *t >= 0.0)
                .ok_or_else(|| err(n, format!("field `ms`: `{ms}` is not a non-negative number")))?;
            let curve = match phase {
                "prefill" => &mut prefill,
                "decode" => &mut decode,
                other => {
                    return Err(err(n, format!("field `phase`: `{other}` is neither `prefill` nor `decode`")))
                }
            };
            if curve.iter().any(|&(t, _)| t == tokens) {
                return Err(err(n, format!("{phase} has a second point at {tokens} tokens")));
            }
            curve.push((tokens, ms));
        }
        for (name, curve) in [("prefill", &mut prefill), ("decode", &mut decode)] {
            if curve.is_empty() {
                return Err(err(0, format!("no `{name}` points")));
            }
            curve.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        Ok(Self { prefill, decode })
    }

    fn interpolate(points: &[(f64, f64)], x: f64) -> f64 {
        let [first, .., last] = points else {
            return points[0].1;
        };
        let (a, b) = if x <= first.0 {
            (points[0], points[1])
        } else if x >= last.0 {
            (points[points.len() - 2], *last)
        } else {
            let i = points.partition_point(|p| p.0 <= x);
            (points[i - 1], points[i])
        };
        let y = a.1 + (b.1 - a.1) * (x - a.0) / (b.0 - a.0);
        y.max(0.0)
    }
}

impl TimingModel for Table {
    fn prefill_ms(&self, shape: PrefillShape) -> f64 {
        Self::interpolate(&self.prefill, f64::from(shape.new_tokens))
    }
    fn decode_ms(&self, shape: DecodeShape) -> f64 {
        Self::interpolate(&self.decode, shape.context_tokens as f64)
    }
}

/// The timing model as written in configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(tag = "model", rename_all = "snake_case", deny_unknown_fields)]
pub enum TimingConfig {
    /// [`Polynomial`].
    #[default]
    Polynomial,
    /// [`Fixed`].
    Fixed {
        /// Milliseconds per pass with prefill work.
        prefill_ms: f64,
        /// Milliseconds per pass with decode work.
        decode_ms: f64,
    },
    /// [`Table`], loaded from a CSV file by the driver.
    Table {
        /// Path of the CSV file (see [`Table::from_csv`]).
        path: String,
    },
}

/// A shareable timing model.
pub type SharedTiming = Arc<dyn TimingModel>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polynomial_matches_published_coefficients() {
        let p = Polynomial;
        let pre = p.prefill_ms(PrefillShape { batch: 1, new_tokens: 1000 });
        assert!((pre - (4.209989e-7 * 1e6 + 15.18344 + 16.50142)).abs() < 1e-9);
        let idle = p.decode_ms(DecodeShape { batch: 1, context_tokens: 0, capacity_tokens: 100 });
        assert!((idle - 5.74).abs() < 1e-12);
        let full = p.decode_ms(DecodeShape { batch: 1, context_tokens: 500, capacity_tokens: 100 });
        assert!((full - (-25.74 + 54.01 + 5.74)).abs() < 1e-9, "p is clamped to 1");
    }

    #[test]
    fn table_interpolates_and_extends_linearly() {
        let t = Table::from_csv(
            "# measured\nphase,tokens,ms\nprefill,0,10\nprefill,1000,30\ndecode,100,5\n",
            "t.csv",
        )
        .unwrap();
        assert_eq!(t.prefill_ms(PrefillShape { batch: 1, new_tokens: 500 }), 20.0);
        assert_eq!(t.prefill_ms(PrefillShape { batch: 1, new_tokens: 2000 }), 50.0);
        assert_eq!(t.decode_ms(DecodeShape { batch: 3, context_tokens: 9999, capacity_tokens: 1 }), 5.0);
    }

    #[test]
    fn table_errors_name_file_line_and_field() {
        let bad = |text: &str| Table::from_csv(text, "t.csv").unwrap_err().to_string();
        assert_eq!(bad(""), "t.csv:0: the table is empty");
        assert!(bad("x,y\n").starts_with("t.csv:1: expected the header"));
        assert_eq!(
            bad("phase,tokens,ms\nprefill,ten,3\n"),
            "t.csv:2: field `tokens`: `ten` is not a non-negative number"
        );
        assert_eq!(
            bad("phase,tokens,ms\nprefill,1,3\ndraft,1,3\n"),
            "t.csv:3: field `phase`: `draft` is neither `prefill` nor `decode`"
        );
        assert_eq!(bad("phase,tokens,ms\nprefill,1,3\n"), "t.csv:0: no `decode` points");
        assert!(bad("phase,tokens,ms\nprefill,1,3\nprefill,1,4\n").contains("second point"));
    }
}
