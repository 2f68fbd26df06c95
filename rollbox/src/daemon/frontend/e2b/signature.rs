//! envd's signed `/files` URLs: `download_url()`/`upload_url()` of a sandbox with an access
//! token carry `signature=v1_<base64 sha256("{path}:{read|write}:{username}:{token}[:{exp}]")>`
//! and an optional `signature_expiration` (Unix seconds) instead of the `X-Access-Token`
//! header. envd answers every failed check with a 401.
//!
//! Also the per-sandbox secrets the daemon derives instead of storing: HMAC-SHA256 of the
//! sandbox id under the daemon's key, one label per use ([`hmac_sha256`], [`derived_token`]).

use base64::Engine as _;
use sha2::Digest as _;

use super::wire::query_pairs;
use crate::daemon::keys::same_secret;

/// What a signed URL is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Read,
    Write,
}

impl Operation {
    fn as_str(self) -> &'static str {
        match self {
            Operation::Read => "read",
            Operation::Write => "write",
        }
    }
}

/// Why a signed URL is refused (each is a 401, as envd answers).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SignatureError {
    #[error("missing X-Access-Token header or signature query parameter (a signed URL from download_url()/upload_url())")]
    Missing,
    #[error("signature_expiration {0:?}: not a Unix time in seconds")]
    BadExpiration(String),
    #[error("signature: invalid for this path, operation ({0}) and user")]
    Invalid(&'static str),
    #[error("signature: expired at {expired} (now {now})")]
    Expired { expired: i64, now: i64 },
}

/// The `v1_` signature of `path`, `operation` and `username` ("" for the default user).
pub fn sign(
    path: &str,
    operation: Operation,
    username: &str,
    token: &str,
    expiration: Option<i64>,
) -> String {
    let mut raw = format!("{path}:{}:{username}:{token}", operation.as_str());
    if let Some(expiration) = expiration {
        raw.push_str(&format!(":{expiration}"));
    }
    let digest = sha2::Sha256::digest(raw.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}

/// Checks the signature of a `/files` query for `operation` against `token` at `now`
/// (Unix seconds). The signature is compared in constant time, then the expiry.
pub fn verify(
    query: &str,
    operation: Operation,
    token: &str,
    now: i64,
) -> Result<(), SignatureError> {
    let pairs = query_pairs(query);
    let value = |name: &str| {
        pairs
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    };
    let signature = value("signature")
        .filter(|s| !s.is_empty())
        .ok_or(SignatureError::Missing)?;
    let expiration = match value("signature_expiration").filter(|e| !e.is_empty()) {
        None => None,
        Some(text) => Some(
            text.parse::<i64>()
                .map_err(|_| SignatureError::BadExpiration(text.to_string()))?,
        ),
    };
    let expected = sign(
        value("path").unwrap_or(""),
        operation,
        value("username").unwrap_or(""),
        token,
        expiration,
    );
    if !same_secret(signature.as_bytes(), expected.as_bytes()) {
        return Err(SignatureError::Invalid(operation.as_str()));
    }
    match expiration {
        Some(expired) if expired < now => Err(SignatureError::Expired { expired, now }),
        _ => Ok(()),
    }
}

/// HMAC-SHA256 (RFC 2104) of `message` under `key`.
pub fn hmac_sha256(key: &[u8], message: &[&[u8]]) -> [u8; 32] {
    const BLOCK: usize = 64;
    let mut block = [0u8; BLOCK];
    if key.len() > BLOCK {
        block[..32].copy_from_slice(&sha2::Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let pad = |byte: u8| block.map(|b| b ^ byte);
    let mut inner = sha2::Sha256::new();
    inner.update(pad(0x36));
    for part in message {
        inner.update(part);
    }
    let mut outer = sha2::Sha256::new();
    outer.update(pad(0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

/// A token for sandbox `id` derived from the daemon's `key`: hex of the first 16 bytes of
/// HMAC-SHA256(key, label NUL id). Nothing is stored; a daemon restart gives the same token.
pub fn derived_token(key: &str, label: &str, id: &str) -> String {
    crate::images::digest::to_hex(
        &hmac_sha256(
            key.trim().as_bytes(),
            &[label.as_bytes(), b"\0", id.as_bytes()],
        )[..16],
    )
}

/// Now, in Unix seconds.
pub fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc_4231() {
        // RFC 4231 test cases 1 and 6 (a key longer than the block).
        let hex = |bytes: [u8; 32]| crate::images::digest::to_hex(&bytes);
        assert_eq!(
            hex(hmac_sha256(&[0x0b; 20], &[b"Hi There"])),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
        assert_eq!(
            hex(hmac_sha256(
                &[0xaa; 131],
                &[
                    b"Test Using Larger Than Block-Size Key",
                    b" - Hash Key First"
                ]
            )),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
        let token = derived_token("key", "traffic", "sb-1");
        assert_eq!(token.len(), 32);
        assert_ne!(token, derived_token("key", "traffic", "sb-2"));
        assert_ne!(token, derived_token("key", "envd", "sb-1"));
        assert_ne!(token, derived_token("other", "traffic", "sb-1"));
    }

    #[test]
    fn signatures_match_the_sdks() {
        // Computed with the SDK's formula (sandbox/signature.py) in Python.
        assert_eq!(
            sign("/home/user/a.txt", Operation::Read, "", "tok", None),
            "v1_Zkbb3914oLJLvMBzCAHQhm2ydBLxbSx2eQUR/kLdvIY"
        );
        assert_eq!(
            sign(
                "/home/user/a.txt",
                Operation::Write,
                "root",
                "tok",
                Some(1_800_000_000)
            ),
            "v1_PwEbZAn30wCkhlh05woI7V2lhGG+88oGp2wSFYqrHxk"
        );
    }

    #[test]
    fn only_a_valid_unexpired_signature_for_the_operation_passes() {
        let now = 1_700_000_000;
        let read = sign("/a b", Operation::Read, "", "tok", None);
        let query = |sig: &str, extra: &str| {
            format!("path=%2Fa%20b&signature={}{extra}", sig.replace('+', "%2B"))
        };
        assert_eq!(
            verify(&query(&read, ""), Operation::Read, "tok", now),
            Ok(())
        );
        // The other operation, another token, another user, another path.
        assert_eq!(
            verify(&query(&read, ""), Operation::Write, "tok", now),
            Err(SignatureError::Invalid("write"))
        );
        assert!(verify(&query(&read, ""), Operation::Read, "other", now).is_err());
        assert!(verify(&query(&read, "&username=root"), Operation::Read, "tok", now).is_err());
        assert!(verify(
            &format!("path=/other&signature={}", read.replace('+', "%2B")),
            Operation::Read,
            "tok",
            now
        )
        .is_err());
        // Tampered: one character changed.
        let mut tampered = read.clone().into_bytes();
        let last = tampered.len() - 1;
        tampered[last] = if tampered[last] == b'A' { b'B' } else { b'A' };
        let tampered = String::from_utf8(tampered).expect("ascii");
        assert!(verify(&query(&tampered, ""), Operation::Read, "tok", now).is_err());
        // Expiry: part of the signature, and checked against the clock.
        let later = sign("/a b", Operation::Read, "", "tok", Some(now + 60));
        let with = |sig: &str, exp: i64| query(sig, &format!("&signature_expiration={exp}"));
        assert_eq!(
            verify(&with(&later, now + 60), Operation::Read, "tok", now),
            Ok(())
        );
        assert!(verify(&with(&later, now + 61), Operation::Read, "tok", now).is_err());
        let past = sign("/a b", Operation::Read, "", "tok", Some(now - 1));
        assert_eq!(
            verify(&with(&past, now - 1), Operation::Read, "tok", now),
            Err(SignatureError::Expired {
                expired: now - 1,
                now
            })
        );
        assert_eq!(
            verify("path=/a", Operation::Read, "tok", now),
            Err(SignatureError::Missing)
        );
        assert!(matches!(
            verify(
                &query(&read, "&signature_expiration=soon"),
                Operation::Read,
                "tok",
                now
            ),
            Err(SignatureError::BadExpiration(_))
        ));
    }
}
