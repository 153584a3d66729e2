//! The live requests of a scheduler, kept in reusable slots.
//!
//! Schedulers queue small slot numbers rather than request ids: a slot is
//! an index, and freed slots are reused, so the table grows with the number
//! of live requests, not with the number ever seen.

use hangar_core::RequestId;
use rustc_hash::FxHashMap;

use crate::{AddError, EngineRequest};

/// A live request's place in a [`RequestTable`].
pub(crate) type Slot = u32;

#[derive(Debug)]
pub(crate) struct RequestTable<T> {
    slots: Vec<Option<T>>,
    free: Vec<Slot>,
    index: FxHashMap<RequestId, Slot>,
}

impl<T> Default for RequestTable<T> {
    fn default() -> Self {
        Self { slots: Vec::new(), free: Vec::new(), index: FxHashMap::default() }
    }
}

impl<T> RequestTable<T> {
    /// The checks every scheduler makes before taking `req`: its id is not
    /// live, its prompt is not empty (as in vLLM and SGLang, a model needs at
    /// least one token to condition on), its prompt was hashed with the
    /// engine's block size, and prompt plus output fit in `capacity` tokens.
    pub fn check(&self, req: &EngineRequest, block_size: u32, capacity: u64) -> Result<(), AddError> {
        if req.prompt.is_empty() {
            return Err(AddError::EmptyPrompt(req.id));
        }
        if self.index.contains_key(&req.id) {
            return Err(AddError::Duplicate(req.id));
        }
        if req.prompt.block_size() != block_size {
            return Err(AddError::BlockSize { prompt: req.prompt.block_size(), engine: block_size });
        }
        let total = u64::from(req.prompt.len()) + u64::from(req.max_output_tokens);
        if total > capacity {
            return Err(AddError::TooLong { tokens: total, capacity });
        }
        Ok(())
    }

    /// Stores a new request (its id not live) and returns its slot.
    pub fn insert(&mut self, id: RequestId, value: T) -> Slot {
        let slot = match self.free.pop() {
            Some(s) => {
                self.slots[s as usize] = Some(value);
                s
            }
            None => {
                self.slots.push(Some(value));
                (self.slots.len() - 1) as Slot
            }
        };
        self.index.insert(id, slot);
        slot
    }

    /// Forgets `id`, returning its slot; the request stays there until
    /// [`free`](Self::free).
    pub fn forget(&mut self, id: RequestId) -> Option<Slot> {
        self.index.remove(&id)
    }

    /// Takes the request out of `slot` and makes the slot reusable.
    pub fn free(&mut self, slot: Slot) -> T {
        self.free.push(slot);
        self.slots[slot as usize].take().expect("live slot")
    }

    pub fn get(&self, slot: Slot) -> &T {
        self.slots[slot as usize].as_ref().expect("live slot")
    }

    pub fn get_mut(&mut self, slot: Slot) -> &mut T {
        self.slots[slot as usize].as_mut().expect("live slot")
    }

    /// Every stored request, in slot order.
    #[cfg(test)]
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.slots.iter().flatten()
    }
}
