//! `rollbox serve` end to end, sandboxes: create, get, list (labels, pages) and delete,
//! idempotent creates, TTLs and keepalive, `on_timeout: pause`, pause and resume, the jail, `cpu_limit` cgroups,
//! usage and /metrics across a restart, a VMM that ends on its own, and the console cap.
//! The real `rollbox` and `rollbox-vmm` binaries with the tier-2 test guest as the
//! template's kernel (tier 2: needs /dev/kvm); `rollbox_tests::daemon` starts the daemon.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use rollbox::daemon::client::Endpoint;
use rollbox::daemon::{cgroup, vm};
use rollbox_tests::daemon::{cli, cmdline, host_cgroups, ids, pid_of, wait_for, Server, KEY};
use rollbox_tests::{kvm_available, rlimit_of, rollbox_binary, root_mount_options, vmm_wrapper};
use serde_json::{json, Value};

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

/// Unix milliseconds now.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

#[test]
fn on_timeout_pause_pauses_at_the_ttl_and_a_resume_gives_its_ttl_again() {
    if !kvm_available() {
        return;
    }
    let server = Server::start(&[]);
    server.add_guest_template("guest");
    let sandbox = server.create(json!({"template": "guest", "ttl_s": 1, "on_timeout": "pause"}));
    let id = sandbox["id"].as_str().expect("id");
    assert_eq!(
        (
            &sandbox["on_timeout"],
            &sandbox["auto_resume"],
            &sandbox["ttl_s"]
        ),
        (&json!("pause"), &json!(false), &json!(1)),
        "{sandbox}"
    );
    let (pid, start) = pid_of(&sandbox);
    for round in ["created", "resumed"] {
        wait_for(
            &format!("the TTL to pause {id} ({round})"),
            Duration::from_secs(20),
            || server.get(id)["state"] == "paused",
        );
        // Paused by its TTL it is kept (30 days), its VMM alive.
        let paused = server.get(id);
        let left_ms = paused["expires_at_ms"]
            .as_u64()
            .expect("expiry")
            .saturating_sub(now_ms());
        assert!(left_ms > 29 * 86_400_000, "{paused}");
        assert!(vm::is_ours(pid, start), "{id}: the pause ended its VMM");
        let (status, resumed) = server.call("POST", &format!("/sandboxes/{id}/resume"), None);
        assert_eq!(resumed["state"], "running", "{status} {resumed}");
        // Resumed, it has its create TTL (1 s) again.
        let left_ms = resumed["expires_at_ms"]
            .as_u64()
            .expect("expiry")
            .saturating_sub(now_ms());
        assert!(left_ms <= 1000, "{resumed}");
    }
    for (body, field) in [
        (
            json!({"template": "guest", "ttl_s": 5, "on_timeout": "stop"}),
            "on_timeout",
        ),
        (
            json!({"template": "guest", "ttl_s": 5, "auto_resume": true}),
            "auto_resume",
        ),
    ] {
        let (status, error) = server.call("POST", "/sandboxes", Some(body));
        assert_eq!(status, 400, "{error}");
        assert!(error.to_string().contains(field), "{error}");
    }
    server.call("DELETE", &format!("/sandboxes/{id}"), None);
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
    // A delete answers before the kernel has removed the jail's groups (each rmdir waits for
    // an RCU grace period): they go right after.
    wait_for(
        "the deleted sandbox's cgroup to go",
        Duration::from_secs(10),
        || !group.exists(),
    );

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
    // Its largest file: its memory (no disk) plus 512 MiB; a root it cannot exec from or use
    // setuid files or devices in; no userfaultfd (this is no uffd restore).
    let memory = sandbox["memory_mib"].as_u64().expect("memory_mib");
    let fsize = ((memory << 20) + (512 << 20)).to_string();
    assert_eq!(rlimit_of(vmm, "Max file size"), (fsize.clone(), fsize));
    let options = root_mount_options(vmm);
    for want in ["nosuid", "nodev", "noexec"] {
        assert!(
            options.iter().any(|o| o == want),
            "{want} not in {options:?}"
        );
    }
    assert!(std::fs::metadata(format!("/proc/{vmm}/root/dev/kvm")).is_ok());
    assert!(std::fs::metadata(format!("/proc/{vmm}/root/dev/userfaultfd")).is_err());
    // Nothing in the state directory (state.db, the sandbox's files, the VMM's sockets and
    // console) is readable or writable by another uid.
    assert_private(&server.state());
    let state = std::fs::metadata(server.state()).expect("state dir");
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&state.permissions()) & 0o777,
        0o700
    );
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

#[test]
fn serve_console_max_bytes_caps_each_vmms_console_file() {
    if !kvm_available() {
        return;
    }
    let server = Server::start(&["--console-max-bytes", "4096"]);
    server.add_guest_template("guest");
    let sandbox = server.create(json!({"template": "guest", "ttl_s": 120}));
    let config = rollbox_tests::daemon::boot_config(&sandbox);
    assert_eq!(config["console-max-bytes"], 4096, "{config}");
    let (pid, _) = pid_of(&sandbox);
    wait_for("the guest's ready line", Duration::from_secs(30), || {
        rollbox_tests::daemon::console(&sandbox).contains("rollbox-test-guest: ready")
    });
    // rollbox-vmm took the config (it refuses a field it cannot apply): the sandbox runs.
    let (status, body) = server.call(
        "GET",
        &format!("/sandboxes/{}", sandbox["id"].as_str().expect("id")),
        None,
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["state"], "running", "{body} (vmm pid {pid})");
    // A cap under 1024 is refused at start-up, naming the flag.
    let refused = Command::new(rollbox_binary())
        .args(["serve", "--console-max-bytes", "100", "--help"])
        .output()
        .expect("rollbox");
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--console-max-bytes"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
}

/// Every file and directory under `dir` (itself too) gives its group and others no read or
/// write (a jailer's mount point may let the jail's uid through: search only).
fn assert_private(dir: &std::path::Path) {
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::symlink_metadata(dir).expect("stat");
    let mode = meta.mode() & 0o7777;
    assert_eq!(mode & 0o066, 0, "{} is mode {mode:04o}", dir.display());
    if meta.is_dir() {
        for entry in std::fs::read_dir(dir).expect("read_dir").flatten() {
            assert_private(&entry.path());
        }
    }
}

#[test]
fn serve_refuses_a_state_dir_another_uid_may_enter() {
    use std::os::unix::fs::PermissionsExt as _;
    let scratch = tempfile::tempdir().expect("tempdir");
    let state = scratch.path().join("state");
    std::fs::create_dir(&state).expect("mkdir");
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let log = scratch.path().join("serve.log");
    let mut serve = Command::new(rollbox_binary())
        .arg("serve")
        .arg("--socket")
        .arg(scratch.path().join("d.sock"))
        .arg("--state-dir")
        .arg(&state)
        .arg("--no-jailer")
        .env("ROLLBOX_API_KEY", KEY)
        .stdin(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("run rollbox serve");
    // It must end at once; one that serves is killed and the test fails.
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = serve.try_wait().expect("wait") {
            break Some(status);
        }
        if Instant::now() >= deadline {
            let _ = serve.kill();
            let _ = serve.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = std::fs::read_to_string(&log).unwrap_or_default();
    let status =
        status.unwrap_or_else(|| panic!("rollbox serve started on a 0755 state dir: {stderr}"));
    assert!(!status.success(), "{stderr}");
    let canonical = std::fs::canonicalize(&state).expect("canonical");
    assert!(
        stderr.contains(&format!(
            "state directory {}: mode 0755",
            canonical.display()
        )) && stderr.contains(&format!("chmod 700 {}", canonical.display())),
        "{stderr}"
    );
    assert!(!state.join("state.db").exists(), "it opened the state");
}
