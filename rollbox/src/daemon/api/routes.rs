//! Routes: every (method, path) the daemon answers, each handed to its resource's validator,
//! which makes the [`Action`].

use super::action::{Action, ApiError};
use super::validate::template::check_template_name;
use super::validate::{
    bad, check_id, check_snapshot_id, exec, file, key, network, node, sandbox, snapshot, template,
    volume,
};

/// Every route the daemon answers, as (method, path with `{name}` placeholders). The OpenAPI
/// document (docs/api/openapi.yaml) lists exactly these; a test checks both ways.
pub const ROUTES: &[(&str, &str)] = &[
    ("GET", "/healthz"),
    ("GET", "/metrics"),
    ("GET", "/templates"),
    ("POST", "/templates"),
    ("GET", "/templates/{name}"),
    ("DELETE", "/templates/{name}"),
    ("GET", "/sandboxes"),
    ("POST", "/sandboxes"),
    ("DELETE", "/sandboxes"),
    ("POST", "/sandboxes/batch"),
    ("GET", "/sandboxes/{id}"),
    ("DELETE", "/sandboxes/{id}"),
    ("GET", "/sandboxes/{id}/usage"),
    ("POST", "/sandboxes/{id}/keepalive"),
    ("PATCH", "/sandboxes/{id}/network"),
    ("POST", "/sandboxes/{id}/pause"),
    ("POST", "/sandboxes/{id}/resume"),
    ("POST", "/sandboxes/{id}/exec"),
    ("POST", "/sandboxes/{id}/processes/{pid}/signal"),
    ("POST", "/sandboxes/{id}/processes/{pid}/stdin"),
    ("GET", "/sandboxes/{id}/files"),
    ("PUT", "/sandboxes/{id}/files"),
    ("DELETE", "/sandboxes/{id}/files"),
    ("GET", "/sandboxes/{id}/files/stat"),
    ("GET", "/sandboxes/{id}/files/list"),
    ("GET", "/sandboxes/{id}/tar"),
    ("PUT", "/sandboxes/{id}/tar"),
    ("POST", "/sandboxes/{id}/snapshots"),
    ("POST", "/sandboxes/{id}/fork"),
    ("POST", "/sandboxes/{id}/reset"),
    ("GET", "/snapshots"),
    ("GET", "/snapshots/{snapshot}"),
    ("DELETE", "/snapshots/{snapshot}"),
    ("GET", "/snapshots/{snapshot}/export"),
    ("POST", "/snapshots/import"),
    ("GET", "/sandboxes/{id}/ports/{port}"),
    ("GET", "/keys"),
    ("POST", "/keys"),
    ("DELETE", "/keys/{key}"),
    ("GET", "/node"),
    ("POST", "/node/drain"),
    ("DELETE", "/node/drain"),
    ("GET", "/livez"),
    ("GET", "/readyz"),
    ("GET", "/volumes"),
    ("POST", "/volumes"),
    ("GET", "/volumes/{name}"),
    ("DELETE", "/volumes/{name}"),
    ("GET", "/volumes/{name}/files"),
    ("PUT", "/volumes/{name}/files"),
    ("GET", "/volumes/{name}/tar"),
    ("GET", "/gpus"),
];

/// Whether `method path` is an upload, whose body [`parse`] does not read (it is streamed).
pub fn is_upload(method: &str, path: &str) -> bool {
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match method {
        "PUT" => matches!(
            segments.as_slice(),
            ["sandboxes", _, "files" | "tar"] | ["volumes", _, "files"]
        ),
        "POST" => segments == ["snapshots", "import"],
        _ => false,
    }
}

/// Parses one request into an [`Action`] (the body is already capped at [`MAX_BODY`]).
pub fn parse(
    method: &str,
    path: &str,
    query: Option<&str>,
    body: &[u8],
) -> Result<Action, ApiError> {
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let no_query = || match query {
        Some(q) if !q.is_empty() => Err(bad(format!("{path} takes no query parameters"))),
        _ => Ok(()),
    };
    let action = match (method, segments.as_slice()) {
        ("GET", ["healthz"]) => Action::Health,
        // The frontend answers these before any key check (frontend/rest.rs, `probe`).
        ("GET", ["livez" | "readyz"]) => Action::Health,
        ("GET", ["metrics"]) => Action::Metrics,
        ("GET", ["node"]) => Action::GetNode,
        ("POST", ["node", "drain"]) => node::parse_drain(body)?,
        ("DELETE", ["node", "drain"]) => Action::Undrain,
        ("GET", ["sandboxes", id, "usage"]) => Action::Usage(check_id(id)?),
        ("GET", ["sandboxes", id, "ports", port]) => sandbox::parse_port_connect(id, port)?,
        ("GET", ["keys"]) => Action::ListKeys,
        ("POST", ["keys"]) => Action::AddKey(key::parse_new_key(body)?),
        ("DELETE", ["keys", id]) => Action::RevokeKey(key::check_key_id(id, "key")?),
        ("GET", ["volumes"]) => Action::ListVolumes,
        ("GET", ["gpus"]) => Action::ListGpus,
        ("POST", ["volumes"]) => volume::parse_create(body)?,
        ("GET" | "DELETE", ["volumes", name]) => {
            volume::parse_volume_route(method, name, &[], query)?
        }
        ("GET" | "PUT", ["volumes", name, rest @ ("files" | "tar")]) => {
            return volume::parse_volume_route(method, name, &[rest], query)
        }
        ("GET", ["templates"]) => Action::ListTemplates,
        ("POST", ["templates"]) => Action::AddTemplate(template::parse_template(body)?),
        ("GET", ["templates", name]) => Action::GetTemplate(check_template_name(name, "name")?),
        ("DELETE", ["templates", name]) => {
            Action::RemoveTemplate(check_template_name(name, "name")?)
        }
        // Routes that take a query return at once: the no-query check is not theirs.
        ("GET", ["sandboxes"]) => return Ok(Action::ListSandboxes(sandbox::parse_query(query)?)),
        ("POST", ["sandboxes"]) => Action::CreateSandbox(sandbox::parse_create(body)?),
        ("POST", ["sandboxes", "batch"]) => sandbox::parse_batch(body)?,
        ("DELETE", ["sandboxes"]) => return sandbox::parse_delete(query),
        ("GET", ["sandboxes", id]) => Action::GetSandbox(check_id(id)?),
        ("DELETE", ["sandboxes", id]) => Action::DeleteSandbox(check_id(id)?),
        ("POST", ["sandboxes", id, "keepalive"]) => sandbox::parse_keepalive(id, body)?,
        ("PATCH", ["sandboxes", id, "network"]) => network::parse_patch(id, body)?,
        ("POST", ["sandboxes", id, "pause"]) => Action::Pause(check_id(id)?),
        ("POST", ["sandboxes", id, "resume"]) => Action::Resume(check_id(id)?),
        ("POST", ["sandboxes", id, "exec"]) => return exec::parse_exec(id, query, body),
        ("POST", ["sandboxes", id, "processes", pid, "stdin"]) => exec::parse_stdin(id, pid, body)?,
        ("POST", ["sandboxes", id, "processes", pid, "signal"]) => {
            exec::parse_signal(id, pid, body)?
        }
        ("POST", ["sandboxes", id, "snapshots"]) => snapshot::parse_snapshot(id, body)?,
        ("POST", ["sandboxes", id, "fork"]) => snapshot::parse_fork(id, body)?,
        ("POST", ["sandboxes", id, "reset"]) => snapshot::parse_reset(id, body)?,
        ("GET", ["snapshots"]) => return snapshot::parse_list(query),
        ("GET", ["snapshots", snapshot]) => {
            Action::GetSnapshot(check_snapshot_id(snapshot, "snapshot")?)
        }
        ("DELETE", ["snapshots", snapshot]) => {
            Action::DeleteSnapshot(check_snapshot_id(snapshot, "snapshot")?)
        }
        ("GET", ["snapshots", snapshot, "export"]) => {
            Action::ExportSnapshot(check_snapshot_id(snapshot, "snapshot")?)
        }
        ("POST", ["snapshots", "import"]) => Action::ImportSnapshot,
        (_, ["sandboxes", id, "files" | "tar", ..]) if file_route(method, &segments) => {
            let id = check_id(id)?;
            return Ok(Action::File {
                id,
                op: file::parse_file_op(method, &segments[2..], query)?,
            });
        }
        _ => {
            return Err(if !allowed_methods(path).is_empty() {
                ApiError::MethodNotAllowed {
                    method: method.to_string(),
                    path: path.to_string(),
                }
            } else {
                ApiError::NotFound(format!("no route {method} {path}"))
            });
        }
    };
    no_query()?;
    Ok(action)
}

fn file_route(method: &str, segments: &[&str]) -> bool {
    matches!(
        (method, segments.get(2..).unwrap_or(&[])),
        ("GET" | "PUT" | "DELETE", ["files"])
            | ("GET", ["files", "stat" | "list"])
            | ("GET" | "PUT", ["tar"])
    )
}

/// The methods [`ROUTES`] has for `path`, in table order: a 405's `Allow`, and empty for an
/// unknown path. A literal segment beats a placeholder (`/sandboxes/batch` is not
/// `/sandboxes/{id}`).
pub fn allowed_methods(path: &str) -> Vec<&'static str> {
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let matching: Vec<(&'static str, usize)> = ROUTES
        .iter()
        .filter(|(_, pattern)| matches_pattern(pattern, &segments))
        .map(|(method, pattern)| (*method, pattern.matches('{').count()))
        .collect();
    let fewest = matching.iter().map(|(_, placeholders)| *placeholders).min();
    let mut methods = Vec::new();
    for (method, placeholders) in matching {
        if Some(placeholders) == fewest && !methods.contains(&method) {
            methods.push(method);
        }
    }
    methods
}

fn matches_pattern(pattern: &str, segments: &[&str]) -> bool {
    let parts: Vec<&str> = pattern.trim_start_matches('/').split('/').collect();
    parts.len() == segments.len()
        && parts
            .iter()
            .zip(segments)
            .all(|(p, s)| p.starts_with('{') || p == s)
}

/// A refusal's message, for tests that check what a request is refused for.
#[cfg(test)]
pub(super) fn err(result: Result<Action, ApiError>) -> String {
    match result {
        Err(e) => e.to_string(),
        Ok(a) => panic!("accepted: {a:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::api::Action;

    #[test]
    fn ids_and_routes() {
        assert_eq!(
            parse("GET", "/sandboxes/sb-0123456789abcdef", None, b"").expect("get"),
            Action::GetSandbox("sb-0123456789abcdef".into())
        );
        assert!(err(parse("GET", "/sandboxes/sb-XYZ", None, b"")).contains("id"));
        assert!(err(parse("GET", "/sandboxes/../etc", None, b"")).contains("no route"));
        assert!(matches!(
            parse("PUT", "/sandboxes", None, b""),
            Err(ApiError::MethodNotAllowed { .. })
        ));
        assert!(err(parse("GET", "/nope", None, b"")).contains("no route"));
    }

    #[test]
    fn allowed_methods_come_from_the_route_table() {
        assert_eq!(allowed_methods("/sandboxes"), ["GET", "POST", "DELETE"]);
        assert_eq!(
            allowed_methods("/sandboxes/sb-0123456789abcdef/files"),
            ["GET", "PUT", "DELETE"]
        );
        assert_eq!(allowed_methods("/sandboxes/batch"), ["POST"]);
        assert!(allowed_methods("/nope").is_empty());
    }

    #[test]
    fn every_route_parses() {
        for (method, pattern) in ROUTES {
            let path = pattern
                .replace("{id}", "sb-0123456789abcdef")
                .replace("{name}", "guest")
                .replace("{snapshot}", "snap-0123456789abcdef")
                .replace("{key}", "key-0123456789abcdef");
            let path = path.replace("{pid}", "42").replace("{port}", "8080");
            let body: &[u8] = match (*method, path.as_str()) {
                ("POST", "/templates") => br#"{"name":"g","kernel":"/k"}"#,
                ("POST", "/keys") => br#"{"tenant":"a"}"#,
                ("POST", "/volumes") => br#"{"name":"data"}"#,
                ("POST", "/sandboxes") => br#"{"template":"g"}"#,
                ("POST", "/sandboxes/batch") => br#"{"template":"g","count":2}"#,
                ("POST", p) if p.ends_with("keepalive") => br#"{"ttl_s":5}"#,
                ("PATCH", p) if p.ends_with("network") => br#"{"egress":"all"}"#,
                ("POST", p) if p.ends_with("exec") => br#"{"cmd":["true"]}"#,
                ("POST", p) if p.ends_with("signal") => br#"{"signal":"TERM"}"#,
                ("POST", p) if p.ends_with("stdin") => br#"{"data":"x"}"#,
                ("POST", p) if p.ends_with("fork") => br#"{"count":2}"#,
                _ => b"",
            };
            let query = if path.starts_with("/volumes/") && !path.ends_with("guest") {
                Some("path=x")
            } else if path.contains("/files") || path.ends_with("/tar") {
                Some("path=/x")
            } else if (*method, path.as_str()) == ("DELETE", "/sandboxes") {
                Some("label=run%3Da")
            } else {
                None
            };
            parse(method, &path, query, body).unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        }
    }

    #[test]
    fn ports_parse_and_bad_ones_are_named() {
        assert_eq!(
            parse(
                "GET",
                "/sandboxes/sb-0123456789abcdef/ports/8080",
                None,
                b""
            )
            .expect("parse"),
            Action::PortConnect {
                id: "sb-0123456789abcdef".into(),
                port: 8080
            }
        );
        for port in ["0", "65536", "http"] {
            let path = format!("/sandboxes/sb-0123456789abcdef/ports/{port}");
            let message = err(parse("GET", &path, None, b""));
            assert!(message.contains(&format!("port: {port:?}")), "{message}");
        }
    }
}
