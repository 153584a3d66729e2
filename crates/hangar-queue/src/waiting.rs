//! The waiting line: FIFO across all accounts, or fair (round-robin over
//! accounts, FIFO within each).

use std::collections::{HashMap, VecDeque};

use hangar_core::{AccountId, RequestId};

use crate::QueueAlgorithm;

/// Requests waiting for a permit, in the order the algorithm serves them.
#[derive(Debug, Clone)]
pub(crate) enum Waiting {
    Fifo(VecDeque<(AccountId, RequestId)>),
    Fair {
        /// Each account's own line.
        lines: HashMap<AccountId, VecDeque<RequestId>>,
        /// Accounts with waiting requests, in serving order: the front is
        /// served next and then moves to the back.
        rotation: VecDeque<AccountId>,
    },
}

impl Waiting {
    pub fn new(algorithm: QueueAlgorithm) -> Self {
        match algorithm {
            QueueAlgorithm::Fifo => Self::Fifo(VecDeque::new()),
            QueueAlgorithm::Fair => Self::Fair { lines: HashMap::new(), rotation: VecDeque::new() },
        }
    }

    /// Whether `account` may queue one more request under `capacity`: a
    /// global bound for FIFO, a per-account bound for fair queuing.
    pub fn has_room(&self, account: &AccountId, capacity: usize) -> bool {
        match self {
            Self::Fifo(q) => q.len() < capacity,
            Self::Fair { lines, .. } => lines.get(account).map_or(0, VecDeque::len) < capacity,
        }
    }

    pub fn push(&mut self, account: AccountId, request: RequestId) {
        match self {
            Self::Fifo(q) => q.push_back((account, request)),
            Self::Fair { lines, rotation } => {
                let line = lines.entry(account.clone()).or_default();
                if line.is_empty() {
                    rotation.push_back(account);
                }
                line.push_back(request);
            }
        }
    }

    /// The request [`pop`](Self::pop) would return.
    pub fn peek(&self) -> Option<RequestId> {
        match self {
            Self::Fifo(q) => q.front().map(|(_, r)| *r),
            Self::Fair { lines, rotation } => rotation.front().and_then(|a| lines[a].front().copied()),
        }
    }

    /// The next request to serve.
    pub fn pop(&mut self) -> Option<RequestId> {
        match self {
            Self::Fifo(q) => q.pop_front().map(|(_, r)| r),
            Self::Fair { lines, rotation } => {
                let account = rotation.pop_front()?;
                let line = lines.get_mut(&account).expect("rotated accounts have a line");
                let request = line.pop_front().expect("rotated accounts have waiting requests");
                if line.is_empty() {
                    lines.remove(&account);
                } else {
                    rotation.push_back(account);
                }
                Some(request)
            }
        }
    }

    /// Removes `request` of `account` wherever it waits; returns whether it
    /// was there.
    pub fn remove(&mut self, account: &AccountId, request: RequestId) -> bool {
        match self {
            Self::Fifo(q) => match q.iter().position(|(_, r)| *r == request) {
                Some(i) => {
                    q.remove(i);
                    true
                }
                None => false,
            },
            Self::Fair { lines, rotation } => {
                let Some(line) = lines.get_mut(account) else { return false };
                let Some(i) = line.iter().position(|r| *r == request) else { return false };
                line.remove(i);
                if line.is_empty() {
                    lines.remove(account);
                    rotation.retain(|a| a != account);
                }
                true
            }
        }
    }

    /// Where `request` of `account` stands: 1 if it is served next, n if
    /// n − 1 requests are served before it should nobody else arrive.
    /// Under fair queuing that counts, from every other account's line,
    /// the requests the rotation serves before this one's turn — one per
    /// round of the rotation, accounts ahead of it in the rotation getting
    /// one more. The request is looked for from the back of its line, where
    /// one that just joined stands (the processor asks as it queues each),
    /// then O(accounts) for fair.
    pub fn position(&self, account: &AccountId, request: RequestId) -> Option<usize> {
        match self {
            Self::Fifo(q) => q.iter().rposition(|(_, r)| *r == request).map(|i| i + 1),
            Self::Fair { lines, rotation } => {
                let rank = lines.get(account)?.iter().rposition(|r| *r == request)?;
                let mut ahead_in_rotation = true;
                let before: usize = rotation
                    .iter()
                    .map(|a| {
                        if a == account {
                            ahead_in_rotation = false;
                            return rank;
                        }
                        let rounds = if ahead_in_rotation { rank + 1 } else { rank };
                        lines[a].len().min(rounds)
                    })
                    .sum();
                Some(before + 1)
            }
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Self::Fifo(q) => q.len(),
            Self::Fair { lines, .. } => lines.values().map(VecDeque::len).sum(),
        }
    }

    /// Empties the line, returning every request in serving order.
    pub fn drain(&mut self) -> Vec<RequestId> {
        std::iter::from_fn(|| self.pop()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever arrived, was served or left in whatever order, every
        /// waiting request's position is its place in the order the line
        /// then serves them.
        #[test]
        fn a_position_is_the_place_in_serving_order(
            fair in any::<bool>(),
            ops in proptest::collection::vec((0u8..4, 0u8..10), 1..80),
        ) {
            let algorithm = if fair { QueueAlgorithm::Fair } else { QueueAlgorithm::Fifo };
            let mut line = Waiting::new(algorithm);
            let name = |a: u8| -> AccountId { format!("account-{a}").parse().unwrap() };
            let mut accounts: HashMap<RequestId, (u8, AccountId)> = HashMap::new();
            for (i, (account, op)) in ops.into_iter().enumerate() {
                match op {
                    0 => {
                        line.pop();
                    }
                    1 => {
                        let leaving = accounts.iter().find(|(_, (n, _))| *n == account);
                        if let Some((r, (_, a))) = leaving {
                            line.remove(a, *r);
                        }
                    }
                    _ => {
                        let a = name(account);
                        accounts.insert(RequestId(i as u64), (account, a.clone()));
                        line.push(a, RequestId(i as u64));
                    }
                }
                let order = line.clone().drain();
                for (place, r) in order.iter().enumerate() {
                    prop_assert_eq!(line.position(&accounts[r].1, *r), Some(place + 1));
                }
                prop_assert_eq!(line.position(&name(9), RequestId(u64::MAX)), None);
            }
        }
    }
}
