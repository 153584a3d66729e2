//! Autoscaling for Hangar: how many replicas each model should have.
#![deny(missing_docs)]

mod config;

pub use config::{HangarSettings, ReplicateSettings, ScalingConfig, WorkersAiSettings};
