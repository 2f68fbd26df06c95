//! `rollbox serve` end to end, the API itself: the key, loopback TCP (any address only with
//! TLS), 4xx answers naming
//! the field, and the OpenAPI document against the routes (each answered live).
//! The real `rollbox` and `rollbox-vmm` binaries with the tier-2 test guest as the
//! template's kernel (tier 2: needs /dev/kvm); `rollbox_tests::daemon` starts the daemon.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use rollbox::daemon::api::ROUTES;
use rollbox::daemon::client::Endpoint;
use rollbox_tests::daemon::{Server, KEY};
use rollbox_tests::{rollbox_binary, test_guest};
use serde_json::{json, Value};

#[test]
fn missing_or_wrong_key_is_401() {
    let server = Server::start(&[]);
    for key in [None, Some("wrong"), Some("")] {
        for (method, path) in [
            ("GET", "/sandboxes"),
            ("POST", "/sandboxes"),
            ("GET", "/nope"),
        ] {
            let response = server.raw(method, path, key, Some(b"{}"));
            assert_eq!(response.status, 401, "{method} {path} with {key:?}");
            assert!(response.error_message().contains("API key"));
            assert_eq!(response.header("www-authenticate"), Some("Bearer"));
        }
    }
    assert_eq!(server.raw("GET", "/healthz", Some(KEY), None).status, 200);
}

/// `rollbox serve` with `extra` flags and its state in `dir`, stderr piped.
fn serve_in(dir: &Path, extra: &[&str]) -> std::process::Child {
    Command::new(rollbox_binary())
        .arg("serve")
        .args(extra)
        .arg("--state-dir")
        .arg(dir.join("state"))
        .env("ROLLBOX_API_KEY", KEY)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn rollbox serve")
}

/// The first stderr line of a daemon that listens on TCP names its URL: that URL.
fn url_of(child: &mut std::process::Child) -> String {
    let mut stderr = std::io::BufReader::new(child.stderr.take().expect("stderr"));
    let mut line = String::new();
    std::io::BufRead::read_line(&mut stderr, &mut line).expect("read");
    line.trim()
        .rsplit(' ')
        .next()
        .filter(|u| u.starts_with("http"))
        .unwrap_or_else(|| panic!("no URL in {line:?}"))
        .to_string()
}

#[test]
fn serves_loopback_tcp_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let serve = |listen: &str| serve_in(dir.path(), &["--listen", listen]);
    let refused = serve("0.0.0.0:0").wait_with_output().expect("wait");
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("not a loopback address"));

    // Port 0: the daemon names the port it got in its first line.
    let mut child = serve("127.0.0.1:0");
    let url = url_of(&mut child);
    assert!(url.starts_with("http://"), "{url}");
    let endpoint = Endpoint::from_url(&url).expect("url");
    let auth = format!("Bearer {KEY}");
    let ok = endpoint
        .request(
            "GET",
            "/healthz",
            &[("Authorization", &auth)],
            None,
            Duration::from_secs(10),
        )
        .expect("GET /healthz");
    let no_key = endpoint
        .request("GET", "/healthz", &[], None, Duration::from_secs(10))
        .expect("GET /healthz");
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!((ok.status, no_key.status), (200, 401));
}

#[test]
fn a_non_loopback_listener_needs_tls_and_then_serves_https() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (ca, cert, key) = match rollbox_tests::daemon::make_certs(dir.path()) {
        Ok(files) => files,
        Err(reason) => {
            rollbox_tests::skip(
                "a_non_loopback_listener_needs_tls_and_then_serves_https",
                &reason,
            );
            return;
        }
    };
    let serve = |extra: &[&str]| serve_in(dir.path(), extra);
    let sock = dir.path().join("d.sock").display().to_string();
    for (extra, flags) in [
        (vec!["--listen", "0.0.0.0:0"], "--tls-cert and --tls-key"),
        (
            vec!["--socket", sock.as_str(), "--e2b-listen", "0.0.0.0:0"],
            "--e2b-tls-cert and --e2b-tls-key",
        ),
    ] {
        let refused = serve(&extra).wait_with_output().expect("wait");
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success(), "{extra:?} served");
        assert!(
            stderr.contains("0.0.0.0:0 is not a loopback address") && stderr.contains(flags),
            "{extra:?}: {stderr}"
        );
    }

    let (cert, key) = (cert.display().to_string(), key.display().to_string());
    let mut child = serve(&[
        "--listen",
        "0.0.0.0:0",
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
    ]);
    let url = url_of(&mut child);
    let port = url
        .strip_prefix("https://0.0.0.0:")
        .unwrap_or_else(|| panic!("not an https URL on 0.0.0.0: {url}"))
        .to_string();
    // Python's ssl checks the chain against the test CA and the address against the cert.
    let script = format!(
        "import http.client, ssl\n\
         ctx = ssl.create_default_context(cafile={ca:?})\n\
         c = http.client.HTTPSConnection('127.0.0.1', {port}, context=ctx, timeout=10)\n\
         c.request('GET', '/healthz', headers={{'Authorization': 'Bearer {KEY}'}})\n\
         r = c.getresponse()\n\
         print(r.status, r.read().decode())\n",
        ca = ca.display().to_string(),
    );
    let https = Command::new("python3")
        .arg("-c")
        .arg(&script)
        .output()
        .expect("python3");
    let plain = Endpoint::from_url(&format!("http://127.0.0.1:{port}"))
        .expect("url")
        .request("GET", "/healthz", &[], None, Duration::from_secs(5));
    let _ = child.kill();
    let _ = child.wait();
    let answer = String::from_utf8_lossy(&https.stdout);
    assert!(
        answer.starts_with("200") && answer.contains("ok"),
        "{answer}{}",
        String::from_utf8_lossy(&https.stderr)
    );
    assert!(
        plain.as_ref().map_or(true, |r| r.status != 200),
        "plain HTTP was answered on the TLS listener: {plain:?}"
    );
}

#[test]
fn bad_requests_get_4xx_naming_the_field() {
    let server = Server::start(&[]);
    server.add_guest_template("guest");
    let cases: Vec<(&str, &str, Value, u16, &str)> = vec![
        (
            "POST",
            "/sandboxes",
            json!({"template": "nosuch", "ttl_s": 5}),
            400,
            "template",
        ),
        (
            "POST",
            "/sandboxes",
            json!({"template": "guest", "ttl_s": 5, "memory_mib": -64}),
            400,
            "memory_mib",
        ),
        (
            "POST",
            "/sandboxes",
            json!({"template": "guest", "ttl_s": 5, "memory_mib": 0}),
            400,
            "memory_mib",
        ),
        (
            "POST",
            "/sandboxes",
            json!({"template": "guest", "ttl_s": 5, "labels": {"no spaces": "x"}}),
            400,
            "labels",
        ),
        (
            "POST",
            "/sandboxes",
            json!({"template": "guest", "ttl_s": 5, "labels": {"k": ["x"]}}),
            400,
            "labels.k",
        ),
        (
            "POST",
            "/sandboxes",
            json!({"template": "guest", "ttl_s": 5, "colour": "red"}),
            400,
            "colour",
        ),
        (
            "POST",
            "/sandboxes",
            json!({"template": "guest"}),
            400,
            "ttl_s",
        ),
        (
            "POST",
            "/sandboxes",
            json!({"template": "guest", "ttl_s": -1}),
            400,
            "ttl_s",
        ),
        ("GET", "/sandboxes/not-an-id", Value::Null, 400, "id"),
        ("DELETE", "/sandboxes/sb-123", Value::Null, 400, "id"),
        ("GET", "/sandboxes?state=zombie", Value::Null, 400, "state"),
        ("GET", "/sandboxes?label=nokey", Value::Null, 400, "label"),
        (
            "GET",
            "/sandboxes/sb-00000000000000aa",
            Value::Null,
            404,
            "sb-00000000000000aa",
        ),
        (
            "POST",
            "/templates",
            json!({"name": "t2", "kernel": "/no/such/kernel"}),
            400,
            "kernel",
        ),
        (
            "POST",
            "/templates",
            json!({"name": "t2", "kernel": test_guest(), "memory_mib": -1}),
            400,
            "memory_mib",
        ),
        (
            "POST",
            "/templates",
            json!({"name": "guest", "kernel": test_guest()}),
            409,
            "name",
        ),
        ("PUT", "/sandboxes", Value::Null, 405, "PUT"),
        ("GET", "/nope", Value::Null, 404, "no route"),
    ];
    for (method, path, body, status, needle) in cases {
        let body = (!body.is_null()).then_some(body);
        let (got, answer) = server.call(method, path, body.clone());
        let error = answer["error"].as_str().unwrap_or_default();
        assert_eq!(got, status, "{method} {path} {body:?}: {answer}");
        assert!(
            error.contains(needle),
            "{method} {path} {body:?}: {error:?} does not name {needle}"
        );
    }
    // A 405 names the methods the path has (RFC 9110's `Allow`).
    for (method, path, allow) in [
        ("PUT", "/sandboxes", "GET, POST, DELETE"),
        ("POST", "/sandboxes/sb-0123456789abcdef/tar", "GET, PUT"),
        ("PUT", "/sandboxes/batch", "POST"),
    ] {
        let response = server.raw(method, path, Some(KEY), None);
        assert_eq!(response.status, 405, "{method} {path}");
        assert_eq!(response.header("allow"), Some(allow), "{method} {path}");
    }
    let big = vec![b'x'; 2 << 20];
    let response = server.raw("POST", "/sandboxes", Some(KEY), Some(&big));
    assert_eq!(response.status, 413);
    assert!(
        response.error_message().contains("body"),
        "{}",
        response.error_message()
    );
    let response = server.raw("POST", "/sandboxes", Some(KEY), Some(b"{not json"));
    assert_eq!(response.status, 400);
    // Nothing above started a VMM.
    assert!(server.vmms().is_empty());
}

#[test]
fn openapi_document_matches_the_routes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let text = std::fs::read_to_string(root.join("docs/api/openapi.yaml")).expect("openapi.yaml");
    let doc: serde_yaml::Value = serde_yaml::from_str(&text).expect("parse openapi.yaml");
    assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.")));
    let mut documented = BTreeSet::new();
    for (path, item) in doc["paths"].as_mapping().expect("paths") {
        let path = path.as_str().expect("path").to_string();
        for (method, _) in item.as_mapping().expect("path item") {
            let method = method.as_str().expect("method");
            if ["get", "post", "put", "patch", "delete"].contains(&method) {
                documented.insert((method.to_uppercase(), path.clone()));
            }
        }
    }
    let served: BTreeSet<(String, String)> = ROUTES
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    assert_eq!(
        documented, served,
        "docs/api/openapi.yaml and api::ROUTES differ"
    );

    // And the live server answers each of them (never 404 "no route" or 405).
    let server = Server::start(&[]);
    for (method, path) in &served {
        let path = path
            .replace("{id}", "sb-00000000000000aa")
            .replace("{name}", "nosuch");
        let response = server.raw(method, &path, Some(KEY), Some(b"{}"));
        assert_ne!(response.status, 405, "{method} {path}");
        assert!(
            !response.error_message().contains("no route"),
            "{method} {path}: {}",
            response.error_message()
        );
    }
}
