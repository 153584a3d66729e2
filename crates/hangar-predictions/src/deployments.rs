//! Deployments made through the API (`POST /v1/deployments`, Replicate's
//! `deployments.create / update / delete`): a name under the caller's
//! account bound to a model this server serves, carrying the model's
//! replica bounds (`min_instances`, `max_instances`).
//!
//! They live in the prediction store ([`DeploymentRecord`], SQLite or
//! Redis), so every gateway of a fleet serves them and a restart keeps
//! them. The bounds are desired state, applied level-triggered: the
//! service reads the store every [`RECONCILE_EVERY`] (and after each change
//! it makes) and hands each model's bounds to the [`Executor`] —
//! `hangar serve`'s controller — whether or not they changed, so a
//! restarted gateway or one that has just become a fleet's leader catches
//! up without anyone telling it. A model has at most one deployment of
//! its own through the API (a second is refused with 409); should two
//! gateways create one for the same model at the same instant, the one
//! created first decides its bounds. Deployments declared in the config
//! (`[[predictions.deployments]]`) carry no bounds and are not changed
//! through the API.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, RwLock};
use std::time::Duration;

use hangar_core::Millis;
use serde::{Deserialize, Serialize};

use crate::executor::Executor;
use crate::store::{PredictionQueue, StoreError};

/// How often the stored deployments are read again and their bounds
/// applied.
pub const RECONCILE_EVERY: Duration = Duration::from_secs(2);

/// A model's replica bounds as a deployment states them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceBounds {
    /// The fewest replicas (`min_replicas`).
    pub min_instances: u32,
    /// The most replicas (`max_replicas`), at least 1.
    pub max_instances: u32,
}

impl InstanceBounds {
    /// Why no model can run within them, if none can: at most at least
    /// one, at least no more than at most.
    pub fn check(self) -> Result<(), String> {
        match self {
            InstanceBounds { max_instances: 0, .. } => Err("max_instances must be at least 1".into()),
            InstanceBounds { min_instances, max_instances } if min_instances > max_instances => Err(format!(
                "min_instances ({min_instances}) must not exceed max_instances ({max_instances})"
            )),
            _ => Ok(()),
        }
    }
}

/// A deployment made through the API, as the store keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeploymentRecord {
    /// `owner/name`: the creating account, then the name it chose.
    pub name: String,
    /// The model it runs.
    pub model: String,
    /// The model's version when the release was made.
    pub version: String,
    /// The hardware SKU (the model's, `GET /v1/hardware`).
    pub hardware: String,
    /// Its replica bounds.
    #[serde(flatten)]
    pub bounds: InstanceBounds,
    /// The release number: 1 when created, one more with each update.
    pub release: u32,
    /// When it was created (ms since the Unix epoch).
    pub created_at: Millis,
    /// When its current release was made.
    pub released_at: Millis,
}

impl DeploymentRecord {
    /// The account that owns it (the `owner` of `owner/name`).
    pub fn owner(&self) -> &str {
        self.name.split_once('/').map_or("", |(owner, _)| owner)
    }
}

/// What this process knows of the stored deployments, and which models'
/// bounds it has set: read by the request path without touching the
/// store.
#[derive(Default)]
pub(crate) struct Book {
    records: RwLock<BTreeMap<String, DeploymentRecord>>,
    /// Models whose bounds were set from a deployment here: when theirs
    /// goes, their own bounds are applied again.
    overridden: Mutex<BTreeSet<String>>,
}

impl Book {
    /// The deployment `name`, as last read or written here.
    pub(crate) fn get(&self, name: &str) -> Option<DeploymentRecord> {
        self.records.read().unwrap_or_else(|e| e.into_inner()).get(name).cloned()
    }

    /// Every deployment, by name.
    pub(crate) fn all(&self) -> Vec<DeploymentRecord> {
        self.records.read().unwrap_or_else(|e| e.into_inner()).values().cloned().collect()
    }

    /// Takes what the store holds now.
    pub(crate) fn replace(&self, records: Vec<DeploymentRecord>) {
        let records = records.into_iter().map(|r| (r.name.clone(), r)).collect();
        *self.records.write().unwrap_or_else(|e| e.into_inner()) = records;
    }

    /// The deployment that decides `model`'s bounds: the earliest created
    /// of those running it.
    pub(crate) fn of_model(&self, model: &str) -> Option<DeploymentRecord> {
        let records = self.records.read().unwrap_or_else(|e| e.into_inner());
        records.values().filter(|r| r.model == model).min_by_key(|r| deciding(r)).cloned()
    }

    /// Each model's bounds as the deployments want them: `Some` for a
    /// model with a deployment (its [`of_model`](Self::of_model)'s), `None`
    /// (its own bounds) for one whose deployment went since its bounds
    /// were set here. One pass over the records.
    fn wanted(&self) -> BTreeMap<String, Option<InstanceBounds>> {
        let mut wanted: BTreeMap<String, Option<InstanceBounds>> = BTreeMap::new();
        for model in self.overridden.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            wanted.insert(model.clone(), None);
        }
        let mut deciders: BTreeMap<&str, &DeploymentRecord> = BTreeMap::new();
        let records = self.records.read().unwrap_or_else(|e| e.into_inner());
        for r in records.values() {
            let decider = deciders.entry(&r.model).or_insert(r);
            if deciding(r) < deciding(decider) {
                *decider = r;
            }
        }
        for (model, r) in deciders {
            wanted.insert(model.to_owned(), Some(r.bounds));
        }
        wanted
    }
}

/// The order in which a model's deployments decide its bounds: the
/// earliest created first, the name breaking ties.
fn deciding(r: &DeploymentRecord) -> (Millis, &str) {
    (r.created_at, &r.name)
}

/// Reads the stored deployments into `book` and applies every model's
/// bounds through `executor` (see the module's doc). A failed apply is
/// logged and tried again on the next pass.
///
/// # Cancel safety
/// Each apply is the executor's to finish whole; a pass dropped between
/// two leaves the rest to the next one.
pub(crate) async fn reconcile(
    store: &dyn PredictionQueue,
    book: &Book,
    executor: &dyn Executor,
) -> Result<(), StoreError> {
    book.replace(store.deployments()?);
    for (model, bounds) in book.wanted() {
        match executor.apply_bounds(&model, bounds).await {
            Ok(()) => {
                let mut overridden = book.overridden.lock().unwrap_or_else(|e| e.into_inner());
                match bounds {
                    Some(_) => overridden.insert(model),
                    None => overridden.remove(&model),
                };
            }
            Err(why) => tracing::debug!(%model, ?bounds, %why, "deployment bounds not applied here"),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(name: &str, model: &str, created_at: Millis, min: u32, max: u32) -> DeploymentRecord {
        DeploymentRecord {
            name: name.into(),
            model: model.into(),
            version: "v".into(),
            hardware: "gpu".into(),
            bounds: InstanceBounds { min_instances: min, max_instances: max },
            release: 1,
            created_at,
            released_at: created_at,
        }
    }

    #[test]
    fn bounds_no_model_runs_within_are_named() {
        assert!(InstanceBounds { min_instances: 0, max_instances: 1 }.check().is_ok());
        let e = InstanceBounds { min_instances: 0, max_instances: 0 }.check().unwrap_err();
        assert!(e.contains("max_instances"), "{e}");
        let e = InstanceBounds { min_instances: 3, max_instances: 2 }.check().unwrap_err();
        assert!(e.contains("min_instances (3)"), "{e}");
    }

    #[test]
    fn the_first_created_deployment_of_a_model_decides_and_a_removed_one_gives_its_bounds_back() {
        let book = Book::default();
        book.replace(vec![record("b/late", "m/x", 20, 2, 2), record("a/early", "m/x", 10, 1, 3)]);
        assert_eq!(book.of_model("m/x").unwrap().name, "a/early");
        let bounds = InstanceBounds { min_instances: 1, max_instances: 3 };
        assert_eq!(book.wanted(), BTreeMap::from([("m/x".to_owned(), Some(bounds))]));
        book.overridden.lock().unwrap().insert("m/x".into());
        book.replace(vec![]);
        assert_eq!(book.wanted(), BTreeMap::from([("m/x".to_owned(), None)]), "its own bounds again");
        assert_eq!(record("acme/prod", "m", 0, 0, 1).owner(), "acme");
    }
}
