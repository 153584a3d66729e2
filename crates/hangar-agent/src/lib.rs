//! The node agent: what runs on the machine that has the GPUs. It starts an
//! engine process for a replica ([`engine`]: `mock`, `openai` command
//! templates, `external`, `cog`), waits until it answers, asks what it can do
//! ([`capabilities`]: its sleep API, metrics, slots, LoRA), talks cog's
//! protocol ([`cog`]), and gives it its weights through the node's store
//! daemon ([`weights`]); [`devices`] counts the machine's GPUs. `hangar serve` drives it for the nodes of its file
//! today; a `hangar agent` per machine will drive the same code from the
//! desired state a control plane publishes.

#![deny(missing_docs)]

pub mod capabilities;
pub mod cog;
pub mod devices;
pub mod engine;
pub mod engine_adapters;
pub mod lifecycle;
pub mod log_tail;
pub mod procedures;
pub mod weights;

/// An HTTP client builder for Hangar's own traffic — to engines, agents,
/// gateways' run ports and store peers — which never goes through the
/// proxy the environment names (`HTTP_PROXY`, `ALL_PROXY`): that proxy is
/// for the outside world, and an engine on `127.0.0.1` or a pod's IP
/// behind it is unreachable (a `hangar serve` run with one set never saw
/// its engines ready).
pub fn direct_http() -> reqwest::ClientBuilder {
    reqwest::Client::builder().no_proxy()
}

/// The fleet's clock: milliseconds since the Unix epoch — when a start
/// report's start began and ended here, and (through `hangar-runtime`,
/// which re-exports it) the scores of the registry's and the load index.
/// Whatever writes or compares those takes the time from here, so that all
/// read one clock.
pub fn wall_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}
