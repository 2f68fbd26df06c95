//! `rollbox exec` runs a command through the agent over a vsock-style Unix socket (here the
//! agent runs as a host process, which speaks the same `CONNECT <port>` protocol).

use std::process::{Command, Stdio};
use std::time::Duration;

use rollbox_tests::{wait_for_socket, workspace_root};

#[test]
fn rollbox_exec_streams_output_and_returns_the_status() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let built = Command::new(cargo)
        .args(["build", "--quiet", "-p", "rollbox", "-p", "rollbox-agent"])
        .current_dir(workspace_root())
        .status()
        .expect("cargo build");
    assert!(built.success());
    let bin = workspace_root().join("target/debug");
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("agent.sock");
    let mut agent = Command::new(bin.join("rollbox-agent"))
        .arg("--listen-unix")
        .arg(&sock)
        .arg("--no-set-clock")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the agent");
    wait_for_socket(&sock, Duration::from_secs(20));
    let run = |args: &[&str]| {
        Command::new(bin.join("rollbox"))
            .arg("exec")
            .arg("--vsock-uds")
            .arg(&sock)
            .args(args)
            .output()
            .expect("rollbox exec")
    };
    let out = run(&[
        "--env",
        "GREETING=hi",
        "--",
        "sh",
        "-c",
        "echo $GREETING; echo oops >&2; exit 3",
    ]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hi\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "oops\n");
    assert_eq!(out.status.code(), Some(3));
    let out = run(&["--timeout", "0.5", "--", "sleep", "30"]);
    assert_eq!(out.status.code(), Some(124));
    let out = Command::new(bin.join("rollbox"))
        .args([
            "exec",
            "--wait",
            "0",
            "--vsock-uds",
            "/nonexistent.sock",
            "--",
            "true",
        ])
        .output()
        .expect("rollbox exec");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent.sock"));
    let _ = agent.kill();
    let _ = agent.wait();
}
