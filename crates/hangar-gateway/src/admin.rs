//! The admin API: what runs where, and the operator's levers.
//!
//! - `GET /admin/status`: every model's line and permits and every replica
//!   (name `<model>:<replica_id>`, level, state, node, GPUs, in flight, what
//!   its instance monitor says, its last start report), each model's
//!   recent minutes and starts, and the nodes with their GPUs — everything
//!   the status page (`/ui`) renders. A browser may read it with the
//!   cookie `/ui?key=` set instead of an `Authorization` header.
//! - `POST /admin/models/{key}/scaling` `{"action": "pin", "replicas": N}`,
//!   `{"action": "freeze"}` or `{"action": "unfreeze"}`: the kill switches
//!   of the model's scaler (docs/scaling.md).
//! - `POST /admin/evict` `{"model": KEY}` or `{"replica": "KEY:ID"}`: to the
//!   warm cache if it has room, else stopped; the model's count is lowered
//!   so they do not come straight back, and demand brings them back.
//!
//! Commands go to the controller's task, which carries each out whole even
//! if the caller leaves.
//! - `PUT /admin/models/{key}/queue` `{"algorithm": "fair", "capacity": N}`:
//!   switch the line without losing anyone waiting.
//! - `PUT /admin/models/{key}/hotswap` `{"swappable": false}` (or `true`):
//!   close a model of the hotswap tier to swapping in — held at 0
//!   replicas, synchronous requests answered 503 — or open it again.
//! - `POST /admin/nodes/{node}/drain` (`DELETE` calls it off): nothing new
//!   is placed on the node and its replicas move to other nodes, each
//!   stopping there once its replacement serves; 202, the moves follow.
//!
//! With API keys configured, only keys marked `admin = true` may call it
//! (403 for others, 401 without a valid key). The commands take the key
//! from the `Authorization` header only, never from the status page's
//! cookie, so no other site can make a browser send them.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use hangar_core::ReplicaId;
use hangar_core::{AuthError, Principal};
use hangar_placement::Deployment;
use hangar_queue::{AdmissionConfig, QueueAlgorithm};
use hangar_runtime::serve::{
    check_queue_capacity, wall_ms, ControlError, ModelRuntime, ScalingCommand, Server,
};
use hangar_scaler::CommandError;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::openai::{principal, ApiError};

pub(crate) fn router(server: Server) -> Router {
    Router::new()
        .route("/admin/status", get(status))
        .route("/admin/evict", post(evict))
        .route("/admin/models/{*path}", post(model_action).put(model_action))
        .route("/admin/nodes/{node}/drain", post(drain).delete(drain))
        .with_state(server)
}

/// Lets admin callers through, by their `Authorization` header.
fn admin(server: &Server, headers: &HeaderMap) -> Result<(), ApiError> {
    allow(principal(server, headers))
}

/// Lets `principal` through if it may use the admin API: 401 without a
/// valid key, 403 for a key that is not an admin's.
pub(crate) fn allow(principal: Result<Principal, AuthError>) -> Result<(), ApiError> {
    match principal {
        Ok(p) if p.admin => Ok(()),
        Ok(p) => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "permission_error",
            format!("the key of account `{}` may not use the admin API", p.account),
        )),
        Err(e) => Err(ApiError::new(StatusCode::UNAUTHORIZED, "authentication_error", e.to_string())),
    }
}

/// Parses a JSON body; errors name the field at fault.
fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let field = e.path().to_string();
        ApiError::bad_request(match field.as_str() {
            "." => format!("invalid body: {}", e.inner()),
            _ => format!("invalid field `{field}`: {}", e.inner()),
        })
    })
}

fn model<'a>(server: &'a Server, key: &str) -> Result<&'a Arc<ModelRuntime>, ApiError> {
    server
        .model(key)
        .ok_or_else(|| ApiError::not_found(format!("The model `{key}` does not exist.")).param("model"))
}

async fn status(State(server): State<Server>, headers: HeaderMap) -> Result<Response, ApiError> {
    allow(crate::ui::principal(&server, &headers))?;
    let mut control: BTreeMap<String, (Value, Vec<Deployment>)> =
        server.control().status().await.into_iter().map(|(k, v, d)| (k, (v, d))).collect();
    let mut models = Vec::new();
    for rt in server.models() {
        let c = rt.config();
        let (scaling, deployments) = control.remove(c.key.as_str()).unwrap_or_default();
        let load = rt.processor().load();
        models.push(json!({
            "model": c.key,
            "trains": c.trains,
            "min_replicas": c.min_replicas,
            "max_replicas": c.max_replicas(),
            "concurrency": c.permits(),
            "timeout_s": rt.timeout().as_secs(),
            "scaling": scaling,
            "hotswap": rt.swappable().map(|swappable| json!({"swappable": swappable})),
            "queue": {"algorithm": load.config.algorithm, "capacity": load.config.capacity, "waiting": load.waiting},
            "permits": {"total": load.permits, "used": load.in_use},
            "replicas": rt.status(&deployments),
            "ready": rt.ready_replicas(),
            "placement": placement(&deployments),
            "ttft_p99_ms": rt.metrics().recent_ttft_p99(),
            "history": rt.metrics().history(),
            "starts": rt.recent_starts(),
        }));
    }
    let mut status = json!({"at_ms": wall_ms(), "nodes": server.nodes(), "models": models});
    if let Some(gateway) = server.fleet_gateway() {
        status["fleet"] = json!({"gateway": gateway, "leading": server.control().is_active()});
    }
    Ok(Json(status).into_response())
}

/// The model's replicas as placement holds them — every one, including
/// those no node reports yet (which `replicas` cannot list): what a
/// checker compares with what the nodes run. Empty on a fleet gateway that
/// does not lead.
fn placement(deployments: &[Deployment]) -> Vec<Value> {
    deployments
        .iter()
        .map(|d| {
            json!({
                "replica": d.replica_id.to_string(),
                "node": d.node.to_string(),
                "level": d.level.to_string(),
                "gpus": d.gpu_bytes_by_gpu,
                "dedicated": d.dedicated,
            })
        })
        .collect()
}

/// A command the controller did not carry out: 409 on a fleet's gateway
/// that does not lead, 503 otherwise.
fn control_error(e: ControlError) -> ApiError {
    match e {
        ControlError::NotLeader => ApiError::new(StatusCode::CONFLICT, "not_the_leader", e.to_string()),
        ControlError::UnknownNode(_) => ApiError::not_found(e.to_string()).param("node"),
        e => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", e.to_string()),
    }
}

/// `POST /admin/nodes/{node}/drain` drains the node, `DELETE` calls the
/// drain off: 202 once the controller (or, on a fleet, Redis) has it.
async fn drain(
    State(server): State<Server>,
    method: Method,
    headers: HeaderMap,
    Path(node): Path<String>,
) -> Result<Response, ApiError> {
    admin(&server, &headers)?;
    let on = method == Method::POST;
    server.drain_node(&node, on).await.map_err(control_error)?;
    Ok((StatusCode::ACCEPTED, Json(json!({"node": node, "draining": on}))).into_response())
}

/// `POST /admin/models/{key}/scaling`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ScalingBody {
    action: ScalingAction,
    replicas: Option<u32>,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum ScalingAction {
    Freeze,
    Unfreeze,
    Pin,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct QueueBody {
    algorithm: Option<QueueAlgorithm>,
    capacity: Option<usize>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HotswapBody {
    swappable: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EvictBody {
    model: Option<String>,
    replica: Option<String>,
}

/// `POST /admin/models/{key}/scaling` and `PUT /admin/models/{key}/queue`
/// (a model key may hold `/`, so the path is split here).
async fn model_action(
    State(server): State<Server>,
    method: Method,
    Path(path): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    admin(&server, &headers)?;
    match (path.rsplit_once('/'), method) {
        (Some((key, "scaling")), Method::POST) => scaling(&server, model(&server, key)?, &body).await,
        (Some((key, "queue")), Method::PUT) => Ok(set_queue(model(&server, key)?, &body)?),
        (Some((key, "hotswap")), Method::PUT) => set_hotswap(&server, model(&server, key)?, &body).await,
        _ => Err(ApiError::not_found(format!(
            "no admin action at `/admin/models/{path}`: use POST /admin/models/{{key}}/scaling, \
             PUT /admin/models/{{key}}/queue or PUT /admin/models/{{key}}/hotswap"
        ))),
    }
}

/// A scaling command, answered once the controller has applied it (the
/// engines follow in the background).
async fn scaling(server: &Server, rt: &Arc<ModelRuntime>, body: &Bytes) -> Result<Response, ApiError> {
    let command = match parse::<ScalingBody>(body)? {
        ScalingBody { action: ScalingAction::Pin, replicas: Some(n) } => ScalingCommand::Pin(n),
        ScalingBody { action: ScalingAction::Pin, replicas: None } => {
            return Err(ApiError::bad_request("`pin` needs `replicas`").param("replicas"))
        }
        ScalingBody { replicas: Some(_), .. } => {
            return Err(ApiError::bad_request("only `pin` takes `replicas`").param("replicas"))
        }
        ScalingBody { action: ScalingAction::Freeze, .. } => ScalingCommand::Freeze,
        ScalingBody { action: ScalingAction::Unfreeze, .. } => ScalingCommand::Unfreeze,
    };
    let key = &rt.config().key;
    server.scale(rt, command).await.map_err(|e| match e {
        ControlError::Command(e @ CommandError::OutOfBounds { .. }) => {
            ApiError::bad_request(e.to_string()).param("replicas")
        }
        e => control_error(e),
    })?;
    Ok(Json(json!({"model": key, "desired_replicas": rt.desired_replicas()})).into_response())
}

/// Opens or closes a hotswap model to swapping in, answered once the
/// controller has the model's scaler pinned at 0 or deciding again.
async fn set_hotswap(server: &Server, rt: &Arc<ModelRuntime>, body: &Bytes) -> Result<Response, ApiError> {
    let HotswapBody { swappable } = parse(body)?;
    let key = &rt.config().key;
    if !rt.config().hotswap {
        return Err(ApiError::bad_request(format!(
            "the model `{key}` is not in the hotswap tier (`hotswap = true` in its configuration): it holds \
             replicas of its own, which its scaling commands govern"
        )));
    }
    server.set_swappable(rt, swappable).await.map_err(control_error)?;
    Ok(Json(json!({"model": key, "swappable": swappable, "desired_replicas": rt.desired_replicas()}))
        .into_response())
}

fn set_queue(rt: &ModelRuntime, body: &Bytes) -> Result<Response, ApiError> {
    let QueueBody { algorithm, capacity } = parse(body)?;
    let current = rt.processor().load().config;
    let config = AdmissionConfig {
        algorithm: algorithm.unwrap_or(current.algorithm),
        capacity: capacity.unwrap_or(current.capacity),
    };
    check_queue_capacity(config.capacity)
        .map_err(|m| ApiError::bad_request(format!("invalid field `capacity`: {m}")).param("capacity"))?;
    rt.processor().reconfigure(config.clone());
    let key = &rt.config().key;
    tracing::info!(model = %key, ?config, "queue reconfigured");
    let answer = json!({"model": key, "algorithm": config.algorithm, "capacity": config.capacity});
    Ok(Json(answer).into_response())
}

async fn evict(State(server): State<Server>, headers: HeaderMap, body: Bytes) -> Result<Response, ApiError> {
    admin(&server, &headers)?;
    let (key, replica) = match parse::<EvictBody>(&body)? {
        EvictBody { model: Some(m), replica: None } => (m, None),
        EvictBody { model: None, replica: Some(name) } => {
            let bad = |why: String| ApiError::bad_request(format!("invalid field `replica`: {why}"));
            let (m, id) =
                name.rsplit_once(':').ok_or_else(|| bad("expected `<model>:<replica_id>`".into()))?;
            let id: ReplicaId = id.parse().map_err(|e| bad(format!("`{id}`: {e}")))?;
            (m.to_owned(), Some(id))
        }
        _ => return Err(ApiError::bad_request("give exactly one of `model` and `replica`")),
    };
    let rt = model(&server, &key)?;
    let evicted = server.control().evict(&rt.config().key, replica).await.map_err(|e| match e {
        ControlError::Command(e @ CommandError::UnknownReplica { .. }) => {
            ApiError::not_found(e.to_string()).param("replica")
        }
        e => control_error(e),
    })?;
    Ok(Json(json!({"evicted": evicted})).into_response())
}
