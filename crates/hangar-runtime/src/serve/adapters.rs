//! LoRA adapters on `hangar serve`'s request path (docs/adapters.md): which
//! adapter a request may use, and the driver that loads adapters on
//! replicas' engines as the model's adapter slots decide.
//!
//! Adapters are artifacts of the node's weight store, registered under
//! their base model (`hangar store import-adapter`). The [`AdapterCatalog`]
//! knows which are registered — read once, then again when a request names
//! one it does not know (at most every [`REFRESH_EVERY`]) or, behind a
//! request it answered from memory, once what it knows is older than
//! [`STALE_AFTER`] — so the request path looks an adapter up in memory. A request is refused before it
//! queues when its model loads no adapters, its engine cannot load them,
//! the adapter is not registered under that model (the error names the
//! models it is registered under), or the model's `adapter_access` rules
//! do not let the account use it ([`ModelRuntime::adapter`]).
//!
//! The slots (`hangar-router`'s `AdapterSlots`, inside the model's
//! chooser) decide every load and unload; the processor hands each step to
//! [`driver`], which carries it out: it exports the adapter from the store
//! as the directory an engine loads (once per node, kept under the store's
//! root) and posts vLLM's `/v1/load_lora_adapter` or
//! `/v1/unload_lora_adapter` to the replica's engine.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use hangar_core::{AccountId, Adapter, AdapterName, AdapterRef, ByteSize, ModelKey, ReplicaId};
use hangar_router::SlotStep;
use hangar_store::adapters::AdapterEntry;
use hangar_store::{ArtifactId, BlobStore};

use super::ModelRuntime;
use crate::processor::AdapterDriver;

/// The least time between two reads of the store's adapters on a request
/// for one the catalog does not know: a newly registered adapter is served
/// within about this long, and unknown names cannot make each request read
/// the store.
pub const REFRESH_EVERY: Duration = Duration::from_secs(1);

/// How old what the catalog knows may grow before a request that finds
/// its adapter in memory has the store read again behind it: an adapter
/// removed from the store stops being served within about this long
/// under traffic (a request for an unknown one reads at once).
pub const STALE_AFTER: Duration = Duration::from_secs(10);

/// The bandwidth an adapter load is estimated at before the model's engines
/// have loaded any (then their measured mean is used): a local disk's,
/// as `hangar sim`'s `cold_start.disk_gbps` (2 GB/s).
const DEFAULT_LOAD_BYTES_PER_MS: f64 = 2e6;

/// The fixed part of the estimate: an engine's own work per adapter,
/// `hangar sim`'s `cold_start.adapter_ms`.
const DEFAULT_LOAD_FIXED_MS: f64 = 300.0;

/// The adapters registered in the node's weight store.
pub struct AdapterCatalog {
    store: BlobStore,
    /// Where adapters are exported as directories engines load.
    exports: PathBuf,
    /// Which registered adapters some model of this server serves.
    serves: Box<dyn Fn(&AdapterRef) -> bool + Send + Sync>,
    known: Mutex<Known>,
    /// Exported directories by artifact (a name moved to new bytes is a
    /// new export), once written.
    exported: Mutex<HashMap<ArtifactId, Arc<tokio::sync::OnceCell<PathBuf>>>>,
    /// The background exporter runs.
    exporting: AtomicBool,
    /// A read behind a request runs.
    reading: AtomicBool,
}

#[derive(Default)]
struct Known {
    by_ref: HashMap<AdapterRef, AdapterEntry>,
    /// The bases each adapter name is registered under.
    bases: HashMap<AdapterName, Vec<ModelKey>>,
    read_at: Option<Instant>,
}

/// Why a request's adapter is refused; `status` and the message say it to
/// the client, naming adapter and model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AdapterRefusal {
    /// The model loads no adapters (400).
    #[error("the model `{model}` serves no LoRA adapters (it has no `[models.adapters]`), so it cannot run adapter `{adapter}`")]
    NotServed {
        /// The model.
        model: ModelKey,
        /// The adapter asked for.
        adapter: AdapterName,
    },
    /// Its engine cannot load adapters at run time (400).
    #[error(
        "the engine of model `{model}` cannot load LoRA adapters (it has no `/v1/load_lora_adapter`; vLLM \
         serves it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), so it cannot run adapter `{adapter}`"
    )]
    NoLora {
        /// The model.
        model: ModelKey,
        /// The adapter asked for.
        adapter: AdapterName,
    },
    /// Registered under other models only (400).
    #[error("adapter `{adapter}` is an adapter of {}, not of `{model}`: its weights fit those models' layers only", list(.bases))]
    OtherBase {
        /// The model asked for.
        model: ModelKey,
        /// The adapter asked for.
        adapter: AdapterName,
        /// The models it is registered under.
        bases: Vec<ModelKey>,
    },
    /// Not registered, or not one the account may use (404: the two are
    /// not told apart, as for models).
    #[error("the model `{model}` has no adapter `{adapter}` that your account may use")]
    Unknown {
        /// The model.
        model: ModelKey,
        /// The adapter asked for.
        adapter: AdapterName,
    },
    /// The store could not be read (503).
    #[error("the weight store's adapters could not be read: {0}")]
    Store(String),
}

impl AdapterRefusal {
    /// The HTTP status it is answered with.
    pub fn status(&self) -> u16 {
        match self {
            AdapterRefusal::Unknown { .. } => 404,
            AdapterRefusal::Store(_) => 503,
            _ => 400,
        }
    }
}

fn list(bases: &[ModelKey]) -> String {
    bases.iter().map(|b| format!("`{b}`")).collect::<Vec<_>>().join(", ")
}

impl AdapterCatalog {
    /// The catalog of the store at `store`'s root, exporting adapters under
    /// `<root>/adapter-dirs`; `serves` says which registered adapters some
    /// model of this server serves (those are exported ahead of need).
    pub fn new(store: BlobStore, serves: impl Fn(&AdapterRef) -> bool + Send + Sync + 'static) -> Self {
        let exports = store.root().join("adapter-dirs");
        AdapterCatalog {
            store,
            exports,
            serves: Box::new(serves),
            known: Mutex::new(Known::default()),
            exported: Mutex::new(HashMap::new()),
            exporting: AtomicBool::new(false),
            reading: AtomicBool::new(false),
        }
    }

    /// The registered adapter `adapter`, reading the store again if it is
    /// not known and the last read is older than [`REFRESH_EVERY`]; else
    /// the bases its name is registered under (maybe none).
    ///
    /// # Cancel safety
    /// A read of the store runs to its end on a blocking thread; dropping
    /// the future only loses its answer.
    pub async fn find(
        self: &Arc<Self>,
        adapter: &AdapterRef,
    ) -> Result<Result<AdapterEntry, Vec<ModelKey>>, String> {
        if let (Some(found), stale) = self.lookup(adapter, false) {
            if stale && !self.reading.swap(true, Ordering::AcqRel) {
                // Answered from memory at once; the store is read behind it,
                // so an adapter removed there is forgotten soon.
                let me = self.clone();
                tokio::spawn(async move {
                    if let Err(e) = me.read().await {
                        tracing::warn!("reading the weight store's adapters: {e}");
                    }
                    me.reading.store(false, Ordering::Release);
                });
            }
            return Ok(found);
        }
        self.read().await?;
        Ok(self.lookup(adapter, true).0.expect("answered after a read"))
    }

    /// Reads the store's adapters into memory (removing the exported copies
    /// of those no longer registered), then exports those a model serves
    /// that are not exported yet, in the background (one at a time), so a
    /// request for one pays only its engine's load.
    ///
    /// # Cancel safety
    /// As [`find`](Self::find); the exports go on whatever the caller does.
    pub async fn read(self: &Arc<Self>) -> Result<(), String> {
        let me = self.clone();
        let read = tokio::task::spawn_blocking(move || {
            let entries = hangar_store::adapters::list(&me.store, None).map_err(|e| e.to_string())?;
            // Copies of adapters no longer registered go (an engine that
            // loaded one keeps it); pruning is housekeeping, never fatal.
            match hangar_store::adapters::prune_exports(&me.exports, entries.iter().map(|e| &e.id)) {
                Ok(removed) if !removed.is_empty() => {
                    tracing::info!(
                        removed = removed.len(),
                        "removed exports of adapters no longer registered"
                    )
                }
                Ok(_) => {}
                Err(e) => tracing::warn!("pruning adapter exports: {e}"),
            }
            Ok::<_, String>(entries)
        });
        let entries = read.await.expect("listing adapters does not panic")?;
        {
            let mut known = self.known.lock().expect("adapter catalog lock");
            known.by_ref.clear();
            known.bases.clear();
            for e in entries {
                known.bases.entry(e.adapter.name().clone()).or_default().push(e.adapter.base().clone());
                known.by_ref.insert(e.adapter.clone(), e);
            }
            known.read_at = Some(Instant::now());
        }
        self.export_served();
        Ok(())
    }

    /// Starts the background exporter unless it runs: it exports every
    /// served adapter not exported yet, looking again after each, and ends
    /// when none is left (an export that fails is tried again on demand).
    fn export_served(self: &Arc<Self>) {
        if self.exporting.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            let mut failed = std::collections::HashSet::new();
            loop {
                let next = {
                    let exported = me.exported.lock().expect("adapter exports lock");
                    let known = me.known.lock().expect("adapter catalog lock");
                    let done = |e: &AdapterEntry| exported.get(&e.id).is_some_and(|c| c.initialized());
                    known
                        .by_ref
                        .values()
                        .filter(|e| e.on_disk && !done(e) && !failed.contains(&e.id))
                        .find(|e| (me.serves)(&e.adapter))
                        .cloned()
                };
                let Some(entry) = next else { break };
                if let Err(why) = me.directory(&entry).await {
                    tracing::warn!(adapter = %entry.adapter, "exporting the adapter ahead of need failed: {why}");
                    failed.insert(entry.id);
                }
            }
            me.exporting.store(false, Ordering::Release);
        });
    }

    /// The answer from memory (`None` when the store should be read
    /// first), and whether what is known was read longer than
    /// [`STALE_AFTER`] ago: one look under the lock, on the path of every
    /// adapter request.
    fn lookup(
        &self,
        adapter: &AdapterRef,
        read_now: bool,
    ) -> (Option<Result<AdapterEntry, Vec<ModelKey>>>, bool) {
        let known = self.known.lock().expect("adapter catalog lock");
        let age = known.read_at.map(|at| at.elapsed());
        let stale = age.is_none_or(|age| age > STALE_AFTER);
        if let Some(e) = known.by_ref.get(adapter) {
            return (Some(Ok(e.clone())), stale);
        }
        let fresh = age.is_some_and(|age| age < REFRESH_EVERY);
        let found =
            (read_now || fresh).then(|| Err(known.bases.get(adapter.name()).cloned().unwrap_or_default()));
        (found, stale)
    }

    /// The directory engines load `entry` from, exported from the store the
    /// first time it is asked for (by a request, or ahead of need).
    ///
    /// # Cancel safety
    /// The export runs to its end on a blocking thread (it writes into a
    /// temporary directory and renames it into place, so a half export is
    /// never seen); dropping the future only loses its answer.
    pub async fn directory(self: &Arc<Self>, entry: &AdapterEntry) -> Result<PathBuf, String> {
        // One cell per artifact: an export waits for another only when it
        // is the same one, never behind unrelated exports.
        let cell = self.exported.lock().expect("adapter exports lock").entry(entry.id).or_default().clone();
        let dir = cell
            .get_or_try_init(|| async {
                let (me, e) = (self.clone(), entry.clone());
                tokio::task::spawn_blocking(move || {
                    hangar_store::adapters::export_dir(&me.store, &e, &me.exports).map_err(|e| e.to_string())
                })
                .await
                .expect("exporting an adapter does not panic")
            })
            .await?;
        Ok(dir.clone())
    }
}

/// What a model's engines' adapter loads took: the driver's estimate of
/// the next, which the `adapter` router weighs.
#[derive(Debug, Default)]
pub(crate) struct LoadTimes {
    /// Loads measured, their bytes and their ms.
    loads: u64,
    bytes: f64,
    ms: f64,
}

impl LoadTimes {
    /// About how long loading `bytes` takes, ms: the fixed part plus the
    /// bytes at the measured mean bandwidth, once a load was measured.
    pub(crate) fn estimate(&self, bytes: u64) -> f64 {
        if self.loads == 0 || self.bytes <= 0.0 {
            return DEFAULT_LOAD_FIXED_MS + bytes as f64 / DEFAULT_LOAD_BYTES_PER_MS;
        }
        // Measured loads fold the engine's fixed work into their bandwidth:
        // the mean time per byte, scaled.
        self.ms / self.bytes * bytes as f64
    }

    fn measured(&mut self, bytes: u64, took: Duration) {
        self.loads += 1;
        self.bytes += bytes as f64;
        self.ms += took.as_secs_f64() * 1000.0;
    }
}

impl ModelRuntime {
    /// The adapter `name` of this model for `account`, with its size and
    /// the estimate of loading it (ms), or why it may not run here.
    ///
    /// # Cancel safety
    /// As [`AdapterCatalog::find`].
    pub async fn adapter(
        &self,
        catalog: Option<&Arc<AdapterCatalog>>,
        name: AdapterName,
        account: &AccountId,
    ) -> Result<(Adapter, f64), AdapterRefusal> {
        let model = self.config.key.clone();
        let (Some(_), Some(catalog)) = (&self.config.adapters, catalog) else {
            return Err(AdapterRefusal::NotServed { model, adapter: name });
        };
        if self.lora_refused() {
            return Err(AdapterRefusal::NoLora { model, adapter: name });
        }
        let id = AdapterRef::new(model.clone(), name);
        let entry = match catalog.find(&id).await.map_err(AdapterRefusal::Store)? {
            Ok(entry) => entry,
            Err(bases) if !bases.is_empty() => {
                return Err(AdapterRefusal::OtherBase { model, adapter: id.name().clone(), bases })
            }
            Err(_) => return Err(AdapterRefusal::Unknown { model, adapter: id.name().clone() }),
        };
        if self.config.adapter_allowed(id.name().as_str(), account) != Some(true) {
            return Err(AdapterRefusal::Unknown { model, adapter: id.name().clone() });
        }
        let estimate = self.adapter_loads.lock().expect("load times lock").estimate(entry.bytes);
        Ok((Adapter::sized(id, ByteSize::new(entry.bytes)), estimate))
    }
}

/// The driver that carries out `rt`'s adapter steps: a load exports the
/// adapter from `catalog` (once) and posts vLLM's `/v1/load_lora_adapter`
/// to the replica's engine with the adapter's name as its `lora_name`; an
/// unload posts `/v1/unload_lora_adapter`. Each answer that is not a
/// success fails the step with the engine's status and message.
pub(crate) fn driver(
    rt: Weak<ModelRuntime>,
    catalog: Arc<AdapterCatalog>,
    client: reqwest::Client,
) -> AdapterDriver {
    Arc::new(move |replica: ReplicaId, step: SlotStep| {
        let (rt, catalog, client) = (rt.clone(), catalog.clone(), client.clone());
        Box::pin(async move {
            let rt = rt.upgrade().ok_or("the server is stopping")?;
            let base = rt.replica_url(replica).ok_or_else(|| format!("replica {replica} is not ready"))?;
            let started = Instant::now();
            let (path, body, loaded) = match &step {
                SlotStep::Load { adapter, .. } => {
                    let entry = match catalog.find(adapter).await? {
                        Ok(entry) => entry,
                        Err(_) => {
                            return Err(format!("adapter `{adapter}` is no longer in the weight store"))
                        }
                    };
                    let dir = catalog.directory(&entry).await?;
                    let body = serde_json::json!({"lora_name": adapter.name().as_str(), "lora_path": dir});
                    ("/v1/load_lora_adapter", body, Some(entry.bytes))
                }
                SlotStep::Unload { adapter } => (
                    "/v1/unload_lora_adapter",
                    serde_json::json!({"lora_name": adapter.name().as_str()}),
                    None,
                ),
            };
            let answer = client.post(format!("{base}{path}")).json(&body).send().await;
            let ok = answer.as_ref().is_ok_and(|r| r.status().is_success());
            rt.metrics().adapter_step(loaded.is_some(), ok);
            if !ok {
                return Err(format!(
                    "its engine answered {path} with {}",
                    hangar_agent::capabilities::describe(answer).await
                ));
            }
            if let Some(bytes) = loaded {
                rt.adapter_loads.lock().expect("load times lock").measured(bytes, started.elapsed());
                tracing::info!(model = %rt.config.key, %replica, adapter = %body["lora_name"], ms = started.elapsed().as_millis() as u64, "adapter loaded");
            }
            Ok(())
        })
    })
}
