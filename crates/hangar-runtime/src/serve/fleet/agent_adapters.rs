//! A fleet node's LoRA adapters (docs/adapters.md, "On a fleet"): the
//! agent carries out what each engine's [`EngineAdapters`] decides, from
//! the gateways' holds.
//!
//! - `POST /v1/replicas/{replica}/adapters/hold` `{"adapter": "BASE:NAME",
//!   "artifact": "hg1:…", "gateway": "gw-…"}`: the gateway's adapter slots
//!   load the adapter on that replica; answered 200 once the engine has
//!   it, 502 naming why its load failed, 409 when the engine has the name
//!   as another artifact, 404 when the replica does not serve here.
//! - `POST /v1/replicas/{replica}/adapters/release` `{"adapter",
//!   "gateway"}`: the slots unloaded it; 200 at once, the engine unloads
//!   it once no gateway holds it.
//!
//! A load makes the adapter's directory on this node (the store daemon
//! fetches the artifact from a peer when the node lacks it, and the
//! binding is checked: [`WeightStore::adapter_dir`]), then posts vLLM's
//! `/v1/load_lora_adapter` to the engine; an unload posts
//! `/v1/unload_lora_adapter`. Every second the holds of gateways that are
//! no longer alive go — a gateway is alive until ten reads of Redis's
//! index of gateways in a row that answered missed it ([`Holders`]; a
//! Redis that does not answer takes no hold away) — and the engines of
//! replicas that no longer run here are forgotten.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use axum::response::{IntoResponse, Response};
use hangar_agent::engine_adapters::{AdapterView, EngineAdapters, Hold, Holders, State, Step};
use hangar_agent::lifecycle::DriverHandle;
use hangar_agent::weights::WeightStore;
use hangar_core::{AdapterRef, ReplicaId, ReplicaPhase};
use hangar_store::ArtifactId;
use tokio::sync::watch;

/// The adapters of every engine on the node.
pub(super) struct AdapterHolds {
    node: String,
    driver: DriverHandle,
    weights: Arc<WeightStore>,
    client: reqwest::Client,
    engines: Mutex<HashMap<ReplicaId, Engine>>,
    /// Which gateways' holds stand.
    gateways: Mutex<Holders>,
    /// Bumped after every step: waiting holds look again.
    stepped: watch::Sender<u64>,
}

struct Engine {
    adapters: EngineAdapters,
    /// A task carries out its steps.
    driving: bool,
}

/// A hold's or release's body.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Asked {
    adapter: String,
    #[serde(default)]
    artifact: Option<String>,
    gateway: String,
}

/// A refusal: its status and the message naming what and why.
struct Refusal(u16, String);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let status = axum::http::StatusCode::from_u16(self.0).expect("a status");
        (status, axum::Json(serde_json::json!({"error": {"message": self.1}}))).into_response()
    }
}

fn refuse(status: u16, message: String) -> Response {
    Refusal(status, message).into_response()
}

/// `POST /v1/replicas/{replica}/adapters/{op}` on the agent of `node`:
/// a hold or a release on `holds`, the node's engines' adapters (`None`:
/// it runs no model with adapters, 404).
pub(super) async fn answer(
    holds: Option<&Arc<AdapterHolds>>,
    node: &str,
    replica: &str,
    op: &str,
    body: &[u8],
) -> Response {
    match (holds, op) {
        (None, _) => refuse(404, format!("node {node} runs no model with adapters")),
        (Some(holds), "hold") => holds.hold(replica, body).await,
        (Some(holds), "release") => holds.release(replica, body),
        (Some(_), other) => refuse(404, format!("no adapter operation `{other}` (hold or release)")),
    }
}

impl AdapterHolds {
    pub(super) fn new(
        node: String,
        driver: DriverHandle,
        weights: Arc<WeightStore>,
        client: reqwest::Client,
    ) -> Self {
        AdapterHolds {
            node,
            driver,
            weights,
            client,
            engines: Mutex::default(),
            gateways: Mutex::default(),
            stepped: watch::channel(0).0,
        }
    }

    /// The body's adapter, artifact (when `with_artifact`) and gateway, or
    /// the 400 naming what is wrong.
    fn parse(body: &[u8], with_artifact: bool) -> Result<(AdapterRef, Option<ArtifactId>, String), Refusal> {
        let asked: Asked = serde_json::from_slice(body).map_err(|e| {
            Refusal(400, format!("the body is not {{\"adapter\", \"artifact\", \"gateway\"}}: {e}"))
        })?;
        let adapter =
            asked.adapter.parse::<AdapterRef>().map_err(|e| Refusal(400, format!("adapter: {e}")))?;
        let artifact = match (asked.artifact, with_artifact) {
            (Some(a), true) => {
                Some(a.parse::<ArtifactId>().map_err(|e| Refusal(400, format!("artifact `{a}`: {e}")))?)
            }
            (None, true) => return Err(Refusal(400, "artifact: missing".into())),
            (_, false) => None,
        };
        if asked.gateway.is_empty() {
            return Err(Refusal(400, "gateway: empty".into()));
        }
        Ok((adapter, artifact, asked.gateway))
    }

    /// A hold: `POST /v1/replicas/{replica}/adapters/hold`.
    ///
    /// # Cancel safety
    /// A gateway that goes away while the load runs leaves its hold (a
    /// hold is idempotent: its slots' next load of the adapter finds it)
    /// until it releases the adapter or is no longer alive; the load goes
    /// on in the engine's own task.
    async fn hold(self: &Arc<Self>, replica: &str, body: &[u8]) -> Response {
        let (adapter, artifact, gateway) = match Self::parse(body, true) {
            Ok(asked) => asked,
            Err(refused) => return refused.into_response(),
        };
        let replica = match self.serving(replica) {
            Ok(replica) => replica,
            Err(refused) => return refused.into_response(),
        };
        let artifact = artifact.expect("parsed with an artifact");
        self.gateways.lock().expect("gateways lock").heard(&gateway);
        let mut stepped = self.stepped.subscribe();
        let held = {
            let mut engines = self.engines.lock().expect("engines lock");
            let engine = engines
                .entry(replica)
                .or_insert_with(|| Engine { adapters: EngineAdapters::new(), driving: false });
            engine.adapters.hold(&gateway, &adapter, artifact)
        };
        match held {
            Hold::Ready => return axum::Json(serde_json::json!({"loaded": true})).into_response(),
            Hold::Conflict { loaded } => {
                return refuse(
                    409,
                    format!(
                        "replica {replica} has adapter {adapter} loaded as artifact {loaded}, not {artifact}; it \
                         loads {artifact} once the gateways holding {loaded} release it"
                    ),
                )
            }
            Hold::Waiting => self.drive(replica),
        }
        loop {
            let state = {
                let engines = self.engines.lock().expect("engines lock");
                engines.get(&replica).map(|e| e.adapters.state(&gateway, adapter.name()))
            };
            match state {
                Some(State::Ready) => return axum::Json(serde_json::json!({"loaded": true})).into_response(),
                Some(State::NotHeld(Some(why))) => return refuse(502, why),
                Some(State::NotHeld(None)) | None => {
                    let why = format!("the hold of adapter {adapter} on replica {replica} ended before it loaded (the replica stopped, or the gateway released it)");
                    return refuse(409, why);
                }
                Some(State::Waiting) => {}
            }
            if stepped.changed().await.is_err() {
                return refuse(503, format!("node {} is stopping", self.node));
            }
        }
    }

    /// A release: `POST /v1/replicas/{replica}/adapters/release`.
    fn release(self: &Arc<Self>, replica: &str, body: &[u8]) -> Response {
        let (adapter, _, gateway) = match Self::parse(body, false) {
            Ok(asked) => asked,
            Err(refused) => return refused.into_response(),
        };
        let Ok(replica) = replica.parse::<ReplicaId>() else {
            return refuse(400, format!("`{replica}` is not a replica id"));
        };
        if let Some(engine) = self.engines.lock().expect("engines lock").get_mut(&replica) {
            engine.adapters.release(&gateway, adapter.name());
        }
        self.drive(replica);
        axum::Json(serde_json::json!({"released": true})).into_response()
    }

    /// Each engine's adapters and who holds them, by replica.
    pub(super) fn view(&self) -> std::collections::BTreeMap<ReplicaId, Vec<AdapterView>> {
        let engines = self.engines.lock().expect("engines lock");
        engines.iter().map(|(id, e)| (*id, e.adapters.view())).collect()
    }

    /// The replica `id` if it serves on this node, else the refusal.
    fn serving(&self, id: &str) -> Result<ReplicaId, Refusal> {
        let replica =
            id.parse::<ReplicaId>().map_err(|_| Refusal(400, format!("`{id}` is not a replica id")))?;
        match self.driver.replica(replica) {
            Some(r) if r.phase == ReplicaPhase::Ready && r.url.is_some() => Ok(replica),
            _ => Err(Refusal(404, format!("replica {replica} does not serve on node {}", self.node))),
        }
    }

    /// Every second: the holds of gateways no longer alive (`alive`: the
    /// gateways in Redis's index now, or `None` when it could not be read,
    /// which changes nothing) go, and the engines of replicas no longer
    /// running here are forgotten.
    pub(super) fn keep_level(self: &Arc<Self>, alive: Option<BTreeSet<String>>) {
        let keep = alive.map(|alive| self.gateways.lock().expect("gateways lock").read(&alive));
        let running: BTreeSet<ReplicaId> = self.driver.replicas().iter().map(|r| r.view.replica).collect();
        let replicas: Vec<ReplicaId> = {
            let mut engines = self.engines.lock().expect("engines lock");
            engines.retain(|id, _| running.contains(id));
            if let Some(keep) = &keep {
                for engine in engines.values_mut() {
                    engine.adapters.keep_gateways(keep);
                }
            }
            engines.keys().copied().collect()
        };
        for replica in replicas {
            self.drive(replica);
        }
        self.stepped.send_modify(|n| *n += 1);
    }

    /// Starts carrying out `replica`'s engine steps unless a task does.
    fn drive(self: &Arc<Self>, replica: ReplicaId) {
        {
            let mut engines = self.engines.lock().expect("engines lock");
            let Some(engine) = engines.get_mut(&replica) else { return };
            if engine.driving {
                return;
            }
            engine.driving = true;
        }
        let me = self.clone();
        tokio::spawn(async move { me.steps(replica).await });
    }

    /// Carries out `replica`'s engine steps one at a time until none is
    /// due.
    ///
    /// # Cancel safety
    /// Runs as its own task; each step's outcome is handed back before
    /// the next is asked for.
    async fn steps(self: Arc<Self>, replica: ReplicaId) {
        loop {
            let step = {
                let mut engines = self.engines.lock().expect("engines lock");
                let Some(engine) = engines.get_mut(&replica) else { return };
                match engine.adapters.poll_step() {
                    Some(step) => step,
                    None => {
                        engine.driving = false;
                        return;
                    }
                }
            };
            let outcome = self.carry_out(replica, &step).await;
            if let Err(why) = &outcome {
                tracing::warn!(node = %self.node, %replica, ?step, "adapter step failed: {why}");
            }
            if let Some(engine) = self.engines.lock().expect("engines lock").get_mut(&replica) {
                engine.adapters.step_done(outcome);
            }
            self.stepped.send_modify(|n| *n += 1);
        }
    }

    async fn carry_out(&self, replica: ReplicaId, step: &Step) -> Result<(), String> {
        let url = self.driver.replica(replica).and_then(|r| r.url).ok_or("the replica stopped")?;
        let (path, body) = match step {
            Step::Load { adapter, artifact } => {
                let (weights, a, id) = (self.weights.clone(), adapter.clone(), *artifact);
                let dir = tokio::task::spawn_blocking(move || weights.adapter_dir(&a, id))
                    .await
                    .expect("making an adapter directory does not panic")
                    .map_err(|e| e.to_string())?;
                let body = serde_json::json!({"lora_name": adapter.name().as_str(), "lora_path": dir});
                ("/v1/load_lora_adapter", body)
            }
            Step::Unload { adapter } => {
                ("/v1/unload_lora_adapter", serde_json::json!({"lora_name": adapter.name().as_str()}))
            }
        };
        let answer = self.client.post(format!("{url}{path}")).json(&body).send().await;
        match answer.as_ref().is_ok_and(|r| r.status().is_success()) {
            true => Ok(()),
            false => Err(format!(
                "the engine of replica {replica} on node {} answered {path} with {}",
                self.node,
                hangar_agent::capabilities::describe(answer).await
            )),
        }
    }
}
