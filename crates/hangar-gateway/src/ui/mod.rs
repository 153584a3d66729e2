//! The live status page, `GET /ui`: nodes and their GPUs with each
//! replica and what it is doing, models with their policy, desired and
//! ready counts and lines, the last scale decisions and starts, and each
//! model's request rate and TTFT p99 over the last minutes.
//!
//! It is one HTML page, one small hand-written script and one style
//! sheet, compiled into the binary (no build step, nothing fetched from
//! elsewhere). The script renders only what `GET /admin/status` answers,
//! polled every 2 s: whatever the page shows, an operator's `curl` can
//! read too.
//!
//! The page needs an admin key, as the admin API does. A browser cannot
//! set an `Authorization` header on a page it navigates to, so `/ui?key=KEY`
//! checks the key once and answers with a redirect to `/ui` that sets it
//! in a cookie (`HttpOnly` — the script cannot read it — `SameSite=Strict`
//! — no other site's page can make the browser send it), and the key
//! leaves the address bar and the history. The cookie then lets the
//! browser load `/ui` and read `GET /admin/status`, and nothing else: the
//! admin commands take the key from the `Authorization` header only. A
//! client that can set the header (a proxy in front of the page) may send
//! it instead. On a server without API keys the page is open, like the
//! admin API.

use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use hangar_core::{AuthError, Principal};
use hangar_runtime::serve::Server;
use serde::Deserialize;

use crate::openai::principal as header_principal;

const PAGE: &str = include_str!("index.html");
const SCRIPT: &str = include_str!("app.js");
const STYLE: &str = include_str!("style.css");

/// The cookie `/ui?key=` sets: the key, hex-encoded (a key may hold
/// characters a cookie value may not).
pub(crate) const COOKIE: &str = "hangar_admin";

/// How long the cookie lasts: a working day.
const COOKIE_MAX_AGE_S: u32 = 12 * 3600;

pub(crate) fn router(server: Server) -> Router {
    Router::new()
        .route("/ui", get(page))
        .route("/ui/", get(page))
        .route("/ui/app.js", get(|| async { asset("text/javascript; charset=utf-8", SCRIPT) }))
        .route("/ui/style.css", get(|| async { asset("text/css; charset=utf-8", STYLE) }))
        .with_state(server)
}

/// A static part of the page. It holds no data, so it needs no key.
fn asset(content_type: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type), (header::CACHE_CONTROL, "no-cache")], body).into_response()
}

/// Who a browser's request acts for: its `Authorization` header if it
/// has one, else the key of the cookie `/ui?key=` set.
pub(crate) fn principal(server: &Server, headers: &HeaderMap) -> Result<Principal, AuthError> {
    if headers.contains_key(header::AUTHORIZATION) {
        return header_principal(server, headers);
    }
    match cookie_key(headers) {
        Some(key) => server.api_keys().key(&key),
        None => header_principal(server, headers),
    }
}

/// The key in the request's `hangar_admin` cookie, if it has a readable one.
fn cookie_key(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .and_then(|(_, value)| unhex(value))
}

fn hex(text: &str) -> String {
    text.bytes().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<String> {
    if text.len() % 2 != 0 {
        return None;
    }
    let bytes: Option<Vec<u8>> =
        (0..text.len()).step_by(2).map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok()).collect();
    String::from_utf8(bytes?).ok()
}

#[derive(Deserialize)]
struct PageQuery {
    key: Option<String>,
}

/// `GET /ui`, and `GET /ui?key=KEY` once to set the cookie.
async fn page(State(server): State<Server>, Query(query): Query<PageQuery>, headers: HeaderMap) -> Response {
    if let Some(key) = query.key {
        return match server.api_keys().key(&key) {
            Ok(p) if p.admin => signed_in(&key, server.api_keys().is_open()),
            Ok(p) => refused(
                StatusCode::FORBIDDEN,
                &format!("the key of account `{}` is not an admin's", p.account),
            ),
            Err(e) => refused(StatusCode::UNAUTHORIZED, &e.to_string()),
        };
    }
    match principal(&server, &headers) {
        Ok(p) if p.admin => {
            ([(header::CONTENT_TYPE, "text/html; charset=utf-8"), (header::CACHE_CONTROL, "no-store")], PAGE)
                .into_response()
        }
        Ok(p) => {
            refused(StatusCode::FORBIDDEN, &format!("the key of account `{}` is not an admin's", p.account))
        }
        Err(e) => refused(StatusCode::UNAUTHORIZED, &e.to_string()),
    }
}

/// The redirect to `/ui` that keeps `key` in the cookie (none on an open
/// server, which needs no key).
fn signed_in(key: &str, open: bool) -> Response {
    let mut answer = (StatusCode::SEE_OTHER, [(header::LOCATION, "/ui")]).into_response();
    if !open {
        let cookie =
            format!("{COOKIE}={}; HttpOnly; SameSite=Strict; Path=/; Max-Age={COOKIE_MAX_AGE_S}", hex(key));
        if let Ok(value) = HeaderValue::from_str(&cookie) {
            answer.headers_mut().insert(header::SET_COOKIE, value);
        }
    }
    answer
}

/// A page saying why the status page is not shown, and how to open it.
fn refused(status: StatusCode, why: &str) -> Response {
    let why = why.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;");
    let body = format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>Hangar</title>\
         <link rel=\"stylesheet\" href=\"/ui/style.css\"></head><body><main class=\"refused\">\
         <h1>Hangar status</h1><p id=\"refused\">{why}</p>\
         <p>The status page needs an admin API key: open <code>/ui?key=YOUR_ADMIN_KEY</code> once \
         (it is kept in an HttpOnly cookie for this browser), or send \
         <code>Authorization: Bearer YOUR_ADMIN_KEY</code>.</p></main></body></html>"
    );
    (status, [(header::CONTENT_TYPE, "text/html; charset=utf-8")], body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_survives_the_cookie_whatever_it_holds() {
        for key in ["sk-ops", "a key; with=odd,chars", "ключ"] {
            let mut headers = HeaderMap::new();
            let cookie = format!("other=1; {COOKIE}={}; last=2", hex(key));
            headers.insert(header::COOKIE, HeaderValue::from_str(&cookie).unwrap());
            assert_eq!(cookie_key(&headers).as_deref(), Some(key));
        }
        let mut headers = HeaderMap::new();
        headers.insert(header::COOKIE, HeaderValue::from_static("hangar_admin=zz"));
        assert_eq!(cookie_key(&headers), None, "not hex");
        headers.insert(header::COOKIE, HeaderValue::from_static("hangar_admin=abc"));
        assert_eq!(cookie_key(&headers), None, "odd length");
        assert_eq!(cookie_key(&HeaderMap::new()), None);
    }
}
