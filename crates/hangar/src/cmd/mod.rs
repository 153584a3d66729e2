//! One module per subcommand. Each exposes `Args` (clap) and `run(args)`,
//! plus the few file helpers they share.

use std::io::{BufWriter, ErrorKind, Write};
use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;

pub mod agent;
pub mod bench;
pub mod engine;
pub mod evict;
pub mod plan;
pub mod serve;
pub mod sim;
mod sim_live;
pub mod store;
pub mod trace;
pub mod usage;

/// Prints an error chain the way users read it (`error: … caused by: …`) and
/// picks the exit code. A broken pipe (`hangar sim | head`) is not a failure.
pub fn report(err: &anyhow::Error) -> ExitCode {
    let broken_pipe = err
        .chain()
        .filter_map(|e| e.downcast_ref::<std::io::Error>())
        .any(|e| e.kind() == ErrorKind::BrokenPipe);
    if broken_pipe {
        return ExitCode::SUCCESS;
    }
    eprint!("{}", chain_text(err));
    ExitCode::FAILURE
}

/// An error chain as [`report`] prints it. Many errors put their cause in
/// their own message (`invalid configuration FILE: <the parser's error>`);
/// such a cause is not printed again, so a TOML error — several lines
/// with the offending one quoted — shows once.
fn chain_text(err: &anyhow::Error) -> String {
    let mut out = format!("error: {err}\n");
    let mut said = err.to_string();
    for cause in err.chain().skip(1) {
        let text = cause.to_string();
        if !said.contains(&text) {
            out.push_str(&format!("  caused by: {text}\n"));
        }
        said = text;
    }
    out
}

/// Reads a whole text file, naming it in the error.
pub fn read_text(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
}

/// Writes `value` as pretty JSON, one trailing newline, to `path` (the
/// `--json FILE` of the reports), naming the file if it cannot.
pub fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> anyhow::Result<()> {
    let json = serde_json::to_string_pretty(value)?;
    std::fs::write(path, json + "\n").with_context(|| format!("cannot write {}", path.display()))
}

/// Writes one JSON value per line.
pub fn write_jsonl(path: &Path, rows: impl IntoIterator<Item = impl serde::Serialize>) -> anyhow::Result<()> {
    let file = std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    jsonl_to(file, rows).with_context(|| format!("cannot write {}", path.display()))
}

/// Writes `rows` to `out` as JSON lines, buffered.
pub fn jsonl_to(
    out: impl Write,
    rows: impl IntoIterator<Item = impl serde::Serialize>,
) -> anyhow::Result<()> {
    let mut out = BufWriter::new(out);
    for r in rows {
        serde_json::to_writer(&mut out, &r)?;
        out.write_all(b"\n")?;
    }
    Ok(out.flush()?)
}

/// This process's peak resident set size in MiB (Linux `VmHWM`).
pub fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_already_in_the_message_is_not_printed_again() {
        let parser =
            std::io::Error::other("TOML parse error at line 2, column 5\n  |\n2 | x = \n  |     ^\n");
        let err = anyhow::Error::from(std::io::Error::other(parser.to_string()))
            .context(format!("invalid configuration serve.toml: {parser}"));
        let text = chain_text(&err);
        assert_eq!(text.matches("TOML parse error").count(), 1, "{text}");
        assert!(!text.contains("caused by"), "{text}");
    }

    #[test]
    fn a_cause_the_message_does_not_say_is_printed() {
        let err = anyhow::Error::from(std::io::Error::other("No such file or directory"))
            .context("cannot read serve.toml");
        assert_eq!(
            chain_text(&err),
            "error: cannot read serve.toml\n  caused by: No such file or directory\n"
        );
    }
}
