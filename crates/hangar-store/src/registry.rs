//! The peer registry (`hangar store registry`): which daemon holds what.
//!
//! Daemons heartbeat their peer URL, the artifacts their blob store holds and
//! their keys; the registry answers "who holds this id" with the daemons
//! heard from within the TTL, and resolves keys cluster-wide. State is soft:
//! a restarted registry is repopulated by the next heartbeats.
//!
//! A node name is held by one daemon, known by its URL: a heartbeat under
//! a name that a live daemon at another URL holds is refused
//! ([`NameTaken`]), so two daemons never silently replace each other (as
//! two `hangar store serve` on one host would, both named after the host).
//! The same URL is the same daemon, restarted: it keeps its name. A name
//! whose holder has been silent for the TTL is free.
//!
//! HTTP API (JSON):
//! - `POST /v1/heartbeat` with a [`Heartbeat`] → `204`, or `409` with a
//!   [`NameTaken`] when another live daemon holds the name
//! - `GET /v1/holders/{id}` → [`Holders`]
//! - `GET /v1/keys/{key}` → `{"id": …}` or `404`
//! - `GET /v1/nodes` → the nodes alive

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use hangar_core::Millis;
use serde::{Deserialize, Serialize};

use crate::id::{ArtifactId, StoreKey};

/// What a daemon reports on each heartbeat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// Node name (unique per daemon).
    pub node: String,
    /// Base URL where the daemon serves peers, e.g. `http://10.0.0.5:7701`.
    pub url: String,
    /// Artifacts its blob store holds.
    pub artifacts: Vec<ArtifactId>,
    /// Its keys.
    pub keys: BTreeMap<StoreKey, ArtifactId>,
}

/// A heartbeat refused: another live daemon holds the node name (the body
/// of the `409`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error(
    "node name `{node}` is held by another live daemon, at {holder} (heard {heard_ms_ago} ms ago); \
     give this daemon its own name with --node NAME, or stop the other one"
)]
pub struct NameTaken {
    /// The name.
    pub node: String,
    /// The URL of the daemon holding it.
    pub holder: String,
    /// How long ago the registry last heard the holder.
    pub heard_ms_ago: Millis,
}

/// Answer to `GET /v1/holders/{id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holders {
    /// Peer base URLs, most recently heard first.
    pub peers: Vec<String>,
}

/// The registry's table, driven by `now` (sans-IO).
#[derive(Debug, Clone)]
pub struct RegistryTable {
    ttl: Millis,
    nodes: HashMap<String, (Heartbeat, Millis)>,
}

impl RegistryTable {
    /// A table forgetting nodes not heard from for `ttl` ms.
    pub fn new(ttl: Millis) -> Self {
        RegistryTable { ttl, nodes: HashMap::new() }
    }

    /// Records a heartbeat; refused, the table unchanged, when a live
    /// daemon at another URL holds the node name.
    pub fn heartbeat(&mut self, hb: Heartbeat, now: Millis) -> Result<(), NameTaken> {
        if let Some((held, seen)) = self.nodes.get(&hb.node) {
            let age = now.saturating_sub(*seen);
            if held.url != hb.url && age <= self.ttl {
                return Err(NameTaken { node: hb.node, holder: held.url.clone(), heard_ms_ago: age });
            }
        }
        self.nodes.insert(hb.node.clone(), (hb, now));
        Ok(())
    }

    fn alive(&self, now: Millis) -> impl Iterator<Item = &(Heartbeat, Millis)> {
        self.nodes.values().filter(move |(_, seen)| now.saturating_sub(*seen) <= self.ttl)
    }

    /// Live nodes holding `id`, most recently heard first.
    pub fn holders(&self, id: &ArtifactId, now: Millis) -> Vec<String> {
        let mut v: Vec<&(Heartbeat, Millis)> =
            self.alive(now).filter(|(h, _)| h.artifacts.contains(id)).collect();
        v.sort_by_key(|(h, seen)| (std::cmp::Reverse(*seen), h.node.clone()));
        v.into_iter().map(|(h, _)| h.url.clone()).collect()
    }

    /// Resolves a key from the most recently heard live node that has it.
    pub fn resolve(&self, key: &StoreKey, now: Millis) -> Option<ArtifactId> {
        self.alive(now).filter_map(|(h, seen)| h.keys.get(key).map(|id| (*seen, *id))).max().map(|(_, id)| id)
    }

    /// Names and URLs of live nodes.
    pub fn nodes(&self, now: Millis) -> BTreeMap<String, String> {
        self.alive(now).map(|(h, _)| (h.node.clone(), h.url.clone())).collect()
    }
}

#[derive(Clone)]
struct Shared {
    table: Arc<Mutex<RegistryTable>>,
    epoch: Instant,
}

impl Shared {
    fn now(&self) -> Millis {
        self.epoch.elapsed().as_millis() as Millis
    }
}

/// The registry's HTTP router.
pub fn router(ttl: Millis) -> Router {
    let shared = Shared { table: Arc::new(Mutex::new(RegistryTable::new(ttl))), epoch: Instant::now() };
    Router::new()
        .route("/v1/heartbeat", post(heartbeat))
        .route("/v1/holders/{id}", get(holders))
        .route("/v1/keys/{*key}", get(key))
        .route("/v1/nodes", get(nodes))
        .with_state(shared)
}

async fn heartbeat(
    State(s): State<Shared>,
    Json(hb): Json<Heartbeat>,
) -> Result<StatusCode, (StatusCode, Json<NameTaken>)> {
    let now = s.now();
    match s.table.lock().expect("not poisoned").heartbeat(hb, now) {
        Ok(()) => Ok(StatusCode::NO_CONTENT),
        Err(taken) => Err((StatusCode::CONFLICT, Json(taken))),
    }
}

async fn holders(
    State(s): State<Shared>,
    Path(id): Path<String>,
) -> Result<Json<Holders>, (StatusCode, String)> {
    let id: ArtifactId = id.parse().map_err(|e| (StatusCode::BAD_REQUEST, format!("{e}")))?;
    let now = s.now();
    Ok(Json(Holders { peers: s.table.lock().expect("not poisoned").holders(&id, now) }))
}

async fn key(
    State(s): State<Shared>,
    Path(key): Path<String>,
) -> Result<Json<serde_json::Value>, (StatusCode, String)> {
    let key: StoreKey = key.parse().map_err(|e| (StatusCode::BAD_REQUEST, format!("{e}")))?;
    let now = s.now();
    match s.table.lock().expect("not poisoned").resolve(&key, now) {
        Some(id) => Ok(Json(serde_json::json!({ "id": id }))),
        None => Err((StatusCode::NOT_FOUND, format!("unknown key `{key}`"))),
    }
}

async fn nodes(State(s): State<Shared>) -> Json<BTreeMap<String, String>> {
    let now = s.now();
    Json(s.table.lock().expect("not poisoned").nodes(now))
}

/// A running registry on its own runtime thread; dropping it stops it.
#[derive(Debug)]
pub struct RegistryHandle {
    addr: SocketAddr,
    service: crate::service::ServiceThread,
}

impl RegistryHandle {
    /// Binds `addr` (port 0 picks one) and serves, forgetting nodes silent for `ttl` ms.
    pub fn start(addr: SocketAddr, ttl: Millis) -> std::io::Result<RegistryHandle> {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        let listener = rt.block_on(tokio::net::TcpListener::bind(addr))?;
        let addr = listener.local_addr()?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new().name("hangar-store-registry".into()).spawn(move || {
            rt.block_on(async move {
                let server = axum::serve(listener, router(ttl)).with_graceful_shutdown(async {
                    let _ = rx.await;
                });
                if let Err(e) = server.await {
                    tracing::error!(error = %e, "registry stopped");
                }
            });
        })?;
        tracing::info!(%addr, ttl_ms = ttl, "store registry listening");
        Ok(RegistryHandle { addr, service: crate::service::ServiceThread::new(tx, thread) })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The base URL daemons use.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Blocks until the registry stops (it runs until killed).
    pub fn wait(mut self) {
        self.service.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hb(node: &str, ids: &[ArtifactId]) -> Heartbeat {
        Heartbeat {
            node: node.into(),
            url: format!("http://{node}"),
            artifacts: ids.to_vec(),
            keys: BTreeMap::new(),
        }
    }

    #[test]
    fn holders_expire_after_ttl_and_latest_first() {
        let id = ArtifactId::View([1; 32]);
        let mut t = RegistryTable::new(100);
        t.heartbeat(hb("a", &[id]), 0).unwrap();
        t.heartbeat(hb("b", &[id]), 50).unwrap();
        assert_eq!(t.holders(&id, 60), vec!["http://b", "http://a"]);
        assert_eq!(t.holders(&id, 120), vec!["http://b"]);
        assert!(t.holders(&id, 200).is_empty());
        let mut with_key = hb("c", &[id]);
        let key: StoreKey = "m:v".parse().unwrap();
        with_key.keys.insert(key.clone(), id);
        t.heartbeat(with_key, 300).unwrap();
        assert_eq!(t.resolve(&key, 350), Some(id));
        assert_eq!(t.resolve(&key, 500), None);
    }

    #[test]
    fn a_live_name_is_refused_to_another_url_and_kept_by_its_own() {
        let id = ArtifactId::View([2; 32]);
        let mut t = RegistryTable::new(100);
        let at = |url: &str| Heartbeat { url: url.into(), ..hb("host", &[id]) };
        t.heartbeat(at("http://h:1"), 0).unwrap();
        let taken = t.heartbeat(at("http://h:2"), 40).unwrap_err();
        assert_eq!(taken, NameTaken { node: "host".into(), holder: "http://h:1".into(), heard_ms_ago: 40 });
        let msg = taken.to_string();
        assert!(msg.contains("`host`") && msg.contains("http://h:1") && msg.contains("--node"), "{msg}");
        assert_eq!(t.holders(&id, 50), vec!["http://h:1"], "the refused heartbeat changed nothing");
        t.heartbeat(at("http://h:1"), 90).unwrap();
        assert!(t.heartbeat(at("http://h:2"), 190).is_err(), "renewed: still live");
        t.heartbeat(at("http://h:2"), 191).unwrap();
        assert_eq!(t.holders(&id, 191), vec!["http://h:2"], "silent past the TTL: the name is free");
    }
}
