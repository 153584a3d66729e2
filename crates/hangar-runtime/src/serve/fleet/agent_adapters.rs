//! A fleet node's agent's side of LoRA adapters (docs/adapters.md, "On a
//! fleet"): the gateways' holds and releases, over HTTP, of adapters on
//! the node's engines, which the node's [`AdapterHolds`] carries out.
//!
//! - `POST /v1/replicas/{replica}/adapters/hold` `{"adapter": "BASE:NAME",
//!   "artifact": "hg1:…", "gateway": "gw-…", "slots": N}`: the gateway's
//!   adapter slots (of generation `N`: new each time the replica comes
//!   back into the gateway's routing) load the adapter on that replica; answered 200 once the engine has
//!   it, 502 naming why its load failed, 409 when the engine has the name
//!   as another artifact, 404 when the replica does not serve here.
//! - `POST /v1/replicas/{replica}/adapters/release` `{"adapter",
//!   "gateway", "slots"}`: the slots unloaded it; 200 at once, the engine unloads
//!   it once no gateway holds it.
//!
//! Each refusal is `{"error": {"message"}}` naming what and why.

use std::sync::Arc;

use axum::response::{IntoResponse, Response};
use hangar_core::{AdapterRef, ReplicaId};
use hangar_store::ArtifactId;

use super::super::adapters::engines::AdapterHolds;

/// A hold's or release's body.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Asked {
    adapter: String,
    #[serde(default)]
    artifact: Option<String>,
    gateway: String,
    slots: u64,
}

fn refuse(status: u16, message: String) -> Response {
    let status = axum::http::StatusCode::from_u16(status).expect("a status");
    (status, axum::Json(serde_json::json!({"error": {"message": message}}))).into_response()
}

/// `POST /v1/replicas/{replica}/adapters/{op}` on the agent of `node`:
/// a hold or a release on `holds`, the node's engines' adapters (`None`:
/// it runs no model with adapters, 404).
///
/// # Cancel safety
/// As [`AdapterHolds::hold`]: a gateway that goes away leaves its hold.
pub(super) async fn answer(
    holds: Option<&Arc<AdapterHolds>>,
    node: &str,
    replica: &str,
    op: &str,
    body: &[u8],
) -> Response {
    let Some(holds) = holds else { return refuse(404, format!("node {node} runs no model with adapters")) };
    let hold = match op {
        "hold" => true,
        "release" => false,
        other => return refuse(404, format!("no adapter operation `{other}` (hold or release)")),
    };
    let Ok(replica) = replica.parse::<ReplicaId>() else {
        return refuse(400, format!("`{replica}` is not a replica id"));
    };
    let Parsed { adapter, artifact, gateway, slots } = match parse(body, hold) {
        Ok(asked) => asked,
        Err(why) => return refuse(400, why),
    };
    match artifact {
        Some(artifact) => match holds.hold(replica, &gateway, slots, &adapter, artifact).await {
            Ok(()) => axum::Json(serde_json::json!({"loaded": true})).into_response(),
            Err(e) => refuse(e.status(), e.to_string()),
        },
        None => {
            holds.release(replica, &gateway, slots, adapter.name());
            axum::Json(serde_json::json!({"released": true})).into_response()
        }
    }
}

/// A hold or release, read.
struct Parsed {
    adapter: AdapterRef,
    /// A hold's.
    artifact: Option<ArtifactId>,
    gateway: String,
    slots: u64,
}

/// The body read, or what is wrong with it.
fn parse(body: &[u8], hold: bool) -> Result<Parsed, String> {
    let asked: Asked = serde_json::from_slice(body)
        .map_err(|e| format!("the body is not {{\"adapter\", \"artifact\", \"gateway\", \"slots\"}}: {e}"))?;
    let adapter = asked.adapter.parse::<AdapterRef>().map_err(|e| format!("adapter: {e}"))?;
    let artifact = match (asked.artifact, hold) {
        (Some(a), true) => Some(a.parse::<ArtifactId>().map_err(|e| format!("artifact `{a}`: {e}"))?),
        (None, true) => return Err("artifact: missing".into()),
        (_, false) => None,
    };
    if asked.gateway.is_empty() {
        return Err("gateway: empty".into());
    }
    Ok(Parsed { adapter, artifact, gateway: asked.gateway, slots: asked.slots })
}
