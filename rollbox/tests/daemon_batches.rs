//! `rollbox serve` end to end, batches and admission: 429 with Retry-After over
//! `--max-pending-creates`, `kill -9` of the daemon mid-batch and a restart that loses and leaks
//! nothing, and batches created, got and deleted by ids and labels.
//! The real `rollbox` and `rollbox-vmm` binaries with the tier-2 test guest as the
//! template's kernel (tier 2: needs /dev/kvm); `rollbox_tests::daemon` starts the daemon.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use rollbox::daemon::client::{Endpoint, Response};
use rollbox::daemon::vm;
use rollbox_tests::daemon::{cli, ids, pid_of, slow_vmm, wait_for, Server, KEY};
use rollbox_tests::kvm_available;
use serde_json::{json, Value};

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
        // On a loaded machine no create may have finished yet: one must have, for the restart
        // to re-attach it (the workers keep others in flight).
        wait_for(
            "a sandbox to run before the kill",
            Duration::from_secs(60),
            || !ids(&server.call("GET", "/sandboxes?state=running", None).1).is_empty(),
        );
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
