//! The static agent binary as PID 1 of a busybox container: it must run in
//! a foreign rootfs (no glibc), look users up in that rootfs's /etc/passwd,
//! reap orphans, run a command on a terminal and watch a directory. Needs `guest-agent/build-static.sh` and
//! `scripts/start-dockerd.sh`; skips with one line when either is missing,
//! unless ROLLBOX_REQUIRE_ALL=1.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use rollbox_agent_protocol::{
    AgentClient, ClientMessage, ExecEvent, ExecRequest, FsEventKind, PtySize, ServerMessage,
    WatchRequest, DEFAULT_PORT,
};
use rollbox_tests::skip;

const IMAGE: &str = "rollbox-test/busybox:latest";

fn static_agent() -> PathBuf {
    std::env::var_os("ROLLBOX_AGENT_STATIC")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../target/agent-static/x86_64-unknown-linux-gnu/release/rollbox-agent")
        })
}

fn missing() -> Option<String> {
    let binary = static_agent();
    if !binary.exists() {
        return Some(format!(
            "no static agent at {} (run guest-agent/build-static.sh)",
            binary.display()
        ));
    }
    let docker = Command::new("timeout")
        .args(["20", "docker", "image", "inspect", IMAGE])
        .output();
    match docker {
        Ok(out) if out.status.success() => None,
        _ => Some(format!(
            "dockerd or the image {IMAGE} is missing (run scripts/start-dockerd.sh)"
        )),
    }
}

struct Container {
    name: String,
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = Command::new("docker")
            .args(["rm", "-f", &self.name])
            .output();
    }
}

#[tokio::test]
async fn static_agent_runs_as_pid1_in_a_busybox_container() {
    if let Some(reason) = missing() {
        return skip("static_agent_runs_as_pid1_in_a_busybox_container", &reason);
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let name = format!("rollbox-agent-test-{}", std::process::id());
    let status = Command::new("docker")
        .args([
            "run",
            "-d",
            "--rm",
            "--network",
            "none",
            "--name",
            &name,
            "-v",
        ])
        .arg(format!("{}:/rollbox-agent:ro", static_agent().display()))
        .arg("-v")
        .arg(format!("{}:/sock", dir.path().display()))
        .args([IMAGE, "/rollbox-agent", "--listen-unix", "/sock/agent.sock"])
        .output()
        .expect("docker run");
    assert!(
        status.status.success(),
        "docker run: {}",
        String::from_utf8_lossy(&status.stderr)
    );
    let _container = Container { name: name.clone() };
    let socket = dir.path().join("agent.sock");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !socket.exists() {
        assert!(
            Instant::now() < deadline,
            "agent socket did not appear; docker logs {name}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let client = AgentClient::connect_unix(&socket, DEFAULT_PORT)
        .await
        .expect("connect");
    let health = client.health().await.expect("health");
    assert_eq!(health.pid, 1);
    assert!(health.is_init);

    // busybox's /etc/passwd, parsed by the agent itself (no NSS in a static binary).
    let mut req = ExecRequest::argv(["id"]);
    req.user = Some("nobody".into());
    let output = client.run(req).await.expect("run as nobody");
    assert!(
        String::from_utf8_lossy(&output.stdout).starts_with("uid=65534(nobody)"),
        "{output:?}"
    );

    // An orphan (the shell exits before its child) is reparented to PID 1 and reaped.
    let output = client.sh("sleep 0.2 & echo $!").await.expect("run");
    let orphan: u32 = String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .expect("pid");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let stat = client.read_file(&format!("/proc/{orphan}/stat")).await;
        match stat {
            Err(_) => break,
            Ok(stat) => {
                let text = String::from_utf8_lossy(&stat).into_owned();
                assert!(
                    Instant::now() < deadline,
                    "orphan {orphan} not reaped: {text}"
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Files work in the container's rootfs.
    client
        .write_file("/tmp/x", b"in the container")
        .await
        .expect("write");
    assert_eq!(
        client.read_file("/tmp/x").await.expect("read"),
        b"in the container"
    );

    // A terminal from the container's /dev/ptmx, opened by the static binary.
    let mut req = ExecRequest::shell("tty; stty size");
    req.pty = Some(PtySize { rows: 33, cols: 77 });
    let output = client
        .exec(req)
        .await
        .expect("exec on a pty")
        .collect()
        .await
        .expect("collect");
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        text.contains("/dev/pts/") && text.contains("33 77"),
        "{output:?}"
    );
    assert_eq!(output.status.code, Some(0));
    let mut handle = client
        .exec({
            let mut req = ExecRequest::shell("read line; echo \"typed $line\"");
            req.pty = Some(PtySize { rows: 24, cols: 80 });
            req
        })
        .await
        .expect("exec");
    handle.write_stdin(b"into busybox\n").await.expect("type");
    let mut seen = Vec::new();
    while let Some(event) = handle.next_event().await.expect("event") {
        if let ExecEvent::Output { data, .. } = event {
            seen.extend(data);
        }
    }
    assert!(
        String::from_utf8_lossy(&seen).contains("typed into busybox"),
        "{}",
        String::from_utf8_lossy(&seen)
    );

    // inotify in the container.
    let mut watch = client
        .watch(WatchRequest {
            path: "/tmp".into(),
            recursive: false,
            refuse_network_mounts: false,
        })
        .await
        .expect("watch /tmp");
    client.sh("echo y > /tmp/watched").await.expect("write");
    loop {
        match watch.recv().await.expect("watch reply") {
            ServerMessage::FsEvents { events }
                if events
                    .iter()
                    .any(|e| e.name == "watched" && e.kind == FsEventKind::Write) =>
            {
                break
            }
            ServerMessage::FsEvents { .. } => continue,
            other => panic!("unexpected {other:?}"),
        }
    }
    watch.send(ClientMessage::Cancel).await.expect("cancel");
}
