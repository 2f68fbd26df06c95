//! `rollbox serve` as a boundary between key holders (issue 25, finding 3): admin and tenant
//! keys on the real daemon, its native API and its E2B control plane. Tenant A's key against
//! tenant B's sandbox and snapshot on every route of both APIs answers what an unknown id
//! answers; a tenant may not manage templates, keys or read /metrics; a revoked key is refused
//! at once; keys are kept hashed; template files stay under --template-dir and pulls within
//! --registry-allow. The tier-2 test guest is the template (needs /dev/kvm).

use std::path::Path;
use std::time::Duration;

use rollbox::daemon::api::ROUTES;
use rollbox::daemon::client::{Endpoint, Response};
use rollbox_tests::daemon::{Server, KEY};
use rollbox_tests::{rollbox_binary, test_guest, TEST_GUEST_CMDLINE};
use serde_json::{json, Value};

/// Ids no sandbox or snapshot has.
const UNKNOWN_SANDBOX: &str = "sb-00000000deadbeef";
const UNKNOWN_SNAPSHOT: &str = "snap-00000000deadbeef";

/// One native request with `key` as the bearer key and `extra` headers.
fn native(
    server: &Server,
    key: &str,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    extra: &[(&str, &str)],
) -> Response {
    let auth = format!("Bearer {key}");
    let mut headers = vec![("Authorization", auth.as_str())];
    headers.extend_from_slice(extra);
    Endpoint::Unix(server.sock())
        .request(method, path, &headers, body, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{method} {path}: {e}\n{}", server.log_tail()))
}

fn json_of(response: &Response) -> Value {
    serde_json::from_slice(&response.body).unwrap_or(Value::Null)
}

/// One E2B control-plane request with `key` as X-API-KEY (none without).
fn e2b(port: u16, key: Option<&str>, method: &str, path: &str, body: Option<&str>) -> Response {
    let mut headers = vec![("Content-Type", "application/json")];
    if let Some(key) = key {
        headers.push(("X-API-KEY", key));
    }
    Endpoint::Tcp(format!("127.0.0.1:{port}"))
        .request(
            method,
            path,
            &headers,
            body.map(str::as_bytes),
            Duration::from_secs(60),
        )
        .unwrap_or_else(|e| panic!("E2B {method} {path}: {e}"))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A new key for `tenant`, made with the admin key: (its id, the key).
fn add_key(server: &Server, tenant: &str) -> (String, String) {
    let response = native(
        server,
        KEY,
        "POST",
        "/keys",
        Some(json!({ "tenant": tenant }).to_string().as_bytes()),
        &[],
    );
    assert_eq!(response.status, 201, "{}", response.error_message());
    let made = json_of(&response);
    assert_eq!(made["role"], "tenant", "{made}");
    assert_eq!(made["tenant"], tenant, "{made}");
    (
        made["id"].as_str().expect("id").to_string(),
        made["key"].as_str().expect("key").to_string(),
    )
}

/// A running sandbox of the guest template made with `key`: its id.
fn create(server: &Server, key: &str) -> String {
    let response = native(
        server,
        key,
        "POST",
        "/sandboxes",
        Some(br#"{"template":"guest","ttl_s":600}"#),
        &[],
    );
    assert_eq!(
        response.status,
        201,
        "{}\n{}",
        response.error_message(),
        server.log_tail()
    );
    json_of(&response)["id"].as_str().expect("id").to_string()
}

/// `text` with every id of `ids` replaced by one placeholder, so two answers compare as the
/// same answer about different ids.
fn without(text: &[u8], ids: &[&str]) -> String {
    let mut text = String::from_utf8_lossy(text).into_owned();
    for id in ids {
        text = text.replace(id, "ID");
    }
    text
}

/// A route's request body and query for the table below.
fn request_for(method: &str, pattern: &str) -> (Option<&'static [u8]>, Option<&'static str>) {
    let body: Option<&'static [u8]> = match (method, pattern) {
        ("POST", "/templates") => Some(br#"{"name":"t2","kernel":"/k"}"#),
        ("POST", "/keys") => Some(br#"{"tenant":"z"}"#),
        ("POST", "/sandboxes") => Some(br#"{"template":"guest","ttl_s":60}"#),
        ("POST", "/sandboxes/batch") => Some(br#"{"template":"guest","ttl_s":60,"count":1}"#),
        ("POST", p) if p.ends_with("keepalive") => Some(br#"{"ttl_s":5}"#),
        ("POST", p) if p.ends_with("exec") => Some(br#"{"cmd":["true"]}"#),
        ("POST", p) if p.ends_with("signal") => Some(br#"{"signal":"TERM"}"#),
        ("POST", p) if p.ends_with("stdin") => Some(br#"{"data":"x"}"#),
        ("POST", p) if p.ends_with("fork") => Some(br#"{"count":1}"#),
        ("PATCH", p) if p.ends_with("network") => Some(br#"{"egress":"all"}"#),
        ("PUT", _) => Some(b"x"),
        _ => None,
    };
    let query = if pattern.contains("/files") || pattern.ends_with("/tar") {
        Some("path=/tmp/x")
    } else {
        None
    };
    (body, query)
}

#[test]
fn a_tenant_key_reaches_only_its_own_sandboxes_and_snapshots() {
    let e2b_port = free_port();
    let port_arg = format!("127.0.0.1:{e2b_port}");
    let server = Server::start(&["--e2b-listen", &port_arg, "--e2b-domain", "e2b.test"]);
    server.add_guest_template("guest");
    let (_, key_a) = add_key(&server, "team-a");
    let (_, key_b) = add_key(&server, "team-b");
    let own_a = create(&server, &key_a);
    let b = create(&server, &key_b);
    let response = native(
        &server,
        &key_b,
        "POST",
        &format!("/sandboxes/{b}/snapshots"),
        None,
        &[],
    );
    assert_eq!(response.status, 201, "{}", response.error_message());
    let b_snapshot = json_of(&response)["id"]
        .as_str()
        .expect("snapshot")
        .to_string();
    // B sees its own: the answers A must not get.
    let mine = native(
        &server,
        &key_b,
        "GET",
        &format!("/sandboxes/{b}"),
        None,
        &[],
    );
    assert_eq!(mine.status, 200);
    assert_eq!(json_of(&mine)["tenant"], "team-b");
    let before = json_of(&mine)["last_active_at_ms"].clone();

    // Every native route with an id, against B's and against an unknown one, with A's key.
    let mut checked = 0;
    for (method, pattern) in ROUTES {
        if !pattern.contains("{id}") && !pattern.contains("{snapshot}") {
            continue;
        }
        let (body, query) = request_for(method, pattern);
        let upgrade: &[(&str, &str)] = if pattern.ends_with("{port}") {
            &[("Connection", "Upgrade"), ("Upgrade", "tcp")]
        } else {
            &[]
        };
        let path_of = |sandbox: &str, snapshot: &str| {
            let path = pattern
                .replace("{id}", sandbox)
                .replace("{snapshot}", snapshot)
                .replace("{pid}", "1")
                .replace("{port}", "8080");
            match query {
                Some(q) => format!("{path}?{q}"),
                None => path,
            }
        };
        let theirs = native(
            &server,
            &key_a,
            method,
            &path_of(&b, &b_snapshot),
            body,
            upgrade,
        );
        let unknown = native(
            &server,
            &key_a,
            method,
            &path_of(UNKNOWN_SANDBOX, UNKNOWN_SNAPSHOT),
            body,
            upgrade,
        );
        assert_eq!(
            theirs.status,
            404,
            "{method} {pattern}: {}",
            theirs.error_message()
        );
        assert_eq!(
            unknown.status,
            404,
            "{method} {pattern}: {}",
            unknown.error_message()
        );
        assert_eq!(
            without(&theirs.body, &[&b, &b_snapshot]),
            without(&unknown.body, &[UNKNOWN_SANDBOX, UNKNOWN_SNAPSHOT]),
            "{method} {pattern}"
        );
        checked += 1;
    }
    assert!(checked >= 22, "only {checked} routes with an id");

    // Routes without an id: lists leave B's out, and nothing of B's can be named.
    let listed = json_of(&native(&server, &key_a, "GET", "/sandboxes", None, &[]));
    let ids: Vec<&str> = listed["sandboxes"]
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|s| s["id"].as_str())
        .collect();
    assert_eq!(ids, [own_a.as_str()], "{listed}");
    let snaps = json_of(&native(&server, &key_a, "GET", "/snapshots", None, &[]));
    assert_eq!(snaps["snapshots"], json!([]), "{snaps}");
    let snaps = json_of(&native(
        &server,
        &key_a,
        "GET",
        &format!("/snapshots?sandbox={b}"),
        None,
        &[],
    ));
    assert_eq!(snaps["snapshots"], json!([]), "{snaps}");
    let deleted = native(
        &server,
        &key_a,
        "DELETE",
        &format!("/sandboxes?ids={b}"),
        None,
        &[],
    );
    assert_eq!(
        json_of(&deleted)["deleted"],
        json!([]),
        "{}",
        deleted.error_message()
    );
    for create_path in ["/sandboxes", "/sandboxes/batch"] {
        let from = |snapshot: &str| {
            let mut body = json!({ "snapshot": snapshot, "ttl_s": 60 });
            if create_path.ends_with("batch") {
                body["count"] = json!(1);
            }
            native(
                &server,
                &key_a,
                "POST",
                create_path,
                Some(body.to_string().as_bytes()),
                &[],
            )
        };
        let (theirs, unknown) = (from(&b_snapshot), from(UNKNOWN_SNAPSHOT));
        assert_eq!((theirs.status, unknown.status), (400, 400), "{create_path}");
        assert_eq!(
            without(&theirs.body, &[&b_snapshot]),
            without(&unknown.body, &[UNKNOWN_SNAPSHOT])
        );
    }
    let reset = |snapshot: &str| {
        let body = json!({ "snapshot": snapshot }).to_string();
        native(
            &server,
            &key_a,
            "POST",
            &format!("/sandboxes/{own_a}/reset"),
            Some(body.as_bytes()),
            &[],
        )
    };
    let (theirs, unknown) = (reset(&b_snapshot), reset(UNKNOWN_SNAPSHOT));
    assert_eq!((theirs.status, unknown.status), (400, 400));
    assert_eq!(
        without(&theirs.body, &[&b_snapshot]),
        without(&unknown.body, &[UNKNOWN_SNAPSHOT])
    );

    // The E2B control plane, with A's key.
    let e2b_routes: &[(&str, &str, Option<&str>)] = &[
        ("GET", "/sandboxes/{id}", None),
        ("DELETE", "/sandboxes/{id}", None),
        ("POST", "/sandboxes/{id}/timeout", Some(r#"{"timeout":60}"#)),
        ("POST", "/sandboxes/{id}/pause", None),
        ("POST", "/sandboxes/{id}/resume", Some("{}")),
        ("POST", "/sandboxes/{id}/connect", Some("{}")),
        ("POST", "/sandboxes/{id}/fork", Some(r#"{"count":1}"#)),
        ("POST", "/sandboxes/{id}/snapshots", Some("{}")),
        ("POST", "/sandboxes/{id}/refreshes", Some("{}")),
        ("GET", "/sandboxes/{id}/metrics", None),
        ("GET", "/v2/sandboxes/{id}", None),
        ("DELETE", "/templates/{snapshot}", None),
        (
            "POST",
            "/sandboxes",
            Some(r#"{"templateID":"{snapshot}","timeout":60}"#),
        ),
        (
            "POST",
            "/v2/sandboxes",
            Some(r#"{"templateID":"{snapshot}","timeout":60}"#),
        ),
    ];
    for (method, pattern, body) in e2b_routes {
        let fill = |text: &str, sandbox: &str, snapshot: &str| {
            text.replace("{id}", sandbox)
                .replace("{snapshot}", snapshot)
        };
        let theirs_body = body.map(|text| fill(text, &b, &b_snapshot));
        let unknown_body = body.map(|text| fill(text, UNKNOWN_SANDBOX, UNKNOWN_SNAPSHOT));
        let theirs = e2b(
            e2b_port,
            Some(&key_a),
            method,
            &fill(pattern, &b, &b_snapshot),
            theirs_body.as_deref(),
        );
        let unknown = e2b(
            e2b_port,
            Some(&key_a),
            method,
            &fill(pattern, UNKNOWN_SANDBOX, UNKNOWN_SNAPSHOT),
            unknown_body.as_deref(),
        );
        assert_eq!(
            theirs.status,
            404,
            "E2B {method} {pattern}: {}",
            theirs.error_message()
        );
        assert_eq!(
            (theirs.status, without(&theirs.body, &[&b, &b_snapshot])),
            (
                unknown.status,
                without(&unknown.body, &[UNKNOWN_SANDBOX, UNKNOWN_SNAPSHOT])
            ),
            "E2B {method} {pattern}"
        );
    }
    for path in [
        "/v2/sandboxes",
        "/sandboxes",
        &format!("/snapshots?sandboxID={b}"),
    ] {
        let listed = e2b(e2b_port, Some(&key_a), "GET", path, None);
        assert_eq!(listed.status, 200, "{path}");
        assert!(
            !String::from_utf8_lossy(&listed.body).contains(&b),
            "{path}"
        );
        assert!(
            !String::from_utf8_lossy(&listed.body).contains(&b_snapshot),
            "{path}"
        );
    }
    let many = e2b(
        e2b_port,
        Some(&key_a),
        "GET",
        &format!("/sandboxes/metrics?sandbox_ids={b}"),
        None,
    );
    assert_eq!(json_of(&many)["sandboxes"], json!({}));
    // A tenant's E2B create is the tenant's.
    let made = e2b(
        e2b_port,
        Some(&key_a),
        "POST",
        "/v2/sandboxes",
        Some(r#"{"templateID":"guest","timeout":60}"#),
    );
    assert_eq!(made.status, 201, "{}", made.error_message());
    let e2b_made = json_of(&made)["sandboxID"]
        .as_str()
        .expect("sandboxID")
        .to_string();
    assert_eq!(
        native(
            &server,
            &key_b,
            "GET",
            &format!("/sandboxes/{e2b_made}"),
            None,
            &[]
        )
        .status,
        404
    );
    assert_eq!(
        json_of(&native(
            &server,
            KEY,
            "GET",
            &format!("/sandboxes/{e2b_made}"),
            None,
            &[]
        ))["tenant"],
        "team-a"
    );

    // No key, or a wrong one: 401 on every E2B control route before anything is looked up.
    for (method, pattern, body) in e2b_routes {
        let path = pattern
            .replace("{id}", &b)
            .replace("{snapshot}", &b_snapshot);
        for key in [None, Some("wrong")] {
            let refused = e2b(e2b_port, key, method, &path, *body);
            assert_eq!(refused.status, 401, "E2B {method} {path} with {key:?}");
        }
    }
    // Nothing above touched B's sandbox (a lookup records an API call on it), nor ended it.
    let listed = json_of(&native(&server, &key_b, "GET", "/sandboxes", None, &[]));
    let b_now = listed["sandboxes"]
        .as_array()
        .and_then(|l| l.iter().find(|s| s["id"] == b.as_str()).cloned())
        .unwrap_or_else(|| panic!("B's sandbox is gone: {listed}"));
    assert_eq!(b_now["state"], "running", "{b_now}");
    assert_eq!(b_now["last_active_at_ms"], before, "{b_now}");
    let snap = native(
        &server,
        &key_b,
        "GET",
        &format!("/snapshots/{b_snapshot}"),
        None,
        &[],
    );
    assert_eq!(snap.status, 200, "B's snapshot is gone");
    // The admin sees every tenant's.
    let all = json_of(&native(&server, KEY, "GET", "/sandboxes", None, &[]));
    assert_eq!(all["sandboxes"].as_array().map(Vec::len), Some(3), "{all}");
}

#[test]
fn tenants_may_not_manage_templates_or_keys_and_revoked_keys_stop_at_once() {
    let server = Server::start(&[]);
    server.add_guest_template("guest");
    // The CLI makes, lists and revokes keys.
    let cli = |args: &[&str]| {
        let output = std::process::Command::new(rollbox_binary())
            .args(args)
            .arg("--socket")
            .arg(server.sock())
            .env("ROLLBOX_API_KEY", KEY)
            .output()
            .expect("run rollbox");
        assert!(
            output.status.success(),
            "rollbox {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).trim().to_string()
    };
    let key = cli(&["key", "add", "--tenant", "team-c"]);
    assert!(key.starts_with("rbx_"), "{key}");
    let listed = cli(&["key", "list"]);
    assert!(
        listed.contains("team-c") && !listed.contains(&key),
        "{listed}"
    );
    let id = listed
        .lines()
        .find(|l| l.contains("team-c"))
        .and_then(|l| l.split_whitespace().next())
        .expect("the key's id")
        .to_string();

    // What a tenant may do, and what it may not.
    for (method, path, body) in [
        ("GET", "/healthz", None),
        ("GET", "/templates", None),
        ("GET", "/templates/guest", None),
    ] {
        let response = native(&server, &key, method, path, body, &[]);
        assert_eq!(
            response.status,
            200,
            "{method} {path}: {}",
            response.error_message()
        );
    }
    let template =
        json!({"name": "t2", "kernel": test_guest(), "cmdline": TEST_GUEST_CMDLINE}).to_string();
    for (method, path, body) in [
        ("POST", "/templates", Some(template.as_bytes())),
        ("DELETE", "/templates/guest", None),
        ("POST", "/keys", Some(&br#"{"tenant":"team-c"}"#[..])),
        ("POST", "/keys", Some(&br#"{"admin":true}"#[..])),
        ("GET", "/keys", None),
        ("DELETE", &format!("/keys/{id}"), None),
        ("GET", "/metrics", None),
    ] {
        let response = native(&server, &key, method, path, body, &[]);
        assert_eq!(
            response.status,
            403,
            "{method} {path}: {}",
            response.error_message()
        );
        assert!(
            response.error_message().contains("admin key"),
            "{}",
            response.error_message()
        );
    }
    assert_eq!(
        native(&server, KEY, "GET", "/templates/guest", None, &[]).status,
        200
    );

    // Usage and metrics carry the tenant.
    let sandbox = create(&server, &key);
    let usage = json_of(&native(
        &server,
        &key,
        "GET",
        &format!("/sandboxes/{sandbox}/usage"),
        None,
        &[],
    ));
    assert_eq!(usage["tenant"], "team-c", "{usage}");
    let metrics = native(&server, KEY, "GET", "/metrics", None, &[]);
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains(&format!(
            "sandbox=\"{sandbox}\",template=\"guest\",state=\"running\",tenant=\"team-c\""
        )),
        "{text}"
    );

    // Revoked: the next request is refused, no restart.
    assert_eq!(cli(&["key", "revoke", &id]), format!("key {id} revoked"));
    let refused = native(&server, &key, "GET", "/templates", None, &[]);
    assert_eq!(refused.status, 401, "{}", refused.error_message());
    assert!(!cli(&["key", "list"]).contains("team-c"));

    // Keys are kept as hashes: no key is in the database's files, its hash is.
    let another = add_key(&server, "team-d").1;
    let hash: String = {
        use sha2::Digest as _;
        sha2::Sha256::digest(another.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    };
    let state = server.state();
    let mut found_hash = false;
    for name in ["state.db", "state.db-wal"] {
        let Ok(bytes) = std::fs::read(state.join(name)) else {
            continue;
        };
        for plain in [&key, &another] {
            assert!(
                !bytes.windows(plain.len()).any(|w| w == plain.as_bytes()),
                "{name} holds a key in plain text"
            );
        }
        found_hash |= bytes.windows(hash.len()).any(|w| w == hash.as_bytes());
    }
    assert!(
        found_hash,
        "the key's hash is in neither state.db nor its WAL: the check saw nothing"
    );
}

#[test]
fn template_files_stay_under_template_dirs_and_pulls_within_the_allowed_registries() {
    let allowed = tempfile::tempdir().expect("tempdir");
    let allowed_dir = allowed.path().display().to_string();
    let server = Server::start(&[
        "--template-dir",
        &allowed_dir,
        "--registry-allow",
        "ghcr.io",
    ]);
    let post = |name: &str, extra: Value| {
        let mut body = json!({"name": name, "kernel": test_guest(), "cmdline": TEST_GUEST_CMDLINE});
        for (k, v) in extra.as_object().expect("object") {
            body[k] = v.clone();
        }
        native(
            &server,
            KEY,
            "POST",
            "/templates",
            Some(body.to_string().as_bytes()),
            &[],
        )
    };
    let inside = allowed.path().join("rootfs.img");
    std::fs::write(&inside, vec![0u8; 4096]).expect("rootfs");
    let ok = post("inside", json!({ "rootfs": inside }));
    assert_eq!(ok.status, 201, "{}", ok.error_message());

    // Outside, straight or through a symlink inside the directory.
    let outside = server.dir.path().join("outside.img");
    std::fs::write(&outside, vec![0u8; 4096]).expect("outside");
    let link = allowed.path().join("escape.img");
    std::os::unix::fs::symlink("/etc/passwd", &link).expect("symlink");
    let dir_link = allowed.path().join("etc");
    std::os::unix::fs::symlink("/etc", &dir_link).expect("dir symlink");
    for (field, path, named) in [
        ("rootfs", outside.clone(), outside.display().to_string()),
        ("rootfs", link.clone(), "/etc/passwd".to_string()),
        (
            "rootfs",
            dir_link.join("hostname"),
            "/etc/hostname".to_string(),
        ),
        ("initrd", link.clone(), "/etc/passwd".to_string()),
    ] {
        let refused = post("out", json!({ field: path }));
        let message = refused.error_message();
        assert_eq!(refused.status, 403, "{field} {}: {message}", path.display());
        assert!(
            message.starts_with(&format!("{field}: {}", path.display()))
                && message.contains(&named),
            "{message}"
        );
    }
    for (field, path) in [("docker_archive", &link), ("oci_layout", &dir_link)] {
        let refused = post("img", json!({ "image": { field: path } }));
        assert_eq!(refused.status, 403, "{field}: {}", refused.error_message());
        assert!(refused
            .error_message()
            .starts_with(&format!("image.{field}: ")));
    }
    // The registry allow-list.
    let refused = post(
        "pull",
        json!({ "image": { "reference": "docker.io/library/busybox:latest" } }),
    );
    assert_eq!(refused.status, 403, "{}", refused.error_message());
    assert!(
        refused.error_message().contains("registry \"docker.io\""),
        "{}",
        refused.error_message()
    );
    let unnamed = post("pull2", json!({ "image": { "reference": "busybox" } }));
    assert_eq!(unnamed.status, 403, "{}", unnamed.error_message());
    let templates = json_of(&native(&server, KEY, "GET", "/templates", None, &[]));
    assert_eq!(
        templates["templates"].as_array().map(Vec::len),
        Some(1),
        "{templates}"
    );
    assert!(Path::new(&allowed_dir).exists());
}
