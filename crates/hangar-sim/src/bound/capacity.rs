//! The replicas beyond the first: permits.
//!
//! A replica has `permits` of them, and a request holds one from its grant
//! `g ∈ [a, d]` for at least `s`. Within a window `[t0, t1)` a request that
//! arrived in it therefore holds a permit for at least
//! `min(s, t1 − d)` (when positive), so the replicas up in the window add
//! up to at least `Σ min(s, t1 − d) / permits` replica-time; the first
//! replica gives at most the window's length, and the rest must come from
//! others. Summed over windows that do not overlap, that excess is a
//! lower bound on the up-time beyond the first replica — which
//! [`super::cover`] does not count — for any choice of windows; this picks
//! the best choice of consecutive whole-second windows of at most two
//! minutes.

use super::jobs::Job;

/// Window ends fall on whole seconds.
const STEP_US: i64 = 1_000_000;
/// The longest window, in steps.
const LONGEST: usize = 120;

/// Replica-microseconds of up-time the jobs need beyond one replica.
pub(crate) fn beyond_one(jobs: &[Job], permits: u32) -> i64 {
    if jobs.is_empty() {
        return 0;
    }
    let permits = i64::from(permits.max(1));
    let mut jobs = jobs.to_vec();
    jobs.sort_by_key(|j| j.a);
    let horizon = jobs.iter().map(|j| j.d + j.s).max().unwrap_or(0);
    let steps = usize::try_from((horizon + STEP_US - 1) / STEP_US).unwrap_or(0) + 1;
    let at = |k: usize| k as i64 * STEP_US;
    // best[k]: the most excess from windows ending by step k.
    let mut best = vec![0i64; steps + 1];
    for end in 1..=steps {
        best[end] = best[end - 1];
        let t1 = at(end);
        let mut demand = 0;
        // Jobs arriving before `t1`, newest first.
        let mut i = jobs.partition_point(|j| j.a < t1);
        for start in (end.saturating_sub(LONGEST)..end).rev() {
            let t0 = at(start);
            while i > 0 && jobs[i - 1].a >= t0 {
                i -= 1;
                let j = jobs[i];
                demand += j.s.min(t1 - j.d).max(0);
            }
            let excess = (demand / permits - (t1 - t0)).max(0);
            best[end] = best[end].max(best[start] + excess);
        }
    }
    best[steps]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_permit_and_simultaneous_requests_need_a_replica_each() {
        // Three requests at once, each holding its permit 10 s, granted at
        // once (d = a): with one permit a replica, three replicas for 10 s
        // — two beyond the first, 20 s, in the window [0, 10 s).
        let jobs = vec![Job { a: 0, d: 0, s: 10 * STEP_US }; 3];
        assert_eq!(beyond_one(&jobs, 1), 20 * STEP_US);
        // With three permits, one replica holds them all.
        assert_eq!(beyond_one(&jobs, 3), 0);
    }

    #[test]
    fn requests_that_may_wait_past_the_window_count_only_what_they_must_hold() {
        // Granted up to 5 s late: within [0, 10 s) each holds at least 5 s.
        let jobs = vec![Job { a: 0, d: 5 * STEP_US, s: 10 * STEP_US }; 3];
        let got = beyond_one(&jobs, 1);
        // Over [0, 15 s): 30 s held, one replica gives 15: 15 beyond.
        assert_eq!(got, 15 * STEP_US);
    }

    #[test]
    fn light_load_needs_nothing_beyond_one() {
        let jobs: Vec<Job> =
            (0..100).map(|i| Job { a: i * 2 * STEP_US, d: i * 2 * STEP_US, s: STEP_US }).collect();
        assert_eq!(beyond_one(&jobs, 1), 0);
    }
}
