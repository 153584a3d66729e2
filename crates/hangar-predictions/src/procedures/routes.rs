//! The procedures routes under `/v1/procedures`, and the procedure side of
//! creating a prediction (`POST /v1/procedures/{owner}/{name}/predictions`
//! and `POST /v1/models/{owner}/{name}/predictions` of a procedure).
//!
//! A procedure is its owner's alone: another account's is answered as one
//! that does not exist (the same 404). With procedures off (no
//! `[predictions.procedures] runtime`) every route answers 404.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::Json;
use hangar_core::AccountId;
use serde_json::{json, Value};

use super::{Procedure, RegistryError, SourceError};
use crate::api::{account, create as create_prediction, parse_body, ApiResult, Problem, Target};
use crate::config::ModelSettings;
use crate::record::{rfc3339, JobKind};
use crate::service::{now, Inner, ProcedureState};

/// The longest procedure name.
const MAX_NAME: usize = 100;

fn state(inner: &Inner) -> Result<&Arc<ProcedureState>, Problem> {
    inner.procedures.as_ref().ok_or_else(|| {
        Problem::not_found("procedures are not enabled on this server ([predictions.procedures] runtime)")
    })
}

fn not_found(key: &str) -> Problem {
    Problem::not_found(format!("procedure `{key}` does not exist"))
}

/// The procedure `key` if `account` owns it.
fn find(state: &ProcedureState, account: &AccountId, key: &str) -> Result<Option<Procedure>, Problem> {
    Ok(state.registry.get(key).map_err(registry_problem)?.filter(|p| p.owner == account.as_str()))
}

/// `owner/name`'s procedure if `account` owns it.
fn owned(state: &ProcedureState, account: &AccountId, owner: &str, name: &str) -> Result<Procedure, Problem> {
    let key = format!("{owner}/{name}");
    find(state, account, &key)?.ok_or_else(|| not_found(&key))
}

/// The prediction target of `owner/name` if it is a procedure of
/// `account`'s; `Ok(None)` if it is none (or procedures are off).
pub(crate) fn target(
    inner: &Inner,
    account: &AccountId,
    owner: &str,
    name: &str,
) -> Result<Option<Target>, Problem> {
    let Some(state) = inner.procedures.as_ref() else { return Ok(None) };
    let found = find(state, account, &format!("{owner}/{name}"))?;
    Ok(found.map(|p| Target { model: p.key(), deployment: None, kind: JobKind::Procedure }))
}

/// What a prediction of procedure `key` is created with: its key, its
/// version, the runtime model's settings, and no language-model input
/// rules. An ephemeral procedure whose source expired is 410.
pub(crate) fn to_run(
    inner: &Inner,
    account: &AccountId,
    key: &str,
) -> Result<(String, String, ModelSettings, bool), Problem> {
    let state = state(inner)?;
    let p = state.registry.runnable(key, now()).map_err(registry_problem)?;
    if p.owner != account.as_str() {
        return Err(not_found(key));
    }
    let settings = inner.models.get(&state.runtime).map(|m| m.settings).unwrap_or_default();
    Ok((p.key(), p.version().to_owned(), settings, false))
}

/// The API object of a procedure.
fn procedure_json(inner: &Inner, state: &ProcedureState, p: &Procedure) -> Value {
    let base = format!("{}/v1/procedures/{}", inner.base_url, p.key());
    let ttl = state.registry.ttl_ms();
    json!({
        "owner": p.owner,
        "name": p.name,
        "source_url": p.source_url,
        "ephemeral": p.ephemeral,
        "version": p.version(),
        "created_at": rfc3339(p.created_at),
        "expires_at": p.expires_at(ttl).map(rfc3339),
        "expired": p.expired(now(), ttl),
        "urls": {"get": base, "predictions": format!("{base}/predictions")},
    })
}

/// `GET /v1/procedures`: the account's procedures.
pub(crate) async fn list(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> ApiResult {
    let account = account(&inner, &headers)?;
    let state = state(&inner)?;
    let results: Vec<Value> = state
        .registry
        .of(account.as_str())
        .map_err(registry_problem)?
        .iter()
        .map(|p| procedure_json(&inner, state, p))
        .collect();
    Ok(Json(json!({"next": null, "previous": null, "results": results})).into_response())
}

/// `GET /v1/procedures/{owner}/{name}`.
pub(crate) async fn get(
    State(inner): State<Arc<Inner>>,
    Path((owner, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> ApiResult {
    let account = account(&inner, &headers)?;
    let state = state(&inner)?;
    let p = owned(state, &account, &owner, &name)?;
    Ok(Json(procedure_json(&inner, state, &p)).into_response())
}

/// `DELETE /v1/procedures/{owner}/{name}`: 204; its cached archive is
/// dropped here unless another procedure has the same (the other gateways
/// of a fleet drop theirs within a minute). Runs already queued fail when
/// they start.
pub(crate) async fn delete(
    State(inner): State<Arc<Inner>>,
    Path((owner, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> ApiResult {
    let account = account(&inner, &headers)?;
    let state = state(&inner)?;
    let p = owned(state, &account, &owner, &name)?;
    state.registry.delete(&p.key()).map_err(registry_problem)?;
    state.prune_sources();
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `POST /v1/procedures/{owner}/{name}/predictions`: a run, as a
/// prediction.
pub(crate) async fn run(
    State(inner): State<Arc<Inner>>,
    Path((owner, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let account = account(&inner, &headers)?;
    let state = state(&inner)?;
    let p = owned(state, &account, &owner, &name)?;
    let body = parse_body(body)?;
    let target = Target { model: p.key(), deployment: None, kind: JobKind::Procedure };
    create_prediction(&inner, &headers, &account, target, body).await
}

fn registry_problem(e: RegistryError) -> Problem {
    match e {
        RegistryError::Exists(_) => Problem::new(StatusCode::CONFLICT, "Conflict", e.to_string()),
        RegistryError::NotFound(key) => not_found(&key),
        RegistryError::Expired { .. } => Problem::new(StatusCode::GONE, "Gone", e.to_string()),
        RegistryError::Store(e) => Problem::store(e),
    }
}

/// Why `name` is not a procedure name, if it is not.
fn bad_name(name: &str) -> Option<&'static str> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Some("must be 1 to 100 characters");
    }
    if name.starts_with('.') || name.starts_with('-') {
        return Some("must start with a letter, a digit or `_`");
    }
    if !name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')) {
        return Some("may hold only letters, digits, `-`, `_` and `.`");
    }
    None
}

/// `POST /v1/procedures` `{"name", "source_url", "ephemeral"}`: a procedure
/// of the key's account. Its source is fetched, checked and extracted
/// before the answer, so a bad one is refused here: a URL the guard
/// refuses is 400, an origin that fails or an archive refused by a rule is
/// 422, each naming the URL and what is wrong.
pub(crate) async fn create(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let account = account(&inner, &headers)?;
    let state = state(&inner)?;
    let body = parse_body(body)?;
    let name = match body.get("name") {
        Some(Value::String(n)) => n.clone(),
        None => return Err(Problem::invalid("name", "is required")),
        Some(_) => return Err(Problem::invalid("name", "must be a string")),
    };
    if let Some(why) = bad_name(&name) {
        return Err(Problem::invalid("name", &format!("`{name}` {why}")));
    }
    match body.get("owner") {
        None | Some(Value::Null) => {}
        Some(Value::String(o)) if o == account.as_str() => {}
        Some(_) => {
            return Err(Problem::bad_field(
                "owner",
                &format!("a procedure is created under the key's own account, `{account}`"),
            ))
        }
    }
    let source_url = match body.get("source_url") {
        Some(Value::String(u)) => u.clone(),
        None => return Err(Problem::invalid("source_url", "is required (the URL of a tar.gz)")),
        Some(_) => return Err(Problem::invalid("source_url", "must be a string")),
    };
    let ephemeral = match body.get("ephemeral") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(Problem::invalid("ephemeral", "must be a boolean")),
    };
    let key = format!("{account}/{name}");
    if inner.models.contains_key(&key) {
        return Err(Problem::new(
            StatusCode::CONFLICT,
            "Conflict",
            format!("`{key}` is a model this server serves; name the procedure otherwise"),
        ));
    }
    if state.registry.get(&key).map_err(registry_problem)?.is_some() {
        return Err(registry_problem(RegistryError::Exists(key)));
    }
    let archive = state.sources.prepare(&source_url, None).await.map_err(source_problem)?;
    let p = Procedure {
        owner: account.as_str().to_owned(),
        name,
        source_url,
        source_sha256: archive.sha256,
        ephemeral,
        created_at: now(),
    };
    state.registry.create(&p).map_err(registry_problem)?;
    Ok((StatusCode::CREATED, Json(procedure_json(&inner, state, &p))).into_response())
}

fn source_problem(e: SourceError) -> Problem {
    match e {
        SourceError::Refused { .. } => Problem::bad_field("source_url", &e.to_string()),
        e if e.is_the_sources() => {
            Problem::new(StatusCode::UNPROCESSABLE_ENTITY, "Unprocessable source", e.to_string())
        }
        e => {
            tracing::error!("procedures: {e}");
            Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "Internal error",
                "the procedure source cache failed; see the server log",
            )
        }
    }
}
