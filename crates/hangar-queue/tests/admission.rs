//! Admission scenarios and property tests against a model of who holds
//! what.

use std::collections::{HashMap, HashSet};

use hangar_core::{AccountId, Millis, ReplicaId, RequestId};
use hangar_queue::{
    Action, Admission, AdmissionConfig, Chooser, FirstFree, FreeReplica, Patience, QueueAlgorithm, Submitted,
};
use proptest::prelude::*;

fn acct(name: &str) -> AccountId {
    name.parse().unwrap()
}

fn rep(n: u128) -> ReplicaId {
    ReplicaId::from_u128(n)
}

fn admission(algorithm: QueueAlgorithm, capacity: usize) -> Admission {
    Admission::new(AdmissionConfig { algorithm, capacity })
}

fn dispatched(a: &mut Admission) -> Vec<u64> {
    std::iter::from_fn(|| a.poll_action())
        .filter_map(|x| match x {
            Action::Dispatch(p) => Some(p.request.0),
            _ => None,
        })
        .collect()
}

#[test]
fn fifo_serves_in_arrival_order_and_rejects_when_full() {
    let mut a = admission(QueueAlgorithm::Fifo, 3);
    a.replica_ready(0, rep(1), 1, &mut FirstFree);
    assert!(matches!(a.submit(0, RequestId(0), acct("a"), None, &mut FirstFree), Ok(Submitted::Leased(_))));
    for i in 1..=3 {
        assert_eq!(
            a.submit(0, RequestId(i), acct(if i % 2 == 0 { "a" } else { "b" }), None, &mut FirstFree),
            Ok(Submitted::Queued)
        );
    }
    assert_eq!(
        a.submit(0, RequestId(9), acct("c"), None, &mut FirstFree),
        Ok(Submitted::Rejected { capacity: 3 })
    );
    let mut order = Vec::new();
    for i in 0..3 {
        a.release(1, RequestId(i), &mut FirstFree);
        order.extend(dispatched(&mut a));
        a.check_invariants();
    }
    assert_eq!(order, vec![1, 2, 3]);
}

/// Serves the whole line one permit at a time, returning dispatch order.
fn drain_one_by_one(a: &mut Admission, holder: u64) -> Vec<u64> {
    let mut order = Vec::new();
    let mut current = holder;
    while a.waiting() > 0 {
        a.release(1, RequestId(current), &mut FirstFree);
        let next = dispatched(a);
        current = next[0];
        order.extend(next);
    }
    order
}

#[test]
fn switching_the_algorithm_keeps_every_waiter_in_arrival_order() {
    let mut a = admission(QueueAlgorithm::Fifo, 10);
    a.replica_ready(0, rep(1), 1, &mut FirstFree);
    a.submit(0, RequestId(0), acct("a"), None, &mut FirstFree).unwrap();
    for (i, who) in [(1, "a"), (2, "a"), (3, "a"), (4, "b"), (5, "b")] {
        assert_eq!(a.submit(0, RequestId(i), acct(who), Some(100), &mut FirstFree), Ok(Submitted::Queued));
    }
    a.reconfigure(0, AdmissionConfig { algorithm: QueueAlgorithm::Fair, capacity: 10 });
    a.check_invariants();
    assert_eq!(a.waiting(), 5);
    assert_eq!(drain_one_by_one(&mut a, 0), vec![1, 4, 2, 5, 3]);

    let mut a = admission(QueueAlgorithm::Fair, 10);
    a.replica_ready(0, rep(1), 1, &mut FirstFree);
    a.submit(0, RequestId(0), acct("a"), None, &mut FirstFree).unwrap();
    for (i, who) in [(1, "a"), (2, "a"), (3, "b")] {
        a.submit(0, RequestId(i), acct(who), None, &mut FirstFree).unwrap();
    }
    // A lowered capacity rejects newcomers but keeps those already waiting.
    a.reconfigure(0, AdmissionConfig { algorithm: QueueAlgorithm::Fifo, capacity: 1 });
    assert_eq!(
        a.submit(0, RequestId(9), acct("c"), None, &mut FirstFree),
        Ok(Submitted::Rejected { capacity: 1 })
    );
    assert_eq!(drain_one_by_one(&mut a, 0), vec![1, 2, 3]);
}

#[test]
fn fair_queuing_interleaves_accounts_and_bounds_each() {
    let mut a = admission(QueueAlgorithm::Fair, 3);
    a.replica_ready(0, rep(1), 1, &mut FirstFree);
    a.submit(0, RequestId(0), acct("busy"), None, &mut FirstFree).unwrap();
    for i in 1..=3 {
        assert_eq!(a.submit(0, RequestId(i), acct("busy"), None, &mut FirstFree), Ok(Submitted::Queued));
    }
    assert!(matches!(
        a.submit(0, RequestId(4), acct("busy"), None, &mut FirstFree),
        Ok(Submitted::Rejected { .. })
    ));
    for i in 10..=11 {
        assert_eq!(
            a.submit(0, RequestId(i), acct("quiet"), None, &mut FirstFree),
            Ok(Submitted::Queued),
            "own bound"
        );
    }
    let mut order = vec![0];
    while let Some(&last) = order.last() {
        a.release(1, RequestId(last), &mut FirstFree);
        match dispatched(&mut a).as_slice() {
            [next] => order.push(*next),
            [] => break,
            more => panic!("one permit, several dispatches: {more:?}"),
        }
    }
    assert_eq!(order, vec![0, 1, 10, 2, 11, 3], "accounts take turns");
}

#[test]
fn deadlines_expire_waiters_and_cancel_removes_them() {
    let mut a = admission(QueueAlgorithm::Fifo, 10);
    a.replica_ready(0, rep(1), 1, &mut FirstFree);
    a.submit(0, RequestId(0), acct("a"), None, &mut FirstFree).unwrap();
    a.submit(0, RequestId(1), acct("a"), Some(100), &mut FirstFree).unwrap();
    a.submit(0, RequestId(2), acct("a"), Some(50), &mut FirstFree).unwrap();
    a.submit(0, RequestId(3), acct("a"), None, &mut FirstFree).unwrap();
    assert_eq!(a.poll_timeout(), Some(50));
    a.handle_timeout(49);
    assert_eq!(a.poll_action(), None, "early timeouts do nothing");
    a.handle_timeout(60);
    assert_eq!(a.poll_action(), Some(Action::Expired(RequestId(2))));
    assert!(a.release(60, RequestId(1), &mut FirstFree), "a client that leaves is removed from the line");
    assert_eq!(a.poll_timeout(), None);
    a.release(70, RequestId(0), &mut FirstFree);
    assert_eq!(dispatched(&mut a), vec![3]);
    a.check_invariants();
}

#[test]
fn replicas_coming_and_going() {
    let mut a = admission(QueueAlgorithm::Fifo, 10);
    // Cold start: requests wait for the first replica.
    for i in 0..3 {
        assert_eq!(a.submit(0, RequestId(i), acct("a"), None, &mut FirstFree), Ok(Submitted::Queued));
    }
    a.replica_ready(5, rep(1), 2, &mut FirstFree);
    assert_eq!(dispatched(&mut a), vec![0, 1]);
    a.replica_ready(6, rep(2), 1, &mut FirstFree);
    assert_eq!(dispatched(&mut a), vec![2]);
    assert_eq!(a.replica_gone(7, rep(1)), vec![RequestId(0), RequestId(1)], "their permits died with it");
    a.check_invariants();
    a.replica_unhealthy(8, rep(2));
    a.release(8, RequestId(2), &mut FirstFree);
    assert_eq!(
        a.submit(9, RequestId(5), acct("a"), None, &mut FirstFree),
        Ok(Submitted::Queued),
        "no healthy replica"
    );
    a.fail_waiting(10, "no replica could start");
    assert!(matches!(a.poll_action(), Some(Action::Failed { request: RequestId(5), .. })));
    a.check_invariants();
    assert!(a.submit(11, RequestId(6), acct("a"), None, &mut FirstFree).is_ok());
    assert!(a.submit(11, RequestId(6), acct("a"), None, &mut FirstFree).is_err(), "duplicates are refused");
}

/// A model that cannot run turns its fail-fast waiters away at once, and
/// every fail-fast newcomer that finds no permit, while patient ones wait
/// on — until a replica is ready, which dispatches them.
#[test]
fn an_unavailable_model_turns_fail_fast_requests_away_and_keeps_patient_ones() {
    let mut a = admission(QueueAlgorithm::Fifo, 10);
    let patient = |a: &mut Admission, id| {
        a.submit_as(0, RequestId(id), acct("a"), Some(1_000), Patience::Patient, &mut FirstFree).unwrap()
    };
    assert_eq!(patient(&mut a, 0), Submitted::Queued);
    assert_eq!(a.submit(0, RequestId(1), acct("a"), Some(1_000), &mut FirstFree), Ok(Submitted::Queued));
    assert_eq!(patient(&mut a, 2), Submitted::Queued);
    assert_eq!(a.submit(0, RequestId(3), acct("b"), None, &mut FirstFree), Ok(Submitted::Queued));
    a.set_unavailable(5, Some("no room on any node".into()));
    let actions: Vec<Action> = std::iter::from_fn(|| a.poll_action()).collect();
    let away = |r| Action::Unavailable { request: RequestId(r), reason: "no room on any node".into() };
    assert_eq!(actions, [away(1), away(3)], "fail-fast waiters, in arrival order");
    assert_eq!((a.waiting(), a.unavailable()), (2, Some("no room on any node")));
    a.check_invariants();
    assert_eq!(a.submit(6, RequestId(4), acct("a"), None, &mut FirstFree), Ok(Submitted::Unavailable));
    let later = a.submit_as(6, RequestId(5), acct("a"), Some(5_000), Patience::Patient, &mut FirstFree);
    assert_eq!(later, Ok(Submitted::Queued));
    a.handle_timeout(1_000);
    assert_eq!(
        std::iter::from_fn(|| a.poll_action()).collect::<Vec<_>>(),
        [Action::Expired(RequestId(0)), Action::Expired(RequestId(2))],
        "patient ones end at their own deadline"
    );
    a.replica_ready(1_001, rep(1), 1, &mut FirstFree);
    assert_eq!(a.unavailable(), None, "a ready replica: the model runs again");
    assert_eq!(dispatched(&mut a), vec![5]);
    assert_eq!(a.submit(1_002, RequestId(6), acct("a"), None, &mut FirstFree), Ok(Submitted::Queued));
    a.check_invariants();
}

/// Chooses the free replica with the most permits left, to exercise the
/// chooser hook.
struct Spread;

impl Chooser for Spread {
    fn choose(&mut self, _: Millis, _: RequestId, free: &[FreeReplica]) -> ReplicaId {
        free.iter().max_by_key(|r| r.limit - r.in_use).unwrap().id
    }
}

#[derive(Debug, Clone)]
enum Op {
    Submit(u8, Option<u8>, bool),
    Release(u8),
    Ready(u8, u8),
    Gone(u8),
    Unhealthy(u8),
    Tick(u8),
    Switch(bool, u8),
    Unavailable(bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, proptest::option::of(0u8..50), any::<bool>()).prop_map(|(a, d, p)| Op::Submit(a, d, p)),
        3 => any::<u8>().prop_map(Op::Release),
        1 => (0u8..3, 0u8..4).prop_map(|(r, l)| Op::Ready(r, l)),
        1 => (0u8..3).prop_map(Op::Gone),
        1 => (0u8..3).prop_map(Op::Unhealthy),
        1 => (1u8..30).prop_map(Op::Tick),
        1 => (any::<bool>(), 0u8..6).prop_map(|(f, c)| Op::Switch(f, c)),
        1 => any::<bool>().prop_map(Op::Unavailable),
    ]
}

proptest! {
    /// Random traffic of both patiences, replica churn, time, queue
    /// switches and the model turning unavailable and back: the
    /// invariants hold after every call, every submitted request ends
    /// exactly once, only fail-fast requests are ever turned away — never
    /// while a permit is free — and none waits while the model is
    /// unavailable.
    #[test]
    fn every_request_ends_exactly_once(
        fair in any::<bool>(),
        capacity in 0usize..6,
        ops in proptest::collection::vec(op(), 1..150),
    ) {
        let algorithm = if fair { QueueAlgorithm::Fair } else { QueueAlgorithm::Fifo };
        let mut a = admission(algorithm, capacity);
        let mut now = 0u64;
        let mut next = 0u64;
        let mut holding: HashSet<u64> = HashSet::new();
        let mut waiting: HashSet<u64> = HashSet::new();
        let mut ended: HashSet<u64> = HashSet::new();
        let mut dispatch_order: HashMap<String, Vec<u64>> = HashMap::new();
        let accounts = ["a", "b", "c"];
        let mut account_of: HashMap<u64, &str> = HashMap::new();
        let mut patient: HashSet<u64> = HashSet::new();
        let mut unavailable = false;
        for op in ops {
            match op {
                Op::Submit(acc, deadline, is_patient) => {
                    let id = next;
                    next += 1;
                    account_of.insert(id, accounts[acc as usize]);
                    if is_patient {
                        patient.insert(id);
                    }
                    let patience = if is_patient { Patience::Patient } else { Patience::FailFast };
                    let d = deadline.map(|d| now + u64::from(d));
                    let free = a.in_use() < a.total_permits() && a.waiting() == 0;
                    match a.submit_as(now, RequestId(id), acct(accounts[acc as usize]), d, patience, &mut Spread).unwrap() {
                        Submitted::Leased(p) => { prop_assert_eq!(p.request, RequestId(id)); holding.insert(id); }
                        Submitted::Queued => {
                            prop_assert!(is_patient || !unavailable, "a fail-fast request queued while unavailable");
                            waiting.insert(id);
                        }
                        Submitted::Rejected { .. } => { ended.insert(id); }
                        Submitted::Unavailable => {
                            prop_assert!(!is_patient && unavailable, "turned away: fail-fast, while unavailable");
                            prop_assert!(!free, "turned away while a permit was free");
                            ended.insert(id);
                        }
                    }
                }
                Op::Unavailable(yes) => {
                    unavailable = yes;
                    a.set_unavailable(now, yes.then(|| "no room".to_owned()));
                }
                Op::Release(i) => {
                    let all: Vec<u64> = {
                        let mut v: Vec<u64> = holding.iter().chain(waiting.iter()).copied().collect();
                        v.sort_unstable();
                        v
                    };
                    if !all.is_empty() {
                        let id = all[i as usize % all.len()];
                        prop_assert!(a.release(now, RequestId(id), &mut FirstFree));
                        holding.remove(&id);
                        waiting.remove(&id);
                        ended.insert(id);
                    }
                }
                Op::Ready(r, limit) => {
                    a.replica_ready(now, rep(u128::from(r)), u32::from(limit), &mut FirstFree);
                    unavailable = false;
                }
                Op::Gone(r) => {
                    for id in a.replica_gone(now, rep(u128::from(r))) {
                        prop_assert!(holding.remove(&id.0), "only holders lose permits");
                        ended.insert(id.0);
                    }
                }
                Op::Unhealthy(r) => a.replica_unhealthy(now, rep(u128::from(r))),
                Op::Switch(fair, capacity) => {
                    let algorithm = if fair { QueueAlgorithm::Fair } else { QueueAlgorithm::Fifo };
                    let before = a.waiting();
                    a.reconfigure(now, AdmissionConfig { algorithm, capacity: usize::from(capacity) });
                    prop_assert_eq!(a.waiting(), before, "switching loses no waiter");
                }
                Op::Tick(dt) => {
                    now += u64::from(dt);
                    if a.poll_timeout().is_some_and(|t| t <= now) {
                        a.handle_timeout(now);
                    }
                }
            }
            while let Some(action) = a.poll_action() {
                match action {
                    Action::Dispatch(p) => {
                        prop_assert!(waiting.remove(&p.request.0), "only waiters are dispatched");
                        holding.insert(p.request.0);
                        dispatch_order.entry(account_of[&p.request.0].to_owned()).or_default().push(p.request.0);
                    }
                    Action::Expired(r) | Action::Failed { request: r, .. } => {
                        prop_assert!(waiting.remove(&r.0), "only waiters expire");
                        ended.insert(r.0);
                    }
                    Action::Unavailable { request: r, .. } => {
                        prop_assert!(!patient.contains(&r.0), "a patient request turned away");
                        prop_assert!(waiting.remove(&r.0), "only waiters are turned away");
                        ended.insert(r.0);
                    }
                }
            }
            prop_assert_eq!(a.unavailable().is_some(), unavailable);
            a.check_invariants();
            prop_assert_eq!(a.waiting(), waiting.len());
            prop_assert_eq!(a.in_use() as usize, holding.len());
            for id in &holding {
                prop_assert!(a.holder(RequestId(*id)).is_some(), "a holder names its replica");
            }
            for id in waiting.iter().chain(&ended) {
                prop_assert_eq!(a.holder(RequestId(*id)), None, "only holders hold");
            }
            prop_assert!(holding.is_disjoint(&ended) && waiting.is_disjoint(&ended));
        }
        // Within each account, dispatches keep arrival order.
        for order in dispatch_order.values() {
            prop_assert!(order.windows(2).all(|w| w[0] < w[1]), "{:?}", order);
        }
    }
}
