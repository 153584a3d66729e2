//! Hangar's simulator: replays request traces through the platform's own
//! policies on a logical clock.
//!
//! A replay reads a [`trace`], admits its requests in trace mode
//! (timestamps, with a speed-up) or concurrency mode (N in flight), routes
//! each with `hangar-router`, steps one `hangar-engine` [`EngineCore`]
//! per worker, and measures TTFT, inter-token latency, end-to-end latency,
//! throughput and prefix-cache reuse into a [`Report`]. It drives exactly
//! the code the live server runs; only the clock differs. Same trace, same
//! configuration, same seed: the same report, byte for byte.
//!
//! [`EngineCore`]: hangar_engine::EngineCore
//!
//! ```
//! use hangar_sim::{simulate, trace, SimConfig};
//!
//! let text = r#"{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}
//! {"timestamp": 10, "input_length": 600, "output_length": 4, "hash_ids": [1, 3]}"#;
//! let trace = trace::read(text, "inline.jsonl").unwrap();
//! let out = simulate(&trace, &SimConfig::default(), |_| Err("no tables".into())).unwrap();
//! assert_eq!(out.report.completed, 2);
//! assert!(out.report.prefix_cache_reuse_ratio > 0.0);
//! ```
#![deny(missing_docs)]

pub mod bound;
mod clock;
mod collector;
pub mod compare;
mod driver;
pub mod fleet;
mod report;
pub mod stats;
pub mod suite;
pub mod synth;
pub mod trace;

pub use driver::{simulate, ArrivalMode, SimConfig, SimError, SimOutput, Slo};
pub use report::{Goodput, Report, RequestRecord, WorkerReport};
