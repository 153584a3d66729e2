//! API keys: who a request acts for. One set of rules for every API that
//! `hangar serve` answers — the OpenAI-compatible gateway, the admin API,
//! `/metrics` and the predictions API — so a key means the same thing on
//! each.
//!
//! With no keys configured the server is open: every request acts for the
//! account `anonymous`, with admin rights. Otherwise a request must carry
//! `Authorization: Bearer KEY` (or `Token KEY`, which Replicate's older
//! clients send) naming a configured key, and acts for that key's account;
//! only keys marked admin may use the admin API.
//!
//! The header is taken as raw bytes, so this module needs no HTTP crate.

use std::collections::HashMap;

use crate::AccountId;

/// The account a request acts for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// Whose request it is (quotas, fairness, access lists).
    pub account: AccountId,
    /// May use the admin API.
    pub admin: bool,
}

/// Why a request is not authenticated: answered 401 with this text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// No `Authorization` header.
    #[error("missing API key: send `Authorization: Bearer KEY`")]
    Missing,
    /// Not `Bearer KEY` or `Token KEY`.
    #[error("malformed Authorization header: expected `Bearer KEY`")]
    Malformed,
    /// A key that is not configured.
    #[error("invalid API key")]
    Invalid,
}

/// The configured API keys.
#[derive(Debug, Clone, Default)]
pub struct ApiKeys {
    keys: HashMap<String, Principal>,
}

impl ApiKeys {
    /// Keys with their principals; none makes an open server.
    pub fn new(keys: impl IntoIterator<Item = (String, Principal)>) -> Self {
        ApiKeys { keys: keys.into_iter().collect() }
    }

    /// Whether the server is open (no keys configured).
    pub fn is_open(&self) -> bool {
        self.keys.is_empty()
    }

    /// Who a request with this `Authorization` header value acts for.
    pub fn authenticate(&self, authorization: Option<&[u8]>) -> Result<Principal, AuthError> {
        if self.is_open() {
            return Ok(Principal { account: anonymous(), admin: true });
        }
        let value = authorization.ok_or(AuthError::Missing)?;
        let key = std::str::from_utf8(value)
            .ok()
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("Token ")))
            .ok_or(AuthError::Malformed)?;
        self.key(key.trim())
    }

    /// A key that acts for `account`, for work the server does on the
    /// account's behalf (a procedure calling the server's APIs as its
    /// caller): one without admin rights if the account has any, the
    /// first in byte order among equals, so every gateway of a fleet picks
    /// the same. `None` on an open server, or when no key names the
    /// account.
    pub fn key_for(&self, account: &AccountId) -> Option<&str> {
        self.keys
            .iter()
            .filter(|(_, p)| p.account == *account)
            .min_by_key(|(k, p)| (p.admin, k.as_str()))
            .map(|(k, _)| k.as_str())
    }

    /// Who the bare `key` acts for (a key that came other than in an
    /// `Authorization` header: the status page's cookie).
    pub fn key(&self, key: &str) -> Result<Principal, AuthError> {
        if self.is_open() {
            return Ok(Principal { account: anonymous(), admin: true });
        }
        self.keys.get(key).cloned().ok_or(AuthError::Invalid)
    }
}

/// The account of every request to an open server (made once: the
/// request path clones it).
pub fn anonymous() -> AccountId {
    static ANONYMOUS: std::sync::LazyLock<AccountId> =
        std::sync::LazyLock::new(|| "anonymous".parse().expect("a valid account id"));
    ANONYMOUS.clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys() -> ApiKeys {
        let p = |a: &str, admin| Principal { account: a.parse().unwrap(), admin };
        ApiKeys::new([("sk-acme".to_owned(), p("acme", false)), ("sk-ops".to_owned(), p("ops", true))])
    }

    #[test]
    fn an_open_server_serves_everyone_as_anonymous_admin() {
        let open = ApiKeys::default();
        assert_eq!(open.authenticate(None), Ok(Principal { account: anonymous(), admin: true }));
        assert_eq!(open.authenticate(Some(b"Bearer whatever")).unwrap().account, anonymous());
    }

    #[test]
    fn a_key_names_its_account_and_its_rights() {
        let keys = keys();
        let acme = keys.authenticate(Some(b"Bearer sk-acme")).unwrap();
        assert_eq!((acme.account.as_str(), acme.admin), ("acme", false));
        assert!(keys.authenticate(Some(b"Token sk-ops ")).unwrap().admin);
        assert_eq!(keys.authenticate(None), Err(AuthError::Missing));
        assert_eq!(keys.authenticate(Some(b"Basic c2stYWNtZQ==")), Err(AuthError::Malformed));
        assert_eq!(keys.authenticate(Some(b"Bearer \xff")), Err(AuthError::Malformed));
        assert_eq!(keys.authenticate(Some(b"Bearer sk-nope")), Err(AuthError::Invalid));
        assert!(keys.key("sk-ops").unwrap().admin);
        assert_eq!(keys.key("sk-ops "), Err(AuthError::Invalid), "a bare key is taken as it is");
    }

    #[test]
    fn the_key_a_procedure_gets_is_its_accounts_least_privileged() {
        let p = |a: &str, admin| Principal { account: a.parse().unwrap(), admin };
        let keys = ApiKeys::new([
            ("sk-b".to_owned(), p("acme", false)),
            ("sk-a".to_owned(), p("acme", true)),
            ("sk-c".to_owned(), p("acme", false)),
            ("sk-ops".to_owned(), p("ops", true)),
        ]);
        assert_eq!(keys.key_for(&"acme".parse().unwrap()), Some("sk-b"));
        assert_eq!(keys.key_for(&"ops".parse().unwrap()), Some("sk-ops"));
        assert_eq!(keys.key_for(&"nobody".parse().unwrap()), None);
        assert_eq!(ApiKeys::default().key_for(&anonymous()), None);
    }
}
