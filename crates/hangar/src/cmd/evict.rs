//! `hangar evict`: the KV-cache disk evictor, and `hangar evict bench`.
//!
//! Every setting is an environment variable of llm-d's PVC evictor (same
//! names and defaults) and also a flag: `CLEANUP_THRESHOLD` is
//! `--cleanup-threshold`. A flag wins over the environment.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Arg, ArgMatches, Subcommand};
use hangar_evict::{Config, VARIABLES};

/// Keep a KV-cache volume below a usage threshold by deleting the least
/// recently used blocks first.
#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    command: Option<Sub>,
    #[command(flatten)]
    settings: Settings,
}

#[derive(Debug, Subcommand)]
enum Sub {
    /// Measure the evictor on loop-mounted ext4 images (needs root,
    /// mkfs.ext4 and loop devices), with and without pre-fill on copies of
    /// one volume: time from crossing the threshold to the first deletion
    /// and to the target, CPU, memory; prints figures against the targets.
    Bench(BenchArgs),
}

#[derive(Debug, clap::Args)]
struct BenchArgs {
    /// Tree sizes to measure, in files of 8 KiB (each at least 1,000).
    #[arg(long, value_delimiter = ',', default_value = "100000,500000")]
    files: Vec<usize>,
    /// Seconds over which idle CPU is measured at 80 % usage.
    #[arg(long, default_value_t = 60)]
    idle_seconds: u64,
    /// Directory for the images and mount points (on a disk with room).
    #[arg(long, default_value = "/var/tmp")]
    work_dir: PathBuf,
}

/// Values given as flags, keyed by environment variable name.
#[derive(Debug, Default)]
struct Settings(BTreeMap<&'static str, String>);

impl clap::FromArgMatches for Settings {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let mut s = Settings::default();
        s.update_from_arg_matches(m)?;
        Ok(s)
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        for v in VARIABLES {
            if let Some(value) = m.get_one::<String>(v.name) {
                self.0.insert(v.name, value.clone());
            }
        }
        Ok(())
    }
}

impl clap::Args for Settings {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        VARIABLES.iter().fold(cmd, |cmd, v| {
            let default = if v.default.is_empty() { "unset" } else { v.default };
            cmd.arg(
                Arg::new(v.name)
                    .long(v.flag())
                    .value_name("VALUE")
                    .help(format!("{} [env: {}] [default: {default}]", v.help, v.name)),
            )
        })
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

impl Settings {
    /// Flag if given, else environment, else default; validated.
    fn config(&self) -> anyhow::Result<Config> {
        Ok(Config::from_lookup(|name| self.0.get(name).cloned().or_else(|| std::env::var(name).ok()))?)
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        Some(Sub::Bench(b)) => {
            init_logging("info", None)?;
            let exe = std::env::current_exe().context("locating the hangar binary")?;
            let options = hangar_evict::bench::Options {
                exe,
                files: b.files,
                idle: std::time::Duration::from_secs(b.idle_seconds),
                work_dir: b.work_dir,
            };
            let report = hangar_evict::bench::run(&options)?;
            print!("{report}");
            Ok(())
        }
        None => {
            let config = args.settings.config()?;
            init_logging(config.log_level.directive(), config.log_file_path.as_deref())?;
            hangar_evict::run(config)?;
            Ok(())
        }
    }
}

/// Logs to stderr and, with `LOG_FILE_PATH`, appended to that file too; the
/// level is `RUST_LOG` when set, else `LOG_LEVEL`.
fn init_logging(level: &str, file: Option<&std::path::Path>) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    use tracing_subscriber::prelude::*;
    use tracing_subscriber::{fmt, EnvFilter};
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    let file_layer = match file {
        Some(path) => {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("opening LOG_FILE_PATH {}", path.display()))?;
            Some(fmt::layer().with_ansi(false).with_writer(std::sync::Mutex::new(f)))
        }
        None => None,
    };
    tracing_subscriber::registry()
        .with(filter)
        .with(fmt::layer().with_ansi(std::io::stderr().is_terminal()).with_writer(std::io::stderr))
        .with(file_layer)
        .try_init()?;
    Ok(())
}
