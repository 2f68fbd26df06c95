//! Starts the real agent binary in host mode on a Unix socket.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rollbox_agent_protocol::{AgentClient, DEFAULT_PORT};

pub struct AgentProcess {
    child: Child,
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub machine_id: PathBuf,
}

/// True when running as root (the agent's UTS namespace and cgroups need it).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no side effects.
    unsafe { libc::geteuid() == 0 }
}

impl AgentProcess {
    /// Start an agent that cannot touch this machine's clock or hostname:
    /// `--no-set-clock`, `--unshare-uts` (as root), and a private machine-id file.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    pub fn start_with(extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("agent.sock");
        let machine_id = dir.path().join("machine-id");
        let mut command = Command::new(env!("CARGO_BIN_EXE_rollbox-agent"));
        command
            .arg("--listen-unix")
            .arg(&socket)
            .arg("--no-set-clock")
            .arg("--machine-id-path")
            .arg(&machine_id)
            .args(extra)
            .stdin(Stdio::null());
        if is_root() {
            command.arg("--unshare-uts");
        }
        let child = command.spawn().expect("spawn rollbox-agent");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !socket.exists() {
            assert!(
                Instant::now() < deadline,
                "agent socket {} did not appear",
                socket.display()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Self {
            child,
            dir,
            socket,
            machine_id,
        }
    }

    pub async fn client(&self) -> AgentClient {
        // The socket file appears at bind(), a moment before listen(): retry briefly.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match AgentClient::connect_unix(&self.socket, DEFAULT_PORT).await {
                Ok(client) => return client,
                Err(err) if Instant::now() < deadline => {
                    let _ = err;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(err) => panic!("connect to agent: {err}"),
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A fresh scratch directory path (absolute) inside the test's temp dir.
    pub fn scratch(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether a process still exists and is not a zombie.
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat
                .rsplit(") ")
                .next()
                .and_then(|rest| rest.chars().next());
            state != Some('Z') && state != Some('X')
        }
        Err(_) => false,
    }
}

/// Wait until `pid` is gone; false after `timeout`.
pub fn wait_gone(pid: u32, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while alive(pid) {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}
