//! Which stored artifacts' bytes to drop to bring the blob store under a
//! byte budget (Workers AI's model-cache reaper): least recently used
//! first, never one that is referenced — leased, or loaded by a running
//! replica. Sans-IO: [`crate::BlobStore::enforce_disk_budget`] gathers the
//! entries and drops the bytes of what this returns. A budget removes
//! bytes, never keys: the artifact stays known, its keys resolve, and the
//! next load fetches its bytes again from a peer or the fallback.

use crate::id::ArtifactId;

/// One stored artifact as the reaper sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskEntry {
    /// The artifact.
    pub id: ArtifactId,
    /// Its bytes on disk.
    pub bytes: u64,
    /// When it was last used (ms since the epoch): imported, loaded.
    pub last_used_ms: u64,
    /// A lease or a running replica uses it: never removed.
    pub referenced: bool,
}

/// The artifacts to remove so the store holds at most `budget` bytes:
/// unreferenced ones, least recently used first (ties by id), as few as
/// that takes. When the referenced ones alone exceed the budget, every
/// unreferenced one is returned and the store stays over it.
pub fn over_budget(entries: &[DiskEntry], budget: u64) -> Vec<ArtifactId> {
    let mut total: u64 = entries.iter().map(|e| e.bytes).sum();
    let mut candidates: Vec<&DiskEntry> = entries.iter().filter(|e| !e.referenced).collect();
    candidates.sort_by_key(|e| (e.last_used_ms, e.id));
    let mut out = Vec::new();
    for e in candidates {
        if total <= budget {
            break;
        }
        total -= e.bytes;
        out.push(e.id);
    }
    out
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn id(n: u8) -> ArtifactId {
        ArtifactId::Full { index: [n; 32], data: [n; 32] }
    }

    fn entries() -> impl Strategy<Value = Vec<DiskEntry>> {
        prop::collection::vec((1u64..1_000, 0u64..50, any::<bool>()), 0..12).prop_map(|v| {
            v.into_iter()
                .enumerate()
                .map(|(i, (bytes, last_used_ms, referenced))| DiskEntry {
                    id: id(i as u8),
                    bytes,
                    last_used_ms,
                    referenced,
                })
                .collect()
        })
    }

    proptest! {
        #[test]
        fn never_referenced_least_recent_first_and_no_more_than_needed(es in entries(), budget in 0u64..6_000) {
            let out = over_budget(&es, budget);
            let by_id = |i: &ArtifactId| es.iter().find(|e| e.id == *i).unwrap();
            prop_assert!(out.iter().all(|i| !by_id(i).referenced));
            let left: u64 = es.iter().filter(|e| !out.contains(&e.id)).map(|e| e.bytes).sum();
            let pinned: u64 = es.iter().filter(|e| e.referenced).map(|e| e.bytes).sum();
            // Under budget, or only referenced bytes left.
            prop_assert!(left <= budget || left == pinned);
            // Nothing kept is older than something removed.
            let newest_removed = out.iter().map(|i| (by_id(i).last_used_ms, *i)).max();
            if let Some(newest) = newest_removed {
                prop_assert!(es.iter().filter(|e| !e.referenced && !out.contains(&e.id))
                    .all(|e| (e.last_used_ms, e.id) > newest));
                // Minimal: without the last removal it would be over budget.
                prop_assert!(left + by_id(&newest.1).bytes > budget);
            }
        }
    }

    #[test]
    fn the_oldest_unleased_go_first() {
        let es = [
            DiskEntry { id: id(1), bytes: 10, last_used_ms: 1, referenced: true },
            DiskEntry { id: id(2), bytes: 10, last_used_ms: 2, referenced: false },
            DiskEntry { id: id(3), bytes: 10, last_used_ms: 3, referenced: false },
        ];
        assert_eq!(over_budget(&es, 20), vec![id(2)]);
        assert_eq!(over_budget(&es, 5), vec![id(2), id(3)]);
        assert!(over_budget(&es, 30).is_empty());
    }
}
