//! A real `rollbox serve` for the rollbox crate's daemon tests (rollbox/tests/daemon_*.rs):
//! a Unix socket and state directory in a scratch directory, this workspace's rollbox-vmm and
//! rollbox-jailer, the test guest as template, a host agent standing in for a guest's, and the
//! small readers those tests share; e2b.rs and python_sdk.rs end their VMMs with [`end_vmms`].
//! Behind the `daemon` feature: it speaks through the rollbox crate's own client and finds
//! VMMs as the daemon does, so only rollbox's tests (which dev-depend on this crate with the
//! feature) build it.

pub mod leaks;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rollbox::daemon::client::{ClientError, Endpoint, Response};
use rollbox::daemon::{cgroup, vm};
use serde_json::{json, Value};

use crate::{
    agent_binary, jailer_binary, rollbox_binary, test_guest, vmm_binary, vmm_wrapper,
    TEST_GUEST_CMDLINE,
};

/// The API key every [`Server`] is started with.
pub const KEY: &str = "test-key-0123";

/// How much of serve.log [`Server::log_tail`] returns.
const LOG_TAIL: usize = 4000;

/// A `rollbox serve` on a Unix socket in a scratch directory; on drop it is killed and every
/// VMM it left is ended, with the cgroups of their jails and of `cpu_limit`.
pub struct Server {
    /// The daemon process; None after [`Server::kill9`], until [`Server::spawn`].
    pub child: Option<Child>,
    pub dir: tempfile::TempDir,
    args: Vec<String>,
}

impl Server {
    /// Starts the daemon with `extra` flags; it runs this workspace's rollbox-vmm and
    /// rollbox-jailer unless `extra` names a `--vmm`, a `--jailer` or `--no-jailer`.
    pub fn start(extra: &[&str]) -> Server {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("key"), format!("{KEY}\n")).expect("write key");
        let mut server = Server {
            child: None,
            dir,
            args: extra.iter().map(|s| s.to_string()).collect(),
        };
        server.spawn();
        server
    }

    pub fn sock(&self) -> PathBuf {
        self.dir.path().join("d.sock")
    }

    /// The state directory as given to the daemon (not canonical).
    pub fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// The network lease directory the daemon is given unless the test names one.
    pub fn net_state(&self) -> PathBuf {
        self.dir.path().join("net")
    }

    pub fn sandboxes_dir(&self) -> PathBuf {
        std::fs::canonicalize(self.state())
            .expect("state dir")
            .join("sandboxes")
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).expect("daemon running")
    }

    /// Starts the daemon on the scratch state directory (again, after [`Server::kill9`]) and
    /// waits until it answers.
    pub fn spawn(&mut self) {
        self.wait_until_nothing_accepts();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("serve.log"))
            .expect("log");
        let mut command = Command::new(rollbox_binary());
        command.arg("serve");
        if !self.args.iter().any(|a| a == "--vmm") {
            command.arg("--vmm").arg(vmm_binary());
        }
        if !self
            .args
            .iter()
            .any(|a| a == "--jailer" || a == "--no-jailer")
        {
            command.arg("--jailer").arg(jailer_binary());
        }
        // Network leases in the scratch directory, released when the server is dropped.
        if !self.args.iter().any(|a| a == "--net-state-dir") {
            command.arg("--net-state-dir").arg(self.net_state());
        }
        // Templates' files (rootfs, image archives) come from the tests' scratch directories.
        if !self.args.iter().any(|a| a == "--template-dir") {
            command.arg("--template-dir").arg(std::env::temp_dir());
        }
        let child = command
            .arg("--socket")
            .arg(self.sock())
            .arg("--api-key-file")
            .arg(self.dir.path().join("key"))
            .arg("--state-dir")
            .arg(self.state())
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn rollbox serve");
        self.child = Some(child);
        // Ready once it answers HTTP (any status, even 401): a connect alone may reach a
        // listener that is not this daemon's (see `wait_until_nothing_accepts`).
        let deadline = Instant::now() + Duration::from_secs(30);
        while Endpoint::Unix(self.sock())
            .request("GET", "/", &[], None, Duration::from_secs(1))
            .is_err()
        {
            assert!(
                Instant::now() < deadline,
                "rollbox serve never answered:\n{}",
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

    /// Waits until nothing accepts connections on the socket. A daemon killed with SIGKILL
    /// leaves its socket file, and its listener lives on in any child it was starting (between
    /// fork and exec a child holds a copy of every descriptor, close-on-exec or not): until
    /// that child execs, connections queue there unanswered and are reset when it does, and a
    /// new daemon would take the socket for another daemon's.
    fn wait_until_nothing_accepts(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::os::unix::net::UnixStream::connect(self.sock()).is_ok() {
            assert!(
                Instant::now() < deadline,
                "something still accepts on {} 30 s after the daemon ended",
                self.sock().display()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// All of serve.log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("serve.log")).unwrap_or_default()
    }

    /// The end of serve.log, for messages after long runs.
    pub fn log_tail(&self) -> String {
        let text = self.log();
        let tail = text.len().saturating_sub(LOG_TAIL);
        text.get(tail..).unwrap_or_default().to_string()
    }

    /// SIGKILL: nothing of the daemon runs after this; its VMMs keep running.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().expect("kill -9 the daemon");
            child.wait().expect("wait");
        }
    }

    fn request(
        &self,
        method: &str,
        path: &str,
        key: Option<&str>,
        body: Option<&[u8]>,
    ) -> Result<Response, ClientError> {
        request_at(&self.sock(), method, path, key, body)
    }

    /// One request with `key` as the bearer key (none without); panics when it gets no answer.
    pub fn raw(
        &self,
        method: &str,
        path: &str,
        key: Option<&str>,
        body: Option<&[u8]>,
    ) -> Response {
        self.request(method, path, key, body)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}\n{}", self.log()))
    }

    /// One request with [`KEY`]; the error when it gets no answer.
    pub fn try_call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Response, ClientError> {
        let body = body.map(Value::to_string);
        self.request(method, path, Some(KEY), body.as_deref().map(str::as_bytes))
    }

    /// One request with [`KEY`]: the status and the body as JSON (Null when it is not).
    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let body = body.map(|b| b.to_string());
        let response = self.raw(method, path, Some(KEY), body.as_deref().map(str::as_bytes));
        status_and_json(&response)
    }

    /// Registers the test guest (32 MiB) as template `name`.
    pub fn add_guest_template(&self, name: &str) {
        self.add_template(guest_template(name));
    }

    /// Registers template `name`: the test guest (32 MiB) with the image in the `docker save`
    /// archive `archive` as its disk, booted once for a snapshot with `boot_snapshot`. The
    /// template's JSON.
    pub fn add_image_template(&self, name: &str, archive: &Path, boot_snapshot: bool) -> Value {
        let mut body = guest_template(name);
        body["image"] = json!({"docker_archive": archive});
        body["boot_snapshot"] = json!(boot_snapshot);
        self.add_template(body)
    }

    /// POST /templates, which must answer 201: the template.
    fn add_template(&self, body: Value) -> Value {
        let (status, template) = self.call("POST", "/templates", Some(body));
        assert_eq!(status, 201, "{template}\n{}", self.log());
        template
    }

    /// POST /sandboxes, which must make a running sandbox: the sandbox.
    pub fn create(&self, body: Value) -> Value {
        let (status, sandbox) = self.call("POST", "/sandboxes", Some(body));
        assert_eq!(status, 201, "{sandbox}\n{}", self.log());
        assert_eq!(sandbox["state"], "running", "{sandbox}");
        sandbox
    }

    pub fn get(&self, id: &str) -> Value {
        let (status, sandbox) = self.call("GET", &format!("/sandboxes/{id}"), None);
        assert_eq!(status, 200, "{sandbox}");
        sandbox
    }

    /// Template "guest", a sandbox booted from it and its snapshot: the snapshot's id.
    pub fn guest_snapshot(&self) -> String {
        self.add_guest_template("guest");
        let (status, base) = self.call(
            "POST",
            "/sandboxes",
            Some(json!({"template": "guest", "ttl_s": 600})),
        );
        assert_eq!(status, 201, "{base}\n{}", self.log_tail());
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

    /// The names in the sandboxes directory.
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
        end_vmms(&self.state());
        // Taps, rules and leases of sandboxes with a network.
        release_leases(&self.net_state());
        if let Ok(dir) = std::fs::canonicalize(self.state()) {
            // The groups of jails whose jailer went with the kill, and their parents.
            let fs = Path::new("/sys/fs/cgroup");
            let parent = cgroup::root_name(&dir);
            for (_, group) in rollbox_jailer::all_jail_groups(fs, &parent) {
                let _ = rollbox_jailer::remove_group(&group);
            }
            for (_, top) in rollbox_jailer::all_jail_groups(fs, "") {
                if top.ends_with(&parent) {
                    let _ = std::fs::remove_dir(top);
                }
            }
            // The daemon's cgroup root (cpu_limit), once its sandboxes' groups are gone.
            if let Some(groups) = host_cgroups(&dir) {
                for entry in std::fs::read_dir(&groups.root)
                    .into_iter()
                    .flatten()
                    .flatten()
                {
                    let _ = std::fs::remove_dir(entry.path());
                }
                let _ = std::fs::remove_dir(&groups.root);
            }
        }
    }
}

/// Ends every VMM (or jailer) still running under the daemon state directory `state`.
/// Releases every network lease in lease directory `dir` (its taps and nftables rules are the
/// host's: a test that fails must not leave them behind).
pub fn release_leases(dir: &Path) {
    let state = rollbox::net::StateDir::new(dir);
    for lease in rollbox::net::leases(&state).unwrap_or_default() {
        let _ = rollbox::net::release(&state, &lease.name);
    }
}

/// A lease directory given to a daemon the test starts itself: [`release_leases`] on drop.
pub struct NetLeases(pub PathBuf);

impl Drop for NetLeases {
    fn drop(&mut self) {
        release_leases(&self.0);
    }
}

pub fn end_vmms(state: &Path) {
    if let Ok(dir) = std::fs::canonicalize(state) {
        for found in vm::find_vmms(&dir.join("sandboxes")) {
            vm::kill(found.pid, found.start_time, Duration::from_secs(5));
        }
    }
}

/// This host's cpu controller, as the daemon with state in `state` uses it.
pub fn host_cgroups(state: &Path) -> Option<cgroup::Cgroups> {
    cgroup::Cgroups::find(Path::new("/sys/fs/cgroup"), &cgroup::root_name(state)).ok()
}

/// A sandbox's VMM: its pid and start time.
pub fn pid_of(sandbox: &Value) -> (u32, u64) {
    (
        u32::try_from(sandbox["pid"].as_u64().expect("pid")).expect("pid fits"),
        sandbox["pid_start_time"].as_u64().expect("start time"),
    )
}

/// One request to the daemon on `sock`, with `key` as the bearer key (none without).
fn request_at(
    sock: &Path,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<&[u8]>,
) -> Result<Response, ClientError> {
    let auth = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("Authorization", a.as_str())).collect();
    Endpoint::Unix(sock.to_path_buf()).request(
        method,
        path,
        &headers,
        body,
        Duration::from_secs(60),
    )
}

/// A response's status and its body as JSON (Null when it is not).
fn status_and_json(response: &Response) -> (u16, Value) {
    let value = serde_json::from_slice(&response.body).unwrap_or(Value::Null);
    (response.status, value)
}

/// [`Server::call`] for a daemon this harness did not start (one in a container, say) on
/// `sock`: one request with [`KEY`], its status and JSON body; panics when it gets no answer.
pub fn call_at(sock: &Path, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let body = body.map(|b| b.to_string());
    let response = request_at(
        sock,
        method,
        path,
        Some(KEY),
        body.as_deref().map(str::as_bytes),
    )
    .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    status_and_json(&response)
}

/// A sandbox (its JSON) ended with `state`, its `end_reason` saying `why`.
pub fn assert_ended(sandbox: &Value, state: &str, why: &str) {
    assert_eq!(sandbox["state"], state, "{sandbox}");
    let reason = sandbox["end_reason"].as_str().unwrap_or("");
    assert!(
        reason.contains(why),
        "end_reason should say {why:?}: {sandbox}"
    );
}

/// Polls `done` every 50 ms; panics naming `what` after `timeout`.
pub fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A `--vmm` that waits `secs` before it becomes rollbox-vmm: slow creates on demand.
pub fn slow_vmm(dir: &Path, secs: &str) -> PathBuf {
    vmm_wrapper(
        dir,
        &format!("slow-vmm-{secs}.sh"),
        &format!("sleep {secs}"),
    )
}

/// The ids of a GET /sandboxes answer, in order.
pub fn ids(list: &Value) -> Vec<String> {
    list["sandboxes"]
        .as_array()
        .expect("sandboxes")
        .iter()
        .map(|s| s["id"].as_str().expect("id").to_string())
        .collect()
}

/// A sandbox's console so far.
pub fn console(sandbox: &Value) -> String {
    let dir = PathBuf::from(sandbox["dir"].as_str().expect("dir"));
    std::fs::read_to_string(dir.join("console.log")).unwrap_or_default()
}

/// The `--config` file (`vmm-config.json`) a booted sandbox's VMM was started with, as JSON
/// (Null for a restore, which has none).
pub fn boot_config(sandbox: &Value) -> Value {
    let dir = PathBuf::from(sandbox["dir"].as_str().expect("dir"));
    std::fs::read(dir.join("vmm-config.json"))
        .ok()
        .and_then(|json| serde_json::from_slice(&json).ok())
        .unwrap_or(Value::Null)
}

/// The command line of a running process.
pub fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

/// Runs the `rollbox` CLI with `args` against `server`: its output, whatever its status.
pub fn cli_output(server: &Server, args: &[&str]) -> std::process::Output {
    Command::new(rollbox_binary())
        .args(args)
        .arg("--socket")
        .arg(server.sock())
        .env("ROLLBOX_API_KEY", KEY)
        .output()
        .expect("run rollbox")
}

/// Runs the `rollbox` CLI with `args` against `server`; must succeed: its stdout.
pub fn cli(server: &Server, args: &[&str]) -> String {
    let out = cli_output(server, args);
    assert!(
        out.status.success(),
        "rollbox {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// A streaming exec (`?stream=true`) of `body` in sandbox `id`: the response, whose body is
/// the NDJSON lines as they come; `timeout` bounds each read.
pub fn open_exec_stream(
    server: &Server,
    id: &str,
    body: &Value,
    timeout: Duration,
) -> Result<rollbox::daemon::client::Streaming, ClientError> {
    let text = body.to_string();
    let auth = format!("Bearer {KEY}");
    Endpoint::Unix(server.sock()).open(
        "POST",
        &format!("/sandboxes/{id}/exec?stream=true"),
        &[("Authorization", &auth)],
        Some((&mut text.as_bytes(), text.len() as u64)),
        timeout,
    )
}

/// A unary exec in sandbox `id`, which must answer 200: the result.
pub fn exec(server: &Server, id: &str, body: Value) -> Value {
    let (status, result) = server.call("POST", &format!("/sandboxes/{id}/exec"), Some(body));
    assert_eq!(status, 200, "{result}\n{}", server.log());
    result
}

/// A host `rollbox-agent --listen-unix`: the fast tests' stand-in for a guest's agent (the test
/// guest has none), behind the same hybrid-vsock `CONNECT 1024` socket.
pub struct HostAgent {
    child: Child,
    pub sock: PathBuf,
    _dir: tempfile::TempDir,
}

impl HostAgent {
    pub fn start() -> HostAgent {
        HostAgent::start_with(&[])
    }

    /// A host agent with more flags (e.g. `--docker-socket PATH`).
    pub fn start_with(extra: &[&str]) -> HostAgent {
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = dir.path().join("agent.sock");
        let child = Command::new(agent_binary())
            .arg("--listen-unix")
            .arg(&sock)
            .args(["--no-init", "--no-set-clock", "--no-generation-watch"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn rollbox-agent");
        wait_for("the host agent's socket", Duration::from_secs(20), || {
            sock.exists()
        });
        HostAgent {
            child,
            sock,
            _dir: dir,
        }
    }
}

impl Drop for HostAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The test guest (32 MiB) as template `name`, a `POST /templates` body.
fn guest_template(name: &str) -> Value {
    json!({
        "name": name,
        "kernel": test_guest(),
        "cmdline": TEST_GUEST_CMDLINE,
        "memory_mib": 32,
    })
}

/// A daemon for image templates: its sandboxes' agent traffic goes to a host agent, templates
/// get the static guest agent, and images are cached in `work/cache`; `extra` flags beside.
pub fn image_server(work: &Path, extra: &[&str]) -> (HostAgent, Server) {
    let agent = HostAgent::start();
    let agent_sock = agent.sock.display().to_string();
    let cache = work.join("cache").display().to_string();
    let guest_agent = crate::images::agent().display().to_string();
    let mut args = vec![
        "--test-agent-socket",
        &agent_sock,
        "--agent",
        &guest_agent,
        "--image-cache",
        &cache,
    ];
    args.extend_from_slice(extra);
    let server = Server::start(&args);
    (agent, server)
}

/// A daemon whose sandboxes' agent traffic goes to a host agent, and one running sandbox.
pub fn agent_server() -> (HostAgent, Server, String) {
    let agent = HostAgent::start();
    let sock = agent.sock.display().to_string();
    let server = Server::start(&["--test-agent-socket", &sock]);
    server.add_guest_template("guest");
    let sandbox = server.create(json!({"template": "guest", "ttl_s": 300}));
    let id = sandbox["id"].as_str().expect("id").to_string();
    (agent, server, id)
}

/// A process's resident memory in KiB, from /proc/PID/status.
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("daemon status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/PID/status")
}

/// The highest resident memory of `pid` (KiB) over the next 4 s, sampled every 250 ms, and at
/// least `from`: a flood test's growth after its queues filled.
pub fn peak_rss_kib_over_4_s(pid: u32, from: u64) -> u64 {
    let mut peak = from;
    for _ in 0..16 {
        std::thread::sleep(Duration::from_millis(250));
        peak = peak.max(rss_kib(pid));
    }
    peak
}

/// Reads until `buf` is full, the stream ends or a read fails; the count read. A flood test's
/// proof that a stalled stream still held output.
pub fn read_until_full(stream: &mut impl std::io::Read, buf: &mut [u8]) -> usize {
    let mut got = 0;
    while got < buf.len() {
        match stream.read(&mut buf[got..]) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    got
}

/// A private CA and a certificate for 127.0.0.1 and *.e2b.test signed by it, made with the
/// openssl CLI: (ca.pem, server.pem, server.key).
pub fn make_certs(dir: &std::path::Path) -> Result<(PathBuf, PathBuf, PathBuf), String> {
    let ext = dir.join("ext.cnf");
    std::fs::write(
        &ext,
        "subjectAltName=IP:127.0.0.1,DNS:*.e2b.test\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
    )
    .map_err(|e| e.to_string())?;
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let steps: [Vec<&str>; 3] = [
        [
            &["req", "-x509"][..],
            &ec,
            &[
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
                "-days",
                "2",
                "-subj",
                "/CN=rollbox e2b test CA",
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign",
            ],
        ]
        .concat(),
        [
            &["req"][..],
            &ec,
            &[
                "-keyout",
                "server.key",
                "-out",
                "server.csr",
                "-subj",
                "/CN=127.0.0.1",
            ],
        ]
        .concat(),
        vec![
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
        ],
    ];
    for args in steps {
        let output = Command::new("openssl")
            .args(&args)
            .current_dir(dir)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run openssl: {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&output.stderr)
            ));
        }
    }
    Ok((
        dir.join("ca.pem"),
        dir.join("server.pem"),
        dir.join("server.key"),
    ))
}
