//! The engines' adapters on the node this process runs engines on — a
//! single machine's, or a fleet node's agent's (docs/adapters.md): each
//! engine's [`EngineAdapters`] decides, from the *holds* of the adapter
//! slots that use it, what it loads and unloads, and [`AdapterHolds`]
//! carries that out.
//!
//! The engine's own adapters are the truth: an engine that sleeps and
//! wakes keeps the adapters it loaded (vLLM and the mock engine alike),
//! while the slots of a replica that went away start empty when it comes
//! back; a hold of an adapter the engine has is answered at once, with no
//! load the engine would refuse as "already loaded". An engine started
//! anew (another process under the replica) starts with none.
//!
//! A load makes the adapter's directory on the node (`dirs`: exported from
//! the machine's store, or on a fleet's node made through its store daemon,
//! fetched from a peer when the node lacks it), then posts vLLM's
//! `/v1/load_lora_adapter` to the engine; an unload posts
//! `/v1/unload_lora_adapter`. On a fleet the holders are the gateways: the
//! holds of gateways no longer alive go ([`AdapterHolds::keep_level`]),
//! and the engines of replicas that no longer run here are forgotten.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use hangar_agent::engine_adapters::{AdapterView, EngineAdapters, Hold, Holders, State, Step};
use hangar_agent::lifecycle::DriverHandle;
use hangar_core::{AdapterName, AdapterRef, ReplicaId, ReplicaPhase};
use hangar_store::ArtifactId;
use tokio::sync::watch;

/// Makes the directory an engine on the node loads an adapter (the
/// artifact) from, or says why not. Blocking.
pub(crate) type AdapterDirs = Box<dyn Fn(&AdapterRef, ArtifactId) -> Result<PathBuf, String> + Send + Sync>;

/// Why a hold was not answered with the adapter loaded; each says so to
/// the holder, with its HTTP status on a fleet.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum HoldError {
    /// The replica does not serve here (404).
    #[error("replica {replica} does not serve on {place}")]
    NotServing {
        /// The replica.
        replica: ReplicaId,
        /// This node, in words.
        place: String,
    },
    /// The engine has the name as another artifact (409).
    #[error(
        "replica {replica} has adapter {adapter} loaded as artifact {loaded}, not {wanted}; it loads {wanted} \
         once the holders of {loaded} release it"
    )]
    Conflict {
        /// The replica.
        replica: ReplicaId,
        /// The adapter.
        adapter: AdapterRef,
        /// The artifact the engine has.
        loaded: ArtifactId,
        /// The artifact asked for.
        wanted: ArtifactId,
    },
    /// The load failed (502): why.
    #[error("{0}")]
    Failed(String),
    /// The hold ended before the load did: the replica stopped, or the
    /// holder released it or held from newer slots (409).
    #[error("the hold of adapter {adapter} on replica {replica} ended before it loaded (the replica stopped, or its holder released it or holds from newer slots)")]
    Ended {
        /// The replica.
        replica: ReplicaId,
        /// The adapter.
        adapter: AdapterRef,
    },
}

impl HoldError {
    /// The HTTP status an agent answers it with.
    pub(crate) fn status(&self) -> u16 {
        match self {
            HoldError::NotServing { .. } => 404,
            HoldError::Conflict { .. } | HoldError::Ended { .. } => 409,
            HoldError::Failed(_) => 502,
        }
    }
}

/// The adapters of every engine on the node.
pub(crate) struct AdapterHolds {
    /// This node, in words ("node n0", "this machine").
    place: String,
    /// The node's lifecycle driver, once it runs.
    driver: OnceLock<DriverHandle>,
    dirs: AdapterDirs,
    client: reqwest::Client,
    engines: Mutex<HashMap<ReplicaId, Engine>>,
    /// Which gateways' holds stand (a fleet's node).
    gateways: Mutex<Holders>,
    /// Bumped after every step: waiting holds look again.
    stepped: watch::Sender<u64>,
}

struct Engine {
    adapters: EngineAdapters,
    /// The engine process its adapters are of: another one under the
    /// replica (a restart) has none.
    pid: Option<u32>,
    /// A task carries out its steps.
    driving: bool,
}

impl AdapterHolds {
    pub(crate) fn new(place: String, dirs: AdapterDirs, client: reqwest::Client) -> Self {
        AdapterHolds {
            place,
            driver: OnceLock::new(),
            dirs,
            client,
            engines: Mutex::default(),
            gateways: Mutex::default(),
            stepped: watch::channel(0).0,
        }
    }

    /// The node's lifecycle driver, from which it learns each replica's
    /// engine; until then nothing serves.
    pub(crate) fn attach(&self, driver: DriverHandle) {
        let _ = self.driver.set(driver);
    }

    /// `holder`'s slots of generation `slots` hold `adapter` (as
    /// `artifact`) on `replica`'s engine; answered once the engine has it.
    ///
    /// # Cancel safety
    /// A holder that goes away while the load runs leaves its hold (a hold
    /// is idempotent: its slots' next load of the adapter finds it) until
    /// it releases the adapter or, on a fleet, is no longer alive; the
    /// load goes on in the engine's own task.
    pub(crate) async fn hold(
        self: &Arc<Self>,
        replica: ReplicaId,
        holder: &str,
        slots: u64,
        adapter: &AdapterRef,
        artifact: ArtifactId,
    ) -> Result<(), Box<HoldError>> {
        let pid = self.serving(replica)?;
        self.gateways.lock().expect("gateways lock").heard(holder);
        let mut stepped = self.stepped.subscribe();
        let held = {
            let mut engines = self.engines.lock().expect("engines lock");
            let engine = engines.entry(replica).or_insert_with(|| Engine {
                adapters: EngineAdapters::new(),
                pid,
                driving: false,
            });
            if engine.pid != pid {
                // Another engine process: it has loaded nothing. A step of
                // the last one still in flight ends on a machine not
                // waiting for it, which ignores it.
                *engine = Engine { adapters: EngineAdapters::new(), pid, driving: engine.driving };
            }
            engine.adapters.hold(holder, slots, adapter, artifact)
        };
        match held {
            Hold::Ready => return Ok(()),
            Hold::Conflict { loaded } => {
                return Err(Box::new(HoldError::Conflict {
                    replica,
                    adapter: adapter.clone(),
                    loaded,
                    wanted: artifact,
                }))
            }
            Hold::Stale => return Err(Box::new(HoldError::Ended { replica, adapter: adapter.clone() })),
            Hold::Waiting => self.drive(replica),
        }
        loop {
            let state = {
                let engines = self.engines.lock().expect("engines lock");
                engines.get(&replica).map(|e| e.adapters.state(holder, adapter.name()))
            };
            match state {
                Some(State::Ready) => return Ok(()),
                Some(State::NotHeld(Some(why))) => return Err(Box::new(HoldError::Failed(why))),
                Some(State::NotHeld(None)) | None => {
                    return Err(Box::new(HoldError::Ended { replica, adapter: adapter.clone() }))
                }
                Some(State::Waiting) => {}
            }
            // The sender lives as long as `self`, which this borrows.
            let _ = stepped.changed().await;
        }
    }

    /// `holder`'s slots of generation `slots` let `adapter` go on
    /// `replica`'s engine, which unloads it once nobody holds it.
    pub(crate) fn release(
        self: &Arc<Self>,
        replica: ReplicaId,
        holder: &str,
        slots: u64,
        adapter: &AdapterName,
    ) {
        if let Some(engine) = self.engines.lock().expect("engines lock").get_mut(&replica) {
            engine.adapters.release(holder, slots, adapter);
        }
        self.drive(replica);
    }

    /// Each engine's adapters and who holds them, by replica.
    pub(crate) fn view(&self) -> BTreeMap<ReplicaId, Vec<AdapterView>> {
        let engines = self.engines.lock().expect("engines lock");
        engines.iter().map(|(id, e)| (*id, e.adapters.view())).collect()
    }

    /// The engine process of `replica` if it serves here.
    fn serving(&self, replica: ReplicaId) -> Result<Option<u32>, Box<HoldError>> {
        match self.driver.get().and_then(|d| d.replica(replica)) {
            Some(r) if r.phase == ReplicaPhase::Ready && r.url.is_some() => Ok(r.pid),
            _ => Err(Box::new(HoldError::NotServing { replica, place: self.place.clone() })),
        }
    }

    /// Every second: the engines of replicas no longer running here are
    /// forgotten, and, given the gateways in Redis's index now (`alive`, a
    /// fleet's node whose read answered), the holds of gateways no longer
    /// alive go ([`Holders`]).
    pub(crate) fn keep_level(self: &Arc<Self>, alive: Option<BTreeSet<String>>) {
        let keep = alive.map(|alive| self.gateways.lock().expect("gateways lock").read(&alive));
        let running: BTreeSet<ReplicaId> = match self.driver.get() {
            Some(driver) => driver.replicas().iter().map(|r| r.view.replica).collect(),
            None => return,
        };
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
            // Only an engine that serves is stepped: a draining one may still
            // run requests with what it has; the next hold or second's
            // `keep_level` drives it again.
            let serving = self.serving(replica).is_ok();
            let step = {
                let mut engines = self.engines.lock().expect("engines lock");
                let Some(engine) = engines.get_mut(&replica) else { return };
                match serving.then(|| engine.adapters.poll_step()).flatten() {
                    Some(step) => step,
                    None => {
                        engine.driving = false;
                        return;
                    }
                }
            };
            let outcome = self.carry_out(replica, &step).await;
            if let Err(why) = &outcome {
                tracing::warn!(place = %self.place, %replica, ?step, "adapter step failed: {why}");
            }
            if let Some(engine) = self.engines.lock().expect("engines lock").get_mut(&replica) {
                engine.adapters.step_done(outcome);
            }
            self.stepped.send_modify(|n| *n += 1);
        }
    }

    async fn carry_out(self: &Arc<Self>, replica: ReplicaId, step: &Step) -> Result<(), String> {
        let engine = self.driver.get().and_then(|d| d.replica(replica)).and_then(|r| r.url);
        let url = engine.ok_or("the replica stopped")?;
        let (path, body) = match step {
            Step::Load { adapter, artifact } => {
                let (me, a, id) = (self.clone(), adapter.clone(), *artifact);
                let dir = tokio::task::spawn_blocking(move || (me.dirs)(&a, id))
                    .await
                    .expect("making an adapter directory does not panic")?;
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
                "the engine of replica {replica} on {} answered {path} with {}",
                self.place,
                hangar_agent::capabilities::describe(answer).await
            )),
        }
    }
}

/// A single machine's [`AdapterHolds::keep_level`], every second until the
/// server is gone: the engines of replicas that stopped are forgotten.
pub(crate) async fn keep_level_every_second(holds: std::sync::Weak<AdapterHolds>) {
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        let Some(holds) = holds.upgrade() else { return };
        holds.keep_level(None);
    }
}
