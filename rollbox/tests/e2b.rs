//! The stock `e2b` Python SDK (from PyPI, pinned) against `rollbox serve --e2b-listen`: the real
//! `rollbox` and `rollbox-vmm` with the tier-2 test guest as the template (needs /dev/kvm), and
//! exec/files through a host `rollbox-agent --listen-unix` (the test guest has no agent).
//! The SDK's venv comes from scripts/e2b-venv.sh (cached outside the repository); when it
//! cannot be made the test is skipped, which ROLLBOX_REQUIRE_ALL=1 turns into a failure.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rollbox::daemon::client::Endpoint;
use rollbox::daemon::vm;
use rollbox_tests::{
    agent_binary, kvm_available, rollbox_binary, skip, test_guest, vmm_binary, workspace_root,
    TEST_GUEST_CMDLINE,
};
use serde_json::json;

const KEY: &str = "e2b-test-key-0123";

/// Ends the children and every VMM left under the state directory on drop.
struct Daemon {
    children: Vec<Child>,
    dir: tempfile::TempDir,
}

impl Daemon {
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("serve.log")).unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Ok(dir) = std::fs::canonicalize(self.dir.path().join("state")) {
            for found in vm::find_vmms(&dir.join("sandboxes")) {
                vm::kill(found.pid, found.start_time, Duration::from_secs(5));
            }
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

fn wait_for(what: &str, daemon: &Daemon, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}\n{}",
            daemon.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A daemon with the E2B listener, a host agent, and the test guest as template "guest".
fn start_daemon() -> (Daemon, u16) {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("key"), format!("{KEY}\n")).expect("write key");
    let agent_sock = dir.path().join("agent.sock");
    let agent = Command::new(agent_binary())
        .arg("--listen-unix")
        .arg(&agent_sock)
        .args(["--no-init", "--no-set-clock", "--no-generation-watch"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn rollbox-agent");
    let mut daemon = Daemon {
        children: vec![agent],
        dir,
    };
    wait_for("the host agent's socket", &daemon, || agent_sock.exists());
    let port = free_port();
    let log = std::fs::File::create(daemon.dir.path().join("serve.log")).expect("log");
    let sock = daemon.dir.path().join("d.sock");
    let serve = Command::new(rollbox_binary())
        .arg("serve")
        .arg("--vmm")
        .arg(vmm_binary())
        .arg("--socket")
        .arg(&sock)
        .arg("--api-key-file")
        .arg(daemon.dir.path().join("key"))
        .arg("--state-dir")
        .arg(daemon.dir.path().join("state"))
        .arg("--test-agent-socket")
        .arg(&agent_sock)
        .arg("--e2b-listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--e2b-domain")
        .arg("e2b.test")
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("spawn rollbox serve");
    daemon.children.push(serve);
    wait_for("rollbox serve", &daemon, || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    let body = json!({
        "name": "guest",
        "kernel": test_guest(),
        "cmdline": TEST_GUEST_CMDLINE,
        "memory_mib": 32,
    })
    .to_string();
    let auth = format!("Bearer {KEY}");
    let response = Endpoint::Unix(sock)
        .request(
            "POST",
            "/templates",
            &[("Authorization", auth.as_str())],
            Some(body.as_bytes()),
            Duration::from_secs(30),
        )
        .expect("POST /templates");
    assert_eq!(response.status, 201, "{}", response.error_message());
    (daemon, port)
}

/// The venv's python for SDK `version`, or why there is none.
fn sdk_python(version: &str) -> Result<PathBuf, String> {
    let script = workspace_root().join("scripts/e2b-venv.sh");
    let output = Command::new("sh")
        .arg(&script)
        .arg(version)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    if !output.status.success() {
        return Err(format!(
            "{} {version} failed ({}): {}",
            script.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let python = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    if python.is_file() {
        Ok(python)
    } else {
        Err(format!("{} printed no python", script.display()))
    }
}

fn run_sdk_suite(test: &str, version: &str) {
    if !kvm_available() {
        return;
    }
    let python = match sdk_python(version) {
        Ok(python) => python,
        Err(reason) => {
            skip(test, &format!("no e2b {version} venv: {reason}"));
            return;
        }
    };
    let (daemon, port) = start_daemon();
    let scratch = tempfile::tempdir().expect("scratch");
    let url = format!("http://127.0.0.1:{port}");
    let output = Command::new(&python)
        .arg(workspace_root().join("rollbox/tests/e2b/test_sdk.py"))
        .env("E2B_API_URL", &url)
        .env("E2B_API_KEY", KEY)
        .env("E2B_DOMAIN", "e2b.test")
        .env("E2B_SANDBOX_URL", &url)
        .env("ROLLBOX_E2B_TEMPLATE", "guest")
        .env("ROLLBOX_E2B_SCRATCH", scratch.path())
        .env_remove("E2B_DEBUG")
        .stdin(Stdio::null())
        .output()
        .expect("run test_sdk.py");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}");
    assert!(
        output.status.success() && stdout.contains("all ok"),
        "e2b {version} suite failed ({}):\n{stdout}\n{stderr}\n--- serve.log ---\n{}",
        output.status,
        daemon.log()
    );
}

#[test]
fn stock_e2b_sdk_2_63_against_rollbox() {
    run_sdk_suite("stock_e2b_sdk_2_63_against_rollbox", "2.63.0");
}
