//! The benchmark on one machine: a weight store, a mock engine and
//! `hangar serve` in front of it.

use std::time::{Duration, Instant};

use super::{
    exported_ahead, fresh_figure, loaded_figure, model_extra, register, until_ok, Fresh, Options, Report,
};
use crate::processes::{address, launch_instant_engine, start_serve, MODEL};
use crate::BenchError;

/// Runs both figures on one machine, `names[0]` the loaded adapter and
/// the rest the fresh ones.
///
/// # Cancel safety
/// Dropping the future kills both child processes.
pub(super) async fn run(options: &Options, names: &[String]) -> Result<Report, BenchError> {
    let store_dir = tempfile::tempdir()?;
    let all: Vec<(u64, &str)> = names.iter().enumerate().map(|(i, n)| (i as u64, n.as_str())).collect();
    let (store, adapter_bytes) = register(store_dir.path(), &all, options.rank).await?;
    let engine = launch_instant_engine(&options.hangar_exe).await?;
    let extra = format!("{}\n[store]\nroot = \"{}\"\n", model_extra(), store_dir.path().display());
    let server = start_serve(&options.hangar_exe, &engine.base_url, 8, &extra, "hangar serve").await?;
    let started = Instant::now();
    let gateway = address(&server.process.base_url)?;
    until_ok(&super::chat(gateway, MODEL), "the base model").await?;
    let (mut client, base, loaded) = loaded_figure(gateway, &names[0], options.requests).await?;

    // The steady state: the server has exported every adapter ahead of
    // need (a first request right after registering pays its export).
    let exported_ahead_s = exported_ahead(store_dir.path(), names.len(), started).await?;
    let fresh: Vec<Fresh> =
        names[1..].iter().map(|name| Fresh { name, store: &store, source: None }).collect();
    let fresh = fresh_figure(&mut client, gateway, &engine.base_url, &fresh, base.p50_ms).await?;
    server.process.stop(Duration::from_secs(5)).await;
    engine.stop(Duration::from_secs(5)).await;
    Ok(Report::new(false, adapter_bytes, exported_ahead_s, (base, loaded), fresh))
}
