//! `/v1/deployments`: Replicate's deployments — get, list, create, update
//! (`PATCH`) and delete, as the official client calls them.
//!
//! A deployment is either declared in the config
//! (`[[predictions.deployments]]`: any account that may use its model sees
//! it; it is changed in the config) or made through this API (owned by the
//! account that made it, seen by it alone, named `ACCOUNT/NAME`). One made
//! here sets its model's replica bounds (`min_instances`, `max_instances`)
//! — see [`crate::deployments`] for how they reach the controller; its
//! `hardware` and `version` must be the model's (Hangar does not move a
//! model to other GPUs or versions through a deployment). Every release
//! shows the model's bounds as they stand.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use hangar_core::AccountId;
use serde_json::{json, Map, Value};

use super::{account, parse_body, ApiResult, Problem};
use crate::deployments::{DeploymentRecord, InstanceBounds};
use crate::record::rfc3339;
use crate::service::{now, Inner};
use crate::{Model, ModelSettings};

/// The routes (merged into the API's router).
pub(super) fn routes() -> Router<Arc<Inner>> {
    Router::new()
        .route("/v1/deployments", get(list).post(create))
        .route("/v1/deployments/{owner}/{name}", get(get_one).patch(update).delete(delete))
}

/// A deployment the caller may see.
pub(super) enum Found {
    /// Declared in the config.
    Declared {
        /// `owner/name`.
        name: String,
        /// The model it runs.
        model: String,
        /// Its limits.
        settings: ModelSettings,
    },
    /// Made through this API.
    Made(DeploymentRecord),
}

impl Found {
    /// `owner/name`.
    pub(super) fn name(&self) -> &str {
        match self {
            Found::Declared { name, .. } => name,
            Found::Made(r) => &r.name,
        }
    }

    /// The model it runs.
    pub(super) fn model(&self) -> &str {
        match self {
            Found::Declared { model, .. } => model,
            Found::Made(r) => &r.model,
        }
    }
}

/// The deployment `owner/name` if `account` may see it — one declared in
/// the config whose model it may use, or one of its own made here;
/// otherwise the 404 of a deployment that does not exist. One made on
/// another gateway since this one last read the store is read from it.
pub(super) fn visible(inner: &Inner, account: &AccountId, owner: &str, name: &str) -> Result<Found, Problem> {
    let key = format!("{owner}/{name}");
    let not_found = || Problem::not_found(format!("deployment `{key}` does not exist"));
    let usable = |model: &str| inner.models.get(model).is_some_and(|m| m.allows(account));
    if let Some((model, settings)) = inner.deployments.get(&key) {
        return match usable(model) {
            true => Ok(Found::Declared { name: key.clone(), model: model.clone(), settings: *settings }),
            false => Err(not_found()),
        };
    }
    if owner != account.as_str() {
        return Err(not_found());
    }
    let record = match inner.book.get(&key) {
        Some(r) => r,
        None => {
            inner.book.replace(inner.store.deployments().map_err(Problem::store)?);
            inner.book.get(&key).ok_or_else(not_found)?
        }
    };
    match usable(&record.model) {
        true => Ok(Found::Made(record)),
        false => Err(not_found()),
    }
}

/// The bounds `model` runs within now: its deployment's, or its own.
fn bounds_of(inner: &Inner, model: &Model) -> InstanceBounds {
    inner.book.of_model(&model.key).map_or(
        InstanceBounds {
            min_instances: model.capacity.min_instances,
            max_instances: model.capacity.max_instances,
        },
        |r| r.bounds,
    )
}

/// A deployment as Replicate's client reads it. A declared one's one
/// release is the config this server loaded (number 1, created when the
/// service started); a made one's is its latest, by the account that made
/// it.
fn to_json(inner: &Inner, found: &Found) -> Value {
    let m = &inner.models[found.model()];
    let settings = match found {
        Found::Declared { settings, .. } => *settings,
        Found::Made(_) => m.settings,
    };
    let (owner, name) = found.name().split_once('/').unwrap_or(("", found.name()));
    let (number, created_at, created_by) = match found {
        Found::Declared { .. } => (1, inner.started_ms, Value::Null),
        Found::Made(r) => (
            r.release,
            r.released_at,
            json!({"type": "user", "username": owner, "name": owner, "github_url": null}),
        ),
    };
    let bounds = bounds_of(inner, m);
    json!({
        "owner": owner,
        "name": name,
        "current_release": {
            "number": number,
            "model": m.key,
            "version": m.version,
            "created_at": rfc3339(created_at),
            "created_by": created_by,
            "configuration": {
                "hardware": m.capacity.hardware,
                "min_instances": bounds.min_instances,
                "max_instances": bounds.max_instances,
                "max_run_lifetime_s": settings.max_run_lifetime_s,
                "predict_timeout_s": settings.predict_timeout_s,
                "idempotent": settings.idempotent,
            },
        },
    })
}

async fn get_one(
    State(inner): State<Arc<Inner>>,
    Path((owner, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> ApiResult {
    let account = account(&inner, &headers)?;
    let found = visible(&inner, &account, &owner, &name)?;
    Ok(Json(to_json(&inner, &found)).into_response())
}

/// `GET /v1/deployments`: those declared whose model the caller may use,
/// then its own (one page holds them all).
async fn list(State(inner): State<Arc<Inner>>, headers: HeaderMap) -> ApiResult {
    let account = account(&inner, &headers)?;
    inner.book.replace(inner.store.deployments().map_err(Problem::store)?);
    let usable = |model: &str| inner.models.get(model).is_some_and(|m| m.allows(&account));
    let declared =
        inner.deployments.iter().filter(|(_, (model, _))| usable(model)).map(|(name, (model, s))| {
            Found::Declared { name: name.clone(), model: model.clone(), settings: *s }
        });
    let made = inner
        .book
        .all()
        .into_iter()
        .filter(|r| r.owner() == account.as_str() && usable(&r.model))
        .map(Found::Made);
    let results: Vec<Value> = declared.chain(made).map(|f| to_json(&inner, &f)).collect();
    Ok(Json(json!({"results": results, "next": null, "previous": null})).into_response())
}

/// The fields of a create or update body, each checked by name; any other
/// field is refused (422 naming it), so a misspelt one is not silently
/// ignored.
struct Fields(Map<String, Value>);

impl Fields {
    fn new(body: Map<String, Value>, allowed: &[&str]) -> Result<Self, Problem> {
        if let Some(other) = body.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(Problem::invalid(
                other,
                &format!("is not a deployment field ({})", allowed.join(", ")),
            ));
        }
        Ok(Fields(body))
    }

    fn string(&self, field: &str) -> Result<Option<&str>, Problem> {
        match self.0.get(field) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(Problem::invalid(field, "must be a string")),
        }
    }

    fn count(&self, field: &str) -> Result<Option<u32>, Problem> {
        match self.0.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| Problem::invalid(field, "must be a whole number of instances, 0 or more")),
        }
    }
}

fn required<T>(field: &str, value: Option<T>) -> Result<T, Problem> {
    value.ok_or_else(|| Problem::invalid(field, "is required"))
}

/// Checks a release's `version`, `hardware` and bounds against `model`:
/// the model's own version and hardware, bounds it can run within (by its
/// scaling policy, through the executor).
fn check_release(
    inner: &Inner,
    model: &Model,
    version: &str,
    hardware: &str,
    bounds: InstanceBounds,
) -> Result<(), Problem> {
    if version != model.version {
        let detail =
            format!("`{version}` is not the version of `{}`; its version is `{}`", model.key, model.version);
        return Err(Problem::invalid("version", &detail));
    }
    if hardware != model.capacity.hardware {
        let detail = format!(
            "`{hardware}` is not the hardware `{}` runs on: `{}` (GET /v1/hardware)",
            model.key, model.capacity.hardware
        );
        return Err(Problem::invalid("hardware", &detail));
    }
    let field = if bounds.max_instances == 0 { "max_instances" } else { "min_instances" };
    bounds.check().map_err(|e| Problem::invalid(field, &e))?;
    inner.executor().check_bounds(&model.key, bounds).map_err(|e| Problem::invalid("min_instances", &e))
}

fn conflict(detail: String) -> Problem {
    Problem::new(StatusCode::CONFLICT, "Conflict", detail)
}

/// Applies the stored deployments' bounds now, after a change. The store
/// already holds the change, so a client that leaves meanwhile loses
/// nothing: the next reconcile pass applies it.
async fn apply_now(inner: &Arc<Inner>) {
    if let Err(e) = inner.reconcile_deployments().await {
        tracing::debug!("deployments: applying bounds after a change: {e}");
    }
}

/// [`apply_now`], then the answer with `found`.
async fn applied(inner: &Arc<Inner>, status: StatusCode, found: Found) -> ApiResult {
    apply_now(inner).await;
    Ok((status, Json(to_json(inner, &found))).into_response())
}

/// `POST /v1/deployments` `{name, model, version, hardware, min_instances,
/// max_instances}`: a deployment `ACCOUNT/NAME` of a model the caller may
/// use, 201. 409 if the name is taken or the model has a deployment made
/// here already.
async fn create(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult {
    const FIELDS: &[&str] = &["name", "model", "version", "hardware", "min_instances", "max_instances"];
    let account = account(&inner, &headers)?;
    let f = Fields::new(parse_body(body)?, FIELDS)?;
    let name = required("name", f.string("name")?)?;
    if name.contains('/') || name.parse::<hangar_core::ModelKey>().is_err() {
        return Err(Problem::invalid("name", "must be a name of ASCII letters, digits and `._-`"));
    }
    let model_key = required("model", f.string("model")?)?;
    let model = inner
        .models
        .get(model_key)
        .filter(|m| m.allows(&account))
        .ok_or_else(|| Problem::not_found(format!("model `{model_key}` does not exist")))?;
    let bounds = InstanceBounds {
        min_instances: required("min_instances", f.count("min_instances")?)?,
        max_instances: required("max_instances", f.count("max_instances")?)?,
    };
    let (version, hardware) =
        (required("version", f.string("version")?)?, required("hardware", f.string("hardware")?)?);
    check_release(&inner, model, version, hardware, bounds)?;
    let key = format!("{account}/{name}");
    if inner.deployments.contains_key(&key) {
        return Err(conflict(format!("deployment `{key}` is declared in the server's config")));
    }
    inner.book.replace(inner.store.deployments().map_err(Problem::store)?);
    if let Some(other) = inner.book.of_model(&model.key).filter(|o| o.name != key) {
        return Err(conflict(format!(
            "model `{}` has a deployment already, `{}`, which sets its replica bounds; update that one (PATCH) or \
             delete it first",
            model.key, other.name
        )));
    }
    let t = now();
    let record = DeploymentRecord {
        name: key.clone(),
        model: model.key.clone(),
        version: version.to_owned(),
        hardware: hardware.to_owned(),
        bounds,
        release: 1,
        created_at: t,
        released_at: t,
    };
    if !inner.store.put_deployment(&record, None).map_err(Problem::store)? {
        return Err(conflict(format!("deployment `{key}` exists already")));
    }
    applied(&inner, StatusCode::CREATED, Found::Made(record)).await
}

/// A deployment the caller may change: one it made here. A declared one
/// is 409 (its place is the config).
fn own(inner: &Inner, account: &AccountId, owner: &str, name: &str) -> Result<DeploymentRecord, Problem> {
    match visible(inner, account, owner, name)? {
        Found::Made(r) => Ok(r),
        Found::Declared { name, .. } => Err(conflict(format!(
            "deployment `{name}` is declared in the server's config ([[predictions.deployments]]); change it there"
        ))),
    }
}

/// `PATCH /v1/deployments/{owner}/{name}` with any of `version`,
/// `hardware`, `min_instances`, `max_instances`: a new release. 409 if
/// another update got in between this one's read and write.
async fn update(
    State(inner): State<Arc<Inner>>,
    Path((owner, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult {
    let account = account(&inner, &headers)?;
    let f = Fields::new(parse_body(body)?, &["version", "hardware", "min_instances", "max_instances"])?;
    let current = own(&inner, &account, &owner, &name)?;
    let model = &inner.models[&current.model];
    let mut next = current.clone();
    next.version = f.string("version")?.map_or(next.version, str::to_owned);
    next.hardware = f.string("hardware")?.map_or(next.hardware, str::to_owned);
    next.bounds.min_instances = f.count("min_instances")?.unwrap_or(next.bounds.min_instances);
    next.bounds.max_instances = f.count("max_instances")?.unwrap_or(next.bounds.max_instances);
    check_release(&inner, model, &next.version, &next.hardware, next.bounds)?;
    (next.release, next.released_at) = (current.release + 1, now());
    if !inner.store.put_deployment(&next, Some(current.release)).map_err(Problem::store)? {
        return Err(conflict(format!(
            "deployment `{}` changed while this update was made (it is not at release {} any more); read it again",
            current.name, current.release
        )));
    }
    applied(&inner, StatusCode::OK, Found::Made(next)).await
}

/// `DELETE /v1/deployments/{owner}/{name}`: 204; its model runs within
/// its own bounds again.
async fn delete(
    State(inner): State<Arc<Inner>>,
    Path((owner, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> ApiResult {
    let account = account(&inner, &headers)?;
    let current = own(&inner, &account, &owner, &name)?;
    inner.store.delete_deployment(&current.name).map_err(Problem::store)?;
    apply_now(&inner).await;
    Ok(StatusCode::NO_CONTENT.into_response())
}
