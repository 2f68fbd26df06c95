//! Shared helpers for the integration tests: build the real binaries and the test guest,
//! spawn `rollbox-vmm`, call its API ([`api_client`], a `vmm_api::Client`), and talk to the
//! guest over its serial console. With features, the rollbox crate's tests get more: `daemon`
//! (a real `rollbox serve`, [`daemon`]) and `images` (crafted container images, [`images`]).

#[cfg(feature = "daemon")]
pub mod daemon;
#[cfg(feature = "images")]
pub mod images;
pub mod linux;
pub mod netns;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// A `cargo` in the workspace root. Without the variables cargo sets for the running test
/// (`CARGO_MANIFEST_DIR`, `CARGO_PKG_NAME`...): build scripts that watch them (ring's does)
/// would otherwise run again, and rebuild what depends on them, in every nested build and in
/// the next `cargo test` after it.
fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(workspace_root());
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if is_test_only_cargo_var(&name) {
            cmd.env_remove(name.as_ref());
        }
    }
    cmd
}

/// Whether cargo sets `name` for the crate it builds or runs (not for cargo itself).
fn is_test_only_cargo_var(name: &str) -> bool {
    [
        "CARGO_MANIFEST_",
        "CARGO_PKG_",
        "CARGO_BIN_EXE_",
        "CARGO_CRATE_NAME",
        "CARGO_BIN_NAME",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_TARGET_TMPDIR",
        "CARGO_RUSTC_CURRENT_DIR",
    ]
    .iter()
    .any(|prefix| name.starts_with(prefix))
}

fn run_build(args: &[&str]) {
    let status = cargo()
        .args(args)
        .status()
        .unwrap_or_else(|e| panic!("cannot run cargo {args:?}: {e}"));
    assert!(status.success(), "cargo {args:?} failed: {status}");
}

/// The python that a venv script (`scripts/e2b-venv.sh VERSION`, `scripts/sdk-venv.sh`) prints
/// after making its venv, or why there is none.
pub fn venv_python(script: &str, args: &[&str]) -> Result<PathBuf, String> {
    let script = workspace_root().join(script);
    let invocation = std::iter::once(script.display().to_string())
        .chain(args.iter().map(|a| a.to_string()))
        .collect::<Vec<_>>()
        .join(" ");
    let output = Command::new("sh")
        .arg(&script)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    if !output.status.success() {
        return Err(format!(
            "{invocation} failed ({}): {}",
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

/// `python rollbox/tests/e2b/SCRIPT` pointed at the E2B listener at `url` with API key `key`:
/// API, volume content and sandbox traffic all to `url`, domain `e2b.test`, sandboxes of `template`, scratch
/// files in `scratch`, no SDK debug mode, stdin closed. Callers add what their script needs.
pub fn e2b_script(
    python: &Path,
    script: &str,
    url: &str,
    key: &str,
    template: &str,
    scratch: &Path,
) -> Command {
    let mut command = Command::new(python);
    command
        .arg(workspace_root().join("rollbox/tests/e2b").join(script))
        .env("E2B_API_URL", url)
        .env("E2B_SANDBOX_URL", url)
        // The volume content API is this listener too (the SDK's default is https://api.{domain}).
        .env("E2B_VOLUME_API_URL", url)
        .env("E2B_API_KEY", key)
        .env("E2B_DOMAIN", "e2b.test")
        .env("ROLLBOX_E2B_TEMPLATE", template)
        .env("ROLLBOX_E2B_SCRATCH", scratch)
        .env_remove("E2B_DEBUG")
        .stdin(Stdio::null());
    command
}

/// Whether the binaries were built before the tests started and must not be rebuilt: inside
/// the nested lab (`scripts/lab/run.sh` sets ROLLBOX_IN_LAB; the workspace is read-only there),
/// or with ROLLBOX_PREBUILT=1.
pub fn prebuilt() -> bool {
    ["ROLLBOX_IN_LAB", "ROLLBOX_PREBUILT"]
        .iter()
        .any(|name| std::env::var(name).is_ok_and(|v| v == "1"))
}

/// A workspace binary in target/debug, built with `cargo build -p PACKAGE... --features
/// FEATURE...` first unless [`prebuilt`].
fn debug_binary(packages: &[&str], features: &[&str], name: &str) -> PathBuf {
    let path = workspace_root().join("target/debug").join(name);
    if prebuilt() {
        assert!(
            path.is_file(),
            "{} is missing: build the workspace before running tests in the lab",
            path.display()
        );
    } else {
        let mut args = vec!["build", "--quiet"];
        for package in packages {
            args.extend(["-p", package]);
        }
        for feature in features {
            args.extend(["--features", feature]);
        }
        run_build(&args);
    }
    path
}

/// Builds `rollbox-agent` for the host (once per test binary) and returns its path: tests run
/// it with `--listen-unix` as a stand-in for a guest's agent.
pub fn agent_binary() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| debug_binary(&["rollbox-agent"], &[], "rollbox-agent"))
        .clone()
}

/// Builds `rollbox-vmm` (once per test binary, with the test-only hooks, as a workspace build
/// that includes this crate has them) and returns its path.
pub fn vmm_binary() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| debug_binary(&["vmm", "snapshot"], &["vmm/test-hooks"], "rollbox-vmm"))
        .clone()
}

/// Writes `dir/name`, a shell script that runs `before` and then becomes rollbox-vmm with its
/// arguments: a `--vmm` stand-in for tests (`--no-jailer`: a jail has no shell).
pub fn vmm_wrapper(dir: &Path, name: &str, before: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    let script = format!(
        "#!/bin/sh\n{before}\nexec '{}' \"$@\"\n",
        vmm_binary().display()
    );
    std::fs::write(&path, script).expect("write the VMM wrapper");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
        .expect("chmod the VMM wrapper");
    path
}

/// Builds `rollbox-jailer` (once per test binary) and returns its path.
pub fn jailer_binary() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| debug_binary(&["rollbox-jailer"], &[], "rollbox-jailer"))
        .clone()
}

/// Builds the `rollbox` CLI (once per test binary) and returns its path.
pub fn rollbox_binary() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| debug_binary(&["rollbox"], &[], "rollbox"))
        .clone()
}

/// Builds the test guest with `cargo xtask test-guest` (once per test binary).
pub fn test_guest() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            if prebuilt() {
                return workspace_root().join("target/test-guest/test-guest");
            }
            let out = cargo()
                .args(["xtask", "test-guest"])
                .stdout(Stdio::null())
                .status()
                .unwrap_or_else(|e| panic!("cannot run cargo xtask test-guest: {e}"));
            assert!(out.success(), "cargo xtask test-guest failed: {out}");
            workspace_root().join("target/test-guest/test-guest")
        })
        .clone()
}

/// Whether tests that need a missing prerequisite must fail instead of skipping (CI).
pub fn require_all() -> bool {
    std::env::var("ROLLBOX_REQUIRE_ALL").is_ok_and(|v| v == "1")
}

/// Records that `test` did not run because `reason`: one line on stderr and one in the file
/// named by ROLLBOX_SKIP_LOG, which `scripts/test.sh` counts and names in its closing line.
/// Under ROLLBOX_REQUIRE_ALL=1 a skip is a failure instead. Call it at most once per test:
/// each line counts as one skipped test.
pub fn skip(test: &str, reason: &str) {
    assert!(
        !require_all(),
        "{test} could not run: {reason} (ROLLBOX_REQUIRE_ALL=1 turns skips into failures)"
    );
    record_skip(test, reason);
}

/// Like [`skip`], but never a failure, even under ROLLBOX_REQUIRE_ALL=1. Only for a
/// prerequisite that is a property of the host itself, which no script can install or start
/// (for example the kernel's memory cgroup for the host-mode OOM test), and whose path another
/// test covers elsewhere.
pub fn skip_even_in_ci(test: &str, reason: &str) {
    record_skip(test, reason);
}

/// One `SKIP` line on stderr, and one line appended to ROLLBOX_SKIP_LOG when it is set.
fn record_skip(test: &str, reason: &str) {
    eprintln!("SKIP {test}: {reason}");
    if let Some(path) = std::env::var_os("ROLLBOX_SKIP_LOG") {
        // Appending the line in one write keeps lines from parallel tests whole.
        let line = format!("{test}: {reason}\n");
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(line.as_bytes()));
        if let Err(e) = written {
            eprintln!("cannot record the skip in {}: {e}", path.to_string_lossy());
        }
    }
}

/// The running test's name as libtest prints it (libtest names each test's thread after it).
fn current_test() -> String {
    std::thread::current()
        .name()
        .unwrap_or("unnamed test")
        .to_string()
}

/// Returns false (after recording the skip under the running test's name) when /dev/kvm is
/// unusable and skipping is allowed.
pub fn kvm_available() -> bool {
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        Ok(_) => true,
        Err(e) => {
            skip(&current_test(), &format!("needs /dev/kvm ({e})"));
            false
        }
    }
}

/// The test guest's command line: it finds its virtio devices on the command line, so ACPI is
/// off (with ACPI on, rollbox-vmm names them in the DSDT instead).
pub const TEST_GUEST_CMDLINE: &str = "console=ttyS0 reboot=k panic=1 pci=off acpi=off";

/// How long to wait for one answer from the guest (CPL0 code is emulated, so be generous).
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// A running `rollbox-vmm` with the test guest on its console.
pub struct Vm {
    /// The VMM process.
    pub child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    stderr: Arc<Mutex<String>>,
    /// Hears when the stderr reader met the end of stderr.
    stderr_done: Receiver<()>,
    /// Scratch directory for sockets and images; removed on drop.
    pub dir: tempfile::TempDir,
}

impl Vm {
    /// Spawns `rollbox-vmm` with `args` (the `{dir}` placeholder expands to the scratch dir).
    pub fn spawn_raw(args: &[String], dir: tempfile::TempDir) -> Vm {
        let args: Vec<String> = args
            .iter()
            .map(|a| a.replace("{dir}", &dir.path().display().to_string()))
            .collect();
        let mut command = Command::new(vmm_binary());
        command.args(&args);
        Vm::spawn_command(command, dir)
    }

    /// Spawns `command` (a `rollbox-vmm`, or a launcher that runs one with the same stdin,
    /// stdout and stderr, such as `rollbox-jailer`) with `dir` as its scratch directory.
    pub fn spawn_command(mut command: Command, dir: tempfile::TempDir) -> Vm {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot spawn {command:?}: {e}"));
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr_buf = Arc::new(Mutex::new(String::new()));
        let mut stderr = child.stderr.take().expect("stderr");
        let sink = Arc::clone(&stderr_buf);
        let (done_tx, stderr_done) = channel();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stderr.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .expect("stderr lock")
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
            let _ = done_tx.send(());
        });
        let stdin = child.stdin.take();
        Vm {
            child,
            stdin,
            lines: rx,
            stderr: stderr_buf,
            stderr_done,
            dir,
        }
    }

    /// Boots the test guest with extra `args` and waits for its ready line.
    pub fn boot(args: &[&str]) -> Vm {
        Vm::boot_with(|_| {}, args)
    }

    /// Like [`Vm::boot`], after `setup` prepared the scratch directory (`{dir}` in `args`).
    pub fn boot_with(setup: impl FnOnce(&Path), args: &[&str]) -> Vm {
        let dir = tempfile::tempdir().expect("tempdir");
        setup(dir.path());
        let mut all = vec!["--kernel".to_string(), test_guest().display().to_string()];
        if !args.contains(&"--cmdline") && !args.contains(&"--config") {
            all.extend(["--cmdline".to_string(), TEST_GUEST_CMDLINE.to_string()]);
        }
        all.extend(args.iter().map(|a| a.to_string()));
        let mut vm = Vm::spawn_raw(&all, dir);
        vm.expect_line("rollbox-test-guest: ready");
        vm
    }

    /// The VMM's stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().expect("stderr lock").clone()
    }

    /// The VMM's stderr from byte `from` on, once that part contains `needle`, or as it
    /// stands after `timeout`. stderr arrives through a reader thread, so a line the VMM has
    /// written may not be here yet.
    pub fn stderr_after(&self, from: usize, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let log = self.stderr();
            let new = log.get(from..).unwrap_or_default();
            if new.contains(needle) || Instant::now() >= deadline {
                return new.to_string();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The next console line.
    pub fn next_line(&mut self, timeout: Duration) -> Option<String> {
        match self.lines.recv_timeout(timeout) {
            Ok(line) => Some(line),
            Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => None,
        }
    }

    /// Waits for a console line equal to `want`, skipping others.
    pub fn expect_line(&mut self, want: &str) {
        let deadline = Instant::now() + ANSWER_TIMEOUT;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.next_line(left) {
                Some(line) if line == want => return,
                Some(_) => {}
                None => break,
            }
        }
        panic!("no console line {want:?}; stderr:\n{}", self.stderr());
    }

    /// Writes raw bytes to the console.
    pub fn send(&mut self, text: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        stdin.write_all(text.as_bytes()).expect("write console");
        stdin.flush().expect("flush console");
    }

    /// Sends a command and returns its one-line answer.
    pub fn cmd(&mut self, command: &str) -> String {
        self.send(&format!("{command}\n"));
        self.next_line(ANSWER_TIMEOUT)
            .unwrap_or_else(|| panic!("no answer to {command:?}; stderr:\n{}", self.stderr()))
    }

    /// Sends a command and asserts the answer starts with `OK`; returns the rest.
    pub fn ok(&mut self, command: &str) -> String {
        let answer = self.cmd(command);
        assert!(
            answer.starts_with("OK"),
            "{command:?} answered {answer:?}; stderr:\n{}",
            self.stderr()
        );
        answer.trim_start_matches("OK").trim_start().to_string()
    }

    /// Waits for the VMM to exit.
    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                // stderr ends when the VMM is gone (or, at worst, a child it left holding
                // stderr): wait for the reader to reach the end, so nothing is missed.
                let _ = self.stderr_done.recv_timeout(ANSWER_TIMEOUT);
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "rollbox-vmm did not exit; stderr:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A path in the scratch directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The client of `api.sock` in the scratch directory (where [`boot_with_api`] puts it).
    pub fn api(&self) -> vmm_api::Client {
        api_client(&self.path("api.sock"))
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Creates a zero-filled raw image of `bytes` bytes.
pub fn raw_image(path: &Path, bytes: u64) {
    let file = std::fs::File::create(path).expect("create image");
    file.set_len(bytes).expect("size image");
}

/// How long a test waits for one answer of a VMM's API.
pub const API_TIMEOUT: Duration = Duration::from_secs(60);

/// The client of the VMM API socket at `sock`, with [`API_TIMEOUT`] per call: typed calls for
/// a test's steps, [`vmm_api::Client::request`] where the test checks the raw answer.
pub fn api_client(sock: &Path) -> vmm_api::Client {
    vmm_api::Client::new(sock).with_timeout(API_TIMEOUT)
}

/// `PUT /snapshot/create` of a `kind` ("Full" or "Diff") snapshot into `dir`: `dir/vmstate`
/// and `dir/memory`.
pub fn snapshot_params(kind: &str, dir: &Path) -> vmm_api::CreateSnapshotParams {
    vmm_api::CreateSnapshotParams {
        snapshot_type: kind.into(),
        snapshot_path: dir.join("vmstate"),
        mem_file_path: dir.join("memory"),
        version: None,
        rollbox: None,
    }
}

/// Boots the test guest with an API socket (`api.sock`), a 4 MiB drive (`disk.img`) and vsock
/// (`v.sock`, CID 5) in its scratch dir, plus `extra` flags; returns once the API listens.
pub fn boot_with_api(extra: &[&str]) -> Vm {
    let mut args = vec![
        "--api-sock",
        "{dir}/api.sock",
        "--drive",
        "{dir}/disk.img",
        "--vsock-uds",
        "{dir}/v.sock",
        "--vsock-cid",
        "5",
    ];
    args.extend_from_slice(extra);
    let vm = Vm::boot_with(|dir| raw_image(&dir.join("disk.img"), 4 << 20), &args);
    wait_for_socket(&vm.path("api.sock"), Duration::from_secs(10));
    vm
}

/// The first line of the file at `path` for which `want` holds, once there is one; panics
/// with the file's text after `timeout` (a clone's console, say, that another process writes).
pub fn wait_for_file_line(path: &Path, timeout: Duration, want: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if let Some(line) = text.lines().find(|l| want(l)) {
            return line.to_string();
        }
        assert!(
            Instant::now() < deadline,
            "{}: no such line within {timeout:?}; it holds:\n{text}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// PIDs of the virtiofsd processes serving rollbox-vmm `pid` (their socket path names it), one
/// per instance: under `--sandbox namespace` (a root VMM's default) virtiofsd forks, and its
/// parent only waits, so the process that serves is the one with no matching child.
pub fn virtiofsd_of(pid: u32) -> Vec<u32> {
    let needle = format!("rollbox-vmm-{pid}-fs");
    let matching: Vec<u32> = std::fs::read_dir("/proc")
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .filter(|p| {
                    std::fs::read(format!("/proc/{p}/cmdline"))
                        .map(|c| String::from_utf8_lossy(&c).contains(&needle))
                        .unwrap_or(false)
                })
                .collect()
        })
        .unwrap_or_default();
    let parents: Vec<u32> = matching.iter().filter_map(|p| parent_of(*p)).collect();
    matching
        .into_iter()
        .filter(|p| !parents.contains(p))
        .collect()
}

/// The parent PID of `pid`, from /proc/PID/stat (the field after the parenthesised name).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Waits until `path` accepts connections.
pub fn wait_for_socket(path: &Path, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while UnixStream::connect(path).is_err() {
        assert!(
            Instant::now() < deadline,
            "{} never accepted connections",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The mount options of process `pid`'s root (`/` as it sees it), from /proc/PID/mountinfo.
pub fn root_mount_options(pid: u32) -> Vec<String> {
    let mountinfo =
        std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).expect("read mountinfo");
    let root = mountinfo
        .lines()
        .rev()
        .map(|line| line.split(' ').collect::<Vec<_>>())
        .find(|fields| fields.get(4) == Some(&"/"))
        .unwrap_or_else(|| panic!("no / in /proc/{pid}/mountinfo:\n{mountinfo}"));
    root.get(5)
        .map(|options| options.split(',').map(str::to_string).collect())
        .unwrap_or_default()
}

/// Process `pid`'s soft and hard limit `name` (e.g. "Max file size"), from /proc/PID/limits.
pub fn rlimit_of(pid: u32, name: &str) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("read limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with(name))
        .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/limits:\n{limits}"));
    let mut values = line[name.len()..].split_whitespace();
    let soft = values.next().unwrap_or_default().to_string();
    let hard = values.next().unwrap_or_default().to_string();
    (soft, hard)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Puts the environment variables it names back as they were when dropped.
    struct RestoreEnv(Vec<(&'static str, Option<std::ffi::OsString>)>);

    impl RestoreEnv {
        fn save(names: &[&'static str]) -> RestoreEnv {
            RestoreEnv(names.iter().map(|&n| (n, std::env::var_os(n))).collect())
        }
    }

    impl Drop for RestoreEnv {
        fn drop(&mut self) {
            for (name, value) in &self.0 {
                match value {
                    Some(value) => std::env::set_var(name, value),
                    None => std::env::remove_var(name),
                }
            }
        }
    }

    #[test]
    fn nested_cargo_drops_what_cargo_set_for_the_test_only() {
        for name in [
            "CARGO_MANIFEST_DIR",
            "CARGO_PKG_NAME",
            "CARGO_BIN_EXE_rollbox",
        ] {
            assert!(is_test_only_cargo_var(name), "{name}");
        }
        for name in [
            "CARGO",
            "CARGO_HOME",
            "CARGO_TARGET_DIR",
            "CARGO_BUILD_JOBS",
            "PATH",
        ] {
            assert!(!is_test_only_cargo_var(name), "{name}");
        }
    }

    // The only test here that touches these process-wide variables, so nothing races with it.
    #[test]
    fn skips_append_one_line_each_to_the_skip_log() {
        let _restore = RestoreEnv::save(&["ROLLBOX_SKIP_LOG", "ROLLBOX_REQUIRE_ALL"]);
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("skips");
        std::env::set_var("ROLLBOX_SKIP_LOG", &log);
        std::env::remove_var("ROLLBOX_REQUIRE_ALL");

        skip("first_test", "needs a thing");
        skip("second_test", "needs another thing (with: a colon)");
        let text = std::fs::read_to_string(&log).expect("skip log");
        assert_eq!(
            text,
            "first_test: needs a thing\nsecond_test: needs another thing (with: a colon)\n"
        );

        // Under ROLLBOX_REQUIRE_ALL=1 a skip fails and records nothing; skip_even_in_ci records.
        std::env::set_var("ROLLBOX_REQUIRE_ALL", "1");
        let failed = std::panic::catch_unwind(|| skip("third_test", "needs root"));
        assert!(
            failed.is_err(),
            "skip did not fail under ROLLBOX_REQUIRE_ALL=1"
        );
        skip_even_in_ci("fourth_test", "no memory cgroup here");
        let text = std::fs::read_to_string(&log).expect("skip log");
        assert_eq!(text.lines().count(), 3, "{text}");
        assert!(
            text.ends_with("fourth_test: no memory cgroup here\n"),
            "{text}"
        );
    }
}
