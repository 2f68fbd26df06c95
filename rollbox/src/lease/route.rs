//! Where a request to a lease goes: its sandbox's data plane, the control routes of that one
//! sandbox, the lease's own `/lease`, or nowhere. Pure, so the rules are tested alone.

/// The alias a client may use for the lease's sandbox in control paths
/// (`Sandbox.connect("lease")`), so it needs no id to start.
pub const ALIAS: &str = "lease";

/// The E2B control plane's top-level paths: under them, only the lease's own sandbox.
const CONTROL_PREFIXES: &[&str] = &[
    "/sandboxes",
    "/v2/sandboxes",
    "/templates",
    "/v2/templates",
    "/v3/templates",
    "/volumes",
    "/snapshots",
    "/teams",
    "/nodes",
    "/api-keys",
    "/access-tokens",
];

/// A request's destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// envd and the guest's other ports, for the lease's sandbox.
    Data,
    /// The daemon's E2B control plane, at this path (the alias replaced by the id).
    Control(String),
    /// `GET /lease`: which sandbox this is.
    Info,
    /// Anything else of the control plane: another sandbox, a list, a create.
    Refused,
}

/// The route of a request for `path_and_query`, on a lease of sandbox `id`; `names_sandbox`:
/// it carries `E2b-Sandbox-Id` (the SDK's data-plane requests always do).
pub fn route(path_and_query: &str, names_sandbox: bool, id: &str) -> Route {
    if names_sandbox {
        return Route::Data;
    }
    let (path, query) = match path_and_query.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (path_and_query, None),
    };
    if path == "/lease" {
        return Route::Info;
    }
    let Some(prefix) = CONTROL_PREFIXES.iter().find(|prefix| {
        path.strip_prefix(**prefix)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
    }) else {
        return Route::Data;
    };
    if !prefix.ends_with("/sandboxes") {
        return Route::Refused;
    }
    let rest = &path[prefix.len()..];
    let Some(rest) = rest.strip_prefix('/') else {
        return Route::Refused;
    };
    let (named, tail) = match rest.split_once('/') {
        Some((named, tail)) => (named, Some(tail)),
        None => (rest, None),
    };
    if named != id && named != ALIAS {
        return Route::Refused;
    }
    let mut to = format!("{prefix}/{id}");
    if let Some(tail) = tail {
        to.push('/');
        to.push_str(tail);
    }
    if let Some(query) = query {
        to.push('?');
        to.push_str(query);
    }
    Route::Control(to)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "n1-abc";

    #[test]
    fn requests_naming_a_sandbox_are_data_plane_whatever_their_path() {
        assert_eq!(route("/sandboxes", true, ID), Route::Data);
        assert_eq!(route("/process.Process/Start", true, ID), Route::Data);
    }

    #[test]
    fn envd_paths_without_a_sandbox_header_are_data_plane() {
        for path in [
            "/health",
            "/envs",
            "/files?path=/a",
            "/filesystem.Filesystem/Stat",
        ] {
            assert_eq!(route(path, false, ID), Route::Data, "{path}");
        }
        // A prefix that is only a prefix of the name is not the control path.
        assert_eq!(route("/sandboxesx", false, ID), Route::Data);
    }

    #[test]
    fn the_own_sandbox_by_id_or_alias_reaches_the_control_plane() {
        assert_eq!(
            route("/sandboxes/n1-abc/connect", false, ID),
            Route::Control("/sandboxes/n1-abc/connect".into())
        );
        assert_eq!(
            route("/sandboxes/lease", false, ID),
            Route::Control("/sandboxes/n1-abc".into())
        );
        assert_eq!(
            route("/v2/sandboxes/lease/logs?start=1", false, ID),
            Route::Control("/v2/sandboxes/n1-abc/logs?start=1".into())
        );
        assert_eq!(route("/lease", false, ID), Route::Info);
    }

    #[test]
    fn other_sandboxes_lists_creates_and_the_rest_of_the_control_plane_are_refused() {
        for path in [
            "/sandboxes",
            "/sandboxes?state=running",
            "/sandboxes/",
            "/sandboxes/n1-other",
            "/sandboxes/n1-other/timeout",
            "/v2/sandboxes",
            "/templates",
            "/v3/templates/x",
            "/volumes/v",
            "/api-keys",
        ] {
            assert_eq!(route(path, false, ID), Route::Refused, "{path}");
        }
    }
}
