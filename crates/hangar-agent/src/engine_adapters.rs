//! Which LoRA adapters one engine of a fleet's node holds, and for which
//! gateways: a sans-IO machine, no clock, no I/O (docs/adapters.md, "On a
//! fleet").
//!
//! Every gateway of a fleet runs its own adapter slots per replica (the
//! router's `AdapterSlots`) and so asks for loads and unloads on an engine
//! that other gateways use too. Posted straight to the engine, a second
//! gateway's load of an adapter the first loaded is refused (vLLM: "has
//! already been loaded"), and its unload pulls the adapter from under the
//! first one's requests. So a gateway *holds* an adapter on a replica
//! through the replica's agent, and the agent's [`EngineAdapters`] decides
//! the engine's steps from two states, level-triggered:
//!
//! - **wanted**: each adapter with the gateways holding it (a hold is
//!   idempotent: one gateway holds an adapter once), changed by
//!   [`hold`](EngineAdapters::hold), [`release`](EngineAdapters::release)
//!   and [`keep_gateways`](EngineAdapters::keep_gateways) (the holds of
//!   gateways no longer alive go — a gateway that dies never releases).
//!   A gateway holds through the slots it keeps for the replica, which
//!   start empty whenever the replica comes back into its routing (after a
//!   sleep, or a moment out of its view) while the engine keeps what it
//!   loaded: each hold and release names the slots' *generation*, and the
//!   first hold from newer slots ends every hold of the older ones (which
//!   will never release them); a hold or release from older slots than the
//!   gateway's latest is stale and changes nothing;
//! - **observed**: what the engine has loaded, changed only by confirmed
//!   steps ([`step_done`](EngineAdapters::step_done)).
//!
//! [`poll_step`](EngineAdapters::poll_step) gives the one next step that
//! brings the engine toward wanted: an unload of a loaded adapter nobody
//! holds first (it frees the engine's room), then a load of a held one not
//! loaded, oldest hold first; one step at a time. So the engine is never
//! asked to load what it has or unload what it lacks, and never loses an
//! adapter a gateway holds. A load that fails ends its holds (each holder
//! is told why, and its next hold tries again); an unload that fails leaves
//! the adapter loaded and is not tried again until it is held and released
//! anew.
//!
//! An engine holds the adapters of every gateway's slots: up to
//! `slots × gateways`; its own limits (vLLM's `--max-loras`,
//! `--max-cpu-loras`) must allow as much.

use std::collections::{BTreeMap, BTreeSet};

use hangar_core::{AdapterName, AdapterRef};
use hangar_store::ArtifactId;

/// What a hold found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hold {
    /// The engine has the adapter: requests may name it now.
    Ready,
    /// It will once its load is done ([`EngineAdapters::state`] says when).
    Waiting,
    /// The engine has, or is loading, the adapter's name as another
    /// artifact (the name was registered anew): refused until that one's
    /// holders release it.
    Conflict {
        /// The artifact the engine has under the name.
        loaded: ArtifactId,
    },
    /// From slots older than the gateway's latest on this engine: ignored.
    Stale,
}

/// One step for the engine, carried out by the driver, which then calls
/// [`EngineAdapters::step_done`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Make the adapter's directory on the node and post the engine's load.
    Load {
        /// The adapter (its name is the engine's `lora_name`).
        adapter: AdapterRef,
        /// The artifact to load.
        artifact: ArtifactId,
    },
    /// Post the engine's unload.
    Unload {
        /// The adapter.
        adapter: AdapterRef,
    },
}

/// Where one adapter is, for a gateway waiting on its hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// Loaded, and `gateway` holds it.
    Ready,
    /// Not loaded yet, and `gateway` holds it.
    Waiting,
    /// `gateway` does not hold it: its load failed (why, if it did).
    NotHeld(Option<String>),
}

/// One adapter of an engine as the agent's `/status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct AdapterView {
    /// `BASE:ADAPTER`.
    pub adapter: AdapterRef,
    /// Its artifact.
    pub artifact: String,
    /// Whether the engine has it (an unload may be under way).
    pub loaded: bool,
    /// The gateways holding it.
    pub holders: Vec<String>,
}

#[derive(Debug, Clone)]
struct Entry {
    adapter: AdapterRef,
    artifact: ArtifactId,
    holders: BTreeSet<String>,
    /// When it was first held since it was last unloaded (order of loads).
    asked: u64,
    phase: Phase,
    /// Why its last load failed, for holders that waited on it.
    failed: Option<String>,
    /// Its last unload failed: it stays loaded until held and released
    /// again.
    stuck: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Unloaded,
    Loading,
    Loaded,
    Unloading,
}

/// The adapters of one engine (see the module's documentation).
#[derive(Debug, Default)]
pub struct EngineAdapters {
    entries: BTreeMap<AdapterName, Entry>,
    /// Each holding gateway's latest slots generation on this engine.
    generations: BTreeMap<String, u64>,
    in_flight: Option<AdapterName>,
    seq: u64,
}

impl EngineAdapters {
    /// An engine with no adapters loaded (one that just started).
    pub fn new() -> Self {
        Self::default()
    }

    /// `gateway`'s slots of generation `slots` hold `adapter` (as
    /// `artifact`) on this engine, until they release it, newer slots of
    /// the gateway hold something here, or the gateway is no longer alive.
    pub fn hold(&mut self, gateway: &str, slots: u64, adapter: &AdapterRef, artifact: ArtifactId) -> Hold {
        if !self.newest(gateway, slots) {
            return Hold::Stale;
        }
        self.seq += 1;
        let seq = self.seq;
        let entry = self.entries.entry(adapter.name().clone()).or_insert_with(|| Entry {
            adapter: adapter.clone(),
            artifact,
            holders: BTreeSet::new(),
            asked: seq,
            phase: Phase::Unloaded,
            failed: None,
            stuck: false,
        });
        if entry.artifact != artifact {
            if entry.phase == Phase::Unloaded && entry.holders.is_empty() {
                entry.artifact = artifact;
                entry.adapter = adapter.clone();
            } else {
                return Hold::Conflict { loaded: entry.artifact };
            }
        }
        if entry.holders.is_empty() && entry.phase == Phase::Unloaded {
            entry.asked = seq;
        }
        entry.holders.insert(gateway.to_owned());
        entry.stuck = false;
        entry.failed = None;
        match entry.phase {
            Phase::Loaded => Hold::Ready,
            _ => Hold::Waiting,
        }
    }

    /// `gateway`'s slots of generation `slots` let `adapter` go; unloaded
    /// once nobody holds it. From older slots: nothing changes.
    pub fn release(&mut self, gateway: &str, slots: u64, adapter: &AdapterName) {
        if self.generations.get(gateway) != Some(&slots) {
            return;
        }
        if let Some(entry) = self.entries.get_mut(adapter) {
            entry.holders.remove(gateway);
        }
        self.tidy();
    }

    /// Whether `slots` is `gateway`'s newest generation here, ending the
    /// holds of its older slots when it is newer than any seen.
    fn newest(&mut self, gateway: &str, slots: u64) -> bool {
        match self.generations.get(gateway) {
            Some(&latest) if slots < latest => false,
            Some(&latest) if slots == latest => true,
            _ => {
                self.generations.insert(gateway.to_owned(), slots);
                for entry in self.entries.values_mut() {
                    entry.holders.remove(gateway);
                }
                true
            }
        }
    }

    /// Only the gateways in `alive` hold anything now: the holds of the
    /// others go (a gateway that died, or restarted as another).
    pub fn keep_gateways(&mut self, alive: &BTreeSet<String>) {
        for entry in self.entries.values_mut() {
            entry.holders.retain(|g| alive.contains(g));
        }
        self.generations.retain(|g, _| alive.contains(g));
        self.tidy();
    }

    /// Where `adapter` is for `gateway`.
    pub fn state(&self, gateway: &str, adapter: &AdapterName) -> State {
        match self.entries.get(adapter) {
            Some(e) if e.holders.contains(gateway) && e.phase == Phase::Loaded => State::Ready,
            Some(e) if e.holders.contains(gateway) => State::Waiting,
            Some(e) => State::NotHeld(e.failed.clone()),
            None => State::NotHeld(None),
        }
    }

    /// The one next step, if one is due and none is in flight.
    pub fn poll_step(&mut self) -> Option<Step> {
        if self.in_flight.is_some() {
            return None;
        }
        let unload = self
            .entries
            .iter()
            .find(|(_, e)| e.phase == Phase::Loaded && e.holders.is_empty() && !e.stuck)
            .map(|(name, _)| name.clone());
        let next = unload.or_else(|| {
            self.entries
                .iter()
                .filter(|(_, e)| e.phase == Phase::Unloaded && !e.holders.is_empty())
                .min_by_key(|(_, e)| e.asked)
                .map(|(name, _)| name.clone())
        })?;
        let entry = self.entries.get_mut(&next).expect("just found");
        let step = match entry.phase {
            Phase::Loaded => {
                entry.phase = Phase::Unloading;
                Step::Unload { adapter: entry.adapter.clone() }
            }
            _ => {
                entry.phase = Phase::Loading;
                Step::Load { adapter: entry.adapter.clone(), artifact: entry.artifact }
            }
        };
        self.in_flight = Some(next);
        Some(step)
    }

    /// The step in flight ended: `Ok` once the engine confirmed it, else
    /// why not. A failed load ends its holds (their holders see why in
    /// [`state`](Self::state)).
    pub fn step_done(&mut self, outcome: Result<(), String>) {
        let Some(name) = self.in_flight.take() else { return };
        let Some(entry) = self.entries.get_mut(&name) else { return };
        match (entry.phase, outcome) {
            (Phase::Loading, Ok(())) => entry.phase = Phase::Loaded,
            (Phase::Loading, Err(why)) => {
                entry.phase = Phase::Unloaded;
                entry.holders.clear();
                entry.failed = Some(why);
            }
            (Phase::Unloading, Ok(())) => entry.phase = Phase::Unloaded,
            (Phase::Unloading, Err(_)) => {
                entry.phase = Phase::Loaded;
                entry.stuck = true;
            }
            _ => {}
        }
        self.tidy();
    }

    /// Every adapter the engine has or is asked to have, with the
    /// gateways holding it: what the agent's `/status` shows.
    pub fn view(&self) -> Vec<AdapterView> {
        self.entries
            .values()
            .map(|e| AdapterView {
                adapter: e.adapter.clone(),
                artifact: e.artifact.to_string(),
                loaded: matches!(e.phase, Phase::Loaded | Phase::Unloading),
                holders: e.holders.iter().cloned().collect(),
            })
            .collect()
    }

    /// The adapters the engine has loaded, by its own word.
    pub fn loaded(&self) -> impl Iterator<Item = &AdapterRef> {
        self.entries
            .values()
            .filter(|e| matches!(e.phase, Phase::Loaded | Phase::Unloading))
            .map(|e| &e.adapter)
    }

    /// Forgets what nobody holds and the engine lacks (a failed load's
    /// reason stays until the next hold, for the holders that waited).
    fn tidy(&mut self) {
        let in_flight = self.in_flight.clone();
        self.entries.retain(|name, e| {
            Some(name) == in_flight.as_ref()
                || e.phase != Phase::Unloaded
                || !e.holders.is_empty()
                || e.failed.is_some()
        });
    }
}

/// Which gateways still hold adapters on a node's engines, judged from
/// reads of Redis's index of live gateways as the fleet's liveness is: a
/// gateway's absence counts only in reads that answered, so an outage of
/// Redis (every gateway absent, or no answer at all) takes no hold away.
#[derive(Debug, Default)]
pub struct Holders {
    /// Each gateway known, and how many answered reads in a row missed it.
    missed: std::collections::HashMap<String, u32>,
}

impl Holders {
    /// How many answered reads in a row may miss a gateway before its
    /// holds go: at a read a second, about ten seconds of answers, past
    /// the index's own TTL (3 s) and a gateway's restart of its refreshes.
    pub const MISSED_READS: u32 = 10;

    /// `gateway` holds something: it counts as alive until reads miss it.
    pub fn heard(&mut self, gateway: &str) {
        self.missed.entry(gateway.to_owned()).or_insert(0);
    }

    /// A read of the index answered `alive`; returns the gateways whose
    /// holds stand ([`EngineAdapters::keep_gateways`]).
    pub fn read(&mut self, alive: &BTreeSet<String>) -> BTreeSet<String> {
        for (gateway, missed) in &mut self.missed {
            *missed = if alive.contains(gateway) { 0 } else { *missed + 1 };
        }
        for gateway in alive {
            self.missed.entry(gateway.clone()).or_insert(0);
        }
        self.missed.retain(|_, missed| *missed < Self::MISSED_READS);
        self.missed.keys().cloned().collect()
    }
}

#[cfg(test)]
mod tests;
