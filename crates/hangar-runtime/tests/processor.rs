//! The live processor: permits released on drop, 429 when the line is full,
//! 504 past the deadline, disconnects leave the line, fair interleaving.

use std::time::Duration;

use hangar_core::{AccountId, ReplicaId};
use hangar_queue::{AdmissionConfig, FirstFree, QueueAlgorithm};
use hangar_runtime::processor::{AdmitError, Patience, Processor, Wait};

fn acct(s: &str) -> AccountId {
    s.parse().unwrap()
}

fn processor(algorithm: QueueAlgorithm, capacity: usize, permits: u32) -> Processor {
    let p = Processor::new(AdmissionConfig { algorithm, capacity }, Box::new(FirstFree));
    p.replica_ready(ReplicaId::from_u128(1), permits);
    p
}

#[tokio::test]
async fn a_dropped_lease_lets_the_next_request_in() {
    let p = processor(QueueAlgorithm::Fifo, 10, 1);
    let first = p.admit(acct("a"), None).await.unwrap();
    let p2 = p.clone();
    let waiting = tokio::spawn(async move { p2.admit(acct("a"), None).await.map(|l| l.request) });
    while p.load().waiting == 0 {
        tokio::task::yield_now().await;
    }
    drop(first);
    let second = waiting.await.unwrap().unwrap();
    assert_eq!(second.0, 1);
    assert_eq!(p.load().waiting, 0);
}

#[tokio::test]
async fn a_full_line_is_refused_and_a_late_wait_times_out() {
    let p = processor(QueueAlgorithm::Fifo, 1, 1);
    let _held = p.admit(acct("a"), None).await.unwrap();
    let p2 = p.clone();
    let timed = tokio::spawn(async move { p2.admit(acct("a"), Some(Duration::from_millis(30))).await });
    while p.load().waiting == 0 {
        tokio::task::yield_now().await;
    }
    let refused = p.admit(acct("b"), None).await.unwrap_err();
    assert_eq!(refused, AdmitError::QueueFull { capacity: 1 });
    assert_eq!(timed.await.unwrap().unwrap_err(), AdmitError::Timeout);
    assert_eq!(p.load().waiting, 0);
}

#[tokio::test]
async fn a_caller_that_stops_waiting_leaves_the_line() {
    let p = processor(QueueAlgorithm::Fifo, 5, 1);
    let held = p.admit(acct("a"), None).await.unwrap();
    let p2 = p.clone();
    let waiter = tokio::spawn(async move { p2.admit(acct("a"), None).await.map(|_| ()) });
    while p.load().waiting == 0 {
        tokio::task::yield_now().await;
    }
    waiter.abort();
    let _ = waiter.await;
    assert_eq!(p.load().waiting, 0, "the aborted request left the line");
    drop(held);
    // The permit is free for the next caller at once.
    let again = tokio::time::timeout(Duration::from_secs(5), p.admit(acct("a"), None)).await;
    assert!(again.unwrap().is_ok());
}

#[tokio::test]
async fn fair_lines_take_turns_and_failures_reach_waiters() {
    let p = processor(QueueAlgorithm::Fair, 10, 1);
    let mut lease = Some(p.admit(acct("busy"), None).await.unwrap());
    let mut handles = Vec::new();
    for (i, who) in ["busy", "busy", "busy", "quiet", "quiet"].into_iter().enumerate() {
        let p2 = p.clone();
        handles.push(tokio::spawn(async move {
            let l = p2.admit(acct(who), None).await.unwrap();
            (who, l)
        }));
        while p.load().waiting < i + 1 {
            tokio::task::yield_now().await;
        }
    }
    let mut order = Vec::new();
    let mut pending: Vec<_> = handles.into_iter().collect();
    while !pending.is_empty() {
        drop(lease.take());
        let (done, _, rest) = futures_select(pending).await;
        order.push(done.0);
        lease = Some(done.1);
        pending = rest;
    }
    assert_eq!(order, vec!["busy", "quiet", "busy", "quiet", "busy"]);
    drop(lease);
    let p3 = p.clone();
    let _hold = p.admit(acct("x"), None).await.unwrap();
    let failing = tokio::spawn(async move { p3.admit(acct("x"), None).await.map(|_| ()) });
    while p.load().waiting == 0 {
        tokio::task::yield_now().await;
    }
    p.fail_waiting("no replica could start");
    assert_eq!(failing.await.unwrap(), Err(AdmitError::Failed("no replica could start".into())));
}

/// A model that cannot run: a synchronous request waiting is answered
/// `Unavailable` when the controller says so, and a new one at once; a
/// patient one waits on and gets the first replica that becomes ready.
#[tokio::test]
async fn an_unavailable_model_answers_sync_requests_at_once_and_keeps_async_ones() {
    let p = Processor::new(
        AdmissionConfig { algorithm: QueueAlgorithm::Fifo, capacity: 10 },
        Box::new(FirstFree),
    );
    let (p1, p2) = (p.clone(), p.clone());
    let sync =
        tokio::spawn(async move { p1.admit(acct("a"), Some(Duration::from_secs(600))).await.map(drop) });
    let patient = tokio::spawn(async move {
        p2.admit_with(acct("a"), Wait { patience: Patience::Patient, ..Wait::default() })
            .await
            .map(|l| l.replica)
    });
    while p.load().waiting < 2 {
        tokio::task::yield_now().await;
    }
    let reason = "no replica of `t/m` can run now: no room";
    p.set_unavailable(Some(reason.into()));
    assert_eq!(sync.await.unwrap(), Err(AdmitError::Unavailable { reason: reason.into() }));
    let again = p.admit(acct("b"), Some(Duration::from_secs(600))).await.unwrap_err();
    assert_eq!(again, AdmitError::Unavailable { reason: reason.into() }, "a newcomer is told at once");
    assert_eq!(p.load().waiting, 1, "the prediction waits on");
    p.replica_ready(ReplicaId::from_u128(7), 1);
    assert_eq!(patient.await.unwrap(), Ok(ReplicaId::from_u128(7)));
}

type Admitted = (&'static str, hangar_runtime::processor::Lease);

/// Waits for whichever handle finishes first.
async fn futures_select(
    mut handles: Vec<tokio::task::JoinHandle<Admitted>>,
) -> (Admitted, usize, Vec<tokio::task::JoinHandle<Admitted>>) {
    loop {
        if let Some(i) = handles.iter().position(|h| h.is_finished()) {
            let h = handles.remove(i);
            return (h.await.unwrap(), i, handles);
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test]
async fn each_replicas_instance_monitor_counts_the_permits_held_on_it() {
    use hangar_core::instance::InstanceState;
    use hangar_core::ReplicaPhase;

    let p = Processor::new(
        AdmissionConfig { algorithm: QueueAlgorithm::Fifo, capacity: 10 },
        Box::new(FirstFree),
    );
    let r = ReplicaId::from_u128(1);
    let state = |p: &Processor| p.instance(r).map(|i| (i.state, i.in_flight));
    assert_eq!(state(&p), None, "no monitor for a replica this process was never told of");
    p.replica_phase(r, ReplicaPhase::Starting);
    assert_eq!(state(&p), Some((InstanceState::Boot, 0)));
    p.replica_ready(r, 2);
    p.replica_phase(r, ReplicaPhase::Ready);
    assert_eq!(state(&p), Some((InstanceState::Idle, 0)));

    // Leased at once.
    let a = p.admit(acct("a"), None).await.unwrap();
    let b = p.admit(acct("a"), None).await.unwrap();
    assert_eq!(state(&p), Some((InstanceState::Active, 2)));
    // One waits and is dispatched when `a` goes: still two in flight.
    let p2 = p.clone();
    let waiting = tokio::spawn(async move { p2.admit(acct("a"), None).await.unwrap() });
    while p.load().waiting == 0 {
        tokio::task::yield_now().await;
    }
    // Another waits and leaves the line: it never held a permit.
    let p3 = p.clone();
    let leaver = tokio::spawn(async move { p3.admit(acct("b"), None).await.map(|_| ()) });
    while p.load().waiting < 2 {
        tokio::task::yield_now().await;
    }
    leaver.abort();
    let _ = leaver.await;
    drop(a);
    let c = waiting.await.unwrap();
    assert_eq!(state(&p), Some((InstanceState::Active, 2)));

    // A replica gone from the line still has its requests finishing.
    p.replica_gone(r);
    p.replica_phase(r, ReplicaPhase::Draining);
    assert_eq!(state(&p), Some((InstanceState::Active, 2)));
    drop(b);
    drop(c);
    assert_eq!(state(&p), Some((InstanceState::Idle, 0)));
    p.replica_phase(r, ReplicaPhase::Sleeping);
    assert_eq!(state(&p), Some((InstanceState::Off, 0)));
    p.forget(r);
    assert_eq!(state(&p), None);
}

/// A request that follows its position is told it when it joins the line
/// and again each time it moves, and its lease keeps where it joined; a
/// request leased at once is told nothing.
#[tokio::test(start_paused = true)]
async fn a_waiting_request_is_told_its_position_as_the_line_moves() {
    use std::num::NonZeroU32;
    use std::sync::{Arc, Mutex};

    let p = processor(QueueAlgorithm::Fifo, 10, 1);
    let told: Arc<Mutex<Vec<u32>>> = Arc::default();
    let tell_into = |told: &Arc<Mutex<Vec<u32>>>| {
        let told = told.clone();
        move |position: NonZeroU32| told.lock().unwrap().push(position.get())
    };
    let at_once = tell_into(&told);
    let first =
        p.admit_with(acct("a"), Wait { on_position: Some(&at_once), ..Wait::default() }).await.unwrap();
    assert_eq!(first.queued_at, None);
    assert!(told.lock().unwrap().is_empty(), "a request leased at once has no position");
    let ahead: Vec<_> = (0..2)
        .map(|_| {
            let p = p.clone();
            tokio::spawn(async move { p.admit(acct("a"), None).await.unwrap() })
        })
        .collect();
    while p.load().waiting < 2 {
        tokio::task::yield_now().await;
    }
    let (p3, told3) = (p.clone(), told.clone());
    let third = tokio::spawn(async move {
        let tell = tell_into(&told3);
        p3.admit_with(acct("a"), Wait { on_position: Some(&tell), ..Wait::default() })
            .await
            .map(|l| l.queued_at)
    });
    while p.load().waiting < 3 {
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(*told.lock().unwrap(), [3], "told its place at once");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(*told.lock().unwrap(), [3], "not told again while it has not moved");
    let mut ahead = ahead.into_iter();
    drop(first);
    let second = ahead.next().unwrap().await.unwrap();
    assert_eq!(second.queued_at, NonZeroU32::new(1));
    tokio::time::sleep(hangar_runtime::processor::POSITION_EVERY).await;
    assert_eq!(*told.lock().unwrap(), [3, 2], "told once it moved");
    drop(second);
    drop(ahead.next().unwrap().await.unwrap());
    assert_eq!(third.await.unwrap().unwrap(), NonZeroU32::new(3), "its lease keeps where it joined");
}
