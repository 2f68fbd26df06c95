//! The stock `e2b` Python SDK (from PyPI, pinned) against `rollbox serve --e2b-listen`: the real
//! `rollbox` and `rollbox-vmm` with the tier-2 test guest as the template (needs /dev/kvm), and
//! exec/files through a host `rollbox-agent --listen-unix` (the test guest has no agent), whose
//! accounts map E2B's default `user` onto the agent's own uid with a scratch home.
//! The SDK's venv comes from scripts/e2b-venv.sh (cached outside the repository); when it
//! cannot be made the test is skipped, which ROLLBOX_REQUIRE_ALL=1 turns into a failure.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rollbox::daemon::client::Endpoint;
use rollbox_tests::{
    agent_binary, e2b_script, kvm_available, rollbox_binary, skip, test_guest, venv_python,
    vmm_binary, workspace_root, TEST_GUEST_CMDLINE,
};
use serde_json::json;

/// The data plane as a security boundary (issue 25).
#[path = "e2b/security.rs"]
mod security;

/// A process's output flooding clients that do not read (issue 25).
#[path = "e2b/flood.rs"]
mod flood;

/// `rollbox lease`, an agent-sandbox pod's container, as a plain process (issue 27).
#[path = "e2b/lease.rs"]
mod lease;

const KEY: &str = "e2b-test-key-0123";
/// The sandbox port the code interpreter SDK calls.
const CODE_INTERPRETER_PORT: u16 = 49999;

/// Ends the children and every VMM left under the state directory on drop.
struct Daemon {
    children: Vec<Child>,
    dir: tempfile::TempDir,
}

impl Daemon {
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("serve.log")).unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        rollbox_tests::daemon::end_vmms(&self.dir.path().join("state"));
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

fn wait_for(what: &str, daemon: &Daemon, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}\n{}",
            daemon.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The host agent's accounts (`DIR/etc`): this host's, with E2B's default `user` mapped onto
/// the agent's own uid and gid and `home` as its home. The host agent cannot add accounts to
/// the host; this way a request that names no user runs as `user` in `home`, as in a guest
/// built from an image, though `whoami` there names the host's account.
fn host_accounts(dir: &std::path::Path, home: &std::path::Path) -> PathBuf {
    use std::os::unix::fs::MetadataExt;
    let etc = dir.join("etc");
    std::fs::create_dir_all(&etc).expect("etc");
    let me = std::fs::metadata(dir).expect("stat the test directory");
    let host = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    let mut passwd: String = host
        .lines()
        .filter(|line| !line.starts_with("user:"))
        .map(|line| format!("{line}\n"))
        .collect();
    passwd.push_str(&format!(
        "user:x:{}:{}:E2B's default user:{}:/bin/sh\n",
        me.uid(),
        me.gid(),
        home.display()
    ));
    std::fs::write(etc.join("passwd"), passwd).expect("write passwd");
    let group = std::fs::read_to_string("/etc/group").unwrap_or_default();
    std::fs::write(etc.join("group"), group).expect("write group");
    etc
}

/// A daemon with the E2B listener (TLS with `tls` = (cert, key)), a host agent, and the test
/// guest as template "guest".
fn start_daemon(
    dir: tempfile::TempDir,
    tls: Option<(PathBuf, PathBuf)>,
    extra_args: &[String],
) -> (Daemon, u16) {
    std::fs::write(dir.path().join("key"), format!("{KEY}\n")).expect("write key");
    let agent_sock = dir.path().join("agent.sock");
    // `commands.run` is `bash -l`: with the host's HOME it would run the host's ~/.profile
    // (which may be slow or take locks a killed command leaves behind). An empty HOME instead.
    let home = dir.path().join("home");
    std::fs::create_dir_all(&home).expect("home");
    let etc = host_accounts(dir.path(), &home);
    let agent = Command::new(agent_binary())
        .env("HOME", &home)
        .arg("--listen-unix")
        .arg(&agent_sock)
        .arg("--etc-dir")
        .arg(&etc)
        .args(["--no-init", "--no-set-clock", "--no-generation-watch"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn rollbox-agent");
    let mut daemon = Daemon {
        children: vec![agent],
        dir,
    };
    // Connectable, not only there: between bind and listen a connect is refused.
    wait_for("the host agent's socket", &daemon, || {
        std::os::unix::net::UnixStream::connect(&agent_sock).is_ok()
    });
    let sock = daemon.dir.path().join("d.sock");
    // free_port races with the other tests' daemons: a daemon that lost its E2B port exits,
    // and is started again on another.
    let mut attempt = 0;
    let port = loop {
        attempt += 1;
        let port = free_port();
        let log = std::fs::File::create(daemon.dir.path().join("serve.log")).expect("log");
        let mut serve = Command::new(rollbox_binary());
        serve.arg("serve");
        if let Some((cert, key)) = &tls {
            serve
                .arg("--e2b-tls-cert")
                .arg(cert)
                .arg("--e2b-tls-key")
                .arg(key);
        }
        let mut child = serve
            .arg("--vmm")
            .arg(vmm_binary())
            .arg("--socket")
            .arg(&sock)
            .arg("--api-key-file")
            .arg(daemon.dir.path().join("key"))
            .arg("--template-dir")
            .arg(std::env::temp_dir())
            .arg("--state-dir")
            .arg(daemon.dir.path().join("state"))
            .arg("--test-agent-socket")
            .arg(&agent_sock)
            .arg("--e2b-listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--e2b-domain")
            .arg("e2b.test")
            .args(extra_args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn rollbox serve");
        // Both listeners: the E2B port alone could be another process's.
        let deadline = Instant::now() + Duration::from_secs(20);
        let exited = loop {
            if std::os::unix::net::UnixStream::connect(&sock).is_ok()
                && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
            {
                break None;
            }
            if let Ok(Some(status)) = child.try_wait() {
                break Some(status);
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for rollbox serve\n{}",
                daemon.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        match exited {
            None => {
                daemon.children.push(child);
                break port;
            }
            Some(_) if attempt < 3 && daemon.log().contains("in use") => {
                let _ = std::fs::remove_file(&sock);
            }
            Some(status) => panic!("rollbox serve exited ({status})\n{}", daemon.log()),
        }
    };
    let body = json!({
        "name": "guest",
        "kernel": test_guest(),
        "cmdline": TEST_GUEST_CMDLINE,
        "memory_mib": 32,
    })
    .to_string();
    let auth = format!("Bearer {KEY}");
    let response = Endpoint::Unix(sock.clone())
        .request(
            "POST",
            "/templates",
            &[("Authorization", auth.as_str())],
            Some(body.as_bytes()),
            Duration::from_secs(30),
        )
        .expect("POST /templates");
    assert_eq!(response.status, 201, "{}", response.error_message());
    // A template whose kernel is gone after registration: its creates fail inside the VMM.
    let kernel = daemon.dir.path().join("vanishing-kernel");
    std::fs::copy(test_guest(), &kernel).expect("copy the kernel");
    let body = json!({ "name": "broken", "kernel": kernel, "memory_mib": 32 }).to_string();
    let response = Endpoint::Unix(daemon.dir.path().join("d.sock"))
        .request(
            "POST",
            "/templates",
            &[("Authorization", auth.as_str())],
            Some(body.as_bytes()),
            Duration::from_secs(30),
        )
        .expect("POST /templates");
    assert_eq!(response.status, 201, "{}", response.error_message());
    std::fs::remove_file(&kernel).expect("remove the kernel");
    (daemon, port)
}

/// The venv's python for SDK `version`, or why there is none.
fn sdk_python(version: &str) -> Result<PathBuf, String> {
    venv_python("scripts/e2b-venv.sh", &[version])
}

/// What a test of the stock SDK `version` needs: /dev/kvm and the SDK's venv. None (and the
/// test `test` reported skipped, a failure under ROLLBOX_REQUIRE_ALL=1) when one is missing.
fn kvm_and_sdk(test: &str, version: &str) -> Option<PathBuf> {
    if !kvm_available() {
        return None;
    }
    match sdk_python(version) {
        Ok(python) => Some(python),
        Err(reason) => {
            skip(test, &format!("no e2b {version} venv: {reason}"));
            None
        }
    }
}

fn run_sdk_suite(test: &str, version: &str, tls: bool) {
    run_sdk_script(test, version, tls, "test_sdk.py");
}

fn run_sdk_script(test: &str, version: &str, tls: bool, script: &str) {
    let Some(python) = kvm_and_sdk(test, version) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let (ca, files) = if tls {
        match rollbox_tests::daemon::make_certs(dir.path()) {
            Ok((ca, cert, key)) => (Some(ca), Some((cert, key))),
            Err(reason) => {
                skip(test, &format!("no test certificate: {reason}"));
                return;
            }
        }
    } else {
        (None, None)
    };
    let (daemon, port) = start_daemon(dir, files, &[]);
    let scratch = tempfile::tempdir().expect("scratch");
    let scheme = if tls { "https" } else { "http" };
    let url = format!("{scheme}://127.0.0.1:{port}");
    let mut command = e2b_script(&python, script, &url, KEY, "guest", scratch.path());
    if let Some(ca) = &ca {
        command.env("SSL_CERT_FILE", ca);
    }
    let output = command
        .env("ROLLBOX_NATIVE_SOCKET", daemon.dir.path().join("d.sock"))
        .env("ROLLBOX_E2B_PORT", port.to_string())
        .output()
        .expect("run test_sdk.py");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}");
    assert!(
        output.status.success() && stdout.contains("all ok"),
        "e2b {version} suite failed ({}):\n{stdout}\n{stderr}\n--- serve.log ---\n{}",
        output.status,
        daemon.log()
    );
}

/// Over TLS with a private CA given through SSL_CERT_FILE, as a user would run it.
#[test]
fn stock_e2b_sdk_2_63_against_rollbox() {
    run_sdk_suite("stock_e2b_sdk_2_63_against_rollbox", "2.63.0", true);
}

/// SDK 1.x: `https://api.{domain}` and host-routed `https://{port}-{id}.{domain}` only (the
/// script stands in for wildcard DNS), `GET /sandboxes/{id}` to connect.
#[test]
fn stock_e2b_sdk_1_11_against_rollbox() {
    run_sdk_script(
        "stock_e2b_sdk_1_11_against_rollbox",
        "1.11.1",
        true,
        "test_sdk_v1.py",
    );
}

/// SDK 2.0-2.50 creates with `POST /sandboxes` and connects with `/sandboxes/{id}/connect`.
#[test]
fn stock_e2b_sdk_2_50_against_rollbox() {
    run_sdk_suite("stock_e2b_sdk_2_50_against_rollbox", "2.50.0", false);
}

/// The SDK's Volume API on the daemon's volumes (rollbox/tests/e2b/test_volumes.py): create,
/// write, read, list, make_dir, remove, a sandbox that mounts one, and destroy (refused
/// while the sandbox lives). The mount needs virtiofsd (scripts/test.sh sets
/// ROLLBOX_VIRTIOFSD).
#[test]
fn stock_e2b_sdk_2_63_volumes_against_rollbox() {
    const TEST: &str = "stock_e2b_sdk_2_63_volumes_against_rollbox";
    if !kvm_available() {
        return;
    }
    if std::env::var_os("ROLLBOX_VIRTIOFSD").is_none() {
        skip(
            TEST,
            "ROLLBOX_VIRTIOFSD is not set (scripts/virtiofsd.sh builds virtiofsd and prints its path)",
        );
        return;
    }
    run_sdk_script(TEST, "2.63.0", false, "test_volumes.py");
}

/// A JSON request to the E2B listener (plain HTTP) with the key as `X-API-KEY`.
fn e2b_call(port: u16, method: &str, path: &str, body: Option<&str>) -> (u16, serde_json::Value) {
    let response = Endpoint::Tcp(format!("127.0.0.1:{port}"))
        .request(
            method,
            path,
            &[("X-API-KEY", KEY), ("Content-Type", "application/json")],
            body.map(str::as_bytes),
            Duration::from_secs(60),
        )
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    let value = if response.body.is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::from_slice(&response.body).unwrap_or_else(|e| {
            panic!(
                "{method} {path}: not JSON ({e}): {}",
                String::from_utf8_lossy(&response.body)
            )
        })
    };
    (response.status, value)
}

/// A JSON request to the daemon's native API.
fn native_call(
    daemon: &Daemon,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> (u16, serde_json::Value) {
    let auth = format!("Bearer {KEY}");
    let response = Endpoint::Unix(daemon.dir.path().join("d.sock"))
        .request(
            method,
            path,
            &[("Authorization", auth.as_str())],
            body.map(str::as_bytes),
            Duration::from_secs(60),
        )
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    let value = serde_json::from_slice(&response.body).unwrap_or(serde_json::Value::Null);
    (response.status, value)
}

/// E2B `envVars` are the daemon's sandbox `env`: native execs see them, and so do forks.
#[test]
fn e2b_env_vars_are_the_sandbox_env() {
    if !kvm_available() {
        return;
    }
    let (daemon, port) = start_daemon(tempfile::tempdir().expect("tempdir"), None, &[]);
    let (status, created) = e2b_call(
        port,
        "POST",
        "/v2/sandboxes",
        Some(r#"{"templateID":"guest","timeout":60,"envVars":{"GREETING":"hi there"}}"#),
    );
    assert_eq!(status, 201, "{created}\n{}", daemon.log());
    let id = created["sandboxID"]
        .as_str()
        .expect("sandboxID")
        .to_string();
    let (status, sandbox) = native_call(&daemon, "GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(status, 200, "{sandbox}");
    assert_eq!(
        sandbox["env"],
        json!({ "GREETING": "hi there" }),
        "{sandbox}"
    );
    let (status, ran) = native_call(
        &daemon,
        "POST",
        &format!("/sandboxes/{id}/exec"),
        Some(r#"{"cmd":"echo \"$GREETING\""}"#),
    );
    assert_eq!(status, 200, "{ran}");
    assert_eq!(ran["stdout"], "hi there\n", "{ran}");
    let (status, forks) = e2b_call(
        port,
        "POST",
        &format!("/sandboxes/{id}/fork"),
        Some(r#"{"count":1}"#),
    );
    assert_eq!(status, 201, "{forks}\n{}", daemon.log());
    let fork = forks[0]["sandbox"]["sandboxID"]
        .as_str()
        .unwrap_or_else(|| panic!("no fork: {forks}"));
    let (_, forked) = native_call(&daemon, "GET", &format!("/sandboxes/{fork}"), None);
    assert_eq!(forked["env"], json!({ "GREETING": "hi there" }), "{forked}");
}

/// E2B's `allow_internet_access` and `network.allowOut`/`denyOut` are the egress of the
/// sandbox's network (its template's), and the SDK's network update (`PUT
/// /sandboxes/{id}/network`) changes it; what rollbox cannot express is refused by field.
#[test]
fn e2b_network_options_are_the_sandbox_egress() {
    let test = "e2b_network_options_are_the_sandbox_egress";
    if !kvm_available() {
        return;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !std::path::Path::new("/dev/net/tun").exists() {
        return rollbox_tests::skip(
            test,
            "needs root and /dev/net/tun (taps and nftables rules)",
        );
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let net_dir = dir.path().join("net");
    let leases = rollbox_tests::daemon::NetLeases(net_dir.clone());
    let extra: Vec<String> = vec![
        "--net-pool".into(),
        "10.246.0.0/24".into(),
        "--net-state-dir".into(),
        net_dir.display().to_string(),
        // Where the resolver of a policy with domains asks (none answers: not needed here).
        "--resolver-upstream".into(),
        "127.0.0.1:53".into(),
    ];
    let (daemon, port) = start_daemon(dir, None, &extra);
    let template = json!({
        "name": "netguest", "kernel": test_guest(), "cmdline": TEST_GUEST_CMDLINE,
        "memory_mib": 32, "network": {"egress": "all"},
    });
    let (status, body) = native_call(&daemon, "POST", "/templates", Some(&template.to_string()));
    assert_eq!(status, 201, "{body}");
    let egress_of = |body: serde_json::Value| {
        let (status, created) = e2b_call(port, "POST", "/v2/sandboxes", Some(&body.to_string()));
        assert_eq!(status, 201, "{body}: {created}\n{}", daemon.log());
        let id = created["sandboxID"]
            .as_str()
            .expect("sandboxID")
            .to_string();
        let (_, sandbox) = native_call(&daemon, "GET", &format!("/sandboxes/{id}"), None);
        (id, sandbox["network"]["egress"].clone())
    };
    let (all, egress) = egress_of(json!({"templateID": "netguest", "timeout": 60}));
    assert_eq!(egress, "all");
    let (_, egress) =
        egress_of(json!({"templateID": "netguest", "timeout": 60, "allow_internet_access": false}));
    assert_eq!(egress, "none");
    let (_, egress) = egress_of(json!({
        "templateID": "netguest", "timeout": 60,
        "network": {"allowOut": ["198.51.100.0/24"], "denyOut": ["0.0.0.0/0"]},
    }));
    assert_eq!(egress, "198.51.100.0/24");
    // Domains are hostname entries: the sandbox's resolver on its gateway is its DNS server.
    let (domains, egress) = egress_of(json!({
        "templateID": "netguest", "timeout": 60,
        "network": {"allowOut": ["PyPI.org", "*.pythonhosted.org"], "denyOut": ["0.0.0.0/0"]},
    }));
    assert_eq!(egress, "pypi.org,*.pythonhosted.org");
    let (_, sandbox) = native_call(&daemon, "GET", &format!("/sandboxes/{domains}"), None);
    assert_eq!(
        sandbox["network"]["dns"], sandbox["network"]["gateway"],
        "{sandbox}"
    );
    // A template without a network: no internet either way, so nothing is made.
    let (plain, egress) =
        egress_of(json!({"templateID": "guest", "timeout": 60, "allow_internet_access": false}));
    assert_eq!(egress, serde_json::Value::Null);
    // The SDK's update: 204, and the native policy follows.
    let update = json!({"allowOut": ["192.0.2.1"], "denyOut": ["0.0.0.0/0"]}).to_string();
    let (status, body) = e2b_call(
        port,
        "PUT",
        &format!("/sandboxes/{all}/network"),
        Some(&update),
    );
    assert_eq!(status, 204, "{body}\n{}", daemon.log());
    let (_, sandbox) = native_call(&daemon, "GET", &format!("/sandboxes/{all}"), None);
    assert_eq!(sandbox["network"]["egress"], "192.0.2.1");
    for (id, body, want_status, want) in [
        (
            &all,
            json!({"denyOut": ["8.8.8.8"]}),
            400,
            "network.denyOut",
        ),
        (
            &all,
            json!({"allowOut": ["exa_mple.com"]}),
            400,
            "network.allowOut",
        ),
        // Created without domains: no resolver, so none can be added.
        (
            &all,
            json!({"allowOut": ["example.com"]}),
            409,
            "has no resolver",
        ),
        (
            &all,
            json!({"egressProxy": {"address": "socks5://x"}}),
            400,
            "network.egressProxy",
        ),
        (
            &plain,
            json!({"allowOut": ["192.0.2.1"]}),
            409,
            "has no network",
        ),
    ] {
        let (status, answer) = e2b_call(
            port,
            "PUT",
            &format!("/sandboxes/{id}/network"),
            Some(&body.to_string()),
        );
        assert_eq!(status, want_status, "{body}: {answer}");
        assert!(
            answer["message"]
                .as_str()
                .unwrap_or_default()
                .contains(want),
            "{body}: {answer}"
        );
    }
    let (_, list) = native_call(&daemon, "GET", "/sandboxes?limit=100", None);
    for sandbox in list["sandboxes"].as_array().cloned().unwrap_or_default() {
        let id = sandbox["id"].as_str().expect("id");
        native_call(&daemon, "DELETE", &format!("/sandboxes/{id}"), None);
    }
    assert!(
        rollbox::net::leases(&rollbox::net::StateDir::new(&leases.0))
            .expect("leases")
            .is_empty()
    );
}

/// The stock e2b-code-interpreter 2.11.5 `run_code` against rollbox: the SDK calls sandbox
/// port 49999, which the daemon reaches through the agent's `tcp_connect` to the guest's
/// 127.0.0.1:49999. The host agent's loopback is this machine's, so our server
/// (scripts/e2b-code-interpreter-server.py, an IPython kernel) listens here on 49999.
#[test]
fn stock_e2b_code_interpreter_2_11_against_rollbox() {
    let test = "stock_e2b_code_interpreter_2_11_against_rollbox";
    if !kvm_available() {
        return;
    }
    let python = match venv_python("scripts/e2b-ci-venv.sh", &["2.11.5"]) {
        Ok(python) => python,
        Err(reason) => {
            skip(test, &format!("no e2b-code-interpreter venv: {reason}"));
            return;
        }
    };
    if let Err(e) = std::net::TcpListener::bind(("127.0.0.1", CODE_INTERPRETER_PORT)) {
        panic!("127.0.0.1:{CODE_INTERPRETER_PORT} is taken ({e}): this test's code-interpreter server needs it, as the SDK always calls that sandbox port");
    }
    // Declared first, so it goes after the daemon (and the server with it).
    let kernels_cwd = tempfile::tempdir().expect("tempdir");
    let (mut daemon, port) = start_daemon(tempfile::tempdir().expect("tempdir"), None, &[]);
    let mut server = Command::new(&python)
        .arg(workspace_root().join("scripts/e2b-code-interpreter-server.py"))
        .args(["--port", &CODE_INTERPRETER_PORT.to_string(), "--cwd"])
        .arg(kernels_cwd.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the code-interpreter server");
    let stdout = server.stdout.take().expect("server stdout");
    // The daemon's drop ends it, whatever fails from here on.
    daemon.children.push(server);
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line)
        .expect("read the server's address");
    assert_eq!(
        line.trim(),
        format!("listening 127.0.0.1:{CODE_INTERPRETER_PORT}"),
        "the code-interpreter server did not say it listens"
    );
    let url = format!("http://127.0.0.1:{port}");
    let scratch = tempfile::tempdir().expect("scratch");
    // The code interpreter, then AReaL's and Harbor's call patterns (which use run_code too).
    for script in ["test_code_interpreter.py", "test_patterns.py"] {
        let output = e2b_script(&python, script, &url, KEY, "guest", scratch.path())
            .env("PYTHONFAULTHANDLER", "1")
            .output()
            .unwrap_or_else(|e| panic!("run {script}: {e}"));
        let stdout = String::from_utf8_lossy(&output.stdout);
        println!("{stdout}");
        assert!(
            output.status.success() && stdout.contains("all ok"),
            "{script} failed ({}):\n{stdout}\n{}\n--- serve.log ---\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr),
            daemon.log()
        );
    }
}

/// Figures, not asserts (docs/benchmarks.md): rollbox/tests/e2b/bench.py with the stock SDK
/// 2.63.0 over plain HTTP and the native API in the same run, at the concurrencies of
/// ROLLBOX_E2B_BENCH_CONCURRENCY (default 1,16,64). Run with `--ignored --nocapture`.
#[test]
#[ignore = "benchmark: prints figures"]
fn e2b_benchmark_figures() {
    let Some(python) = kvm_and_sdk("e2b_benchmark_figures", "2.63.0") else {
        return;
    };
    let (daemon, port) = start_daemon(tempfile::tempdir().expect("tempdir"), None, &[]);
    let scratch = tempfile::tempdir().expect("scratch");
    let url = format!("http://127.0.0.1:{port}");
    let status = e2b_script(&python, "bench.py", &url, KEY, "guest", scratch.path())
        .env("ROLLBOX_NATIVE_SOCKET", daemon.dir.path().join("d.sock"))
        .status()
        .expect("run bench.py");
    assert!(
        status.success(),
        "bench.py failed ({status})\n--- serve.log ---\n{}",
        daemon.log()
    );
}
