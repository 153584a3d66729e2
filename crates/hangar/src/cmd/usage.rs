//! `hangar usage`: a server's usage and billing, from its `GET /v1/usage`
//! (docs/observability.md), as a table or as the server's JSON.

use anyhow::{bail, Context};
use serde_json::Value;

/// Usage and billing of a running server, grouped by model, account, day
/// or hour: requests, errors, tokens in and out, images, seconds of
/// inference, Replicate-style cost (USD) and Workers AI neurons. An
/// account's key shows its own usage; an admin key every account's.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The server.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// An API key of the server (none for a server without keys).
    #[arg(long, env = "HANGAR_API_KEY", hide_env_values = true)]
    key: Option<String>,
    /// From (RFC 3339, e.g. 2026-11-27T00:00:00Z, or Unix seconds);
    /// default: a day before `--to`.
    #[arg(long)]
    from: Option<String>,
    /// To, excluded (RFC 3339 or Unix seconds); default: now.
    #[arg(long)]
    to: Option<String>,
    /// Only this model's usage.
    #[arg(long)]
    model: Option<String>,
    /// Only this account's usage (another account's needs an admin key).
    #[arg(long)]
    account: Option<String>,
    /// Group by model, account, day or hour (UTC).
    #[arg(long, value_parser = ["model", "account", "day", "hour"])]
    group_by: Option<String>,
    /// Print the server's JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let url = format!("{}/v1/usage", args.url.trim_end_matches('/'));
    let params: Vec<(&str, &String)> = [
        ("from", &args.from),
        ("to", &args.to),
        ("model", &args.model),
        ("account", &args.account),
        ("group_by", &args.group_by),
    ]
    .into_iter()
    .filter_map(|(name, value)| value.as_ref().map(|v| (name, v)))
    .collect();
    let mut request = reqwest::blocking::Client::new().get(&url).query(&params);
    if let Some(key) = &args.key {
        request = request.bearer_auth(key);
    }
    let response = request.send().with_context(|| format!("cannot reach {url}"))?;
    let status = response.status();
    let body: Value = response.json().with_context(|| format!("{url} answered {status}, not JSON"))?;
    if !status.is_success() {
        let message = body.pointer("/error/message").and_then(Value::as_str).unwrap_or("(no message)");
        bail!("{url} answered {status}: {message}");
    }
    match args.json {
        true => println!("{}", serde_json::to_string_pretty(&body)?),
        false => print!("{}", table(&body)),
    }
    Ok(())
}

/// The report as a table: a line per group, then the total.
fn table(report: &Value) -> String {
    let text = |v: &Value| v.as_str().unwrap_or("-").to_owned();
    let mut out = format!(
        "usage from {} to {}{}{}\n",
        text(&report["from"]),
        text(&report["to"]),
        report["model"].as_str().map(|m| format!(", model {m}")).unwrap_or_default(),
        report["account"].as_str().map(|a| format!(", account {a}")).unwrap_or_default(),
    );
    let by = report["group_by"].as_str().unwrap_or("group");
    let header = [by, "requests", "errors", "tokens_in", "tokens_out", "images", "seconds", "usd", "neurons"];
    let row = |group: String, t: &Value| -> Vec<String> {
        let int = |k: &str| t[k].as_u64().unwrap_or(0).to_string();
        let real = |k: &str, places: usize| format!("{:.*}", places, t[k].as_f64().unwrap_or(0.0));
        vec![
            group,
            int("requests"),
            int("errors"),
            int("input_tokens"),
            int("output_tokens"),
            int("images"),
            real("seconds", 1),
            real("usd", 6),
            real("neurons", 2),
        ]
    };
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    for g in report["data"].as_array().into_iter().flatten() {
        rows.push(row(text(&g["group"]), g));
    }
    rows.push(row("total".into(), &report["total"]));
    let widths: Vec<usize> =
        (0..header.len()).map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0)).collect();
    for r in rows {
        let cells: Vec<String> = r
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(c, (cell, w))| match c {
                0 => format!("{cell:<w$}"),
                _ => format!("{cell:>w$}"),
            })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_table_has_a_line_per_group_and_the_total_aligned() {
        let totals = |n: u64, usd: f64| {
            json!({"requests": n, "errors": 1, "input_tokens": 10 * n, "output_tokens": 20 * n, "images": 0,
                   "seconds": 1.25, "usd": usd, "neurons": 3.5})
        };
        let mut a = totals(2, 0.0123);
        a["group"] = json!("demo/chat");
        let mut b = totals(12, 0.5);
        b["group"] = json!("t/x");
        let report = json!({"from": "2026-11-26T00:00:00Z", "to": "2026-11-27T00:00:00Z", "group_by": "model",
                            "model": null, "account": "acme", "data": [a, b], "total": totals(14, 0.5123)});
        let text = table(&report);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "usage from 2026-11-26T00:00:00Z to 2026-11-27T00:00:00Z, account acme");
        assert!(lines[1].starts_with("model      requests  errors"), "{text}");
        assert!(lines[2].starts_with("demo/chat         2       1"), "{text}");
        assert_eq!(
            lines[4],
            "total            14       1        140         280       0      1.2  0.512300     3.50"
        );
        assert!(lines[4].ends_with("1.2  0.512300     3.50"), "{text}");
        assert_eq!(lines.len(), 5);
    }
}
