//! The live control plane of `hangar serve`.
//!
//! This crate drives the policy crates with real time, real processes and
//! real sockets: the model processor ([`processor`]) that admits requests
//! onto replica permits; [`serve`], the controller's task, replicas
//! reconciled with placement through the node agent (`hangar-agent`, which
//! starts, probes, sleeps and stops engines and gives them their weights),
//! and the state the gateway and admin APIs (`hangar-gateway`) serve from.
//! The benchmarks that measure it from the outside are `hangar-bench`'s.
#![deny(missing_docs)]

pub mod events;
pub mod processor;
pub mod serve;
