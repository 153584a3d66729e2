//! Publish-side dedupe of ingestion events (sans-IO).
//!
//! An ingestion is *published* when it leaves an artifact stored on this
//! node: a producer's `CommitRegister` (the synchronous publish request) or
//! the store of an artifact a load fetched from a peer or the fallback (the
//! automatic publish after `ingestion_completed`). Publishing puts an
//! `ingestion_published` event on `/v1/events` and in the log and makes
//! the daemon heartbeat the registry at once, so peers find the new holder
//! without waiting for the next period.
//!
//! Both flows can publish the same artifact — a fetch is stored while a
//! producer registers the same bytes, or eight tensor-parallel ranks
//! register one replicated artifact — so, as TensorCast's metadata
//! gateway does, publishes are deduplicated by **publish context id**: the
//! first ingestion of an artifact mints the context and publishes; an
//! ingestion of the same artifact within the **window** after it joins
//! that context, and its publish is a no-op that refreshes the window (a
//! TTL refresh): no second event, no extra heartbeat. The window defaults
//! to [`DEFAULT_WINDOW_MS`], the registry's default TTL — how long a
//! published holding stands without being heard again.
//!
//! [`PublishDedupe`] takes `now` and returns decisions; the daemon carries
//! them out.

use std::collections::HashMap;

use hangar_core::Millis;

use crate::id::ArtifactId;

/// The default dedupe window: the registry's default TTL (10 s).
pub const DEFAULT_WINDOW_MS: Millis = 10_000;

/// What to do with one publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// First in its window: publish it, under `context`.
    Publish {
        /// The publish context it opened (the ingestion's own).
        context: u64,
    },
    /// The artifact was published within the window under `context`; this
    /// publish joins it and only refreshes the window.
    Duplicate {
        /// The context it joined.
        context: u64,
    },
}

/// The live publish contexts: per artifact, the context that published it
/// and when its window ends.
///
/// Invariant: every entry's window ends after the last publish that
/// created or refreshed it by exactly the window; an entry whose window
/// has ended is treated as absent (and is removed on the next publish).
#[derive(Debug, Clone)]
pub struct PublishDedupe {
    window: Millis,
    live: HashMap<ArtifactId, (u64, Millis)>,
}

impl PublishDedupe {
    /// A dedupe with `window` ms (0: every publish is published).
    pub fn new(window: Millis) -> Self {
        PublishDedupe { window, live: HashMap::new() }
    }

    /// A publish of `id` by the ingestion whose context is `context`, at
    /// `now` (monotonic, never decreasing across calls).
    pub fn publish(&mut self, now: Millis, id: ArtifactId, context: u64) -> Decision {
        self.live.retain(|_, (_, until)| *until > now);
        if self.window == 0 {
            return Decision::Publish { context };
        }
        match self.live.get_mut(&id) {
            Some((joined, until)) => {
                *until = now + self.window;
                Decision::Duplicate { context: *joined }
            }
            None => {
                self.live.insert(id, (context, now + self.window));
                Decision::Publish { context }
            }
        }
    }

    /// Forgets `id`'s context: its next publish is published (an artifact
    /// removed from the store is new again when it comes back).
    pub fn forget(&mut self, id: &ArtifactId) {
        self.live.remove(id);
    }

    /// Artifacts with a live context at `now`.
    pub fn live(&self, now: Millis) -> usize {
        self.live.values().filter(|(_, until)| *until > now).count()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn id(n: u8) -> ArtifactId {
        ArtifactId::Full { index: [n; 32], data: [n; 32] }
    }

    #[test]
    fn the_first_publishes_a_later_one_in_the_window_joins_and_refreshes() {
        let mut d = PublishDedupe::new(100);
        assert_eq!(d.publish(0, id(1), 7), Decision::Publish { context: 7 });
        assert_eq!(d.publish(99, id(1), 8), Decision::Duplicate { context: 7 });
        // Refreshed at 99: still live at 198.
        assert_eq!(d.publish(198, id(1), 9), Decision::Duplicate { context: 7 });
        assert_eq!(d.publish(298, id(1), 10), Decision::Publish { context: 10 });
        assert_eq!(d.publish(298, id(2), 11), Decision::Publish { context: 11 }, "per artifact");
        d.forget(&id(2));
        assert_eq!(d.publish(299, id(2), 12), Decision::Publish { context: 12 });
        assert_eq!(PublishDedupe::new(0).publish(0, id(1), 1), Decision::Publish { context: 1 });
    }

    proptest! {
        /// Against a model: an artifact is published iff no publish of it
        /// (published or joined) came within the window before; a joined
        /// publish names the context that published.
        #[test]
        fn matches_the_model_on_noisy_arrivals(
            window in 1u64..500,
            arrivals in prop::collection::vec((0u64..300, 0u8..4), 1..200),
        ) {
            let mut d = PublishDedupe::new(window);
            let mut now = 0;
            let mut last: HashMap<u8, (u64, Millis)> = HashMap::new();
            for (ctx, (gap, which)) in arrivals.into_iter().enumerate() {
                now += gap;
                let ctx = ctx as u64;
                let got = d.publish(now, id(which), ctx);
                let want = match last.get(&which) {
                    Some(&(c, at)) if now < at + window => Decision::Duplicate { context: c },
                    _ => Decision::Publish { context: ctx },
                };
                prop_assert_eq!(got, want);
                let c = match want { Decision::Publish { context } | Decision::Duplicate { context } => context };
                last.insert(which, (c, now));
                prop_assert!(d.live(now) <= 4);
            }
        }
    }
}
