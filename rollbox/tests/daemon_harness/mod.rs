//! A real `rollbox serve` for the daemon load and crash tests: a Unix socket and state
//! directory in a scratch directory, the test guest as template, and readers of what the
//! daemon holds (processes, fds, files) for leak checks.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rollbox::daemon::client::{ClientError, Endpoint, Response};
use rollbox::daemon::vm;
use rollbox_tests::{rollbox_binary, test_guest, vmm_binary, TEST_GUEST_CMDLINE};
use serde_json::{json, Value};

pub const KEY: &str = "test-key-0123";

/// A `rollbox serve`; on drop it is killed and every VMM it left is ended.
pub struct Server {
    child: Option<Child>,
    pub dir: tempfile::TempDir,
}

impl Server {
    pub fn start() -> Server {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("key"), format!("{KEY}\n")).expect("write key");
        let mut server = Server { child: None, dir };
        server.spawn();
        server
    }

    pub fn sock(&self) -> PathBuf {
        self.dir.path().join("d.sock")
    }

    pub fn state(&self) -> PathBuf {
        std::fs::canonicalize(self.dir.path().join("state")).expect("state dir")
    }

    pub fn sandboxes_dir(&self) -> PathBuf {
        self.state().join("sandboxes")
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).expect("daemon running")
    }

    /// Starts the daemon on the scratch state directory (again, after [`Server::kill9`]).
    pub fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("serve.log"))
            .expect("log");
        let child = Command::new(rollbox_binary())
            .arg("serve")
            .arg("--vmm")
            .arg(vmm_binary())
            .arg("--socket")
            .arg(self.sock())
            .arg("--api-key-file")
            .arg(self.dir.path().join("key"))
            .arg("--state-dir")
            .arg(self.dir.path().join("state"))
            .args(["--max-pending-creates", "1000"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn rollbox serve");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::os::unix::net::UnixStream::connect(self.sock()).is_err() {
            assert!(
                Instant::now() < deadline,
                "rollbox serve never listened:\n{}",
                self.log()
            );
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!("rollbox serve ended: {status}\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn log(&self) -> String {
        let text = std::fs::read_to_string(self.dir.path().join("serve.log")).unwrap_or_default();
        let tail = text.len().saturating_sub(4000);
        text.get(tail..).unwrap_or_default().to_string()
    }

    /// SIGKILL: nothing of the daemon runs after this; its VMMs keep running.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().expect("kill -9 the daemon");
            child.wait().expect("wait");
        }
    }

    pub fn try_call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Response, ClientError> {
        let body = body.map(Value::to_string);
        let auth = format!("Bearer {KEY}");
        Endpoint::Unix(self.sock()).request(
            method,
            path,
            &[("Authorization", auth.as_str())],
            body.as_deref().map(str::as_bytes),
            Duration::from_secs(60),
        )
    }

    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let response = self
            .try_call(method, path, body.as_ref())
            .unwrap_or_else(|e| panic!("{method} {path}: {e}\n{}", self.log()));
        let value = serde_json::from_slice(&response.body).unwrap_or(Value::Null);
        (response.status, value)
    }

    /// A template of the test guest (32 MiB), a sandbox booted from it and its snapshot: the
    /// snapshot's id.
    pub fn guest_snapshot(&self) -> String {
        let (status, body) = self.call(
            "POST",
            "/templates",
            Some(json!({
                "name": "guest",
                "kernel": test_guest(),
                "cmdline": TEST_GUEST_CMDLINE,
                "memory_mib": 32,
            })),
        );
        assert_eq!(status, 201, "{body}");
        let (status, base) = self.call(
            "POST",
            "/sandboxes",
            Some(json!({"template": "guest", "ttl_s": 600})),
        );
        assert_eq!(status, 201, "{base}\n{}", self.log());
        let id = base["id"].as_str().expect("id").to_string();
        let (status, snap) = self.call("POST", &format!("/sandboxes/{id}/snapshots"), None);
        assert_eq!(status, 201, "{snap}");
        let (status, _) = self.call("DELETE", &format!("/sandboxes/{id}"), None);
        assert_eq!(status, 204);
        snap["id"].as_str().expect("snapshot id").to_string()
    }

    /// Every sandbox in `state` (one page of up to 1000).
    pub fn list(&self, state: &str) -> Vec<Value> {
        let (status, list) =
            self.call("GET", &format!("/sandboxes?state={state}&limit=1000"), None);
        assert_eq!(status, 200, "{list}");
        list["sandboxes"].as_array().cloned().unwrap_or_default()
    }

    /// VMM processes (alive, not zombies) under this daemon's state directory.
    pub fn vmms(&self) -> Vec<vm::Found> {
        vm::find_vmms(&self.sandboxes_dir())
    }

    pub fn dirs(&self) -> BTreeSet<String> {
        std::fs::read_dir(self.sandboxes_dir())
            .expect("sandboxes dir")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().to_string())
            .collect()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill9();
        if let Ok(dir) = std::fs::canonicalize(self.dir.path().join("state")) {
            for found in vm::find_vmms(&dir.join("sandboxes")) {
                vm::kill(found.pid, found.start_time, Duration::from_secs(5));
            }
        }
    }
}

pub fn ids(sandboxes: &[Value]) -> BTreeSet<String> {
    sandboxes
        .iter()
        .map(|s| s["id"].as_str().expect("id").to_string())
        .collect()
}

/// What `readlink /proc/PID/fd/*` shows: `socket:[…]`, `pipe:[…]`, paths, `anon_inode:…`.
pub fn fds(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .map(|target| target.to_string_lossy().to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// Processes whose parent is `pid` (zombies included): "PID STATE COMM" each.
pub fn children_of(pid: u32) -> Vec<String> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some(close) = stat.rfind(')') else {
            continue;
        };
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        // Field 3 is the state, field 4 the parent's pid.
        if fields.get(1).and_then(|p| p.parse::<u32>().ok()) == Some(pid) {
            found.push(format!(
                "{} {} {}",
                entry.file_name().to_string_lossy(),
                fields.first().unwrap_or(&"?"),
                stat.get(..close + 1).unwrap_or_default()
            ));
        }
    }
    found
}

/// Every file and directory under `root`, relative, except SQLite's own side files.
pub fn tree(root: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let rel = path
                .strip_prefix(root)
                .unwrap_or(&path)
                .to_string_lossy()
                .to_string();
            if rel.starts_with("state.db") {
                continue;
            }
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(path);
            }
            out.insert(rel);
        }
    }
    out
}

/// Network interfaces of the host (tap devices show up here).
pub fn interfaces() -> BTreeSet<String> {
    std::fs::read_dir("/sys/class/net")
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .collect()
        })
        .unwrap_or_default()
}

pub fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
