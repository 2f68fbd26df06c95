//! Keys: POST /keys (a tenant's key or an admin's), key ids and tenant names.

use serde::Deserialize;

use super::super::action::ApiError;
use super::super::model::NewKey;
use super::{bad, from_json};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyBody {
    tenant: Option<String>,
    #[serde(default)]
    admin: bool,
}

/// Tenant names: 1-63 of a-z 0-9 . _ -, starting with a letter or digit.
pub fn check_tenant(name: &str, field: &str) -> Result<String, ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.bytes().enumerate().all(|(i, b)| {
            b.is_ascii_lowercase()
                || b.is_ascii_digit()
                || (i > 0 && matches!(b, b'.' | b'_' | b'-'))
        });
    if ok {
        Ok(name.to_string())
    } else {
        Err(bad(format!(
            "{field}: {name:?} is not a tenant name (1-63 of a-z 0-9 . _ -, starting with a letter or digit)"
        )))
    }
}

/// Key ids: `key-` and 16 lowercase hex digits.
pub fn check_key_id(id: &str, field: &str) -> Result<String, ApiError> {
    let hex = id.strip_prefix("key-").unwrap_or("");
    if hex.len() == 16 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        Ok(id.to_string())
    } else {
        Err(bad(format!(
            "{field}: {id:?} is not a key id (key- and 16 hex digits)"
        )))
    }
}

/// POST /keys: `{"tenant": NAME}` or `{"admin": true}`, exactly one.
pub fn parse_new_key(body: &[u8]) -> Result<NewKey, ApiError> {
    let body: KeyBody = from_json(body)?;
    match (body.tenant, body.admin) {
        (Some(_), true) => Err(bad(
            "tenant: an admin key has no tenant; give tenant or admin: true, not both",
        )),
        (Some(tenant), false) => Ok(NewKey {
            tenant: Some(check_tenant(&tenant, "tenant")?),
        }),
        (None, true) => Ok(NewKey { tenant: None }),
        (None, false) => Err(bad(
            "tenant: required (the tenant the key is for), or admin: true for an admin key",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::api::routes::{err, parse};
    use crate::daemon::api::Action;

    #[test]
    fn keys_parse_and_bad_ones_are_named() {
        assert_eq!(
            parse("POST", "/keys", None, br#"{"tenant":"team-a"}"#).expect("tenant"),
            Action::AddKey(NewKey {
                tenant: Some("team-a".into())
            })
        );
        assert_eq!(
            parse("POST", "/keys", None, br#"{"admin":true}"#).expect("admin"),
            Action::AddKey(NewKey { tenant: None })
        );
        for (body, field) in [
            (r#"{}"#, "tenant"),
            (r#"{"tenant":"A B"}"#, "tenant"),
            (r#"{"tenant":"a","admin":true}"#, "tenant"),
            (r#"{"tenant":"a","role":"x"}"#, "role"),
        ] {
            let message = err(parse("POST", "/keys", None, body.as_bytes()));
            assert!(message.starts_with(field), "{body}: {message}");
        }
        assert_eq!(
            parse("DELETE", "/keys/key-0123456789abcdef", None, b"").expect("revoke"),
            Action::RevokeKey("key-0123456789abcdef".into())
        );
        assert!(err(parse("DELETE", "/keys/k1", None, b"")).starts_with("key:"));
    }
}
