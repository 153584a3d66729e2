//! What letting requests go may save in the first layer: the most by
//! which [`super::cover`]'s optimum can drop when `m` of a segment's jobs
//! need not be served, for each `m`, as a list of non-increasing
//! marginals (the first `m` add up to that most).
//!
//! Two bounds, each valid for any set `D` of jobs let go, and the least of
//! them (and of the segment's whole cost) is taken:
//!
//! - **A component each**: from an optimum `S` for the jobs kept, adding a
//!   component `[a, a + s]` of its own for each job of `D` serves it, so
//!   `OPT(all) ≤ OPT(kept) + Σ (s + restart)`. Tight when requests are
//!   sparse, far too generous when they are dense (letting one go of many
//!   that overlap saves almost nothing).
//! - **Filling in**: every job `k` kept pins `S` up over its *forced*
//!   stretch `F_k = [d_k, a_k + s_k]` (any component serving it starts by
//!   `d_k` and lasts past `a_k + s_k`). Adding `I_j = [a_j, a_j + s_j]` to
//!   `S` for each `j` of `D` serves `j` (granted at its arrival) and adds
//!   (1) the time of the `I_j` outside every kept job's forced stretch —
//!   time outside all forced stretches, at most `|I_j \ ∪F|` per job, or
//!   time whose every forced stretch belongs to a job of `D`, at most
//!   `w_k = ∫_{F_k} dt / c(t)` per job `k` (`c(t)`: how many forced
//!   stretches hold `t`) — and (2) a restart for each new component, a
//!   piece of the fills touching no kept job's forced stretch. Take any
//!   `I_j` in it: `j` and the `n_j` jobs whose forced stretch touches
//!   `I_j` are all let go and all lie in that piece, so charging
//!   `restart / (n_j + 1)` to each pays for it, and no job is charged by
//!   two pieces: a job pays at most `r_k = restart / (1 + the least n_j`
//!   over `j = k` and the jobs whose `I_j` touches `F_k)`. So
//!   `OPT(all) ≤ OPT(kept) + Σ_{j ∈ D} v_j` with `v_j = |I_j \ ∪F| +
//!   w_j + r_j`.
//!
//! Each bound's largest `m` values summed is the most it allows for `m`
//! jobs; both are concave in `m`, and so is their least, so its marginals
//! do not increase and a caller may pool segments' marginals and take
//! the largest.

use super::jobs::Job;

/// The marginals (µs, non-increasing, non-negative, adding up to at most
/// `cost`) of what letting go of 1, 2, … of `seg`'s jobs may save, `cost`
/// the segment's first-layer cost (or a lower bound of it).
pub(crate) fn marginals(seg: &[Job], restart: i64, cost: i64) -> Vec<f64> {
    let mut own: Vec<f64> = seg.iter().map(|j| (j.s + restart) as f64).collect();
    let mut fill = fill_in(seg, restart);
    for v in [&mut own, &mut fill] {
        v.sort_unstable_by(|a, b| b.total_cmp(a));
    }
    let (mut p_own, mut p_fill, mut last) = (0.0, 0.0, 0.0);
    let mut out = Vec::new();
    for (o, f) in own.into_iter().zip(fill) {
        p_own += o;
        p_fill += f;
        let most = p_own.min(p_fill).min(cost as f64);
        if most <= last {
            break;
        }
        out.push(most - last);
        last = most;
    }
    out
}

/// A function of time that is constant between breakpoints, integrated:
/// `at(x)` is its integral from the first breakpoint to `x`.
struct Integral {
    times: Vec<i64>,
    /// The integral up to each breakpoint.
    upto: Vec<f64>,
    /// The function's value from each breakpoint to the next.
    value: Vec<f64>,
}

impl Integral {
    fn at(&self, x: i64) -> f64 {
        let i = self.times.partition_point(|&t| t <= x);
        if i == 0 {
            return 0.0;
        }
        self.upto[i - 1] + (x - self.times[i - 1]) as f64 * self.value[i - 1]
    }
}

/// `v_j` of the module docs for each job, in `seg`'s order.
fn fill_in(seg: &[Job], restart: i64) -> Vec<f64> {
    let restart = restart as f64;
    let forced = |j: &Job| j.e() >= j.d;
    // How many forced stretches of positive length hold each moment: the
    // covered time (`c ≥ 1`) and `1 / c` over it, integrated.
    let mut events: Vec<(i64, i32)> = Vec::new();
    for j in seg.iter().filter(|j| j.e() > j.d) {
        events.push((j.d, 1));
        events.push((j.e(), -1));
    }
    events.sort_unstable();
    let (mut times, mut c) = (Vec::new(), 0i32);
    let mut counts = Vec::new();
    for (t, delta) in events {
        if times.last() != Some(&t) {
            times.push(t);
            counts.push(c);
        }
        c += delta;
        *counts.last_mut().expect("pushed") = c;
    }
    let integral = |value: &dyn Fn(i32) -> f64| {
        let value: Vec<f64> = counts.iter().map(|&c| value(c)).collect();
        let mut upto = vec![0.0; times.len()];
        for i in 1..times.len() {
            upto[i] = upto[i - 1] + (times[i] - times[i - 1]) as f64 * value[i - 1];
        }
        Integral { times: times.clone(), upto, value }
    };
    let covered = integral(&|c| if c >= 1 { 1.0 } else { 0.0 });
    let share = integral(&|c| if c >= 1 { 1.0 / f64::from(c) } else { 0.0 });

    // n_j: the other jobs whose forced stretch touches I_j = [a_j, e_j].
    let mut starts: Vec<i64> = seg.iter().filter(|j| forced(j)).map(|j| j.d).collect();
    let mut ends: Vec<i64> = seg.iter().filter(|j| forced(j)).map(Job::e).collect();
    starts.sort_unstable();
    ends.sort_unstable();
    let touching = |j: &Job| {
        starts.partition_point(|&d| d <= j.e()) - ends.partition_point(|&e| e < j.a) - usize::from(forced(j))
    };
    let n: Vec<usize> = seg.iter().map(touching).collect();
    let fewest = fewest_touching(seg, &n);
    seg.iter()
        .enumerate()
        .map(|(i, k)| {
            let outside = k.s as f64 - (covered.at(k.e()) - covered.at(k.a));
            let w = if k.e() > k.d { share.at(k.e()) - share.at(k.d) } else { 0.0 };
            let r = restart / (1 + n[i].min(fewest[i])) as f64;
            outside.max(0.0) + w + r
        })
        .collect()
}

/// For each job `k` with a forced stretch, the least `n_j` of the other
/// jobs whose `I_j` touches `F_k` (`a_j ≤ e_k` and `e_j ≥ d_k`);
/// `usize::MAX` for none. Offline: queries by `e_k`, jobs added by `a_j`
/// into a Fenwick tree of minima over `e_j`, largest first.
fn fewest_touching(seg: &[Job], n: &[usize]) -> Vec<usize> {
    let mut ends: Vec<i64> = seg.iter().map(Job::e).collect();
    ends.sort_unstable();
    ends.dedup();
    // Position of an end, counted from the largest (1-based).
    let slot = |e: i64| ends.len() - ends.partition_point(|&x| x < e);
    let mut tree = vec![usize::MAX; ends.len() + 1];
    let mut by_a: Vec<usize> = (0..seg.len()).collect();
    by_a.sort_unstable_by_key(|&j| seg[j].a);
    let mut queries: Vec<usize> = (0..seg.len()).filter(|&k| seg[k].e() >= seg[k].d).collect();
    queries.sort_unstable_by_key(|&k| seg[k].e());
    let mut out = vec![usize::MAX; seg.len()];
    let mut next = 0;
    for k in queries {
        let (d, e) = (seg[k].d, seg[k].e());
        while next < by_a.len() && seg[by_a[next]].a <= e {
            let j = by_a[next];
            // `k` itself is among them: its own I_k holds F_k. Its n_k
            // stands in the minimum anyway, so it needs no exclusion.
            let mut i = slot(seg[j].e());
            while i < tree.len() {
                tree[i] = tree[i].min(n[j]);
                i += i & i.wrapping_neg();
            }
            next += 1;
        }
        // Ends at least `d`: slots 1 ..= slot(d).
        let mut i = slot(d);
        let mut least = usize::MAX;
        while i > 0 {
            least = least.min(tree[i]);
            i -= i & i.wrapping_neg();
        }
        out[k] = least;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::cover::min_cover;
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// On small random cases, letting any set of jobs go saves no more
    /// than the marginals allow for that many: checked against the exact
    /// optimum with and without every subset.
    #[test]
    fn no_set_let_go_saves_more_than_the_marginals_allow() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for case in 0..300 {
            let n = rng.random_range(1..=7);
            let restart = [0, 1, 3, 8][rng.random_range(0..4)];
            let dense = rng.random_bool(0.5);
            let jobs: Vec<Job> = (0..n)
                .map(|_| {
                    let a = rng.random_range(0..if dense { 12 } else { 60 });
                    let s = rng.random_range(1..=8);
                    Job { a, d: a + rng.random_range(0..=5), s }
                })
                .collect();
            let all = min_cover(&jobs, restart, 1 << 20).cost;
            let m = marginals(&jobs, restart, all);
            for mask in 1u32..(1 << n) {
                let kept: Vec<Job> = (0..n).filter(|i| mask >> i & 1 == 0).map(|i| jobs[i]).collect();
                let rest = min_cover(&kept, restart, 1 << 20).cost;
                let gone = mask.count_ones() as usize;
                let allowed: f64 = m.iter().take(gone).sum();
                assert!(
                    (all - rest) as f64 <= allowed + 1e-6,
                    "case {case}: letting {mask:b} go saves {} > {allowed}: {jobs:?} restart {restart}",
                    all - rest
                );
            }
            assert!(m.windows(2).all(|w| w[0] >= w[1] - 1e-9), "case {case}: {m:?}");
        }
    }

    #[test]
    fn among_dense_requests_one_let_go_saves_little() {
        // Forty requests a unit apart, each held 10 with a slack of 2: any
        // moment is pinned by eight of them, so ten let go free little —
        // not the 150 of a component each.
        let jobs: Vec<Job> = (0..40).map(|i| Job { a: i, d: i + 2, s: 10 }).collect();
        let cost = min_cover(&jobs, 5, 1 << 20).cost;
        let m = marginals(&jobs, 5, cost);
        assert!(m.iter().take(10).sum::<f64>() < 30.0, "{m:?}");
        // Sparse ones save their whole stretch and a restart each.
        let sparse: Vec<Job> = (0..4).map(|i| Job { a: i * 100, d: i * 100, s: 10 }).collect();
        let cost = min_cover(&sparse, 5, 1 << 20).cost;
        assert_eq!(marginals(&sparse, 5, cost), vec![15.0; 4]);
    }
}
