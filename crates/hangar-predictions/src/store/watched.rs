//! The store as the service uses it: every call's outcome fed to a
//! [`Reachability`], so the driver knows whether — and since when — the
//! store has answered without a break.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use hangar_core::Millis;
use tokio::sync::Notify;

use super::{Cursor, Delivery, EnqueueFuture, Page, PredictionQueue, Recovery, Rotation, StoreError};
use crate::deployments::DeploymentRecord;
use crate::procedures::Procedure;
use crate::reachability::Reachability;
use crate::record::{JobKind, Record};

/// A [`PredictionQueue`] that watches its store's answers (see
/// [`crate::reachability`]). Logs once when the store stops answering
/// and once when it answers again, and wakes [`Watched::returned`].
pub(crate) struct Watched {
    store: Arc<dyn PredictionQueue>,
    reach: Mutex<Reachability>,
    /// The clock `Reachability` is fed on.
    epoch: Instant,
    /// Notified (a stored permit) each time the store answers again.
    back: Notify,
}

impl Watched {
    /// Watches `store`; sweeping waits until it has answered for
    /// `lease_ms`.
    pub fn new(store: Arc<dyn PredictionQueue>, lease_ms: Millis) -> Self {
        Watched {
            store,
            reach: Mutex::new(Reachability::new(lease_ms)),
            epoch: Instant::now(),
            back: Notify::new(),
        }
    }

    fn reach(&self) -> std::sync::MutexGuard<'_, Reachability> {
        self.reach.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn now(&self) -> Millis {
        self.epoch.elapsed().as_millis() as Millis
    }

    /// Whether this process may sweep others' claims now: the store has
    /// answered every call for a lease.
    pub fn may_sweep(&self) -> bool {
        let now = self.now();
        self.reach().may_sweep(now)
    }

    /// Completes when the store has started answering again since the
    /// last call (at once if it has meanwhile): the moment to renew
    /// claims.
    ///
    /// # Cancel safety
    /// Cancel-safe: a return not awaited stays noted for the next call.
    pub async fn returned(&self) {
        self.back.notified().await;
    }

    /// Notes `result`, a call's outcome, and passes it on.
    fn note<T>(&self, result: Result<T, StoreError>) -> Result<T, StoreError> {
        let mut reach = self.reach.lock().unwrap_or_else(|e| e.into_inner());
        let now = self.now();
        match &result {
            Err(StoreError::Unavailable { store, cause }) => {
                if reach.handle_unreachable(now) {
                    tracing::warn!("the prediction store ({store}) is unreachable: {cause}; waiting for it");
                }
            }
            _ => {
                let down_since = reach.broken_at();
                if reach.handle_answer(now) {
                    let down = now.saturating_sub(down_since.unwrap_or(now));
                    tracing::info!(
                        "the prediction store answers again ({down} ms after the last failure): claims are \
                         renewed now, others' swept once it has answered for a lease"
                    );
                }
                if reach.poll_renew() {
                    self.back.notify_one();
                }
            }
        }
        result
    }
}

impl PredictionQueue for Watched {
    fn enqueue(&self, record: &Record) -> Result<i64, StoreError> {
        self.note(self.store.enqueue(record))
    }

    fn enqueue_async<'a>(&'a self, record: &'a Record) -> EnqueueFuture<'a> {
        Box::pin(async move {
            let result = self.store.enqueue_async(record).await;
            self.note(result)
        })
    }

    fn shared(&self) -> bool {
        self.store.shared()
    }

    fn recover(
        &self,
        now: Millis,
        idempotent: &dyn Fn(&str) -> bool,
        completed: &dyn Fn(&Record) -> Option<Delivery>,
    ) -> Result<Recovery, StoreError> {
        self.note(self.store.recover(now, idempotent, completed))
    }

    fn get(&self, id: &str) -> Result<Option<Record>, StoreError> {
        self.note(self.store.get(id))
    }

    fn list(
        &self,
        account: Option<&str>,
        kind: JobKind,
        cursor: Cursor,
        limit: usize,
    ) -> Result<Page, StoreError> {
        self.note(self.store.list(account, kind, cursor, limit))
    }

    fn claim(
        &self,
        queue: &str,
        owner: &str,
        now: Millis,
        lease_ms: Millis,
    ) -> Result<Option<Record>, StoreError> {
        self.note(self.store.claim(queue, owner, now, lease_ms))
    }

    fn heartbeat(&self, owner: &str, now: Millis, lease_ms: Millis) -> Result<usize, StoreError> {
        match self.store.heartbeat(owner, now, lease_ms) {
            // Not evidence of an answer: with no claims held, Redis is
            // not asked at all.
            Ok(n) => Ok(n),
            Err(e) => self.note(Err(e)),
        }
    }

    fn abandon(&self, owner: &str, id: &str) {
        self.store.abandon(owner, id)
    }

    fn start(&self, id: &str, now: Millis, deliveries: &[Delivery]) -> Result<bool, StoreError> {
        self.note(self.store.start(id, now, deliveries))
    }

    fn save_progress(&self, id: &str, output: &serde_json::Value, logs: &str) -> Result<(), StoreError> {
        self.note(self.store.save_progress(id, output, logs))
    }

    fn finish(&self, record: &Record, deliveries: &[Delivery]) -> Result<bool, StoreError> {
        self.note(self.store.finish(record, deliveries))
    }

    fn due_deliveries(&self, now: Millis, limit: usize) -> Result<Vec<Delivery>, StoreError> {
        self.note(self.store.due_deliveries(now, limit))
    }

    fn next_delivery_at(&self) -> Result<Option<Millis>, StoreError> {
        self.note(self.store.next_delivery_at())
    }

    fn delivery_attempted(
        &self,
        id: &str,
        delivered: bool,
        next_at: Option<Millis>,
    ) -> Result<(), StoreError> {
        self.note(self.store.delivery_attempted(id, delivered, next_at))
    }

    fn expired_waiting(&self, now: Millis, limit: usize) -> Result<Vec<Record>, StoreError> {
        self.note(self.store.expired_waiting(now, limit))
    }

    fn sweep_expired_claims(&self, now: Millis) -> Result<Vec<Record>, StoreError> {
        self.note(self.store.sweep_expired_claims(now))
    }

    fn requeue(&self, id: &str) -> Result<bool, StoreError> {
        self.note(self.store.requeue(id))
    }

    fn prune_queue(&self, before: Millis, now: Millis) -> Result<Vec<String>, StoreError> {
        self.note(self.store.prune_queue(before, now))
    }

    fn remove_data(&self, before: Millis) -> Result<usize, StoreError> {
        self.note(self.store.remove_data(before))
    }

    fn webhook_secrets(
        &self,
        account: &str,
        now: Millis,
        create: &dyn Fn() -> String,
    ) -> Result<Vec<String>, StoreError> {
        self.note(self.store.webhook_secrets(account, now, create))
    }

    fn rotate_webhook_secret(
        &self,
        account: &str,
        now: Millis,
        grace_ms: Millis,
        create: &dyn Fn() -> String,
    ) -> Result<Rotation, StoreError> {
        self.note(self.store.rotate_webhook_secret(account, now, grace_ms, create))
    }

    fn put_deployment(
        &self,
        deployment: &DeploymentRecord,
        expected: Option<u32>,
    ) -> Result<bool, StoreError> {
        self.note(self.store.put_deployment(deployment, expected))
    }

    fn delete_deployment(&self, name: &str) -> Result<bool, StoreError> {
        self.note(self.store.delete_deployment(name))
    }

    fn deployments(&self) -> Result<Vec<DeploymentRecord>, StoreError> {
        self.note(self.store.deployments())
    }

    fn create_procedure(&self, procedure: &Procedure) -> Result<bool, StoreError> {
        self.note(self.store.create_procedure(procedure))
    }

    fn delete_procedure(&self, key: &str) -> Result<bool, StoreError> {
        self.note(self.store.delete_procedure(key))
    }

    fn procedure(&self, key: &str) -> Result<Option<Procedure>, StoreError> {
        self.note(self.store.procedure(key))
    }

    fn procedures(&self) -> Result<Vec<Procedure>, StoreError> {
        self.note(self.store.procedures())
    }
}
