//! The scale-down policy against a model that remembers every observation
//! of the current excess.

use hangar_queue::ScaleDown;
use proptest::prelude::*;

proptest! {
    #[test]
    fn keeps_the_peak_of_a_whole_quiet_period_and_never_more_than_it_has(
        after in 1u64..3_000,
        steps in prop::collection::vec((0u64..1_500, 0u32..5, 0u32..5), 1..200),
    ) {
        let mut policy = ScaleDown::new(after);
        let mut now = 0;
        // Observations (time, demand) since the excess began.
        let mut run: Vec<(u64, u32)> = Vec::new();
        for (dt, demand, up) in steps {
            now += dt;
            let got = policy.observe(now, demand, up);
            if demand >= up {
                prop_assert_eq!(got, None, "no excess, nothing to give back");
                run.clear();
                continue;
            }
            run.push((now, demand));
            let started = run[0].0;
            if now - started < after {
                prop_assert_eq!(got, None, "the quiet period has not passed");
                continue;
            }
            let peak = run.iter().map(|&(_, d)| d).max().unwrap();
            // Replicas may have gone during the period: never below its peak.
            let want = (peak < up).then_some(peak);
            prop_assert_eq!(got, want, "after the period: the peak of the period, if fewer than up");
            run.clear();
        }
        let pending = run.first().map(|&(t, _)| t + after);
        prop_assert_eq!(policy.poll_timeout(), pending);
    }
}
