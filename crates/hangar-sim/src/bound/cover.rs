//! The least cost of keeping *a* replica of one model up for every
//! request that must meet its objective: the first layer of the bound.
//!
//! The problem, in integer microseconds: jobs `(a, d, s)` must each be
//! served — granted at some `g ∈ [a, d]` and kept for `s` — by an
//! interval of time during which the model has a replica up. The up-time
//! is a union of disjoint *components* `[x, y]`, each costing its length
//! plus `restart` (the least load that puts a replica up). A component
//! serves job `j` exactly when `x ≤ d`, `y ≥ a + s` and `y − x ≥ s`.
//!
//! [`min_cover`] finds the exact minimum by a search over component ends,
//! resting on three facts (each checked against brute force in the tests):
//!
//! - *lazy starts*: a component can be shifted later, keeping its length
//!   and what it serves, until it starts at the deadline of a job it
//!   serves; so each component starts at the earliest deadline of the
//!   jobs not yet served (a later start would leave that job unserved for
//!   ever);
//! - *no short gaps*: two components less than `restart` apart cost more
//!   than one spanning both, which serves all they serve;
//! - the state after a component ending at `y` is `y` and the jobs it
//!   left behind that had already arrived and ended (`a + s ≤ y`, too long
//!   for it): each needs a later component starting by its `d` and at
//!   least `s` long, so only the staircase of `(d, s)` not implied by
//!   another matters. Every job with `a + s > y` is still unserved.
//!
//! Jobs whose windows `[a, d + s]` lie `restart` or more apart never share
//! a component, so [`segments`] splits them and each is solved alone: the
//! sum is the whole optimum.

use std::collections::BTreeMap;

use super::jobs::Job;

/// Before any component.
const START: i64 = i64::MIN / 4;

/// A solved segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cover {
    /// The least cost (µs), or a lower bound of it when not `exact`.
    pub cost: i64,
    /// Whether the search finished within its budget; if not, `cost` is
    /// the weaker [`forced_bound`].
    pub exact: bool,
}

/// Splits jobs (any order) into runs whose windows `[a, d + s]` are at
/// least `restart` apart from the next run's, each sorted by arrival.
pub(crate) fn segments(jobs: &[Job], restart: i64) -> Vec<Vec<Job>> {
    let mut sorted = jobs.to_vec();
    sorted.sort_by_key(|j| (j.a, j.d, j.s));
    let mut out: Vec<Vec<Job>> = Vec::new();
    let mut end = START;
    for j in sorted {
        match out.last_mut() {
            Some(seg) if j.a < end.saturating_add(restart) => seg.push(j),
            _ => out.push(vec![j]),
        }
        end = end.max(j.d + j.s);
    }
    out
}

/// The exact least cost of serving every job, or [`forced_bound`] when the
/// search would visit more than `budget` states.
pub(crate) fn min_cover(jobs: &[Job], restart: i64, budget: usize) -> Cover {
    if jobs.is_empty() {
        return Cover { cost: 0, exact: true };
    }
    match Search::new(jobs, restart).run(budget) {
        Some(cost) => Cover { cost, exact: true },
        None => Cover { cost: forced_bound(jobs, restart), exact: false },
    }
}

/// A weaker lower bound, for a search over budget: the time some job's
/// service must cover whatever its grant (`[d, a + s]`, when `s > d − a`),
/// plus, between those stretches, the gap or a restart, whichever is
/// less; and never less than the longest job and one start.
pub(crate) fn forced_bound(jobs: &[Job], restart: i64) -> i64 {
    let mut forced: Vec<(i64, i64)> = jobs.iter().filter(|j| j.e() > j.d).map(|j| (j.d, j.e())).collect();
    forced.sort_unstable();
    let mut total = 0;
    let mut current: Option<(i64, i64)> = None;
    for (x, y) in forced {
        match current {
            Some((cx, cy)) if x <= cy => current = Some((cx, cy.max(y))),
            Some((cx, cy)) => {
                total += cy - cx + (x - cy).min(restart);
                current = Some((x, y));
            }
            None => current = Some((x, y)),
        }
    }
    if let Some((cx, cy)) = current {
        total += cy - cx;
    }
    let longest = jobs.iter().map(|j| j.s).max().unwrap_or(0);
    (total + restart).max(longest + restart)
}

/// Left-behind jobs as `(d, s)`: sorted by `d`, `s` strictly growing (each
/// needs a component starting by `d`, at least `s` long; one implied by
/// another is dropped).
type Stair = Vec<(i64, i64)>;

fn stair(mut reqs: Vec<(i64, i64)>) -> Stair {
    reqs.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
    let mut out: Stair = Vec::new();
    for (d, s) in reqs {
        if out.last().is_none_or(|&(_, top)| s > top) {
            out.push((d, s));
        }
    }
    out
}

/// Whether every requirement of `a` is implied by one of `b` (`a` asks no
/// more than `b`).
fn easier(a: &Stair, b: &Stair) -> bool {
    a.iter().all(|&(d, s)| {
        // The requirement of `b` with the largest `s` among those due by `d`.
        let k = b.partition_point(|&(bd, _)| bd <= d);
        k > 0 && b[k - 1].1 >= s
    })
}

struct Search {
    /// Sorted by `a + s`.
    jobs: Vec<Job>,
    ends: Vec<i64>,
    /// `sufd[k]`: the earliest deadline among `jobs[k..]`.
    sufd: Vec<i64>,
    /// Job indexes by arrival.
    by_arrival: Vec<usize>,
    arrivals: Vec<i64>,
    longest: i64,
    restart: i64,
}

impl Search {
    fn new(jobs: &[Job], restart: i64) -> Self {
        let mut jobs = jobs.to_vec();
        jobs.sort_by_key(|j| (j.e(), j.d, j.s));
        let ends: Vec<i64> = jobs.iter().map(Job::e).collect();
        let mut sufd = vec![i64::MAX; jobs.len() + 1];
        for k in (0..jobs.len()).rev() {
            sufd[k] = sufd[k + 1].min(jobs[k].d);
        }
        let mut by_arrival: Vec<usize> = (0..jobs.len()).collect();
        by_arrival.sort_by_key(|&i| jobs[i].a);
        let arrivals = by_arrival.iter().map(|&i| jobs[i].a).collect();
        let longest = jobs.iter().map(|j| j.s).max().unwrap_or(0);
        Search { jobs, ends, sufd, by_arrival, arrivals, longest, restart }
    }

    /// Serving every job at its arrival, components bridged over gaps
    /// shorter than a restart: a feasible cost, the search's first bound.
    fn at_arrival(&self) -> i64 {
        let mut spans: Vec<(i64, i64)> = self.jobs.iter().map(|j| (j.a, j.e())).collect();
        spans.sort_unstable();
        let (mut total, mut current) = (0, spans[0]);
        for &(x, y) in &spans[1..] {
            if x < current.1 + self.restart {
                current.1 = current.1.max(y);
            } else {
                total += current.1 - current.0 + self.restart;
                current = (x, y);
            }
        }
        total + current.1 - current.0 + self.restart
    }

    fn run(&self, budget: usize) -> Option<i64> {
        let n = self.jobs.len();
        let mut best = self.at_arrival();
        let mut frontier: BTreeMap<i64, Vec<(i64, Stair)>> = BTreeMap::new();
        frontier.insert(START, vec![(0, Vec::new())]);
        let mut visited = 0usize;
        let mut left: Vec<(i64, i64, usize)> = Vec::new();
        let mut served_late: Vec<(i64, i64, usize)> = Vec::new();
        while let Some((y, states)) = frontier.pop_first() {
            for (cost, stair_in) in states {
                if cost >= best {
                    continue;
                }
                visited += 1;
                if visited > budget {
                    return None;
                }
                let k = self.ends.partition_point(|&e| e <= y);
                let x = self.sufd[k].min(stair_in.first().map_or(i64::MAX, |r| r.0));
                // Jobs not yet ended by `y` that arrived before `x`: served
                // only once the component has run `s` from `x`.
                served_late.clear();
                let from = self.arrivals.partition_point(|&a| a <= y.saturating_sub(self.longest));
                for &i in &self.by_arrival[from..] {
                    let j = self.jobs[i];
                    if j.a >= x {
                        break;
                    }
                    if i >= k {
                        served_late.push((x + j.s, j.d, i));
                    }
                }
                for (id, &(d, s)) in stair_in.iter().enumerate() {
                    served_late.push((x + s, d, n + id));
                }
                served_late.sort_unstable();
                left.clear();
                left.extend(stair_in.iter().enumerate().map(|(id, &(d, s))| (d, s, n + id)));
                let (mut p, mut q, mut late) = (k, 0, k);
                loop {
                    // The next end at which the served set grows: a job
                    // that arrived after `x` ends, or one that arrived
                    // before has run `s` from `x`.
                    while late < n && (late < p || self.jobs[late].a < x) {
                        late += 1;
                    }
                    let t = match (self.ends.get(late), served_late.get(q)) {
                        (Some(&e), Some(&(c, _, _))) => e.min(c),
                        (Some(&e), None) => e,
                        (None, Some(&(c, _, _))) => c,
                        (None, None) => break,
                    };
                    while p < n && self.ends[p] <= t {
                        if self.jobs[p].a < x {
                            left.push((self.jobs[p].d, self.jobs[p].s, p));
                        }
                        p += 1;
                    }
                    while q < served_late.len() && served_late[q].0 <= t {
                        let id = served_late[q].2;
                        left.retain(|r| r.2 != id);
                        q += 1;
                    }
                    let total = cost + (t - x) + self.restart;
                    if total >= best {
                        break;
                    }
                    if p == n && left.is_empty() {
                        best = total;
                        break;
                    }
                    let next = self.sufd[p].min(left.iter().map(|r| r.0).min().unwrap_or(i64::MAX));
                    if next <= t || next < t + self.restart {
                        // Some job can no longer be served, or the next
                        // start is too close: a longer component is better.
                        continue;
                    }
                    let out = stair(left.iter().map(|r| (r.0, r.1)).collect());
                    let at = frontier.entry(t).or_default();
                    if at.iter().any(|(c, s)| *c <= total && easier(s, &out)) {
                        continue;
                    }
                    at.retain(|(c, s)| !(total <= *c && easier(&out, s)));
                    at.push((total, out));
                }
            }
        }
        Some(best)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn job(a: i64, slack: i64, s: i64) -> Job {
        Job { a, d: a + slack, s }
    }

    /// The exact optimum over every union of whole time units in
    /// `[0, horizon)`: an independent check of the search's three facts
    /// (with whole-unit data the optimum has whole-unit ends).
    fn grid_optimum(jobs: &[Job], restart: i64, horizon: u32) -> i64 {
        let mut best = i64::MAX;
        for mask in 0u32..(1 << horizon) {
            let mut runs = Vec::new();
            let mut t = 0;
            while t < horizon {
                if mask >> t & 1 == 1 {
                    let start = t;
                    while t < horizon && mask >> t & 1 == 1 {
                        t += 1;
                    }
                    runs.push((i64::from(start), i64::from(t)));
                } else {
                    t += 1;
                }
            }
            let cost: i64 = runs.iter().map(|(x, y)| y - x + restart).sum();
            if cost >= best {
                continue;
            }
            let serves = |j: &Job| runs.iter().any(|&(x, y)| x <= j.d && y >= j.e() && y - x >= j.s);
            if jobs.iter().all(serves) {
                best = cost;
            }
        }
        best
    }

    #[test]
    fn the_search_finds_the_optimum_of_every_small_case() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for case in 0..400 {
            let horizon = 13;
            let n = rng.random_range(1..=4);
            let restart = [0, 1, 2, 4][rng.random_range(0..4)];
            let jobs: Vec<Job> = (0..n)
                .map(|_| {
                    let s = rng.random_range(1..=4);
                    job(rng.random_range(0..horizon - s - 3), rng.random_range(0..=3), s)
                })
                .collect();
            let want = grid_optimum(&jobs, restart, horizon as u32);
            let by_segment: i64 =
                segments(&jobs, restart).iter().map(|seg| min_cover(seg, restart, 1 << 20).cost).sum();
            assert_eq!(
                min_cover(&jobs, restart, 1 << 20),
                Cover { cost: want, exact: true },
                "case {case}: {jobs:?} restart {restart}"
            );
            assert_eq!(by_segment, want, "case {case}: segments {jobs:?} restart {restart}");
            assert!(forced_bound(&jobs, restart) <= want, "case {case}: {jobs:?}");
        }
    }

    #[test]
    fn worked_cases() {
        // One job: up for its service, one start.
        assert_eq!(min_cover(&[job(5, 10, 3)], 2, 100).cost, 3 + 2);
        // Two jobs far apart: two components.
        assert_eq!(min_cover(&[job(0, 1, 3), job(50, 1, 4)], 2, 100).cost, 3 + 2 + 4 + 2);
        // Two jobs whose grants can meet: the first waits for the second
        // (granted at 4, its deadline; the second arrives at 4).
        assert_eq!(min_cover(&[job(0, 4, 3), job(4, 0, 3)], 10, 100).cost, 3 + 10);
        // Nearer than a restart: one component bridges the gap.
        assert_eq!(min_cover(&[job(0, 0, 3), job(5, 0, 3)], 10, 100).cost, 8 + 10);
        // A long job that arrives while a short one is served waits for a
        // later component, which a third job needs anyway.
        let jobs = [job(0, 0, 1), job(1, 6, 5), job(7, 0, 5)];
        assert_eq!(min_cover(&jobs, 1, 100).cost, (1 + 1) + (5 + 1));
    }

    #[test]
    fn a_search_over_budget_falls_back_to_a_lower_bound() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let jobs: Vec<Job> = (0..300)
            .map(|i| job(i * 700 + rng.random_range(0..500), 2000, rng.random_range(200..4000)))
            .collect();
        let exact = min_cover(&jobs, 640, 1 << 22);
        assert!(exact.exact);
        let capped = min_cover(&jobs, 640, 3);
        assert!(!capped.exact && capped.cost <= exact.cost, "{capped:?} {exact:?}");
    }
}
