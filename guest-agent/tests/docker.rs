//! Docker through the agent in host mode, driving the host's dockerd.
//! Needs `scripts/start-dockerd.sh` (daemon + local image rollbox-test/busybox:latest);
//! skips with one line when that is missing, unless ROLLBOX_REQUIRE_ALL=1.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::AgentProcess;
use rollbox_agent_protocol::DockerRunRequest;
use rollbox_tests::skip;

const IMAGE: &str = "rollbox-test/busybox:latest";

/// None when Docker is usable here; else why not.
fn docker_missing() -> Option<String> {
    let info = Command::new("timeout")
        .args(["20", "docker", "info"])
        .output();
    match info {
        Ok(out) if out.status.success() => {}
        Ok(_) | Err(_) => {
            return Some("dockerd is not running (run scripts/start-dockerd.sh)".into())
        }
    }
    let image = Command::new("docker")
        .args(["image", "inspect", IMAGE])
        .output();
    match image {
        Ok(out) if out.status.success() => None,
        _ => Some(format!(
            "test image {IMAGE} is missing (run scripts/start-dockerd.sh)"
        )),
    }
}

/// True (after recording the skip) when Docker is not usable here.
fn skip_unless_docker(test: &str) -> bool {
    match docker_missing() {
        None => false,
        Some(reason) => {
            skip(test, &reason);
            true
        }
    }
}

fn run_request(command: &[&str]) -> DockerRunRequest {
    let mut req = DockerRunRequest::new(IMAGE, command.iter().map(|s| s.to_string()).collect());
    req.network = Some("none".into());
    req.timeout_ms = Some(120_000);
    req
}

#[tokio::test]
async fn docker_ensure_and_run_stream_output() {
    if skip_unless_docker("docker_ensure_and_run_stream_output") {
        return;
    }
    let agent = AgentProcess::start();
    let client = agent.client().await;
    let started = client
        .docker_ensure(Some(Duration::from_secs(60)))
        .await
        .expect("docker ensure");
    assert!(
        !started,
        "dockerd was already running; the agent must not start a second one"
    );

    let mut req = run_request(&["sh", "-c", "echo \"hello $WHO\"; echo oops >&2; exit 3"]);
    req.env.insert("WHO".into(), "container".into());
    let output = client
        .docker_run(req)
        .await
        .expect("docker run")
        .collect()
        .await
        .expect("collect");
    assert_eq!(String::from_utf8_lossy(&output.stdout), "hello container\n");
    assert_eq!(String::from_utf8_lossy(&output.stderr), "oops\n");
    assert_eq!(output.status.code, Some(3));

    let mut req = run_request(&["cat"]);
    req.stdin = true;
    let handle = client.docker_run(req).await.expect("docker run");
    handle.write_stdin(b"through docker").await.expect("stdin");
    handle.close_stdin().await.expect("close");
    let output = handle.collect().await.expect("collect");
    assert_eq!(output.stdout, b"through docker");
    assert_eq!(output.status.code, Some(0));

    // No command: the image's default (/bin/sh) runs and ends at once on the closed stdin.
    let output = client
        .docker_run(run_request(&[]))
        .await
        .expect("docker run")
        .collect()
        .await
        .expect("collect");
    assert_eq!(output.status.code, Some(0));

    let mut bad = run_request(&["true"]);
    bad.image = "--privileged".into();
    let err = client
        .docker_run(bad)
        .await
        .expect("sent")
        .collect()
        .await
        .expect_err("bad image");
    assert!(err.to_string().contains("invalid image name"), "{err}");

    // A missing image fails like the docker CLI does (125), with its message on stderr.
    let mut missing = run_request(&["true"]);
    missing.image = "rollbox-test/does-not-exist:latest".into();
    missing.extra_args = vec!["--pull=never".into()];
    let output = client
        .docker_run(missing)
        .await
        .expect("docker run")
        .collect()
        .await
        .expect("collect");
    assert_eq!(output.status.code, Some(125), "{output:?}");
    assert!(!output.stderr.is_empty());
}

#[tokio::test]
async fn docker_run_timeout_kills_and_removes_the_container() {
    if skip_unless_docker("docker_run_timeout_kills_and_removes_the_container") {
        return;
    }
    let agent = AgentProcess::start();
    let client = agent.client().await;
    // busybox sleep as the container's PID 1 ignores SIGTERM: the SIGKILL and `docker rm -f` finish it.
    let mut req = run_request(&["sleep", "300"]);
    req.timeout_ms = Some(3000);
    req.kill_grace_ms = Some(1000);
    let started = Instant::now();
    let output = client
        .docker_run(req)
        .await
        .expect("docker run")
        .collect()
        .await
        .expect("collect");
    assert!(output.status.timed_out, "{:?}", output.status);
    println!("docker run timeout finished after {:?}", started.elapsed());
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ps = Command::new("docker")
            .args([
                "ps",
                "-aq",
                "--filter",
                &format!("name=rollbox-{}-", agent_pid(&agent)),
            ])
            .output()
            .expect("docker ps");
        if ps.stdout.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "container still exists: {}",
            String::from_utf8_lossy(&ps.stdout)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn agent_pid(agent: &AgentProcess) -> u32 {
    agent.pid()
}

/// Stops a dockerd by its pid file when the test ends.
struct DaemonGuard(std::path::PathBuf);

impl Drop for DaemonGuard {
    fn drop(&mut self) {
        if let Some(pid) = std::fs::read_to_string(&self.0)
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
        {
            // SAFETY: kill has no memory effects.
            unsafe { libc::kill(pid, libc::SIGTERM) };
            common::wait_gone(pid as u32, Duration::from_secs(20));
        }
    }
}

#[tokio::test]
async fn agent_starts_a_private_dockerd_on_demand() {
    let have_dockerd = Command::new("sh")
        .args(["-c", "command -v dockerd"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !have_dockerd || !common::is_root() {
        return skip(
            "agent_starts_a_private_dockerd_on_demand",
            "needs root and dockerd (apt-get install -y docker.io)",
        );
    }
    // A second daemon with its own socket, data and pid file, so the host's dockerd is untouched.
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().display().to_string();
    let socket = format!("{root}/docker.sock");
    let agent = AgentProcess::start_with(&[
        "--docker-socket",
        &socket,
        "--dockerd-log",
        &format!("{root}/dockerd.log"),
    ]);
    let client = agent.client().await;

    // A dockerd that cannot start is reported with its log.
    let err = client
        .request(rollbox_agent_protocol::ClientMessage::DockerEnsure {
            timeout_ms: Some(30_000),
            extra_args: vec!["--no-such-flag".into()],
        })
        .await
        .expect_err("bad flag");
    assert!(err.to_string().contains("dockerd exited"), "{err}");
    assert!(err.to_string().contains("no-such-flag"), "{err}");

    let _daemon = DaemonGuard(dir.path().join("dockerd.pid"));
    let extra_args = vec![
        format!("--data-root={root}/data"),
        format!("--exec-root={root}/exec"),
        format!("--pidfile={root}/dockerd.pid"),
        "--bridge=none".into(),
        "--iptables=false".into(),
    ];
    let reply = client
        .request(rollbox_agent_protocol::ClientMessage::DockerEnsure {
            timeout_ms: Some(60_000),
            extra_args,
        })
        .await
        .expect("docker ensure");
    match reply {
        rollbox_agent_protocol::ServerMessage::DockerReady { started, waited_ms } => {
            assert!(started);
            println!("private dockerd answered after {waited_ms} ms");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        !client.docker_ensure(None).await.expect("again"),
        "a second ensure must reuse the daemon"
    );
    let output = client
        .run(rollbox_agent_protocol::ExecRequest::argv([
            "docker",
            "--host",
            &format!("unix://{socket}"),
            "info",
            "--format",
            "{{.DockerRootDir}}",
        ]))
        .await
        .expect("docker info");
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        format!("{root}/data")
    );
}
