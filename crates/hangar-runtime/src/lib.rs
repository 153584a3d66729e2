//! The live control plane of `hangar serve`.
//!
//! This crate drives the policy crates with real time, real processes and
//! real sockets. So far it holds the node agent's engine launcher
//! ([`engine`]): how an engine process is started on a free loopback port,
//! health-checked until ready, and stopped; and the model processor
//! ([`processor`]) that admits requests onto replica permits; and
//! [`bench`], which measures what the gateway adds in front of an engine.
#![deny(missing_docs)]

pub mod bench;
pub mod capabilities;
pub mod cog;
pub mod engine;
pub mod processor;
pub mod serve;
pub mod weights;
