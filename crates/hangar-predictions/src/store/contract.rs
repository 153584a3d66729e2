//! The contract every [`PredictionQueue`] keeps, as functions each
//! backend's tests run on a fresh store of its own (`contract_tests!`).

use hangar_core::Millis;
use serde_json::json;

use super::{Cursor, Delivery, PredictionQueue, Rotation};
use crate::lifecycle::Status;
use crate::record::{JobKind, Record};
use crate::webhook_policy::Event;

/// A waiting prediction of `model` by `acme`, its lifetime ending a
/// second after `created_at`.
pub(crate) fn record(id: &str, model: &str, created_at: Millis) -> Record {
    let deadlines = crate::lifecycle::Deadlines { per_prediction: None, lifetime: Some(created_at + 1000) };
    Record::starting(id.into(), model, "v", "acme", json!({"prompt": "hi"}), created_at, deadlines)
}

/// A processing prediction put back by `requeue` waits again and can be
/// claimed again; a waiting one cannot be requeued.
pub(crate) fn requeued_records_are_claimed_again(q: &dyn PredictionQueue) {
    q.enqueue(&record("p", "a/x", 0)).unwrap();
    assert!(!q.requeue("p").unwrap(), "only a processing record is requeued");
    let queue = JobKind::Prediction.queue("a/x");
    q.claim(&queue, "w", 0, 10_000).unwrap().unwrap();
    assert!(q.start("p", 1, &[]).unwrap());
    assert!(q.requeue("p").unwrap());
    let again = q.get("p").unwrap().unwrap();
    assert_eq!((again.status, again.started_at), (Status::Starting, None));
    assert_eq!(q.claim(&queue, "w2", 2, 10_000).unwrap().unwrap().id, "p");
    assert!(q.claim(&queue, "w2", 2, 10_000).unwrap().is_none());
}

/// Enqueueing an id that exists changes nothing and answers its
/// sequence number: the record and its place in the queue are the first
/// create's, and it is claimed once.
pub(crate) fn an_id_is_enqueued_once(q: &dyn PredictionQueue) {
    let first = q.enqueue(&record("p", "a/x", 0)).unwrap();
    let mut again = record("p", "a/x", 5);
    again.input = json!({"prompt": "another"});
    assert_eq!(q.enqueue(&again).unwrap(), first);
    assert_eq!(q.get("p").unwrap().unwrap().input, json!({"prompt": "hi"}));
    let queue = JobKind::Prediction.queue("a/x");
    assert_eq!(q.claim(&queue, "w", 10, 100).unwrap().unwrap().id, "p");
    assert!(q.claim(&queue, "w", 10, 100).unwrap().is_none(), "queued once");
}

pub(crate) fn queue_is_ordered_per_model_and_claims_are_exclusive(q: &dyn PredictionQueue) {
    for (i, m) in ["a/x", "b/y", "a/x"].iter().enumerate() {
        q.enqueue(&record(&format!("p{i}"), m, i as Millis)).unwrap();
    }
    let queue = JobKind::Prediction.queue("a/x");
    assert_eq!(q.claim(&queue, "w1", 10, 100).unwrap().unwrap().id, "p0");
    assert_eq!(q.claim(&queue, "w2", 10, 100).unwrap().unwrap().id, "p2");
    assert!(q.claim(&queue, "w1", 10, 100).unwrap().is_none());
    assert_eq!(q.claim(&JobKind::Prediction.queue("b/y"), "w1", 10, 100).unwrap().unwrap().id, "p1");
}

pub(crate) fn exactly_one_terminal_state(q: &dyn PredictionQueue) {
    let mut r = record("p", "a/x", 0);
    q.enqueue(&r).unwrap();
    assert!(q.start("p", 5, &[]).unwrap());
    assert!(!q.start("p", 6, &[]).unwrap());
    r.status = Status::Succeeded;
    r.started_at = Some(5);
    r.completed_at = Some(9);
    r.output = Some(json!(["a"]));
    assert!(q.finish(&r, &[]).unwrap());
    r.status = Status::Canceled;
    assert!(!q.finish(&r, &[]).unwrap());
    let got = q.get("p").unwrap().unwrap();
    assert_eq!(got.status, Status::Succeeded);
    assert_eq!(got.output, Some(json!(["a"])));
    assert!(q.claim(&JobKind::Prediction.queue("a/x"), "w", 10, 10).unwrap().is_none());
}

pub(crate) fn pagination_both_ways(q: &dyn PredictionQueue) {
    for i in 0..25 {
        q.enqueue(&record(&format!("p{i:02}"), "a/x", i)).unwrap();
    }
    let p1 = q.list(Some("acme"), JobKind::Prediction, Cursor::Start, 10).unwrap();
    assert_eq!(p1.results[0].id, "p24");
    assert!(p1.more_after && !p1.more_before);
    let p2 = q.list(Some("acme"), JobKind::Prediction, Cursor::Before(p1.results[9].seq), 10).unwrap();
    assert_eq!(p2.results[0].id, "p14");
    assert!(p2.more_after && p2.more_before);
    let p3 = q.list(Some("acme"), JobKind::Prediction, Cursor::Before(p2.results[9].seq), 10).unwrap();
    assert_eq!(p3.results.len(), 5);
    assert!(!p3.more_after);
    let back = q.list(Some("acme"), JobKind::Prediction, Cursor::After(p2.results[0].seq), 10).unwrap();
    assert_eq!(
        back.results.iter().map(|r| r.id.clone()).collect::<Vec<_>>(),
        p1.results.iter().map(|r| r.id.clone()).collect::<Vec<_>>()
    );
    assert!(q.list(Some("other"), JobKind::Prediction, Cursor::Start, 10).unwrap().results.is_empty());
}

pub(crate) fn cordon_query_prune_and_retention(q: &dyn PredictionQueue) {
    q.enqueue(&record("old", "a/x", 0)).unwrap();
    let mut fresh = record("new", "a/x", 5000);
    fresh.lifetime_deadline = None;
    q.enqueue(&fresh).unwrap();
    assert_eq!(q.expired_waiting(999, 10).unwrap().len(), 0);
    assert_eq!(q.expired_waiting(1000, 10).unwrap()[0].id, "old");
    assert_eq!(q.prune_queue(1, 2).unwrap(), ["old"]);
    assert_eq!(q.get("old").unwrap().unwrap().status, Status::Failed);
    assert_eq!(q.remove_data(3).unwrap(), 1);
    let old = q.get("old").unwrap().unwrap();
    assert!(old.data_removed);
    assert_eq!(old.input, serde_json::Value::Null);
}

pub(crate) fn deliveries_are_retried_until_delivered(q: &dyn PredictionQueue) {
    let d = Delivery {
        id: "msg_1".into(),
        prediction: "p".into(),
        event: Event::Start,
        url: "http://x".into(),
        body: "{}".into(),
        attempts: 0,
        next_at: 10,
        account: "acme".into(),
    };
    q.enqueue(&record("p", "a/x", 0)).unwrap();
    assert!(q.start("p", 1, std::slice::from_ref(&d)).unwrap());
    assert!(!q.start("p", 2, std::slice::from_ref(&d)).unwrap());
    assert!(q.due_deliveries(9, 10).unwrap().is_empty());
    assert_eq!(q.due_deliveries(10, 10).unwrap(), vec![d.clone()]);
    q.delivery_attempted("msg_1", false, Some(20)).unwrap();
    assert_eq!(q.next_delivery_at().unwrap(), Some(20));
    assert_eq!(q.due_deliveries(20, 10).unwrap()[0].attempts, 1);
    q.delivery_attempted("msg_1", true, None).unwrap();
    assert!(q.due_deliveries(1000, 10).unwrap().is_empty());
}

pub(crate) fn a_rotated_secret_stays_valid_for_the_grace_period_only(q: &dyn PredictionQueue) {
    assert_eq!(q.webhook_secrets("a", 0, &|| "whsec_old".into()).unwrap(), ["whsec_old"]);
    let r = q.rotate_webhook_secret("a", 1000, 500, &|| "whsec_new".into()).unwrap();
    assert_eq!(r, Rotation { key: "whsec_new".into(), previous_valid_until: Some(1500) });
    let never = || -> String { panic!("no secret is created while one is current") };
    assert_eq!(q.webhook_secrets("a", 1000, &never).unwrap(), ["whsec_new", "whsec_old"]);
    assert_eq!(q.webhook_secrets("a", 1499, &never).unwrap(), ["whsec_new", "whsec_old"]);
    assert_eq!(q.webhook_secrets("a", 1500, &never).unwrap(), ["whsec_new"]);
    // Another account is untouched.
    assert_eq!(q.webhook_secrets("b", 1000, &|| "whsec_b".into()).unwrap(), ["whsec_b"]);
    // A rotation without a current secret retires nothing; a zero grace
    // period retires at once.
    let r = q.rotate_webhook_secret("c", 0, 500, &|| "whsec_c".into()).unwrap();
    assert_eq!(r.previous_valid_until, None);
    q.rotate_webhook_secret("c", 10, 0, &|| "whsec_c2".into()).unwrap();
    assert_eq!(q.webhook_secrets("c", 10, &never).unwrap(), ["whsec_c2"]);
}

/// One `#[test]` per contract function, each on a store from `$open`
/// (an expression giving a guard and the store, or `None` to skip).
/// A queued request waits in its model's prediction queue, in turn with
/// the model's predictions; it is read back as a request, and a listing
/// of predictions does not show it.
pub(crate) fn a_queued_request_waits_with_the_predictions_and_is_not_listed(q: &dyn PredictionQueue) {
    q.enqueue(&record("p0", "a/x", 0)).unwrap();
    let mut request = record("r1", "a/x", 1);
    request.kind = JobKind::Request;
    q.enqueue(&request).unwrap();
    let queue = JobKind::Request.queue("a/x");
    assert_eq!(queue, JobKind::Prediction.queue("a/x"), "one queue");
    assert_eq!(q.claim(&queue, "w", 10, 100).unwrap().unwrap().id, "p0");
    let claimed = q.claim(&queue, "w", 10, 100).unwrap().unwrap();
    assert_eq!((claimed.id.as_str(), claimed.kind), ("r1", JobKind::Request));
    assert_eq!(q.get("r1").unwrap().unwrap().kind, JobKind::Request);
    let listed = q.list(Some("acme"), JobKind::Prediction, Cursor::Start, 10).unwrap();
    assert_eq!(listed.results.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), ["p0"]);
}

/// A deployment is created once, updated only from the release it was
/// read at (a racing update loses), a repeated write reports success, and
/// a deleted one is gone.
pub(crate) fn deployments_are_compare_and_set_by_release(q: &dyn PredictionQueue) {
    use crate::deployments::{DeploymentRecord, InstanceBounds};
    let first = DeploymentRecord {
        name: "acme/prod".into(),
        model: "a/x".into(),
        version: "v1".into(),
        hardware: "gpu".into(),
        bounds: InstanceBounds { min_instances: 0, max_instances: 2 },
        release: 1,
        created_at: 10,
        released_at: 10,
    };
    assert!(q.put_deployment(&first, None).unwrap());
    assert!(q.put_deployment(&first, None).unwrap(), "the same write again (a lost reply) succeeds");
    let mut other = first.clone();
    other.model = "a/y".into();
    assert!(!q.put_deployment(&other, None).unwrap(), "the name is taken");
    let mut second = first.clone();
    (second.release, second.bounds.min_instances, second.released_at) = (2, 1, 20);
    assert!(q.put_deployment(&second, Some(1)).unwrap());
    let mut racing = first.clone();
    (racing.release, racing.bounds.max_instances) = (2, 5);
    assert!(!q.put_deployment(&racing, Some(1)).unwrap(), "an update from a stale release loses");
    assert_eq!(q.deployments().unwrap(), [second]);
    assert!(q.delete_deployment("acme/prod").unwrap());
    assert!(!q.delete_deployment("acme/prod").unwrap());
    assert!(q.deployments().unwrap().is_empty());
}

/// A procedure is created once (a second of its name is refused, the
/// same write again succeeds), read back by key and in the list, and a
/// deleted one is gone.
pub(crate) fn procedures_are_created_once(q: &dyn PredictionQueue) {
    use crate::procedures::Procedure;
    let p = Procedure {
        owner: "acme".into(),
        name: "pipe".into(),
        source_url: "https://example.com/p.tar.gz".into(),
        source_sha256: crate::version_id("archive"),
        ephemeral: true,
        created_at: 10,
    };
    assert!(q.create_procedure(&p).unwrap());
    assert!(q.create_procedure(&p).unwrap(), "the same write again (a lost reply) succeeds");
    let other = Procedure { source_url: "https://example.com/q.tar.gz".into(), ..p.clone() };
    assert!(!q.create_procedure(&other).unwrap(), "the name is taken");
    let second = Procedure { owner: "beta".into(), ..p.clone() };
    assert!(q.create_procedure(&second).unwrap());
    assert_eq!(q.procedure("acme/pipe").unwrap(), Some(p.clone()));
    assert_eq!(q.procedure("acme/none").unwrap(), None);
    assert_eq!(q.procedures().unwrap(), [p, second.clone()]);
    assert!(q.delete_procedure("acme/pipe").unwrap());
    assert!(!q.delete_procedure("acme/pipe").unwrap());
    assert_eq!(q.procedures().unwrap(), [second]);
}

macro_rules! contract_tests {
    ($open:expr) => {
        contract_tests!(@each $open;
            queue_is_ordered_per_model_and_claims_are_exclusive,
            an_id_is_enqueued_once,
            exactly_one_terminal_state,
            pagination_both_ways,
            cordon_query_prune_and_retention,
            deliveries_are_retried_until_delivered,
            a_rotated_secret_stays_valid_for_the_grace_period_only,
            requeued_records_are_claimed_again,
            a_queued_request_waits_with_the_predictions_and_is_not_listed,
            deployments_are_compare_and_set_by_release,
            procedures_are_created_once);
    };
    (@each $open:expr; $($name:ident),*) => {
        $(
            #[test]
            fn $name() {
                let Some((_guard, q)) = $open else { return };
                crate::store::contract::$name(&q);
            }
        )*
    };
}
pub(crate) use contract_tests;
