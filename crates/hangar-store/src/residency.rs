//! Who holds which resident artifact, and what may be evicted: a sans-IO
//! state machine.
//!
//! The daemon keeps artifacts resident in shared memory. Every use is a
//! *holder* keyed by the caller's replica id: either a process (released
//! when it unloads or dies) or a TTL lease (released when it expires unless
//! kept alive). An artifact with at least one holder is *referenced* and is
//! never evicted. Resident bytes stay within a budget: making room evicts
//! unreferenced artifacts, least recently used first; if even that is not
//! enough, the reservation is refused.
//!
//! Inputs carry `now` (milliseconds, monotonic); nothing here reads a clock
//! or touches memory. Outputs are plain data: the ids the driver must drop.
//! The driver calls [`Residency::handle_timeout`] at or after
//! [`Residency::poll_timeout`]; early or repeated calls do nothing.

use std::collections::HashMap;

use hangar_core::{Millis, ReplicaId};

use crate::id::ArtifactId;

/// Who holds a reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// A local process; released by `Unload` or when the process exits.
    Pid(u32),
    /// A lease that expires at the given time unless kept alive.
    Lease {
        /// Expiry instant.
        expires_at: Millis,
    },
}

#[derive(Debug, Clone)]
struct Entry {
    bytes: u64,
    refs: u32,
    last_used: Millis,
}

/// Why an acquire or keep-alive was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ResidencyError {
    /// The artifact is not resident.
    #[error("artifact {0} is not resident")]
    NotResident(ArtifactId),
    /// The replica already holds a different artifact.
    #[error("replica {replica} already holds {held}")]
    ReplicaBusy {
        /// The replica.
        replica: ReplicaId,
        /// What it holds.
        held: ArtifactId,
    },
    /// No such holder.
    #[error("replica {0} holds nothing")]
    UnknownHolder(ReplicaId),
    /// The holder is a process, not a lease.
    #[error("replica {0} is held by a process, not a lease")]
    NotALease(ReplicaId),
    /// Not enough evictable memory.
    #[error("{need} bytes needed, budget {budget}, {pinned} referenced")]
    OutOfBudget {
        /// Requested.
        need: u64,
        /// Budget.
        budget: u64,
        /// Referenced (unevictable) bytes.
        pinned: u64,
    },
}

/// The residency table.
#[derive(Debug, Clone)]
pub struct Residency {
    budget: u64,
    used: u64,
    entries: HashMap<ArtifactId, Entry>,
    holders: HashMap<ReplicaId, (ArtifactId, Owner)>,
}

impl Residency {
    /// An empty table with a budget of `budget` bytes.
    pub fn new(budget: u64) -> Self {
        Residency { budget, used: 0, entries: HashMap::new(), holders: HashMap::new() }
    }

    // --- getters ---

    /// Resident bytes.
    pub fn used(&self) -> u64 {
        self.used
    }
    /// The budget.
    pub fn budget(&self) -> u64 {
        self.budget
    }
    /// Whether `id` is resident.
    pub fn contains(&self, id: &ArtifactId) -> bool {
        self.entries.contains_key(id)
    }
    /// Number of holders of `id` (0 if not resident).
    pub fn refs(&self, id: &ArtifactId) -> u32 {
        self.entries.get(id).map_or(0, |e| e.refs)
    }
    /// What `replica` holds.
    pub fn holder(&self, replica: &ReplicaId) -> Option<(ArtifactId, Owner)> {
        self.holders.get(replica).copied()
    }
    /// Resident ids with bytes and holder counts.
    pub fn residents(&self) -> impl Iterator<Item = (ArtifactId, u64, u32)> + '_ {
        self.entries.iter().map(|(id, e)| (*id, e.bytes, e.refs))
    }
    /// Whether any holder is process `pid`.
    pub fn has_pid(&self, pid: u32) -> bool {
        self.holders.values().any(|(_, o)| *o == Owner::Pid(pid))
    }

    // --- mutators ---

    /// Makes room for and records a new resident of `bytes` (unreferenced),
    /// evicting unreferenced residents LRU first. Returns the evicted ids,
    /// whose memory the driver must drop. On refusal nothing changes.
    pub fn reserve(
        &mut self,
        id: ArtifactId,
        bytes: u64,
        now: Millis,
    ) -> Result<Vec<ArtifactId>, ResidencyError> {
        if let Some(e) = self.entries.get_mut(&id) {
            e.last_used = now;
            return Ok(vec![]);
        }
        let pinned: u64 = self.entries.values().filter(|e| e.refs > 0).map(|e| e.bytes).sum();
        if pinned.saturating_add(bytes) > self.budget {
            return Err(ResidencyError::OutOfBudget { need: bytes, budget: self.budget, pinned });
        }
        let mut victims: Vec<(Millis, ArtifactId, u64)> = self
            .entries
            .iter()
            .filter(|(_, e)| e.refs == 0)
            .map(|(i, e)| (e.last_used, *i, e.bytes))
            .collect();
        victims.sort();
        let mut evicted = Vec::new();
        for (_, victim, vbytes) in victims {
            if self.used + bytes <= self.budget {
                break;
            }
            self.entries.remove(&victim);
            self.used -= vbytes;
            evicted.push(victim);
        }
        self.entries.insert(id, Entry { bytes, refs: 0, last_used: now });
        self.used += bytes;
        Ok(evicted)
    }

    /// Adds `replica` as a holder of resident `id`. Acquiring again for the
    /// same artifact is idempotent (a retried request does not double count;
    /// a lease's expiry is updated).
    pub fn acquire(
        &mut self,
        replica: ReplicaId,
        id: ArtifactId,
        owner: Owner,
        now: Millis,
    ) -> Result<(), ResidencyError> {
        let entry = self.entries.get_mut(&id).ok_or(ResidencyError::NotResident(id))?;
        entry.last_used = now;
        match self.holders.get_mut(&replica) {
            Some((held, o)) if *held == id => *o = owner,
            Some((held, _)) => return Err(ResidencyError::ReplicaBusy { replica, held: *held }),
            None => {
                entry.refs += 1;
                self.holders.insert(replica, (id, owner));
            }
        }
        Ok(())
    }

    /// Drops `replica`'s reference. Returns what it held (`None`: it held
    /// nothing, which is not an error — `Unload` is idempotent).
    pub fn release(&mut self, replica: &ReplicaId, now: Millis) -> Option<ArtifactId> {
        let (id, _) = self.holders.remove(replica)?;
        if let Some(e) = self.entries.get_mut(&id) {
            e.refs -= 1;
            e.last_used = now;
        }
        Some(id)
    }

    /// Drops every reference held by process `pid` (it exited).
    pub fn release_pid(&mut self, pid: u32, now: Millis) -> Vec<ReplicaId> {
        let gone: Vec<ReplicaId> =
            self.holders.iter().filter(|(_, (_, o))| *o == Owner::Pid(pid)).map(|(r, _)| *r).collect();
        for r in &gone {
            self.release(r, now);
        }
        gone
    }

    /// Extends a lease to `now + ttl`. Returns the new expiry.
    pub fn keep_alive(
        &mut self,
        replica: &ReplicaId,
        ttl: Millis,
        now: Millis,
    ) -> Result<Millis, ResidencyError> {
        match self.holders.get_mut(replica) {
            None => Err(ResidencyError::UnknownHolder(*replica)),
            Some((_, Owner::Pid(_))) => Err(ResidencyError::NotALease(*replica)),
            Some((_, Owner::Lease { expires_at })) => {
                *expires_at = now + ttl;
                Ok(*expires_at)
            }
        }
    }

    /// Forgets `id` and its holders (its load failed). Returns the holders dropped.
    pub fn remove(&mut self, id: &ArtifactId) -> Vec<ReplicaId> {
        let Some(e) = self.entries.remove(id) else { return vec![] };
        self.used -= e.bytes;
        let gone: Vec<ReplicaId> =
            self.holders.iter().filter(|(_, (a, _))| a == id).map(|(r, _)| *r).collect();
        for r in &gone {
            self.holders.remove(r);
        }
        gone
    }

    // --- timers ---

    /// The earliest lease expiry, if any.
    pub fn poll_timeout(&self) -> Option<Millis> {
        self.holders
            .values()
            .filter_map(|(_, o)| match o {
                Owner::Lease { expires_at } => Some(*expires_at),
                Owner::Pid(_) => None,
            })
            .min()
    }

    /// Releases every lease that expired at or before `now`; returns them.
    pub fn handle_timeout(&mut self, now: Millis) -> Vec<ReplicaId> {
        let expired: Vec<ReplicaId> = self
            .holders
            .iter()
            .filter(|(_, (_, o))| matches!(o, Owner::Lease { expires_at } if *expires_at <= now))
            .map(|(r, _)| *r)
            .collect();
        for r in &expired {
            self.release(r, now);
        }
        expired
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn id(n: u8) -> ArtifactId {
        ArtifactId::View([n; 32])
    }
    fn rep(n: u8) -> ReplicaId {
        ReplicaId::from_u128(n as u128)
    }

    #[test]
    fn lru_evicts_unreferenced_only() {
        let mut r = Residency::new(100);
        r.reserve(id(1), 40, 0).unwrap();
        r.reserve(id(2), 40, 1).unwrap();
        r.acquire(rep(1), id(1), Owner::Pid(7), 2).unwrap();
        assert_eq!(r.reserve(id(3), 40, 3).unwrap(), vec![id(2)]);
        let err = r.reserve(id(4), 70, 4).unwrap_err();
        assert_eq!(err, ResidencyError::OutOfBudget { need: 70, budget: 100, pinned: 40 });
        assert!(r.contains(&id(3)), "a refused reservation evicts nothing");
        assert_eq!(r.release_pid(7, 5), vec![rep(1)]);
        assert_eq!(r.reserve(id(4), 70, 6).unwrap().len(), 2);
    }

    #[test]
    fn leases_expire_and_keep_alive_extends() {
        let mut r = Residency::new(100);
        r.reserve(id(1), 10, 0).unwrap();
        r.acquire(rep(1), id(1), Owner::Lease { expires_at: 100 }, 0).unwrap();
        assert_eq!(r.poll_timeout(), Some(100));
        assert!(r.handle_timeout(99).is_empty());
        assert_eq!(r.keep_alive(&rep(1), 100, 90).unwrap(), 190);
        assert!(r.handle_timeout(150).is_empty());
        assert_eq!(r.refs(&id(1)), 1);
        assert_eq!(r.handle_timeout(190), vec![rep(1)]);
        assert_eq!(r.refs(&id(1)), 0);
        assert_eq!(r.keep_alive(&rep(1), 1, 200), Err(ResidencyError::UnknownHolder(rep(1))));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Reserve(u8, u64),
        AcquirePid(u8, u8, u32),
        AcquireLease(u8, u8, u64),
        Release(u8),
        Die(u32),
        KeepAlive(u8, u64),
        Tick(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..6, 1u64..60).prop_map(|(a, b)| Op::Reserve(a, b)),
            (0u8..8, 0u8..6, 1u32..4).prop_map(|(r, a, p)| Op::AcquirePid(r, a, p)),
            (0u8..8, 0u8..6, 1u64..50).prop_map(|(r, a, t)| Op::AcquireLease(r, a, t)),
            (0u8..8).prop_map(Op::Release),
            (1u32..4).prop_map(Op::Die),
            (0u8..8, 1u64..50).prop_map(|(r, t)| Op::KeepAlive(r, t)),
            (0u64..30).prop_map(Op::Tick),
        ]
    }

    proptest! {
        /// Referenced artifacts are never evicted, bytes stay within budget and
        /// add up, and reference counts equal the holders.
        #[test]
        fn referenced_is_never_evicted(ops in proptest::collection::vec(op(), 1..80)) {
            let mut r = Residency::new(100);
            let mut now = 0;
            for op in ops {
                match op {
                    Op::Reserve(a, b) => {
                        let before: Vec<ArtifactId> =
                            r.residents().filter(|(_, _, refs)| *refs > 0).map(|(i, _, _)| i).collect();
                        if let Ok(evicted) = r.reserve(id(a), b, now) {
                            for e in &evicted {
                                prop_assert!(!before.contains(e), "evicted referenced {e}");
                            }
                        }
                    }
                    Op::AcquirePid(x, a, p) => { let _ = r.acquire(rep(x), id(a), Owner::Pid(p), now); }
                    Op::AcquireLease(x, a, t) => {
                        let _ = r.acquire(rep(x), id(a), Owner::Lease { expires_at: now + t }, now);
                    }
                    Op::Release(x) => { r.release(&rep(x), now); }
                    Op::Die(p) => { r.release_pid(p, now); prop_assert!(!r.has_pid(p)); }
                    Op::KeepAlive(x, t) => { let _ = r.keep_alive(&rep(x), t, now); }
                    Op::Tick(dt) => {
                        now += dt;
                        r.handle_timeout(now);
                        prop_assert!(r.poll_timeout().is_none_or(|t| t > now));
                    }
                }
                prop_assert!(r.used() <= r.budget());
                prop_assert_eq!(r.used(), r.residents().map(|(_, b, _)| b).sum::<u64>());
                for (a, _, refs) in r.residents() {
                    let holders = r.holders.values().filter(|(h, _)| *h == a).count() as u32;
                    prop_assert_eq!(refs, holders);
                }
                for (a, _) in r.holders.values() {
                    prop_assert!(r.contains(a), "holder of a non-resident artifact");
                }
            }
        }
    }
}
