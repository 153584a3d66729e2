//! `hangar plan SCENARIO`: a placement dry run for operators.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use hangar_placement::scenario::{plan, Format};

/// Arguments of `hangar plan`.
#[derive(Debug, clap::Args)]
#[command(after_help = "The scenario lists nodes, model sizes, current deployments and what to ask \
(evictions, a dedicated schedule, replica requests) plus a seed; see examples/plan.toml.")]
pub struct Args {
    /// Scenario file (TOML, or JSON if it ends in .json or starts with `{`).
    pub scenario: PathBuf,
    /// Print the report as JSON instead of tables.
    #[arg(long)]
    pub json: bool,
}

/// Reads the scenario, plans it, prints the report.
pub fn run(args: Args) -> anyhow::Result<()> {
    let name = args.scenario.display().to_string();
    let text = super::read_text(&args.scenario)?;
    let report =
        plan(&text, Format::guess(&name, &text)).with_context(|| format!("invalid scenario {name}"))?;
    let out = if args.json {
        let mut s = serde_json::to_string_pretty(&report).context("cannot encode the report")?;
        s.push('\n');
        s
    } else {
        report.render_table()
    };
    std::io::stdout().lock().write_all(out.as_bytes()).context("cannot write the report")?;
    Ok(())
}
