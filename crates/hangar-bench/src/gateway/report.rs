//! `hangar bench gateway`'s figures, as a table for people and JSON for scripts.

use std::fmt;

use serde::Serialize;

use super::BodyKind;
use crate::load::PathStats;
use crate::processes::ProcessCpu;

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
    /// The gateway's CPU in the closed loop.
    pub cpu: Cpu,
    /// The same gateway without inference events, when asked for
    /// (`--compare-events`): its paths took turns with the others.
    pub without_events: Option<Gateway>,
    /// The gateway of another build, when asked for (`--baseline`): its
    /// paths took turns with the others.
    pub baseline: Option<Gateway>,
}

/// One gateway's figures: both phases against the direct path, and its CPU.
#[derive(Debug, Clone, Serialize)]
pub struct Gateway {
    /// Maximum throughput.
    pub closed_loop: Phase,
    /// Latency under load.
    pub open_loop: Phase,
    /// Its CPU in the closed loop.
    pub cpu: Cpu,
}

/// What a gateway process spent on the CPU in the closed loop, per
/// request: steadier than a throughput share, which also moves with the
/// load generator's and the engine's share of the same cores.
#[derive(Debug, Clone, Serialize)]
pub struct Cpu {
    /// All its threads, microseconds per request.
    pub us_per_request: f64,
    /// Of which its inference-event writer thread.
    pub events_writer_us_per_request: f64,
}

impl Cpu {
    /// `spent` over `requests`.
    pub(super) fn new(spent: ProcessCpu, requests: u64) -> Self {
        let per = |d: std::time::Duration| d.as_secs_f64() * 1e6 / requests.max(1) as f64;
        Cpu { us_per_request: per(spent.total), events_writer_us_per_request: per(spent.named) }
    }
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
        writeln!(
            f,
            "  gateway CPU = {:.1} µs per request, of which the events writer {:.1} µs",
            self.cpu.us_per_request, self.cpu.events_writer_us_per_request
        )?;
        writeln!(f, "\nopen loop, {} req/s (latency under load)", self.rate)?;
        self.open_loop.rows(f)?;
        let added = self.open_loop.added.p99_ms;
        writeln!(
            f,
            "  p99 added latency = {added:.3} ms (target <= {TARGET_ADDED_P99_MS} ms at 1000 req/s: {})",
            verdict(added <= TARGET_ADDED_P99_MS)
        )?;
        if let Some(bare) = &self.without_events {
            let title = "the same gateway without inference events ([events] enabled = false)";
            self.side_by_side(f, title, "without events", bare)?;
        }
        if let Some(baseline) = &self.baseline {
            self.side_by_side(f, "the baseline's gateway (--baseline)", "the baseline", baseline)?;
        }
        Ok(())
    }
}

impl Report {
    /// This gateway next to `other`, whose paths took turns with its own.
    fn side_by_side(
        &self,
        f: &mut fmt::Formatter<'_>,
        title: &str,
        name: &str,
        other: &Gateway,
    ) -> fmt::Result {
        writeln!(f, "\n{title}, taking turns with this one")?;
        other.closed_loop.rows(f)?;
        let (this, that) = (self.closed_loop.throughput_share, other.closed_loop.throughput_share);
        writeln!(
            f,
            "  closed loop: {:.1} % of direct here, {:.1} % {name} ({:+.1} points)",
            this * 100.0,
            that * 100.0,
            (this - that) * 100.0
        )?;
        let (this, that) = (self.cpu.us_per_request, other.cpu.us_per_request);
        writeln!(
            f,
            "  gateway CPU: {this:.1} µs per request here, {that:.1} µs {name} ({:+.1} µs, {:+.1} %)",
            this - that,
            (this / that - 1.0) * 100.0
        )?;
        writeln!(
            f,
            "  open loop added p50 / p99: {:.3} / {:.3} ms here, {:.3} / {:.3} ms {name}",
            self.open_loop.added.p50_ms,
            self.open_loop.added.p99_ms,
            other.open_loop.added.p50_ms,
            other.open_loop.added.p99_ms
        )
    }
}
