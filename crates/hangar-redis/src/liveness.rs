//! [`Liveness`]: which registered nodes are alive, decided as a fleet
//! must — from silence observed while Redis answers, never from a read
//! that failed.
//!
//! A reader (every gateway's view) reads the registry every few hundred
//! milliseconds and feeds each successful read to [`Liveness::observe`]
//! with its `now`; a failed read is [`Liveness::unreachable`]. A node's
//! silence grows by the time between two successful reads in a row in
//! which its heartbeat counter did not move (each gap counted at most
//! `max_gap`, so a reader that was itself stopped does not count its own
//! pause), and the node is declared dead once its silence reaches the
//! TTL. Time around a failed read does not count: an outage, a paused
//! Redis or a reader cut off from it concludes nothing, and once Redis
//! answers again every agent has its whole TTL to beat again.
//!
//! A live node may also be *suspect* ([`Liveness::suspect`]): a gateway
//! found that neither its agent nor any of its engines answers — direct
//! evidence, unlike a silence in Redis, but not proof (a network path may
//! have failed). It stays alive (what it runs is not given up before its
//! TTL) and only hosts nothing new, until its agent is shown to run and to
//! be reachable again. A heartbeat written after the evidence shows it
//! runs: the first read after [`Liveness::suspect`] records the counter,
//! and any higher one makes the node *beating*. A beating node is one to
//! check ([`Liveness::to_reach`]): only when its agent answers the gateway
//! ([`Liveness::reached`]) is the suspicion cleared.
//! A node that beats but does not answer is cut off from the gateway by a
//! network fault, and stays suspect however long it beats. A suspect node
//! that does not beat dies at its TTL as any other.
//!
//! Sans-IO: no clock, no Redis; the same input gives the same output.

use std::collections::BTreeMap;

use hangar_core::Millis;

/// One node's registration as a read saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    /// The node's name.
    pub name: String,
    /// The agent run holding it.
    pub agent: String,
    /// Its heartbeat counter.
    pub beat: u64,
    /// Its agent left on purpose.
    pub left: bool,
}

/// What a read changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// A node is alive that was not: new, or beating again after it was
    /// declared dead.
    Joined {
        /// The node.
        name: String,
        /// Its agent run.
        agent: String,
    },
    /// Another run holds a live node's name: the old run's node is gone,
    /// the new one's joined.
    Replaced {
        /// The node.
        name: String,
        /// The run that held it.
        old: String,
        /// The run that holds it now.
        new: String,
    },
    /// A node was silent for the TTL while Redis answered.
    Died {
        /// The node.
        name: String,
        /// Its agent run.
        agent: String,
    },
    /// A node's agent left on purpose.
    Left {
        /// The node.
        name: String,
        /// Its agent run.
        agent: String,
    },
}

#[derive(Debug, Clone)]
struct Track {
    agent: String,
    beat: u64,
    silent: Millis,
    dead: bool,
    suspect: Option<Suspicion>,
}

/// A suspect node's heartbeat counter as the first read after the
/// evidence saw it (`None` until that read), and whether it beat since.
#[derive(Debug, Clone, Copy)]
struct Suspicion {
    beat_after: Option<u64>,
    beating: bool,
}

impl Track {
    fn new(agent: &str, beat: u64) -> Self {
        Track { agent: agent.to_owned(), beat, silent: 0, dead: false, suspect: None }
    }
}

/// The liveness of every registered node. See the module doc.
#[derive(Debug, Clone)]
pub struct Liveness {
    ttl: Millis,
    max_gap: Millis,
    /// When the last read succeeded, if the one before it did too (or it
    /// was the first).
    last_ok: Option<Millis>,
    nodes: BTreeMap<String, Track>,
}

impl Liveness {
    /// Nodes die after `ttl` ms of observed silence; one gap between reads
    /// counts at most `max_gap` ms.
    pub fn new(ttl: Millis, max_gap: Millis) -> Self {
        Liveness { ttl, max_gap, last_ok: None, nodes: BTreeMap::new() }
    }

    /// Every live node and its agent run.
    pub fn alive(&self) -> impl Iterator<Item = (&str, &str)> {
        self.nodes.iter().filter(|(_, t)| !t.dead).map(|(n, t)| (n.as_str(), t.agent.as_str()))
    }

    /// Whether node `name` is alive.
    pub fn is_alive(&self, name: &str) -> bool {
        self.nodes.get(name).is_some_and(|t| !t.dead)
    }

    /// Whether node `name` is alive but suspect (see the module doc).
    pub fn is_suspect(&self, name: &str) -> bool {
        self.nodes.get(name).is_some_and(|t| !t.dead && t.suspect.is_some())
    }

    /// Node `name` was found not answering — its agent nor any engine —
    /// before the next read: it is suspect until a heartbeat written after
    /// that read, and then an answer of its agent. Returns whether it
    /// became suspect (false: unknown, dead, or suspect already). New
    /// evidence against a suspect node asks for a beat after it again, so
    /// that no check begun before it clears the suspicion.
    pub fn suspect(&mut self, name: &str) -> bool {
        match self.nodes.get_mut(name) {
            Some(t) if !t.dead => {
                let became = t.suspect.is_none();
                t.suspect = Some(Suspicion { beat_after: None, beating: false });
                became
            }
            _ => false,
        }
    }

    /// The suspect nodes that beat after the evidence: their agents run,
    /// and whether the gateway reaches them is to be checked.
    pub fn to_reach(&self) -> impl Iterator<Item = &str> {
        self.nodes
            .iter()
            .filter(|(_, t)| !t.dead && t.suspect.is_some_and(|s| s.beating))
            .map(|(n, _)| n.as_str())
    }

    /// The agent of node `name` answered the gateway, checked because
    /// [`to_reach`](Self::to_reach) listed it: the suspicion is cleared,
    /// and the node's agent run returned. `None` when it was not listed
    /// (not suspect, or not beating yet: an answer then may predate the
    /// evidence).
    pub fn reached(&mut self, name: &str) -> Option<&str> {
        let t = self.nodes.get_mut(name).filter(|t| !t.dead && t.suspect.is_some_and(|s| s.beating))?;
        t.suspect = None;
        Some(&t.agent)
    }

    /// How long node `name` has been silent, as observed.
    pub fn silence(&self, name: &str) -> Option<Millis> {
        self.nodes.get(name).map(|t| t.silent)
    }

    /// A read failed: the time until the next successful one is not
    /// counted as anyone's silence.
    pub fn unreachable(&mut self) {
        self.last_ok = None;
    }

    /// A read at `now` succeeded and saw `regs`. Returns what changed, in
    /// name order.
    pub fn observe(&mut self, now: Millis, regs: &[Seen]) -> Vec<Change> {
        let gap = self.last_ok.map_or(0, |t| now.saturating_sub(t).min(self.max_gap));
        self.last_ok = Some(now);
        let mut changes = Vec::new();
        let by_name: BTreeMap<&str, &Seen> = regs.iter().map(|s| (s.name.as_str(), s)).collect();
        // Tracked nodes first: silence, replacement, departure.
        let names: Vec<String> = self.nodes.keys().cloned().collect();
        for name in names {
            let track = self.nodes.get_mut(&name).expect("a listed node");
            match by_name.get(name.as_str()) {
                Some(s) if s.agent != track.agent => {
                    let (old, was_dead) = (track.agent.clone(), track.dead);
                    if s.left {
                        // A new run came and went: the old one is gone.
                        if !was_dead {
                            changes.push(Change::Left { name: name.clone(), agent: old });
                        }
                        self.nodes.remove(&name);
                    } else {
                        *track = Track::new(&s.agent, s.beat);
                        changes.push(if was_dead {
                            Change::Joined { name, agent: s.agent.clone() }
                        } else {
                            Change::Replaced { name, old, new: s.agent.clone() }
                        });
                    }
                }
                Some(s) if s.left => {
                    if !track.dead {
                        changes.push(Change::Left { name: name.clone(), agent: track.agent.clone() });
                    }
                    self.nodes.remove(&name);
                }
                Some(s) if s.beat != track.beat => {
                    track.beat = s.beat;
                    track.silent = 0;
                    if track.dead {
                        track.dead = false;
                        track.suspect = None;
                        changes.push(Change::Joined { name, agent: track.agent.clone() });
                    } else if let Some(suspicion) = &mut track.suspect {
                        match suspicion.beat_after {
                            // This beat may predate the evidence: the next counts.
                            None => suspicion.beat_after = Some(s.beat),
                            Some(_) => suspicion.beating = true,
                        }
                    }
                }
                seen => {
                    if let (Some(suspicion), Some(s)) = (&mut track.suspect, seen) {
                        suspicion.beat_after.get_or_insert(s.beat);
                    }
                    track.silent = track.silent.saturating_add(gap);
                    if !track.dead && track.silent >= self.ttl {
                        track.dead = true;
                        track.suspect = None;
                        changes.push(Change::Died { name: name.clone(), agent: track.agent.clone() });
                    }
                    if track.dead && seen.is_none() {
                        // Dead and gone from the registry: forgotten.
                        self.nodes.remove(&name);
                    }
                }
            }
        }
        // Then registrations not tracked yet.
        let new: Vec<&Seen> = regs.iter().filter(|s| !s.left && !self.nodes.contains_key(&s.name)).collect();
        for s in new {
            self.nodes.insert(s.name.clone(), Track::new(&s.agent, s.beat));
            changes.push(Change::Joined { name: s.name.clone(), agent: s.agent.clone() });
        }
        changes
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn seen(name: &str, agent: &str, beat: u64) -> Seen {
        Seen { name: name.into(), agent: agent.into(), beat, left: false }
    }

    #[test]
    fn silence_counts_only_between_successful_reads() {
        let mut l = Liveness::new(8_000, 1_000);
        assert_eq!(
            l.observe(0, &[seen("a", "r1", 1)]),
            vec![Change::Joined { name: "a".into(), agent: "r1".into() }]
        );
        // Silent for 7.75 s of reads: alive.
        for t in (250..=7_750).step_by(250) {
            assert!(l.observe(t, &[seen("a", "r1", 1)]).is_empty());
        }
        // Redis down for a minute: nothing concluded.
        l.unreachable();
        assert!(l.observe(67_750, &[seen("a", "r1", 1)]).is_empty());
        assert_eq!(l.silence("a"), Some(7_750));
        assert!(
            l.observe(68_000, &[seen("a", "r1", 1)])
                == vec![Change::Died { name: "a".into(), agent: "r1".into() }]
        );
        // It beats again (a stopped agent resumed): it joins again.
        assert_eq!(
            l.observe(68_250, &[seen("a", "r1", 2)]),
            vec![Change::Joined { name: "a".into(), agent: "r1".into() }]
        );
        // Another run takes the name; the first leaves on purpose.
        assert_eq!(
            l.observe(68_500, &[seen("a", "r2", 1)]),
            vec![Change::Replaced { name: "a".into(), old: "r1".into(), new: "r2".into() }]
        );
        let left = Seen { left: true, ..seen("a", "r2", 1) };
        assert_eq!(
            l.observe(68_750, std::slice::from_ref(&left)),
            vec![Change::Left { name: "a".into(), agent: "r2".into() }]
        );
        assert!(l.observe(69_000, &[left]).is_empty());
        assert_eq!(l.alive().count(), 0);
    }

    #[test]
    fn a_reader_that_was_itself_stopped_does_not_count_its_pause() {
        let mut l = Liveness::new(8_000, 1_000);
        l.observe(0, &[seen("a", "r1", 1)]);
        // The reader was SIGSTOPped for 30 s: one gap, counted as 1 s.
        assert!(l.observe(30_000, &[seen("a", "r1", 1)]).is_empty());
        assert_eq!(l.silence("a"), Some(1_000));
    }

    #[test]
    fn a_registration_gone_while_redis_answers_is_silence_not_death() {
        let mut l = Liveness::new(8_000, 1_000);
        l.observe(0, &[seen("a", "r1", 1)]);
        // Redis lost its data: the registration is gone for two reads, then
        // the agent registers again as the same run.
        assert!(l.observe(250, &[]).is_empty());
        assert!(l.observe(500, &[]).is_empty());
        assert!(l.observe(750, &[seen("a", "r1", 1)]).is_empty());
        assert!(l.is_alive("a"));
    }

    #[test]
    fn a_suspect_node_is_cleared_by_a_beat_after_the_evidence_then_an_answer_and_dies_silent() {
        let mut l = Liveness::new(8_000, 1_000);
        l.observe(0, &[seen("a", "r1", 1), seen("b", "r1", 1)]);
        assert!(l.suspect("a") && l.suspect("b"));
        assert!(!l.suspect("a"), "suspect already");
        assert!(!l.suspect("nobody"));
        // The first read after the evidence sees a beat that may have been
        // written before it: still suspect, and not to check yet.
        assert!(l.observe(250, &[seen("a", "r1", 2), seen("b", "r1", 1)]).is_empty());
        assert!(l.is_suspect("a") && l.is_suspect("b"));
        assert_eq!(l.to_reach().count(), 0);
        assert_eq!(l.reached("a"), None, "an answer may predate the evidence");
        // A beat after that read: `a`'s agent runs; whether this gateway
        // reaches it is to be checked, and until it answers it is suspect.
        assert!(l.observe(500, &[seen("a", "r1", 3), seen("b", "r1", 1)]).is_empty());
        assert_eq!(l.to_reach().collect::<Vec<_>>(), ["a"]);
        assert!(l.is_suspect("a"));
        assert_eq!(l.reached("a"), Some("r1"));
        assert_eq!(l.reached("a"), None, "cleared once");
        assert!(!l.is_suspect("a") && l.is_suspect("b"));
        assert_eq!(l.to_reach().count(), 0);
        // `b` never beats again: suspect and alive until its TTL, then dead.
        for t in (750..8_000).step_by(250) {
            assert!(l.observe(t, &[seen("a", "r1", 3), seen("b", "r1", 1)]).is_empty(), "{t}");
            assert!(l.is_suspect("b"));
        }
        assert_eq!(
            l.observe(8_000, &[seen("a", "r1", 3), seen("b", "r1", 1)]),
            vec![Change::Died { name: "b".into(), agent: "r1".into() }]
        );
        assert!(!l.is_suspect("b") && !l.suspect("b"));
        // Another run under `a`'s name is not suspect for the old one.
        assert!(l.suspect("a"));
        l.observe(8_250, &[seen("a", "r2", 1)]);
        assert!(!l.is_suspect("a"));
    }

    #[test]
    fn new_evidence_voids_a_check_begun_before_it() {
        let mut l = Liveness::new(8_000, 1_000);
        l.observe(0, &[seen("a", "r1", 1)]);
        assert!(l.suspect("a"));
        l.observe(250, &[seen("a", "r1", 2)]);
        l.observe(500, &[seen("a", "r1", 3)]);
        assert_eq!(l.to_reach().collect::<Vec<_>>(), ["a"], "a check begins");
        // A request finds the node dead again while the check runs.
        assert!(!l.suspect("a"), "suspect already");
        assert_eq!(l.reached("a"), None, "the check predates the evidence");
        assert_eq!(l.to_reach().count(), 0);
        // A beat after the new evidence, and a check after it, clear it.
        assert!(l.observe(750, &[seen("a", "r1", 4)]).is_empty());
        assert!(l.observe(1_000, &[seen("a", "r1", 5)]).is_empty());
        assert!(l.reached("a").is_some());
    }

    #[test]
    fn a_node_that_beats_but_never_answers_stays_suspect_however_long_it_beats() {
        // A network fault between the gateway and the node: Redis sees
        // its heartbeats, the gateway reaches nothing there.
        let mut l = Liveness::new(8_000, 1_000);
        l.observe(0, &[seen("a", "r1", 1)]);
        assert!(l.suspect("a"));
        for (i, t) in (250..60_000).step_by(250).enumerate() {
            assert!(l.observe(t, &[seen("a", "r1", 2 + i as u64 / 8)]).is_empty(), "{t}");
            assert!(l.is_alive("a") && l.is_suspect("a"), "{t}");
        }
        assert_eq!(l.to_reach().collect::<Vec<_>>(), ["a"]);
        // The path heals: the next check answers.
        assert!(l.reached("a").is_some());
        assert!(!l.is_suspect("a"));
    }

    proptest! {
        /// A node suspected at a random moment: one whose agent runs (beats
        /// every 2 s, at a random phase) and answers the gateway's checks
        /// (each read, as the view checks what `to_reach` lists) is cleared
        /// within two heartbeats and one read of the evidence; one whose
        /// agent died before the evidence, or that beats but answers no
        /// check (cut off from the gateway), stays suspect — never cleared
        /// — while it is alive.
        #[test]
        fn only_a_beat_after_the_evidence_and_an_answer_clear_a_suspicion(
            phase in 0u64..2_000,
            died_before_by in 0u64..2_000,
            suspected_at in 10_000u64..20_000,
            alive: bool,
            reachable: bool,
        ) {
            let (read_every, beat_every) = (250u64, 2_000u64);
            let mut l = Liveness::new(8_000, 4 * read_every);
            let stop = if alive { u64::MAX } else { suspected_at - died_before_by };
            let mut beats = 0;
            let mut cleared_at = None;
            let mut suspected = false;
            // The evidence lands between two reads, as the view's mailbox
            // takes it at the start of a refresh.
            for t in (0..40_000u64).step_by(read_every as usize) {
                for b in (t.saturating_sub(read_every) + 1)..=t {
                    if (b + phase) % beat_every == 0 && b < stop {
                        beats += 1;
                    }
                }
                if !suspected && t >= suspected_at {
                    prop_assert!(l.suspect("n"));
                    suspected = true;
                }
                l.observe(t, &[seen("n", "r", beats)]);
                if suspected && cleared_at.is_none() && l.is_alive("n") {
                    prop_assert!(l.is_suspect("n"), "cleared by a read alone at {}", t);
                }
                // The view checks what is listed; a running agent on a
                // working path answers.
                let listed: Vec<String> = l.to_reach().map(str::to_owned).collect();
                for n in listed {
                    if alive && reachable {
                        prop_assert!(l.reached(&n).is_some());
                        cleared_at.get_or_insert(t);
                    }
                }
                if !(alive && reachable) && suspected && l.is_alive("n") {
                    prop_assert!(l.is_suspect("n"), "cleared at {} with no beat and answer since", t);
                }
            }
            if alive && reachable {
                let at = cleared_at.expect("a beating node was never cleared");
                prop_assert!(at <= suspected_at + 2 * beat_every + 2 * read_every, "cleared only at {}", at);
            }
        }

        /// Agents beating every 2 s whenever Redis is up are never declared
        /// dead, whatever the outages; an agent that stops beating while
        /// Redis answers is declared dead within its TTL plus one read.
        #[test]
        fn beating_agents_live_and_silent_ones_die_in_time(
            outages in proptest::collection::vec((0u64..600_000, 0u64..120_000), 0..8),
            stop_at in 0u64..600_000,
            phase in 0u64..2_000,
        ) {
            let down = |t: u64| outages.iter().any(|(at, len)| t >= *at && t < at + len);
            let (ttl, read_every, beat_every) = (8_000, 250, 2_000);
            let mut l = Liveness::new(ttl, 4 * read_every);
            let (mut beats, mut silent_beats) = (0u64, 0u64);
            let mut silent_since_up: Option<u64> = None;
            let mut died_at = None;
            let mut prev_up = false;
            for t in (0..700_000u64).step_by(read_every as usize) {
                // Heartbeats land only while Redis is up.
                if !down(t) && (t + phase) % beat_every < read_every {
                    beats += 1;
                    if t < stop_at {
                        silent_beats = beats;
                    }
                }
                if down(t) {
                    l.unreachable();
                    prev_up = false;
                    continue;
                }
                let regs = [seen("beating", "r", beats), seen("stops", "r", silent_beats)];
                for c in l.observe(t, &regs) {
                    match c {
                        Change::Died { name, .. } => {
                            prop_assert_eq!(name.as_str(), "stops", "a beating agent died at {}", t);
                            died_at.get_or_insert(t);
                        }
                        Change::Joined { .. } => {}
                        other => prop_assert!(false, "{:?}", other),
                    }
                }
                // Count the silence of `stops` observed between reads in a
                // row that both succeeded, as the tracker does.
                if t >= stop_at {
                    let gap = if prev_up { read_every } else { 0 };
                    silent_since_up = Some(silent_since_up.map_or(0, |s| s + gap));
                }
                prev_up = true;
            }
            let observed = silent_since_up.unwrap_or(0);
            if observed >= ttl + beat_every + read_every {
                prop_assert!(died_at.is_some(), "silent for {} ms of reads and not dead", observed);
            }
        }
    }
}
