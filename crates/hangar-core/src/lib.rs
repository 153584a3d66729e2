//! The shared vocabulary of Hangar.
//!
//! Every other crate depends inward on this one and on nothing else of the
//! workspace, so the types here are the words the crates use to talk to each
//! other: identifiers ([`ModelKey`], [`ReplicaId`], [`AccountId`],
//! [`RequestId`]), LoRA adapters' names ([`AdapterRef`]: `BASE:ADAPTER`,
//! and an [`Adapter`] with its size where known), units ([`ByteSize`],
//! [`Millis`]) and the KV-cache block identity engines and routers agree on ([`BlockHash`], [`KvEvent`]), what
//! a node agent registers ([`NodeRecord`]), the bounds every API applies
//! alike ([`limits`]), how a request ended ([`RequestKind`],
//! [`ErrorCode`]) and the steps its user is shown ([`Progress`]), what
//! each replica is doing — the instance monitor's states and windows
//! ([`instance`]) — and the formats every `/metrics` answers in
//! ([`exposition`]).
//!
//! Nothing here performs I/O or reads a clock; policy crates can use all of it.
//!
//! ```
//! use hangar_core::{ByteSize, ModelKey, ReplicaId};
//!
//! let key: ModelKey = "meta/llama-3-8b".parse().unwrap();
//! let replica = ReplicaId::from_u128(0x2a);
//! assert_eq!(format!("{key}:{replica}"), "meta/llama-3-8b:0000000000000000000000000000002a");
//! assert_eq!("80GB".parse::<ByteSize>().unwrap().bytes(), 80_000_000_000);
//! ```
#![deny(missing_docs)]

mod adapter;
pub mod agent;
pub mod auth;
pub mod exposition;
mod field;
mod ids;
pub mod instance;
mod kv;
pub mod limits;
mod outcome;
mod progress;
mod units;

pub use adapter::{parse_model_field, Adapter, AdapterRef, AdapterRefError};
pub use agent::{
    DesiredReplica, DesiredState, GatewayLoad, ModelLoad, NodeAdapters, NodeRecord, NodeReport, PhaseAt,
    RegisteredAdapter, ReplicaPhase, ReplicaReport, StartPhase, StartReport, StartStatus, WeightsReport,
};
pub use auth::{ApiKeys, AuthError, Principal};
pub use field::FieldError;
pub use ids::{AccountId, AdapterName, IdError, ModelKey, ReplicaId, RequestId};
pub use kv::{mix64, BlockHash, KvEvent, ROOT_BLOCK_HASH};
pub use limits::MAX_OUTPUT_TOKENS;
pub use outcome::{ErrorCode, RequestKind};
pub use progress::{Progress, StepAt};
pub use units::{ByteSize, ByteSizeError, Millis};
