//! Webhook signatures, as Replicate (and the Standard Webhooks spec) sign
//! them.
//!
//! The secret is `whsec_` followed by base64 of 32 random bytes. A
//! webhook carries `webhook-id`, `webhook-timestamp` (Unix seconds) and
//! `webhook-signature: v1,<base64 HMAC-SHA256(key, "{id}.{timestamp}.{body}")>`
//! where `key` is the base64-decoded part of the secret after `whsec_`.
//!
//! Each account has its own secret (a shared one would let any account
//! forge webhooks that another account's receiver accepts). While a
//! rotated-out secret is still in its grace period, a webhook carries one
//! signature per valid secret, space-separated in the one header, as the
//! Standard Webhooks spec allows ([`sign_all`]); a receiver that knows
//! either secret accepts it.

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

/// A new random secret.
pub fn new_secret() -> String {
    let mut key = [0u8; 32];
    rand::rng().fill_bytes(&mut key);
    format!("whsec_{}", STANDARD.encode(key))
}

/// The key bytes of `secret` (the decoded part after `whsec_`; a secret
/// that is not of that form is used as raw bytes).
fn key(secret: &str) -> Vec<u8> {
    secret
        .strip_prefix("whsec_")
        .and_then(|k| STANDARD.decode(k).ok())
        .unwrap_or_else(|| secret.as_bytes().to_vec())
}

/// The `webhook-signature` header value of one webhook.
pub fn sign(secret: &str, id: &str, timestamp: u64, body: &str) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(&key(secret)).expect("HMAC takes any key length");
    mac.update(format!("{id}.{timestamp}.{body}").as_bytes());
    format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
}

/// The `webhook-signature` header value signed with each of `secrets`:
/// `v1,<sig>` entries separated by spaces, in the order given.
pub fn sign_all(secrets: &[String], id: &str, timestamp: u64, body: &str) -> String {
    secrets.iter().map(|s| sign(s, id, timestamp, body)).collect::<Vec<_>>().join(" ")
}

/// Whether `header` (space-separated `v1,<sig>` entries) holds a valid
/// signature of the webhook.
pub fn verify(secret: &str, id: &str, timestamp: u64, body: &str, header: &str) -> bool {
    let expected = sign(secret, id, timestamp, body);
    header.split(' ').any(|s| s == expected)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn standard_webhooks_test_vector() {
        // The Standard Webhooks reference vector.
        let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let body = r#"{"test": 2432232314}"#;
        let sig = sign(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body);
        assert_eq!(sig, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
        assert!(verify(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body, &format!("v1,bad {sig}")));
        assert!(!verify(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265331, body, &sig));
        assert!(new_secret().starts_with("whsec_"));
    }

    #[test]
    fn a_header_signed_with_two_secrets_verifies_with_either() {
        let (old, new, other) = (new_secret(), new_secret(), new_secret());
        let header = sign_all(&[new.clone(), old.clone()], "msg_1", 10, "{}");
        assert_eq!(header.split(' ').count(), 2);
        assert!(header.split(' ').all(|s| s.starts_with("v1,")));
        assert!(verify(&new, "msg_1", 10, "{}", &header));
        assert!(verify(&old, "msg_1", 10, "{}", &header));
        assert!(!verify(&other, "msg_1", 10, "{}", &header));
        assert_eq!(sign_all(std::slice::from_ref(&new), "msg_1", 10, "{}"), sign(&new, "msg_1", 10, "{}"));
    }
}
