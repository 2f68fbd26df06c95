//! Docker in the guest: start dockerd on demand and run containers through
//! the docker CLI (`docker run --rm`), whose output streams like any exec.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rollbox_agent_protocol::{DockerRunRequest, ErrorInfo, ExecRequest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::agent::Agent;
use crate::errors::SysError;
use crate::exec::DEFAULT_PATH;
use crate::reaper::reaper;

/// How long DockerEnsure waits by default (dockerd under TCG needs up to ~30 s).
pub const DEFAULT_READY_TIMEOUT: Duration = Duration::from_secs(180);
const DEFAULT_SOCKET: &str = "/var/run/docker.sock";

/// True when dockerd answers `GET /_ping` on its socket.
pub async fn ping(socket: &Path) -> bool {
    let attempt = async {
        let mut stream = tokio::net::UnixStream::connect(socket).await.ok()?;
        stream
            .write_all(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            .await
            .ok()?;
        let mut reply = Vec::new();
        stream.read_to_end(&mut reply).await.ok()?;
        let reply = String::from_utf8_lossy(&reply);
        Some(
            reply.starts_with("HTTP/1.")
                && reply.lines().next().is_some_and(|l| l.contains(" 200 ")),
        )
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(2), attempt).await,
        Ok(Some(true))
    )
}

fn find_in_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_else(|_| DEFAULT_PATH.to_owned());
    path.split(':')
        .chain(DEFAULT_PATH.split(':'))
        .map(|dir| Path::new(dir).join(program))
        .find(|p| p.is_file())
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(5)..].join("\n")
}

/// Start dockerd unless it answers; wait until it does. Returns
/// (started by this call, milliseconds waited).
pub async fn ensure(
    agent: &Agent,
    timeout: Option<Duration>,
    extra_args: &[String],
) -> Result<(bool, u64), ErrorInfo> {
    let _serial = agent.docker_lock.lock().await;
    let socket = &agent.config.docker_socket;
    if ping(socket).await {
        return Ok((false, 0));
    }
    let Some(dockerd) = find_in_path("dockerd") else {
        return Err(ErrorInfo {
            code: "ENOENT".into(),
            errno: Some(libc::ENOENT),
            message: format!("start dockerd: no dockerd in PATH ({DEFAULT_PATH})"),
        });
    };
    let log_path = &agent.config.dockerd_log;
    if let Some(dir) = log_path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_path)
        .map_err(|e| SysError::new("open", log_path.display().to_string(), e).to_info())?;
    let log_err = log
        .try_clone()
        .map_err(|e| SysError::new("dup", log_path.display().to_string(), e).to_info())?;
    let mut command = std::process::Command::new(&dockerd);
    let given = |flag: &str| {
        extra_args
            .iter()
            .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
    };
    if !given("--host") && !given("-H") {
        command.arg(format!("--host=unix://{}", socket.display()));
    }
    if !given("--pidfile") && !given("-p") {
        command.arg("--pidfile=/run/rollbox-dockerd.pid");
    }
    command
        .args(extra_args)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err);
    if std::env::var_os("PATH").is_none() {
        command.env("PATH", DEFAULT_PATH);
    }
    // SAFETY: setsid is async-signal-safe; the closure allocates nothing.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut command, || {
            libc::setsid();
            Ok(())
        });
    }
    let started = Instant::now();
    let (child, mut exited) = reaper()
        .spawn(&mut command)
        .map_err(|e| SysError::new("exec", dockerd.display().to_string(), e).to_info())?;
    log::info!(
        "started dockerd (pid {}), log in {}",
        child.id(),
        log_path.display()
    );
    let timeout = timeout.unwrap_or(DEFAULT_READY_TIMEOUT);
    loop {
        if ping(socket).await {
            return Ok((
                true,
                u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            ));
        }
        if let Ok(status) = exited.try_recv() {
            return Err(ErrorInfo {
                code: "dockerd_exited".into(),
                errno: None,
                message: format!(
                    "dockerd exited (code {:?}, signal {:?}) before answering on {}; last lines of {}:\n{}",
                    status.code(),
                    status.signal(),
                    socket.display(),
                    log_path.display(),
                    log_tail(log_path)
                ),
            });
        }
        if started.elapsed() >= timeout {
            return Err(ErrorInfo {
                code: "ETIMEDOUT".into(),
                errno: Some(libc::ETIMEDOUT),
                message: format!(
                    "dockerd did not answer on {} within {} ms (still running; see {})",
                    socket.display(),
                    timeout.as_millis(),
                    log_path.display()
                ),
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

static CONTAINERS: AtomicU64 = AtomicU64::new(0);

/// The exec request for `docker run`, and the cleanup argv that removes the
/// container if the run is killed (killing the CLI does not stop it).
pub fn run_command(
    agent: &Agent,
    req: &DockerRunRequest,
) -> Result<(ExecRequest, Vec<String>), ErrorInfo> {
    if req.image.is_empty() || req.image.starts_with('-') {
        return Err(ErrorInfo::bad_request(format!(
            "docker run: invalid image name {:?}",
            req.image
        )));
    }
    let name = format!(
        "rollbox-{}-{}",
        std::process::id(),
        CONTAINERS.fetch_add(1, Ordering::Relaxed)
    );
    let mut argv: Vec<String> = vec![
        "docker".into(),
        "run".into(),
        "--rm".into(),
        "--name".into(),
        name.clone(),
    ];
    if req.stdin {
        argv.push("-i".into());
    }
    for (key, value) in &req.env {
        if key.is_empty() || key.contains('=') {
            return Err(ErrorInfo::bad_request(format!(
                "docker run: invalid environment variable name {key:?}"
            )));
        }
        argv.push("-e".into());
        argv.push(format!("{key}={value}"));
    }
    for (flag, value) in [
        ("--workdir", &req.workdir),
        ("--user", &req.user),
        ("--network", &req.network),
    ] {
        if let Some(value) = value {
            argv.push(format!("{flag}={value}"));
        }
    }
    argv.extend(req.extra_args.iter().cloned());
    argv.push(req.image.clone());
    argv.extend(req.command.iter().cloned());
    let mut exec = ExecRequest::argv(argv);
    exec.timeout_ms = req.timeout_ms;
    exec.kill_grace_ms = req.kill_grace_ms;
    exec.output_limit_bytes = req.output_limit_bytes;
    exec.stdin = req.stdin;
    if agent.config.docker_socket != Path::new(DEFAULT_SOCKET) {
        exec.env.insert(
            "DOCKER_HOST".into(),
            format!("unix://{}", agent.config.docker_socket.display()),
        );
    }
    let mut cleanup = vec!["docker".to_owned(), "rm".into(), "-f".into(), name];
    if let Some(host) = exec.env.get("DOCKER_HOST") {
        cleanup.splice(1..1, ["--host".to_owned(), host.clone()]);
    }
    Ok((exec, cleanup))
}
