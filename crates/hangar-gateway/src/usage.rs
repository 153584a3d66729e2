//! `GET /v1/usage`: the server's inference events of a time range added
//! up — per model, account, day or hour: requests, errors, tokens in and
//! out, images, seconds of inference, Replicate-style cost and Workers AI
//! neurons (docs/observability.md, "Usage and billing").
//!
//! An account's key sees its own account only (`account=` another is
//! 403, whatever that account is); an admin key sees every account and
//! may name one. A model the caller may not use is answered as one that
//! does not exist (404), as everywhere in the API.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use hangar_core::{AccountId, Millis, ModelKey};
use hangar_runtime::events::{parse_time, rfc3339, GroupBy, QueryError, UsageError, UsageQuery};
use hangar_runtime::serve::{wall_ms, Server};
use serde_json::json;

use crate::openai::{denied, no_such_model, principal, ApiError};

pub(crate) fn router(server: Server) -> Router {
    Router::new().route("/v1/usage", get(usage)).with_state(server)
}

/// The parameters `GET /v1/usage` takes.
const PARAMS: [&str; 5] = ["from", "to", "model", "account", "group_by"];

/// Without `from`, the usage of this long before `to`.
const DEFAULT_SPAN_MS: Millis = 24 * 3_600_000;

/// Seconds a client is told to wait before asking again when the fleet's
/// Redis cannot be reached.
const RETRY_AFTER_S: u32 = 5;

/// `GET /v1/usage?from=&to=&model=&account=&group_by=`.
async fn usage(
    State(server): State<Server>,
    headers: HeaderMap,
    params: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> Response {
    let caller = match principal(&server, &headers) {
        Ok(p) => p,
        Err(e) => return denied(StatusCode::UNAUTHORIZED, &e.to_string()),
    };
    let query = match query(&server, &caller.account, caller.admin, params) {
        Ok(q) => q,
        Err(refused) => return refused.into_response(),
    };
    let (from, to, group_by) = (query.from_ms, query.to_ms, query.group_by);
    let (model, account) = (query.model.clone(), query.account.as_ref().map(AccountId::to_string));
    match server.usage(query).await {
        Ok(report) => Json(json!({
            "object": "usage",
            "from": rfc3339(from),
            "to": rfc3339(to),
            "group_by": group_by,
            "model": model,
            "account": account,
            "data": report.groups(),
            "total": report.total(),
        }))
        .into_response(),
        Err(UsageError::Off) => ApiError::not_found(UsageError::Off.to_string()).into_response(),
        Err(UsageError::Stream { source, .. }) if source.is_unavailable() => {
            let message = "the fleet's Redis, which holds the events, cannot be reached; retry";
            let mut r = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", message)
                .into_response();
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_S));
            r
        }
        Err(e) => {
            tracing::error!("cannot read usage: {e}");
            let message = "the usage records could not be read; the server's log says why";
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", message).into_response()
        }
    }
}

/// The query the parameters ask for, as `account` (an admin when
/// `admin`) may make it; the refusal naming the parameter at fault.
fn query(
    server: &Server,
    account: &AccountId,
    admin: bool,
    params: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> Result<UsageQuery, ApiError> {
    let Query(params) = params.map_err(|r| ApiError::bad_request(r.body_text()))?;
    let mut given: [Option<&str>; PARAMS.len()] = Default::default();
    for (name, value) in &params {
        let Some(i) = PARAMS.iter().position(|p| p == name) else {
            let message = format!("unknown parameter `{name}`; /v1/usage takes {}", PARAMS.join(", "));
            return Err(ApiError::bad_request(message));
        };
        if given[i].replace(value).is_some() {
            return Err(ApiError::bad_request(format!("`{name}` is given twice")).param(PARAMS[i]));
        }
    }
    let [from, to, model, asked_account, group_by] = given;
    let time = |param: &'static str, value: &str| {
        parse_time(param, value).map_err(|e| ApiError::bad_request(e.to_string()).param(param))
    };
    // Now, and what ended within this millisecond too (`to` is excluded).
    let to_ms = to.map(|t| time("to", t)).transpose()?.unwrap_or_else(|| wall_ms() + 1);
    let from_ms = from.map(|f| time("from", f)).transpose()?.unwrap_or(to_ms.saturating_sub(DEFAULT_SPAN_MS));
    if from_ms > to_ms {
        let e = QueryError::Range {
            from: from.unwrap_or_default().to_owned(),
            to: to.unwrap_or("now").to_owned(),
        };
        return Err(ApiError::bad_request(e.to_string()).param("from"));
    }
    let group_by = match group_by {
        Some(g) => GroupBy::parse(g).map_err(|e| ApiError::bad_request(e.to_string()).param("group_by"))?,
        None => GroupBy::default(),
    };
    let model = match model {
        None => None,
        // A model it may use: the others do not exist for it.
        Some(m) if !admin => match server.model(m).filter(|rt| rt.allows(account)) {
            Some(_) => Some(m.to_owned()),
            None => return Err(no_such_model(m)),
        },
        // An admin may ask for any model, one no longer served too.
        Some(m) => match m.parse::<ModelKey>() {
            Ok(_) => Some(m.to_owned()),
            Err(e) => return Err(ApiError::bad_request(format!("`model`: {e}")).param("model")),
        },
    };
    let account = match (asked_account, admin) {
        (None, true) => None,
        (None, false) => Some(account.clone()),
        (Some(a), _) => {
            let asked: AccountId =
                a.parse().map_err(|e| ApiError::bad_request(format!("`account`: {e}")).param("account"))?;
            if !admin && asked != *account {
                let message =
                    "an account's API key sees only its own usage; another account's needs an admin key";
                return Err(
                    ApiError::new(StatusCode::FORBIDDEN, "permission_error", message).param("account")
                );
            }
            Some(asked)
        }
    };
    Ok(UsageQuery { from_ms, to_ms, model, account, group_by })
}
