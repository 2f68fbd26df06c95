//! `rollbox serve` as a node of a fleet: `GET /node` (slots, memory, CPU fingerprint,
//! templates, snapshots), admission against `--max-sandboxes` and `--memory-budget-mib` (429
//! with Retry-After naming the limit, batches and forks all or nothing, idempotent repeats
//! still answered), drain (503 for new sandboxes, running ones untouched, a deadline ends
//! them), the unauthenticated `/livez` and `/readyz`, `/metrics` gauges, `rollbox node`, and
//! the end of a pod's sandboxes once the kubelet removes the pod (`--kubelet-pods-dir`).

use std::time::Duration;

use rollbox_tests::daemon::{assert_ended, cli, wait_for, Server, KEY};
use rollbox_tests::kvm_available;
use serde_json::{json, Value};

fn node(server: &Server) -> Value {
    let (status, node) = server.call("GET", "/node", None);
    assert_eq!(status, 200, "{node}");
    node
}

/// A create that must be refused with `status`: the error body.
fn refused(server: &Server, path: &str, body: Value, status: u16) -> Value {
    let body = body.to_string();
    let response = server.raw("POST", path, Some(KEY), Some(body.as_bytes()));
    let value: Value = serde_json::from_slice(&response.body).unwrap_or(Value::Null);
    assert_eq!(response.status, status, "{path}: {value}");
    if status == 429 {
        assert_eq!(
            response.header("retry-after"),
            Some("1"),
            "{path}: a 429 says when to retry"
        );
    }
    value
}

#[test]
fn admission_counts_live_sandboxes_and_their_memory_and_names_the_limit() {
    if !kvm_available() {
        return;
    }
    let server = Server::start(&[
        "--max-sandboxes",
        "2",
        "--memory-budget-mib",
        "80",
        "--node-id",
        "test-node-1",
    ]);
    let empty = node(&server);
    assert_eq!(empty["node_id"], "test-node-1", "{empty}");
    assert_eq!(empty["status"], "ready");
    assert_eq!(empty["slots"], json!({"total": 2, "used": 0, "pending": 0}));
    assert_eq!(empty["memory_mib"]["budget"], 80);
    assert_eq!(empty["memory_mib"]["committed"], 0);
    assert!(
        empty["memory_mib"]["host_available"].as_u64().unwrap_or(0) > 0,
        "{empty}"
    );
    assert_eq!(
        empty["cpu"]["id"].as_str().map(str::len),
        Some(16),
        "{empty}"
    );
    assert!(empty["version"].as_str().is_some_and(|v| !v.is_empty()));

    let snapshot = server.guest_snapshot();
    let with_template = node(&server);
    assert_eq!(
        with_template["templates"][0]["name"], "guest",
        "{with_template}"
    );
    assert_eq!(with_template["snapshots"], json!([snapshot]));

    let a = server.create(json!({"template": "guest", "ttl_s": 120}));
    let too_big = refused(
        &server,
        "/sandboxes",
        json!({"template": "guest", "ttl_s": 120, "memory_mib": 64}),
        429,
    );
    assert_eq!(too_big["limit"], "memory_budget_mib", "{too_big}");
    assert!(
        too_big["error"]
            .as_str()
            .unwrap_or("")
            .contains("--memory-budget-mib"),
        "{too_big}"
    );
    let b_body = json!({"template": "guest", "ttl_s": 120, "idempotency_key": "b-once"});
    let b = server.create(b_body.clone());
    let after_two = node(&server);
    assert_eq!(after_two["slots"]["used"], 2, "{after_two}");
    assert_eq!(after_two["memory_mib"]["committed"], 64, "{after_two}");

    let full = refused(
        &server,
        "/sandboxes",
        json!({"template": "guest", "ttl_s": 120}),
        429,
    );
    assert_eq!(full["limit"], "max_sandboxes", "{full}");
    assert!(
        full["error"].as_str().unwrap_or("").contains("test-node-1"),
        "{full}"
    );
    // A batch and a fork that do not fit are refused whole: nothing made, no snapshot taken.
    refused(
        &server,
        "/sandboxes/batch",
        json!({"count": 2, "template": "guest", "ttl_s": 120}),
        429,
    );
    let a_id = a["id"].as_str().expect("id");
    refused(
        &server,
        &format!("/sandboxes/{a_id}/fork"),
        json!({"count": 1}),
        429,
    );
    assert_eq!(
        node(&server)["snapshots"],
        json!([snapshot]),
        "a refused fork took a snapshot"
    );
    // A repeat of a create that succeeded is answered with what it made, full or not.
    let (status, again) = server.call("POST", "/sandboxes", Some(b_body));
    assert_eq!((status, &again["id"]), (200, &b["id"]), "{again}");

    let metrics = server.raw("GET", "/metrics", Some(KEY), None);
    let metrics = String::from_utf8_lossy(&metrics.body).to_string();
    for line in [
        "rollbox_node_slots_used{node=\"test-node-1\"} 2",
        "rollbox_node_slots_total{node=\"test-node-1\"} 2",
        "rollbox_node_memory_committed_mib{node=\"test-node-1\"} 64",
        "rollbox_node_draining{node=\"test-node-1\"} 0",
    ] {
        assert!(metrics.contains(line), "no {line:?} in\n{metrics}");
    }

    let (status, _) = server.call("DELETE", &format!("/sandboxes/{a_id}"), None);
    assert_eq!(status, 204);
    server.create(json!({"template": "guest", "ttl_s": 120}));
}

#[test]
fn drain_refuses_new_sandboxes_keeps_running_ones_and_its_deadline_ends_them() {
    if !kvm_available() {
        return;
    }
    let server = Server::start(&[]);
    server.add_guest_template("guest");
    let a = server.create(json!({"template": "guest", "ttl_s": 300}));
    let a_id = a["id"].as_str().expect("id").to_string();

    let (status, draining) = server.call("POST", "/node/drain", Some(json!({})));
    assert_eq!(
        (status, &draining["status"]),
        (200, &json!("draining")),
        "{draining}"
    );
    let readyz = server.raw("GET", "/readyz", None, None);
    assert_eq!(
        (readyz.status, readyz.body.as_slice()),
        (503, &b"not ready\n"[..])
    );
    let refusal = refused(
        &server,
        "/sandboxes",
        json!({"template": "guest", "ttl_s": 60}),
        503,
    );
    assert!(
        refusal["error"].as_str().unwrap_or("").contains("draining"),
        "{refusal}"
    );
    refused(
        &server,
        "/sandboxes/batch",
        json!({"count": 2, "template": "guest", "ttl_s": 60}),
        503,
    );
    refused(
        &server,
        &format!("/sandboxes/{a_id}/fork"),
        json!({"count": 1}),
        503,
    );
    assert_eq!(
        server.get(&a_id)["state"],
        "running",
        "a drain leaves running sandboxes be"
    );

    let undrained = cli(&server, &["node", "undrain"]);
    assert!(undrained.contains("status    ready"), "{undrained}");
    assert_eq!(server.raw("GET", "/readyz", None, None).status, 200);
    let b = server.create(json!({"template": "guest", "ttl_s": 300}));
    let b_id = b["id"].as_str().expect("id").to_string();

    let info = cli(&server, &["node", "drain", "--deadline", "1"]);
    assert!(info.contains("draining (what is left ends at"), "{info}");
    wait_for(
        "the drain deadline to end both sandboxes",
        Duration::from_secs(30),
        || {
            [&a_id, &b_id]
                .iter()
                .all(|id| server.get(id)["state"] == "deleted")
        },
    );
    assert_ended(&server.get(&a_id), "deleted", "drain deadline");
    assert_eq!(node(&server)["slots"]["used"], 0);
    let (status, ready) = server.call("DELETE", "/node/drain", None);
    assert_eq!(
        (status, &ready["status"]),
        (200, &json!("ready")),
        "{ready}"
    );
}

#[test]
fn probes_need_no_key_and_say_nothing_else_and_the_node_is_an_admins() {
    if !kvm_available() {
        return;
    }
    let server = Server::start(&["--node-id", "probe-node"]);
    let livez = server.raw("GET", "/livez", None, None);
    assert_eq!((livez.status, livez.body.as_slice()), (200, &b"ok\n"[..]));
    let readyz = server.raw("GET", "/readyz", Some("not-a-key"), None);
    assert_eq!(
        (readyz.status, readyz.body.as_slice()),
        (200, &b"ready\n"[..])
    );
    assert_eq!(server.raw("GET", "/node", None, None).status, 401);
    assert_eq!(
        server.raw("POST", "/node/drain", None, Some(b"{}")).status,
        401
    );

    let (status, key) = server.call("POST", "/keys", Some(json!({"tenant": "t1"})));
    assert_eq!(status, 201, "{key}");
    let tenant = key["key"].as_str().expect("key");
    for (method, path) in [
        ("GET", "/node"),
        ("POST", "/node/drain"),
        ("DELETE", "/node/drain"),
    ] {
        let response = server.raw(method, path, Some(tenant), Some(b"{}"));
        assert_eq!(response.status, 403, "{method} {path} with a tenant key");
    }
    let (status, bad) = server.call("POST", "/node/drain", Some(json!({"deadline": 3})));
    assert_eq!(status, 400, "{bad}");
    assert!(
        bad["error"].as_str().unwrap_or("").contains("deadline"),
        "{bad}"
    );
    let info = cli(&server, &["node", "info"]);
    assert!(info.contains("node      probe-node"), "{info}");

    // `rollbox node probe`, a Kubernetes exec probe: no key, its status says it all.
    let probe = |what: &str| {
        std::process::Command::new(rollbox_tests::rollbox_binary())
            .args(["node", "probe", what, "--socket"])
            .arg(server.sock())
            .env_remove("ROLLBOX_API_KEY")
            .output()
            .expect("rollbox node probe")
    };
    for what in ["live", "ready"] {
        let out = probe(what);
        assert!(
            out.status.success(),
            "probe {what}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let (status, _) = server.call("POST", "/node/drain", Some(json!({})));
    assert_eq!(status, 200);
    assert!(probe("live").status.success(), "a draining node is alive");
    let not_ready = probe("ready");
    assert_eq!(not_ready.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&not_ready.stderr).contains("/readyz: not ready"),
        "{}",
        String::from_utf8_lossy(&not_ready.stderr)
    );
}

#[test]
fn drain_on_sigterm_refuses_creates_ends_what_is_left_and_then_exits() {
    if !kvm_available() {
        return;
    }
    // Long enough that the checks below run inside the drain on a busy machine.
    let mut server = Server::start(&["--drain-on-sigterm", "10"]);
    server.add_guest_template("guest");
    let a = server.create(json!({"template": "guest", "ttl_s": 300}));
    let a_id = a["id"].as_str().expect("id").to_string();
    let pid = server.pid();
    // SAFETY: a signal to the daemon this test started.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGTERM) }, 0);
    wait_for("/readyz to say not ready", Duration::from_secs(10), || {
        server.raw("GET", "/readyz", None, None).status == 503
    });
    // While it drains it still answers: creates are refused, the sandbox runs.
    refused(
        &server,
        "/sandboxes",
        json!({"template": "guest", "ttl_s": 60}),
        503,
    );
    assert_eq!(server.get(&a_id)["state"], "running");
    let mut child = server.child.take().expect("the daemon");
    let stopped = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            stopped.elapsed() < Duration::from_secs(60),
            "the daemon did not exit\n{}",
            server.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}\n{}", server.log());
    assert!(server.vmms().is_empty(), "a VMM outlived the drain");
    server.spawn();
    assert_ended(&server.get(&a_id), "deleted", "drain deadline");
}

#[test]
fn a_sandbox_of_a_pod_ends_once_the_kubelet_removes_the_pods_directory() {
    if !kvm_available() {
        return;
    }
    // The kubelet keeps one directory per pod UID under /var/lib/kubelet/pods; the daemon only
    // looks at whether it is there.
    let pods = tempfile::tempdir().expect("pods dir");
    for uid in ["3f1c-a", "3f1c-b"] {
        std::fs::create_dir(pods.path().join(uid)).expect("pod dir");
    }
    let pods_dir = pods.path().to_str().expect("utf-8").to_string();
    let server = Server::start(&["--kubelet-pods-dir", &pods_dir]);
    server.add_guest_template("guest");
    let of_pod = |uid: &str| {
        let sandbox = server.create(json!({
            "template": "guest", "ttl_s": 300, "labels": {"rollbox.dev/pod-uid": uid}
        }));
        sandbox["id"].as_str().expect("id").to_string()
    };
    let a = of_pod("3f1c-a");
    let b = of_pod("3f1c-b");
    let unlabelled = server.create(json!({"template": "guest", "ttl_s": 300}));
    let unlabelled = unlabelled["id"].as_str().expect("id").to_string();

    std::fs::remove_dir(pods.path().join("3f1c-b")).expect("pod b goes");
    wait_for(
        "the reaper to end pod b's sandbox",
        Duration::from_secs(30),
        || server.get(&b)["state"] == "deleted",
    );
    assert_ended(&server.get(&b), "deleted", "pod 3f1c-b is gone");
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(server.get(&a)["state"], "running", "pod a is still there");
    assert_eq!(
        server.get(&unlabelled)["state"],
        "running",
        "no pod, no reaping"
    );

    // A pods directory that is not there is refused at start, in one line: it would make
    // every pod look gone.
    let scratch = tempfile::tempdir().expect("scratch");
    std::fs::write(scratch.path().join("key"), KEY).expect("key");
    let output = std::process::Command::new(rollbox_tests::rollbox_binary())
        .arg("serve")
        .arg("--kubelet-pods-dir")
        .arg(pods.path().join("no-such-dir"))
        .arg("--socket")
        .arg(scratch.path().join("d.sock"))
        .arg("--api-key-file")
        .arg(scratch.path().join("key"))
        .arg("--state-dir")
        .arg(scratch.path().join("state"))
        .output()
        .expect("rollbox serve runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("--kubelet-pods-dir") && stderr.contains("not a directory"),
        "{stderr}"
    );
}

/// A stand-in for the Kubernetes API server, which cannot be installed here: Python's HTTPS
/// server on 127.0.0.1 with a certificate of its own, which records each request in
/// `dir/requests` (one JSON line) and refuses a node named `forbidden` with 403.
const API_SERVER: &str = r#"
import http.server, json, ssl, sys
d = sys.argv[1]
class H(http.server.BaseHTTPRequestHandler):
    def do_PATCH(self):
        body = self.rfile.read(int(self.headers["Content-Length"])).decode()
        with open(d + "/requests", "a") as f:
            f.write(json.dumps({"path": self.path, "auth": self.headers["Authorization"],
                                "type": self.headers["Content-Type"], "body": body}) + "\n")
        code = 403 if "/forbidden/" in self.path else 200
        answer = b'{"kind":"Status","reason":"Forbidden"}' if code == 403 else b'{"kind":"Node"}'
        self.send_response(code)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)
    def log_message(self, *args):
        pass
s = http.server.HTTPServer(("127.0.0.1", 0), H)
c = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
c.load_cert_chain(d + "/cert.pem", d + "/key.pem")
s.socket = c.wrap_socket(s.socket, server_side=True)
print(s.server_address[1], flush=True)
s.serve_forever()
"#;

#[test]
fn advertise_publishes_the_slot_limit_on_the_kubernetes_node() {
    use std::io::BufRead as _;
    if !kvm_available() {
        return;
    }
    let account = tempfile::tempdir().expect("service account dir");
    let dir = account.path();
    // A cluster CA and the API server's certificate for 127.0.0.1, signed by it.
    let made = std::process::Command::new("sh")
        .arg("-ec")
        .arg(
            "cd \"$1\"
             openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=kube-ca -keyout ca.key -out ca.crt
             openssl req -newkey rsa:2048 -nodes -subj /CN=kube-apiserver -keyout key.pem -out server.csr
             printf 'subjectAltName=IP:127.0.0.1\\nbasicConstraints=CA:FALSE\\n' > server.ext
             openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 -extfile server.ext -out cert.pem",
        )
        .arg("sh")
        .arg(dir)
        .output()
        .expect("openssl");
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    std::fs::write(dir.join("token"), "tok-123\n").expect("token");
    let mut api = std::process::Command::new("python3")
        .args(["-c", API_SERVER])
        .arg(dir)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3");
    let mut port = String::new();
    std::io::BufReader::new(api.stdout.take().expect("stdout"))
        .read_line(&mut port)
        .expect("port");
    let port = port.trim().to_string();

    let server = Server::start(&["--max-sandboxes", "3"]);
    let advertise = |node: &str| {
        std::process::Command::new(rollbox_tests::rollbox_binary())
            .args(["node", "advertise", "--once", "--node-name", node])
            .arg("--service-account")
            .arg(dir)
            .arg("--socket")
            .arg(server.sock())
            .env("ROLLBOX_API_KEY", KEY)
            .env("KUBERNETES_SERVICE_HOST", "127.0.0.1")
            .env("KUBERNETES_SERVICE_PORT", &port)
            .output()
            .expect("rollbox node advertise")
    };
    let out = advertise("node-a");
    let refused = advertise("forbidden");
    let _ = api.kill();
    let _ = api.wait();
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("403"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("published rollbox.dev/slots=3 on node node-a"),
        "{stdout}"
    );
    let requests = std::fs::read_to_string(dir.join("requests")).expect("requests");
    let first: Value = serde_json::from_str(requests.lines().next().expect("a request")).unwrap();
    assert_eq!(first["path"], "/api/v1/nodes/node-a/status");
    assert_eq!(first["auth"], "Bearer tok-123");
    assert_eq!(first["type"], "application/json-patch+json");
    let patch: Value = serde_json::from_str(first["body"].as_str().unwrap()).unwrap();
    assert_eq!(
        patch,
        json!([{"op": "add", "path": "/status/capacity/rollbox.dev~1slots", "value": "3"}])
    );
    // A node name that is no DNS name never reaches the API server.
    let bad = advertise("../nodes");
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("DNS subdomain"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
}
