//! The production entry point: `statvfs` on the mount, signals, side
//! services and the evictor loop.

use crate::config::Config;
use crate::engine::{EvictError, Evictor};
use crate::services::Services;
use crate::shutdown::Shutdown;
use crate::usage::{AtimeMode, Statvfs, UsageSource};

/// Runs the evictor described by `config` until SIGTERM or SIGINT, then
/// finishes the current batch and returns (well within a second).
pub fn run(config: Config) -> Result<(), EvictError> {
    let disk = Statvfs::new(&config.pvc_mount_path);
    let usage =
        disk.usage().map_err(|source| EvictError::Mount { path: config.pvc_mount_path.clone(), source })?;
    // Refuse a symlinked root, or one on another filesystem, before doing
    // anything; a root that does not exist yet is waited for (every sweep
    // opens it again, with the same checks).
    crate::engine::open_root(&config)?;
    match disk.atime_mode() {
        Ok(AtimeMode::Relative) => tracing::warn!(
            mount = %config.pvc_mount_path.display(),
            "mounted relatime: a block's last use is its first read after being written, \
             refreshed at most daily; mount with strictatime or lazytime for exact LRU"
        ),
        Ok(AtimeMode::Never) => tracing::warn!(
            mount = %config.pvc_mount_path.display(),
            "mounted noatime: reads are invisible, blocks are evicted by write time"
        ),
        _ => {}
    }
    let root = config.cache_root();
    tracing::info!(
        root = %root.display(),
        usage_percent = format_args!("{:.2}", usage.percent()),
        cleanup = config.cleanup_threshold,
        target = config.target_threshold,
        crawlers = config.crawler_threads,
        dry_run = config.dry_run,
        "evictor started"
    );
    let shutdown = Shutdown::new();
    shutdown.on_signals().map_err(|source| EvictError::Start { what: "signal handler", source })?;
    let mut evictor = Evictor::new(config.clone(), disk).with_shutdown(shutdown);
    let services = Services::start(&config, evictor.stats())?;
    if let Some(sink) = services.removed_sink() {
        evictor = evictor.with_removed_sink(sink);
    }
    let result = evictor.run();
    services.stop();
    tracing::info!("evictor stopped");
    result
}
