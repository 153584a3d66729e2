//! The waiting line: FIFO across all accounts, or fair (round-robin over
//! accounts, FIFO within each).

use std::collections::{HashMap, VecDeque};

use hangar_core::{AccountId, RequestId};

use crate::QueueAlgorithm;

/// Requests waiting for a permit, in the order the algorithm serves them.
#[derive(Debug)]
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
