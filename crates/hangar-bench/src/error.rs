//! [`BenchError`]: why a bench could not run.

use std::net::SocketAddr;

use hangar_agent::engine::LaunchError;

/// Why a bench could not run. Requests that fail are not errors:
/// they are counted in the report.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// An option is out of range.
    #[error("invalid option: {0}")]
    Options(String),
    /// The mock engine or the gateway did not start.
    #[error("cannot start the {what}: {source}")]
    Launch {
        /// `mock engine` or `gateway`.
        what: &'static str,
        /// Why.
        source: LaunchError,
    },
    /// A client could not connect.
    #[error("cannot connect to {addr}: {reason}")]
    Connect {
        /// The address.
        addr: SocketAddr,
        /// Why.
        reason: String,
    },
    /// Writing the gateway's configuration failed.
    #[error("cannot write the gateway configuration: {0}")]
    Io(#[from] std::io::Error),
    /// A step the figures depend on failed (a fixture, a measurement the
    /// bench makes itself, a request that must succeed).
    #[error("the bench could not run: {0}")]
    Failed(String),
}
