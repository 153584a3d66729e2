//! `hangar-evict`: keeps a vLLM file-system KV-cache volume below a usage
//! threshold by deleting the least recently used blocks first.
//!
//! A drop-in replacement for llm-d's PVC evictor: it reads the same
//! environment variables ([`config`]), understands both FileMapper layouts
//! ([`layout`]), and adds oldest-first selection with bounded memory.
//!
//! How the parts fit:
//! - a [`UsageSource`] (production: [`Statvfs`], computed as `df` does)
//!   feeds the [`Activator`] (sans-IO), whose [`Hysteresis`] turns deletion
//!   ON at `CLEANUP_THRESHOLD` and OFF at `TARGET_THRESHOLD`, and which
//!   decides each next [`Step`];
//! - a sweep lists the tree once in parallel, streaming deletable files
//!   through a bounded channel into a [`Selection`] of the oldest files
//!   covering a byte budget: the *deletion queue*. With *pre-fill* it is
//!   filled while OFF (at start, periodically, after a deletion thinned
//!   it), so deletion starts at the first check after a crossing;
//! - the deleter unlinks queued files oldest first in batches relative to
//!   open directory handles, re-checking each file's last use just before,
//!   and re-measuring usage between batches;
//! - [`Stats`] feeds one status line per interval and `/metrics`; removed
//!   blocks can be published as `BlockRemoved` events.
//!
//! ```no_run
//! use hangar_evict::{Config, Evictor, Statvfs};
//! // The daemon: statvfs on PVC_MOUNT_PATH, signals, /metrics, events.
//! hangar_evict::run(Config::from_env()?)?;
//!
//! // Or drive the parts yourself.
//! let config = Config::from_env()?;
//! let mut evictor = Evictor::new(config.clone(), Statvfs::new(&config.pvc_mount_path));
//! let tick = evictor.tick()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]

mod activator;
pub mod bench;
pub mod config;
mod crawl;
mod daemon;
mod delete;
mod engine;
mod fsops;
mod hysteresis;
pub mod layout;
mod select;
mod services;
mod shutdown;
mod stats;
pub mod synth;
mod usage;

pub use activator::{Activator, ActivatorConfig, QueueInfo, Step, SweepEnd, BUDGET_MARGIN};
pub use config::{Config, ConfigError, LogLevel, Variable, VARIABLES};
pub use crawl::{DirHook, Shard};
pub use daemon::run;
pub use delete::Removed;
pub use engine::{EvictError, EvictReport, Evictor, Stop, Sweep, Tick};
pub use hysteresis::{Hysteresis, Mode};
pub use select::{Candidate, Selection};
pub use services::{event_message, render_metrics, Services, MEDIUM};
pub use shutdown::Shutdown;
pub use stats::{human_bytes, Snapshot, Stats};
pub use usage::{AtimeMode, Statvfs, Usage, UsageSource};
