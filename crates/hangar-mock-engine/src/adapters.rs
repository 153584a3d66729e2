//! The adapter table: which LoRA adapters the engine holds, which are
//! being loaded, and whose load goes next. Sans-IO: it reads no file, no
//! clock and never waits; the HTTP handlers (`lora`) read the adapter's
//! bytes and sleep its load time, asking the table at each step.
//!
//! A load goes through three states: *waiting* (its name and a slot are
//! reserved; [`AdapterTable::request_load`]), *in progress* (its turn came;
//! [`AdapterTable::try_start`]) and *loaded* ([`AdapterTable::finish`]), or
//! it leaves the table from either of the first two
//! ([`AdapterTable::abort`]: the files could not be read, the client left).
//!
//! Invariants after every call:
//! - loaded and reserved adapters together never number more than
//!   `max_loras`, so a load that is accepted always has a slot to finish in;
//! - a name is at most once in the table (loaded, or waiting, or in
//!   progress), and never the base model's;
//! - at most one load is in progress (an engine loads one adapter at a
//!   time), and loads start in the order they were asked for;
//! - [`AdapterTable::resolve`] finds only loaded adapters: a request never
//!   runs on an adapter that is still loading.

use std::time::Duration;

use crate::WeightsRead;

/// A loaded adapter, as `/v1/models` lists it and requests run on it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Adapter {
    /// The name requests put in `"model"` (vLLM's `lora_name`).
    pub name: String,
    /// What was read from its `lora_path`.
    pub read: WeightsRead,
    /// The modelled load time it took.
    pub load_time: Duration,
    /// Mixed into its requests' token ids, so an adapter's outputs and
    /// prefix cache are its own (vLLM keys its prefix cache by adapter).
    pub salt: u64,
}

/// Why a load was refused before it began. The messages are vLLM's where
/// vLLM refuses the same thing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum LoadRefused {
    /// `lora_name` or `lora_path` is missing or empty.
    #[error("Both 'lora_name' and 'lora_path' must be provided.")]
    MissingField,
    /// The name is the base model's: requests naming it could not tell the
    /// two apart.
    #[error("'{0}' is the base model's name; load the adapter under another name")]
    BaseName(String),
    /// An adapter of that name is loaded.
    #[error("The lora adapter '{0}' has already been loaded.")]
    AlreadyLoaded(String),
    /// An adapter of that name is being loaded (waiting or in progress).
    #[error("The lora adapter '{0}' is already being loaded.")]
    Loading(String),
    /// Every slot is taken by a loaded or loading adapter.
    #[error(
        "{max} LoRA adapters are loaded or loading, the most this engine holds (max_loras = {max}); unload one first"
    )]
    Full {
        /// The engine's `max_loras`.
        max: usize,
    },
}

/// Why an unload was refused. The messages are vLLM's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum UnloadRefused {
    /// `lora_name` is missing or empty.
    #[error("either 'lora_name' and 'lora_int_id' needs to be provided.")]
    MissingName,
    /// No adapter of that name is loaded (one still loading included).
    #[error("The lora adapter '{0}' cannot be found.")]
    NotFound(String),
}

/// The adapters of one engine. See the module doc for its invariants.
#[derive(Debug)]
pub(crate) struct AdapterTable {
    base: String,
    max_loras: usize,
    /// Loaded adapters in the order they finished loading, the order
    /// `/v1/models` lists them (as vLLM does).
    loaded: Vec<Adapter>,
    /// Reserved names in the order their loads were asked for; the first
    /// is in progress when `in_progress`.
    reserved: Vec<String>,
    in_progress: bool,
}

impl AdapterTable {
    /// An empty table for an engine serving `base` that holds at most
    /// `max_loras` adapters.
    pub fn new(base: impl Into<String>, max_loras: usize) -> Self {
        Self { base: base.into(), max_loras, loaded: Vec::new(), reserved: Vec::new(), in_progress: false }
    }

    /// Reserves `name` and a slot for a load from `path`, or says why not.
    /// On `Ok` the load waits until [`try_start`](Self::try_start) says its
    /// turn came; on `Err` the table is unchanged.
    pub fn request_load(&mut self, name: &str, path: &str) -> Result<(), LoadRefused> {
        if name.is_empty() || path.is_empty() {
            return Err(LoadRefused::MissingField);
        }
        if name == self.base {
            return Err(LoadRefused::BaseName(name.into()));
        }
        if self.loaded.iter().any(|a| a.name == name) {
            return Err(LoadRefused::AlreadyLoaded(name.into()));
        }
        if self.reserved.iter().any(|n| n == name) {
            return Err(LoadRefused::Loading(name.into()));
        }
        if self.loaded.len() + self.reserved.len() >= self.max_loras {
            return Err(LoadRefused::Full { max: self.max_loras });
        }
        self.reserved.push(name.into());
        Ok(())
    }

    /// Whether the load of `name` may run now: true once, when no other
    /// load is in progress and every load asked for before it has
    /// finished or been aborted. The caller then reads the adapter and
    /// ends with [`finish`](Self::finish) or [`abort`](Self::abort).
    pub fn try_start(&mut self, name: &str) -> bool {
        if self.in_progress || self.reserved.first().is_none_or(|n| n != name) {
            return false;
        }
        self.in_progress = true;
        true
    }

    /// Ends the load in progress of `name`: the adapter is loaded and
    /// requests may name it. `None` (and nothing changed) unless `name` is
    /// the load in progress.
    pub fn finish(
        &mut self,
        name: &str,
        read: WeightsRead,
        load_time: Duration,
        salt: u64,
    ) -> Option<&Adapter> {
        if !self.in_progress || self.reserved.first().is_none_or(|n| n != name) {
            return None;
        }
        self.reserved.remove(0);
        self.in_progress = false;
        self.loaded.push(Adapter { name: name.into(), read, load_time, salt });
        self.loaded.last()
    }

    /// Drops the reservation of `name`, waiting or in progress; its slot is
    /// free again and the next load may start. Nothing happens if `name`
    /// is not being loaded (a loaded adapter stays loaded).
    pub fn abort(&mut self, name: &str) {
        if let Some(i) = self.reserved.iter().position(|n| n == name) {
            self.reserved.remove(i);
            if i == 0 {
                self.in_progress = false;
            }
        }
    }

    /// Unloads `name`. Requests already running on it finish (their
    /// tokens are in the engine); new ones naming it are refused.
    pub fn unload(&mut self, name: &str) -> Result<Adapter, UnloadRefused> {
        if name.is_empty() {
            return Err(UnloadRefused::MissingName);
        }
        let i = self
            .loaded
            .iter()
            .position(|a| a.name == name)
            .ok_or_else(|| UnloadRefused::NotFound(name.into()))?;
        Ok(self.loaded.remove(i))
    }

    /// The loaded adapter named `model`, if any.
    pub fn resolve(&self, model: &str) -> Option<&Adapter> {
        self.loaded.iter().find(|a| a.name == model)
    }

    /// The loaded adapters, in the order they were loaded.
    pub fn loaded(&self) -> &[Adapter] {
        &self.loaded
    }
}

/// How long loading `bytes` takes an engine that reads adapters at
/// `bytes_per_s` and spends `fixed` on every load besides (building the
/// adapter's layers, copying them to the GPU).
pub(crate) fn load_time(bytes: u64, bytes_per_s: std::num::NonZeroU64, fixed: Duration) -> Duration {
    let nanos = u128::from(bytes) * 1_000_000_000 / u128::from(bytes_per_s.get());
    fixed.saturating_add(Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX)))
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::num::NonZeroU64;

    use proptest::prelude::*;

    use super::*;

    fn read(name: &str) -> WeightsRead {
        WeightsRead::whole(format!("/adapters/{name}"), 1, blake3::hash(b"0"))
    }

    #[test]
    fn a_load_reserves_then_starts_in_turn_then_serves() {
        let mut t = AdapterTable::new("base", 2);
        assert_eq!(t.request_load("", "/p"), Err(LoadRefused::MissingField));
        assert_eq!(t.request_load("a", ""), Err(LoadRefused::MissingField));
        assert_eq!(t.request_load("base", "/p"), Err(LoadRefused::BaseName("base".into())));
        t.request_load("a", "/a").unwrap();
        assert_eq!(t.request_load("a", "/a"), Err(LoadRefused::Loading("a".into())));
        t.request_load("b", "/b").unwrap();
        assert_eq!(t.request_load("c", "/c"), Err(LoadRefused::Full { max: 2 }));
        assert!(!t.try_start("b"), "b was asked for after a");
        assert!(t.try_start("a"));
        assert!(!t.try_start("a"), "a turn comes once");
        assert!(t.resolve("a").is_none(), "not served while loading");
        assert!(t.finish("b", read("b"), Duration::ZERO, 0).is_none(), "b is not in progress");
        assert_eq!(t.finish("a", read("a"), Duration::from_millis(5), 7).unwrap().salt, 7);
        assert_eq!(t.resolve("a").unwrap().load_time, Duration::from_millis(5));
        assert_eq!(t.request_load("a", "/a"), Err(LoadRefused::AlreadyLoaded("a".into())));
        assert!(t.try_start("b"));
        t.abort("b");
        assert!(t.resolve("b").is_none());
        t.request_load("c", "/c").unwrap();
        assert!(t.try_start("c"), "an aborted load frees the loader");
        assert_eq!(t.unload(""), Err(UnloadRefused::MissingName));
        assert_eq!(t.unload("c"), Err(UnloadRefused::NotFound("c".into())), "c is still loading");
        assert_eq!(t.unload("a").unwrap().name, "a");
        assert_eq!(t.unload("a"), Err(UnloadRefused::NotFound("a".into())));
    }

    #[test]
    fn the_load_time_is_bytes_over_bandwidth_plus_the_fixed_part() {
        let gbps = NonZeroU64::new(2_000_000_000).unwrap();
        assert_eq!(load_time(0, gbps, Duration::from_millis(50)), Duration::from_millis(50));
        assert_eq!(load_time(168_000_000, gbps, Duration::from_millis(50)), Duration::from_millis(134));
        let one = NonZeroU64::new(1).unwrap();
        assert_eq!(load_time(u64::MAX, one, Duration::MAX), Duration::MAX, "saturates");
    }

    #[derive(Debug, Clone)]
    enum Op {
        Load(usize),
        Start(usize),
        Finish(usize),
        Abort(usize),
        Unload(usize),
    }

    const NAMES: [&str; 6] = ["a", "b", "c", "d", "e", "base"];

    fn op() -> impl Strategy<Value = Op> {
        let n = 0..NAMES.len();
        prop_oneof![
            3 => n.clone().prop_map(Op::Load),
            3 => n.clone().prop_map(Op::Start),
            3 => n.clone().prop_map(Op::Finish),
            1 => n.clone().prop_map(Op::Abort),
            2 => n.prop_map(Op::Unload),
        ]
    }

    /// What the table should hold, kept the obvious way.
    #[derive(Default)]
    struct Model {
        loaded: Vec<&'static str>,
        queue: VecDeque<&'static str>,
        running: bool,
    }

    proptest! {
        /// Random loads, turns, finishes, aborts and unloads against a
        /// plain model; after every step the invariants of the module doc
        /// hold and every name resolves exactly when loaded.
        #[test]
        fn the_table_keeps_its_invariants(max in 0usize..4, ops in proptest::collection::vec(op(), 1..200)) {
            let mut t = AdapterTable::new("base", max);
            let mut m = Model::default();
            for op in ops {
                match op {
                    Op::Load(i) => {
                        let name = NAMES[i];
                        let want = if name == "base" {
                            Err(LoadRefused::BaseName(name.into()))
                        } else if m.loaded.contains(&name) {
                            Err(LoadRefused::AlreadyLoaded(name.into()))
                        } else if m.queue.contains(&name) {
                            Err(LoadRefused::Loading(name.into()))
                        } else if m.loaded.len() + m.queue.len() >= max {
                            Err(LoadRefused::Full { max })
                        } else {
                            m.queue.push_back(name);
                            Ok(())
                        };
                        prop_assert_eq!(t.request_load(name, "/p"), want);
                    }
                    Op::Start(i) => {
                        let want = !m.running && m.queue.front() == Some(&NAMES[i]);
                        m.running |= want;
                        prop_assert_eq!(t.try_start(NAMES[i]), want);
                    }
                    Op::Finish(i) => {
                        let name = NAMES[i];
                        let want = m.running && m.queue.front() == Some(&name);
                        if want {
                            m.queue.pop_front();
                            m.running = false;
                            m.loaded.push(name);
                        }
                        prop_assert_eq!(t.finish(name, read(name), Duration::ZERO, 0).is_some(), want);
                    }
                    Op::Abort(i) => {
                        if let Some(p) = m.queue.iter().position(|n| *n == NAMES[i]) {
                            m.queue.remove(p);
                            if p == 0 {
                                m.running = false;
                            }
                        }
                        t.abort(NAMES[i]);
                    }
                    Op::Unload(i) => {
                        let name = NAMES[i];
                        let was = m.loaded.iter().position(|n| *n == name);
                        if let Some(p) = was {
                            m.loaded.remove(p);
                        }
                        prop_assert_eq!(t.unload(name).is_ok(), was.is_some());
                    }
                }
                prop_assert!(t.loaded().len() + t.reserved.len() <= max);
                let names: Vec<&str> = t.loaded().iter().map(|a| a.name.as_str()).collect();
                prop_assert_eq!(&names, &m.loaded);
                prop_assert_eq!(&t.reserved, &m.queue.iter().map(|n| n.to_string()).collect::<Vec<_>>());
                prop_assert_eq!(t.in_progress, m.running);
                prop_assert!(!t.in_progress || !t.reserved.is_empty(), "a load in progress is reserved");
                for name in NAMES {
                    prop_assert_eq!(t.resolve(name).is_some(), m.loaded.contains(&name), "{}", name);
                }
            }
        }
    }
}
