//! The two formats every Hangar `/metrics` answers in — the server's, a
//! node agent's, the mock engine's, the store daemon's — and which one a
//! scraper gets.
//!
//! Hangar's figures are kept with `prometheus-client`, whose encoder
//! writes the OpenMetrics text format: a counter's family is named
//! without `_total` (`# TYPE hangar_requests counter`, then samples
//! `hangar_requests_total{…}`) and the exposition ends with `# EOF`.
//! Prometheus asks for that format first in its `Accept` header and gets
//! it. Anything else — `curl`, `promtool check metrics`, a scraper that
//! only knows the older format — gets the Prometheus text format 0.0.4,
//! in which a family is named like its samples (`# TYPE
//! hangar_requests_total counter`): served OpenMetrics under the older
//! format's name, every counter would be read as an untyped series with
//! no help. [`Format::render`] turns one into the other.

/// A format of the `/metrics` exposition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0.0 text.
    OpenMetrics,
    /// The Prometheus text format 0.0.4.
    Text,
}

/// The `Content-Type` of an OpenMetrics answer.
pub const OPENMETRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The `Content-Type` of a Prometheus text format answer.
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

impl Format {
    /// The format a scraper's `Accept` header asks for: OpenMetrics when it
    /// names `application/openmetrics-text` with a weight above 0 (as
    /// Prometheus does), the text format otherwise (no header, `*/*`).
    pub fn negotiate(accept: Option<&str>) -> Format {
        let asks = |range: &str| {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or_default();
            let refused = parts
                .any(|p| p.strip_prefix("q=").and_then(|q| q.parse::<f64>().ok()).is_some_and(|q| q <= 0.0));
            media.eq_ignore_ascii_case("application/openmetrics-text") && !refused
        };
        match accept.is_some_and(|a| a.split(',').any(asks)) {
            true => Format::OpenMetrics,
            false => Format::Text,
        }
    }

    /// Its `Content-Type`.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => OPENMETRICS_CONTENT_TYPE,
            Format::Text => TEXT_CONTENT_TYPE,
        }
    }

    /// `openmetrics` — an OpenMetrics text exposition, as
    /// `prometheus-client` encodes it — in this format.
    ///
    /// To the text format: a counter family's `# HELP` and `# TYPE` lines
    /// take its samples' `_total` name, its `_created` samples (the older
    /// format has none) are left out, an `unknown` family becomes
    /// `untyped`, and the `# UNIT` and `# EOF` lines go.
    pub fn render(self, openmetrics: String) -> String {
        match self {
            Format::OpenMetrics => openmetrics,
            Format::Text => to_text(&openmetrics),
        }
    }
}

fn to_text(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    // The `# HELP` line of the family whose `# TYPE` comes next.
    let mut help: Option<(&str, &str)> = None;
    // The counter family the samples belong to.
    let mut counter: Option<&str> = None;
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            flush_help(&mut out, help.take(), None);
            help = Some(rest.split_once(' ').unwrap_or((rest, "")));
            counter = None;
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (family, kind) = rest.split_once(' ').unwrap_or((rest, ""));
            let (name, kind) = match kind {
                "counter" if !family.ends_with("_total") => {
                    counter = Some(family);
                    (format!("{family}_total"), "counter")
                }
                "unknown" => (family.to_owned(), "untyped"),
                _ => (family.to_owned(), kind),
            };
            match help.take() {
                Some(held) if held.0 == family => flush_help(&mut out, Some(held), Some(&name)),
                other => flush_help(&mut out, other, None),
            }
            out.push_str("# TYPE ");
            out.push_str(&name);
            out.push(' ');
            out.push_str(kind);
            out.push('\n');
        } else if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        } else {
            flush_help(&mut out, help.take(), None);
            let created = counter.is_some_and(|c| {
                line.strip_prefix(c)
                    .and_then(|r| r.strip_prefix("_created"))
                    .is_some_and(|r| r.starts_with(['{', ' ']))
            });
            if !created {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    flush_help(&mut out, help, None);
    out
}

/// Writes a held `# HELP` line, under `name` when given.
fn flush_help(out: &mut String, help: Option<(&str, &str)>, name: Option<&str>) {
    let Some((family, text)) = help else { return };
    out.push_str("# HELP ");
    out.push_str(name.unwrap_or(family));
    out.push(' ');
    out.push_str(text);
    out.push('\n');
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPENMETRICS: &str = "\
# HELP hangar_requests Requests ended.
# TYPE hangar_requests counter
hangar_requests_total{model=\"a\",status=\"200\"} 3
hangar_requests_created{model=\"a\",status=\"200\"} 1700000000.0
# HELP hangar_permits Permits of ready replicas.
# TYPE hangar_permits gauge
hangar_permits{model=\"a\"} 1
# HELP hangar_wait_seconds Time to a permit.
# TYPE hangar_wait_seconds histogram
# UNIT hangar_wait_seconds seconds
hangar_wait_seconds_sum 0.5
hangar_wait_seconds_count 1
hangar_wait_seconds_bucket{le=\"1.0\"} 1
hangar_wait_seconds_bucket{le=\"+Inf\"} 1
# HELP hangar_odd Something.
# TYPE hangar_odd unknown
hangar_odd 2
# HELP hangar_done_total Already named for its samples.
# TYPE hangar_done_total counter
hangar_done_total 4
# EOF
";

    #[test]
    fn counters_take_their_samples_name_in_the_text_format() {
        let text = Format::Text.render(OPENMETRICS.to_owned());
        assert_eq!(
            text,
            "\
# HELP hangar_requests_total Requests ended.
# TYPE hangar_requests_total counter
hangar_requests_total{model=\"a\",status=\"200\"} 3
# HELP hangar_permits Permits of ready replicas.
# TYPE hangar_permits gauge
hangar_permits{model=\"a\"} 1
# HELP hangar_wait_seconds Time to a permit.
# TYPE hangar_wait_seconds histogram
hangar_wait_seconds_sum 0.5
hangar_wait_seconds_count 1
hangar_wait_seconds_bucket{le=\"1.0\"} 1
hangar_wait_seconds_bucket{le=\"+Inf\"} 1
# HELP hangar_odd Something.
# TYPE hangar_odd untyped
hangar_odd 2
# HELP hangar_done_total Already named for its samples.
# TYPE hangar_done_total counter
hangar_done_total 4
"
        );
        assert_eq!(Format::OpenMetrics.render(OPENMETRICS.to_owned()), OPENMETRICS);
    }

    #[test]
    fn prometheus_gets_openmetrics_and_anything_else_the_text_format() {
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
                          version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert_eq!(Format::negotiate(Some(prometheus)), Format::OpenMetrics);
        assert_eq!(Format::negotiate(Some("Application/OpenMetrics-Text")), Format::OpenMetrics);
        assert_eq!(Format::negotiate(None), Format::Text);
        assert_eq!(Format::negotiate(Some("*/*")), Format::Text);
        assert_eq!(Format::negotiate(Some("text/plain;version=0.0.4")), Format::Text);
        assert_eq!(Format::negotiate(Some("application/openmetrics-text;q=0")), Format::Text);
        assert_eq!(Format::OpenMetrics.content_type(), OPENMETRICS_CONTENT_TYPE);
        assert_eq!(Format::Text.content_type(), TEXT_CONTENT_TYPE);
    }
}
