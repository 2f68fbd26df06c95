//! envd's signed `/files` URLs: `download_url()`/`upload_url()` of a sandbox with an access
//! token carry `signature=v1_<base64 sha256("{path}:{read|write}:{username}:{token}[:{exp}]")>`
//! and an optional `signature_expiration` (Unix seconds) instead of the `X-Access-Token`
//! header. envd answers every failed check with a 401.

use base64::Engine as _;
use sha2::Digest as _;

use super::super::transport::same_key;
use super::wire::query_pairs;

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
    if !same_key(signature.as_bytes(), expected.as_bytes()) {
        return Err(SignatureError::Invalid(operation.as_str()));
    }
    match expiration {
        Some(expired) if expired < now => Err(SignatureError::Expired { expired, now }),
        _ => Ok(()),
    }
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
