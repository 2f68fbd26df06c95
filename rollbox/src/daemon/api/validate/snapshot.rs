//! Snapshots: taking one, fork, reset, the snapshot list, and snapshot ids.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::super::action::{Action, ApiError};
use super::super::limits::MAX_FORK;
use super::{
    bad, check_id, check_labels, check_snapshot_id, check_snapshot_name, from_json, in_range,
    query_pairs, ttl,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotBody {
    #[serde(default)]
    stop: bool,
    ttl_s: Option<i64>,
    name: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ForkBody {
    count: i64,
    ttl_s: Option<i64>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResetBody {
    snapshot: Option<String>,
}

/// POST /sandboxes/{id}/snapshots (an empty body: the defaults).
pub fn parse_snapshot(id: &str, body: &[u8]) -> Result<Action, ApiError> {
    let id = check_id(id)?;
    let body = if body.is_empty() {
        SnapshotBody {
            stop: false,
            ttl_s: None,
            name: None,
        }
    } else {
        from_json::<SnapshotBody>(body)?
    };
    Ok(Action::Snapshot {
        id,
        stop: body.stop,
        ttl_s: body.ttl_s.map(|v| ttl(v, "ttl_s")).transpose()?,
        name: body
            .name
            .map(|n| check_snapshot_name(&n, "name"))
            .transpose()?,
    })
}

/// POST /sandboxes/{id}/fork.
pub fn parse_fork(id: &str, body: &[u8]) -> Result<Action, ApiError> {
    let id = check_id(id)?;
    let body: ForkBody = from_json(body)?;
    check_labels(&body.labels)?;
    Ok(Action::Fork {
        id,
        count: in_range(Some(body.count), "count", 1, MAX_FORK)?.unwrap_or(1),
        ttl_s: body.ttl_s.map(|v| ttl(v, "ttl_s")).transpose()?,
        labels: body.labels,
    })
}

/// POST /sandboxes/{id}/reset (an empty body: back to the snapshot it came from).
pub fn parse_reset(id: &str, body: &[u8]) -> Result<Action, ApiError> {
    let id = check_id(id)?;
    let snapshot = if body.is_empty() {
        None
    } else {
        from_json::<ResetBody>(body)?.snapshot
    };
    Ok(Action::Reset {
        id,
        snapshot: snapshot
            .map(|s| check_snapshot_id(&s, "snapshot"))
            .transpose()?,
    })
}

/// GET /snapshots[?sandbox=ID].
pub fn parse_list(query: Option<&str>) -> Result<Action, ApiError> {
    let mut sandbox = None;
    for (name, value) in query_pairs(query)? {
        match name.as_str() {
            "sandbox" => {
                sandbox = Some(check_id(&value).map_err(|_| {
                    bad(format!(
                        "sandbox: {value:?} is not a sandbox id (sb- and 16 hex digits)"
                    ))
                })?)
            }
            other => return Err(bad(format!("{other}: unknown query parameter (sandbox)"))),
        }
    }
    Ok(Action::ListSnapshots { sandbox })
}

#[cfg(test)]
mod tests {
    use crate::daemon::api::routes::{err, parse};
    use crate::daemon::api::{Action, CreateSandbox};

    #[test]
    fn snapshot_fork_reset_and_restore_bodies() {
        let sb = "/sandboxes/sb-0123456789abcdef";
        let snap = "snap-0123456789abcdef";
        let create = parse(
            "POST",
            "/sandboxes",
            None,
            format!(r#"{{"snapshot":"{snap}","ttl_s":5}}"#).as_bytes(),
        )
        .expect("restore");
        assert!(
            matches!(create, Action::CreateSandbox(CreateSandbox { ref snapshot, .. }) if snapshot.as_deref() == Some(snap))
        );
        for (body, field) in [
            (
                format!(r#"{{"snapshot":"{snap}","template":"t"}}"#),
                "template",
            ),
            (format!(r#"{{"snapshot":"{snap}","vcpus":2}}"#), "vcpus"),
            (r#"{"snapshot":"snap-xyz"}"#.to_string(), "snapshot"),
        ] {
            let message = err(parse("POST", "/sandboxes", None, body.as_bytes()));
            assert!(message.contains(field), "{body}: {message:?}");
        }
        assert_eq!(
            parse("POST", &format!("{sb}/snapshots"), None, b"").expect("snapshot"),
            Action::Snapshot {
                id: "sb-0123456789abcdef".into(),
                stop: false,
                ttl_s: None,
                name: None,
            }
        );
        assert!(matches!(
            parse("POST", &format!("{sb}/snapshots"), None, br#"{"name":"base-1.0"}"#),
            Ok(Action::Snapshot { name: Some(ref n), .. }) if n == "base-1.0"
        ));
        for name in [
            "",
            "Upper",
            "-lead",
            "a b",
            "x'--",
            "snap-0123456789abcdef",
            &"n".repeat(64),
        ] {
            let body = serde_json::json!({ "name": name }).to_string();
            let message = err(parse(
                "POST",
                &format!("{sb}/snapshots"),
                None,
                body.as_bytes(),
            ));
            assert!(message.starts_with("name: "), "{name:?}: {message:?}");
        }
        assert!(matches!(
            parse(
                "POST",
                &format!("{sb}/snapshots"),
                None,
                br#"{"stop":true}"#
            ),
            Ok(Action::Snapshot { stop: true, .. })
        ));
        assert!(err(parse(
            "POST",
            &format!("{sb}/snapshots"),
            None,
            br#"{"ttl_s":0}"#
        ))
        .contains("ttl_s"));
        for (body, field) in [
            (r#"{"count":0}"#, "count"),
            (r#"{"count":65}"#, "count"),
            (r#"{"count":2,"ttl_s":-1}"#, "ttl_s"),
            (r#"{"count":2,"labels":{"bad key":"v"}}"#, "labels"),
        ] {
            let message = err(parse("POST", &format!("{sb}/fork"), None, body.as_bytes()));
            assert!(message.contains(field), "{body}: {message:?}");
        }
        assert!(err(parse(
            "POST",
            &format!("{sb}/reset"),
            None,
            br#"{"snapshot":"x"}"#
        ))
        .contains("snapshot"));
        assert!(matches!(
            parse("POST", &format!("{sb}/reset"), None, b""),
            Ok(Action::Reset { snapshot: None, .. })
        ));
        assert!(err(parse("GET", "/snapshots/nope", None, b"")).contains("snapshot"));
        assert!(err(parse("GET", "/snapshots", Some("sandbox=x"), b"")).contains("sandbox: \"x\""));
    }
}
