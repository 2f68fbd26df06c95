//! `rollbox lease` as a plain process against a local daemon (issue 27): the stock e2b SDK
//! reaches the lease's sandbox through it (test_lease.py), the sandbox carries the pod's UID,
//! SIGTERM deletes it, a sandbox ended behind the lease's back ends the lease, and a lease
//! that cannot start says why in one line and leaves no sandbox.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{
    e2b_script, free_port, kvm_and_sdk, native_call, rollbox_binary, start_daemon, Daemon,
};

/// A running `rollbox lease` and the sandbox id it printed.
struct Lease {
    child: Child,
    id: String,
    port: u16,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn lease_command(daemon: &Daemon, port: u16, template: &str) -> Command {
    let dir = daemon.dir.path();
    let mut command = Command::new(rollbox_binary());
    command
        .arg("lease")
        .arg("--socket")
        .arg(dir.join("d.sock"))
        .arg("--api-key-file")
        .arg(dir.join("key"))
        .arg("--e2b-socket")
        .arg(dir.join("e2b.sock"))
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .args(["--pod-uid", "pod-0123", "--label", "team=rl"])
        .arg(template)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// Starts a lease of `template` and waits for the id it prints once the sandbox is ready.
fn start_lease(daemon: &Daemon, template: &str) -> Lease {
    let port = free_port();
    let mut child = lease_command(daemon, port, template)
        .spawn()
        .expect("spawn rollbox lease");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let id = rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_default()
        .trim()
        .to_string();
    if id.is_empty() {
        let _ = child.kill();
        let _ = child.wait();
        panic!(
            "the lease printed no sandbox id\n{}\n--- serve.log ---\n{}",
            stderr_of(&mut child),
            daemon.log()
        );
    }
    Lease { child, id, port }
}

fn wait_exit(child: &mut Child, within: Duration) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the lease did not exit within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn stderr_of(child: &mut Child) -> String {
    let mut text = String::new();
    if let Some(mut stderr) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut stderr, &mut text);
    }
    text
}

#[test]
fn stock_e2b_sdk_reaches_its_sandbox_through_a_lease_that_ends_with_it() {
    let test = "stock_e2b_sdk_reaches_its_sandbox_through_a_lease_that_ends_with_it";
    let Some(python) = kvm_and_sdk(test, "2.63.0") else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let e2b_socket = dir.path().join("e2b.sock");
    let (daemon, _) = start_daemon(
        dir,
        None,
        &["--e2b-socket".into(), e2b_socket.display().to_string()],
    );

    // The SDK through the lease.
    let mut lease = start_lease(&daemon, "guest");
    let (status, sandbox) = native_call(&daemon, "GET", &format!("/sandboxes/{}", lease.id), None);
    assert_eq!(status, 200, "{sandbox}");
    assert_eq!(
        sandbox["labels"]["rollbox.dev/pod-uid"], "pod-0123",
        "{sandbox}"
    );
    assert_eq!(sandbox["labels"]["team"], "rl", "{sandbox}");
    let scratch = tempfile::tempdir().expect("scratch");
    let url = format!("http://127.0.0.1:{}", lease.port);
    // The lease puts the daemon's key on its sandbox's control routes: the client's is unused.
    let output = e2b_script(
        &python,
        "test_lease.py",
        &url,
        "not-the-daemons-key",
        "guest",
        scratch.path(),
    )
    .env("ROLLBOX_LEASE_SANDBOX", &lease.id)
    .output()
    .expect("run test_lease.py");
    let stdout = String::from_utf8_lossy(&output.stdout);
    println!("{stdout}");
    assert!(
        output.status.success() && stdout.contains("all ok"),
        "test_lease.py failed ({}):\n{stdout}\n{}\n--- serve.log ---\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr),
        daemon.log()
    );

    // SIGTERM: the sandbox is deleted and the lease exits 0.
    // SAFETY: kill(2) on the lease's own pid, a child this test started and has not reaped.
    unsafe { libc::kill(lease.child.id() as i32, libc::SIGTERM) };
    let status = wait_exit(&mut lease.child, Duration::from_secs(60));
    assert!(
        status.success(),
        "lease exit {status}: {}",
        stderr_of(&mut lease.child)
    );
    let (_, ended) = native_call(&daemon, "GET", &format!("/sandboxes/{}", lease.id), None);
    assert!(ended["ended_at_ms"].is_u64(), "not deleted: {ended}");

    // A sandbox deleted behind the lease's back: the lease ends, saying so.
    let mut lease = start_lease(&daemon, "guest");
    let (status, body) = native_call(&daemon, "DELETE", &format!("/sandboxes/{}", lease.id), None);
    assert!((200..300).contains(&status), "{body}");
    let status = wait_exit(&mut lease.child, Duration::from_secs(30));
    let stderr = stderr_of(&mut lease.child);
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("sandbox {} ended", lease.id)),
        "{stderr}"
    );

    // A template the daemon lacks: one line, exit 1, no sandbox left.
    let (_, before) = native_call(&daemon, "GET", "/sandboxes?state=running", None);
    let output = lease_command(&daemon, free_port(), "no-such-template")
        .output()
        .expect("run rollbox lease");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("no-such-template") && stderr.trim().lines().count() == 1,
        "{stderr}"
    );
    let (_, after) = native_call(&daemon, "GET", "/sandboxes?state=running", None);
    assert_eq!(before["sandboxes"], after["sandboxes"]);
}
