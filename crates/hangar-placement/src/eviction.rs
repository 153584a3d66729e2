//! Exact choice of the eviction set: least evicted bytes, then fewest
//! evictions.
//!
//! Placement needs room in one of two shapes, and each has its own search.
//!
//! * **A share of one GPU** (`min_cover`): free at least `need` more bytes
//!   on that GPU. Every tenant there is an item whose *benefit* is its bytes
//!   on this GPU and whose *cost* is all the GPU bytes it holds (a multi-GPU
//!   tenant costs more than it frees here). This is a minimum-cost cover, a
//!   knapsack variant, solved exactly by depth-first branch and bound:
//!   tenants with equal (benefit, cost) are grouped so that k identical
//!   replicas branch k+1 ways instead of 2^k; within a group more than
//!   `ceil(need / benefit)` is never tried (a minimal cover never overshoots
//!   by a whole item); a branch stops when the benefit left cannot cover the
//!   need, or when `cost so far + need left` (a lower bound, since cost ≥
//!   benefit for every item) cannot beat the best set found so far.
//! * **k whole GPUs** (`min_clear`): empty k GPUs. The set evicted is the
//!   union of the tenants of the GPUs chosen, so the search is over k-subsets
//!   of the node's GPUs (at most C(16, 8) = 12 870 with the node size limit),
//!   depth first, cheapest GPUs first, pruned as soon as the running cost
//!   cannot beat the best; a tenant spanning several chosen GPUs is paid for
//!   once.
//!
//! Greedy smallest-first (the reference implementation) is wrong for both:
//! with 30 GB needed and tenants of 10, 25 and 30 GB it evicts 10 + 25 where
//! the single 30 GB tenant frees as much for less.
//!
//! Both searches take a `limit`: the best cost already found on another node.
//! A node that cannot match it is abandoned early, which keeps a full
//! cluster-wide scan cheap.

use serde::{Deserialize, Serialize};

/// What an eviction set costs, compared (by the derived order, field by
/// field) whether it takes a non-hotswap replica first, then bytes, then
/// count.
///
/// The leading flag is how the hotswap tier stands behind the models that
/// hold their own replicas: a set of hotswap replicas alone beats any set
/// that takes a non-hotswap one, whatever their bytes. It is a flag, not a
/// count of such victims: in a fleet without hotswap models every set that
/// evicts anything has it set, so the order among them is bytes then count
/// exactly as before the tier existed, where a leading count would have put
/// the fewest evictions before the fewest bytes. The searches below ignore
/// it (they run over one tier's candidates at a time); the placement code
/// searches the hotswap victims alone first and sets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Hash, Serialize, Deserialize)]
pub struct EvictionCost {
    /// Whether the set evicts a replica of a model outside the hotswap tier
    /// (false for the empty set and for sets of hotswap replicas alone).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub non_hotswap: bool,
    /// GPU bytes the evicted deployments held.
    pub bytes: u64,
    /// How many deployments are evicted.
    pub count: u32,
}

impl EvictionCost {
    fn plus(self, bytes: u64, count: u32) -> Self {
        Self { bytes: self.bytes + bytes, count: self.count + count, ..self }
    }
}

/// One evictable tenant of the GPU being cleared for a share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Item {
    /// Bytes evicting it frees on this GPU.
    pub benefit: u64,
    /// GPU bytes it holds in all (≥ `benefit`).
    pub cost: u64,
}

/// Tracks the best cost seen and whether a candidate may replace it: before
/// any local solution, anything up to `limit` (inclusive, so ties with other
/// nodes survive for the random tie-break); after, only strictly better.
struct Best {
    limit: Option<EvictionCost>,
    found: bool,
}

impl Best {
    fn admits(&self, c: EvictionCost) -> bool {
        match (self.limit, self.found) {
            (None, _) => true,
            (Some(l), false) => c <= l,
            (Some(l), true) => c < l,
        }
    }

    fn record(&mut self, c: EvictionCost) {
        self.limit = Some(c);
        self.found = true;
    }
}

struct Group {
    benefit: u64,
    cost: u64,
    members: Vec<usize>,
}

struct Cover<'a> {
    groups: &'a [Group],
    suffix_benefit: Vec<u64>,
    choice: Vec<usize>,
    best: Best,
    best_choice: Vec<usize>,
}

impl Cover<'_> {
    fn dfs(&mut self, g: usize, rem: u64, cost: EvictionCost) {
        if rem == 0 {
            if self.best.admits(cost) {
                self.best.record(cost);
                self.best_choice.clone_from(&self.choice);
            }
            return;
        }
        if g == self.groups.len() || self.suffix_benefit[g] < rem {
            return;
        }
        if !self.best.admits(cost.plus(rem, 1)) {
            return;
        }
        let grp = &self.groups[g];
        let useful = rem.div_ceil(grp.benefit).min(grp.members.len() as u64) as usize;
        for t in (0..=useful).rev() {
            self.choice[g] = t;
            let freed = grp.benefit * t as u64;
            self.dfs(g + 1, rem.saturating_sub(freed), cost.plus(grp.cost * t as u64, t as u32));
        }
        self.choice[g] = 0;
    }
}

/// The cheapest subset of `items` whose benefits sum to at least `need`,
/// costing at most `limit`; returns item indices (ascending) and the cost.
/// `need == 0` gives the empty set.
pub(crate) fn min_cover(
    items: &[Item],
    need: u64,
    limit: Option<EvictionCost>,
) -> Option<(Vec<usize>, EvictionCost)> {
    let mut order: Vec<usize> = (0..items.len()).filter(|&i| items[i].benefit > 0).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(items[i].benefit), items[i].cost, i));
    let mut groups: Vec<Group> = Vec::new();
    for i in order {
        match groups.last_mut() {
            Some(g) if g.benefit == items[i].benefit && g.cost == items[i].cost => g.members.push(i),
            _ => groups.push(Group { benefit: items[i].benefit, cost: items[i].cost, members: vec![i] }),
        }
    }
    let mut suffix_benefit = vec![0u64; groups.len() + 1];
    for g in (0..groups.len()).rev() {
        suffix_benefit[g] = suffix_benefit[g + 1] + groups[g].benefit * groups[g].members.len() as u64;
    }
    let mut search = Cover {
        groups: &groups,
        suffix_benefit,
        choice: vec![0; groups.len()],
        best: Best { limit, found: false },
        best_choice: Vec::new(),
    };
    search.dfs(0, need, EvictionCost::default());
    if !search.best.found {
        return None;
    }
    let cost = search.best.limit.expect("recorded with the solution");
    let mut chosen: Vec<usize> =
        search.best_choice.iter().zip(&groups).flat_map(|(&t, g)| g.members[..t].iter().copied()).collect();
    chosen.sort_unstable();
    Some((chosen, cost))
}

/// A GPU that could be emptied: every tenant on it is evictable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Clearable {
    /// The GPU's index on the node.
    pub gpu: u32,
    /// Indices (into the tenant cost table) of the deployments on it.
    pub tenants: Vec<usize>,
}

struct Clear<'a> {
    gpus: &'a [Clearable],
    costs: &'a [u64],
    k: usize,
    marks: Vec<u32>,
    chosen: Vec<usize>,
    best: Best,
    best_chosen: Vec<usize>,
}

impl Clear<'_> {
    fn dfs(&mut self, pos: usize, cost: EvictionCost) {
        if !self.best.admits(cost) {
            return;
        }
        if self.chosen.len() == self.k {
            self.best.record(cost);
            self.best_chosen.clone_from(&self.chosen);
            return;
        }
        if self.gpus.len() - pos < self.k - self.chosen.len() {
            return;
        }
        // Take this GPU: pay for its tenants not already evicted.
        let mut added = EvictionCost::default();
        for &t in &self.gpus[pos].tenants {
            if self.marks[t] == 0 {
                added = added.plus(self.costs[t], 1);
            }
            self.marks[t] += 1;
        }
        self.chosen.push(pos);
        self.dfs(pos + 1, cost.plus(added.bytes, added.count));
        self.chosen.pop();
        for &t in &self.gpus[pos].tenants {
            self.marks[t] -= 1;
        }
        // Or leave it.
        self.dfs(pos + 1, cost);
    }
}

/// The cheapest way to empty `k` of `gpus`, costing at most `limit`:
/// returns the GPU indices chosen (ascending), the tenants evicted
/// (ascending indices into `costs`) and the cost.
pub(crate) fn min_clear(
    gpus: &[Clearable],
    costs: &[u64],
    k: usize,
    limit: Option<EvictionCost>,
) -> Option<(Vec<u32>, Vec<usize>, EvictionCost)> {
    if k == 0 || gpus.len() < k {
        return None;
    }
    let alone = |c: &Clearable| c.tenants.iter().map(|&t| costs[t]).sum::<u64>();
    let mut ordered: Vec<Clearable> = gpus.to_vec();
    ordered.sort_by_key(|c| (alone(c), c.gpu));
    let mut search = Clear {
        gpus: &ordered,
        costs,
        k,
        marks: vec![0; costs.len()],
        chosen: Vec::with_capacity(k),
        best: Best { limit, found: false },
        best_chosen: Vec::new(),
    };
    search.dfs(0, EvictionCost::default());
    if !search.best.found {
        return None;
    }
    let cost = search.best.limit.expect("recorded with the solution");
    let mut chosen: Vec<u32> = search.best_chosen.iter().map(|&p| ordered[p].gpu).collect();
    chosen.sort_unstable();
    let mut evicted: Vec<usize> =
        search.best_chosen.iter().flat_map(|&p| ordered[p].tenants.iter().copied()).collect();
    evicted.sort_unstable();
    evicted.dedup();
    Some((chosen, evicted, cost))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn items(sizes: &[u64]) -> Vec<Item> {
        sizes.iter().map(|&s| Item { benefit: s, cost: s }).collect()
    }

    #[test]
    fn one_large_tenant_beats_two_small_ones() {
        // The reference's greedy smallest-first would evict 10 + 25.
        let (set, cost) = min_cover(&items(&[10, 25, 30]), 30, None).unwrap();
        assert_eq!(set, vec![2]);
        assert_eq!(cost, EvictionCost { non_hotswap: false, bytes: 30, count: 1 });
    }

    #[test]
    fn least_bytes_wins_then_fewest_evictions() {
        // 20 + 20 = 40 frees exactly; 45 alone wastes more bytes.
        let (set, cost) = min_cover(&items(&[20, 20, 45]), 40, None).unwrap();
        assert_eq!((set, cost), (vec![0, 1], EvictionCost { non_hotswap: false, bytes: 40, count: 2 }));
        // 10 + 30 and 40 both cost 40: one eviction beats two.
        let (set, _) = min_cover(&items(&[10, 30, 40]), 35, None).unwrap();
        assert_eq!(set, vec![2]);
    }

    #[test]
    fn multi_gpu_tenants_cost_all_their_bytes() {
        // Evicting the spanning tenant frees 40 here but costs 160.
        let it =
            [Item { benefit: 40, cost: 160 }, Item { benefit: 25, cost: 25 }, Item { benefit: 20, cost: 20 }];
        let (set, cost) = min_cover(&it, 40, None).unwrap();
        assert_eq!((set, cost.bytes), (vec![1, 2], 45));
    }

    #[test]
    fn impossible_and_over_limit_give_none() {
        assert_eq!(min_cover(&items(&[10, 10]), 25, None), None);
        let limit = Some(EvictionCost { non_hotswap: false, bytes: 29, count: 9 });
        assert_eq!(min_cover(&items(&[30]), 30, limit), None);
        // A tie with the limit is kept, so other nodes' equal sets can be drawn.
        let limit = Some(EvictionCost { non_hotswap: false, bytes: 30, count: 1 });
        assert!(min_cover(&items(&[30]), 30, limit).is_some());
        assert_eq!(min_cover(&items(&[5]), 0, None), Some((vec![], EvictionCost::default())));
    }

    #[test]
    fn many_identical_tenants_are_searched_as_a_group() {
        let sizes = vec![3u64; 40];
        let (set, cost) = min_cover(&items(&sizes), 50, None).unwrap();
        assert_eq!(set.len(), 17);
        assert_eq!(cost.bytes, 51);
    }

    #[test]
    fn clearing_pays_once_for_a_tenant_spanning_gpus() {
        // GPUs 0 and 1 share tenant 0 (160 bytes); GPU 2 has two tenants of 50.
        let gpus = [
            Clearable { gpu: 0, tenants: vec![0] },
            Clearable { gpu: 1, tenants: vec![0] },
            Clearable { gpu: 2, tenants: vec![1, 2] },
        ];
        let costs = [160, 50, 50];
        let (chosen, evicted, cost) = min_clear(&gpus, &costs, 2, None).unwrap();
        assert_eq!(
            (chosen, evicted, cost),
            (vec![0, 1], vec![0], EvictionCost { non_hotswap: false, bytes: 160, count: 1 })
        );
        let (chosen, evicted, _) = min_clear(&gpus, &costs, 1, None).unwrap();
        assert_eq!((chosen, evicted), (vec![2], vec![1, 2]));
        assert_eq!(min_clear(&gpus, &costs, 4, None), None);
    }

    fn brute_cover(items: &[Item], need: u64) -> Option<EvictionCost> {
        (0u32..1 << items.len())
            .filter_map(|mask| {
                let chosen = (0..items.len()).filter(|i| mask & (1 << i) != 0);
                let (b, c, n) =
                    chosen.fold((0, 0, 0), |(b, c, n), i| (b + items[i].benefit, c + items[i].cost, n + 1));
                (b >= need).then_some(EvictionCost { non_hotswap: false, bytes: c, count: n })
            })
            .min()
    }

    proptest! {
        #[test]
        fn cover_matches_brute_force(
            raw in prop::collection::vec((1u64..60, 0u64..60), 0..12),
            need in 0u64..200,
        ) {
            let items: Vec<Item> = raw.iter().map(|&(b, extra)| Item { benefit: b, cost: b + extra }).collect();
            let got = min_cover(&items, need, None);
            prop_assert_eq!(got.as_ref().map(|g| g.1), brute_cover(&items, need));
            if let Some((set, cost)) = got {
                let b: u64 = set.iter().map(|&i| items[i].benefit).sum();
                let c: u64 = set.iter().map(|&i| items[i].cost).sum();
                prop_assert!(b >= need);
                prop_assert_eq!(EvictionCost { non_hotswap: false, bytes: c, count: set.len() as u32 }, cost);
            }
        }

        #[test]
        fn clear_matches_brute_force(
            tenancy in prop::collection::vec(prop::collection::vec(0usize..6, 0..3), 1..7),
            costs in prop::collection::vec(1u64..100, 6),
            k in 1usize..4,
        ) {
            let gpus: Vec<Clearable> = tenancy.iter().enumerate().map(|(i, t)| {
                let mut t = t.clone();
                t.sort_unstable();
                t.dedup();
                Clearable { gpu: i as u32, tenants: t }
            }).collect();
            let brute = (0u32..1 << gpus.len())
                .filter(|m| m.count_ones() as usize == k)
                .map(|m| {
                    let mut ev: Vec<usize> = (0..gpus.len()).filter(|i| m & (1 << i) != 0)
                        .flat_map(|i| gpus[i].tenants.clone()).collect();
                    ev.sort_unstable();
                    ev.dedup();
                    EvictionCost { non_hotswap: false, bytes: ev.iter().map(|&t| costs[t]).sum(), count: ev.len() as u32 }
                })
                .min();
            prop_assert_eq!(min_clear(&gpus, &costs, k, None).map(|r| r.2), brute);
        }
    }
}
