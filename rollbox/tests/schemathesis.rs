//! schemathesis (pinned, from PyPI, in the venv `scripts/schemathesis-venv.sh` makes) against
//! docs/api/openapi.yaml on a live `rollbox serve`: a TCP listener, the test guest as template
//! "guest", one running sandbox, and a host `rollbox-agent --listen-unix` standing in for the
//! guest's. Every answer must be no 5xx, have a documented status, content type, headers and
//! body shape, and the daemon must outlive the run. A few examples per operation keep it to
//! about a minute.
//!
//! The agent runs as nobody, chrooted into an empty scratch directory: schemathesis reads the
//! sandbox's id from `GET /sandboxes` and then writes, removes and runs whatever it generates
//! through it, which must never reach this host's files. `POST /templates` is left out: its
//! random kernel and rootfs paths would be read (as root) from this host; and `PUT .../tar`,
//! whose tar body schemathesis cannot make; and `POST /node/drain`, which would drain the node
//! under the run.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rollbox::daemon::client::Endpoint;
use rollbox_tests::daemon::{NetLeases, KEY};
use rollbox_tests::{
    jailer_binary, kvm_available, rollbox_binary, skip, test_guest, venv_python, vmm_binary,
    workspace_root, TEST_GUEST_CMDLINE,
};
use serde_json::{json, Value};

/// The schemathesis release the venv pins.
const VERSION: &str = "4.32.5";
/// The checks that gate: no server errors and answers as documented. (`unsupported_method`,
/// `positive_data_acceptance` and `negative_data_rejection` judge the spec's strictness and
/// the 405's Allow header; see CHANGELOG.)
const CHECKS: &str = "not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance,ignored_auth";

/// Children killed on drop.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The static agent, built with guest-agent/build-static.sh when missing; or why not.
fn static_agent() -> Result<PathBuf, String> {
    let path =
        workspace_root().join("target/agent-static/x86_64-unknown-linux-gnu/release/rollbox-agent");
    if !path.is_file() {
        let status = Command::new("sh")
            .arg(workspace_root().join("guest-agent/build-static.sh"))
            .stdout(Stdio::null())
            .status()
            .map_err(|e| format!("cannot run guest-agent/build-static.sh: {e}"))?;
        if !status.success() || !path.is_file() {
            return Err(format!("guest-agent/build-static.sh failed ({status})"));
        }
    }
    Ok(path)
}

/// The agent as nobody in an empty chroot at `root`: its socket path on this side.
fn jailed_agent(agent: &Path, root: &Path, children: &mut Children) -> PathBuf {
    std::fs::copy(agent, root.join("rollbox-agent")).expect("copy the agent");
    std::fs::create_dir(root.join("tmp")).expect("tmp");
    std::os::unix::fs::chown(root, Some(65534), Some(65534)).expect("chown the chroot");
    let tmp = root.join("tmp");
    std::os::unix::fs::chown(&tmp, Some(65534), Some(65534)).expect("chown tmp");
    let child = Command::new("chroot")
        .arg("--userspec=65534:65534")
        .arg(root)
        .args(["/rollbox-agent", "--listen-unix", "/agent.sock"])
        .args(["--no-init", "--no-set-clock", "--no-generation-watch"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the chrooted agent");
    children.0.push(child);
    let sock = root.join("agent.sock");
    let deadline = Instant::now() + Duration::from_secs(20);
    // Connectable, not only there: between bind and listen a connect is refused.
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(
            Instant::now() < deadline,
            "the chrooted agent made no socket"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    sock
}

fn call(api: &Endpoint, method: &str, path: &str, body: Value) -> (u16, Value) {
    let auth = format!("Bearer {KEY}");
    let text = body.to_string();
    let response = api
        .request(
            method,
            path,
            &[("Authorization", &auth)],
            Some(text.as_bytes()),
            Duration::from_secs(60),
        )
        .expect("the daemon answers");
    let value = serde_json::from_slice(&response.body).unwrap_or(Value::Null);
    (response.status, value)
}

#[test]
fn the_api_answers_as_its_openapi_document_says() {
    let test = "schemathesis::the_api_answers_as_its_openapi_document_says";
    if !kvm_available() {
        return;
    }
    let python = match venv_python("scripts/schemathesis-venv.sh", &[VERSION]) {
        Ok(python) => python,
        Err(reason) => return skip(test, &format!("no schemathesis {VERSION} venv: {reason}")),
    };
    let agent = match static_agent() {
        Ok(agent) => agent,
        Err(reason) => return skip(test, &format!("no static agent: {reason}")),
    };
    let schemathesis = python.with_file_name("schemathesis");
    let scratch = tempfile::tempdir().expect("tempdir");
    let root = scratch.path().join("agent-root");
    std::fs::create_dir(&root).expect("agent root");
    // Declared before the daemon's processes, so it is dropped after them.
    let net = NetLeases(scratch.path().join("net"));
    let mut children = Children(Vec::new());
    let agent_sock = jailed_agent(&agent, &root, &mut children);

    std::fs::write(scratch.path().join("key"), format!("{KEY}\n")).expect("key");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let log_path = scratch.path().join("serve.log");
    let log = std::fs::File::create(&log_path).expect("log");
    let serve = Command::new(rollbox_binary())
        .arg("serve")
        .arg("--vmm")
        .arg(vmm_binary())
        .arg("--jailer")
        .arg(jailer_binary())
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--api-key-file")
        .arg(scratch.path().join("key"))
        .arg("--state-dir")
        .arg(scratch.path().join("state"))
        .arg("--net-state-dir")
        .arg(&net.0)
        .args(["--net-pool", "10.245.0.0/20"])
        .arg("--test-agent-socket")
        .arg(&agent_sock)
        .args(["--agent-timeout", "5", "--default-ttl", "300"])
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("spawn rollbox serve");
    children.0.push(serve);
    let serve_log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let api = Endpoint::Tcp(format!("127.0.0.1:{port}"));
    let deadline = Instant::now() + Duration::from_secs(30);
    while api
        .request("GET", "/healthz", &[], None, Duration::from_secs(1))
        .is_err()
    {
        assert!(Instant::now() < deadline, "no daemon:\n{}", serve_log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, body) = call(
        &api,
        "POST",
        "/templates",
        json!({"name": "guest", "kernel": test_guest(), "cmdline": TEST_GUEST_CMDLINE, "memory_mib": 32}),
    );
    assert_eq!(status, 201, "{body}");
    let (status, body) = call(
        &api,
        "POST",
        "/sandboxes",
        json!({"template": "guest", "ttl_s": 300}),
    );
    assert_eq!(status, 201, "{body}\n{}", serve_log());

    let output = Command::new(&schemathesis)
        .current_dir(scratch.path())
        .arg("run")
        .arg(workspace_root().join("docs/api/openapi.yaml"))
        .arg("--url")
        .arg(format!("http://127.0.0.1:{port}"))
        .arg("--header")
        .arg(format!("Authorization: Bearer {KEY}"))
        .args(["--checks", CHECKS])
        .args(["--phases", "examples,coverage,fuzzing"])
        // One worker: hypothesis' lambda descriptions race across threads (a SystemError in
        // ast.parse under Python 3.11).
        .args(["--max-examples", "60", "--workers", "1", "--seed", "1"])
        .args(["--request-timeout", "30"])
        .args(["--exclude-name", "POST /templates"])
        // A tar body is nothing schemathesis can make (no serializer for application/x-tar).
        .args(["--exclude-name", "PUT /sandboxes/{id}/tar"])
        // A drain would refuse the run's own creates, and its deadline end its sandbox.
        .args(["--exclude-name", "POST /node/drain"])
        .args(["--no-color", "--warnings", "off"])
        .stdin(Stdio::null())
        .output()
        .expect("run schemathesis");
    let report = String::from_utf8_lossy(&output.stdout);
    let alive = children
        .0
        .last_mut()
        .and_then(|serve| serve.try_wait().ok())
        .is_some_and(|ended| ended.is_none());
    assert!(alive, "the daemon died during the run:\n{}", serve_log());
    assert!(
        output.status.success(),
        "schemathesis found failures ({}):\n{report}\n{}\ndaemon log:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr),
        serve_log()
    );
}
