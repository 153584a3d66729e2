//! LoRA adapters on `hangar serve`'s request path (docs/adapters.md): which
//! adapter a request may use, and the driver that loads adapters on
//! replicas' engines as the model's adapter slots decide.
//!
//! Adapters are artifacts of a weight store, registered under their base
//! model (`hangar store import-adapter`): the node's on a single machine,
//! any live node's on a fleet. The [`AdapterCatalog`] knows which are
//! registered, so the request path looks an adapter up in memory. A
//! request is refused before it queues when its model loads no adapters,
//! its engine cannot load them, the adapter is not registered under that
//! model (the error names the models it is registered under), or the
//! model's `adapter_access` rules do not let the account use it
//! ([`ModelRuntime::adapter`]).
//!
//! The slots (`hangar-router`'s `AdapterSlots`, inside the model's
//! chooser) decide every load and unload; the processor hands each step to
//! [`driver`], which carries it out: it has the adapter's directory made
//! on the replica's node ([`AdapterCatalog::directory`]: exported from the
//! store on a single machine, made by the node's agent on a fleet) and
//! posts vLLM's `/v1/load_lora_adapter` or `/v1/unload_lora_adapter` to the
//! replica's engine.

mod catalog;
pub(crate) mod engines;

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use hangar_core::{AccountId, Adapter, AdapterName, AdapterRef, ByteSize, ModelKey, ReplicaId};
use hangar_router::SlotStep;

pub use catalog::{AdapterCatalog, REFRESH_EVERY, STALE_AFTER};

use super::ModelRuntime;
use crate::processor::AdapterDriver;

/// The bandwidth an adapter load is estimated at before the model's engines
/// have loaded any (then their measured mean is used): a local disk's,
/// as `hangar sim`'s `cold_start.disk_gbps` (2 GB/s).
const DEFAULT_LOAD_BYTES_PER_MS: f64 = 2e6;

/// The fixed part of the estimate: an engine's own work per adapter,
/// `hangar sim`'s `cold_start.adapter_ms`.
const DEFAULT_LOAD_FIXED_MS: f64 = 300.0;

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

/// The driver that carries out `rt`'s adapter steps through `catalog`
/// ([`AdapterCatalog::load`], [`AdapterCatalog::unload`]): each adapter
/// held and released on the replica's engine, through the machine's own
/// [`engines::AdapterHolds`] or, on a fleet, the replica's agent. A hold
/// that fails fails the step, naming why.
pub(crate) fn driver(
    rt: Weak<ModelRuntime>,
    catalog: Arc<AdapterCatalog>,
    client: reqwest::Client,
) -> AdapterDriver {
    Arc::new(move |replica: ReplicaId, slots: u64, step: SlotStep| {
        let (rt, catalog, client) = (rt.clone(), catalog.clone(), client.clone());
        Box::pin(async move {
            let rt = rt.upgrade().ok_or("the server is stopping")?;
            let (_, node) =
                rt.replica_route(replica).ok_or_else(|| format!("replica {replica} is not ready"))?;
            let node = node.as_deref();
            let started = Instant::now();
            let (adapter, loaded, done) = match &step {
                SlotStep::Load { adapter, .. } => {
                    let entry = match catalog.find(adapter).await? {
                        Ok(entry) => entry,
                        Err(_) => return Err(format!("adapter `{adapter}` is no longer registered")),
                    };
                    (adapter, Some(entry.bytes), catalog.load(&entry, (replica, slots), node, &client).await)
                }
                SlotStep::Unload { adapter } => {
                    (adapter, None, catalog.unload(adapter, (replica, slots), node, &client).await)
                }
            };
            rt.metrics().adapter_step(loaded.is_some(), done.is_ok());
            done?;
            if let Some(bytes) = loaded {
                rt.adapter_loads.lock().expect("load times lock").measured(bytes, started.elapsed());
                tracing::info!(model = %rt.config.key, %replica, %adapter, ms = started.elapsed().as_millis() as u64, "adapter loaded");
            }
            Ok(())
        })
    })
}
