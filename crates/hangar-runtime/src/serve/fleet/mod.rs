//! A fleet: any number of gateways (`hangar serve` with `redis` and no
//! `[[nodes]]`) and one `hangar agent` per machine, sharing one Redis
//! (docs/cluster.md).
//!
//! - `agent`: a node's side. It registers the machine, hands the node's
//!   desired state to the lifecycle driver a single machine uses (`node`),
//!   and reports its replicas.
//! - `view`: every gateway's side. It routes to the replicas the live
//!   nodes report ready, publishes its load, and — on the leader — turns
//!   what changed into facts for the controller.
//! - `leader`: the gateway holding the lease runs the controller over
//!   every live node and writes each node's desired state.

mod agent;
mod agent_adapters;
pub(crate) mod leader;
mod view;

use hangar_core::NodeRecord;
use hangar_placement::NodeConfig;

pub use agent::Agent;
pub(crate) use leader::Leadership;
pub(crate) use view::View;

/// How long a gateway keeps a replica it saw fail out of routing, though
/// its node still reports it (longer than a report outlives its agent).
pub(crate) const QUARANTINE: std::time::Duration = std::time::Duration::from_secs(10);

/// The fleet's clock: milliseconds since the Unix epoch, the score of the
/// registry's node index (a node's last heartbeat) and of the gateways'
/// load index, and a start report's times. Whatever writes those indexes
/// or compares a time with their scores — an agent's heartbeat, a
/// gateway's load, `hangar bench cluster`'s simulated agents and its
/// reading of a dead node's last heartbeat — takes the time from here, so
/// that all read one clock (`hangar-agent`'s, which stamps start reports).
pub use hangar_agent::wall_ms;

/// The node as placement knows it, from what its agent registered.
fn node_config(r: &NodeRecord) -> Result<NodeConfig, String> {
    Ok(NodeConfig {
        id: r.name.parse().map_err(|e| format!("node name `{}`: {e}", r.name))?,
        gpus: r.gpus,
        gpu_memory: Some(r.gpu_memory),
        gpu_kind: r.gpu_kind.clone(),
        virtual_gpus: r.virtual_gpus,
        cpu_cache: r.cpu_memory,
    })
}
