//! Validators, one module per resource: each turns a request's path parameters, query and JSON
//! body into its [`Action`](super::Action), or a 400 naming the field at fault. Here: what they
//! share (JSON with field paths, ranges, TTLs, query strings, sandbox and snapshot ids,
//! labels, environments).

pub mod exec;
pub mod file;
pub mod key;
pub mod network;
pub mod node;
pub mod sandbox;
pub mod snapshot;
pub mod template;
pub mod volume;

use std::collections::BTreeMap;

use super::action::ApiError;
use super::limits::{MAX_ENV, MAX_LABELS, MAX_NODE_ID, MAX_TTL_S};

/// A 400 with this message.
pub fn bad(message: impl Into<String>) -> ApiError {
    ApiError::BadRequest(message.into())
}

/// Deserializes JSON; an error names the field it is about.
pub fn from_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.is_empty() {
        return Err(bad("the request needs a JSON body"));
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            bad(format!("bad JSON body: {}", e.inner()))
        } else {
            bad(format!("{path}: {}", e.inner()))
        }
    })?;
    de.end().map_err(|e| bad(format!("bad JSON body: {e}")))?;
    Ok(value)
}

/// Sandbox ids: `sb-`, 16 lowercase hex digits and `-NODE`, the id of the node that made it
/// (ids of daemons from before node ids have none).
pub fn check_id(id: &str) -> Result<String, ApiError> {
    let rest = id.strip_prefix("sb-").unwrap_or("");
    let (hex, node) = match rest.split_at_checked(16) {
        Some((hex, node)) => (hex, node),
        None => ("", ""),
    };
    let hex_ok = hex.len() == 16 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    // Since ids say their node: `-NODE` (a node id) after the hex; before, nothing.
    let node_ok = node.is_empty()
        || node.strip_prefix('-').is_some_and(|n| {
            !n.is_empty()
                && n.len() <= MAX_NODE_ID
                && n.bytes().enumerate().all(|(i, b)| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || (i > 0 && b == b'-')
                })
        });
    if hex_ok && node_ok {
        Ok(id.to_string())
    } else {
        Err(bad(format!(
            "id: {id:?} is not a sandbox id (sb-, 16 hex digits, then -NODE)"
        )))
    }
}

/// An optional count within `min..=max`.
pub fn in_range(
    value: Option<i64>,
    field: &str,
    min: u32,
    max: u32,
) -> Result<Option<u32>, ApiError> {
    match value {
        None => Ok(None),
        Some(v) if v >= i64::from(min) && v <= i64::from(max) => Ok(u32::try_from(v).ok()),
        Some(v) => Err(bad(format!("{field}: {v} is out of range ({min}-{max})"))),
    }
}

/// A TTL in seconds: 1 to [`MAX_TTL_S`].
pub fn ttl(value: i64, field: &str) -> Result<u64, ApiError> {
    match u64::try_from(value) {
        Ok(v) if (1..=MAX_TTL_S).contains(&v) => Ok(v),
        _ => Err(bad(format!(
            "{field}: {value} is out of range (1-{MAX_TTL_S} seconds)"
        ))),
    }
}

/// A host path that must be absolute.
pub fn absolute(path: &std::path::Path, field: &str) -> Result<(), ApiError> {
    if path.is_absolute() {
        Ok(())
    } else {
        Err(bad(format!(
            "{field}: {} is not an absolute path",
            path.display()
        )))
    }
}

/// A boolean query value (`true`, `1` or empty; `false`, `0`).
pub fn parse_bool(value: &str, field: &str) -> Result<bool, ApiError> {
    match value {
        "true" | "1" | "" => Ok(true),
        "false" | "0" => Ok(false),
        _ => Err(bad(format!("{field}: {value:?} is not true or false"))),
    }
}

/// A query string as decoded (name, value) pairs.
pub fn query_pairs(query: Option<&str>) -> Result<Vec<(String, String)>, ApiError> {
    let mut pairs = Vec::new();
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let name = percent_decode(name, "query")?;
        let value = percent_decode(value, &name)?;
        pairs.push((name, value));
    }
    Ok(pairs)
}

/// Decodes %XX escapes and `+`.
pub fn percent_decode(text: &str, field: &str) -> Result<String, ApiError> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes
                    .get(i + 1..i + 3)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| bad(format!("{field}: bad %-escape in {text:?}")))?;
                out.push(hex);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| bad(format!("{field}: {text:?} is not UTF-8")))
}

/// An environment: at most [`MAX_ENV`] variables, names without `=` or NUL.
pub fn check_env(env: &BTreeMap<String, String>) -> Result<(), ApiError> {
    if env.len() > MAX_ENV {
        return Err(bad(format!("env: more than {MAX_ENV} variables")));
    }
    for (key, value) in env {
        if key.is_empty() || key.contains('=') || key.contains('\0') || value.contains('\0') {
            return Err(bad(format!(
                "env: {key:?} is not a variable name (non-empty, no = or NUL)"
            )));
        }
    }
    Ok(())
}

/// Snapshot ids: `snap-` and 16 lowercase hex digits.
pub fn check_snapshot_id(id: &str, field: &str) -> Result<String, ApiError> {
    let hex = id.strip_prefix("snap-").unwrap_or("");
    if hex.len() == 16 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        Ok(id.to_string())
    } else {
        Err(bad(format!(
            "{field}: {id:?} is not a snapshot id (snap- and 16 hex digits)"
        )))
    }
}

/// Snapshot names share E2B's namespace with templates (`templateID`): a template name's
/// rule (1-63 of a-z 0-9 . _ -, starting with a letter or digit), and never a snapshot id.
pub fn check_snapshot_name(name: &str, field: &str) -> Result<String, ApiError> {
    let plain = !name.is_empty()
        && name.len() <= 63
        && name.bytes().enumerate().all(|(i, b)| {
            b.is_ascii_lowercase()
                || b.is_ascii_digit()
                || (i > 0 && matches!(b, b'.' | b'_' | b'-'))
        });
    if !plain {
        return Err(bad(format!(
            "{field}: {name:?} is not a snapshot name (1-63 of a-z 0-9 . _ -, starting with a letter or digit)"
        )));
    }
    if check_snapshot_id(name, field).is_ok() {
        return Err(bad(format!(
            "{field}: {name:?} is a snapshot id; a name must not look like one"
        )));
    }
    Ok(name.to_string())
}

/// Label keys: 1-63 of A-Z a-z 0-9 . _ / -, starting with a letter or digit.
pub fn check_label_key(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= 63
        && key.bytes().enumerate().all(|(i, b)| {
            b.is_ascii_alphanumeric() || (i > 0 && matches!(b, b'.' | b'_' | b'/' | b'-'))
        })
}

/// Labels: at most [`MAX_LABELS`], plain keys, short values.
pub fn check_labels(labels: &BTreeMap<String, String>) -> Result<(), ApiError> {
    if labels.len() > MAX_LABELS {
        return Err(bad(format!("labels: more than {MAX_LABELS}")));
    }
    for (key, value) in labels {
        if !check_label_key(key) {
            return Err(bad(format!(
                "labels: key {key:?} is not 1-63 of A-Z a-z 0-9 . _ / - starting with a letter or digit"
            )));
        }
        if value.len() > 255 || value.chars().any(char::is_control) {
            return Err(bad(format!(
                "labels.{key}: the value must be at most 255 bytes with no control characters"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_ids_end_with_their_node_and_old_ones_still_read() {
        for good in [
            "sb-0123456789abcdef",
            "sb-0123456789abcdef-node-a",
            "sb-0123456789abcdef-n",
            "sb-0123456789abcdef-node-00112233aabbccdd",
        ] {
            assert_eq!(check_id(good).ok().as_deref(), Some(good));
        }
        for bad in [
            "sb-0123456789abcde",
            "sb-0123456789abcdeF",
            "sb-0123456789abcdef-",
            "sb-0123456789abcdef--a",
            "sb-0123456789abcdef-Node",
            "sb-0123456789abcdef-a/b",
            "sb-0123456789abcdefx",
            "sb-0123456789abcdef-0123456789012345678901234",
            "snap-0123456789abcdef",
        ] {
            let error = check_id(bad).expect_err(bad).to_string();
            assert!(error.contains("not a sandbox id"), "{bad}: {error}");
        }
    }
}
