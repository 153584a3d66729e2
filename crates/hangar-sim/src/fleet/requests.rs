//! The requests a fleet simulation has in flight, from arrival to end.
//!
//! Ids count the served rows from 0 in arrival order, and only the window
//! from the oldest request still in flight to the newest is kept: memory
//! follows what is in flight, not the length of the trace, so an hour at
//! thousands of requests a second fits in a few megabytes. The window holds
//! four bytes a request — where its record is — and the records sit in a
//! slab as long as the most requests in flight at once: one request
//! waiting out a 30 s timeout at 20,000 arrivals a second spans 600,000
//! ids, of which most have ended.

use std::collections::VecDeque;

use hangar_core::RequestId;
use slab::Slab;

use super::Timing;

/// A served request while it is in the fleet: what its engine needs and
/// when things happened to it.
#[derive(Debug)]
pub(crate) struct InFlight {
    /// Its model's index in the fleet.
    pub model: usize,
    pub input_len: u32,
    pub output_len: u32,
    pub hash_ids: Vec<u64>,
    /// It runs with an adapter: granted a permit, it waits for the
    /// adapter's `Ready` before its engine gets it.
    pub adapter: bool,
    /// The replica it was granted, while it waits for its adapter.
    pub waiting_on: Option<hangar_core::ReplicaId>,
    pub timing: Timing,
}

/// Requests in flight by id.
#[derive(Debug, Default)]
pub(crate) struct Requests {
    /// The id of `window[0]`.
    base: u64,
    /// Where each request from `base` on has its record in `slab`;
    /// [`ENDED`]: nowhere, it ended.
    window: VecDeque<u32>,
    /// The records of the requests in flight; an ended one's slot is
    /// taken again by the next.
    slab: Slab<InFlight>,
}

/// A window entry of a request that ended.
const ENDED: u32 = u32::MAX;

impl Requests {
    /// Adds the next request; its id follows the last one's.
    pub fn insert(&mut self, request: InFlight) -> RequestId {
        let slot = self.slab.insert(request);
        self.window.push_back(u32::try_from(slot).expect("fewer than 2^32 requests in flight"));
        RequestId(self.base + self.window.len() as u64 - 1)
    }

    /// Where request `id` is in the window, and its slot unless it ended.
    fn find(&self, id: RequestId) -> Option<(usize, usize)> {
        let k = usize::try_from(id.0.checked_sub(self.base)?).ok()?;
        let slot = *self.window.get(k)?;
        (slot != ENDED).then_some((k, slot as usize))
    }

    /// The request `id`, unless it ended.
    pub fn get(&self, id: RequestId) -> Option<&InFlight> {
        self.slab.get(self.find(id)?.1)
    }

    pub fn get_mut(&mut self, id: RequestId) -> Option<&mut InFlight> {
        let (_, slot) = self.find(id)?;
        self.slab.get_mut(slot)
    }

    /// Takes request `id` out as it ends; `None` if it already had.
    pub fn remove(&mut self, id: RequestId) -> Option<InFlight> {
        let (k, slot) = self.find(id)?;
        let request = self.slab.try_remove(slot)?;
        self.window[k] = ENDED;
        while self.window.front() == Some(&ENDED) {
            self.window.pop_front();
            self.base += 1;
        }
        Some(request)
    }

    /// Requests in flight.
    pub fn open(&self) -> usize {
        self.slab.len()
    }

    /// The ids of the requests in flight, oldest first.
    pub fn open_ids(&self) -> Vec<RequestId> {
        (self.window.iter().enumerate())
            .filter(|(_, &slot)| slot != ENDED)
            .map(|(k, _)| RequestId(self.base + k as u64))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> InFlight {
        InFlight {
            model: 0,
            input_len: 1,
            output_len: 1,
            hash_ids: Vec::new(),
            adapter: false,
            waiting_on: None,
            timing: Timing::default(),
        }
    }

    #[test]
    fn ids_follow_arrivals_and_the_window_shrinks_from_its_oldest_end() {
        let mut live = Requests::default();
        let ids: Vec<RequestId> = (0..4).map(|_| live.insert(request())).collect();
        assert_eq!(ids, (0..4).map(RequestId).collect::<Vec<_>>());
        assert!(live.remove(ids[1]).is_some());
        assert!(live.remove(ids[1]).is_none(), "a request ends once");
        assert_eq!(
            (live.open(), live.window.len()),
            (3, 4),
            "an ended request behind the oldest stays a hole"
        );
        assert!(live.remove(ids[0]).is_some());
        assert_eq!((live.base, live.window.len()), (2, 2));
        assert!(live.get(ids[0]).is_none() && live.get(ids[2]).is_some());
        assert_eq!(live.open_ids(), vec![ids[2], ids[3]]);
        assert_eq!(live.insert(request()), RequestId(4));
        assert!(live.get(RequestId(99)).is_none());
        assert!(live.window.back().is_some_and(|&slot| slot < 2), "an ended request's slot is taken again");
        assert_eq!(live.get(RequestId(4)).map(|r| r.input_len), Some(1));
    }
}
