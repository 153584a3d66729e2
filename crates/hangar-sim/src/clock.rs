//! What a simulation's event heap holds: a time, the order it was
//! scheduled in, and what happens.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// One scheduled event of kind `K` at `at` (ms on the logical clock).
///
/// The heap is a max-heap, so the order is reversed: the earliest event
/// pops first; of two at the same time the lower `rank`, then the one
/// scheduled first — which keeps every run reproducible.
#[derive(Debug)]
pub(crate) struct Event<K> {
    pub at: f64,
    /// Orders events of one instant before their scheduling order does.
    pub rank: u8,
    pub seq: u64,
    pub kind: K,
}

impl<K> PartialEq for Event<K> {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl<K> Eq for Event<K> {}
impl<K> PartialOrd for Event<K> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<K> Ord for Event<K> {
    fn cmp(&self, other: &Self) -> Ordering {
        other.at.total_cmp(&self.at).then(other.rank.cmp(&self.rank)).then(other.seq.cmp(&self.seq))
    }
}

/// When the next thing happens: the earlier of the heap's first event and
/// the next arrival, kept apart because arrivals come in time order.
pub(crate) fn next_time<K>(heap: &BinaryHeap<Event<K>>, arrival: Option<f64>) -> Option<f64> {
    let heap = heap.peek().map(|e| e.at);
    match (heap, arrival) {
        (Some(h), Some(a)) => Some(h.min(a)),
        (h, a) => h.or(a),
    }
}
