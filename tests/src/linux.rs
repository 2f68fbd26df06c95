//! The tier-4 harness: Linux guests under `rollbox-vmm` in the nested lab, driven through the
//! agent. Tests that use it skip (with their reason) where hardware virtualization or the
//! fixtures of `scripts/lab/tier4-fixtures.sh` are missing.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rollbox_agent_protocol::{AgentClient, DEFAULT_PORT};

use crate::{api_client, skip, snapshot_params, vmm_binary};

/// How long a guest may take to boot (or restore) to an answering agent in the lab.
pub const AGENT_TIMEOUT: Duration = Duration::from_secs(300);
/// How long one agent call may take in the lab before the test fails naming it (a stuck guest
/// shows as that call's failure, not as the lab's timeout); [`Agent::call_within`] for more.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(240);
/// How long a guest may take to end after it was told to.
pub const EXIT_TIMEOUT: Duration = Duration::from_secs(120);
/// Our rootfs images start the agent as init.
pub const AGENT_INIT: &str = "init=/.rollbox/rollbox-agent";
/// Kernel messages that mean the clock is not what it should be.
pub const CLOCK_COMPLAINTS: [&str; 5] = [
    "TSC unstable",
    "Marking TSC unstable",
    "clocksource watchdog",
    "timekeeping watchdog",
    "Unstable clock detected",
];

/// Why Linux can't run under this host's KVM, or None when it can.
pub fn hardware_virtualization_missing() -> Option<String> {
    if !Path::new("/dev/kvm").exists() {
        return Some("no /dev/kvm".into());
    }
    if Path::new("/sys/module/kvm_pvm").exists() {
        return Some(
            "/dev/kvm is PVM-flavoured KVM (kvm_pvm): guest kernel code is emulated and Linux cannot boot; scripts/test.sh runs tier 4 in the nested lab".into(),
        );
    }
    if !Path::new("/sys/module/kvm_intel").exists() && !Path::new("/sys/module/kvm_amd").exists() {
        return Some("neither kvm_intel nor kvm_amd is loaded: no hardware virtualization".into());
    }
    None
}

/// What `scripts/lab/tier4-fixtures.sh` prepared.
pub struct Fixtures(pub HashMap<String, String>);

impl Fixtures {
    pub fn path(&self, key: &str) -> PathBuf {
        PathBuf::from(self.text(key))
    }

    pub fn text(&self, key: &str) -> String {
        self.0
            .get(key)
            .cloned()
            .unwrap_or_else(|| panic!("fixtures.env has no {key}"))
    }
}

/// The fixtures, or None after recording why this test can't run here.
pub fn fixtures(test: &str) -> Option<Fixtures> {
    if let Some(reason) = hardware_virtualization_missing() {
        skip(test, &reason);
        return None;
    }
    let Some(dir) = std::env::var_os("ROLLBOX_TIER4_FIXTURES") else {
        skip(
            test,
            "ROLLBOX_TIER4_FIXTURES is not set (scripts/lab/tier4-fixtures.sh DIR prepares them)",
        );
        return None;
    };
    let env = Path::new(&dir).join("fixtures.env");
    let text = std::fs::read_to_string(&env)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", env.display()));
    let vars = text
        .lines()
        .filter_map(|line| line.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    Some(Fixtures(vars))
}

/// A private copy of a rootfs image in `dir` (sparse), so a guest can write to it.
pub fn copy_rootfs(image: &Path, dir: &Path, name: &str) -> PathBuf {
    let copy = dir.join(name);
    let status = Command::new("cp")
        .arg("--sparse=always")
        .arg(image)
        .arg(&copy)
        .status()
        .expect("run cp");
    assert!(status.success(), "cp {} failed", image.display());
    copy
}

pub fn seconds(since: Instant) -> f64 {
    since.elapsed().as_secs_f64()
}

/// One `rollbox-vmm` process with its files in a scratch directory: `<name>.console` (the
/// guest's serial console), `<name>.stderr`, `<name>.vsock` and `<name>.api`.
pub struct LinuxVm {
    child: Child,
    dir: PathBuf,
    name: String,
    started: Instant,
}

impl LinuxVm {
    /// Spawns rollbox-vmm with `args` plus the console, vsock and API socket options.
    pub fn spawn(dir: &Path, name: &str, args: &[String]) -> LinuxVm {
        let stderr = std::fs::File::create(dir.join(format!("{name}.stderr"))).expect("stderr");
        let mut all: Vec<String> = args.to_vec();
        all.extend([
            "--console".into(),
            dir.join(format!("{name}.console")).display().to_string(),
            "--vsock-uds".into(),
            dir.join(format!("{name}.vsock")).display().to_string(),
            "--api-sock".into(),
            dir.join(format!("{name}.api")).display().to_string(),
        ]);
        let started = Instant::now();
        let child = Command::new(vmm_binary())
            .args(&all)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot spawn rollbox-vmm: {e}"));
        LinuxVm {
            child,
            dir: dir.to_path_buf(),
            name: name.to_string(),
            started,
        }
    }

    /// Boots `kernel` with a private copy of the `rootfs` image as its root drive, the kernel
    /// command line `cmdline` and more rollbox-vmm flags in `args`.
    pub fn boot(
        dir: &Path,
        name: &str,
        kernel: &Path,
        rootfs: &Path,
        cmdline: &str,
        args: &[&str],
    ) -> LinuxVm {
        let copy = copy_rootfs(rootfs, dir, &format!("{name}.ext4"));
        let mut all = vec![
            "--kernel".to_string(),
            kernel.display().to_string(),
            "--drive".into(),
            format!("{},root", copy.display()),
            "--vsock-cid".into(),
            "3".into(),
            "--cmdline".into(),
            cmdline.to_string(),
        ];
        all.extend(args.iter().map(|a| a.to_string()));
        LinuxVm::spawn(dir, name, &all)
    }

    /// Restores the snapshot in `snapshot` with `args` (rollbox-vmm restore flags).
    pub fn restore(dir: &Path, name: &str, snapshot: &Path, args: &[&str]) -> LinuxVm {
        let mut all = vec!["--restore".to_string(), snapshot.display().to_string()];
        all.extend(args.iter().map(|a| a.to_string()));
        LinuxVm::spawn(dir, name, &all)
    }

    /// The rollbox-vmm process ID.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn file(&self, suffix: &str) -> PathBuf {
        self.dir.join(format!("{}.{suffix}", self.name))
    }

    pub fn vsock(&self) -> PathBuf {
        self.file("vsock")
    }

    pub fn api_sock(&self) -> PathBuf {
        self.file("api")
    }

    pub fn console(&self) -> String {
        std::fs::read_to_string(self.file("console")).unwrap_or_default()
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.file("stderr")).unwrap_or_default()
    }

    /// The console and stderr, for failure messages.
    pub fn report(&self) -> String {
        let tail = |text: String| {
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(40)..].join("\n")
        };
        format!(
            "--- {} console (last lines) ---\n{}\n--- rollbox-vmm stderr ---\n{}",
            self.name,
            tail(self.console()),
            tail(self.stderr())
        )
    }

    /// Connects to the agent, waiting for the guest to boot or restore.
    pub fn agent(&mut self) -> Agent {
        let uds = self.vsock();
        let agent = Agent::connect(&uds, |timed_out| {
            let why = match self.child.try_wait() {
                Ok(Some(status)) => {
                    format!("rollbox-vmm ended ({status}) before the agent answered")
                }
                _ if timed_out => format!("the agent did not answer within {AGENT_TIMEOUT:?}"),
                _ => return Ok(()),
            };
            Err(format!("{why}\n{}", self.report()))
        });
        eprintln!(
            "{}: agent answered {:.2} s after rollbox-vmm started",
            self.name,
            seconds(self.started)
        );
        agent
    }

    /// Waits for rollbox-vmm to end.
    pub fn wait(&mut self) -> ExitStatus {
        let deadline = Instant::now() + EXIT_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "rollbox-vmm did not end within {EXIT_TIMEOUT:?}\n{}",
                self.report()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The client of the VMM's API socket, with the tests' deadline per call.
    pub fn api(&self) -> vmm_api::Client {
        api_client(&self.api_sock())
    }

    /// Pauses the VM and writes a Full snapshot into `snapshot`.
    pub fn snapshot(&self, snapshot: &Path) {
        std::fs::create_dir_all(snapshot).expect("snapshot dir");
        let api = self.api();
        api.pause().unwrap_or_else(|e| panic!("{e}"));
        api.create_snapshot(&snapshot_params("Full", snapshot))
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// A fork of this VM the way the daemon makes one: paused, its root drive copied, a Full
    /// snapshot into `dir` whose memory the VMM writes while the VM runs again
    /// (`"rollbox": {"resume_vm": true}`), then `count` restores of it named `clone-N`, each
    /// with a new generation, its own copy of the drive and `per_clone(N)`'s flags. Returns
    /// the clones once their processes started; prints how long the snapshot took.
    pub fn clones(
        &self,
        count: usize,
        dir: &Path,
        per_clone: impl Fn(usize) -> Vec<String>,
    ) -> Vec<LinuxVm> {
        let snapshot = dir.join("snapshot");
        std::fs::create_dir_all(&snapshot).expect("snapshot dir");
        let api = self.api().with_timeout(Duration::from_secs(600));
        let started = Instant::now();
        api.pause()
            .unwrap_or_else(|e| panic!("{e}\n{}", self.report()));
        // The drive is copied while the VM is paused, so it matches the memory.
        let drive = self.file("ext4");
        let has_drive = drive.exists();
        let base = has_drive.then(|| copy_rootfs(&drive, dir, "drive0.base.img"));
        let params = snapshot_params("Full", &snapshot);
        let resumed = api
            .create_snapshot_resuming(&params)
            .unwrap_or_else(|e| panic!("{e}\n{}", self.report()));
        eprintln!(
            "{}: snapshot for {count} clones written {:.2} s after the pause (the VMM resumed the VM {:.2} ms after its request)",
            self.name,
            seconds(started),
            resumed.paused_ms
        );
        (0..count)
            .map(|index| {
                let name = format!("clone-{index}");
                let mut args = vec!["--new-generation".to_string()];
                if let Some(base) = &base {
                    let copy = copy_rootfs(base, dir, &format!("{name}.ext4"));
                    args.extend([
                        "--drive-override".into(),
                        format!("drive0={}", copy.display()),
                    ]);
                }
                args.extend(per_clone(index));
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                LinuxVm::restore(dir, &name, &snapshot, &args)
            })
            .collect()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for LinuxVm {
    fn drop(&mut self) {
        self.kill();
        // A failed assertion on the guest's side is explained by what the VMM and the guest said.
        if std::thread::panicking() {
            eprintln!("{}", self.report());
        }
    }
}

/// A connection to a guest's agent, with the runtime that drives it.
pub struct Agent {
    /// Drives the client.
    pub runtime: tokio::runtime::Runtime,
    /// The agent protocol client.
    pub client: AgentClient,
}

impl Agent {
    /// Connects to the agent behind the vsock socket `uds`, retrying until it answers a hello.
    /// Between tries `check(timed_out)` may end the wait with a reason to fail;
    /// `timed_out` is true once [`AGENT_TIMEOUT`] has passed, and then it must.
    pub fn connect(uds: &Path, mut check: impl FnMut(bool) -> Result<(), String>) -> Agent {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        let deadline = Instant::now() + AGENT_TIMEOUT;
        loop {
            let attempt = runtime.block_on(async {
                let client = tokio::time::timeout(
                    Duration::from_secs(10),
                    AgentClient::connect_unix(uds, DEFAULT_PORT),
                )
                .await
                .ok()?
                .ok()?;
                tokio::time::timeout(Duration::from_secs(20), client.hello())
                    .await
                    .ok()?
                    .ok()?;
                Some(client)
            });
            if let Some(client) = attempt {
                return Agent { runtime, client };
            }
            let timed_out = Instant::now() >= deadline;
            if let Err(why) = check(timed_out) {
                panic!("{why}");
            }
            assert!(
                !timed_out,
                "the agent behind {} did not answer within {AGENT_TIMEOUT:?}",
                uds.display()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Runs one agent call to its end, within [`CALL_TIMEOUT`]; panics naming `what` when the
    /// call fails or the guest does not answer in time.
    pub fn call<T, E: std::fmt::Display>(
        &self,
        what: &str,
        call: impl std::future::Future<Output = Result<T, E>>,
    ) -> T {
        self.call_within(what, CALL_TIMEOUT, call)
    }

    /// [`Agent::call`] with its own time limit.
    pub fn call_within<T, E: std::fmt::Display>(
        &self,
        what: &str,
        limit: Duration,
        call: impl std::future::Future<Output = Result<T, E>>,
    ) -> T {
        // The timer must be made inside the runtime (block_on's future), not before it.
        match self
            .runtime
            .block_on(async { tokio::time::timeout(limit, call).await })
        {
            Ok(Ok(value)) => value,
            Ok(Err(e)) => panic!("{what}: {e}"),
            Err(_) => panic!("{what}: the agent did not answer within {limit:?}"),
        }
    }

    /// Runs `script` with sh; returns (exit code, stdout, stderr).
    pub fn sh_status(&self, script: &str) -> (Option<i32>, String, String) {
        let out = self.call(&format!("exec {script:?}"), self.client.sh(script));
        (
            out.status.code,
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Runs `script` with sh and returns its trimmed stdout; panics unless it exits 0.
    pub fn sh(&self, script: &str) -> String {
        let (code, stdout, stderr) = self.sh_status(script);
        assert_eq!(
            code,
            Some(0),
            "{script:?} failed:\nstdout: {stdout}\nstderr: {stderr}"
        );
        stdout.trim().to_string()
    }

    /// Starts `script` without waiting: for commands that end the guest (poweroff, reboot).
    pub fn start(&self, script: &str) {
        self.call(&format!("start {script:?}"), async {
            let mut handle = self
                .client
                .exec(rollbox_agent_protocol::ExecRequest::shell(script))
                .await?;
            handle.started().await
        });
    }

    pub fn write_file(&self, path: &str, data: &[u8]) {
        let written = self.call(
            &format!("write_file {path}"),
            self.client.write_file(path, data),
        );
        assert_eq!(written, data.len() as u64);
    }

    pub fn read_file(&self, path: &str) -> Vec<u8> {
        self.call(&format!("read_file {path}"), self.client.read_file(path))
    }
}

/// The kernel log lines that complain about the clock.
pub fn clock_complaints(dmesg: &str) -> Vec<String> {
    dmesg
        .lines()
        .filter(|line| CLOCK_COMPLAINTS.iter().any(|c| line.contains(c)))
        .map(str::to_string)
        .collect()
}

/// Kernel warnings that remain, printed for the record (see docs/testing.md for why each is
/// there).
pub fn note_platform_warnings(name: &str, dmesg: &str) {
    for line in dmesg.lines().filter(|l| {
        l.contains("WARNING") || l.contains("Fatal") || l.contains("error") || l.contains("BUG")
    }) {
        eprintln!("{name}: kernel says: {line}");
    }
}

pub fn sha256_hex(data: &[u8]) -> String {
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("sha256sum");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin.write_all(data).expect("feed sha256sum");
    }
    let mut out = String::new();
    child
        .stdout
        .take()
        .expect("stdout")
        .read_to_string(&mut out)
        .expect("read sha256sum");
    assert!(child.wait().expect("wait").success());
    out.split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// Deterministic pseudo-random bytes (xorshift), so a failure can be reproduced.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn unix_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The command line our rootfs images boot with (warnings and errors on the console).
pub fn agent_cmdline(extra: &str) -> String {
    format!("console=ttyS0 reboot=k panic=1 loglevel=4 {AGENT_INIT} {extra}")
        .trim()
        .to_string()
}

/// `rollbox serve` in the lab with a scratch state directory and image cache (on L1's own
/// tmpfs, where the sandboxes' rootfs copies live too), templates from
/// anywhere (`--template-dir /`: L1 is a throwaway VM; the confinement itself is
/// rollbox/tests/daemon_tenants.rs's) and `--vmm-start-timeout 60` (the lab starts VMMs
/// slowly, several at once for a fork). On drop, every sandbox is deleted through the daemon
/// (so no VMM outlives the test) and the daemon ends.
pub struct LabDaemon {
    serve: Child,
    pub dir: tempfile::TempDir,
    pub key: String,
}

impl LabDaemon {
    /// Starts `rollbox serve` with API key `key` and `extra` flags, and waits (at most 60 s)
    /// until its socket, and `tcp_port` on 127.0.0.1 where given, listen.
    pub fn start(key: &str, extra: &[String], tcp_port: Option<u16>) -> LabDaemon {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = std::fs::File::create(dir.path().join("serve.log")).expect("serve.log");
        let serve = Command::new(crate::rollbox_binary())
            .arg("serve")
            .arg("--socket")
            .arg(dir.path().join("d.sock"))
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .arg("--image-cache")
            .arg(dir.path().join("cache"))
            .args(["--template-dir", "/", "--vmm-start-timeout", "60"])
            .args(extra)
            .env("ROLLBOX_API_KEY", key)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn rollbox serve");
        let daemon = LabDaemon {
            serve,
            dir,
            key: key.to_string(),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !(daemon.socket().exists()
            && tcp_port
                .is_none_or(|port| std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()))
        {
            assert!(
                Instant::now() < deadline,
                "rollbox serve did not listen\n{}",
                daemon.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        daemon
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("d.sock")
    }

    /// The daemon's log, then the last lines of each sandbox's serial console.
    pub fn log(&self) -> String {
        let mut text =
            std::fs::read_to_string(self.dir.path().join("serve.log")).unwrap_or_default();
        let sandboxes = self.dir.path().join("state/sandboxes");
        for entry in std::fs::read_dir(sandboxes).into_iter().flatten().flatten() {
            let console = entry.path().join("console.log");
            if let Ok(lines) = std::fs::read_to_string(&console) {
                let tail: Vec<&str> = lines.lines().rev().take(20).collect();
                text.push_str(&format!("\n--- {} (last lines)\n", console.display()));
                for line in tail.iter().rev() {
                    text.push_str(line);
                    text.push('\n');
                }
            }
        }
        text
    }

    /// One request on the daemon's socket (HTTP/1.0, a JSON body): the status and the JSON
    /// answer (Null when it is none). Panics when nothing answers within 15 minutes.
    pub fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> (u16, serde_json::Value) {
        use std::io::{Read, Write};
        let body = body.map(serde_json::Value::to_string).unwrap_or_default();
        let answer = (|| -> std::io::Result<Vec<u8>> {
            let mut stream = std::os::unix::net::UnixStream::connect(self.socket())?;
            stream.set_read_timeout(Some(Duration::from_secs(900)))?;
            write!(
                stream,
                "{method} {path} HTTP/1.0\r\nHost: rollbox\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                self.key,
                body.len()
            )?;
            let mut answer = Vec::new();
            stream.read_to_end(&mut answer)?;
            Ok(answer)
        })()
        .unwrap_or_else(|e| panic!("{method} {path}: {e}\n{}", self.log()));
        let text = String::from_utf8_lossy(&answer);
        let (head, json) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{method} {path}: no HTTP answer: {text}"));
        (
            status,
            serde_json::from_str(json).unwrap_or(serde_json::Value::Null),
        )
    }

    /// `rollbox ARGS` as a client of this daemon.
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        Command::new(crate::rollbox_binary())
            .args(args)
            .env("ROLLBOX_SOCKET", self.socket())
            .env("ROLLBOX_API_KEY", &self.key)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("run rollbox {args:?}: {e}"))
    }
}

impl Drop for LabDaemon {
    fn drop(&mut self) {
        let listed = self.cli(&["sandbox", "ls", "--json"]);
        let ids: Vec<String> = serde_json::from_slice::<serde_json::Value>(&listed.stdout)
            .ok()
            .and_then(|v| v["sandboxes"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|s| s["id"].as_str().map(str::to_string))
            .collect();
        for id in ids {
            let _ = self.cli(&["sandbox", "rm", &id]);
        }
        let _ = self.serve.kill();
        let _ = self.serve.wait();
    }
}
