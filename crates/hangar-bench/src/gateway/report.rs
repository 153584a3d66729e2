//! `hangar bench gateway`'s figures, as a table for people and JSON for scripts.

use std::fmt;

use serde::Serialize;

use super::BodyKind;
use crate::load::PathStats;

/// The targets the figures are held against (issue 5's "Benchmark").
const TARGET_ADDED_P99_MS: f64 = 0.5;
const TARGET_THROUGHPUT_SHARE: f64 = 0.5;

/// Everything one `hangar bench gateway` measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Requests per path in each phase.
    pub requests: usize,
    /// Keep-alive clients per path.
    pub concurrency: usize,
    /// Requests per second of the open loop.
    pub rate: f64,
    /// What the requests looked like.
    pub body: BodyKind,
    /// The mock engine's base URL.
    pub engine_url: String,
    /// The gateway's base URL.
    pub gateway_url: String,
    /// Maximum throughput: `concurrency` clients, back to back.
    pub closed_loop: Phase,
    /// Latency at `rate` requests per second.
    pub open_loop: Phase,
}

/// One phase on both paths.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    /// Straight to the engine.
    pub direct: PathStats,
    /// Through the gateway.
    pub gateway: PathStats,
    /// Gateway minus direct, percentile by percentile.
    pub added: Added,
    /// The gateway's requests per second as a share of the direct path's.
    pub throughput_share: f64,
}

/// What the gateway adds at each percentile (milliseconds).
#[derive(Debug, Clone, Serialize)]
pub struct Added {
    /// At the median.
    pub p50_ms: f64,
    /// At the 90th percentile.
    pub p90_ms: f64,
    /// At the 99th percentile.
    pub p99_ms: f64,
}

impl Phase {
    /// Compares the two paths.
    pub fn new(direct: PathStats, gateway: PathStats) -> Self {
        let added = Added {
            p50_ms: gateway.p50_ms - direct.p50_ms,
            p90_ms: gateway.p90_ms - direct.p90_ms,
            p99_ms: gateway.p99_ms - direct.p99_ms,
        };
        let throughput_share =
            if direct.req_per_s > 0.0 { gateway.req_per_s / direct.req_per_s } else { 0.0 };
        Self { direct, gateway, added, throughput_share }
    }
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "MISSED"
    }
}

impl Phase {
    fn rows(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "  {:<8} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7}",
            "path", "req/s", "mean ms", "p50 ms", "p90 ms", "p99 ms", "max ms", "errors"
        )?;
        for (name, s) in [("direct", &self.direct), ("gateway", &self.gateway)] {
            writeln!(
                f,
                "  {name:<8} {:>10.0} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>7}",
                s.req_per_s, s.mean_ms, s.p50_ms, s.p90_ms, s.p99_ms, s.max_ms, s.errors
            )?;
        }
        let a = &self.added;
        writeln!(
            f,
            "  {:<8} {:>10} {:>9} {:>+9.3} {:>+9.3} {:>+9.3}",
            "added", "", "", a.p50_ms, a.p90_ms, a.p99_ms
        )?;
        for (name, s) in [("direct", &self.direct), ("gateway", &self.gateway)] {
            if let Some(e) = &s.first_error {
                writeln!(f, "  first {name} error: {e}")?;
            }
        }
        Ok(())
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let body = match self.body {
            BodyKind::Chat => "chat",
            BodyKind::Completion => "completion",
        };
        writeln!(
            f,
            "hangar bench gateway: {} {body} requests per path and phase; engine {} (mock, preset instant), gateway {}",
            self.requests, self.engine_url, self.gateway_url
        )?;
        writeln!(f, "\nclosed loop, {} keep-alive clients (maximum throughput)", self.concurrency)?;
        self.closed_loop.rows(f)?;
        let share = self.closed_loop.throughput_share;
        writeln!(
            f,
            "  gateway throughput = {:.0} % of direct (target >= {:.0} %: {})",
            share * 100.0,
            TARGET_THROUGHPUT_SHARE * 100.0,
            verdict(share >= TARGET_THROUGHPUT_SHARE)
        )?;
        writeln!(f, "\nopen loop, {} req/s (latency under load)", self.rate)?;
        self.open_loop.rows(f)?;
        let added = self.open_loop.added.p99_ms;
        writeln!(
            f,
            "  p99 added latency = {added:.3} ms (target <= {TARGET_ADDED_P99_MS} ms at 1000 req/s: {})",
            verdict(added <= TARGET_ADDED_P99_MS)
        )
    }
}
