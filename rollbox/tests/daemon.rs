//! `rollbox serve` end to end: the real `rollbox` and `rollbox-vmm` binaries, with the tier-2
//! test guest as the template's kernel (tier 2: needs /dev/kvm).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rollbox::daemon::api::ROUTES;
use rollbox::daemon::client::{Endpoint, Response};
use rollbox::daemon::{cgroup, vm};
use rollbox_tests::{
    agent_binary, images, jailer_binary, kvm_available, rollbox_binary, test_guest, vmm_binary,
    vmm_wrapper, TEST_GUEST_CMDLINE,
};
use serde_json::{json, Value};

const KEY: &str = "test-key-0123";

/// A `rollbox serve` on a Unix socket in a scratch directory; on drop it is killed and every
/// VMM it left is ended.
struct Server {
    child: Option<Child>,
    dir: tempfile::TempDir,
    args: Vec<String>,
}

impl Server {
    fn start(extra: &[&str]) -> Server {
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

    fn sock(&self) -> PathBuf {
        self.dir.path().join("d.sock")
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    fn sandboxes_dir(&self) -> PathBuf {
        std::fs::canonicalize(self.state())
            .expect("state dir")
            .join("sandboxes")
    }

    fn spawn(&mut self) {
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
        let deadline = Instant::now() + Duration::from_secs(20);
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

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("serve.log")).unwrap_or_default()
    }

    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().expect("kill -9 the daemon");
            child.wait().expect("wait");
        }
    }

    fn raw(&self, method: &str, path: &str, key: Option<&str>, body: Option<&[u8]>) -> Response {
        let auth = key.map(|k| format!("Bearer {k}"));
        let headers: Vec<(&str, &str)> =
            auth.iter().map(|a| ("Authorization", a.as_str())).collect();
        Endpoint::Unix(self.sock())
            .request(method, path, &headers, body, Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("{method} {path}: {e}\n{}", self.log()))
    }

    fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let body = body.map(|b| b.to_string());
        let response = self.raw(method, path, Some(KEY), body.as_deref().map(str::as_bytes));
        let value = serde_json::from_slice(&response.body).unwrap_or(Value::Null);
        (response.status, value)
    }

    fn add_guest_template(&self, name: &str) {
        let (status, body) = self.call(
            "POST",
            "/templates",
            Some(json!({
                "name": name,
                "kernel": test_guest(),
                "cmdline": TEST_GUEST_CMDLINE,
                "memory_mib": 32,
            })),
        );
        assert_eq!(status, 201, "{body}");
    }

    fn create(&self, body: Value) -> Value {
        let (status, sandbox) = self.call("POST", "/sandboxes", Some(body));
        assert_eq!(status, 201, "{sandbox}\n{}", self.log());
        assert_eq!(sandbox["state"], "running", "{sandbox}");
        sandbox
    }

    fn get(&self, id: &str) -> Value {
        let (status, sandbox) = self.call("GET", &format!("/sandboxes/{id}"), None);
        assert_eq!(status, 200, "{sandbox}");
        sandbox
    }

    /// VMM processes (alive, not zombies) under this daemon's state directory.
    fn vmms(&self) -> Vec<vm::Found> {
        vm::find_vmms(&self.sandboxes_dir())
    }

    fn dirs(&self) -> BTreeSet<String> {
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
        if let Ok(dir) = std::fs::canonicalize(self.state()) {
            for found in vm::find_vmms(&dir.join("sandboxes")) {
                vm::kill(found.pid, found.start_time, Duration::from_secs(5));
            }
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

fn pid_of(sandbox: &Value) -> (u32, u64) {
    (
        u32::try_from(sandbox["pid"].as_u64().expect("pid")).expect("pid fits"),
        sandbox["pid_start_time"].as_u64().expect("start time"),
    )
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A `--vmm` that waits `secs` before it becomes rollbox-vmm: slow creates on demand.
fn slow_vmm(dir: &Path, secs: &str) -> PathBuf {
    vmm_wrapper(
        dir,
        &format!("slow-vmm-{secs}.sh"),
        &format!("sleep {secs}"),
    )
}

fn ids(list: &Value) -> Vec<String> {
    list["sandboxes"]
        .as_array()
        .expect("sandboxes")
        .iter()
        .map(|s| s["id"].as_str().expect("id").to_string())
        .collect()
}

#[test]
fn create_get_list_filter_paginate_and_delete() {
    if !kvm_available() {
        return;
    }
    let server = Server::start(&[]);
    server.add_guest_template("guest");
    let a = server
        .create(json!({"template": "guest", "ttl_s": 120, "labels": {"run": "r1", "idx": "0"}}));
    let b = server.create(json!({"template": "guest", "ttl_s": 120, "labels": {"run": "r1", "idx": "1"}, "metadata": {"note": "x"}}));
    let c = server.create(json!({"template": "guest", "ttl_s": 120, "labels": {"run": "r2"}, "vcpus": 2, "memory_mib": 48}));
    assert_eq!(
        (c["vcpus"].as_u64(), c["memory_mib"].as_u64()),
        (Some(2), Some(48))
    );
    let a_id = a["id"].as_str().expect("id");
    let got = server.get(a_id);
    assert_eq!(got["labels"]["run"], "r1");
    let (pid, start) = pid_of(&got);
    assert!(vm::is_ours(pid, start), "VMM of {a_id} is not running");
    let dir = PathBuf::from(got["dir"].as_str().expect("dir"));
    assert!(dir.join("api.sock").exists() && dir.join("console.log").exists());

    // Label filter and pages of one.
    let (status, all) = server.call("GET", "/sandboxes", None);
    assert_eq!(status, 200);
    assert_eq!(ids(&all).len(), 3);
    let mut seen = Vec::new();
    let mut path = "/sandboxes?label=run%3Dr1&limit=1".to_string();
    loop {
        let (status, page) = server.call("GET", &path, None);
        assert_eq!(status, 200, "{page}");
        let page_ids = ids(&page);
        assert!(page_ids.len() <= 1);
        seen.extend(page_ids);
        match page["next_page_token"].as_str() {
            Some(token) => path = format!("/sandboxes?label=run%3Dr1&limit=1&page_token={token}"),
            None => break,
        }
    }
    assert_eq!(seen, [a_id, b["id"].as_str().expect("id")]);
    let (_, both) = server.call("GET", "/sandboxes?label=run%3Dr1&label=idx%3D1", None);
    assert_eq!(ids(&both), [b["id"].as_str().expect("id")]);

    // Delete: the VMM and the directory go; twice, or an id never seen, is still success.
    let (status, _) = server.call("DELETE", &format!("/sandboxes/{a_id}"), None);
    assert_eq!(status, 204);
    assert!(!vm::is_ours(pid, start), "VMM survived DELETE");
    assert!(!dir.exists(), "{} survived DELETE", dir.display());
    assert_eq!(server.get(a_id)["state"], "deleted");
    for id in [a_id, "sb-00000000000000aa"] {
        let (status, body) = server.call("DELETE", &format!("/sandboxes/{id}"), None);
        assert_eq!(status, 204, "{body}");
    }
    let (_, running) = server.call("GET", "/sandboxes?state=running", None);
    assert_eq!(ids(&running).len(), 2);
    let (_, deleted) = server.call("GET", "/sandboxes?state=deleted", None);
    assert_eq!(ids(&deleted), [a_id]);

    // The CLI, for scripts (--json) and people (a table).
    let cli = |args: &[&str]| {
        let out = Command::new(rollbox_binary())
            .args(args)
            .arg("--socket")
            .arg(server.sock())
            .env("ROLLBOX_API_KEY", KEY)
            .output()
            .expect("run rollbox");
        assert!(
            out.status.success(),
            "rollbox {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let made: Value = serde_json::from_str(&cli(&[
        "sandbox", "create", "guest", "--ttl", "60", "--label", "run=cli", "--json",
    ]))
    .expect("create --json");
    let cli_id = made["id"].as_str().expect("id").to_string();
    let table = cli(&["sandbox", "ls", "--label", "run=cli"]);
    assert!(
        table.contains(&cli_id) && table.contains("running"),
        "{table}"
    );
    assert!(cli(&["template", "ls"]).contains("guest"));
    cli(&["sandbox", "rm", &cli_id]);
    assert_eq!(server.get(&cli_id)["state"], "deleted");

    // A VMM that cannot start: the create fails cleanly, naming why, and leaves nothing.
    let not_kernel = server.dir.path().join("not-a-kernel");
    std::fs::write(&not_kernel, "not a kernel\n").expect("write");
    let (status, body) = server.call(
        "POST",
        "/templates",
        Some(json!({"name": "broken", "kernel": not_kernel})),
    );
    assert_eq!(status, 201, "{body}");
    let (status, body) = server.call(
        "POST",
        "/sandboxes",
        Some(json!({"template": "broken", "ttl_s": 60})),
    );
    assert_eq!(status, 500, "{body}");
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("rollbox-vmm")),
        "{body}"
    );
    let (_, failed) = server.call("GET", "/sandboxes?state=failed", None);
    let failed = failed["sandboxes"].as_array().cloned().unwrap_or_default();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(failed[0]["end_reason"]
        .as_str()
        .is_some_and(|r| !r.is_empty()));
    let live: BTreeSet<String> = ids(&server.call("GET", "/sandboxes", None).1)
        .into_iter()
        .collect();
    assert_eq!(server.dirs(), live);
    let vmm_ids: BTreeSet<String> = server.vmms().into_iter().map(|f| f.id).collect();
    assert_eq!(vmm_ids, live);

    let out = Command::new(rollbox_binary())
        .args(["sandbox", "ls", "--socket"])
        .arg(server.dir.path().join("nobody.sock"))
        .env("ROLLBOX_API_KEY", KEY)
        .output()
        .expect("run rollbox");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("is `rollbox serve` running?"));
}

#[test]
fn idempotent_create_returns_the_first_sandbox_also_when_racing() {
    if !kvm_available() {
        return;
    }
    let server = Server::start(&[]);
    server.add_guest_template("guest");
    let body = json!({"template": "guest", "ttl_s": 60, "idempotency_key": "episode-1"});
    let first = server.create(body.clone());
    let (status, again) = server.call("POST", "/sandboxes", Some(body));
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["id"], first["id"]);

    // Eight racing creates with one new key: one VM, one 201, all the same id.
    let results: Vec<(u16, Value)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                scope.spawn(|| {
                    server.call(
                        "POST",
                        "/sandboxes",
                        Some(json!({"template": "guest", "ttl_s": 60, "idempotency_key": "race"})),
                    )
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    });
    let created = results.iter().filter(|(s, _)| *s == 201).count();
    assert_eq!(created, 1, "{results:?}");
    assert!(
        results.iter().all(|(s, _)| *s == 200 || *s == 201),
        "{results:?}"
    );
    let race_ids: BTreeSet<&str> = results
        .iter()
        .map(|(_, v)| v["id"].as_str().expect("id"))
        .collect();
    assert_eq!(race_ids.len(), 1, "{results:?}");
    let race_id = race_ids.into_iter().next().expect("one id").to_string();
    let vmms = server.vmms();
    assert_eq!(vmms.len(), 2, "{vmms:?}");
    assert_eq!(vmms.iter().filter(|f| f.id == race_id).count(), 1);
    assert_eq!(server.get(&race_id)["state"], "running");
}

#[test]
fn ttl_idle_ttl_and_keepalive() {
    if !kvm_available() {
        return;
    }
    let server = Server::start(&[]);
    server.add_guest_template("guest");
    // 6 s: the keepalive must land before it runs out, also on a loaded machine.
    let kept = server.create(json!({"template": "guest", "ttl_s": 6}));
    let kept_id = kept["id"].as_str().expect("id");
    let (status, extended) = server.call(
        "POST",
        &format!("/sandboxes/{kept_id}/keepalive"),
        Some(json!({"ttl_s": 60})),
    );
    assert_eq!(status, 200, "{extended}");
    assert!(extended["expires_at_ms"].as_u64() > kept["expires_at_ms"].as_u64());
    let kept_at = Instant::now();
    let hard = server.create(json!({"template": "guest", "ttl_s": 1}));
    let idle = server.create(json!({"template": "guest", "ttl_s": 60, "idle_ttl_s": 1}));
    for (sandbox, reason) in [(&hard, "ttl"), (&idle, "idle_ttl")] {
        let id = sandbox["id"].as_str().expect("id");
        let (pid, start) = pid_of(sandbox);
        let mut last = Value::Null;
        wait_for(&format!("{id} to expire"), Duration::from_secs(10), || {
            // Ask the list, not GET: a GET counts as activity for the idle TTL.
            let (_, list) = server.call("GET", "/sandboxes?state=expired", None);
            last = list["sandboxes"]
                .as_array()
                .and_then(|a| a.iter().find(|s| s["id"] == id).cloned())
                .unwrap_or(Value::Null);
            // The state flips first, then the reaper kills the VMM and removes the directory.
            !last.is_null()
                && !vm::is_ours(pid, start)
                && !PathBuf::from(last["dir"].as_str().unwrap_or("/")).exists()
        });
        assert!(
            last["end_reason"]
                .as_str()
                .is_some_and(|r| r.starts_with(reason)),
            "{last}"
        );
        assert!(!vm::is_ours(pid, start), "{id}: VMM outlived its {reason}");
        assert!(!PathBuf::from(last["dir"].as_str().expect("dir")).exists());
    }
    // Past its first TTL (6 s), the kept one still runs.
    std::thread::sleep(Duration::from_millis(6500).saturating_sub(kept_at.elapsed()));
    assert_eq!(server.get(kept_id)["state"], "running");
}

#[test]
fn pause_and_resume_through_the_vmm_api() {
    if !kvm_available() {
        return;
    }
    let server = Server::start(&[]);
    server.add_guest_template("guest");
    let sandbox = server.create(json!({"template": "guest", "ttl_s": 60}));
    let id = sandbox["id"].as_str().expect("id");
    let api_sock = PathBuf::from(sandbox["dir"].as_str().expect("dir")).join("api.sock");
    let vm_state = || {
        let r = Endpoint::Unix(api_sock.clone())
            .request("GET", "/", &[], None, Duration::from_secs(10))
            .expect("GET / on the VMM");
        serde_json::from_slice::<Value>(&r.body).expect("VMM json")["state"].clone()
    };
    let (status, paused) = server.call("POST", &format!("/sandboxes/{id}/pause"), None);
    assert_eq!(
        (status, paused["state"].as_str()),
        (200, Some("paused")),
        "{paused}"
    );
    assert_eq!(vm_state(), "Paused");
    // Pausing twice is fine; resuming a running one is fine; both say where it is.
    assert_eq!(
        server
            .call("POST", &format!("/sandboxes/{id}/pause"), None)
            .0,
        200
    );
    let (status, resumed) = server.call("POST", &format!("/sandboxes/{id}/resume"), None);
    assert_eq!(
        (status, resumed["state"].as_str()),
        (200, Some("running")),
        "{resumed}"
    );
    assert_eq!(vm_state(), "Running");
    server.call("DELETE", &format!("/sandboxes/{id}"), None);
    let (status, body) = server.call("POST", &format!("/sandboxes/{id}/pause"), None);
    assert_eq!(status, 409, "{body}");
}

#[test]
fn missing_or_wrong_key_is_401() {
    let server = Server::start(&[]);
    for key in [None, Some("wrong"), Some("")] {
        for (method, path) in [
            ("GET", "/sandboxes"),
            ("POST", "/sandboxes"),
            ("GET", "/nope"),
        ] {
            let response = server.raw(method, path, key, Some(b"{}"));
            assert_eq!(response.status, 401, "{method} {path} with {key:?}");
            assert!(response.error_message().contains("API key"));
            assert_eq!(response.header("www-authenticate"), Some("Bearer"));
        }
    }
    assert_eq!(server.raw("GET", "/healthz", Some(KEY), None).status, 200);
}

#[test]
fn serves_loopback_tcp_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let serve = |listen: &str| {
        Command::new(rollbox_binary())
            .args(["serve", "--listen", listen, "--state-dir"])
            .arg(dir.path().join("state"))
            .env("ROLLBOX_API_KEY", KEY)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn rollbox serve")
    };
    let refused = serve("0.0.0.0:0").wait_with_output().expect("wait");
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("not a loopback address"));

    // Port 0: the daemon names the port it got in its first line.
    let mut child = serve("127.0.0.1:0");
    let mut stderr = std::io::BufReader::new(child.stderr.take().expect("stderr"));
    let mut line = String::new();
    std::io::BufRead::read_line(&mut stderr, &mut line).expect("read");
    let url = line
        .trim()
        .rsplit(' ')
        .next()
        .filter(|u| u.starts_with("http://"))
        .unwrap_or_else(|| panic!("no URL in {line:?}"))
        .to_string();
    let endpoint = Endpoint::from_url(&url).expect("url");
    let auth = format!("Bearer {KEY}");
    let ok = endpoint
        .request(
            "GET",
            "/healthz",
            &[("Authorization", &auth)],
            None,
            Duration::from_secs(10),
        )
        .expect("GET /healthz");
    let no_key = endpoint
        .request("GET", "/healthz", &[], None, Duration::from_secs(10))
        .expect("GET /healthz");
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!((ok.status, no_key.status), (200, 401));
}

#[test]
fn bad_requests_get_4xx_naming_the_field() {
    let server = Server::start(&[]);
    server.add_guest_template("guest");
    let cases: Vec<(&str, &str, Value, u16, &str)> = vec![
        (
            "POST",
            "/sandboxes",
            json!({"template": "nosuch", "ttl_s": 5}),
            400,
            "template",
        ),
        (
            "POST",
            "/sandboxes",
            json!({"template": "guest", "ttl_s": 5, "memory_mib": -64}),
            400,
            "memory_mib",
        ),
        (
            "POST",
            "/sandboxes",
            json!({"template": "guest", "ttl_s": 5, "memory_mib": 0}),
            400,
            "memory_mib",
        ),
        (
            "POST",
            "/sandboxes",
            json!({"template": "guest", "ttl_s": 5, "labels": {"no spaces": "x"}}),
            400,
            "labels",
        ),
        (
            "POST",
            "/sandboxes",
            json!({"template": "guest", "ttl_s": 5, "labels": {"k": ["x"]}}),
            400,
            "labels.k",
        ),
        (
            "POST",
            "/sandboxes",
            json!({"template": "guest", "ttl_s": 5, "colour": "red"}),
            400,
            "colour",
        ),
        (
            "POST",
            "/sandboxes",
            json!({"template": "guest"}),
            400,
            "ttl_s",
        ),
        (
            "POST",
            "/sandboxes",
            json!({"template": "guest", "ttl_s": -1}),
            400,
            "ttl_s",
        ),
        ("GET", "/sandboxes/not-an-id", Value::Null, 400, "id"),
        ("DELETE", "/sandboxes/sb-123", Value::Null, 400, "id"),
        ("GET", "/sandboxes?state=zombie", Value::Null, 400, "state"),
        ("GET", "/sandboxes?label=nokey", Value::Null, 400, "label"),
        (
            "GET",
            "/sandboxes/sb-00000000000000aa",
            Value::Null,
            404,
            "sb-00000000000000aa",
        ),
        (
            "POST",
            "/templates",
            json!({"name": "t2", "kernel": "/no/such/kernel"}),
            400,
            "kernel",
        ),
        (
            "POST",
            "/templates",
            json!({"name": "t2", "kernel": test_guest(), "memory_mib": -1}),
            400,
            "memory_mib",
        ),
        (
            "POST",
            "/templates",
            json!({"name": "guest", "kernel": test_guest()}),
            409,
            "name",
        ),
        ("PUT", "/sandboxes", Value::Null, 405, "PUT"),
        ("GET", "/nope", Value::Null, 404, "no route"),
    ];
    for (method, path, body, status, needle) in cases {
        let body = (!body.is_null()).then_some(body);
        let (got, answer) = server.call(method, path, body.clone());
        let error = answer["error"].as_str().unwrap_or_default();
        assert_eq!(got, status, "{method} {path} {body:?}: {answer}");
        assert!(
            error.contains(needle),
            "{method} {path} {body:?}: {error:?} does not name {needle}"
        );
    }
    let big = vec![b'x'; 2 << 20];
    let response = server.raw("POST", "/sandboxes", Some(KEY), Some(&big));
    assert_eq!(response.status, 413);
    assert!(
        response.error_message().contains("body"),
        "{}",
        response.error_message()
    );
    let response = server.raw("POST", "/sandboxes", Some(KEY), Some(b"{not json"));
    assert_eq!(response.status, 400);
    // Nothing above started a VMM.
    assert!(server.vmms().is_empty());
}

#[test]
fn over_the_pending_limit_is_429_with_retry_after() {
    if !kvm_available() {
        return;
    }
    let scratch = tempfile::tempdir().expect("tempdir");
    let slow = slow_vmm(scratch.path(), "1");
    let server = Server::start(&[
        "--max-pending-creates",
        "1",
        // A shell-script stand-in for the VMM cannot run in a jail (no shell there).
        "--no-jailer",
        "--vmm",
        slow.to_str().expect("utf-8"),
    ]);
    server.add_guest_template("guest");
    let results: Vec<Response> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4)
            .map(|i| {
                let server = &server;
                scope.spawn(move || {
                    // Stagger a little so the first one is surely in flight.
                    std::thread::sleep(Duration::from_millis(100 * i));
                    let body = json!({"template": "guest", "ttl_s": 30}).to_string();
                    server.raw("POST", "/sandboxes", Some(KEY), Some(body.as_bytes()))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    });
    let statuses: Vec<u16> = results.iter().map(|r| r.status).collect();
    assert_eq!(
        statuses.iter().filter(|s| **s == 201).count(),
        1,
        "{statuses:?}"
    );
    for r in results.iter().filter(|r| r.status == 429) {
        assert_eq!(r.header("retry-after"), Some("1"));
        assert!(r.error_message().contains("in flight"));
    }
    assert_eq!(
        statuses.iter().filter(|s| **s == 429).count(),
        3,
        "{statuses:?}"
    );
    // Once it finished, a create goes through again.
    let (status, body) = server.call(
        "POST",
        "/sandboxes",
        Some(json!({"template": "guest", "ttl_s": 30})),
    );
    assert_eq!(status, 201, "{body}");
}

#[test]
fn kill_9_mid_batch_then_restart_loses_and_leaks_nothing() {
    if !kvm_available() {
        return;
    }
    let scratch = tempfile::tempdir().expect("tempdir");
    let slow = slow_vmm(scratch.path(), "0.2");
    // A shell-script stand-in for the VMM cannot run in a jail (no shell there).
    let mut server = Server::start(&["--no-jailer", "--vmm", slow.to_str().expect("utf-8")]);
    server.add_guest_template("guest");
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        for worker in 0..3 {
            let (server, stop) = (&server, &stop);
            scope.spawn(move || {
                let mut n = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let body = json!({"template": "guest", "ttl_s": 10, "labels": {"w": worker.to_string()}, "idempotency_key": format!("{worker}-{n}")}).to_string();
                    let sock = server.sock();
                    // The daemon dies under some of these: errors are expected.
                    let _ = Endpoint::Unix(sock).request(
                        "POST",
                        "/sandboxes",
                        &[("Authorization", &format!("Bearer {KEY}"))],
                        Some(body.as_bytes()),
                        Duration::from_secs(30),
                    );
                    n += 1;
                }
            });
        }
        std::thread::sleep(Duration::from_millis(1100));
        // SIGKILL: nothing of the daemon runs after this.
        let pid = server.child.as_ref().map(|c| c.id()).expect("daemon pid");
        let (_, live) = server.call("GET", "/sandboxes", None);
        assert!(
            !ids(&live).is_empty(),
            "no sandbox was created before the kill"
        );
        let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    server.kill9();
    server.spawn();

    let all = |state: &str| {
        let (status, list) =
            server.call("GET", &format!("/sandboxes?state={state}&limit=1000"), None);
        assert_eq!(status, 200);
        list["sandboxes"].as_array().cloned().unwrap_or_default()
    };
    let running = all("running");
    let failed = all("failed");
    assert!(
        all("creating").is_empty(),
        "a create is stuck after the restart"
    );
    eprintln!(
        "after the restart: {} running (re-attached), {} failed",
        running.len(),
        failed.len()
    );
    assert!(!running.is_empty(), "no sandbox survived: {}", server.log());
    for sandbox in &running {
        let (pid, start) = pid_of(sandbox);
        assert!(vm::is_ours(pid, start), "running {sandbox} has no VMM");
    }
    for sandbox in &failed {
        assert!(
            sandbox["end_reason"]
                .as_str()
                .is_some_and(|r| !r.is_empty()),
            "{sandbox}"
        );
        assert!(!PathBuf::from(sandbox["dir"].as_str().expect("dir")).exists());
    }
    let running_ids: BTreeSet<String> = running
        .iter()
        .map(|s| s["id"].as_str().expect("id").to_string())
        .collect();
    let vmm_ids: BTreeSet<String> = server.vmms().into_iter().map(|f| f.id).collect();
    assert_eq!(vmm_ids, running_ids, "VMMs the DB does not know (or lost)");
    assert_eq!(
        server.dirs(),
        running_ids,
        "directories the DB does not know"
    );

    // The restarted daemon still enforces their TTLs (10 s: long enough that none expires
    // during the checks above on a loaded machine).
    wait_for(
        "the re-attached sandboxes to expire",
        Duration::from_secs(30),
        // The reaper records the end, then removes the directory.
        || server.vmms().is_empty() && all("running").is_empty() && server.dirs().is_empty(),
    );
    assert_eq!(all("expired").len() + all("exited").len(), running.len());
}

#[test]
fn openapi_document_matches_the_routes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let text = std::fs::read_to_string(root.join("docs/api/openapi.yaml")).expect("openapi.yaml");
    let doc: serde_yaml::Value = serde_yaml::from_str(&text).expect("parse openapi.yaml");
    assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.")));
    let mut documented = BTreeSet::new();
    for (path, item) in doc["paths"].as_mapping().expect("paths") {
        let path = path.as_str().expect("path").to_string();
        for (method, _) in item.as_mapping().expect("path item") {
            let method = method.as_str().expect("method");
            if ["get", "post", "put", "patch", "delete"].contains(&method) {
                documented.insert((method.to_uppercase(), path.clone()));
            }
        }
    }
    let served: BTreeSet<(String, String)> = ROUTES
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    assert_eq!(
        documented, served,
        "docs/api/openapi.yaml and api::ROUTES differ"
    );

    // And the live server answers each of them (never 404 "no route" or 405).
    let server = Server::start(&[]);
    for (method, path) in &served {
        let path = path
            .replace("{id}", "sb-00000000000000aa")
            .replace("{name}", "nosuch");
        let response = server.raw(method, &path, Some(KEY), Some(b"{}"));
        assert_ne!(response.status, 405, "{method} {path}");
        assert!(
            !response.error_message().contains("no route"),
            "{method} {path}: {}",
            response.error_message()
        );
    }
}

/// A host `rollbox-agent --listen-unix`: the fast tests' stand-in for a guest's agent (the test
/// guest has none), behind the same hybrid-vsock `CONNECT 1024` socket.
struct HostAgent {
    child: Child,
    sock: PathBuf,
    _dir: tempfile::TempDir,
}

impl HostAgent {
    fn start() -> HostAgent {
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = dir.path().join("agent.sock");
        let child = Command::new(agent_binary())
            .arg("--listen-unix")
            .arg(&sock)
            .args(["--no-init", "--no-set-clock", "--no-generation-watch"])
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

/// A daemon whose sandboxes' agent traffic goes to a host agent, and one running sandbox.
fn agent_server() -> (HostAgent, Server, String) {
    let agent = HostAgent::start();
    let sock = agent.sock.display().to_string();
    let server = Server::start(&["--test-agent-socket", &sock]);
    server.add_guest_template("guest");
    let sandbox = server.create(json!({"template": "guest", "ttl_s": 300}));
    let id = sandbox["id"].as_str().expect("id").to_string();
    (agent, server, id)
}

fn exec(server: &Server, id: &str, body: Value) -> Value {
    let (status, result) = server.call("POST", &format!("/sandboxes/{id}/exec"), Some(body));
    assert_eq!(status, 200, "{result}\n{}", server.log());
    result
}

/// A streaming exec: the response, read line by line.
fn exec_stream(
    server: &Server,
    id: &str,
    body: Value,
) -> std::io::BufReader<rollbox::daemon::client::Streaming> {
    let text = body.to_string();
    let auth = format!("Bearer {KEY}");
    let response = Endpoint::Unix(server.sock())
        .open(
            "POST",
            &format!("/sandboxes/{id}/exec?stream=true"),
            &[("Authorization", &auth)],
            Some((&mut text.as_bytes(), text.len() as u64)),
            Duration::from_secs(60),
        )
        .expect("streaming exec");
    assert_eq!(response.status, 200);
    assert_eq!(
        response
            .headers
            .iter()
            .find(|(n, _)| n == "content-type")
            .map(|(_, v)| v.as_str()),
        Some("application/x-ndjson")
    );
    std::io::BufReader::new(response)
}

fn next_line(lines: &mut impl std::io::BufRead) -> Value {
    let mut line = String::new();
    lines.read_line(&mut line).expect("read a line");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?}: {e}"))
}

#[test]
fn exec_runs_through_the_agent_unary_and_streaming_with_signals() {
    if !kvm_available() {
        return;
    }
    let (_agent, server, id) = agent_server();
    let scratch = tempfile::tempdir().expect("tempdir");
    let cwd = scratch.path().display().to_string();

    let result = exec(
        &server,
        &id,
        json!({"cmd": ["sh", "-c", "echo out; echo err >&2; exit 3"]}),
    );
    assert_eq!(
        (&result["exit_code"], &result["stdout"], &result["stderr"]),
        (&json!(3), &json!("out\n"), &json!("err\n")),
        "{result}"
    );
    assert_eq!(result["stdout_encoding"], "utf-8");
    assert_eq!(
        (&result["timed_out"], &result["oom"], &result["truncated"]),
        (&json!(false), &json!(false), &json!(false))
    );

    // A shell string, stdin, env and cwd.
    let result = exec(
        &server,
        &id,
        json!({"cmd": "cat; echo $FOO; pwd", "stdin": "in\n", "env": {"FOO": "bar"}, "cwd": cwd}),
    );
    assert_eq!(result["stdout"], format!("in\nbar\n{cwd}\n"), "{result}");
    // Bytes that are not UTF-8 come as base64.
    let result = exec(&server, &id, json!({"cmd": "printf '\\377\\000'"}));
    assert_eq!(
        (&result["stdout"], &result["stdout_encoding"]),
        (&json!("/wA="), &json!("base64")),
        "{result}"
    );
    // Timeout and output cap.
    let result = exec(
        &server,
        &id,
        json!({"cmd": ["sleep", "30"], "timeout_s": 0.3}),
    );
    assert_eq!(result["timed_out"], true, "{result}");
    let result = exec(
        &server,
        &id,
        json!({"cmd": "head -c 100000 /dev/zero", "max_output_bytes": 1000}),
    );
    assert_eq!(result["truncated"], true, "{result}");
    assert!(result["stdout"].as_str().expect("stdout").len() <= 1000);
    // A program that does not exist is the agent's refusal, not a 200.
    let (status, body) = server.call(
        "POST",
        &format!("/sandboxes/{id}/exec"),
        Some(json!({"cmd": ["/nonexistent/prog"]})),
    );
    assert!((400..500).contains(&status), "{status} {body}");
    let (status, body) = server.call(
        "POST",
        &format!("/sandboxes/{id}/exec"),
        Some(json!({"cmd": ["ls"], "cwd": "tmp"})),
    );
    assert_eq!(status, 400);
    assert!(
        body["error"].as_str().expect("error").contains("cwd"),
        "{body}"
    );

    // Streaming: sequence numbers from 0, started, output, exit.
    let mut lines = exec_stream(
        &server,
        &id,
        json!({"cmd": "echo a; echo b >&2; echo c; exit 5"}),
    );
    let mut seq = 0;
    let mut stdout = String::new();
    let mut stderr = String::new();
    loop {
        let line = next_line(&mut lines);
        assert_eq!(line["seq"], seq, "{line}");
        seq += 1;
        match line["type"].as_str().expect("type") {
            "started" => assert!(line["pid"].as_u64().is_some_and(|p| p > 0)),
            "stdout" => stdout.push_str(line["data"].as_str().expect("data")),
            "stderr" => stderr.push_str(line["data"].as_str().expect("data")),
            "exit" => {
                assert_eq!(line["exit_code"], 5, "{line}");
                break;
            }
            other => panic!("unexpected line type {other}: {line}"),
        }
    }
    assert_eq!((stdout.as_str(), stderr.as_str()), ("a\nc\n", "b\n"));

    // Signals reach a process of a running streaming exec.
    let mut lines = exec_stream(&server, &id, json!({"cmd": ["sleep", "30"]}));
    let started = next_line(&mut lines);
    assert_eq!(started["type"], "started", "{started}");
    let pid = started["pid"].as_u64().expect("pid");
    let (status, body) = server.call(
        "POST",
        &format!("/sandboxes/{id}/processes/{pid}/signal"),
        Some(json!({"signal": "TERM"})),
    );
    assert_eq!(status, 204, "{body}");
    let exit = next_line(&mut lines);
    assert_eq!(
        (&exit["type"], &exit["signal"]),
        (&json!("exit"), &json!(15)),
        "{exit}"
    );
    let (status, body) = server.call(
        "POST",
        &format!("/sandboxes/{id}/processes/{pid}/signal"),
        Some(json!({"signal": 9})),
    );
    assert_eq!(status, 404, "{body}");

    // The CLI streams and exits with the command's status.
    let output = Command::new(rollbox_binary())
        .args(["sandbox", "exec", "--socket"])
        .arg(server.sock())
        .arg("--api-key-file")
        .arg(server.dir.path().join("key"))
        .args([&id, "--", "sh", "-c", "echo hi; echo oops >&2; exit 7"])
        .output()
        .expect("rollbox sandbox exec");
    assert_eq!(output.status.code(), Some(7), "{output:?}");
    assert_eq!(output.stdout, b"hi\n");
    assert_eq!(output.stderr, b"oops\n");

    // A paused sandbox takes no exec.
    let (status, _) = server.call("POST", &format!("/sandboxes/{id}/pause"), None);
    assert_eq!(status, 200);
    let (status, body) = server.call(
        "POST",
        &format!("/sandboxes/{id}/exec"),
        Some(json!({"cmd": ["true"]})),
    );
    assert_eq!(status, 409, "{body}");
}

fn put(server: &Server, path: &str, data: &[u8]) -> Response {
    let auth = format!("Bearer {KEY}");
    let mut source = data;
    Endpoint::Unix(server.sock())
        .open(
            "PUT",
            path,
            &[("Authorization", &auth)],
            Some((&mut source, data.len() as u64)),
            Duration::from_secs(60),
        )
        .expect("PUT")
        .into_response()
        .expect("PUT answer")
}

fn enc(path: &Path) -> String {
    path.display()
        .to_string()
        .replace('%', "%25")
        .replace(' ', "%20")
}

#[test]
fn files_upload_download_stat_list_remove_and_tar() {
    if !kvm_available() {
        return;
    }
    let (_agent, server, id) = agent_server();
    let scratch = tempfile::tempdir().expect("tempdir");
    let root = scratch.path();
    let file = root.join("a/b.txt");

    let response = put(
        &server,
        &format!(
            "/sandboxes/{id}/files?path={}&parents=true&mode=600",
            enc(&file)
        ),
        b"hello",
    );
    assert_eq!(response.status, 201, "{}", response.error_message());
    let written: Value = serde_json::from_slice(&response.body).expect("json");
    assert_eq!(written["bytes"], 5);
    assert_eq!(std::fs::read(&file).expect("uploaded"), b"hello");
    let response = server.raw(
        "GET",
        &format!("/sandboxes/{id}/files?path={}", enc(&file)),
        Some(KEY),
        None,
    );
    assert_eq!(
        (response.status, response.body.as_slice()),
        (200, &b"hello"[..])
    );
    // A larger binary file streams both ways intact.
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let big_path = root.join("big.bin");
    let response = put(
        &server,
        &format!("/sandboxes/{id}/files?path={}", enc(&big_path)),
        &big,
    );
    assert_eq!(response.status, 201, "{}", response.error_message());
    let response = server.raw(
        "GET",
        &format!("/sandboxes/{id}/files?path={}", enc(&big_path)),
        Some(KEY),
        None,
    );
    assert!(
        response.body == big,
        "download of {} bytes differs",
        big.len()
    );

    let (status, info) = server.call(
        "GET",
        &format!("/sandboxes/{id}/files/stat?path={}", enc(&file)),
        None,
    );
    assert_eq!(status, 200, "{info}");
    assert_eq!(
        (&info["kind"], &info["size"], &info["mode"]),
        (&json!("file"), &json!(5), &json!(0o600)),
        "{info}"
    );
    let (status, list) = server.call(
        "GET",
        &format!("/sandboxes/{id}/files/list?path={}", enc(&root.join("a"))),
        None,
    );
    assert_eq!(status, 200, "{list}");
    assert_eq!(list["entries"][0]["name"], "b.txt", "{list}");

    // Tar: upload unpacks into a directory, download packs one.
    let mut archive = tar::Builder::new(Vec::new());
    let mut header = tar::Header::new_gnu();
    header.set_size(3);
    header.set_mode(0o644);
    header.set_cksum();
    archive
        .append_data(&mut header, "x/y.txt", &b"yyy"[..])
        .expect("tar");
    let data = archive.into_inner().expect("tar");
    let unpacked = root.join("t");
    let response = put(
        &server,
        &format!("/sandboxes/{id}/tar?path={}", enc(&unpacked)),
        &data,
    );
    assert_eq!(response.status, 201, "{}", response.error_message());
    assert_eq!(
        std::fs::read(unpacked.join("x/y.txt")).expect("unpacked"),
        b"yyy"
    );
    let response = server.raw(
        "GET",
        &format!("/sandboxes/{id}/tar?path={}", enc(&unpacked)),
        Some(KEY),
        None,
    );
    assert_eq!(response.status, 200);
    let names: Vec<String> = tar::Archive::new(response.body.as_slice())
        .entries()
        .expect("entries")
        .map(|e| {
            e.expect("entry")
                .path()
                .expect("path")
                .display()
                .to_string()
        })
        .collect();
    assert!(names.iter().any(|n| n.ends_with("x/y.txt")), "{names:?}");

    // Remove, then it is gone.
    let (status, _) = server.call(
        "DELETE",
        &format!(
            "/sandboxes/{id}/files?path={}&recursive=true",
            enc(&root.join("a"))
        ),
        None,
    );
    assert_eq!(status, 204);
    let (status, body) = server.call(
        "GET",
        &format!("/sandboxes/{id}/files/stat?path={}", enc(&file)),
        None,
    );
    assert_eq!(status, 404, "{body}");
    let response = server.raw(
        "GET",
        &format!("/sandboxes/{id}/files?path={}", enc(&file)),
        Some(KEY),
        None,
    );
    assert_eq!(response.status, 404);

    // Bad paths name the field; an upload over the cap is 413.
    for (query, word) in [
        ("path=etc/passwd", "relative"),
        ("path=/tmp/../../etc/passwd", "escapes"),
        ("", "path"),
    ] {
        let (status, body) = server.call("GET", &format!("/sandboxes/{id}/files?{query}"), None);
        assert_eq!(status, 400, "{query}: {body}");
        assert!(
            body["error"].as_str().expect("error").contains(word),
            "{query}: {body}"
        );
    }
    let auth = format!("Bearer {KEY}");
    let huge = Endpoint::Unix(server.sock())
        .open(
            "PUT",
            &format!("/sandboxes/{id}/files?path={}", enc(&root.join("huge"))),
            &[("Authorization", &auth)],
            Some((&mut &b"tiny"[..], 300 << 20)),
            Duration::from_secs(60),
        )
        .expect("PUT")
        .into_response()
        .expect("answer");
    assert_eq!(huge.status, 413, "{}", huge.error_message());
    assert!(!root.join("huge").exists());

    // `rollbox sandbox cp`, both ways, a file and a directory.
    let cli = |args: &[&str]| {
        let output = Command::new(rollbox_binary())
            .args(["sandbox", "--socket"])
            .arg(server.sock())
            .arg("--api-key-file")
            .arg(server.dir.path().join("key"))
            .args(args)
            .output()
            .expect("rollbox sandbox");
        assert!(output.status.success(), "{args:?}: {output:?}");
    };
    let host = tempfile::tempdir().expect("tempdir");
    std::fs::write(host.path().join("in.txt"), b"cp in").expect("write");
    std::fs::create_dir_all(host.path().join("tree/sub")).expect("mkdir");
    std::fs::write(host.path().join("tree/sub/leaf"), b"leaf").expect("write");
    let inside = root.join("cp");
    let host_in = host.path().join("in.txt").display().to_string();
    cli(&["cp", &host_in, &format!("{id}:{}/", inside.display())]);
    assert_eq!(
        std::fs::read(inside.join("in.txt")).expect("cp in"),
        b"cp in"
    );
    let tree = host.path().join("tree").display().to_string();
    cli(&[
        "cp",
        &tree,
        &format!("{id}:{}", inside.join("tree").display()),
    ]);
    assert_eq!(
        std::fs::read(inside.join("tree/sub/leaf")).expect("cp dir in"),
        b"leaf"
    );
    let back = host.path().join("back");
    cli(&[
        "cp",
        &format!("{id}:{}", inside.display()),
        &back.display().to_string(),
    ]);
    assert_eq!(
        std::fs::read(back.join("in.txt")).expect("cp dir out"),
        b"cp in"
    );
    assert_eq!(
        std::fs::read(back.join("tree/sub/leaf")).expect("cp dir out"),
        b"leaf"
    );
    let one = host.path().join("one.txt");
    cli(&[
        "cp",
        &format!("{id}:{}", inside.join("in.txt").display()),
        &one.display().to_string(),
    ]);
    assert_eq!(std::fs::read(&one).expect("cp file out"), b"cp in");
}

/// The VMM's own view of its VM (`GET /` on its API socket): state "Running" or "Paused".
fn vmm_state(sandbox: &Value) -> String {
    let dir = PathBuf::from(sandbox["dir"].as_str().expect("dir"));
    let response = Endpoint::Unix(dir.join("api.sock"))
        .request("GET", "/", &[], None, Duration::from_secs(10))
        .expect("GET / on the VMM");
    let info: Value = serde_json::from_slice(&response.body).expect("json");
    info["state"].as_str().unwrap_or("").to_string()
}

fn console(sandbox: &Value) -> String {
    let dir = PathBuf::from(sandbox["dir"].as_str().expect("dir"));
    std::fs::read_to_string(dir.join("console.log")).unwrap_or_default()
}

/// The command line of a running process.
fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

#[test]
fn snapshot_restore_fork_and_reset() {
    if !kvm_available() {
        return;
    }
    let server = Server::start(&[]);
    server.add_guest_template("guest");
    let sandbox = server.create(json!({"template": "guest", "ttl_s": 300}));
    let id = sandbox["id"].as_str().expect("id").to_string();
    wait_for(
        "the test guest's ready line",
        Duration::from_secs(30),
        || console(&sandbox).contains("rollbox-test-guest: ready"),
    );

    // A snapshot leaves the sandbox running.
    let (status, snap) = server.call("POST", &format!("/sandboxes/{id}/snapshots"), None);
    assert_eq!(status, 201, "{snap}\n{}", server.log());
    let snap_id = snap["id"].as_str().expect("snapshot id").to_string();
    assert_eq!(
        (&snap["sandbox"], &snap["parent"]),
        (&json!(id), &Value::Null),
        "{snap}"
    );
    let snap_dir = PathBuf::from(snap["dir"].as_str().expect("dir"));
    assert!(snap_dir.join("vmstate").is_file() && snap_dir.join("memory").is_file());
    assert_eq!(server.get(&id)["state"], "running");
    assert_eq!(vmm_state(&sandbox), "Running");
    let (status, list) = server.call("GET", &format!("/snapshots?sandbox={id}"), None);
    assert_eq!(status, 200);
    assert_eq!(list["snapshots"][0]["id"], snap_id.as_str(), "{list}");

    // Create from the snapshot: a restore (the guest does not boot again), with a parent chain.
    let restored = server.create(json!({"snapshot": snap_id, "ttl_s": 300}));
    let restored_id = restored["id"].as_str().expect("id").to_string();
    assert_eq!(restored["template"], "guest");
    let (pid, _) = pid_of(&restored);
    assert!(cmdline(pid).contains("--restore"), "{}", cmdline(pid));
    assert_eq!(vmm_state(&restored), "Running");
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !console(&restored).contains("ready"),
        "the restored guest booted: {}",
        console(&restored)
    );
    let (status, child_snap) = server.call(
        "POST",
        &format!("/sandboxes/{restored_id}/snapshots"),
        Some(json!({"stop": true})),
    );
    assert_eq!(status, 201, "{child_snap}");
    assert_eq!(child_snap["parent"], snap_id.as_str(), "{child_snap}");
    assert_eq!(server.get(&restored_id)["state"], "deleted");
    let (status, body) = server.call(
        "POST",
        "/sandboxes",
        Some(json!({"snapshot": "snap-00000000000000ff", "ttl_s": 30})),
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"].as_str().expect("error").contains("snapshot"),
        "{body}"
    );

    // Fork into 3: each is its own running sandbox.
    let (status, forked) = server.call(
        "POST",
        &format!("/sandboxes/{id}/fork"),
        Some(json!({"count": 3, "labels": {"fork": "1"}})),
    );
    assert_eq!(status, 200, "{forked}\n{}", server.log());
    let results = forked["results"].as_array().expect("results");
    assert_eq!(results.len(), 3);
    let mut fork_pids = BTreeSet::new();
    for result in results {
        assert_eq!(result["error"], Value::Null, "{result}");
        let child = &result["sandbox"];
        assert_eq!(
            (
                &child["state"],
                &child["labels"]["fork"],
                &child["metadata"]["forked_from"]
            ),
            (&json!("running"), &json!("1"), &json!(id)),
            "{child}"
        );
        let (pid, start) = pid_of(child);
        assert!(vm::is_ours(pid, start));
        fork_pids.insert(pid);
        assert_eq!(vmm_state(child), "Running");
    }
    assert_eq!(fork_pids.len(), 3);
    assert_eq!(server.get(&id)["state"], "running");

    // Reset: same id, a new VMM restored from the given snapshot.
    let before = pid_of(&server.get(&id));
    let (status, reset) = server.call(
        "POST",
        &format!("/sandboxes/{id}/reset"),
        Some(json!({"snapshot": snap_id})),
    );
    assert_eq!(status, 200, "{reset}\n{}", server.log());
    assert_eq!(
        (&reset["id"], &reset["state"]),
        (&json!(id), &json!("running"))
    );
    let after = pid_of(&reset);
    assert_ne!(after, before);
    assert!(!vm::is_ours(before.0, before.1), "the old VMM still runs");
    assert!(cmdline(after.0).contains("--restore"));
    assert_eq!(vmm_state(&reset), "Running");
    // The reaper does not take the reset for an exit.
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(server.get(&id)["state"], "running");
    // Without a snapshot it goes back to the one it came from now.
    let (status, again) = server.call("POST", &format!("/sandboxes/{id}/reset"), Some(json!({})));
    assert_eq!(status, 200, "{again}");
    assert_ne!(pid_of(&again), after);
    // A sandbox that came from no snapshot resets by booting afresh.
    let fresh = server.create(json!({"template": "guest", "ttl_s": 300}));
    let fresh_id = fresh["id"].as_str().expect("id");
    let (status, rebooted) = server.call("POST", &format!("/sandboxes/{fresh_id}/reset"), None);
    assert_eq!(status, 200, "{rebooted}");
    wait_for(
        "the rebooted guest's ready line",
        Duration::from_secs(30),
        || console(&rebooted).contains("rollbox-test-guest: ready"),
    );

    // Delete a snapshot: its files go; deleting it again is success.
    let (status, _) = server.call("DELETE", &format!("/snapshots/{snap_id}"), None);
    assert_eq!(status, 204);
    assert!(!snap_dir.exists());
    let (status, _) = server.call("DELETE", &format!("/snapshots/{snap_id}"), None);
    assert_eq!(status, 204);
    let (status, _) = server.call("GET", &format!("/snapshots/{snap_id}"), None);
    assert_eq!(status, 404);

    // The CLI: snapshot, create --snapshot, fork, reset.
    let cli = |args: &[&str]| -> String {
        let output = Command::new(rollbox_binary())
            .args(["sandbox", "--socket"])
            .arg(server.sock())
            .arg("--api-key-file")
            .arg(server.dir.path().join("key"))
            .args(args)
            .output()
            .expect("rollbox sandbox");
        assert!(output.status.success(), "{args:?}: {output:?}");
        String::from_utf8_lossy(&output.stdout).trim().to_string()
    };
    let snap = cli(&["snapshot", &id]);
    assert!(snap.starts_with("snap-"), "{snap}");
    assert!(cli(&["snapshots", "--sandbox", &id]).contains(&snap));
    let restored = cli(&["--json", "create", "--snapshot", &snap, "--ttl", "60"]);
    let restored: Value = serde_json::from_str(&restored).expect("json");
    assert_eq!(restored["state"], "running");
    let forks = cli(&["fork", &id, "--count", "2"]);
    assert_eq!(
        forks.lines().filter(|l| l.starts_with("sb-")).count(),
        2,
        "{forks}"
    );
    assert!(cli(&["reset", &id, "--snapshot", &snap]).contains("reset"));
    cli(&["snapshot-rm", &snap]);
}

#[test]
fn snapshots_carry_the_rootfs_and_restores_get_their_own_copy() {
    if !kvm_available() {
        return;
    }
    let server = Server::start(&[]);
    let image = server.dir.path().join("rootfs.img");
    std::fs::write(&image, vec![7u8; 1 << 20]).expect("write image");
    let (status, body) = server.call(
        "POST",
        "/templates",
        Some(json!({
            "name": "disk",
            "kernel": test_guest(),
            "rootfs": image,
            "cmdline": TEST_GUEST_CMDLINE,
            "memory_mib": 32,
        })),
    );
    assert_eq!(status, 201, "{body}");
    let sandbox = server.create(json!({"template": "disk", "ttl_s": 120}));
    let id = sandbox["id"].as_str().expect("id");
    let (status, snap) = server.call("POST", &format!("/sandboxes/{id}/snapshots"), None);
    assert_eq!(status, 201, "{snap}\n{}", server.log());
    let snap_dir = PathBuf::from(snap["dir"].as_str().expect("dir"));
    assert_eq!(
        std::fs::metadata(snap_dir.join("rootfs.img"))
            .expect("rootfs copy")
            .len(),
        1 << 20
    );
    let restored = server.create(json!({"snapshot": snap["id"], "ttl_s": 120}));
    let dir = PathBuf::from(restored["dir"].as_str().expect("dir"));
    assert!(dir.join("rootfs.img").is_file());
    let (pid, _) = pid_of(&restored);
    let line = cmdline(pid);
    // The jailer's command line: the sandbox directory is the jail, seen as / by the VMM.
    let jail = format!(
        "--chroot-base {}",
        dir.parent().expect("sandboxes dir").display()
    );
    assert!(
        line.contains(&jail) && line.contains("--drive-override rootfs=/rootfs.img"),
        "{line}"
    );
    assert_eq!(vmm_state(&restored), "Running");
    // A restart leaves recorded snapshots and removes stray snapshot directories.
    let stray = snap_dir.with_file_name("snap-00000000000000aa");
    std::fs::create_dir(&stray).expect("stray dir");
    let mut server = server;
    server.kill9();
    server.spawn();
    assert!(snap_dir.join("vmstate").is_file());
    assert!(!stray.exists());
    assert_eq!(
        server.get(restored["id"].as_str().expect("id"))["state"],
        "running"
    );
}

#[test]
fn create_env_is_stored_and_merged_under_each_exec_env() {
    if !kvm_available() {
        return;
    }
    let (_agent, server, _) = agent_server();
    let sandbox = server.create(json!({
        "template": "guest", "ttl_s": 300,
        "env": {"ROLLBOX_A": "from-sandbox", "ROLLBOX_B": "from-sandbox"},
    }));
    let id = sandbox["id"].as_str().expect("id").to_string();
    assert_eq!(sandbox["env"]["ROLLBOX_A"], "from-sandbox", "{sandbox}");
    let result = exec(
        &server,
        &id,
        json!({"cmd": "echo $ROLLBOX_A $ROLLBOX_B", "env": {"ROLLBOX_B": "from-exec"}}),
    );
    assert_eq!(result["stdout"], "from-sandbox from-exec\n", "{result}");
    // Streaming execs get it too.
    let mut lines = exec_stream(&server, &id, json!({"cmd": "echo $ROLLBOX_A"}));
    assert_eq!(next_line(&mut lines)["type"], "started");
    let out = next_line(&mut lines);
    assert_eq!(out["data"], "from-sandbox\n", "{out}");
    // Bad env is a 400 naming it.
    let (status, body) = server.call(
        "POST",
        "/sandboxes",
        Some(json!({"template": "guest", "ttl_s": 30, "env": {"A=B": "x"}})),
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"].as_str().is_some_and(|e| e.contains("env")),
        "{body}"
    );
}

fn cli(server: &Server, args: &[&str]) -> String {
    let out = Command::new(rollbox_binary())
        .args(args)
        .arg("--socket")
        .arg(server.sock())
        .env("ROLLBOX_API_KEY", KEY)
        .output()
        .expect("run rollbox");
    assert!(
        out.status.success(),
        "rollbox {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

fn batch_ids(batch: &Value) -> Vec<String> {
    batch["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(|r| {
            assert!(r["error"].is_null(), "{r}");
            assert_eq!(r["sandbox"]["state"], "running", "{r}");
            r["sandbox"]["id"].as_str().expect("id").to_string()
        })
        .collect()
}

#[test]
fn batches_create_n_and_get_and_delete_by_ids_and_labels() {
    if !kvm_available() {
        return;
    }
    let scratch = tempfile::tempdir().expect("tempdir");
    let slow = slow_vmm(scratch.path(), "1");
    let server = Server::start(&[
        "--max-pending-creates",
        "4",
        // A shell-script stand-in for the VMM cannot run in a jail (no shell there).
        "--no-jailer",
        "--vmm",
        slow.to_str().expect("utf-8"),
    ]);
    server.add_guest_template("guest");
    let spec = json!({"count": 3, "template": "guest", "ttl_s": 120,
        "labels": {"run": "b1"}, "idempotency_key": "batch-1"});
    let (status, batch) = server.call("POST", "/sandboxes/batch", Some(spec.clone()));
    assert_eq!(status, 200, "{batch}\n{}", server.log());
    let made = batch_ids(&batch);
    assert_eq!(made.len(), 3);
    assert_eq!(
        batch["results"][2]["sandbox"]["idempotency_key"], "batch-1/2",
        "{batch}"
    );
    // A retried batch creates nothing twice.
    let (status, again) = server.call("POST", "/sandboxes/batch", Some(spec));
    assert_eq!(status, 200, "{again}");
    assert_eq!(batch_ids(&again), made);
    let (_, listed) = server.call("GET", "/sandboxes?label=run%3Db1", None);
    assert_eq!(ids(&listed), made);

    // Over the limit as a whole: 400 naming count. Over what is free now: 429, nothing made.
    let (status, body) = server.call(
        "POST",
        "/sandboxes/batch",
        Some(json!({"count": 5, "template": "guest", "ttl_s": 60})),
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"].as_str().is_some_and(|e| e.contains("count")),
        "{body}"
    );
    let (first, second) = std::thread::scope(|scope| {
        let server = &server;
        let first = scope.spawn(move || {
            let body =
                json!({"count": 3, "template": "guest", "ttl_s": 60, "labels": {"run": "b2"}});
            server.call("POST", "/sandboxes/batch", Some(body))
        });
        // The first batch holds its three places while its (slow) VMMs start.
        wait_for("the first batch in flight", Duration::from_secs(20), || {
            let (_, list) = server.call("GET", "/sandboxes?label=run%3Db2&state=creating", None);
            ids(&list).len() == 3
        });
        let body = json!({"count": 2, "template": "guest", "ttl_s": 60, "labels": {"run": "b3"}})
            .to_string();
        let second = server.raw("POST", "/sandboxes/batch", Some(KEY), Some(body.as_bytes()));
        (first.join().expect("thread"), second)
    });
    assert_eq!(first.0, 200, "{}", first.1);
    assert_eq!(batch_ids(&first.1).len(), 3);
    assert_eq!(second.status, 429, "{}", second.error_message());
    assert_eq!(second.header("retry-after"), Some("1"));
    let (_, none) = server.call("GET", "/sandboxes?label=run%3Db3&state=failed", None);
    assert!(ids(&none).is_empty(), "{none}");
    let (_, none) = server.call("GET", "/sandboxes?label=run%3Db3", None);
    assert!(ids(&none).is_empty(), "{none}");

    // Get by ids (any state), delete by ids, delete by label.
    let query = format!("ids={},{}", made[0], made[1]);
    let (status, got) = server.call("GET", &format!("/sandboxes?{query}"), None);
    assert_eq!(status, 200, "{got}");
    assert_eq!(ids(&got), made[..2]);
    let (status, deleted) = server.call("DELETE", &format!("/sandboxes?ids={}", made[0]), None);
    assert_eq!(status, 200, "{deleted}");
    assert_eq!(deleted["deleted"], json!([made[0]]));
    let (status, deleted) = server.call("DELETE", "/sandboxes?label=run%3Db1", None);
    assert_eq!(status, 200, "{deleted}");
    assert_eq!(deleted["deleted"], json!(made[1..]));
    let (_, got) = server.call("GET", &format!("/sandboxes?{query}"), None);
    let states: Vec<&Value> = got["sandboxes"]
        .as_array()
        .expect("sandboxes")
        .iter()
        .map(|s| &s["state"])
        .collect();
    assert_eq!(states, [&json!("deleted"), &json!("deleted")]);
    let (status, body) = server.call("DELETE", "/sandboxes", None);
    assert_eq!(status, 400, "{body}");

    // The CLI: create --count, rm --label.
    let out = cli(
        &server,
        &[
            "sandbox", "create", "guest", "--ttl", "60", "--count", "2", "--label", "run=cli",
        ],
    );
    assert_eq!(
        out.lines().filter(|l| l.contains("running")).count(),
        2,
        "{out}"
    );
    let out = cli(&server, &["sandbox", "rm", "--label", "run=cli"]);
    assert_eq!(
        out.lines().filter(|l| l.ends_with("removed")).count(),
        2,
        "{out}"
    );
    let (_, left) = server.call("GET", "/sandboxes?label=run%3Dcli", None);
    assert!(ids(&left).is_empty(), "{left}");
    let (_, b2) = server.call("DELETE", "/sandboxes?label=run%3Db2", None);
    assert_eq!(b2["deleted"].as_array().map(Vec::len), Some(3), "{b2}");
    assert!(server.vmms().is_empty(), "VMMs left after the deletes");
}

/// This host's cpu controller, as the daemon with state in `state` uses it.
fn host_cgroups(state: &Path) -> Option<cgroup::Cgroups> {
    cgroup::Cgroups::find(Path::new("/sys/fs/cgroup"), &cgroup::root_name(state)).ok()
}

#[test]
fn cpu_limit_puts_the_vmm_in_its_own_cgroup_with_the_quota() {
    if !kvm_available() {
        return;
    }
    let mut server = Server::start(&[]);
    server.add_guest_template("guest");
    let state = std::fs::canonicalize(server.state()).expect("state dir");
    let Some(groups) = host_cgroups(&state) else {
        // No cpu controller: the create must say so, never run without the limit.
        let (status, body) = server.call(
            "POST",
            "/sandboxes",
            Some(json!({"template": "guest", "ttl_s": 60, "cpu_limit": 0.5})),
        );
        assert_eq!(status, 503, "{body}");
        eprintln!("SKIPPED (partly): no cgroup cpu controller on this host");
        return;
    };
    let sandbox = server.create(json!({"template": "guest", "ttl_s": 120, "cpu_limit": 0.5}));
    assert_eq!(sandbox["cpu_limit"], 0.5, "{sandbox}");
    let id = sandbox["id"].as_str().expect("id").to_string();
    let (pid, start) = pid_of(&sandbox);
    let group = groups.path(&id);
    let read = |name: &str| {
        std::fs::read_to_string(group.join(name))
            .unwrap_or_else(|e| panic!("{}/{name}: {e}", group.display()))
    };
    match groups.version {
        cgroup::Version::V1 => {
            assert_eq!(read("cpu.cfs_quota_us").trim(), "50000");
            assert_eq!(read("cpu.cfs_period_us").trim(), "100000");
        }
        cgroup::Version::V2 => assert_eq!(read("cpu.max").trim(), "50000 100000"),
    }
    let procs = read("cgroup.procs");
    // The sandbox's pid is its jailer's, which stays outside; the jail (its PID 1, a child of
    // the jailer, and the VMM) is in the group.
    let children =
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    let jail_init = children
        .split_whitespace()
        .next()
        .expect("the jail's PID 1");
    assert!(
        procs.lines().any(|l| l.trim() == jail_init),
        "jail of pid {pid} not in {}: {procs:?}",
        group.display()
    );
    // A sandbox without a limit gets no group.
    let free = server.create(json!({"template": "guest", "ttl_s": 120}));
    assert!(!groups.path(free["id"].as_str().expect("id")).exists());
    let (status, _) = server.call("DELETE", &format!("/sandboxes/{id}"), None);
    assert_eq!(status, 204);
    assert!(!group.exists(), "{} survived DELETE", group.display());

    // A group whose sandbox's VMM died while the daemon was down is reaped at restart.
    let second = server.create(json!({"template": "guest", "ttl_s": 120, "cpu_limit": 1.5}));
    let second_id = second["id"].as_str().expect("id").to_string();
    assert!(groups.path(&second_id).exists());
    server.kill9();
    let (pid2, start2) = pid_of(&second);
    vm::kill(pid2, start2, Duration::from_secs(5));
    assert!(!vm::is_ours(pid2, start2));
    assert!(!vm::is_ours(pid, start), "the deleted VMM lives");
    server.spawn();
    assert!(
        !groups.path(&second_id).exists(),
        "orphaned cgroup survived a restart\n{}",
        server.log()
    );

    // Where no controller is writable, a create with cpu_limit is a 503 naming it.
    let empty = tempfile::tempdir().expect("tempdir");
    let nowhere = empty.path().to_str().expect("utf-8").to_string();
    let other = Server::start(&["--cgroup-fs", &nowhere]);
    other.add_guest_template("guest");
    let (status, body) = other.call(
        "POST",
        "/sandboxes",
        Some(json!({"template": "guest", "ttl_s": 60, "cpu_limit": 0.5})),
    );
    assert_eq!(status, 503, "{body}");
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("cpu_limit")),
        "{body}"
    );
    let (_, none) = other.call("GET", "/sandboxes?state=failed", None);
    assert!(ids(&none).is_empty(), "{none}");
}

fn usage(server: &Server, id: &str) -> Value {
    let (status, usage) = server.call("GET", &format!("/sandboxes/{id}/usage"), None);
    assert_eq!(status, 200, "{usage}");
    usage
}

/// The value of the one /metrics sample `name{...sandbox="id"...}`, or a gauge by its labels.
fn metric(text: &str, name: &str, label: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| {
            (l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
                && l.contains(label)
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[test]
fn usage_counts_running_seconds_not_paused_and_survives_a_restart() {
    if !kvm_available() {
        return;
    }
    let mut server = Server::start(&[]);
    server.add_guest_template("guest");
    let sandbox = server.create(json!({"template": "guest", "ttl_s": 300, "vcpus": 2}));
    let id = sandbox["id"].as_str().expect("id").to_string();
    std::thread::sleep(Duration::from_millis(2100));
    let first = usage(&server, &id);
    let ran = first["running_s"].as_u64().expect("running_s");
    assert!((3..=8).contains(&ran), "{first}");
    assert_eq!(first["vcpu_seconds"].as_u64(), Some(2 * ran), "{first}");
    assert_eq!(
        first["memory_mib_seconds"].as_u64(),
        Some(32 * ran),
        "{first}"
    );
    assert!(first["cpu_seconds"].as_f64().is_some(), "{first}");

    // Paused time does not count.
    let (status, _) = server.call("POST", &format!("/sandboxes/{id}/pause"), None);
    assert_eq!(status, 200);
    let paused = usage(&server, &id)["running_s"]
        .as_u64()
        .expect("running_s");
    std::thread::sleep(Duration::from_millis(2100));
    assert_eq!(usage(&server, &id)["running_s"].as_u64(), Some(paused));
    let (status, _) = server.call("POST", &format!("/sandboxes/{id}/resume"), None);
    assert_eq!(status, 200);

    // A restart loses nothing.
    server.kill9();
    server.spawn();
    let after = usage(&server, &id)["running_s"]
        .as_u64()
        .expect("running_s");
    assert!(after >= paused, "{after} < {paused}");

    // /metrics: per-sandbox counters and daemon gauges, in Prometheus text.
    let response = server.raw("GET", "/metrics", Some(KEY), None);
    assert_eq!(response.status, 200);
    assert!(response
        .header("content-type")
        .is_some_and(|t| t.starts_with("text/plain")));
    let text = String::from_utf8(response.body.clone()).expect("utf-8");
    let label = format!("sandbox=\"{id}\"");
    let vcpu_s = metric(&text, "rollbox_sandbox_vcpu_seconds_total", &label)
        .unwrap_or_else(|| panic!("no vcpu seconds for {id} in:\n{text}"));
    assert!(vcpu_s >= 2.0 * after as f64, "{text}");
    assert!(metric(&text, "rollbox_sandbox_memory_mib_seconds_total", &label).is_some());
    assert!(metric(&text, "rollbox_sandbox_cpu_seconds_total", &label).is_some());
    assert_eq!(
        metric(&text, "rollbox_sandboxes", "state=\"running\""),
        Some(1.0),
        "{text}"
    );
    assert!(
        metric(&text, "rollbox_creates_total", "").is_some(),
        "{text}"
    );
    assert!(
        metric(&text, "rollbox_creates_refused_total", "").is_some(),
        "{text}"
    );
    for line in text.lines().filter(|l| !l.is_empty()) {
        assert!(
            line.starts_with("# HELP ")
                || line.starts_with("# TYPE ")
                || line
                    .rsplit(' ')
                    .next()
                    .is_some_and(|v| v.parse::<f64>().is_ok()),
            "not a Prometheus line: {line:?}"
        );
    }

    // Ended: kept, frozen.
    let (status, _) = server.call("DELETE", &format!("/sandboxes/{id}"), None);
    assert_eq!(status, 204);
    let ended = usage(&server, &id);
    assert_eq!(ended["state"], "deleted");
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(usage(&server, &id)["running_s"], ended["running_s"]);
    assert!(
        ended["cpu_seconds"].as_f64().is_some_and(|c| c > 0.0),
        "{ended}"
    );
    let out = cli(&server, &["sandbox", "usage", &id]);
    assert!(out.contains("vcpu_seconds") && out.contains(&id), "{out}");
    let (status, _) = server.call("GET", "/sandboxes/sb-00000000000000aa/usage", None);
    assert_eq!(status, 404);
}

fn snapshot_ids(server: &Server, sandbox: &str) -> Vec<String> {
    let (status, list) = server.call("GET", &format!("/snapshots?sandbox={sandbox}"), None);
    assert_eq!(status, 200, "{list}");
    list["snapshots"]
        .as_array()
        .expect("snapshots")
        .iter()
        .map(|s| s["id"].as_str().expect("id").to_string())
        .collect()
}

fn take_snapshot(server: &Server, id: &str, body: Value) -> (String, PathBuf) {
    let (status, snap) = server.call("POST", &format!("/sandboxes/{id}/snapshots"), Some(body));
    assert_eq!(status, 201, "{snap}\n{}", server.log());
    (
        snap["id"].as_str().expect("id").to_string(),
        PathBuf::from(snap["dir"].as_str().expect("dir")),
    )
}

#[test]
fn snapshot_retention_keeps_the_newest_n_and_ttls_but_never_a_live_sandboxs_source() {
    if !kvm_available() {
        return;
    }
    let server = Server::start(&["--snapshot-retention", "2"]);
    server.add_guest_template("guest");
    let sandbox = server.create(json!({"template": "guest", "ttl_s": 300}));
    let id = sandbox["id"].as_str().expect("id").to_string();
    let (_s1, s1_dir) = take_snapshot(&server, &id, json!({}));
    let (s2, _) = take_snapshot(&server, &id, json!({}));
    let (s3, _) = take_snapshot(&server, &id, json!({}));
    assert_eq!(snapshot_ids(&server, &id), [s2.clone(), s3.clone()]);
    assert!(!s1_dir.exists(), "{} outlived retention", s1_dir.display());

    // s2 is the source of a live sandbox: kept past the newest two until that one ends.
    let restored = server.create(json!({"snapshot": s2, "ttl_s": 300}));
    let restored_id = restored["id"].as_str().expect("id").to_string();
    let (s4, _) = take_snapshot(&server, &id, json!({}));
    let (s5, _) = take_snapshot(&server, &id, json!({}));
    assert_eq!(
        snapshot_ids(&server, &id),
        [s2.clone(), s4.clone(), s5.clone()]
    );
    let (status, _) = server.call("DELETE", &format!("/sandboxes/{restored_id}"), None);
    assert_eq!(status, 204);
    wait_for("s2 to go once unused", Duration::from_secs(10), || {
        snapshot_ids(&server, &id) == [s4.clone(), s5.clone()]
    });

    // ttl_s: gone when it runs out, unless a live sandbox came from it.
    let other = server.create(json!({"template": "guest", "ttl_s": 300}));
    let other_id = other["id"].as_str().expect("id").to_string();
    let (short, short_dir) = take_snapshot(&server, &other_id, json!({"ttl_s": 1}));
    let (kept, _) = take_snapshot(&server, &other_id, json!({"ttl_s": 2}));
    let (status, got) = server.call("GET", &format!("/snapshots/{kept}"), None);
    assert_eq!(status, 200);
    assert!(got["expires_at_ms"].as_u64().is_some(), "{got}");
    let user = server.create(json!({"snapshot": kept, "ttl_s": 300}));
    wait_for(
        "the short snapshot to expire",
        Duration::from_secs(10),
        || snapshot_ids(&server, &other_id) == [kept.clone()],
    );
    // The row goes first, then the files (off the reaper's thread).
    wait_for(
        &format!("{short}'s files to go after it expired"),
        Duration::from_secs(10),
        || !short_dir.exists(),
    );
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(snapshot_ids(&server, &other_id), [kept]);
    let user_id = user["id"].as_str().expect("id");
    let (status, _) = server.call("DELETE", &format!("/sandboxes/{user_id}"), None);
    assert_eq!(status, 204);
    wait_for(
        "the kept snapshot to expire",
        Duration::from_secs(10),
        || snapshot_ids(&server, &other_id).is_empty(),
    );
}

#[test]
fn interactive_stdin_reaches_a_streaming_exec_until_closed() {
    if !kvm_available() {
        return;
    }
    let (_agent, server, id) = agent_server();
    let mut lines = exec_stream(&server, &id, json!({"cmd": ["cat"], "stdin_open": true}));
    let started = next_line(&mut lines);
    assert_eq!(started["type"], "started", "{started}");
    let pid = started["pid"].as_u64().expect("pid");
    let stdin = format!("/sandboxes/{id}/processes/{pid}/stdin");
    let mut echoed = String::new();
    for (body, want) in [
        (json!({"data": "hello\n"}), "hello\n"),
        (
            json!({"data": "AAECdGhlcmUK", "encoding": "base64"}),
            "\u{0}\u{1}\u{2}there\n",
        ),
    ] {
        let (status, reply) = server.call("POST", &stdin, Some(body));
        assert_eq!(status, 204, "{reply}");
        let target = echoed.len() + want.len();
        echoed.push_str(want);
        let mut got = String::new();
        while got.len() < want.len() {
            let line = next_line(&mut lines);
            assert_eq!(line["type"], "stdout", "{line}");
            assert_eq!(line["encoding"], "utf-8", "{line}");
            got.push_str(line["data"].as_str().expect("data"));
        }
        assert_eq!(got, want);
        assert_eq!(echoed.len(), target);
    }
    let (status, reply) = server.call("POST", &stdin, Some(json!({"close": true})));
    assert_eq!(status, 204, "{reply}");
    let exit = next_line(&mut lines);
    assert_eq!(
        (&exit["type"], &exit["exit_code"]),
        (&json!("exit"), &json!(0)),
        "{exit}"
    );
    // Gone now: 404. A process started without stdin_open: 409.
    let (status, _) = server.call("POST", &stdin, Some(json!({"data": "x"})));
    assert_eq!(status, 404);
    let mut lines = exec_stream(&server, &id, json!({"cmd": ["sleep", "30"]}));
    let pid = next_line(&mut lines)["pid"].as_u64().expect("pid");
    let (status, body) = server.call(
        "POST",
        &format!("/sandboxes/{id}/processes/{pid}/stdin"),
        Some(json!({"data": "x"})),
    );
    assert_eq!(status, 409, "{body}");
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("stdin_open")),
        "{body}"
    );
    let (status, _) = server.call(
        "POST",
        &format!("/sandboxes/{id}/processes/{pid}/signal"),
        Some(json!({"signal": "KILL"})),
    );
    assert_eq!(status, 204);
}

#[test]
fn templates_built_from_an_image_with_a_boot_snapshot() {
    if !kvm_available()
        || !images::root_or_skip("templates_built_from_an_image_with_a_boot_snapshot")
    {
        return;
    }
    let work = tempfile::tempdir().expect("tempdir");
    let archive = work.path().join("image.tar");
    images::standard_image().write_docker_archive(&archive, "rollbox-test/crafted:latest");
    let agent = HostAgent::start();
    let agent_sock = agent.sock.display().to_string();
    let cache = work.path().join("cache").display().to_string();
    let guest_agent = images::agent().display().to_string();
    let server = Server::start(&[
        "--test-agent-socket",
        &agent_sock,
        "--agent",
        &guest_agent,
        "--image-cache",
        &cache,
    ]);
    let templates_dir = std::fs::canonicalize(server.state())
        .expect("state dir")
        .join("templates");

    // A bad image leaves nothing: no template, no directory.
    let (status, body) = server.call(
        "POST",
        "/templates",
        Some(json!({
            "name": "broken",
            "kernel": test_guest(),
            "image": {"docker_archive": "/nonexistent/image.tar"},
        })),
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"].as_str().unwrap_or("").contains("image"),
        "{body}"
    );
    assert_eq!(server.call("GET", "/templates/broken", None).0, 404);
    assert!(!templates_dir.join("broken").exists());

    // Built from a `docker save` archive, booted once and snapshotted.
    let (status, template) = server.call(
        "POST",
        "/templates",
        Some(json!({
            "name": "img",
            "kernel": test_guest(),
            "cmdline": TEST_GUEST_CMDLINE,
            "memory_mib": 32,
            "image": {"docker_archive": archive, "reference": "rollbox-test/crafted:latest"},
            "boot_snapshot": true,
        })),
    );
    assert_eq!(status, 201, "{template}\n{}", server.log());
    let rootfs = PathBuf::from(template["rootfs"].as_str().expect("rootfs"));
    assert_eq!(rootfs, templates_dir.join("img/rootfs.ext4"));
    assert!(rootfs.is_file());
    let image = template["image"].as_str().expect("image");
    assert!(
        image.starts_with("rollbox-test/crafted:latest@sha256:"),
        "{image}"
    );
    let boot = template["boot_snapshot"]
        .as_str()
        .expect("boot_snapshot")
        .to_string();
    // The sandbox booted for it is gone.
    wait_for(
        "the boot sandbox's VMM to end",
        Duration::from_secs(20),
        || server.vmms().is_empty(),
    );
    let (_, booted) = server.call(
        "GET",
        &format!("/sandboxes?label={}%3Dimg", "rollbox.boot-snapshot-of"),
        None,
    );
    for s in booted["sandboxes"].as_array().expect("sandboxes") {
        assert_eq!(s["state"], "deleted", "{s}");
    }

    // Creates of the template's shape restore the boot snapshot; another shape boots.
    let restored = server.create(json!({"template": "img", "ttl_s": 300}));
    let (pid, _) = pid_of(&restored);
    assert!(cmdline(pid).contains("--restore"), "{}", cmdline(pid));
    let id = restored["id"].as_str().expect("id");
    let out = exec(&server, id, json!({"cmd": ["sh", "-c", "echo ok"]}));
    assert_eq!(out["stdout"], "ok\n", "{out}");
    let booted = server.create(json!({"template": "img", "ttl_s": 300, "memory_mib": 48}));
    let (pid, _) = pid_of(&booted);
    assert!(!cmdline(pid).contains("--restore"), "{}", cmdline(pid));
    assert!(cmdline(pid).contains("--drive"), "{}", cmdline(pid));

    // Reset goes back to the boot snapshot.
    let (status, reset) = server.call("POST", &format!("/sandboxes/{id}/reset"), Some(json!({})));
    assert_eq!(status, 200, "{reset}");
    let (pid, _) = pid_of(&reset);
    assert!(cmdline(pid).contains("--restore"), "{}", cmdline(pid));

    // The boot snapshot goes with its template only.
    let (status, body) = server.call("DELETE", &format!("/snapshots/{boot}"), None);
    assert_eq!(status, 409, "{body}");
    assert!(
        body["error"].as_str().unwrap_or("").contains("img"),
        "{body}"
    );
    let (status, body) = server.call("DELETE", "/templates/img", None);
    assert_eq!(status, 204, "{body}");
    assert_eq!(
        server.call("GET", &format!("/snapshots/{boot}"), None).0,
        404
    );
    assert!(!templates_dir.join("img").exists());
    // Its sandboxes keep running on their own copies.
    assert_eq!(server.get(id)["state"], "running");
}

/// The children of `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

fn uid_of(pid: u32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .expect("Uid line")
        .split_whitespace()
        .next()
        .expect("real uid")
        .to_string()
}

#[test]
fn sandboxes_run_jailed_by_default_and_directly_with_no_jailer() {
    if !kvm_available() {
        return;
    }
    let server = Server::start(&[]);
    server.add_guest_template("guest");
    let sandbox = server.create(json!({"template": "guest", "ttl_s": 120}));
    let (pid, _) = pid_of(&sandbox);
    assert!(cmdline(pid).contains("rollbox-jailer"), "{}", cmdline(pid));
    let init = *children_of(pid).first().expect("the jail's PID 1");
    let vmm = *children_of(init).first().expect("the jailed VMM");
    assert!(
        cmdline(vmm).starts_with("/rollbox-vmm "),
        "{}",
        cmdline(vmm)
    );
    assert_eq!(uid_of(vmm), "64000");
    // Its sockets are in the sandbox directory on the host, made by the jail's uid.
    let dir = PathBuf::from(sandbox["dir"].as_str().expect("dir"));
    let sock = std::fs::metadata(dir.join("api.sock")).expect("api.sock");
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&sock), 64000);
    // The daemon still reaches the VM through them (agent-free: pause and resume).
    let id = sandbox["id"].as_str().expect("id");
    let (status, body) = server.call("POST", &format!("/sandboxes/{id}/pause"), None);
    assert_eq!(status, 200, "{body}");
    let (status, body) = server.call("POST", &format!("/sandboxes/{id}/resume"), None);
    assert_eq!(status, 200, "{body}");

    let direct = Server::start(&["--no-jailer"]);
    direct.add_guest_template("guest");
    let sandbox = direct.create(json!({"template": "guest", "ttl_s": 120}));
    let (pid, _) = pid_of(&sandbox);
    assert!(cmdline(pid).contains("rollbox-vmm"), "{}", cmdline(pid));
    assert!(!cmdline(pid).contains("rollbox-jailer"), "{}", cmdline(pid));
    assert_eq!(uid_of(pid), "0");
}

/// `GET /sandboxes/{id}/ports/{port}` (an `Upgrade: tcp`) and `rollbox sandbox port-forward`
/// reach a guest TCP port through the agent; the host agent's 127.0.0.1 is this machine's, so
/// a listener here stands in for the guest's service.
#[test]
fn guest_ports_through_the_agent_by_upgrade_and_port_forward() {
    use std::io::{BufRead, Read, Write};
    if !kvm_available() {
        return;
    }
    let (_agent, server, id) = agent_server();
    let service = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = service.local_addr().expect("address").port();
    // Answers each connection with what it got, upper-cased, once its input ends.
    std::thread::spawn(move || {
        for connection in service.incoming() {
            let Ok(mut connection) = connection else {
                continue;
            };
            std::thread::spawn(move || {
                let mut got = Vec::new();
                if connection.read_to_end(&mut got).is_ok() {
                    let _ = connection.write_all(&got.to_ascii_uppercase());
                }
            });
        }
    });
    let auth = format!("Bearer {KEY}");
    let endpoint = Endpoint::Unix(server.sock());
    let path = format!("/sandboxes/{id}/ports/{port}");
    let mut guest = endpoint
        .upgrade(
            &path,
            &[("Authorization", &auth)],
            "tcp",
            Duration::from_secs(30),
        )
        .expect("upgrade request")
        .unwrap_or_else(|r| panic!("{} {}\n{}", r.status, r.error_message(), server.log()));
    guest.write_all(b"through the daemon").expect("send");
    guest.shutdown_write().expect("end of input");
    let mut answer = String::new();
    guest.read_to_string(&mut answer).expect("answer");
    assert_eq!(answer, "THROUGH THE DAEMON");

    // Without the upgrade headers it is a 400 saying what to send; a closed port is a 502.
    let (status, body) = server.call("GET", &path, None);
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap_or("")
            .contains("Upgrade: tcp"),
        "{body}"
    );
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let refusal = endpoint
        .upgrade(
            &format!("/sandboxes/{id}/ports/{closed}"),
            &[("Authorization", &auth)],
            "tcp",
            Duration::from_secs(30),
        )
        .expect("upgrade request")
        .expect_err("nothing listens");
    assert_eq!(refusal.status, 502, "{}", refusal.error_message());
    assert!(
        refusal
            .error_message()
            .contains(&format!("127.0.0.1:{closed}: Connection refused")),
        "{}",
        refusal.error_message()
    );

    // The CLI refuses a sandbox that is not there before it listens.
    let output = Command::new(rollbox_binary())
        .args(["sandbox", "port-forward", "--socket"])
        .arg(server.sock())
        .env("ROLLBOX_API_KEY", KEY)
        .args(["sb-0000000000000000", "80"])
        .output()
        .expect("rollbox sandbox port-forward");
    assert!(!output.status.success(), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("sb-0000000000000000"), "{stderr}");

    // The CLI serves the port on a host address it prints.
    let mut forward = Command::new(rollbox_binary())
        .args(["sandbox", "port-forward", "--socket"])
        .arg(server.sock())
        .env("ROLLBOX_API_KEY", KEY)
        .args([id.as_str(), &port.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("rollbox sandbox port-forward");
    let mut line = String::new();
    std::io::BufReader::new(forward.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read its address");
    let local = line
        .strip_prefix("forwarding ")
        .and_then(|rest| rest.split_whitespace().next())
        .map(str::to_string);
    let result = std::panic::catch_unwind(|| {
        let local = local.unwrap_or_else(|| panic!("port-forward printed {line:?}"));
        for round in 0..3 {
            let mut client = std::net::TcpStream::connect(&local).expect("connect");
            let text = format!("round {round} through the cli");
            client.write_all(text.as_bytes()).expect("send");
            client
                .shutdown(std::net::Shutdown::Write)
                .expect("end of input");
            let mut answer = String::new();
            client.read_to_string(&mut answer).expect("answer");
            assert_eq!(answer, text.to_uppercase());
        }
    });
    let _ = forward.kill();
    let _ = forward.wait();
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}

#[test]
fn templates_run_their_start_command_after_boot_and_wait_until_ready() {
    if !kvm_available() {
        return;
    }
    // The host agent runs the commands on this host: they mark files in a scratch directory.
    let agent = HostAgent::start();
    let agent_sock = agent.sock.display().to_string();
    let server = Server::start(&["--test-agent-socket", &agent_sock]);
    let work = tempfile::tempdir().expect("tempdir");
    let dir = work.path().display().to_string();
    let started = work.path().join("started");
    let want = work.path().join("want");
    let lines = || {
        std::fs::read_to_string(&started)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    // The start command marks itself a second late; the ready command waits for the mark the
    // test expects, so a template add or create that returns early sees too few lines.
    let start_cmd = format!("sleep 1; echo \"up $GREETING\" >> {dir}/started");
    let ready_cmd = format!("[ \"$(wc -l < {dir}/started)\" -ge \"$(cat {dir}/want)\" ]");
    std::fs::write(&want, "1").expect("want");
    let (status, template) = server.call(
        "POST",
        "/templates",
        Some(json!({
            "name": "svc",
            "kernel": test_guest(),
            "cmdline": TEST_GUEST_CMDLINE,
            "memory_mib": 32,
            "boot_snapshot": true,
            "start_cmd": start_cmd,
            "ready_cmd": ready_cmd,
            "ready_timeout_s": 60,
        })),
    );
    assert_eq!(status, 201, "{template}\n{}", server.log());
    assert_eq!(template["start_cmd"], start_cmd.as_str());
    assert_eq!(template["ready_timeout_s"], 60);
    assert!(template["boot_snapshot"].is_string(), "{template}");
    assert_eq!(lines(), ["up "], "the boot before the snapshot ran it once");

    // A restore of the boot snapshot does not run it again: the snapshot has it running.
    let restored = server.create(json!({"template": "svc", "ttl_s": 300}));
    assert!(cmdline(pid_of(&restored).0).contains("--restore"));
    assert_eq!(lines(), ["up "]);

    // A boot (another shape) runs it with the sandbox's env, and returns once it is ready.
    std::fs::write(&want, "2").expect("want");
    let booted = server.create(json!({
        "template": "svc", "ttl_s": 300, "memory_mib": 48, "env": {"GREETING": "hi"},
    }));
    assert!(!cmdline(pid_of(&booted).0).contains("--restore"));
    assert_eq!(lines(), ["up ", "up hi"]);

    // A ready command that never succeeds fails the template add within its timeout and
    // leaves nothing: no template, no snapshot, no VMM beyond the two above.
    let before = server.vmms().len();
    let asked = Instant::now();
    let (status, body) = server.call(
        "POST",
        "/templates",
        Some(json!({
            "name": "never",
            "kernel": test_guest(),
            "cmdline": TEST_GUEST_CMDLINE,
            "memory_mib": 32,
            "boot_snapshot": true,
            "start_cmd": "true",
            "ready_cmd": "echo not yet >&2; false",
            "ready_timeout_s": 2,
        })),
    );
    assert_eq!(status, 503, "{body}");
    let error = body["error"].as_str().unwrap_or("");
    assert!(
        error.contains("ready_cmd") && error.contains("within 2 s") && error.contains("not yet"),
        "{body}"
    );
    assert!(asked.elapsed() < Duration::from_secs(30));
    assert_eq!(server.call("GET", "/templates/never", None).0, 404);
    wait_for(
        "the failed boot's VMM to end",
        Duration::from_secs(20),
        || server.vmms().len() == before,
    );

    // The same failure on a create's boot: the create fails and its sandbox is failed.
    let (status, body) = server.call(
        "POST",
        "/templates",
        Some(json!({
            "name": "late",
            "kernel": test_guest(),
            "cmdline": TEST_GUEST_CMDLINE,
            "memory_mib": 32,
            "start_cmd": "true",
            "ready_cmd": "false",
            "ready_timeout_s": 1,
        })),
    );
    assert_eq!(status, 201, "{body}");
    let (status, body) = server.call(
        "POST",
        "/sandboxes",
        Some(json!({"template": "late", "ttl_s": 300})),
    );
    assert_eq!(status, 503, "{body}");
    wait_for(
        "the failed create's VMM to end",
        Duration::from_secs(20),
        || server.vmms().len() == before,
    );
    let (_, list) = server.call("GET", "/sandboxes?state=failed", None);
    let failed: Vec<&Value> = list["sandboxes"]
        .as_array()
        .expect("sandboxes")
        .iter()
        .filter(|s| s["template"] == "late")
        .collect();
    assert_eq!(failed.len(), 1, "{list}");
    assert!(
        failed[0]["end_reason"]
            .as_str()
            .unwrap_or("")
            .contains("ready_cmd"),
        "{list}"
    );
}

#[test]
fn deterministic_sandboxes_boot_restore_reset_and_fork_deterministically() {
    if !kvm_available() {
        return;
    }
    let (_agent, server, plain) = agent_server();
    let has_flag = |sandbox: &Value| cmdline(pid_of(sandbox).0).contains("--deterministic");
    assert!(!has_flag(&server.get(&plain)));
    let (plain_snap, _) = take_snapshot(&server, &plain, json!({}));

    // A deterministic boot: the VMM runs with --deterministic, and the sandbox says so.
    let det = server.create(json!({"template": "guest", "ttl_s": 300, "deterministic": true}));
    assert_eq!(det["deterministic"], true, "{det}");
    assert!(has_flag(&det), "{}", cmdline(pid_of(&det).0));
    let id = det["id"].as_str().expect("id").to_string();
    let (det_snap, _) = take_snapshot(&server, &id, json!({}));
    let (_, snapshot) = server.call("GET", &format!("/snapshots/{det_snap}"), None);
    assert_eq!(snapshot["deterministic"], true, "{snapshot}");

    // Its resets restore deterministically; a snapshot of another sandbox is refused by name.
    let (status, reset) = server.call(
        "POST",
        &format!("/sandboxes/{id}/reset"),
        Some(json!({"snapshot": det_snap})),
    );
    assert_eq!(status, 200, "{reset}\n{}", server.log());
    let line = cmdline(pid_of(&reset).0);
    assert!(
        line.contains("--restore") && line.contains("--deterministic"),
        "{line}"
    );
    let (status, body) = server.call(
        "POST",
        &format!("/sandboxes/{id}/reset"),
        Some(json!({"snapshot": plain_snap})),
    );
    assert_eq!(status, 400, "{body}");
    let error = body["error"].as_str().unwrap_or("");
    assert!(
        error.starts_with("deterministic:") && error.contains(&plain_snap),
        "{body}"
    );
    assert_eq!(
        server.get(&id)["state"],
        "running",
        "a refused reset leaves it running"
    );

    // Creates from snapshots: a deterministic one only of a deterministic snapshot.
    let (status, body) = server.call(
        "POST",
        "/sandboxes",
        Some(json!({"snapshot": plain_snap, "ttl_s": 300, "deterministic": true})),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body["error"]
        .as_str()
        .unwrap_or("")
        .starts_with("deterministic:"));
    let restored =
        server.create(json!({"snapshot": det_snap, "ttl_s": 300, "deterministic": true}));
    assert!(has_flag(&restored));
    let restored_plain = server.create(json!({"snapshot": det_snap, "ttl_s": 300}));
    assert!(!has_flag(&restored_plain));

    // A new sandbox from a snapshot is a clone of its VM: a new generation, unless it is
    // deterministic. A reset keeps the sandbox's identity.
    let new_generation = |sandbox: &Value| cmdline(pid_of(sandbox).0).contains("--new-generation");
    assert!(new_generation(&restored_plain));
    assert!(!new_generation(&restored) && !new_generation(&reset));
    let (status, plain_reset) = server.call(
        "POST",
        &format!("/sandboxes/{plain}/reset"),
        Some(json!({"snapshot": plain_snap})),
    );
    assert_eq!(status, 200, "{plain_reset}");
    assert!(!new_generation(&plain_reset) && !has_flag(&plain_reset));

    // Forks inherit it.
    let (status, forked) = server.call(
        "POST",
        &format!("/sandboxes/{id}/fork"),
        Some(json!({"count": 1})),
    );
    assert_eq!(status, 200, "{forked}\n{}", server.log());
    let clone = &forked["results"][0]["sandbox"];
    assert_eq!(clone["deterministic"], true, "{forked}");
    assert!(has_flag(clone));
}

#[test]
fn a_vmm_that_ends_on_its_own_leaves_its_status_and_log_in_the_end_reason() {
    if !kvm_available() {
        return;
    }
    // A VMM logs nothing on a clean run: a wrapper writes one line to vmm.log first.
    let scratch = tempfile::tempdir().expect("tempdir");
    let wrapper = vmm_wrapper(
        scratch.path(),
        "vmm-says-hello.sh",
        "echo 'wrapper: starting rollbox-vmm' >&2",
    );
    // A shell-script stand-in for the VMM cannot run in a jail (no shell there).
    let server = Server::start(&["--no-jailer", "--vmm", wrapper.to_str().expect("utf-8")]);
    server.add_guest_template("guest");
    let sandbox = server.create(json!({"template": "guest", "ttl_s": 300}));
    let id = sandbox["id"].as_str().expect("id");
    let (pid, _) = pid_of(&sandbox);
    let dir = PathBuf::from(sandbox["dir"].as_str().expect("dir"));
    // SAFETY: kill(2) on the sandbox's own VMM process.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) }, 0);
    let mut last = Value::Null;
    wait_for(
        &format!("{id} to be exited"),
        Duration::from_secs(20),
        || {
            last = server.get(id);
            last["state"] == "exited"
        },
    );
    let reason = last["end_reason"].as_str().unwrap_or_default();
    assert!(
        reason.starts_with("the VMM ended: signal: 9 (SIGKILL)"),
        "{last}"
    );
    assert!(
        reason.ends_with("; the end of its log: wrapper: starting rollbox-vmm"),
        "{reason}"
    );
    assert!(!dir.exists(), "{} outlived the sandbox", dir.display());
    let daemon_log = server.log();
    assert!(
        daemon_log.contains(&format!("sandbox {id}: {reason}")),
        "{daemon_log}"
    );
}
