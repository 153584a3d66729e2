//! `Idempotency-Key` on creates: a client that repeats a create — its
//! connection cut before the answer, a `503` it retries, a timeout of its
//! own — sends the same key, and gets the one prediction the key made
//! rather than a second run.
//!
//! The key names the prediction itself: its id is derived from the
//! account and the key ([`prediction_id`]), and both stores keep one
//! record per id (a create of an id that exists changes nothing), so two
//! creates with one key — one after the other, at once on two gateways, or
//! after a Redis failover that lost the first — leave one prediction, with
//! no index of keys to keep or expire. A key is good for as long as its
//! prediction's record is kept (docs/predictions.md, retention). A repeat
//! must be the same request: the same job, model, version and deployment,
//! input, webhook, events filter, `stream` and destination; another
//! request under a used key is refused (422) rather than answered with a
//! prediction it did not ask for.

use axum::http::{HeaderMap, StatusCode};
use hangar_core::AccountId;
use sha2::{Digest, Sha256};

use crate::api::{Problem, ID_ALPHABET, ID_LEN};
use crate::record::Record;
use crate::service::Inner;

/// The request header.
pub(crate) const HEADER: &str = "idempotency-key";

/// The response header of a create answered with the prediction an
/// earlier create under the same key made.
pub(crate) const REPLAYED: &str = "idempotent-replayed";

/// The longest key, bytes (as Stripe's).
const MAX_LEN: usize = 255;

/// The key a create carries, if any: 1 to [`MAX_LEN`] visible ASCII
/// characters (no spaces), or a 400 naming the header.
pub(crate) fn key(headers: &HeaderMap) -> Result<Option<String>, Problem> {
    let Some(value) = headers.get(HEADER) else { return Ok(None) };
    let bytes = value.as_bytes();
    if bytes.is_empty() || bytes.len() > MAX_LEN || !bytes.iter().all(|b| b.is_ascii_graphic()) {
        return Err(Problem::bad_request(format!(
            "the Idempotency-Key header must be 1 to {MAX_LEN} visible ASCII characters without spaces \
             (it has {} bytes)",
            bytes.len()
        )));
    }
    Ok(Some(String::from_utf8_lossy(bytes).into_owned()))
}

/// The id of the prediction `account` creates under `key`: a prediction
/// id like any other (26 of its letters), the same for the same account
/// and key, and another for another account.
pub(crate) fn prediction_id(account: &AccountId, key: &str) -> String {
    let mut hash = Sha256::new();
    hash.update(b"hangar idempotency-key\0");
    hash.update(account.as_str().as_bytes());
    hash.update(b"\0");
    hash.update(key.as_bytes());
    let digest = hash.finalize();
    digest.iter().take(ID_LEN).map(|b| ID_ALPHABET[usize::from(*b) % ID_ALPHABET.len()] as char).collect()
}

/// Whether `asked` is the request that made `stored` under `key`: if not,
/// a 422 naming the key and the prediction it made.
pub(crate) fn check_same(stored: &Record, asked: &Record, key: &str) -> Result<(), Problem> {
    let same = stored.kind == asked.kind
        && stored.model == asked.model
        && stored.version == asked.version
        && stored.deployment == asked.deployment
        // (Once its data is removed, after `retention`, the input is
        // gone: the rest must still match.)
        && (stored.data_removed || stored.input == asked.input)
        && stored.webhook == asked.webhook
        && stored.webhook_events == asked.webhook_events
        && stored.stream == asked.stream
        && stored.destination == asked.destination;
    if same {
        return Ok(());
    }
    Err(Problem::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        "Idempotency-Key reused",
        format!(
            "the Idempotency-Key `{key}` made {} `{}` from another request (its model, version, input, \
             webhook or options differ); send a new key for a new request",
            stored.kind.shown_as().as_str(),
            stored.id
        ),
    ))
}

/// Creates `record`, whose id is its key's ([`prediction_id`]), unless a
/// create under `key` came first; either way `record` becomes the stored
/// prediction. Returns whether one came first (the answer is a replay),
/// or a 422 if it was another request.
///
/// # Cancel safety
/// Dropping the future may leave the prediction stored, as any create
/// (`Inner::create`); the client's repeat under the key finds it.
pub(crate) async fn create(inner: &Inner, record: &mut Record, key: &str) -> Result<bool, Problem> {
    let first = inner.current(&record.id).map_err(Problem::store)?;
    if let Some(stored) = &first {
        check_same(stored, record, key)?;
    }
    // Stored now, or left as it is (the stores keep one record per id) —
    // on a durable store, held by its replicas either way, since the
    // first create's answer may have been a 503 for want of them.
    inner.create(record).await.map_err(Problem::store)?;
    // Read back: a create of the same id at once elsewhere may have been
    // first.
    if let Some(stored) = inner.current(&record.id).map_err(Problem::store)? {
        check_same(&stored, record, key)?;
        *record = stored;
    }
    Ok(first.is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(value: &[u8]) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(HEADER, axum::http::HeaderValue::from_bytes(value).unwrap());
        h
    }

    #[test]
    fn a_key_is_visible_ascii_up_to_255_bytes() {
        assert_eq!(key(&HeaderMap::new()).unwrap(), None);
        assert_eq!(key(&headers(b"order-42/retry")).unwrap().as_deref(), Some("order-42/retry"));
        assert!(key(&headers(&[b'k'; 255])).unwrap().is_some());
        for bad in [&b""[..], &[b'k'; 256][..], b"two words", b"tab\tkey", "caf\u{e9}".as_bytes()] {
            let e = key(&headers(bad)).unwrap_err();
            assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        }
    }

    fn asked(input: serde_json::Value) -> Record {
        let deadlines = crate::lifecycle::Deadlines { per_prediction: None, lifetime: None };
        Record::starting("p".into(), "t/open", "v1", "acme", input, 0, deadlines)
    }

    #[test]
    fn a_repeat_is_answered_only_when_it_is_the_same_request() {
        let stored = asked(serde_json::json!({"prompt": "x"}));
        assert!(check_same(&stored, &asked(serde_json::json!({"prompt": "x"})), "k").is_ok());
        let other = check_same(&stored, &asked(serde_json::json!({"prompt": "y"})), "k").unwrap_err();
        assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
        let mut hooked = asked(serde_json::json!({"prompt": "x"}));
        hooked.webhook = Some("https://example.com/hook".into());
        assert!(check_same(&stored, &hooked, "k").is_err(), "another webhook is another request");
        // Past retention its input is gone; the rest still has to match.
        let mut removed = stored;
        removed.input = serde_json::Value::Null;
        removed.data_removed = true;
        assert!(check_same(&removed, &asked(serde_json::json!({"prompt": "x"})), "k").is_ok());
        let mut elsewhere = asked(serde_json::json!({"prompt": "x"}));
        elsewhere.model = "t/other".into();
        assert!(check_same(&removed, &elsewhere, "k").is_err());
    }

    #[test]
    fn an_id_is_the_accounts_and_the_keys() {
        let (a, b) = ("acme".parse::<AccountId>().unwrap(), "globex".parse::<AccountId>().unwrap());
        let id = prediction_id(&a, "k1");
        assert_eq!(id.len(), ID_LEN);
        assert!(id.bytes().all(|c| ID_ALPHABET.contains(&c)), "{id}");
        assert_eq!(prediction_id(&a, "k1"), id);
        assert_ne!(prediction_id(&a, "k2"), id);
        assert_ne!(prediction_id(&b, "k1"), id);
    }
}
